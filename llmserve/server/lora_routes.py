"""Loading and unloading LoRA adapters at run time (vLLM's endpoints), when the operator allows it
(--allow-runtime-lora-updating). Behind the API key like every /v1 route; folders confined to --lora-dir."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from llmserve.lora.registry import LoRARegistry
from llmserve.server.async_engine import AsyncEngine
from llmserve.server.errors import APIError

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)


def install_lora_routes(app: FastAPI, engine: AsyncEngine, adapters: LoRARegistry, base_name: str, check_auth) -> None:
    lock = asyncio.Lock()  # one load or unload at a time: a name is checked and registered without a gap

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_auth)])
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        async with lock:
            if req.lora_name == base_name or adapters.get(req.lora_name) is not None:
                raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name",
                               code="lora_adapter_exists")
            path = adapters.confine(req.lora_path)  # before anything under it is opened
            adapter = adapters.new_request(req.lora_name, path)
            size = await asyncio.wrap_future(engine.call("add_lora", adapter))
            adapters.register(adapter)
        logger.info("LoRA adapter %s loaded from %s (%.1f MiB in host memory)", adapter.lora_name, path, size / 2**20)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_auth)])
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        async with lock:
            adapter = adapters.unregister(req.lora_name)  # new requests naming it get 404 from now on
            # running requests finish with it first; the engine drops it after the last
            await asyncio.wrap_future(engine.call("remove_lora", adapter.lora_int_id))
        logger.info("LoRA adapter %s unloaded", adapter.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
