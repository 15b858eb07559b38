"""The executor through its step boundary: StepInputs in, StepOutputs out, on a tiny checkpoint with transformers'
float32 as the reference. No engine, scheduler or KV manager: the inputs are plain data a test can write."""

from __future__ import annotations

import pickle

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.step_io import NewRequestData, ScheduledRow, StepInput, StepOutput
from llmserve.executor import UniprocExecutor
from llmserve.loader import load_model_files
from llmserve.sample.logits_processors import pack_bitmask, unpack_bitmask
from llmserve.sampling_params import SamplingParams
from tests.helpers import save_tiny_llama

transformers = pytest.importorskip("transformers")
VOCAB = 96
PROMPT = [5, 17, 33, 2, 61, 40, 8, 90, 12, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"), VOCAB, seed=11)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def executor(path, **kw) -> UniprocExecutor:
    files = load_model_files(path, load_tokenizer=False)
    return UniprocExecutor(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32, block_size=4, **kw),
                           files.config, files.weights)


def greedy_reference(hf, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


def new(rid, prompt, **params) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(**{"temperature": 0, "max_tokens": 16, **params}), set())


def test_prefill_then_decode_through_step_inputs_give_transformers_tokens(tiny):
    path, hf = tiny
    ex = executor(path)
    table = [7, 3, 12, 0]  # any blocks: the executor only follows the table
    out = ex.execute(StepInput([ScheduledRow("r", PROMPT, 0, table, True)], new_requests=[new("r", PROMPT)]))
    tokens = [out.sampled["r"].token_ids[0]]
    for _ in range(4):
        start = len(PROMPT) + len(tokens) - 1
        out = ex.execute(StepInput([ScheduledRow("r", tokens[-1:], start, table, True, len(tokens))]))
        assert out.sampled["r"].num_accepted == 0 and len(out.sampled["r"].token_ids) == 1
        tokens.append(out.sampled["r"].token_ids[0])
    assert tokens == greedy_reference(hf, PROMPT, 5)


def test_chunked_prompt_rows_that_do_not_sample_return_nothing(tiny):
    path, hf = tiny
    ex = executor(path)
    first = ex.execute(StepInput([ScheduledRow("r", PROMPT[:6], 0, [1, 2, 3], False)], new_requests=[new("r", PROMPT)]))
    assert first.sampled == {}
    last = ex.execute(StepInput([ScheduledRow("r", PROMPT[6:], 6, [1, 2, 3], True)]))
    assert last.sampled["r"].token_ids == greedy_reference(hf, PROMPT, 1)


def test_step_inputs_and_outputs_are_plain_data(tiny):
    """A StepInput survives pickling (as it would on its way to a worker process) and gives the same output."""
    path, _ = tiny
    step = StepInput([ScheduledRow("r", PROMPT, 0, [0, 1, 2], True)],
                     new_requests=[new("r", PROMPT, temperature=0.9, seed=3, logprobs=2)])
    outs = [executor(path).execute(s) for s in (step, pickle.loads(pickle.dumps(step)))]
    assert isinstance(pickle.loads(pickle.dumps(outs[0])), StepOutput)
    assert outs[0].sampled == outs[1].sampled


def test_a_grammar_bitmask_limits_the_sampled_token(tiny):
    """Only the tokens the bitmask allows can be sampled; greedy picks the best of them."""
    path, _ = tiny
    ex = executor(path)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[4, 50, 77]] = True
    mask = pack_bitmask(allowed)
    assert mask.dtype == torch.int32 and torch.equal(unpack_bitmask(mask, VOCAB), allowed)
    seen = []
    with ex.watch_logits(lambda ids, logits: seen.append(logits.clone())):
        greedy = ex.execute(StepInput([ScheduledRow("g", PROMPT, 0, [0, 1, 2], True, grammar_bitmask=mask)],
                                      new_requests=[new("g", PROMPT)]))
    best = max((4, 50, 77), key=lambda t: seen[0][0, t])
    assert greedy.sampled["g"].token_ids == [best]
    sampled = set()
    for i in range(40):
        out = ex.execute(StepInput([ScheduledRow(f"s{i}", PROMPT, 0, [3, 4, 5], True, grammar_bitmask=mask)],
                                   new_requests=[new(f"s{i}", PROMPT, temperature=5.0, seed=i)],
                                   finished_request_ids=[f"s{i - 1}"] if i else []))
        sampled.update(out.sampled[f"s{i}"].token_ids)
    assert sampled <= {4, 50, 77} and len(sampled) > 1


def test_prompt_logprobs_are_transformers_log_softmax(tiny):
    path, hf = tiny
    ex = executor(path)
    out = ex.execute(StepInput([ScheduledRow("p", PROMPT, 0, [0, 1, 2], True, prompt_logprob_range=(0, 9))],
                               new_requests=[new("p", PROMPT, prompt_logprobs=2)]))
    entries = out.prompt_logprobs["p"]
    assert len(entries) == 9
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), -1)
    for p, entry in enumerate(entries):
        target = PROMPT[p + 1]
        assert entry[target] == pytest.approx(float(ref[p, target]), abs=1e-4)
        assert len(entry) in (2, 3) and all(lp <= 0 for lp in entry.values())


def test_block_copies_and_block_reads(tiny):
    """Copy-on-write: a copied block holds the source's K/V, and a sequence continued on the copy decodes as the
    original would."""
    path, hf = tiny
    ex = executor(path)
    ex.execute(StepInput([ScheduledRow("a", PROMPT, 0, [0, 1, 2], True)], new_requests=[new("a", PROMPT)]))
    ex.execute(StepInput([], block_copies=[(2, 9)]))
    torch.testing.assert_close(ex.read_block(9), ex.read_block(2), atol=0, rtol=0)
    first = greedy_reference(hf, PROMPT, 1)[0]
    out = ex.execute(StepInput([ScheduledRow("b", [first], len(PROMPT), [0, 1, 9], True, 1)],
                               new_requests=[new("b", PROMPT)]))
    assert out.sampled["b"].token_ids == greedy_reference(hf, PROMPT + [first], 1)


def test_speculative_rows_accept_what_greedy_would_emit(tiny):
    """A row with drafts (greedy): the drafts that match the target's argmax are accepted, then one token of its own;
    the emitted tokens are what plain greedy decoding gives."""
    path, hf = tiny
    ex = executor(path)
    ref = greedy_reference(hf, PROMPT, 4)
    drafts = [ref[1], ref[2], (ref[3] + 1) % VOCAB]  # two right, then a wrong one
    ex.execute(StepInput([ScheduledRow("s", PROMPT, 0, [0, 1, 2, 3], True)], new_requests=[new("s", PROMPT)]))
    out = ex.execute(StepInput([ScheduledRow("s", [ref[0]] + drafts, len(PROMPT), [0, 1, 2, 3], True, 1,
                                             spec_token_ids=drafts)]))
    row = out.sampled["s"]
    assert row.num_accepted == 2 and row.token_ids == ref[1:4]
