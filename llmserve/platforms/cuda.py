"""CUDA GPUs: bf16 by default, SDPA attention over the paged cache, float weights, page-locked host tiers."""

from __future__ import annotations

import torch

from llmserve.errors import InvalidRequestError
from llmserve.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    pin_host_memory = True

    dist_backend = "nccl"

    def bind_rank(self, local_rank: int, local_size: int) -> None:
        if local_size > torch.cuda.device_count():
            raise InvalidRequestError(f"tensor-parallel size {local_size} on this machine needs as many GPUs; torch "
                                      f"sees {torch.cuda.device_count()}", "tensor_parallel_size")
        self.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(self.device)

    def available_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free
