"""CUDA GPUs: bf16 by default, SDPA attention over the paged cache, float weights, page-locked host tiers."""

from __future__ import annotations

import torch

from llmserve.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    pin_host_memory = True

    def available_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free
