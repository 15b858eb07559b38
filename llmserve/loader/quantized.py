"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ, compressed-tensors and FP8, as config.json's
`quantization_config` (or an older AutoGPTQ/AutoAWQ folder's quantize_config.json / quant_config.json) names them.

A quantized linear layer's tensors (codes, scales, zero points, act-order indices) are gathered from the weight
stream and turned into the float weight they stand for, computed in float32: what the rest of the loader and the
model runner take from any checkpoint. Where a layer's codes are 4-bit on groups of whole 32-column blocks, in
input order, its scale and offset per 32 columns go along as `<layer>.weight_int4_scale` and
`<layer>.weight_int4_offset`, so that the CPU's int4 kernel holds the checkpoint's own codes instead of new ones
from the float weight (`--decode-quantization auto` picks it there, as it does for a GGUF Q4_1 file).

The checkpoint's activation quantization (W8A8, FP8's input scales) and KV scales are not applied: llmserve
multiplies the weights as stored against activations in the serving dtype.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from llmserve.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# vLLM's --quantization names for the same checkpoints read by faster kernels
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
GRID_PARAMS = ("weight_int4_scale", "weight_int4_offset")
GRID_COLUMNS = 32  # llmserve's int4 kernel: a scale and an offset per 32 input columns
# static activation and KV-cache scales: llmserve does not quantize activations, and picks its own KV dtype
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "weight_global_scale", "input_global_scale")
PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"),
    "fp8": ("weight_scale_inv", "weight_scale"),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs output columns k*8 + AWQ_ORDER[i] into nibble i


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # one of METHODS
    bits: int
    group_size: int  # -1: a group per output channel (the whole input)
    description: str  # as `llmserve info` shows it
    zero_offset: int = 0  # GPTQ's v1 format stores each zero point less one
    act_order: bool = False
    block_size: tuple[int, int] | None = None  # FP8's (rows, columns) per scale
    int4_codes: bool = False  # every 4-bit layer can bring its codes to the int4 kernel as they are

    def is_part(self, leaf: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor named <layer>.<leaf> belongs to a quantized layer (its weight included, when stored
        as 8-bit integers or FP8)."""
        import torch

        if leaf in PARTS[self.method] or leaf in DROPPED:
            return True
        return leaf == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

    def layer_weights(self, layer: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The float weight of one layer (and its int4 grid where there is one), from its quantized parts."""
        codes = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed", "fp8": "weight"}
        if not any(k in parts for k in ("qweight", "weight_packed", "weight")):
            if all(k in DROPPED for k in parts):
                return  # scales of activations or the KV cache only
            raise ModelLoadError(f"the checkpoint has {', '.join(sorted(parts))} for {layer} but not its quantized "
                                 f"weight ({codes[self.method]})", "model")
        read = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}[self.method]
        try:
            weight, grid = read(self, parts)
        except KeyError as e:
            raise ModelLoadError(f"the {self.method} checkpoint lacks {layer}.{e.args[0]}", "model") from e
        if grid is not None and not layer.endswith(("lm_head", "embed_tokens")):  # before the weight: a layer may
            yield f"{layer}.{GRID_PARAMS[0]}", grid[0]  # be quantized as soon as its weight is in
            yield f"{layer}.{GRID_PARAMS[1]}", grid[1]
        yield f"{layer}.weight", weight


def read_quantization(folder: str, cfg: dict, wanted: str | None = None) -> CheckpointQuantization | None:
    """The checkpoint's quantization, checked against --quantization (`wanted`, vLLM's flag: it must name what
    the checkpoint holds; vLLM's online quantization of a float checkpoint is not offered)."""
    q = cfg.get("quantization_config")
    for legacy in ("quantize_config.json", "quant_config.json"):  # AutoGPTQ's and AutoAWQ's own files
        path = os.path.join(folder, legacy)
        if not q and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                q = json.load(f)
            q.setdefault("quant_method", "gptq" if legacy == "quantize_config.json" else "awq")
    wanted = ALIASES.get(wanted, wanted)
    if not q:
        if wanted not in (None, "none"):
            raise ModelLoadError(f"--quantization {wanted}: {folder} is not a {wanted} checkpoint (it has no "
                                 "quantization_config); llmserve reads checkpoints quantized ahead of time, and on "
                                 "CPU --decode-quantization int4/int8 quantizes a float one at load", "quantization")
        return None
    method = str(q.get("quant_method", "")).lower()
    method = ALIASES.get(method, method)
    if method not in METHODS:
        raise ModelLoadError(f"{folder} is quantized with {method or 'an unnamed method'}, which llmserve does not "
                             f"read; it reads {', '.join(METHODS)} checkpoints (and GGUF files)", "quantization")
    if wanted not in (None, method):
        raise ModelLoadError(f"--quantization {wanted} does not match the checkpoint, which is {method} (its "
                             "quantization_config); drop the flag or name that method", "quantization")
    parse = {"gptq": _parse_gptq, "awq": _parse_awq, "compressed-tensors": _parse_compressed_tensors,
             "fp8": _parse_fp8}[method]
    return parse(q)


def dequantized_weights(stream: Iterable[tuple[str, torch.Tensor]],
                        quant: CheckpointQuantization) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every quantized layer's parts replaced by its float weight. Parts are gathered to the end
    (a layer's parts may sit in different shards); they are the checkpoint's compact form, so this holds at most
    the file's size, beside the float model being filled."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        layer, _, leaf = name.rpartition(".")
        if quant.is_part(leaf, tensor):
            parts.setdefault(layer, {})[leaf] = tensor
        else:
            yield name, tensor
    while parts:
        layer, layer_parts = parts.popitem()
        yield from quant.layer_weights(layer, layer_parts)


# ---- reading quantization_config ---------------------------------------------------------------------------
def _group_size(value, method: str) -> int:
    group = int(value if value is not None else -1)
    if group != -1 and group <= 0:
        raise ModelLoadError(f"{method} group_size must be positive or -1, got {value}", "quantization")
    return group


def _int4_grid_fits(bits: int, group: int) -> bool:
    return bits == 4 and (group == -1 or group % GRID_COLUMNS == 0)


def _parse_gptq(q: dict) -> CheckpointQuantization:
    bits = int(q.get("bits", 4))
    if bits not in (2, 4, 8):
        raise ModelLoadError(f"GPTQ with {bits}-bit weights is not read (2, 4 and 8 are)", "quantization")
    group = _group_size(q.get("group_size"), "GPTQ")
    act_order = bool(q.get("desc_act", False))
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint_format {fmt} is not read (gptq and gptq_v2 are)", "quantization")
    desc = f"GPTQ int{bits} ({'per channel' if group == -1 else f'group {group}'}{', act-order' if act_order else ''})"
    return CheckpointQuantization("gptq", bits, group, desc, zero_offset=1 if fmt == "gptq" else 0,
                                  act_order=act_order, int4_codes=_int4_grid_fits(bits, group) and not act_order)


def _parse_awq(q: dict) -> CheckpointQuantization:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not q.get("zero_point", True):
        raise ModelLoadError(f"AWQ is read in AutoAWQ's GEMM layout with 4-bit weights and zero points; this one is "
                             f"{bits}-bit, version {version}, zero_point {q.get('zero_point', True)}", "quantization")
    group = _group_size(q.get("group_size", q.get("q_group_size")), "AWQ")
    return CheckpointQuantization("awq", 4, group, f"AWQ int4 (group {group})",
                                  int4_codes=_int4_grid_fits(4, group))


def _parse_compressed_tensors(q: dict) -> CheckpointQuantization:
    groups = q.get("config_groups") or {}
    sparsity = (q.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise ModelLoadError(f"compressed-tensors sparsity ({sparsity}) is not read", "quantization")
    schemes, int4_codes, bits_seen = [], True, set()
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        w = group.get("weights")
        if not w:
            raise ModelLoadError(f"compressed-tensors group {name} quantizes no weights (activations only), which "
                                 "llmserve does not run", "quantization")
        kind, bits = w.get("type", "int"), int(w.get("num_bits", 8))
        if fmt not in CT_FORMATS or not ((kind == "int" and bits in (4, 8)) or (kind == "float" and bits == 8)):
            raise ModelLoadError(f"compressed-tensors {fmt} with {kind}{bits} weights is not read; llmserve reads "
                                 f"int4 and int8 ({', '.join(CT_FORMATS[:3])}) and fp8 (float-quantized)",
                                 "quantization")
        strategy = w.get("strategy", "tensor")
        group_size = int(w.get("group_size") or -1)
        detail = f"group {group_size}" if strategy == "group" else strategy
        if strategy == "block":
            detail = "block " + "x".join(map(str, w.get("block_structure") or []))
        if w.get("actorder"):
            detail += ", act-order"
        acts = " with quantized activations (not applied)" if group.get("input_activations") else ""
        schemes.append(f"{kind}{bits} ({detail}){acts}")
        bits_seen.add(bits)
        int4_codes &= kind == "int" and bits == 4 and not w.get("actorder") and (
            strategy == "channel" or (strategy == "group" and group_size % GRID_COLUMNS == 0))
    if not schemes:
        raise ModelLoadError("compressed-tensors quantization_config has no config_groups", "quantization")
    block = next((tuple(g["weights"]["block_structure"]) for g in groups.values()
                  if (g.get("weights") or {}).get("block_structure")), None)
    return CheckpointQuantization("compressed-tensors", max(bits_seen), -1,
                                  "compressed-tensors " + "; ".join(dict.fromkeys(schemes)), block_size=block,
                                  int4_codes=int4_codes)


def _parse_fp8(q: dict) -> CheckpointQuantization:
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelLoadError(f"FP8 checkpoints are read in e4m3; this one is {fmt}", "quantization")
    block = q.get("weight_block_size")
    desc = f"FP8 e4m3 ({'block ' + 'x'.join(map(str, block)) if block else 'per tensor or channel'})"
    return CheckpointQuantization("fp8", 8, -1, desc, block_size=tuple(block) if block else None)


# ---- reading the tensors -----------------------------------------------------------------------------------
def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers of `bits` bits packed into int32s along `dim`, value j of a word in its bits [j*bits, (j+1)*bits),
    as int32 codes (unsigned), that dim 32/bits times longer."""
    import torch

    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    packed = packed.to(torch.int32).movedim(dim, -1)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_word).movedim(-1, dim)


def _by_column(per_group: torch.Tensor, in_features: int, group: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """[out, groups] → [out, in_features]: each input column takes its group's value (g_idx: act-order's group per
    column; otherwise consecutive groups of `group` columns)."""
    import torch

    if g_idx is None:
        size = in_features if group == -1 else group
        g_idx = torch.arange(in_features) // size
    return per_group[:, g_idx.long()]


def _in_order(g_idx: torch.Tensor | None, in_features: int, group: int) -> bool:
    import torch

    if g_idx is None:
        return True
    size = in_features if group == -1 else group
    return bool(torch.equal(g_idx.long(), torch.arange(in_features) // size))


def _grid(scale: torch.Tensor, zero: torch.Tensor, in_features: int, group: int):
    """The int4 kernel's scale and offset per 32 input columns for codes q with weight scale * (q - zero), where
    that grid holds the weight exactly: groups of whole 32-column blocks, scales that are float16 numbers (the
    kernel's). Asymmetric zero points' offsets (-zero * scale) are rounded to float16 by the kernel."""
    import torch

    size = in_features if group == -1 else group
    if in_features % GRID_COLUMNS or size % GRID_COLUMNS:
        return None
    if not torch.equal(scale.half().float(), scale.float()):
        return None
    repeat = size // GRID_COLUMNS
    scale32 = scale.float().repeat_interleave(repeat, dim=1)
    return scale32, -zero.float().repeat_interleave(repeat, dim=1) * scale32


def _gptq(quant: CheckpointQuantization, parts: dict):
    """AutoGPTQ's layout: qweight [in*bits/32, out] packed along the input, qzeros [groups, out*bits/32] packed
    along the output (v1: each zero less one), scales [groups, out], g_idx [in] (act-order's group per column)."""
    bits = quant.bits
    codes = _unpack(parts["qweight"], bits, 0).T  # [out, in]
    out_features, in_features = codes.shape
    zeros = _unpack(parts["qzeros"], bits, 1)[:, :out_features].T + quant.zero_offset  # [out, groups]
    scales = parts["scales"].float().T
    g_idx = parts.get("g_idx") if quant.act_order else None
    weight = (codes - _by_column(zeros, in_features, quant.group_size, g_idx)) * _by_column(
        scales, in_features, quant.group_size, g_idx)
    grid = None
    if bits == 4 and _in_order(g_idx, in_features, quant.group_size):
        grid = _grid(scales, zeros, in_features, quant.group_size)
    return weight, grid


def _awq(quant: CheckpointQuantization, parts: dict):
    """AutoAWQ's GEMM layout: qweight [in, out/8] and qzeros [groups, out/8] packed along the output in AWQ_ORDER,
    scales [groups, out]; weight = (q - zero) * scale."""
    import torch

    def columns(packed):
        nibbles = _unpack(packed, 4, 1).view(packed.shape[0], -1, 8)
        order = torch.tensor(AWQ_ORDER)
        return torch.empty_like(nibbles).index_copy_(2, order, nibbles).view(packed.shape[0], -1)

    codes, zeros = columns(parts["qweight"]).T, columns(parts["qzeros"]).T  # [out, in], [out, groups]
    scales = parts["scales"].float().T
    in_features = codes.shape[1]
    weight = (codes - _by_column(zeros, in_features, quant.group_size, None)) * _by_column(
        scales, in_features, quant.group_size, None)
    return weight, _grid(scales, zeros, in_features, quant.group_size)


def _per_block(scale: torch.Tensor, shape, block) -> torch.Tensor:
    rows, cols = block
    return scale.float().repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def _compressed_tensors(quant: CheckpointQuantization, parts: dict):
    """compressed-tensors' formats: pack-quantized (weight_packed [out, in*bits/32] of signed codes offset by
    2**(bits-1), packed along the input; asymmetric zero points packed along the output), int-/naive-quantized
    (int8 weight) and float-quantized (FP8 weight); weight_scale per tensor, channel, group or block; weight =
    (q - zero) * scale."""
    import torch

    scale = parts["weight_scale"].float()
    if "weight_packed" in parts:
        out_features, in_features = (int(n) for n in parts["weight_shape"].tolist())
        packed = parts["weight_packed"]
        bits = packed.shape[1] * 32 // in_features
        if bits not in (4, 8) or packed.shape[1] * 32 != bits * in_features:
            raise ModelLoadError(f"compressed-tensors weight_packed of shape {tuple(packed.shape)} does not hold "
                                 f"4- or 8-bit codes for a weight of {in_features} input features", "model")
        offset = 1 << (bits - 1)
        codes = _unpack(packed, bits, 1)[:, :in_features] - offset
    else:
        weight = parts["weight"]
        out_features, in_features = weight.shape
        bits = 8
        codes = weight.float() if weight.dtype.is_floating_point else weight.to(torch.int32)
        offset = 1 << (bits - 1)
    zero = parts.get("weight_zero_point")
    if zero is not None and "weight_packed" in parts and zero.dtype == torch.int32 and zero.shape[0] < out_features:
        zero = _unpack(zero, bits, 0)[:out_features] - offset
    g_idx = parts.get("weight_g_idx")
    if scale.numel() == 1:  # per tensor
        scale_full = scale.reshape(1, 1).expand(out_features, in_features)
        zero_full = 0 if zero is None else zero.reshape(1, 1).float()
        group = None
    elif scale.shape[0] == out_features:  # per channel ([out, 1]) or group ([out, in/group])
        group = -1 if scale.shape[1] == 1 else math.ceil(in_features / scale.shape[1])
        scale_full = _by_column(scale, in_features, group, g_idx)
        zero_full = 0 if zero is None else _by_column(zero.float(), in_features, group, g_idx)
    else:  # blocks
        block = quant.block_size or (math.ceil(out_features / scale.shape[0]), math.ceil(in_features / scale.shape[1]))
        scale_full = _per_block(scale, (out_features, in_features), block)
        zero_full = 0 if zero is None else _per_block(zero, (out_features, in_features), block)
        group = None
    weight = (codes - zero_full) * scale_full
    grid = None
    if bits == 4 and group is not None and _in_order(g_idx, in_features, group):
        zero_group = torch.zeros_like(scale) if zero is None else zero.float()
        grid = _grid(scale, zero_group + offset, in_features, group)  # codes on the kernel's grid: q + offset
    return weight, grid


def _fp8(quant: CheckpointQuantization, parts: dict):
    """transformers' FP8 layout: an e4m3 weight and weight_scale_inv per block (weight_block_size; DeepSeek-V3's
    and Qwen3's FP8 releases), or weight_scale per tensor or channel; weight = w * scale."""
    weight = parts["weight"]
    scale = parts["weight_scale_inv"] if "weight_scale_inv" in parts else parts["weight_scale"]
    if scale.numel() == 1:
        return weight.float() * scale.float().reshape(()), None
    if scale.shape[0] == weight.shape[0] and scale.dim() == 2 and scale.shape[1] == 1:
        return weight.float() * scale.float(), None
    block = quant.block_size or (math.ceil(weight.shape[0] / scale.shape[0]), math.ceil(weight.shape[1] / scale.shape[1]))
    return weight.float() * _per_block(scale, weight.shape, block), None
