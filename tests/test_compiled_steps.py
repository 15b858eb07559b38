"""compile: small decode steps and lone prompts through torch.compile.

The compiled graph fuses bf16 elementwise ops and keeps float32 between them, so it rounds differently from eager
bf16. Against the float32 engine on the same sequences (up to 75 tokens, batches of 1 to 6), the logits of rows
computed from the same tokens stay within 2.0: on the default model's first 3 layers (below) measured 1.38 compiled,
1.58 eager bf16; on all 30, 1.47 and 2.12. That bound also keeps any token where the two part within a near-tie: both
logits of the compiled choice are within 2.0 of float32's. Start-up compiles every graph: serving steps of any batch
size and context length must not compile again (a recompile stalls every request for seconds).
"""

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.graphs.inductor import LONE_PROMPT_TRIAL_ROWS, compiled_decode_batch_limit
from llmserve.errors import InvalidRequestError
from tests.helpers import LogitsRecorder, greedy, run_to_completion, save_tiny_llama
from tests.test_continuous_batching import PROMPTS


@pytest.fixture(scope="module")
def make_engine(shallow_files, engine_maker):
    """The default model cut to its first 3 layers (its vocabulary, shapes and weight types as they are): what compiling
    costs grows with the depth (~40 s cold for these, ~2 min for all 30, and a fresh checkout's environment never
    finds the graphs cached); on the CPU, where these features are."""
    return engine_maker(shallow_files, device="cpu")


LOGIT_TOL = 2.0
SETTINGS = dict(dtype="bfloat16", max_num_seqs=6)


@pytest.fixture(scope="module")
def compiled_engine(make_engine):
    return make_engine(compile=True, **SETTINGS)


def compiled_passes(engine, since: int = 0) -> list[int]:
    """Tokens of each forward that ran on a compiled graph, in the engine's recorded steps from `since` on."""
    steps = list(engine.step_stats)[since:]
    return [p.num_tokens for s in steps for p in s.forward_passes if p.compiled]


def _run(engine, prompts, max_tokens=40):
    """Requests join one at a time while others decode (each prompt next to decode rows), so steps of 1 to 6 rows and
    contexts across block edges."""
    with LogitsRecorder(engine) as rec:
        done = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(max_tokens + 7 * i, ignore_eos=True))
            for _ in range(3):
                for out in engine.step():
                    done[out.request_id] = out
        done.update(run_to_completion(engine))
    return {rid: (o.outputs[0].token_ids, torch.stack(rec.logits[rid])) for rid, o in done.items() if o.finished}


def test_compiled_steps_track_float32_and_never_recompile(compiled_engine, make_engine):
    assert compiled_engine.executor.info.compile_seconds > 0
    assert compiled_engine.executor.info.compiled_decode_batch == 6  # native attention: every decode-only step
    compiled_engine.step_stats.clear()
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    ours = _run(compiled_engine, PROMPTS[:6])
    compiled_calls = compiled_passes(compiled_engine)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames_before, "a serving step compiled a new graph"
    # decode steps on every graph (1; 2 on; with torch's low-bit kernels, 2-4 and 5 on); the first prompt ran compiled too
    assert {1, 2, 3, 4, 5, 6} <= set(compiled_calls)
    assert compiled_engine.kv.num_free_blocks == compiled_engine.kv.num_blocks

    ref = _run(make_engine(max_num_seqs=6), PROMPTS[:6])  # float32
    for rid, (tokens, logits) in ours.items():
        ref_tokens, ref_logits = ref[rid]
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        # rows up to and including the first differing choice were computed from the same tokens
        assert (logits[: same + 1] - ref_logits[: same + 1]).abs().max() < LOGIT_TOL, rid


def test_a_step_of_decode_rows_and_new_prompts_runs_as_compiled_parts(compiled_engine):
    """Under load requests join as others decode: the decode rows run as the decode graph and each new prompt as the
    lone-prompt graph, all compiled at start-up. A prompt's later chunks and rows for prompt logprobs stay eager."""
    info = compiled_engine.executor.info
    compiled_engine.step_stats.clear()
    encode = compiled_engine.tokenizer.encode
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]

    def on_prompt_graph(tokens):
        """[len(tokens)] if a lone prompt of these tokens runs on a lone-prompt graph, else []: only if it takes the
        same weights as one of the graphs' trials. With the AMX low-bit kernel every step does; with its AVX512-BF16
        route there is a graph on each side of the 64-row limit; with torch's kernels (4 rows), prompts of 2-4 rows
        run eager."""
        trials = info.compiled_prompt_lengths
        assert LONE_PROMPT_TRIAL_ROWS in trials
        same = any(info.weights.uses_lowbit(len(tokens)) == info.weights.uses_lowbit(n) for n in trials)
        return [len(tokens)] if same else []

    def calls():
        return compiled_passes(compiled_engine)

    prompt = encode("Once upon a time, in a small village,")
    compiled_engine.add_request("solo", prompt, greedy(8, ignore_eos=True))
    compiled_engine.step()  # the whole prompt, alone
    assert calls() == [len(prompt)] == on_prompt_graph(prompt)
    joins = "Water boils at one hundred degrees when"
    compiled_engine.add_request("joins", joins, greedy(6, ignore_eos=True))
    compiled_engine.step()  # solo's decode row, then the new prompt
    assert calls() == [len(prompt), 1, len(encode(joins))] == [len(prompt), 1, *on_prompt_graph(encode(joins))]
    short = encode("The quick brown fox jumps")[:3]
    compiled_engine.add_request("short", short, greedy(2, ignore_eos=True))
    compiled_engine.step()
    assert calls()[3:] == [2, *on_prompt_graph(short)]
    n = len(calls())
    a, b = encode("The quick brown fox"), encode("SELECT name FROM users WHERE")
    assert on_prompt_graph(b)  # long enough for the prompt graph on any CPU
    compiled_engine.add_request("a", a, greedy(2, ignore_eos=True))
    compiled_engine.add_request("b", b, greedy(2, ignore_eos=True))
    compiled_engine.step()  # two prompts next to three decode rows: the decode graph, then each prompt
    assert calls()[n:] == [3, *on_prompt_graph(a), len(b)]
    n = len(calls())
    decoding = sum(r.num_computed_tokens > 0 for r in compiled_engine.scheduler.running)
    compiled_engine.add_request("logprobs", a, greedy(2, ignore_eos=True, prompt_logprobs=1))
    compiled_engine.step()  # every prompt row is wanted: that prompt runs eager, the decode rows compiled
    assert decoding > 1 and calls()[n:] == [decoding]
    run_to_completion(compiled_engine)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames_before, "a serving step compiled a new graph"
    assert compiled_engine.kv.num_free_blocks == compiled_engine.kv.num_blocks


def test_compiled_parts_give_the_tokens_of_eager_steps(compiled_engine, make_engine):
    """Prompts arriving together, several per step and cut into chunks by a small token budget, next to decode rows:
    the compiled parts give the greedy tokens of the eager engine up to near-ties (bf16 rounds differently in the
    graphs)."""
    encode = compiled_engine.tokenizer.encode
    budget = 16
    eager = make_engine(**SETTINGS, max_num_batched_tokens=budget)
    config = compiled_engine.scheduler.config
    runs, default_budget = [], config.max_num_batched_tokens
    try:
        config.max_num_batched_tokens = budget
        for engine in (compiled_engine, eager):
            with LogitsRecorder(engine) as rec:
                engine.add_request("first", encode(PROMPTS[0]), greedy(10, ignore_eos=True))
                engine.step()
                for i, p in enumerate(PROMPTS[1:6]):
                    engine.add_request(f"p{i}", encode(p), greedy(10, ignore_eos=True))
                outs = run_to_completion(engine)
            runs.append(({rid: o.outputs[0].token_ids for rid, o in outs.items()}, rec.logits))
    finally:
        config.max_num_batched_tokens = default_budget
    (ours, _), (ref, ref_logits) = runs
    assert ours.keys() == ref.keys() and len(ours) == 6
    for rid, tokens in ours.items():
        j = next((k for k, (x, y) in enumerate(zip(tokens, ref[rid])) if x != y), None)
        if j is not None:  # where they part, the compiled choice is within a near-tie of the eager best
            row = ref_logits[rid][j]
            assert row[tokens[j]] >= row.max() - LOGIT_TOL, (rid, j)
    assert compiled_engine.kv.num_free_blocks == compiled_engine.kv.num_blocks


def test_each_compiled_model_keeps_its_own_graphs(compiled_engine, tmp_path):
    """A second compiled model in the process (another LLM, a draft model) of other shapes, here a tiny one with an FP8
    KV cache, runs graphs of its own, and the first model's graphs still serve it."""
    prompt = compiled_engine.tokenizer.encode("The capital of France is")
    compiled_engine.add_request("before", prompt, greedy(8, ignore_eos=True))
    before = run_to_completion(compiled_engine)["before"].outputs[0].token_ids

    settings = dict(model=save_tiny_llama(tmp_path / "tiny", 64, seed=3), device="cpu", dtype="float32", kv_cache_dtype="fp8",
                    num_kv_blocks=32, max_num_seqs=4,
                    deterministic=False)  # compiled against eager steps of the same kernels (compile turns it off)
    runs = []
    for compile in (True, False):
        engine = LLMEngine(EngineConfig(compile=compile, **settings), skip_tokenizer=True)
        with LogitsRecorder(engine) as rec:
            for i in range(3):
                engine.add_request(str(i), [5 + i, 9, 17, 33, 2 + i], greedy(12, ignore_eos=True))
            outs = run_to_completion(engine)
        runs.append(({rid: o.outputs[0].token_ids for rid, o in outs.items()},
                     {rid: torch.stack(rows) for rid, rows in rec.logits.items()}))
    (tokens, logits), (eager_tokens, eager_logits) = runs
    assert tokens == eager_tokens
    for rid in logits:
        torch.testing.assert_close(logits[rid], eager_logits[rid], atol=1e-4, rtol=1e-4)

    compiled_engine.add_request("after", prompt, greedy(8, ignore_eos=True))
    assert run_to_completion(compiled_engine)["after"].outputs[0].token_ids == before


def test_compiled_decode_batch_limit(make_engine):
    """With the native attention kernel every decode-only step runs compiled (up to max_num_seqs); with SDPA, only
    steps of up to 4 rows, above which compiled steps measured no faster."""
    def limit(**kw):
        info = make_engine(**SETTINGS, **kw).executor.info
        return compiled_decode_batch_limit(EngineConfig(**SETTINGS, **kw), info.attention_backend)

    assert limit(attention_backend="sdpa") == 4
    assert limit(attention_backend="native") == 6
    assert limit(attention_backend="native", compile_max_decode_batch=3) == 3


def test_compile_settings_are_checked():
    with pytest.raises(InvalidRequestError, match="compile_max_decode_batch must be at least 1"):
        EngineConfig(compile=True, compile_max_decode_batch=0)
