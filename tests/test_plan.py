"""`llmserve plan`: the chapter's worked examples, MoE / MLA / sliding-window shapes, file readers, bad input."""

from __future__ import annotations

import json

import pytest

from llmserve.cli import main
from llmserve.plan.estimate import PlanInputs, Planner, weight_bits
from llmserve.plan.hardware import CATALOGUE, get_hardware
from llmserve.plan.models import PRESETS, from_hf_config, load_spec
from llmserve.plan.pricing import Price, price_tokens

GB = 1e9
H100, H200 = CATALOGUE["h100-sxm"], CATALOGUE["h200"]


def planner(model="Llama-3.1-70B", hardware=H100, **kw) -> Planner:
    return Planner(PlanInputs(spec=load_spec(model), hardware=hardware, **kw))


# ---- the chapter's worked examples ---------------------------------------------------------------------------
def test_llama70b_kv_per_token_and_per_request():
    p = planner()
    assert p.spec.kv_bytes_per_token(2) == 320 * 1024  # 2 x 80 layers x 8 KV heads x 128 x 2 bytes
    assert p.kv_per_request(4096) / GB == pytest.approx(1.3, abs=0.05)
    assert p.kv_per_request(8192) / GB == pytest.approx(2.7, abs=0.05)
    assert p.kv_per_request(128 * 1024) / GB == pytest.approx(43, abs=0.5)
    assert planner(kv_format="FP8").kv_per_request(8192) == p.kv_per_request(8192) / 2


def test_kv_handoff_for_a_10k_prompt():
    p = planner(prompt_len=10_000, link_gbps=400)
    d = p.plan()["disaggregation"]
    assert d["kv_bytes_for_prompt"] / GB == pytest.approx(3.3, abs=0.05)
    assert d["transfer_seconds"] * 1000 == pytest.approx(65, abs=1.5)


@pytest.mark.parametrize("fmt, gb", [("BF16", 140), ("FP8", 70), ("INT4", 35), ("NVFP4", 39), ("MXFP4", 37)])
def test_llama70b_weights_by_format(fmt, gb):
    # the chapter rounds to a nominal 70B; Llama-3.1-70B has 70.55B parameters
    assert planner(weight_format=fmt).weights_bytes() / GB == pytest.approx(gb, rel=0.025)


def test_llama70b_8k_batch16_fp4_total_and_fit():
    p = planner(weight_format="NVFP4", context=8192, batch=16).plan()["memory"]
    assert 83 <= p["total_bytes"] / GB <= 88
    assert p["kv_bytes_batch"] / GB == pytest.approx(43, abs=0.5)
    assert not p["fits"]  # just over one H100 80GB
    assert planner(weight_format="NVFP4", context=8192, batch=16, hardware=H200).plan()["memory"]["fits"]
    fp8_kv = planner(weight_format="NVFP4", kv_format="FP8", context=8192, batch=16).plan()["memory"]
    assert fp8_kv["fits"] and fp8_kv["kv_bytes_batch"] / GB == pytest.approx(21.5, abs=0.5)
    # "with room to grow the batch to roughly 13-14 at 8K" on one H100 with 4-bit weights
    assert planner(weight_format="NVFP4", context=8192).plan()["memory"]["max_batch_at_context"] in (13, 14)


def test_flops_per_token_and_single_stream_decode():
    p = planner()
    assert p.plan()["compute"]["flops_per_token_weights"] / 1e9 == pytest.approx(140, rel=0.01)
    single = planner(context=1, batch=1).plan()["compute"]
    assert single["decode_tokens_per_s_per_user"] == pytest.approx(24, rel=0.03)  # 140 GB / 3.35 TB/s
    assert single["decode_bound"] == "memory bandwidth"


def test_kv_never_sized_with_query_heads():
    # The classic mistake (64 query heads instead of 8 KV heads) gives 168 GB for 8K x batch 8: 8x too high.
    p = planner(context=8192, batch=8).plan()["memory"]
    assert p["kv_bytes_batch"] / GB == pytest.approx(21.5, abs=0.5)
    mha = from_hf_config({**PRESETS["Llama-3.1-70B"], "num_key_value_heads": 64}, "mha")
    assert mha.kv_bytes_per_token(2) == 8 * load_spec("Llama-3.1-70B").kv_bytes_per_token(2)
    no_kv_field = {k: v for k, v in PRESETS["Llama-3.1-70B"].items() if k != "num_key_value_heads"}
    assert from_hf_config(no_kv_field, "x").num_kv_heads == 64  # only a config without the field is MHA


# ---- other shapes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, total, active", [
    ("Llama-3.1-8B", 8.03, 7.50), ("Llama-3.1-405B", 405.9, 403.8), ("Qwen2.5-7B", 7.6, 7.1),
    ("Mixtral-8x7B", 46.7, 12.8), ("Qwen3-30B-A3B", 30.5, 3.0), ("Qwen3-235B-A22B", 235.1, 21.5),
    ("DeepSeek-V3", 671.0, 36.5), ("gpt-oss-120b", 116.8, 5.1),
])
def test_parameter_counts_match_published_sizes(name, total, active):
    spec = load_spec(name)
    assert spec.total_params / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.active_params / 1e9 == pytest.approx(active, rel=0.04)  # the input embedding is a lookup, not compute


def test_moe_memory_counts_all_experts_compute_only_active():
    p = planner("Mixtral-8x7B", weight_format="BF16", context=1).plan()
    assert p["memory"]["weights_bytes"] / GB == pytest.approx(93.4, rel=0.02)
    assert p["compute"]["flops_per_token_weights"] / 1e9 == pytest.approx(2 * 12.8, rel=0.03)
    one = planner("Mixtral-8x7B", batch=1, context=1)
    many = planner("Mixtral-8x7B", batch=64, context=1)
    assert one.weight_bytes_read_per_step(1) < 0.35 * one.weights_bytes()  # 2 of 8 experts + attention
    assert many.weight_bytes_read_per_step(64) == pytest.approx(many.weights_bytes(), rel=1e-3)  # every expert touched


def test_mla_kv_is_the_compressed_latent():
    spec = load_spec("DeepSeek-V3")
    assert spec.is_mla
    assert spec.kv_bytes_per_token(2) == 61 * (512 + 64) * 2  # 70,272 bytes, not 2 x 128 heads x 128
    assert planner("DeepSeek-V3", tensor_parallel=8).kv_share_per_device(8) == 1.0  # replicated, not split


def test_sliding_window_layers_stop_growing():
    spec = load_spec("gpt-oss-120b")
    assert (spec.sliding_window, spec.num_sliding_layers) == (128, 18)
    per_layer_token = 2 * 8 * 64 * 2
    assert spec.kv_bytes_per_request(131072, 2) == per_layer_token * (18 * 131072 + 18 * 128)
    assert planner("gpt-oss-120b").plan()["settings"]["weight_format"] == "BF16"
    assert planner("gpt-oss-120b", weight_format="MXFP4").weights_bytes() / GB == pytest.approx(116.8 * 4.25 / 8, rel=0.02)


def test_tensor_parallel_splits_weights_and_kv_heads():
    p = planner(weight_format="BF16", context=8192, batch=8)
    assert p.devices_needed() == 4  # 141 + 21.5 GB (+6%) over 80 GB devices
    assert p.per_device_bytes(2, 8) == pytest.approx(p.per_device_bytes(1, 8) / 2)
    assert p.kv_share_per_device(16) == 1 / 8  # 8 KV heads on 16 devices: each keeps a whole head


def test_gguf_and_hf_folder_read_the_same_numbers(default_gguf, default_files, tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**PRESETS["SmolLM2-135M"], "architectures": ["LlamaForCausalLM"]}))
    from_gguf, from_hf = load_spec(default_gguf), load_spec(str(folder))
    assert from_gguf.total_params == from_hf.total_params == default_files.config.num_parameters
    assert from_gguf.kv_bytes_per_token(2) == from_hf.kv_bytes_per_token(2) == 23_040
    assert from_gguf.file_weight_bytes == default_files.config.weight_file_bytes
    assert planner(default_gguf, hardware=H100).weights_bytes() == default_files.config.weight_file_bytes  # as stored
    assert weight_bits("Q4_1") == 5.0 and weight_bits("Q8_0") == 8.5


def test_kv_prediction_equals_the_engine_allocation(engine_f32, default_gguf):
    """The planner's KV bytes per token for the default model, against what llmserve actually allocates."""
    actual = engine_f32.executor.info.kv_cache_bytes / (engine_f32.kv.num_blocks * engine_f32.config.block_size)
    assert actual == load_spec(default_gguf).kv_bytes_per_token(4)  # fp32 engine, fp32 KV


def test_cost_and_break_even_are_consistent():
    p = planner("Llama-3.1-8B", batch=32, context=2048, gpu_hour_price=2.0, utilization=0.5).plan()
    c, k = p["compute"], p["cost"]
    assert k["output_per_million"] == pytest.approx(2.0 / 3600 * 1e6 / (c["decode_tokens_per_s_total"] * 0.5))
    for h in k["hosted"]:
        # at the break-even utilization, self-hosting a blend of r input + 1 output token costs what the API charges
        u, r = h["break_even_utilization"], k["input_per_output"]
        gpu_s = 1 / c["decode_tokens_per_s_total"] + r / c["prefill_tokens_per_s"]
        assert 2.0 / 3600 * gpu_s / u == pytest.approx((h["output"] + r * h["input"]) / 1e6)


def test_price_conventions():
    openai_style = Price(input=2.0, cached_input=0.2, output=10.0, convention="openai")
    anthropic_style = Price(input=2.0, cached_input=0.2, output=10.0, convention="anthropic")
    # OpenAI: 1,000 prompt tokens of which 800 cached; Anthropic: 200 uncached input + 800 cache reads.
    a = price_tokens(openai_style, 1000, 800, 100)
    b = price_tokens(anthropic_style, 200, 800, 100)
    assert a == b
    assert a.total == pytest.approx((200 * 2.0 + 800 * 0.2 + 100 * 10.0) / 1e6)
    assert price_tokens(Price(input=1.0, output=1.0), 1000, 800, 0).total == pytest.approx(1000 / 1e6)  # no cache discount


def test_this_cpu_is_measured():
    hw = get_hardware("cpu")
    from llmserve.platforms.cpu import cpu_has_fast_bf16

    assert hw.measured and 0.5e9 < hw.bandwidth_tbps * 1e12 < 1e12
    kind = "bf16" if cpu_has_fast_bf16() else "fp32"  # the dtype the engine serves here
    assert list(hw.tflops) == [kind] and hw.tflops[kind] > 0.001
    assert hw.peak_flops("Q4_1") == hw.peak_flops("FP8") == hw.tflops[kind] * 1e12


# ---- the command ---------------------------------------------------------------------------------------------------
def test_plan_command_table_and_json(capsys):
    assert main(["plan", "Llama-3.1-70B", "--weight-dtype", "NVFP4", "--batch", "16", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "320.0 KiB" in out and "does NOT fit" in out and "break-even utilization" in out
    assert main(["plan", "qwen3-30b-a3b", "--json", "--hardware", "H200"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["moe"] == "128 experts, 8 per token" and plan["settings"]["hardware"] == "H200"


@pytest.mark.parametrize("args, message", [
    (["Llama-9000"], "unknown model 'Llama-9000'"),
    (["Llama-3.1-8B", "--batch", "-1"], "batch must be at least 1, got -1"),
    (["Llama-3.1-8B", "--weight-dtype", "FP3"], "unknown weight format 'FP3'"),
    (["Llama-3.1-8B", "--kv-dtype", "INT2"], "unknown KV format 'INT2'"),
    (["Llama-3.1-8B", "--hardware", "TPU"], "unknown hardware 'TPU'"),
    (["Llama-3.1-8B", "--mfu", "2"], "mfu must be in (0, 1]"),
])
def test_bad_input_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_config_missing_fields_named(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 512, "num_attention_heads": 8, "vocab_size": 1000}))
    assert main(["plan", str(path)]) == 2
    assert "has no num_hidden_layers / n_layer / num_layers: the planner needs it" in capsys.readouterr().err
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 1000}))
    assert main(["plan", str(path)]) == 2
    assert "has no intermediate_size" in capsys.readouterr().err
    moe = {**PRESETS["Mixtral-8x7B"]}
    del moe["num_experts_per_tok"]
    path.write_text(json.dumps(moe))
    assert main(["plan", str(path)]) == 2
    assert "num_experts_per_tok" in capsys.readouterr().err
