"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window, Gemma 2 and 3) and the Gemma family (1, 2 with
its attention soft-capping, 3's text models), against transformers on tiny random-weight checkpoints: every backend,
chunked prompts, prefix-cache hits, the deterministic mode, configs written before transformers listed layer types,
and what is refused."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import LLMServeError
from tests.helpers import assert_each_request_as_if_alone, random_prompts, save_randomized
from tests.test_model_logits import assert_logits_match

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
WINDOW = 8  # prompts below run to 70 tokens and 12 more are generated: most keys fall outside it


def save(path, kind: str):
    torch.manual_seed(0)
    if kind == "mistral":  # every layer windowed
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=WINDOW))
    elif kind == "ministral":  # the layers its config lists windowed (Ministral 8B interleaves them)
        model = transformers.MinistralForCausalLM(transformers.MinistralConfig(
            **TINY, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    elif kind == "olmo3":  # OLMo 3: OLMo 2's layers, windowed where its config lists; the full layers' rope scaled
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **TINY, pad_token_id=0, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}))
    elif kind == "qwen2":  # the layers from max_window_layers on windowed
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
    elif kind == "gemma":  # Gemma 1: no window; Gemma's norms, embedding scale and GELU MLP in Llama's layout
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**TINY, head_dim=16, hidden_act="gelu"))
    elif kind == "gemma2":  # every other layer windowed; scores capped at 1 (on these weights the cap matters)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TINY, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0))
    else:  # Gemma 3: windowed and full layers, each with its rope; the scale, soft-capping and norms it adds
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **TINY, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}))
    return save_randomized(model, path)


prompts = random_prompts


def engine(path, **kw):
    kw = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 8, "device": "cpu", **kw}
    return LLMEngine(EngineConfig(model=str(path), **kw), skip_tokenizer=True)


def edit_config(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("kind", ["mistral", "ministral", "olmo3", "qwen2", "gemma2", "gemma3"])
def test_windowed_checkpoints_match_transformers(tmp_path, kind, backend):
    model = save(tmp_path, kind)
    if kind in ("qwen2", "gemma2"):  # configs from before layer_types: the windowed layers follow from
        edit_config(tmp_path, lambda cfg: cfg.pop("layer_types"))  # max_window_layers (Qwen2), the alternation (Gemma 2)
    e = engine(tmp_path, attention_backend=backend)
    assert e.model_config.sliding_windows() == (WINDOW,)
    assert_logits_match(e, model, prompts(), max_tokens=12, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_gemma_1_matches_transformers(tmp_path, backend):
    model = save(tmp_path, "gemma")
    e = engine(tmp_path, attention_backend=backend)
    assert (e.model_config.architecture, e.model_config.sliding_windows()) == ("gemma", ())
    assert e.model_config.hidden_activation == "gelu_pytorch_tanh"  # Gemma 1's "gelu", as transformers reads it
    assert_logits_match(e, model, prompts(), max_tokens=8, atol=1e-4)


def test_gemma2_scores_are_capped(tmp_path):
    """The cap matters on this checkpoint: served without it, the logits are not transformers'."""
    model = save(tmp_path, "gemma2")
    with pytest.raises(AssertionError):
        assert_logits_match(engine(tmp_path, hf_overrides={"attn_logit_softcapping": None}), model, prompts()[:1],
                            max_tokens=2, atol=1e-4)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_windowed_model_on_the_triton_backend(tmp_path, kind):
    pytest.importorskip("triton")
    model = save(tmp_path, kind)
    assert_logits_match(engine(tmp_path, attention_backend="triton"), model, prompts()[1:], max_tokens=4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_chunked_prompts_and_prefix_cache_hits_keep_the_window(tmp_path, kind):
    model = save(tmp_path, kind)
    e = engine(tmp_path, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert_logits_match(e, model, prompts(), max_tokens=6, atol=1e-4)  # 70 tokens in chunks of at most 16
    assert_logits_match(e, model, prompts(), max_tokens=6, atol=1e-4)  # again: the prompts' blocks come from the cache


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_request_is_batch_invariant_in_deterministic_mode(tmp_path, kind):
    save(tmp_path, kind)
    e = engine(tmp_path, num_kv_blocks=128, deterministic=True)
    assert_each_request_as_if_alone(e, prompts())


def test_gemma3_configs_from_before_layer_types_read_the_same(tmp_path):
    """Google's Gemma 3 configs give the layer pattern as sliding_window_pattern and the ropes as rope_theta,
    rope_scaling and rope_local_base_freq."""
    model = save(tmp_path / "new", "gemma3")
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)

    def older(cfg):
        del cfg["layer_types"], cfg["rope_parameters"]
        cfg.update(sliding_window_pattern=2, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling={"rope_type": "linear", "factor": 4.0})

    edit_config(old, older)
    e = engine(old)
    assert e.model_config.layer_types == engine(tmp_path / "new").model_config.layer_types
    assert_logits_match(e, model, prompts(), max_tokens=4, atol=1e-4)


def test_olmo3_configs_with_rope_scaling_at_the_top_read_the_same(tmp_path):
    """OLMo 3's released configs give rope_theta and rope_scaling (YaRN in the 7B) at the top: the scaling is the full
    layers', the windowed layers rotate unscaled with the same base, as transformers reads them."""
    model = save(tmp_path, "olmo3")

    def older(cfg):
        del cfg["rope_parameters"]
        cfg.update(rope_theta=500_000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})

    edit_config(tmp_path, older)
    e = engine(tmp_path)
    assert (e.model_config.rope_scaling["factor"], e.model_config.rope_local_theta) == (4.0, 500_000.0)
    assert_logits_match(e, model, prompts(), max_tokens=4, atol=1e-4)


def test_what_is_not_supported_is_refused_in_one_line(tmp_path):
    save(tmp_path, "gemma3")
    with pytest.raises(LLMServeError, match="bidirectional attention .* is not supported"):
        engine(tmp_path, hf_overrides={"use_bidirectional_attention": True})
    cli = [sys.executable, "-m", "llmserve"]
    run = subprocess.run(cli + ["generate", "--model", str(tmp_path), "--device", "cpu", "--hf-overrides",
                                '{"use_bidirectional_attention": true}', "hi"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "bidirectional attention" in run.stderr.strip().splitlines()[-1]
    info = subprocess.run(cli + ["info", str(tmp_path), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "8 tokens, on 2 of 3 layers" in info.stdout and "gemma3" in info.stdout
    assert "soft-capping" in info.stdout and "logits 3" in info.stdout


def test_an_image_text_gemma3_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): its language model serves text, the same logits as
    transformers' language model on text; the vision tower is not read."""
    text = dict(TINY, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4))
    model = save_randomized(model, tmp_path)
    e = engine(tmp_path)
    assert e.model_config.architecture == "gemma3" and e.model_config.sliding_windows() == (WINDOW,)
    assert e.model_config.num_parameters == sum(p.numel() for n, p in model.named_parameters()
                                                 if "vision" not in n and "multi_modal" not in n)
    assert_logits_match(e, model, prompts(), max_tokens=4, atol=1e-4)
