"""LoRA adapters over one base model: requests (request.py), PEFT folders (adapter.py), the worker's host cache and
slots (manager.py) and the server's named adapters with their allowed folders (registry.py). The batched low-rank
term itself is a layer concern: layers/lora.py."""

from llmserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
