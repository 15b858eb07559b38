"""Platforms: what differs between devices (default dtype, attention backend, weight methods, compiled graphs, memory
sizing) lives in one module per device type. Nothing outside platforms/ and kernels/ tests a device type."""

from __future__ import annotations

import torch

from llmserve.errors import InvalidRequestError
from llmserve.platforms.interface import Platform


def resolve_device(spec: str) -> torch.device:
    """'auto' (CUDA when torch sees a GPU, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise InvalidRequestError(f"unknown device {spec!r}", "device") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda requested but torch sees no CUDA GPU", "device")
    return device


def get_platform(device_spec: str = "auto") -> Platform:
    device = resolve_device(device_spec)
    if device.type == "cpu":
        from llmserve.platforms.cpu import CpuPlatform

        return CpuPlatform(device)
    if device.type == "cuda":
        from llmserve.platforms.cuda import CudaPlatform

        return CudaPlatform(device)
    raise InvalidRequestError(f"device {device.type} is not supported (cpu or cuda)", "device")


__all__ = ["Platform", "get_platform", "resolve_device"]
