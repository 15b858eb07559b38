"""Disaggregated prefill and decode, as a user runs it: `llmserve serve --disaggregated` (a prefill instance and a
decode instance, each its own process and core, KV handed over a torch.distributed link), and the two roles started
on their own (`--role prefill|decode`, as on two machines), driven by the real `openai` client.

Both instances run the deterministic float32 mode, so the decode side's output must equal a colocated engine's bit
for bit, whichever instance prefilled the prompt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from llmserve.errors import InvalidRequestError
from llmserve.kv_transfer.link import KVLayout, KVLink, parse_address, payload_crc
from tests.helpers import greedy, run_to_completion
from tests.server_fixtures import ServerProcess, free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two instances need two cores")

MODEL = "disagg-test"
# the default model cut to 3 layers (conftest's shallow_gguf): layers x K,V x block x KV heads x head dim x float32 (the
# servers run the float32 reference mode, so that their tokens and logprobs compare bit for bit with shallow_engine's)
BLOCK_BYTES = 3 * 2 * 16 * 3 * 64 * 4
FRUITS = "Here is a list of fruits: apple, banana, cherry, grape, mango, peach, plum, pear, kiwi, lime. " * 8
SHORT = "The capital of France is"


class Server(ServerProcess):
    """`llmserve serve` of the model file with this file's model name, float32 and no playground."""

    def __init__(self, model: str, *flags: str):
        super().__init__("--model", model, "--served-model-name", MODEL, "--no-webui", "--dtype", "float32", *flags)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def disagg(shallow_gguf):
    """Prompts with fewer than 64 uncached tokens stay on the decode side; longer ones go to the prefill side."""
    server = Server(shallow_gguf, "--disaggregated", "--max-local-prefill-length", "64", "--kv-cache-memory", "128MiB").wait_ready()
    yield server
    server.stop()


def prefill_url(server: Server) -> str:
    return re.search(r"prefill at (http://\S+),", server.output()).group(1)


def reference(engine, prompt: str, max_tokens: int = 16, logprobs: int = 2):
    engine.add_request("ref", prompt, greedy(max_tokens, logprobs=logprobs))
    return run_to_completion(engine)["ref"].outputs[0]


def complete(server: Server, prompt: str, max_tokens: int = 16, **extra):
    return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              logprobs=2, **extra)


def assert_same_as_colocated(response, ref) -> None:
    choice = response.choices[0]
    assert choice.text == ref.text
    assert choice.logprobs.token_logprobs == [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]


def test_long_prompts_are_prefilled_remotely_and_decode_as_colocated(disagg, shallow_engine):
    before = disagg.metric("llmserve:disagg_prefill_requests_total", route="remote")
    r = complete(disagg, FRUITS)
    details = r.usage.prompt_tokens_details.model_dump()
    assert details["prefilled_remotely"] == 1 and details["cached_tokens"] == 0
    prompt_len = r.usage.prompt_tokens
    assert details["kv_transfer_bytes"] == -(-(prompt_len - 1) // 16) * BLOCK_BYTES  # positions 0 .. P-2, whole blocks
    assert details["kv_transfer_seconds"] > 0
    assert_same_as_colocated(r, reference(shallow_engine, FRUITS))
    assert disagg.metric("llmserve:disagg_prefill_requests_total", route="remote") == before + 1
    assert disagg.metric("llmserve:kv_transfer_bytes_total") >= details["kv_transfer_bytes"]
    assert disagg.metric("llmserve:request_kv_transfer_seconds_count") >= 1


def test_short_prompts_bypass_the_prefill_instance(disagg, shallow_engine):
    before = disagg.metric("llmserve:disagg_prefill_requests_total", route="bypass")
    r = complete(disagg, SHORT)
    details = r.usage.prompt_tokens_details.model_dump()
    assert details["prefilled_remotely"] == 0 and details["kv_transfer_bytes"] == 0
    assert disagg.metric("llmserve:disagg_prefill_requests_total", route="bypass") == before + 1
    assert_same_as_colocated(r, reference(shallow_engine, SHORT))


def test_decode_side_prefix_hits_shrink_what_is_sent(disagg, shallow_engine):
    tail = "Now a question about them, asked at some length so that it is more than the bypass length. " * 4
    complete(disagg, FRUITS + "Which is red?")  # the shared list is in the decode side's cache (if not already)
    again = complete(disagg, FRUITS + tail)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((len(FRUITS) // 8) // 16)  # the shared list, in whole blocks
    details = again.usage.prompt_tokens_details.model_dump()
    expected_blocks = -(-(again.usage.prompt_tokens - 1) // 16) - cached // 16
    assert details["prefilled_remotely"] == 1
    assert details["kv_transfer_bytes"] == expected_blocks * BLOCK_BYTES
    assert details["kv_transfer_bytes"] < -(-(again.usage.prompt_tokens - 1) // 16) * BLOCK_BYTES
    assert_same_as_colocated(again, reference(shallow_engine, FRUITS + tail))


def test_concurrent_streams_mixing_both_routes(disagg, shallow_engine):
    prompts = [FRUITS + f"Question {i}: which fruit comes number {i}?" if i % 2 else f"Count to {i}: one," for i in range(8)]
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = disagg.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0,
                                                    stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(shallow_engine, prompt, 12).text
    # no KV block left behind on either side
    for url in (disagg.url, prefill_url(disagg)):
        deadline = time.time() + 10
        while True:
            usage = [float(l.rsplit(" ", 1)[1]) for l in httpx.get(url + "/metrics").text.splitlines()
                     if l.startswith("llmserve:kv_cache_usage_perc")]
            if usage == [0.0] or time.time() > deadline:
                break
            time.sleep(0.2)
        assert usage == [0.0], url


def test_several_api_server_processes_in_front_of_the_decode_instance(shallow_gguf, shallow_engine):
    """`--disaggregated --api-server-count 2`: the decode instance is the engine process behind two HTTP processes.
    Requests, each on a connection of its own (the kernel spreads them over both), are prefilled remotely or here by
    their length, give the colocated tokens and logprobs, and /metrics counts each route once."""
    server = Server(shallow_gguf, "--disaggregated", "--api-server-count", "2", "--max-local-prefill-length", "64",
                    "--kv-cache-memory", "128MiB").wait_ready()
    try:
        # the long ones differ from their first block on: no prefix-cache hit shortens them below the bypass length
        prompts = [(f"List number {i}. " + FRUITS, 1) if i % 2 else (f"Count to {i}: one,", 0) for i in range(6)]
        for prompt, remote in prompts:
            r = complete(server, prompt, max_tokens=8)
            assert r.usage.prompt_tokens_details.model_dump()["prefilled_remotely"] == remote
            assert_same_as_colocated(r, reference(shallow_engine, prompt, 8))
        assert server.metric("llmserve:disagg_prefill_requests_total", route="remote") == 3
        assert server.metric("llmserve:disagg_prefill_requests_total", route="bypass") == 3
    finally:
        server.stop()
    assert "Traceback" not in server.output()


def test_orders_are_checked_by_the_prefill_instance(disagg):
    url = prefill_url(disagg)
    bad = [({"do_remote_decode": True, "transfer_id": -1, "skip_tokens": 0}, "transfer_id"),
           ({"do_remote_decode": True, "transfer_id": 1, "skip_tokens": 5}, "multiple of the block size"),
           ({"transfer_id": 1, "skip_tokens": 0}, "do_remote_decode")]
    for order, message in bad:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                      "kv_transfer_params": order})
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(disagg.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                         "kv_transfer_params": bad[0][0]})
    assert r.status_code == 400 and "not a prefill instance" in r.json()["error"]["message"]


def test_roles_started_apart_and_a_dead_prefill_instance_falls_back(shallow_gguf, shallow_engine):
    """As on two machines: each role its own command, with the peer's address. When the prefill instance dies the
    decode instance prefills everything itself: slower, never wrong, never down."""
    link = f"127.0.0.1:{free_port()}"
    prefill = ServerProcess("--model", shallow_gguf, "--served-model-name", "prefill-side", "--no-webui", "--dtype", "float32",
                           "--role", "prefill", "--kv-link", link, "--kv-cache-memory", "64MiB")
    decode = Server(shallow_gguf, "--role", "decode", "--kv-link", link, "--prefill-url", prefill.url,
                    "--max-local-prefill-length", "8", "--kv-cache-memory", "64MiB")
    try:
        decode.wait_ready()
        r = complete(decode, FRUITS)
        assert r.usage.prompt_tokens_details.model_dump()["prefilled_remotely"] == 1
        assert_same_as_colocated(r, reference(shallow_engine, FRUITS))
        prefill.proc.kill()
        prefill.proc.wait()
        question = FRUITS + "Which is yellow?"
        r = complete(decode, question)
        assert_same_as_colocated(r, reference(shallow_engine, question))
        assert decode.metric("llmserve:kv_transfer_fallbacks_total") + \
            decode.metric("llmserve:disagg_prefill_requests_total", route="bypass") >= 1
        assert httpx.get(decode.url + "/health").status_code == 200
    finally:
        decode.stop()
        prefill.stop()


def test_bad_role_settings_are_one_line_errors():
    for flags, message in [(["--role", "decode", "--kv-link", "127.0.0.1:1"], "--role decode needs --prefill-url"),
                           (["--role", "prefill"], "--role prefill needs --kv-link HOST:PORT"),
                           (["--kv-link", "127.0.0.1:1"], "--kv-link and --prefill-url need --role"),
                           (["--disaggregated", "--role", "prefill", "--kv-link", "h:1"], "drop --role")]:
        run = subprocess.run([sys.executable, "-m", "llmserve", "serve", *flags], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("error: ") and message in run.stderr
    with pytest.raises(InvalidRequestError, match="HOST:PORT"):
        parse_address("nowhere")


# ---- the link itself: layouts must match, damaged KV is never used ---------------------------------------------
LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _connect_pair(decode_layout: KVLayout):
    address = f"127.0.0.1:{free_port()}"
    made: dict = {}

    def prefill_side():
        try:
            made["prefill"] = KVLink("prefill", address, LAYOUT, torch.device("cpu"))
        except Exception as e:  # noqa: BLE001 - checked by the test
            made["prefill"] = e

    t = threading.Thread(target=prefill_side)
    t.start()
    try:
        made["decode"] = KVLink("decode", address, decode_layout, torch.device("cpu"))
    except Exception as e:  # noqa: BLE001
        made["decode"] = e
    t.join(timeout=60)
    return made["prefill"], made["decode"]


def test_links_refuse_a_different_kv_layout():
    prefill, decode = _connect_pair(KVLayout(2, 8, 2, 8, "float32"))
    assert isinstance(prefill, InvalidRequestError) and "block size 4 here, 8 there" in str(prefill)
    assert isinstance(decode, InvalidRequestError) and "block size 8 here, 4 there" in str(decode)


def test_link_delivers_blocks_and_refuses_damaged_ones():
    prefill, decode = _connect_pair(LAYOUT)
    assert prefill.bandwidth_bytes_per_s > 0 and decode.bandwidth_bytes_per_s == prefill.bandwidth_bytes_per_s
    received, sent = [], []
    done = threading.Event()

    def on_received(tid, payload, nbytes, seconds):
        received.append((tid, payload, nbytes))
        if len(received) == 3:
            done.set()

    decode.start_receiver(on_received)
    prefill.start_sender(lambda tid, nbytes, seconds: sent.append((tid, nbytes, seconds)))
    blocks = torch.randn(3, *LAYOUT.block_shape)
    prefill.send(7, lambda: blocks)

    def unreadable():
        raise RuntimeError("block table gone")

    prefill.send(8, unreadable)
    # a peer whose bytes change on the way: the same wire protocol, a payload that does not match its CRC
    damaged = blocks.clone()
    header = torch.tensor([9, 0, 3, damaged.numel() * 4, payload_crc(blocks)], dtype=torch.int64)
    damaged.view(-1)[5] += 1.0
    while len(sent) < 2:
        time.sleep(0.05)
    prefill.close()  # its sender thread stops; this test sends by hand over the link's group
    time.sleep(0.2)
    prefill.group.send([header], 1, 4).wait()
    prefill.group.send([damaged], 1, 5).wait()
    assert done.wait(30)
    (t1, p1, n1), (t2, p2, n2), (t3, p3, n3) = received
    assert t1 == 7 and torch.equal(p1, blocks) and n1 == blocks.numel() * 4
    assert t2 == 8 and p2 is None and n2 == 0  # the prefill side could not read its blocks: recompute
    assert t3 == 9 and p3 is None and n3 > 0  # damaged: recompute
    assert [s[0] for s in sent] == [7, 8] and sent[1][2] is None
    prefill.close()
    decode.close()
