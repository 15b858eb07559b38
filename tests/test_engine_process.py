"""The engine in a process of its own (server/engine_process.py; `llmserve serve`'s default on CUDA, --engine-process):
the server's tests again against it, outputs equal to the engine's own, errors and failures across the process
boundary, and no engine process left behind."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParams
from llmserve.server.async_engine import EngineDeadError
from tests import test_server as served
from tests import test_structured_output as structured
from tests.server_fixtures import RunningServer, ServerProcess, free_port

MODEL = served.MODEL


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {}, engine_process=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


# The server's own tests, against this module's server: what a client sees does not depend on where the engine runs.
test_completion_with_usage = served.test_completion_with_usage
test_chat_stream_with_usage = served.test_chat_stream_with_usage
test_completion_stream_one_chunk_per_token = served.test_completion_stream_one_chunk_per_token
test_stop_strings = served.test_stop_strings
test_n_and_seed = served.test_n_and_seed
test_completion_logprobs_and_echo = served.test_completion_logprobs_and_echo
test_chat_logprobs = served.test_chat_logprobs
test_concurrent_streams_and_disconnect = served.test_concurrent_streams_and_disconnect
test_timeout_returns_partial_output = served.test_timeout_returns_partial_output
test_bad_completion_requests = served.test_bad_completion_requests
test_non_stream_disconnect_is_a_clean_abort = served.test_non_stream_disconnect_is_a_clean_abort
test_tokenize_detokenize_models_health = served.test_tokenize_detokenize_models_health
test_metrics_agree_with_requests = served.test_metrics_agree_with_requests
# Grammars cross the boundary uncompiled (the server compiles them only to refuse bad ones), and the engine process
# compiles them again off its loop (engine_loop.py).
test_choice_regex_and_grammars = structured.test_choice_regex_and_grammars
test_streamed_tool_calls_reassemble_to_the_whole = structured.test_streamed_tool_calls_reassemble_to_the_whole
test_bad_schemas_get_400_naming_the_field = structured.test_bad_schemas_get_400_naming_the_field


def test_outputs_equal_the_engines_own(server, engine_f32):
    """Concurrent greedy requests with logprobs, and seeded samples (n=2), streamed and not: the same tokens, text
    and logprobs as the engine gives in this process (CPU's default mode is batch-invariant)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, n=2, ignore_eos=True)
    want = {}
    for i, p in enumerate(prompts):
        for name, params in (("greedy", greedy), ("seeded", seeded)):
            engine_f32.add_request(f"ref-{name}-{i}", p, params)
    while engine_f32.has_unfinished_requests():
        for out in engine_f32.step():
            if out.finished:
                want[out.request_id] = out

    async def one(client, i, name, stream):
        body = {"model": MODEL, "prompt": prompts[i], "ignore_eos": True, "stream": stream}
        body.update({"max_tokens": 12, "temperature": 0, "logprobs": 2} if name == "greedy" else
                    {"max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7, "n": 2})
        if not stream:
            r = (await client.post("/v1/completions", json=body)).json()
            return {c["index"]: (c["text"], c["logprobs"] and c["logprobs"]["token_logprobs"]) for c in r["choices"]}
        texts, lps = {}, {}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                        if c.get("logprobs"):
                            lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
        return {k: (texts[k], lps.get(k)) for k in texts}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            jobs = [(i, name, stream) for i in range(len(prompts)) for name in ("greedy", "seeded") for stream in (False, True)]
            return jobs, await asyncio.gather(*[one(client, *job) for job in jobs])

    jobs, got = asyncio.run(main())
    for (i, name, stream), result in zip(jobs, got):
        ref = want[f"ref-{name}-{i}"]
        for c in ref.outputs:
            text, logprobs = result[c.index]
            assert text == c.text, (name, i, stream)
            if name == "greedy":
                assert logprobs == pytest.approx([lp[t] for lp, t in zip(c.logprobs, c.token_ids)], abs=1e-6)
    server.wait_idle()


def test_engine_errors_cross_the_process_boundary(server):
    """An error the engine raises for one request (the prompt needs more KV blocks than the cache has) is that
    request's 400; an engine call that fails raises in its caller; the engine goes on."""
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi " * 7000, "max_tokens": 4})
    assert r.status_code == 400
    assert "needs more KV blocks than the whole cache holds" in r.json()["error"]["message"]
    with pytest.raises(InvalidRequestError, match="LoRA adapters are not enabled"):
        server.engine.call("add_lora", LoRARequest("x", 1, "/nonexistent")).result(timeout=30)
    with pytest.raises(AttributeError):
        server.engine.call("no_such_method").result(timeout=30)
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()


def test_a_dead_engine_process_fails_streams_and_answers_503(default_files):
    s = RunningServer(default_files, {}, {}, engine_process=True)
    try:
        async def stream_until_killed():
            async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json={
                        "model": MODEL, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 3:
                                os.kill(s.engine.pid, signal.SIGKILL)
                    return lines

        lines = asyncio.run(stream_until_killed())
        assert any('"error"' in line for line in lines[3:]), lines[-3:]  # the stream ends with an error event
        assert "the engine process exited" in lines[-1] or "the engine process exited" in lines[-2], lines[-2:]
        r = httpx.post(s.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "the engine process exited" in r.json()["error"]["message"]  # why, not only that
        assert httpx.get(s.base_url + "/health").status_code == 503
        with pytest.raises(EngineDeadError):
            s.engine.call("stats")
    finally:
        s.stop()


def _engine_children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], timeout: float = 30) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_serve_leaves_no_engine_process(how, shallow_gguf):
    """`llmserve serve --engine-process` stopped (SIGTERM) or killed outright (SIGKILL): its engine process exits too."""
    server = ServerProcess("--model", shallow_gguf, "--no-webui", "--engine-process", "--kv-cache-memory", "64MiB")
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        children = _engine_children(server.proc.pid)
        assert any(c.name().startswith(("python", "llmserve")) for c in children), children
        server.proc.send_signal(getattr(signal, how))
        server.proc.wait(timeout=60)
        assert not _wait_gone(children)
    finally:
        server.stop()
    if how == "SIGTERM":
        assert "Traceback" not in server.output()


def test_a_load_error_in_the_engine_process_is_one_line(shallow_gguf):
    """What the engine process raises while loading (here: a KV cache too small for one block) is the CLI's one-line
    error, with no traceback and no process left behind."""
    r = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--model", shallow_gguf, "--engine-process",
                        "--kv-cache-memory", "1KiB",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "KV cache memory 1024 bytes holds no block" in errors[0], r.stderr


def test_tiny_checkpoint_on_the_default_device(tmp_path):
    """The engine process on whatever device this machine has (on a GPU machine: CUDA started in a spawned process,
    Triton attention, CUDA graphs), in the batch-invariant mode so that the comparison is bit for bit: what the
    client streams adds up to what the engine gives in this process, for greedy, seeded and n=2 requests; a request
    closed early is aborted there and its blocks come back."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.server.engine_process import EngineProcessClient
    from tests.helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", 512, seed=9)
    cfg = dict(model=str(folder), dtype="float32", deterministic=True, num_kv_blocks=64, block_size=16, max_num_seqs=8,
               max_num_batched_tokens=64)
    rng = __import__("random").Random(5)
    work = [([rng.randrange(3, 512) for _ in range(rng.randrange(3, 40))],
             SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, n=2 if i == 4 else 1, logprobs=1, ignore_eos=True,
                            max_tokens=rng.randrange(4, 30))) for i in range(10)]
    reference = LLMEngine(EngineConfig(**cfg), skip_tokenizer=True)
    want = {}
    for i, (prompt, params) in enumerate(work):
        reference.add_request(f"r{i}", prompt, params)
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                want[out.request_id] = out

    client = EngineProcessClient(EngineConfig(**cfg))
    try:
        async def one(i, prompt, params):
            final, streamed = None, {}
            async for out in client.generate(f"r{i}", prompt, params):
                final = out
                for c in out.outputs:
                    streamed.setdefault(c.index, []).extend(c.delta_token_ids)
            return final, streamed

        async def closed_early():
            agen = client.generate("long", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
            async for _ in agen:
                break
            await agen.aclose()

        async def main():
            return await asyncio.gather(closed_early(), *[one(i, p, params) for i, (p, params) in enumerate(work)])

        _, *got = asyncio.run(main())
        for i, (final, streamed) in enumerate(got):
            ref = want[f"r{i}"]
            assert final.finished and len(final.outputs) == len(ref.outputs)
            for c, r in zip(final.outputs, ref.outputs):
                assert list(c.token_ids) == list(r.token_ids) == streamed[c.index], i
                assert list(c.logprobs) == list(r.logprobs) and c.finish_reason == r.finish_reason, i
            assert final.prompt_token_ids == work[i][0]
        deadline = time.time() + 30
        while time.time() < deadline:
            stats = client.call("stats").result(timeout=30)
            if not stats.num_running and stats.num_free_blocks == stats.num_blocks:
                break
            time.sleep(0.05)
        assert not stats.num_running and stats.num_free_blocks == stats.num_blocks
    finally:
        client.shutdown()
    assert not psutil.pid_exists(client.pid) or psutil.Process(client.pid).status() == psutil.STATUS_ZOMBIE


@contextlib.contextmanager
def shared_engine_process(cfg, count: int):
    """One engine process with `count` clients attached, as --api-server-count starts them (api_servers.py); stopped
    through its control pipe at the end, which it must obey with exit code 0."""
    from llmserve.server.engine_process import EngineProcessClient, start_engine_process

    process, conns, control = start_engine_process(cfg, count, control=True)
    clients = []
    try:
        clients = [EngineProcessClient(cfg, connection=conn) for conn in conns]
        yield clients
    finally:
        for c in clients:
            c.shutdown()
        control.send(("stop",))
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


def test_one_engine_process_serves_several_clients(tmp_path):
    """One engine process behind several server processes (--api-server-count, api_servers.py), through its public
    pieces: two clients' requests interleave in one engine, each client gets exactly its own requests' outputs (equal
    to the engine run in this process, bit for bit in the batch-invariant mode), and a client that leaves has its
    running requests aborted and their blocks freed. On the default device (CUDA in benchmarks/gpu_suite.sh)."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from tests.helpers import save_tiny_llama

    # room for a request far too long to finish during the test, so that only an abort can free its blocks
    folder = save_tiny_llama(tmp_path / "tiny", 512, seed=3, max_positions=20_000)
    cfg = EngineConfig(model=str(folder), dtype="float32", deterministic=True, num_kv_blocks=1300, block_size=16,
                       max_num_seqs=8, max_num_batched_tokens=64)
    work = {f"r{i}": ([3 + i, 40 + i, 7, 99 - i], SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=6 + i,
                                                                 ignore_eos=True, logprobs=1)) for i in range(6)}
    reference = LLMEngine(cfg, skip_tokenizer=True)
    want = {}
    for rid, (prompt, params) in work.items():
        reference.add_request(rid, prompt, params)
    while reference.has_unfinished_requests():
        want.update({o.request_id: o for o in reference.step() if o.finished})

    with shared_engine_process(cfg, 2) as clients:
        async def one(client, rid):
            final = None
            async for out in client.generate(rid, *work[rid]):
                assert out.request_id == rid
                final = out
            return rid, final

        async def both():
            held = clients[1].generate("long", [5, 6, 7], SamplingParams(max_tokens=19_000, ignore_eos=True))
            await held.__anext__()  # running in the engine now, from the second client
            done = await asyncio.gather(*[one(clients[i % 2], rid) for i, rid in enumerate(work)])
            return dict(done), held

        # not asyncio.run: it would close `held` at its end, which aborts the request; here its process leaves instead
        loop = asyncio.new_event_loop()
        got, held = loop.run_until_complete(both())
        for rid, out in got.items():
            assert list(out.outputs[0].token_ids) == list(want[rid].outputs[0].token_ids), rid
            assert list(out.outputs[0].logprobs) == list(want[rid].outputs[0].logprobs), rid
        clients[1].shutdown()  # its process goes away with "long" still running (19,000 steps to go)
        deadline = time.time() + 5
        while time.time() < deadline:
            stats = clients[0].call("stats").result(timeout=30)
            if not stats.num_running and stats.num_free_blocks == stats.num_blocks:
                break
            time.sleep(0.05)
        assert not stats.num_running and stats.num_free_blocks == stats.num_blocks


def test_several_clients_share_the_adapters_names(tmp_path):
    """With several server processes the engine process keeps the adapters' names (served_adapters.py): an adapter
    loaded through one client is found, listed and run through the other (tokens equal to the engine run in this
    process with it); a request that names it after it was unloaded elsewhere, from a copy not yet told, is refused
    (404) rather than bringing it back; loaded again it gets a new id; a bad one is refused and not listed."""
    pytest.importorskip("peft")
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.lora.registry import LoRAExistsError, ModelNotFoundError
    from llmserve.server.served_adapters import SharedServedAdapters
    from tests.lora_helpers import make_adapter, tiny_base

    base = tiny_base(tmp_path / "base", seed=4)
    allowed = tmp_path / "allowed"
    make_adapter(base, allowed / "a", seed=5)
    (allowed / "empty").mkdir()
    cfg = EngineConfig(model=str(tmp_path / "base"), dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=4,
                       enable_lora=True, max_loras=2)
    prompt, params = [5, 17, 99, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLMEngine(cfg, skip_tokenizer=True)
    reference.add_request("ref", prompt, params, lora_request=LoRARequest("a", 1, str(allowed / "a")))
    done = {}
    while reference.has_unfinished_requests():
        done.update({o.request_id: o for o in reference.step() if o.finished})
    want = list(done["ref"].outputs[0].token_ids)

    with shared_engine_process(cfg, 2) as clients:
        first, second = (SharedServedAdapters(c, [str(allowed)]) for c in clients)

        async def tokens(client, lora):
            async for out in client.generate(f"r{time.monotonic_ns()}", prompt, params, lora_request=lora):
                pass
            return list(out.outputs[0].token_ids)

        async def run():
            a, size = await first.load("a", first.confine("a"))
            assert size > 0
            assert await second.find("a") == a and [x.lora_name for x in await second.served()] == ["a"]
            with pytest.raises(LoRAExistsError):
                await second.load("a", second.confine("a"))
            assert await tokens(clients[1], await second.find("a")) == want

            stale = await first.find("a")
            assert await second.unload("a") == a
            with pytest.raises(ModelNotFoundError):  # the engine process refuses it
                await tokens(clients[0], stale)
            deadline = time.time() + 5
            while await first.find("a") is not None:  # the change reaches the first client's copy
                assert time.time() < deadline
                await asyncio.sleep(0.01)

            again, _ = await second.load("a", second.confine("a"))
            assert again.lora_int_id != a.lora_int_id
            assert await tokens(clients[0], await first.find("a")) == want
            with pytest.raises(InvalidRequestError):
                await first.load("empty", first.confine("empty"))
            assert [x.lora_name for x in await second.served()] == ["a"]

        asyncio.new_event_loop().run_until_complete(run())
