"""Host values to the device without waiting for the device's queue.

A plain torch.tensor(..., device=cuda) (or .to(cuda)) copies and then synchronizes: the host stalls until every
kernel queued before it has run, the step in flight included. The sampler and the logits processors run while their
step's forward is still queued (async output processing and async scheduling overlap it), so their small per-step
tensors go through here. An asynchronous copy from ordinary (pageable) host memory is staged before the call
returns, so the host may reuse its values at once.
"""

from __future__ import annotations

import torch


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on `device`, copied without synchronizing."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
