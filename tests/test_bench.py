"""`llmserve bench`: figures checked by hand, load shapes, workloads, a real sweep, bad input."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from llmserve.bench import workloads
from llmserve.bench.backends import RequestRecord
from llmserve.bench.metrics import SLO, summarize
from llmserve.bench.runner import LoadLevel, arrival_offsets
from llmserve.cli import main
from tests.scripted_server import ScriptedServer
from tests.server_fixtures import RunningServer


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    yield server
    server.stop()


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", "--quiet", "--no-plots", "--result", str(out), *map(str, args)]) == 0
    return json.loads(out.read_text())


def dataset(tmp_path, lines: list[str], chat: bool = False) -> str:
    path = tmp_path / "scripts.jsonl"
    rows = [{"messages": [{"role": "user", "content": s}]} if chat else {"prompt": s} for s in lines]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---- the figures, by hand ------------------------------------------------------------------------
def record(i, sent, chunks, out_tokens, status="ok"):
    return RequestRecord(index=i, session=i, turn=0, sent=sent, chunk_times=chunks, done=chunks[-1] if chunks else sent + 0.1,
                         status=status, input_tokens=10, output_tokens=out_tokens)


def test_summary_matches_hand_computation():
    records = [
        record(0, 0.0, [0.1, 0.2, 0.3], 3),  # TTFT 100 ms, TPOT (0.3-0.1)/2 = 100 ms, ITL 100, 100
        record(1, 0.0, [0.3, 0.35, 0.4, 0.45, 0.5], 5),  # TTFT 300, TPOT 50, ITL 50 x4
        record(2, 0.5, [0.6], 1),  # TTFT 100, no TPOT (one token), no ITL
        record(3, 0.5, [], None, status="rejected"),
        record(4, 0.6, [], None, status="failed"),
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=150, tpot_ms=80))
    assert (s["completed"], s["rejected"], s["failed"]) == (3, 1, 1)
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(19.5)
    # TTFT: 100, 300, 100 ms -> mean 166.67; sorted [100, 100, 300]: p50 = 100, p90 = 100 + 0.8*200 = 260, p99 = 296
    assert s["mean_ttft_ms"] == pytest.approx(500 / 3)
    assert (s["p50_ttft_ms"], s["p90_ttft_ms"], s["p99_ttft_ms"]) == pytest.approx((100, 260, 296))
    # TPOT: 100, 50 -> mean 75; p50 75; p90 = 50 + 0.9*50 = 95; p99 = 99.5
    assert s["mean_tpot_ms"] == pytest.approx(75)
    assert (s["p50_tpot_ms"], s["p90_tpot_ms"], s["p99_tpot_ms"]) == pytest.approx((75, 95, 99.5))
    # ITL pooled: sorted [50, 50, 50, 50, 100, 100] -> mean 66.67; p50 at rank 2.5 = 50; p90 at rank 4.5 = 100
    assert s["mean_itl_ms"] == pytest.approx(400 / 6)
    assert (s["p50_itl_ms"], s["p90_itl_ms"]) == pytest.approx((50, 100))
    # E2E: 300, 500, 100
    assert s["mean_e2e_ms"] == pytest.approx(300)
    # Goodput: record 0 fails TPOT 80 (100 ms), record 1 fails TTFT 150 (300 ms); record 2 meets both (no TPOT).
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["output_throughput_per_user"] == pytest.approx(1000 / 75)


def test_slo_parsing_and_errors():
    assert SLO.parse("ttft_ms=500,tpot_ms=50") == SLO(ttft_ms=500, tpot_ms=50)
    for bad in ("ttft=500", "ttft_ms=abc", "tpot_ms=-1", "e2e_ms"):
        with pytest.raises(Exception, match="--slo"):
            SLO.parse(bad)


# ---- against the scripted server: timing to within scheduler jitter, counts exactly -----------------------
def test_scripted_timings_rejections_and_goodput(scripted, tmp_path):
    lines = ["ttft=0.2 gap=0.05 tokens=5"] * 3 + ["ttft=0.5 gap=0.05 tokens=3", "status=429", "status=503", "status=500",
                                                     "ttft=0.1 tokens=4 gap=0.02 error_after=2"]
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, lines), "--concurrency", 8, "--warmup", 0,
              "--slo", "ttft_ms=350,tpot_ms=200")
    level = r["levels"][0]
    s, reqs = level["summary"], level["requests"]
    assert (s["completed"], s["rejected"], s["failed"]) == (4, 2, 2)
    ok = [q for q in reqs if q["status"] == "ok"]
    fast = [q for q in ok if q["output_tokens"] == 5]
    slow = [q for q in ok if q["output_tokens"] == 3]
    assert len(fast) == 3 and len(slow) == 1
    # The server's sleeps bound the times from below; a busy 2-core machine only adds to them, so the upper margin is
    # wider (still under the 350 ms TTFT SLO that the goodput below separates on).
    for q in fast:
        assert 0.19 <= q["ttft"] <= 0.33
        assert q["tpot"] == pytest.approx(0.05, abs=0.03)
        assert len(q["chunk_times"]) == 5
    assert 0.49 <= slow[0]["ttft"] <= 0.63
    # ITL pools every gap of completed requests: 3 x 4 + 2 = 14 gaps of ~50 ms
    assert s["mean_itl_ms"] == pytest.approx(50, abs=15)
    # Goodput: the TTFT SLO of 350 ms separates the scripted 200 ms from the 500 ms exactly.
    assert s["good_requests"] == 3
    assert s["goodput"] == pytest.approx(3 / s["duration_s"])
    # The summary is the pure function of the stored records.
    ttfts = [q["ttft"] * 1000 for q in ok]
    assert s["mean_ttft_ms"] == pytest.approx(statistics.mean(ttfts))
    assert s["p90_ttft_ms"] == pytest.approx(float(np.percentile(ttfts, 90)))
    assert s["total_output_tokens"] == 18 and s["total_input_tokens"] == 28  # usage from the server
    assert "429" in next(q["error"] for q in reqs if q["http_status"] == 429)


def test_tokens_counted_by_tokenizer_without_usage(scripted, tmp_path):
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["tokens=6 usage=0"]), "--warmup", 0)
    q = r["levels"][0]["requests"][0]
    assert q["output_tokens"] == 6  # " tok" x 6 is six tokens of the default tokenizer


def test_time_to_first_visible_token_counts_thinking(scripted, tmp_path):
    """A thinking model's reasoning_content arrives first: TTFT stamps it, TTFVT waits for the answer."""
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset",
              dataset(tmp_path, ["ttft=0.1 gap=0.05 tokens=6 think=4"] * 3, chat=True), "--concurrency", 3, "--warmup", 0)
    level = r["levels"][0]
    for q in level["requests"]:
        assert 0.09 <= q["ttft"] <= 0.25 and 0.29 <= q["ttfvt"] <= 0.45 and len(q["chunk_times"]) == 6
    assert level["summary"]["mean_ttfvt_ms"] > level["summary"]["mean_ttft_ms"] + 150


def test_concurrency_cap_and_chat_endpoint(scripted, tmp_path):
    scripted.state["max_in_flight"] = 0
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["ttft=0.1 gap=0.02 tokens=3"] * 9, chat=True),
              "--concurrency", 3, "--warmup", 0)
    assert r["endpoint"] == "chat"
    assert r["levels"][0]["summary"]["completed"] == 9
    assert scripted.state["max_in_flight"] == 3


def test_client_processes_share_the_load_and_its_cap(scripted, tmp_path):
    """--client-processes 2: the sessions go out from two processes, the concurrency cap still holds for the whole
    level (3 over 2 processes: 2 + 1), every request is recorded once on one clock, and the figures are those of one
    process's run (the scripted server's TTFT, tokens counted from the text where it sends no usage)."""
    scripted.state["max_in_flight"] = 0
    lines = ["ttft=0.1 gap=0.02 tokens=3"] * 8 + ["ttft=0.1 gap=0.02 tokens=5 usage=0"] * 4
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, lines), "--concurrency", 3,
              "--warmup", 0, "--client-processes", 2)
    level = r["levels"][0]
    s, reqs = level["summary"], level["requests"]
    assert s["completed"] == 12 and scripted.state["max_in_flight"] == 3
    assert sorted(q["output_tokens"] for q in reqs) == [3] * 8 + [5] * 4
    assert sorted(q["index"] for q in reqs) == list(range(12))
    assert reqs[0]["sent"] == 0 and all(0.09 <= q["ttft"] <= 0.3 for q in reqs)
    # 12 requests of ~0.15-0.2 s, 3 at a time: four waves, whichever process sent each
    assert 0.5 <= s["duration_s"] <= 2.0 and max(q["done"] for q in reqs) == pytest.approx(s["duration_s"])


def test_bench_against_an_https_server(tmp_path, capsys):
    """A server with a private CA's certificate: without trusting it, one line that says so and how; with
    SSL_CERT_FILE naming the CA (as for any OpenSSL client), the run goes through."""
    import os
    import ssl
    import subprocess
    import sys

    import trustme

    from llmserve.cli import main
    from tests.scripted_server import ScriptedServer

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server = ScriptedServer(tls={"ssl_certfile": str(tmp_path / "cert.pem"), "ssl_keyfile": str(tmp_path / "key.pem")},
                            verify=ssl.create_default_context(cafile=str(tmp_path / "ca.pem")))
    try:
        data = dataset(tmp_path, ["ttft=0.05 tokens=3"] * 4)
        args = ["bench", "--quiet", "--no-plots", "--base-url", server.base_url, "--dataset", data, "--concurrency",
                "2", "--warmup", "0", "--result", str(tmp_path / "r.json")]
        assert main(args) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "its TLS certificate is not trusted" in errors[0] and "SSL_CERT_FILE" in errors[0]
        run = subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "SSL_CERT_FILE": str(tmp_path / "ca.pem")})
        assert run.returncode == 0, run.stderr
        assert json.loads((tmp_path / "r.json").read_text())["levels"][0]["summary"]["completed"] == 4
    finally:
        server.stop()


def test_duration_bounds_a_level(scripted, tmp_path):
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["ttft=0.3 tokens=1"]), "--num-requests", 20,
              "--concurrency", 1, "--duration", 0.7, "--warmup", 0)
    assert 2 <= r["levels"][0]["summary"]["completed"] <= 4


def test_poisson_arrivals_have_the_requested_rate_and_burstiness():
    gaps = np.diff(arrival_offsets(4001, LoadLevel(request_rate=20.0), seed=1))
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV = 1
    bursty = np.diff(arrival_offsets(4001, LoadLevel(request_rate=20.0, burstiness=0.25), seed=1))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma shape k: CV = 1/sqrt(k)
    assert arrival_offsets(3, LoadLevel(concurrency=2), seed=0) == [0.0, 0.0, 0.0]


def test_rate_sweep_levels(scripted, tmp_path):
    r = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["tokens=2 gap=0.01"] * 4),
              "--request-rate", "50,inf", "--concurrency", 2, "--warmup", 1)
    assert [lv["label"] for lv in r["levels"]] == ["concurrency 2, rate 50/s", "concurrency 2"]
    assert all(lv["summary"]["completed"] == 4 for lv in r["levels"])


# ---- workloads --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_files):
    return default_files.tokenizer


def test_synthetic_prompts_have_exact_token_lengths(tokenizer):
    sessions = workloads.synthetic(tokenizer, 20, 200, 16, 0.5, seed=3, chat=False)
    for s in sessions:
        t = s.turns[0]
        assert len(tokenizer.encode(t.prompt, add_special_tokens=False)) == t.input_tokens
        assert 100 <= t.input_tokens <= 300 and 8 <= t.max_tokens <= 24
    assert len({s.turns[0].prompt for s in sessions}) == 20


def test_shared_prefix_workload(tokenizer):
    sessions = workloads.shared_prefix(tokenizer, 3, 4, 100, 10, 8, seed=0, chat=False)
    assert len(sessions) == 12
    prefixes = {s.tags["prefix"]: s.turns[0].prompt[: len(s.turns[0].prompt) - 1] for s in sessions}
    assert len(prefixes) == 3
    for s in sessions:
        assert s.turns[0].input_tokens == 110
        ids = tokenizer.encode(s.turns[0].prompt, add_special_tokens=False)
        assert len(ids) == 110
    by_prefix = {}
    for s in sessions:
        by_prefix.setdefault(s.tags["prefix"], set()).add(tuple(tokenizer.encode(s.turns[0].prompt, add_special_tokens=False)[:100]))
    assert all(len(v) == 1 for v in by_prefix.values())  # the same 100 tokens open every question of a prefix


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(Exception, match=r"line 2: needs a non-empty \"prompt\""):
        workloads.from_jsonl(str(path), 8)
    path.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(Exception, match="line 1: max_tokens"):
        workloads.from_jsonl(str(path), 8)


# ---- against the real llmserve server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(default_files):
    server = RunningServer(default_files, {}, {})
    yield server
    server.stop()


def test_sweep_against_llmserve_writes_json_and_plots(real_server, tmp_path):
    out = tmp_path / "sweep.json"
    rc = main(["bench", "--quiet", "--base-url", real_server.base_url + "/v1", "--concurrency", "1,3", "--num-requests", "3",
               "--input-len", "40", "--output-len", "6", "--ignore-eos", "--slo", "ttft_ms=60000", "--result", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["model"] == "test-model" and len(r["levels"]) == 2
    for lv in r["levels"]:
        s = lv["summary"]
        assert s["completed"] == 3 and s["failed"] == 0 and s["rejected"] == 0
        assert all(q["input_tokens"] == 40 and q["output_tokens"] == 6 and len(q["chunk_times"]) == 6 for q in lv["requests"])
        assert s["good_requests"] == 3
    for kind in ("pareto", "ttft", "itl"):
        png = tmp_path / f"sweep.{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    real_server.wait_idle()


def test_multi_turn_resends_history(real_server, tmp_path):
    r = bench(tmp_path, "--base-url", real_server.base_url + "/v1", "--workload", "multi-turn", "--turns", 3, "--system-len", 30,
              "--user-len", 10, "--output-len", 4, "--ignore-eos", "--num-requests", 2, "--concurrency", 2, "--warmup", 0)
    reqs = r["levels"][0]["requests"]
    assert len(reqs) == 6 and all(q["status"] == "ok" for q in reqs)
    for session in (0, 1):
        lens = [q["input_tokens"] for q in sorted((q for q in reqs if q["session"] == session), key=lambda q: q["turn"])]
        assert lens[0] < lens[1] < lens[2]  # each turn carries the previous turns and answers
        assert lens[1] - lens[0] == lens[2] - lens[1]  # 4 answer tokens + 10 user tokens + template overhead, each turn


def test_compare_two_results(scripted, tmp_path, capsys):
    a = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["ttft=0.05 tokens=3 gap=0.01"] * 2),
              "--warmup", 0, "--label", "fast")
    (tmp_path / "a.json").write_text(json.dumps(a))
    b = bench(tmp_path, "--base-url", scripted.base_url, "--dataset", dataset(tmp_path, ["ttft=0.2 tokens=3 gap=0.01"] * 2),
              "--warmup", 0, "--label", "slow")
    (tmp_path / "b.json").write_text(json.dumps(b))
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plot", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("mean TTFT"))
    ratio = float(row.split()[-1].rstrip("x"))
    assert 2.0 < ratio < 6.0  # ~200 ms vs ~50 ms
    assert (tmp_path / "cmp.pareto.png").exists()


# ---- bad input: one line, non-zero exit ----------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--base-url", "http://127.0.0.1:9/v1"], "cannot reach http://127.0.0.1:9/v1"),
    (["--model", "nope"], "model 'nope' is not served"),
    (["--concurrency", "0"], "--concurrency values must be positive"),
    (["--concurrency", "1,2", "--request-rate", "1,2"], "sweep either"),
    (["--slo", "ttft=5"], "bad --slo entry"),
    (["--workload", "multi-turn", "--endpoint", "completions"], "needs --endpoint chat"),
    (["--output-len", "0"], "--output-len must be at least 1"),
    (["--client-processes", "0"], "--client-processes must be at least 1"),
    (["--client-processes", "2", "--engine"], "--client-processes needs a server"),
])
def test_bad_input_one_line(scripted, capsys, args, message):
    argv = ["bench", "--quiet", "--no-plots", "--base-url", scripted.base_url, *args]
    if args[0] == "--base-url":
        argv = ["bench", "--quiet", "--no-plots", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_malformed_dataset_line(scripted, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    assert main(["bench", "--quiet", "--base-url", scripted.base_url, "--dataset", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path} line 2: not valid JSON (Expecting ',' delimiter)"


def test_compare_rejects_other_files(tmp_path, capsys):
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main(["bench", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "is not a result file of llmserve bench" in capsys.readouterr().err


def test_level_labels():
    assert LoadLevel(concurrency=4).label == "concurrency 4"
    assert LoadLevel(request_rate=2.5).label == "rate 2.5/s"
    assert LoadLevel(request_rate=math.inf).label == "all at once"


def test_engine_mode_runs_in_process(tmp_path, default_gguf):
    out = tmp_path / "engine.json"
    assert main(["bench", "--engine", "--model", default_gguf, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--quiet",
                 "--no-plots", "--concurrency", "2", "--num-requests", "2", "--input-len", "20", "--output-len", "4",
                 "--ignore-eos", "--warmup", "0", "--result", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["target"] == "engine"
    assert all(q["input_tokens"] == 20 and q["output_tokens"] == 4 for q in r["levels"][0]["requests"])
