"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors, FP8) against transformers on the weights
they stand for.

compressed-tensors checkpoints are made by the compressed-tensors library itself, and the reference weights are its
own fake_quantize. GPTQ, AWQ and FP8 folders are written here in their published layouts (AutoGPTQ's, AutoAWQ's
GEMM, transformers' FP8), from known integer codes: the reference is transformers' float model holding
(code - zero) * scale."""

import json
import subprocess
import sys

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import LLMServeError
from tests.test_model_logits import assert_logits_match

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def float_model(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES)).eval()


def linear_layers(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}


def engine(path, **overrides):
    cfg = dict(model=str(path), dtype="float32", num_kv_blocks=64, block_size=8)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), skip_tokenizer=True)


def prompts(n=(5, 23, 40)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in n]


def int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits as the int32s a checkpoint stores (two's complement)."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Codes packed 32/bits to an int32 along dim, value j at bits [j*bits, (j+1)*bits); order: which of each run of
    32/bits codes goes to value j (AWQ's interleave)."""
    per = 32 // bits
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, per)
    if order is not None:
        c = c[..., list(order)]
    words = sum(c[..., j] << (bits * j) for j in range(per))
    return int32(words).movedim(-1, dim).contiguous()


def write_folder(path, model, tensors: dict, quantization_config: dict, config_file="config.json"):
    """The float model's other tensors, the quantized layers' `tensors`, and config.json (with the quantization
    config there, or in AutoGPTQ's quantize_config.json)."""
    quantized = {name.rsplit(".", 1)[0] for name in tensors}
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k.rsplit(".", 1)[0] not in quantized or not k.endswith(".weight")}
    safetensors_torch.save_file({**state, **tensors}, str(path / "model.safetensors"))
    cfg = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    if config_file == "config.json":
        cfg["quantization_config"] = quantization_config
    else:
        (path / config_file).write_text(json.dumps(quantization_config))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def quantize_gptq(model, bits, group, sym=True, act_order=False, v1=True, seed=2):
    """AutoGPTQ's layout from random codes: each layer's float weight becomes the one the codes stand for."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in linear_layers(model).items():
        out_f, in_f = layer.weight.shape
        size = in_f if group == -1 else group
        groups = in_f // size
        codes = torch.randint(0, 2**bits, (in_f, out_f), generator=g)
        zeros = (torch.full((groups, out_f), 2 ** (bits - 1)) if sym
                 else torch.randint(1, 2**bits, (groups, out_f), generator=g))
        scales = (torch.rand(groups, out_f, generator=g) * 0.02 + 0.005).half()
        g_idx = (torch.randperm(in_f, generator=g) if act_order else torch.arange(in_f)) // size
        weight = (codes - zeros[g_idx]) * scales.float()[g_idx]  # [in, out]
        layer.weight.data.copy_(weight.T)
        tensors[f"{name}.qweight"] = pack(codes, bits, 0)
        tensors[f"{name}.qzeros"] = pack((zeros - 1) & (2**bits - 1) if v1 else zeros, bits, 1)
        tensors[f"{name}.scales"] = scales
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    return tensors


def test_gptq_int4_runs_the_checkpoints_codes_exactly(tmp_path):
    model = float_model()
    tensors = quantize_gptq(model, 4, 128)
    write_folder(tmp_path, model, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                            "sym": True})
    eng = engine(tmp_path, device="cpu")  # decode_quantization auto: the CPU's int4 kernel, holding the file's codes
    assert eng.model_config.quantization == "GPTQ int4 (group 128)"
    methods = eng.executor.info.weights.methods
    assert sum(m.startswith("int4/") for m in methods.values()) == 2 * 4  # qkv, o, gate_up, down per layer
    assert methods["lm_head"].startswith("float")  # the checkpoint's float head stays float
    assert_logits_match(eng, model, prompts(), max_tokens=5, atol=1e-4)


@pytest.mark.parametrize("variant", ["asymmetric act-order v2", "int8 per channel, quantize_config.json"])
def test_gptq_variants_match_transformers(tmp_path, variant):
    model = float_model()
    if variant.startswith("asymmetric"):
        tensors = quantize_gptq(model, 4, 64, sym=False, act_order=True, v1=False)
        qc, config_file = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
                           "checkpoint_format": "gptq_v2"}, "config.json"
    else:
        tensors = quantize_gptq(model, 8, -1)
        qc, config_file = {"bits": 8, "group_size": -1, "desc_act": False, "sym": True}, "quantize_config.json"
    write_folder(tmp_path, model, tensors, qc, config_file)
    assert_logits_match(engine(tmp_path), model, prompts(), max_tokens=5, atol=1e-4)


def test_awq_matches_transformers(tmp_path):
    model = float_model()
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for name, layer in linear_layers(model).items():
        out_f, in_f = layer.weight.shape
        codes = torch.randint(0, 16, (in_f, out_f), generator=g)
        zeros = torch.randint(0, 16, (in_f // 64, out_f), generator=g)
        scales = (torch.rand(in_f // 64, out_f, generator=g) * 0.02 + 0.005).half()
        layer.weight.data.copy_(((codes - zeros.repeat_interleave(64, 0)) * scales.float().repeat_interleave(64, 0)).T)
        tensors[f"{name}.qweight"] = pack(codes, 4, 1, AWQ_ORDER)
        tensors[f"{name}.qzeros"] = pack(zeros, 4, 1, AWQ_ORDER)
        tensors[f"{name}.scales"] = scales
    write_folder(tmp_path, model, tensors, {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                            "zero_point": True})
    # float weights: exact; the int4 kernel (auto) holds the codes, with offsets (-zero * scale) rounded to float16
    assert_logits_match(engine(tmp_path, decode_quantization="none"), model, prompts(), max_tokens=5, atol=1e-4)
    assert_logits_match(engine(tmp_path, device="cpu"), model, prompts(), max_tokens=5, atol=2e-3)


def test_fp8_block_checkpoint_matches_transformers(tmp_path):
    model = float_model()
    g = torch.Generator().manual_seed(4)
    tensors = {}
    for name, layer in linear_layers(model).items():
        out_f, in_f = layer.weight.shape
        scale = torch.rand(out_f // 128, in_f // 128, generator=g) * 1e-3 + 1e-4
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        fp8 = (layer.weight.data / full).to(torch.float8_e4m3fn)
        layer.weight.data.copy_(fp8.float() * full)
        tensors[f"{name}.weight"] = fp8
        tensors[f"{name}.weight_scale_inv"] = scale
    write_folder(tmp_path, model, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]})
    eng = engine(tmp_path)
    assert eng.model_config.quantization == "FP8 e4m3 (block 128x128)"
    assert_logits_match(eng, model, prompts(), max_tokens=5, atol=1e-4)


def compressed_tensors_folder(path, scheme, fmt):
    """A checkpoint compressed by the compressed-tensors library (scales from each group's min and max, float16
    numbers), and the float model holding the library's own fake-quantized weights."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model, reference = float_model(), float_model()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"],
        quantization_status=QuantizationStatus.CALIBRATION))
    for name, layer in linear_layers(model).items():
        args, w = layer.quantization_scheme.weights, layer.weight.data
        if args.strategy == "group":
            grouped = w.view(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().view(1), w.amax().view(1)
        scale, zero = calculate_qparams(lo, hi, args)
        layer.weight_scale.data = scale.half().float().to(layer.weight_scale.dtype).view(layer.weight_scale.shape)
        if hasattr(layer, "weight_zero_point"):
            layer.weight_zero_point.data = zero.to(layer.weight_zero_point.dtype).view(layer.weight_zero_point.shape)
        reference.get_submodule(name).weight.data.copy_(
            fake_quantize(w, layer.weight_scale, getattr(layer, "weight_zero_point", None), args))
    compressor = ct.ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return reference


@pytest.mark.parametrize("scheme,fmt", [("W4A16", "pack-quantized"), ("W4A16_ASYM", "pack-quantized"),
                                        ("W8A8", "int-quantized"), ("FP8", "float-quantized")])
def test_compressed_tensors_checkpoints_match_transformers(tmp_path, scheme, fmt):
    reference = compressed_tensors_folder(tmp_path, scheme, fmt)
    exact_int4 = scheme == "W4A16"  # symmetric: the int4 kernel (auto) holds codes and scales exactly
    eng = engine(tmp_path, decode_quantization="auto" if exact_int4 else "none")
    assert eng.model_config.quantization.startswith("compressed-tensors ")
    assert_logits_match(eng, reference, prompts(), max_tokens=5, atol=1e-4)


def test_wrong_or_unreadable_quantization_is_refused_in_one_line(tmp_path):
    model = float_model()
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    write_folder(gptq, model, quantize_gptq(model, 4, 128), {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(LLMServeError, match="--quantization awq does not match the checkpoint, which is gptq"):
        engine(gptq, quantization="awq")
    engine(gptq, quantization="gptq_marlin", num_kv_blocks=8)  # vLLM's kernel name for the same checkpoint
    with pytest.raises(LLMServeError, match="quantization must be one of gptq, gptq_marlin, awq"):
        engine(gptq, quantization="int4")
    plain = tmp_path / "plain"
    float_model().save_pretrained(plain)
    with pytest.raises(LLMServeError, match="--quantization fp8: .* is not a fp8 checkpoint"):
        engine(plain, quantization="fp8")
    bnb = tmp_path / "bnb"
    bnb.mkdir()
    write_folder(bnb, model, {}, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(LLMServeError, match="quantized with bitsandbytes, which llmserve does not read"):
        engine(bnb)
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    tensors = {k: v for k, v in quantize_gptq(float_model(), 4, 128).items() if k != "model.layers.1.mlp.up_proj.qzeros"}
    write_folder(lacking, model, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(LLMServeError, match=r"the gptq checkpoint lacks model\.layers\.1\.mlp\.up_proj\.qzeros"):
        engine(lacking)
    # the CLI: one line, no traceback; info names the method
    cli = [sys.executable, "-m", "llmserve"]
    run = subprocess.run(cli + ["generate", "--model", str(bnb), "--device", "cpu", "hi"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "bitsandbytes, which llmserve does not read" in run.stderr.strip().splitlines()[-1]
    info = subprocess.run(cli + ["info", str(gptq), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "GPTQ int4 (group 128); on CPU its 4-bit codes run as they are" in info.stdout


def test_each_linear_layer_is_handed_over_once_whole(tmp_path):
    """The model reports each linear layer as soon as every part of it is loaded (the model runner quantizes it
    then, freeing its float32 weight before the next is read): once, with its weight and, from a 4-bit
    checkpoint, its grid."""
    from llmserve.layers.linear import LinearBase
    from llmserve.loader import load_model_files
    from llmserve.models import build_model

    model = float_model()
    write_folder(tmp_path, model, quantize_gptq(model, 4, 128), {"quant_method": "gptq", "bits": 4, "group_size": 128})
    files = load_model_files(str(tmp_path), load_tokenizer=False)
    ours = build_model(files.config)
    seen = []

    def handed_over(name, layer):
        assert not layer.weight.is_meta and (name == "lm_head" or layer.int4_grid() is not None)
        seen.append(name)

    ours.load_weights(files.weights(), on_layer_loaded=handed_over)
    assert sorted(seen) == sorted(n for n, m in ours.named_modules() if isinstance(m, LinearBase))
    assert len(seen) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the untied LM head
