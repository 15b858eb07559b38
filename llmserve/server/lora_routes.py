"""Loading and unloading LoRA adapters at run time (vLLM's endpoints), when the operator allows it
(--allow-runtime-lora-updating). Behind the API key like every /v1 route; folders confined to --lora-dir. With
several API-server processes, loaded through any of them, served by all (served_adapters.py)."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from llmserve.lora.registry import LoRAExistsError
from llmserve.server.served_adapters import ServedAdapters

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)


def install_lora_routes(app: FastAPI, adapters: ServedAdapters, base_names: list[str], check_auth) -> None:
    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_auth)])
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if req.lora_name in base_names:
            raise LoRAExistsError(req.lora_name)
        path = adapters.confine(req.lora_path)  # before anything under it is opened
        adapter, size = await adapters.load(req.lora_name, path)
        logger.info("LoRA adapter %s loaded from %s (%.1f MiB in host memory)", adapter.lora_name, path, size / 2**20)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_auth)])
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        adapter = await adapters.unload(req.lora_name)
        logger.info("LoRA adapter %s unloaded", adapter.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
