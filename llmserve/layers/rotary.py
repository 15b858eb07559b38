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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if kind == "gguf_freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    if kind == "default":
        return inv_freq
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Qwen's long-context configs, DeepSeek, Ministral 3): frequencies that turn fewer than beta_slow times over
    the original context are divided by `factor` (interpolated), those that turn more than beta_fast times are kept
    (extrapolated), with a linear ramp between, over dimensions found from the original context length."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns this many times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling: dict | None) -> float:
    """What the cos and sin are multiplied by: the config's attention_factor, or for YaRN 0.1 ln(factor) + 1 (with
    DeepSeek's mscale and mscale_all_dim, their ratio), as transformers infers it."""
    scaling = scaling or {}
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding (Hugging Face layout) with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        """head_dim: the dimensions rotated (the first ones of each head where a model rotates only part of it:
        partial_rotary_factor); LongRoPE's attention_factor multiplies the cos and sin (transformers' scaling)."""
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        factor = attention_factor(scaling)
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


class LayerTypeRopes(nn.Module):
    """The rotations of a model whose windowed layers rotate with a base of their own, unscaled (Gemma 3, OLMo 3):
    the full-attention layers' rope (the config's theta and scaling) and, where local_theta is set, the windowed
    layers'. `tables` gives both for a step's positions (the same table twice where the model has one rope)."""

    def __init__(self, dim: int, max_position: int, theta: float, scaling: dict | None, local_theta: float | None):
        super().__init__()
        self.full = RotaryEmbedding(dim, max_position, theta, scaling)
        self.local = RotaryEmbedding(dim, max_position, local_theta) if local_theta is not None else None

    def tables(self, positions: torch.Tensor):
        full = self.full.table(positions)
        return full, (self.local.table(positions) if self.local is not None else full)
