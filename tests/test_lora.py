"""Multi-LoRA serving through the engine and the Python API: adapters mixed in one batch against peft's merged models,
the max_loras limit, prefix-cache isolation, the scheduler features, unloading, and every bad adapter."""

import json
import os
import shutil

import pytest
import torch

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from tests.helpers import LogitsRecorder, greedy, run_to_completion
from tests.lora_helpers import PHI3_TARGETS, make_adapter, tiny_base

pytest.importorskip("peft")


def _engine(folder, **kw):
    cfg = dict(model=str(folder), dtype="float32", num_kv_blocks=128, block_size=8, enable_lora=True, max_loras=2)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), skip_tokenizer=True)


def _prompts(n, seed=1, lengths=(5, 23, 11, 40, 17, 9)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _reference(model, prompt, generated):
    with torch.no_grad():
        return model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:].float()


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    base = tiny_base(root / "base", "llama")
    merged = {i: make_adapter(base, root / f"a{i}", seed=10 + i) for i in range(3)}
    requests = {i: LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")) for i in range(3)}
    return root, base, merged, requests


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_mixed_batch_matches_peft_merged_models(tmp_path, kind):
    """Two adapters and the base in the same steps: each request's float32 logits and greedy tokens equal peft's
    merged model (or the base) run alone. Phi-3's adapters target its fused q/k/v and gate/up modules."""
    base = tiny_base(tmp_path / "base", kind)
    targets = (PHI3_TARGETS, ["qkv_proj", "down_proj"]) if kind == "phi3" else (None, ["q_proj", "v_proj", "down_proj"])
    merged = [make_adapter(base, tmp_path / "a0", seed=3, **({"targets": targets[0]} if targets[0] else {})),
              make_adapter(base, tmp_path / "a1", seed=4, r=4, alpha=8, targets=targets[1])]
    loras = [LoRARequest("a0", 1, str(tmp_path / "a0")), LoRARequest("a1", 2, str(tmp_path / "a1")), None]
    engine = _engine(tmp_path / "base")
    prompts = _prompts(6)
    steps = []
    with LogitsRecorder(engine) as rec:
        engine.executor.runner.logits_observers.append(lambda ids, _: steps.append(set(ids)))
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, greedy(6, ignore_eos=True), lora_request=loras[i % 3])
        outs = run_to_completion(engine)
    assert max(len(s) for s in steps) == 6  # all six decoded together: adapters and base mixed in one step
    for i, p in enumerate(prompts):
        model = merged[i % 3] if i % 3 < 2 else base
        generated = outs[f"p{i}"].outputs[0].token_ids
        ref = _reference(model, p, generated)
        torch.testing.assert_close(torch.stack(rec.logits[f"p{i}"]), ref, atol=1e-4, rtol=1e-4)
        assert generated == ref.argmax(-1).tolist()
    # an adapter changes the output: the test would notice an adapter that was silently ignored
    assert not torch.allclose(_reference(merged[0], prompts[0], [0]), _reference(base, prompts[0], [0]), atol=1e-2)


def test_default_model_with_an_adapter_matches_peft(tmp_path, default_files, hf_gguf_model, hf_gguf_tokenizer):
    merged = make_adapter(hf_gguf_model, tmp_path / "smol", seed=5, r=8, alpha=8)
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="128MiB", enable_lora=True), files=default_files)
    adapter = LoRARequest("smol", 1, str(tmp_path / "smol"))
    prompts = [hf_gguf_tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):\n    "]]
    with LogitsRecorder(engine) as rec:
        engine.add_request("lora", prompts[0], greedy(6, ignore_eos=True), lora_request=adapter)
        engine.add_request("base", prompts[1], greedy(6, ignore_eos=True))
        outs = run_to_completion(engine)
    for rid, model, p in (("lora", merged, prompts[0]), ("base", hf_gguf_model, prompts[1])):
        generated = outs[rid].outputs[0].token_ids
        ref = _reference(model, p, generated)
        torch.testing.assert_close(torch.stack(rec.logits[rid]), ref, atol=2e-3, rtol=1e-3)
        assert generated == ref.argmax(-1).tolist()


def test_rank_and_alpha_patterns_and_rslora(tmp_path, llama_setup):
    """Per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern) and rsLoRA's alpha/sqrt(r) scale."""
    root, base, _, _ = llama_setup
    merged = make_adapter(base, tmp_path / "patterned", seed=6, r=8, alpha=16, rank_pattern={"q_proj": 4, "down_proj": 2},
                          alpha_pattern={"v_proj": 3, "up_proj": 40}, use_rslora=True)
    engine = _engine(root / "base")
    prompt = _prompts(1, seed=3)[0]
    with LogitsRecorder(engine) as rec:
        engine.add_request("r", prompt, greedy(5, ignore_eos=True),
                           lora_request=LoRARequest("patterned", 7, str(tmp_path / "patterned")))
        generated = run_to_completion(engine)["r"].outputs[0].token_ids
    ref = _reference(merged, prompt, generated)
    torch.testing.assert_close(torch.stack(rec.logits["r"]), ref, atol=1e-4, rtol=1e-4)
    assert generated == ref.argmax(-1).tolist()


def test_python_api_in_vllm_shape(llama_setup):
    root, base, merged, requests = llama_setup
    llm = LLM(model=str(root / "base"), dtype="float32", num_kv_blocks=128, block_size=8, enable_lora=True, max_loras=2)
    prompts = _prompts(3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False,
                        lora_request=requests[1])
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _reference(merged[1], p, out.outputs[0].token_ids).argmax(-1).tolist()
    per_prompt = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False,
                              lora_request=[requests[0], None, requests[1]])
    for p, out, model in zip(prompts, per_prompt, [merged[0], base, merged[1]]):
        assert out.outputs[0].token_ids == _reference(model, p, out.outputs[0].token_ids).argmax(-1).tolist()


def test_llm_constructor_takes_enable_lora(llama_setup):
    root, _, merged, requests = llama_setup
    llm = LLM(model=str(root / "base"), dtype="float32", num_kv_blocks=64, block_size=8, enable_lora=True,
              max_lora_rank=8)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                       lora_request=requests[2])[0]
    assert out.outputs[0].token_ids == _reference(merged[2], [1, 2, 3, 4], out.outputs[0].token_ids).argmax(-1).tolist()


def test_max_loras_limits_distinct_adapters_per_step(llama_setup):
    """Three adapters, two slots: no step runs more than two, and every request still gets its own adapter."""
    root, _, merged, requests = llama_setup
    engine = _engine(root / "base", max_loras=2)
    adapter_of = {}
    steps = []
    prompts = _prompts(6)
    with LogitsRecorder(engine) as rec:
        engine.executor.runner.logits_observers.append(lambda ids, _: steps.append({adapter_of[i] for i in ids}))
        for i, p in enumerate(prompts):
            adapter_of[f"p{i}"] = i % 3
            engine.add_request(f"p{i}", p, greedy(4, ignore_eos=True), lora_request=requests[i % 3])
        outs = run_to_completion(engine)
    assert max(len(s) for s in steps) == 2
    assert set().union(*steps) == {0, 1, 2}
    for i, p in enumerate(prompts):
        generated = outs[f"p{i}"].outputs[0].token_ids
        assert generated == _reference(merged[i % 3], p, generated).argmax(-1).tolist()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_never_crosses_adapters(llama_setup):
    root, base, merged, requests = llama_setup
    engine = _engine(root / "base")
    prompt = _prompts(1, seed=7, lengths=(40,))[0]

    def run(lora):
        engine.add_request("r", prompt, greedy(4, ignore_eos=True), lora_request=lora)
        return run_to_completion(engine)["r"]

    first = run(requests[0])
    again = run(requests[0])
    other = run(requests[1])
    plain = run(None)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # full blocks of 8, the last token recomputed
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for out, model in ((other, merged[1]), (plain, base)):
        generated = out.outputs[0].token_ids
        assert generated == _reference(model, prompt, generated).argmax(-1).tolist()


@pytest.mark.parametrize("variant", ["chunked", "preemption", "fp8_kv", "ngram_spec", "n2"])
def test_adapters_under_scheduler_features(llama_setup, variant):
    """Chunked prefill, preemption with recompute, an FP8 KV cache, speculative decoding and n > 1: each request in a
    mixed batch gives what it gives alone on the same engine settings."""
    root, _, _, requests = llama_setup
    kw = {"chunked": dict(max_num_batched_tokens=16), "preemption": dict(num_kv_blocks=12, max_num_batched_tokens=64),
          "fp8_kv": dict(kv_cache_dtype="fp8"), "ngram_spec": dict(speculative_method="ngram", num_speculative_tokens=3),
          "n2": {}}[variant]
    prompts = _prompts(6)
    repeat = [p[:6] * 3 for p in prompts] if variant == "ngram_spec" else prompts  # drafts find something to copy
    params = greedy(12, ignore_eos=True, n=2) if variant == "n2" else greedy(12, ignore_eos=True)
    loras = [requests[0], requests[1], None] * 2
    engine = _engine(root / "base", **kw)
    for i, p in enumerate(repeat):
        engine.add_request(f"p{i}", p, params, lora_request=loras[i])
    together = run_to_completion(engine)
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for i, p in enumerate(repeat):
        alone = _engine(root / "base", **kw)
        alone.add_request("x", p, params, lora_request=loras[i])
        expected = [o.token_ids for o in run_to_completion(alone)["x"].outputs]
        assert [o.token_ids for o in together[f"p{i}"].outputs] == expected


def test_unload_lets_running_requests_finish(llama_setup):
    root, _, merged, requests = llama_setup
    engine = _engine(root / "base")
    prompt = _prompts(1)[0]
    engine.add_request("r", prompt, greedy(8, ignore_eos=True), lora_request=requests[0])
    engine.step()
    engine.step()
    engine.remove_lora(requests[0].lora_int_id)
    assert engine.lora_users(requests[0].lora_int_id) == 1
    assert engine.executor.lora_ids() == [requests[0].lora_int_id]  # kept while the request runs
    out = run_to_completion(engine)["r"]
    generated = out.outputs[0].token_ids
    assert len(generated) == 8 and generated == _reference(merged[0], prompt, generated).argmax(-1).tolist()
    assert engine.lora_users(requests[0].lora_int_id) == 0
    assert engine.executor.lora_ids() == []  # dropped after the last one finished


def test_host_memory_lru_reads_evicted_adapters_again(llama_setup):
    """max_cpu_loras 1: each adapter pushes the other out of host memory; the folder is the source."""
    root, _, merged, requests = llama_setup
    engine = _engine(root / "base", max_loras=1, max_cpu_loras=1)
    prompt = _prompts(1)[0]
    for i in (0, 1, 0):
        engine.add_request("r", prompt, greedy(4, ignore_eos=True), lora_request=requests[i])
        assert engine.executor.lora_ids() == [requests[i].lora_int_id]
        generated = run_to_completion(engine)["r"].outputs[0].token_ids
        assert generated == _reference(merged[i], prompt, generated).argmax(-1).tolist()


def test_adapters_of_live_requests_stay_in_host_memory(llama_setup, tmp_path):
    """max_cpu_loras 1 with two adapters in flight: both stay in host memory while their requests live, so no step reads
    a folder again (deleting one after admission changes nothing); afterwards the cache shrinks back to one."""
    root, _, merged, requests = llama_setup
    shutil.copytree(root / "a0", tmp_path / "a0")
    first = LoRARequest("a0", 1, str(tmp_path / "a0"))
    engine = _engine(root / "base", max_loras=1, max_cpu_loras=1)
    prompt = _prompts(1)[0]
    engine.add_request("r0", prompt, greedy(6, ignore_eos=True), lora_request=first)
    engine.add_request("r1", prompt, greedy(6, ignore_eos=True), lora_request=requests[1])
    shutil.rmtree(tmp_path / "a0")
    assert sorted(engine.executor.lora_ids()) == [1, 2]
    outs = run_to_completion(engine)
    for rid, model in (("r0", merged[0]), ("r1", merged[1])):
        generated = outs[rid].outputs[0].token_ids
        assert generated == _reference(model, prompt, generated).argmax(-1).tolist()
    assert len(engine.executor.lora_ids()) == 1


def test_lora_needs_enabling(llama_setup):
    root, _, _, requests = llama_setup
    engine = _engine(root / "base", enable_lora=False)
    with pytest.raises(InvalidRequestError, match="not enabled"):
        engine.add_request("r", [1, 2, 3], greedy(2), lora_request=requests[0])
    assert not engine.has_unfinished_requests()


def test_config_limits():
    with pytest.raises(InvalidRequestError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidRequestError, match="max_loras"):
        EngineConfig(enable_lora=True, max_loras=0)
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


# ---- bad adapters: each refused with a message naming the field, nothing kept -----------------------------------------
def _copy_adapter(src, dst, config_changes=None):
    shutil.copytree(src, dst)
    if config_changes is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config_changes)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return str(dst)


def _bad_adapters(root, tmp):
    import peft  # noqa: F401
    from safetensors.torch import load_file, save_file

    good = str(root / "a0")
    cases = {}
    high = tmp / "rank32"
    make_adapter(tiny_base(tmp / "b", "llama"), high, seed=1, r=32)
    cases["rank"] = (str(high), "above --max-lora-rank 16", "r")
    wrong_target = tmp / "lm_head"
    make_adapter(tiny_base(tmp / "b2", "llama"), wrong_target, seed=1, targets=["q_proj", "lm_head"])
    cases["target"] = (str(wrong_target), "lm_head", "target_modules")
    other_shape = tmp / "wide"
    make_adapter(tiny_base(tmp / "b3", "llama", hidden_size=128), other_shape, seed=1)
    cases["shape"] = (str(other_shape), "do not fit the base model", "lora_path")
    deeper = tmp / "deeper"
    make_adapter(tiny_base(tmp / "b4", "llama", num_hidden_layers=4), deeper, seed=1)
    cases["architecture"] = (str(deeper), "different base model", "base_model_name_or_path")
    missing = _copy_adapter(good, tmp / "missing")
    os.remove(os.path.join(missing, "adapter_model.safetensors"))
    cases["missing"] = (missing, "has no adapter_model.safetensors", "lora_path")
    corrupt = _copy_adapter(good, tmp / "corrupt")
    path = os.path.join(corrupt, "adapter_model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    cases["corrupt"] = (corrupt, "cannot read adapter_model.safetensors", "lora_path")
    pickled = _copy_adapter(good, tmp / "pickled")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    cases["pickle"] = (pickled, "refusing to load adapter_model.bin", "lora_path")
    cases["dora"] = (_copy_adapter(good, tmp / "dora", {"use_dora": True}), "DoRA", "use_dora")
    cases["config"] = (_copy_adapter(good, tmp / "norank", {"r": "eight"}), "r must be a positive integer", "r")
    cases["task"] = (_copy_adapter(good, tmp / "seqcls", {"task_type": "SEQ_CLS"}), "SEQ_CLS", "task_type")
    cases["alpha_pattern"] = (_copy_adapter(good, tmp / "alphapat", {"alpha_pattern": {"q_proj": "big"}}),
                              "alpha_pattern must map module names to numbers", "alpha_pattern")
    cases["targets_type"] = (_copy_adapter(good, tmp / "targets", {"target_modules": [1, 2]}), "target module 1",
                             "target_modules")
    cases["not_a_folder"] = (str(tmp / "nowhere"), "does not exist", "lora_path")
    # one tensor with the wrong rank inside an otherwise fitting adapter
    mixed = _copy_adapter(good, tmp / "mixed")
    tensors = load_file(os.path.join(mixed, "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:4].contiguous()
    save_file(tensors, os.path.join(mixed, "adapter_model.safetensors"))
    cases["inner_shape"] = (mixed, "do not fit the base model", "lora_path")
    return cases


@pytest.fixture(scope="module")
def bad_adapters(llama_setup, tmp_path_factory):
    return _bad_adapters(llama_setup[0], tmp_path_factory.mktemp("bad_adapters"))


@pytest.mark.parametrize("case", ["rank", "target", "shape", "architecture", "missing", "corrupt", "pickle", "dora",
                                  "config", "task", "not_a_folder", "inner_shape", "alpha_pattern", "targets_type"])
def test_bad_adapter_is_refused_and_nothing_is_kept(llama_setup, bad_adapters, case):
    root, _, merged, requests = llama_setup
    path, message, param = bad_adapters[case]
    engine = _engine(root / "base")
    bad = LoRARequest("bad", 9, path)
    with pytest.raises(InvalidRequestError, match=message) as err:
        engine.add_request("r", [1, 2, 3], greedy(2), lora_request=bad)
    assert err.value.param == param
    assert not engine.has_unfinished_requests()
    # the engine goes on serving good adapters
    engine.add_request("ok", [1, 2, 3], greedy(3, ignore_eos=True), lora_request=requests[0])
    generated = run_to_completion(engine)["ok"].outputs[0].token_ids
    assert generated == _reference(merged[0], [1, 2, 3], generated).argmax(-1).tolist()


@pytest.mark.parametrize("lengths, slots, base_rows, batched", [
    ([4, 4, 4], [0, 1, 2], 3, True),  # decode rows, equal segments: batched over a view
    ([3, 4, 2, 4], [1, 2, 3, 4], 0, True),  # batched with padding
    ([2, 2, 3], [5, 0, 3], 2, True),  # batched over slots that are not a range
    ([40, 3, 1], [0, 1, 2], 5, False),  # a prompt beside decode rows: per segment
    ([7], [2], 4, False),  # one adapter
])
def test_lora_layer_layouts_agree_with_row_by_row(lengths, slots, base_rows, batched):
    """Every way the layer may add the low-rank term gives each row x A_s^T B_s of its own slot, and nothing to base
    rows."""
    from llmserve.layers.lora import LoRALayerWeights, LoRAStepState

    g = torch.Generator().manual_seed(0)
    state = LoRAStepState()
    layer = LoRALayerWeights(state, 6, 8, 16, 12, torch.float32, torch.device("cpu"))
    layer.a_t.copy_(torch.randn(layer.a_t.shape, generator=g))
    layer.b_t.copy_(torch.randn(layer.b_t.shape, generator=g))
    segments, row = [], base_rows
    for n, slot in zip(lengths, slots):
        segments.append((slot, row, row + n))
        row += n
    x, base = torch.randn(row, 16, generator=g), torch.randn(row, 12, generator=g)
    state.plan(segments, torch.device("cpu"))
    assert state.batched == batched
    out = layer.apply(x, base.clone())
    expected = base.clone()
    for slot, start, end in segments:
        for r in range(start, end):
            expected[r] += x[r] @ layer.a_t[slot] @ layer.b_t[slot]
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[:base_rows], base[:base_rows])


def test_compiled_engine_runs_adapter_steps_eagerly_and_base_steps_compiled(llama_setup):
    """With --compile the captured graphs are the base model's: a step with an adapter runs eagerly (and gets the
    adapter), a base-only step still runs compiled; tokens equal the eager engine's."""
    root, base, merged, requests = llama_setup
    results = {}
    for compile_ in (False, True):
        engine = _engine(root / "base", compile=compile_, max_num_seqs=4, device="cpu")
        for i, lora in enumerate([None, requests[0], requests[1]]):
            engine.add_request(f"r{i}", _prompts(1)[0], greedy(6, ignore_eos=True), lora_request=lora)
        outs = run_to_completion(engine)
        engine.step_stats.clear()
        engine.add_request("solo", _prompts(1)[0], greedy(6, ignore_eos=True))
        outs.update(run_to_completion(engine))
        results[compile_] = {rid: o.outputs[0].token_ids for rid, o in outs.items()}
        if compile_:
            assert any(p.compiled for s in engine.step_stats for p in s.forward_passes)
    assert results[True] == results[False]
    assert results[True]["r1"] != results[True]["r0"] != results[True]["r2"]
