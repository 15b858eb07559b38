"""What names an adapter in a request, in vLLM's shape: LoRARequest(lora_name, lora_int_id, lora_path)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` is the adapter's identity (>= 1): requests with the same id share its weights and its prefix-cache
    entries, so a different adapter must get a different id, even under a reused name."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not self.lora_name:
            raise InvalidRequestError("a LoRA adapter needs a name", "lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}", "lora_int_id")
        if not self.lora_path:
            raise InvalidRequestError("a LoRA adapter needs a path", "lora_path")
