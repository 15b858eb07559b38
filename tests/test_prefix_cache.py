"""Prefix caching: same outputs on and off, tenant isolation, spill to host and disk, block invariants."""

from __future__ import annotations


import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.config import EngineConfig
from llmserve.engine.kv_cache import extra_keys_digest
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.sampling_params import SamplingParams
from tests.helpers import LogitsRecorder, greedy, run_to_completion, save_tiny_llama
from tests.server_fixtures import RunningServer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_prefix"), 96, seed=1)


def tiny_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), skip_tokenizer=True)


def drive(engine: LLMEngine, requests, abort_after: dict[str, int]):
    """Runs requests added in waves; a request in abort_after is aborted once it has that many tokens.
    Returns {id: (token ids, [logits rows])} and checks the block pool after every step."""
    tokens: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        for rid, n in abort_after.items():
            if len(tokens.get(rid, [])) >= n:
                engine.abort_request(rid)
        engine.kv.check_integrity()

    with LogitsRecorder(engine) as rec:
        for wave in requests:
            for rid, prompt, max_tokens in wave:
                engine.add_request(rid, prompt, greedy(max_tokens, ignore_eos=True))
            for _ in range(3):  # the next wave arrives while this one runs
                if engine.has_unfinished_requests():
                    step()
        while engine.has_unfinished_requests():
            step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.kv.block_tables
    return {rid: (tokens.get(rid, []), rec.logits.get(rid, [])) for wave in requests for rid, _, _ in wave}


prefixes = st.lists(st.lists(st.integers(3, 95), min_size=1, max_size=30), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefixes=prefixes, data=st.data(), blocks=st.integers(12, 40))
def test_outputs_identical_with_caching_on_and_off(tiny_model_dir, prefixes, data, blocks):
    waves, aborts, n = [], {}, 0
    for _ in range(data.draw(st.integers(1, 3), label="waves")):
        wave = []
        for _ in range(data.draw(st.integers(1, 4), label="requests")):
            prefix = data.draw(st.sampled_from(prefixes), label="prefix")
            suffix = data.draw(st.lists(st.integers(3, 95), max_size=6), label="suffix")
            wave.append((str(n), prefix + suffix, data.draw(st.integers(1, 8), label="max_tokens")))
            if data.draw(st.integers(0, 4), label="abort?") == 0:
                aborts[str(n)] = data.draw(st.integers(1, 4), label="abort after")
            n += 1
        waves.append(wave)
    on = drive(tiny_engine(tiny_model_dir, num_kv_blocks=blocks), waves, aborts)
    off = drive(tiny_engine(tiny_model_dir, num_kv_blocks=blocks, enable_prefix_caching=False), waves, aborts)
    for rid in on:
        (t_on, l_on), (t_off, l_off) = on[rid], off[rid]
        k = min(len(t_on), len(t_off)) if rid in aborts else len(t_off)
        assert t_on[:k] == t_off[:k], rid
        for a, b in zip(l_on[:k], l_off[:k]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_repeated_prompt_hits_and_reports_cached_tokens(make_engine, default_files):
    engine = make_engine()
    tok = default_files.tokenizer
    system = tok.encode("You are a careful assistant. " * 12)
    first = run_to_completion_one(engine, "a", system + tok.encode(" What is 2+2?"))
    second = run_to_completion_one(engine, "b", system + tok.encode(" Name a color."))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(system) // 16) * 16 > 0
    third = run_to_completion_one(engine, "c", system + tok.encode(" What is 2+2?"))  # whole prompt but the last token
    assert third.num_cached_tokens == ((len(first.prompt_token_ids) - 1) // 16) * 16
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    engine.kv.check_integrity()


def run_to_completion_one(engine, rid, ids, cache_salt=None, **kw):
    engine.add_request(rid, ids, greedy(8, **kw), cache_salt=cache_salt)
    return run_to_completion(engine)[rid]


def test_default_model_logits_identical_with_cache(make_engine, default_files):
    tok = default_files.tokenizer
    system = tok.encode("System: answer briefly and precisely, citing the manual. " * 6)
    prompts = [system + tok.encode(q) for q in (" How do I reset it?", " Where is the fuse?", " Is it waterproof?")]

    def run(engine):
        with LogitsRecorder(engine) as rec:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, greedy(6, ignore_eos=True))
                run_to_completion(engine)  # one after the other, so later ones can hit
        return rec.logits

    on = run(make_engine())
    off = run(make_engine(enable_prefix_caching=False))
    for rid in on:
        for a, b in zip(on[rid], off[rid]):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_salts_never_share_blocks_even_through_preemption(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=12, max_num_batched_tokens=64)
    handed_out = []  # (request's salt digest, salt digest of every block it got from the cache)
    lookup = engine.kv.get_computed_blocks

    def checked_lookup(request):
        hit = lookup(request)
        table = engine.kv.block_tables.get(request.request_id, [])[: hit // engine.kv.block_size]
        handed_out.extend((extra_keys_digest(request), engine.kv.block_keys[b][2]) for b in table)
        return hit

    engine.kv.get_computed_blocks = checked_lookup
    prompt = list(range(10, 30))  # 5 blocks
    assert run_to_completion_one(engine, "a", prompt, ignore_eos=True, cache_salt="tenant-a").num_cached_tokens == 0
    engine.add_request("b", prompt, greedy(4, ignore_eos=True), cache_salt="tenant-b")
    engine.add_request("b2", list(range(40, 64)), greedy(12, ignore_eos=True), cache_salt="tenant-b")  # forces preemption
    outs = run_to_completion(engine)
    assert outs["b"].num_cached_tokens == 0
    assert engine.scheduler.num_preemptions > 0
    assert run_to_completion_one(engine, "none", prompt, ignore_eos=True).num_cached_tokens == 0  # no salt: its own tenant
    assert handed_out  # the preempted request found its own blocks again on resuming
    assert all(mine == theirs for mine, theirs in handed_out)  # and every block ever handed out was its tenant's
    engine.kv.check_integrity()


def test_prompt_logprobs_requests_skip_the_cache(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    prompt = list(range(5, 25))
    run_to_completion_one(engine, "warm", prompt)
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    out = run_to_completion(engine)["scored"]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)


# ---- spill tiers ----------------------------------------------------------------------------------
def evict_all(engine, start: int, count: int = 4):
    for i in range(count):
        engine.add_request(f"filler-{start}-{i}", [(start * 13 + i * 7 + j) % 90 + 3 for j in range(24)], greedy(2, ignore_eos=True))
        run_to_completion(engine)


def spill_run(engine, prompt):
    with LogitsRecorder(engine) as rec:
        out = run_to_completion_one(engine, f"p{len(rec.logits)}-{id(rec)}", prompt, ignore_eos=True)
    return out, next(iter(rec.logits.values()))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_blocks_come_back_from_a_spill_tier(tiny_model_dir, tmp_path, tier):
    kw = {"kv_offload_memory": "1MiB"} if tier == "host" else {"kv_offload_dir": str(tmp_path / "kv")}
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, **kw)
    reference = tiny_engine(tiny_model_dir, num_kv_blocks=10, enable_prefix_caching=False)
    prompt = list(range(3, 23)) + [7]  # 5 full blocks + 1 token
    first, _ = spill_run(engine, prompt)
    evict_all(engine, 1)
    assert all(k is None or k[1] != tuple(prompt[:4]) for k in engine.kv.block_keys)  # gone from the pool
    again, logits = spill_run(engine, prompt)
    assert again.num_cached_tokens == 20
    assert engine.kv.stats.hits[tier] == 20
    ref, ref_logits = spill_run(reference, prompt)
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids == first.outputs[0].token_ids
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    engine.kv.check_integrity()


def test_corrupt_or_missing_disk_block_is_recomputed(tiny_model_dir, tmp_path):
    folder = tmp_path / "kv"
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, kv_offload_dir=str(folder))
    prompt = list(range(30, 50)) + [9]
    first, first_logits = spill_run(engine, prompt)
    evict_all(engine, 2)
    chain = [d.hex() for d, _ in engine.kv._chain(Request("x", prompt, greedy(1), []), 5)]
    first_block, third_block = folder / f"{chain[0]}.safetensors", folder / f"{chain[2]}.safetensors"
    assert first_block.exists() and third_block.exists()
    data = bytearray(first_block.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the tensor payload
    first_block.write_bytes(bytes(data))
    out, logits = spill_run(engine, prompt)
    assert out.num_cached_tokens == 0  # the chain breaks at its first block: everything recomputed
    assert not first_block.exists()  # the corrupt file is dropped
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    for a, b in zip(logits, first_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a file missing from the middle of a chain: the blocks before it still hit
    evict_all(engine, 3)
    third_block.unlink()
    out, _ = spill_run(engine, prompt)
    assert out.num_cached_tokens == 8
    engine.kv.check_integrity()


def test_disk_tier_survives_a_restart(tiny_model_dir, tmp_path):
    folder = str(tmp_path / "kv")
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, kv_offload_dir=folder)
    prompt = list(range(50, 70)) + [4]
    first, _ = spill_run(engine, prompt)
    evict_all(engine, 4)
    restarted = tiny_engine(tiny_model_dir, num_kv_blocks=10, kv_offload_dir=folder)
    out, _ = spill_run(restarted, prompt)
    assert out.num_cached_tokens == 20 and out.outputs[0].token_ids == first.outputs[0].token_ids


def test_disk_budget_is_kept(tiny_model_dir, tmp_path):
    folder = tmp_path / "kv"
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, kv_offload_dir=str(folder), kv_offload_disk="6KiB")
    for i in range(6):
        evict_all(engine, 10 + i, count=2)
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert 0 < total <= 6 * 1024
    assert engine.kv.offload.disk.stats.bytes == total


def test_bad_offload_settings():
    with pytest.raises(Exception, match="need prefix caching on"):
        EngineConfig(enable_prefix_caching=False, kv_offload_memory="1GiB")
    with pytest.raises(Exception, match="cannot read 'lots' as a size for kv_offload_memory"):
        EngineConfig(kv_offload_memory="lots")


# ---- the server: tenants, usage, metrics ------------------------------------------------------------
@pytest.fixture(scope="module")
def tenant_server(default_files):
    server = RunningServer(default_files, {}, {"api_key": ["key-a", "key-b"], "prefix_cache_salt_from": "api-key"})
    yield server
    server.stop()


SYSTEM = "You are the support assistant of a bicycle shop. Answer in one short sentence. " * 5


def ask(server, key, path="completions", **extra):
    body = {"model": "test-model", "max_tokens": 2, **extra}
    if path == "completions":
        body.setdefault("prompt", SYSTEM + "Do you fix brakes?")
    else:
        body.setdefault("messages", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you fix brakes?"}])
    r = httpx.post(f"{server.base_url}/v1/{path}" if path == "completions" else f"{server.base_url}/v1/chat/completions",
                   json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_tenants_do_not_share_cached_prefixes(tenant_server, path):
    assert ask(tenant_server, "key-a", path) == 0
    assert ask(tenant_server, "key-b", path) == 0  # same prompt, other tenant: nothing cached for it
    assert ask(tenant_server, "key-a", path) > 0
    assert ask(tenant_server, "key-b", path) > 0
    # a client-chosen cache_salt splits a tenant further, never joins another
    assert ask(tenant_server, "key-a", path, cache_salt="project-x") == 0
    tenant_server.wait_idle()


def test_tenant_isolation_with_n(tenant_server):
    prompt = "Rental desk rules: deposit first, helmets included, return by six. " * 5 + "Can I rent an e-bike?"
    assert ask(tenant_server, "key-a", prompt=prompt, n=2, temperature=1.0, seed=1) == 0
    assert ask(tenant_server, "key-b", prompt=prompt, n=2, temperature=1.0, seed=1) == 0
    assert ask(tenant_server, "key-b", prompt=prompt, n=2, temperature=1.0, seed=2) > 0
    tenant_server.wait_idle()


def test_header_tenants_and_missing_header(default_files):
    server = RunningServer(default_files, {}, {"prefix_cache_salt_from": "header:X-Tenant"})
    try:
        body = {"model": "test-model", "prompt": SYSTEM + "Open on Sunday?", "max_tokens": 1}

        def cached(tenant):
            r = httpx.post(server.base_url + "/v1/completions", json=body, headers={"X-Tenant": tenant}, timeout=60)
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("t1") == 0 and cached("t2") == 0 and cached("t1") > 0
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "X-Tenant header" in r.json()["error"]["message"]
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'llmserve:prefix_cache_hits_total{model_name="test-model",tier="device"}' in metrics
        assert "llmserve:prefix_cache_queries_total" in metrics
    finally:
        server.stop()


def test_bad_salt_source():
    from llmserve.server.app import ServerConfig

    with pytest.raises(Exception, match="must be api-key or header:NAME"):
        ServerConfig(served_model_name="m", prefix_cache_salt_from="cookie")
    with pytest.raises(Exception, match="needs --api-key"):
        ServerConfig(served_model_name="m", prefix_cache_salt_from="api-key")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_reset_prefix_cache_forgets_every_tier(tiny_model_dir, tmp_path, tier):
    """vLLM's LLM.reset_prefix_cache: nothing cached before it is found after it, the spill tiers' blocks included;
    while a running request holds cached blocks it answers False and they stay until freed."""
    kw = {"kv_offload_memory": "1MiB"} if tier == "host" else {"kv_offload_dir": str(tmp_path / "kv")}
    engine = tiny_engine(tiny_model_dir, num_kv_blocks=10, **kw)
    prompt, other = list(range(3, 23)) + [7], list(range(40, 60)) + [8]
    first, _ = spill_run(engine, prompt)
    spill_run(engine, other)
    evict_all(engine, 1)  # some of the blocks in the spill tier, some still in the pool
    spilled = list((tmp_path / "kv").glob("*.safetensors")) if tier == "disk" else engine.kv.offload.host.blocks
    assert spilled
    assert engine.reset_prefix_cache() is True
    if tier == "disk":
        assert not list((tmp_path / "kv").glob("*.safetensors"))  # the tier's files are deleted
    again, _ = spill_run(engine, prompt)
    assert again.num_cached_tokens == 0 and engine.kv.stats.hits[tier] == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # a request holding cached blocks keeps them: the answer says so
    engine.add_request("held", prompt, greedy(4, ignore_eos=True))
    engine.step()
    assert engine.reset_prefix_cache() is False
    run_to_completion(engine)
    assert engine.reset_prefix_cache() is True
    engine.kv.check_integrity()
