"""CUDA graphs for decode steps (graphs/cuda_graphs.py), driven through the CUDA platform's model runner.

On a GPU the decode steps replay captured graphs. Without one, the CUDA platform's runner is built on CPU tensors,
with its Triton kernels under Triton's interpreter (conftest.py): the decode steps then run padded to their bucket
on the same fixed buffers, eagerly. That checks the bucketing, the padding (its K/V kept out of the pool, its rows
dropped) and the fixed-address metadata; only the capture itself needs the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine.step_io import PLACEHOLDER_TOKEN, NewRequestData, ScheduledRow, StepInput  # noqa: E402
from llmserve.errors import InvalidRequestError  # noqa: E402
from llmserve.graphs.cuda_graphs import capture_sizes  # noqa: E402
from llmserve.platforms.cuda import CudaPlatform  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.worker.model_runner import ModelRunner  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16
NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from llmserve.loader import load_model_files
    from tests.helpers import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("graphs") / "tiny", 96, seed=11)
    return load_model_files(path, load_tokenizer=False)


def make_runner(files, **overrides) -> ModelRunner:
    config = EngineConfig(device=str(DEVICE), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, kv_cache_memory="8MiB",
                          max_num_seqs=16, **overrides)
    return ModelRunner(config, files.config, files.weights, platform=CudaPlatform(DEVICE))


def decode(runner: ModelRunner, prompts: dict[str, list[int]], tables: dict[str, list[int]], joins: dict[int, list[str]],
           steps: int):
    """Greedy decoding of the prompts, each prefilled in the step given by `joins` (step → requests) and decoded in
    every later step together with whoever else is running. Returns each request's logits per decode step, and each
    step's forward passes."""
    params = SamplingParams(temperature=0, max_tokens=steps)
    seen: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    last: dict[str, list[int]] = {}  # the request's tokens so far
    passes = []
    runner.logits_observers.append(lambda ids, rows: [seen[r].append(row.clone().cpu()) for r, row in zip(ids, rows)])
    for step in range(steps):
        rows, new = [], []
        for rid in joins.get(step, []):
            rows.append(ScheduledRow(rid, prompts[rid], 0, tables[rid], True))
            new.append(NewRequestData(rid, prompts[rid], params, set()))
        for rid, tokens in last.items():
            rows.append(ScheduledRow(rid, tokens[-1:], len(tokens) - 1, tables[rid], True))
        out = runner.execute(StepInput(rows, new_requests=new))
        passes.append(out.forward_passes)
        for rid in joins.get(step, []):
            last[rid] = list(prompts[rid])
        for rid, sampled in out.sampled.items():
            last[rid].extend(sampled.token_ids)
    runner.logits_observers.clear()
    return seen, passes


PROMPTS = {f"r{i}": list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 17, 9, 30, 2, 12))}
TABLES = {rid: [1 + 4 * i + j for j in range(4)] for i, rid in enumerate(PROMPTS)}  # block 0 and 25+ hold no one
# requests join over time, so that the decode batch passes through sizes 1, 2, 3, 5 and 6 (buckets 1, 2, 4, 8, 8)
JOINS = {0: ["r0"], 2: ["r1"], 4: ["r2"], 6: ["r3", "r4"], 8: ["r5"]}


def test_capture_sizes_are_vllms_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert len(capture_sizes(256)) == 35


def test_padded_decode_steps_give_the_eager_steps_logits(tiny_files):
    graphs = make_runner(tiny_files)
    eager = make_runner(tiny_files, enforce_eager=True)
    assert graphs.cuda_graphs is not None and eager.cuda_graphs is None
    assert graphs.cuda_graphs.sizes == [1, 2, 4, 8, 16]
    got, passes = decode(graphs, PROMPTS, TABLES, JOINS, 12)
    want, eager_passes = decode(eager, PROMPTS, TABLES, JOINS, 12)
    for rid in PROMPTS:
        assert len(got[rid]) == len(want[rid]) > 0
        for a, b in zip(got[rid], want[rid]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert a.argmax() == b.argmax()
    # decode-only steps ran on the graph runner, steps with a prompt eagerly; nothing eager ran in graph mode otherwise
    for step, step_passes in enumerate(passes):
        assert [p.compiled for p in step_passes] == [step not in JOINS]
    assert not any(p.compiled for step_passes in eager_passes for p in step_passes)


def decode_async(runner: ModelRunner, prompts, tables, joins, steps: int):
    """As `decode`, as async scheduling drives the runner: each step is launched before the previous step's tokens
    are read, its decode rows ending with PLACEHOLDER_TOKEN (the runner reads the previous step's tokens on the
    device)."""
    params = SamplingParams(temperature=0, max_tokens=steps)
    seen: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    running: list[str] = []
    runner.logits_observers.append(lambda ids, rows: [seen[r].append(row.clone().cpu()) for r, row in zip(ids, rows)])
    length = {}
    wait = None
    for step in range(steps):
        rows, new = [], []
        for rid in joins.get(step, []):
            rows.append(ScheduledRow(rid, prompts[rid], 0, tables[rid], True))
            new.append(NewRequestData(rid, prompts[rid], params, set()))
        for rid in running:
            rows.append(ScheduledRow(rid, [PLACEHOLDER_TOKEN], length[rid], tables[rid], True))
        launched = runner.execute_deferred(StepInput(rows, new_requests=new))
        if wait is not None:
            wait()  # the previous step's tokens, read after this step was launched
        wait = launched
        for row in rows:
            length[row.request_id] = row.start + len(row.token_ids)
        running += joins.get(step, [])
    wait()
    runner.logits_observers.clear()
    return seen


def test_async_scheduling_steps_read_the_previous_tokens_on_the_device(tiny_files):
    """Decode rows whose token the previous step sampled and the host has not seen: graph steps and eager steps
    give the logits of steps that were given the tokens."""
    want, _ = decode(make_runner(tiny_files, enforce_eager=True), PROMPTS, TABLES, JOINS, 12)
    for overrides in ({}, {"enforce_eager": True}):
        got = decode_async(make_runner(tiny_files, async_scheduling=True, **overrides), PROMPTS, TABLES, JOINS, 12)
        for rid in PROMPTS:
            assert len(got[rid]) == len(want[rid]) > 0
            for a, b in zip(got[rid], want[rid]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_padding_rows_write_no_kv_block_of_the_pool(tiny_files):
    runner = make_runner(tiny_files)
    used = {b for rid in ("r0", "r1", "r2") for b in TABLES[rid]}
    decode(runner, PROMPTS, TABLES, {0: ["r0", "r1", "r2"]}, 6)  # decode steps of 3 rows in buckets of 4
    written = {block for block in range(NUM_BLOCKS) if runner.read_block(block).abs().sum() > 0}
    assert written and written <= used, f"blocks {sorted(written - used)} belong to no request but were written"


def test_deterministic_mode_keeps_its_bits_through_padded_graph_steps(tiny_files):
    """The batch-invariant kernels make a row's result independent of the padding: graph steps equal eager bits."""
    got, _ = decode(make_runner(tiny_files, deterministic=True), PROMPTS, TABLES, JOINS, 10)
    want, _ = decode(make_runner(tiny_files, deterministic=True, enforce_eager=True), PROMPTS, TABLES, JOINS, 10)
    for rid in PROMPTS:
        assert all(torch.equal(a, b) for a, b in zip(got[rid], want[rid]))


def test_larger_steps_than_the_largest_bucket_run_eagerly(tiny_files):
    runner = make_runner(tiny_files, max_cudagraph_capture_size=2)
    assert runner.cuda_graphs.sizes == [1, 2]
    _, passes = decode(runner, PROMPTS, TABLES, {0: ["r0", "r1", "r2"]}, 3)
    assert [p.compiled for step_passes in passes[1:] for p in step_passes] == [False, False]


def test_graph_settings_are_checked_and_reported(tiny_files):
    with pytest.raises(InvalidRequestError, match="max_cudagraph_capture_size"):
        EngineConfig(max_cudagraph_capture_size=0)
    assert make_runner(tiny_files, attention_backend="sdpa").cuda_graphs is None  # SDPA's shapes follow the step
    from llmserve.executor.base import ExecutorInfo

    info = ExecutorInfo.of_runner(make_runner(tiny_files, max_cudagraph_capture_size=8))
    assert info.cuda_graph_sizes == [1, 2, 4, 8] and info.attention_backend == "triton"
    assert ExecutorInfo.of_runner(make_runner(tiny_files, enforce_eager=True)).cuda_graph_sizes == []


@pytest.mark.parametrize("fused", ["1", "0"])
def test_the_cuda_runner_gives_the_reference_runners_logits(tiny_files, fused, monkeypatch):
    """Everything CUDA runs differently from the CPU reference at once (fused RMSNorm, rotary written in place into
    the QKV output, fused SwiGLU, the Triton attention kernel, padded graph steps): the same logits, float32. With
    LLMSERVE_FUSED_KERNELS=0 torch's ops replace the fused kernels, with the same logits."""
    from llmserve.platforms import get_platform

    monkeypatch.setenv("LLMSERVE_FUSED_KERNELS", fused)
    runner = make_runner(tiny_files)
    assert (runner.weights.num_fused_norms > 0) == (fused == "1")
    assert (runner.attention.kv_writer() is not None) == (fused == "1")
    got, _ = decode(runner, PROMPTS, TABLES, JOINS, 10)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          kv_cache_memory="8MiB", max_num_seqs=16, attention_backend="sdpa", deterministic=False)
    reference = ModelRunner(config, tiny_files.config, tiny_files.weights, platform=get_platform("cpu"))
    want, _ = decode(reference, PROMPTS, TABLES, JOINS, 10)
    for rid in PROMPTS:
        assert len(got[rid]) == len(want[rid])
        for a, b in zip(got[rid], want[rid]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
