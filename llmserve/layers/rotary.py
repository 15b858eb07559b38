import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelen > old_len / low, inv_freq / factor, torch.where(wavelen < old_len / high, inv_freq, blended))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        # Phi-3's LongRoPE: each frequency divided by its own factor. The short factors serve contexts up to the
        # original length (the loader caps the context there; the long ones would change every position's rotation
        # once a sequence grows past it)
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    if kind == "gguf_freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    if kind == "default":
        return inv_freq
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding (Hugging Face layout) with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        """head_dim: the dimensions rotated (the first ones of each head where a model rotates only part of it:
        partial_rotary_factor); LongRoPE's attention_factor multiplies the cos and sin (transformers' scaling)."""
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        factor = (scaling or {}).get("attention_factor", 1.0)
        self.register_buffer("cos", (freqs.cos() * factor).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).float(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for this batch's positions, [T, 1, D] each, looked up once per forward and
        shared by every layer. The sin row carries rotate-half's sign (-sin | sin), so a rotation is two
        multiplies and an add."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate [T, H, D] heads (queries and keys together, in one pass) in float32; returns x's dtype. A table
        narrower than the heads rotates their first dimensions and passes the rest (partial rotary)."""
        cos, sin = cos_sin
        if cos.shape[-1] != x.shape[-1]:
            d = cos.shape[-1]
            return torch.cat((RotaryEmbedding.apply(x[..., :d], cos_sin), x[..., d:]), dim=-1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)
