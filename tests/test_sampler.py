"""The sampler on fixed logits: exact filtered distributions (chi-square), penalties against transformers."""

import math

import pytest
import torch

from llmserve.engine.request import Request
from llmserve.errors import InvalidRequestError
from llmserve.sample.sampler import Sampler as BatchedSampler
from llmserve.sampling_params import SamplingParams
from llmserve.worker.input_batch import SamplingRow
from tests.helpers import chi_square_pvalue


class Sampler(BatchedSampler):
    """The sampler, given engine Requests as the worker gives it their SamplingRows."""

    def sample(self, logits, requests):
        return super().sample(logits, [SamplingRow(r.request_id, r.params, r.eos_token_ids, r.prompt_token_ids,
                                                   r.output_token_ids, r.num_output_tokens) for r in requests])

V = 24
N = 20_000  # draws per distribution test
ALPHA = 1e-3  # false-alarm rate of each chi-square test; seeds are fixed, so a pass is reproducible


def fixed_logits(seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 2.0


def make_requests(params: SamplingParams, n: int, prompt=(1, 2, 3)) -> list[Request]:
    return [Request(str(i), list(prompt), params, eos_token_ids=[0]) for i in range(n)]


def draw(params: SamplingParams, logits: torch.Tensor, n: int = N, seed: int = 0, sort_top_p: bool = False) -> torch.Tensor:
    sampler = Sampler(V, torch.device("cpu"), seed=seed, sort_top_p=sort_top_p)
    out = sampler.sample(logits.expand(n, V).clone(), make_requests(params, n))
    return torch.bincount(torch.tensor(out.token_ids), minlength=V).double()


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The filtered distribution, computed directly (descending sort, prefix sums)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    keep = torch.ones(V, dtype=torch.bool)
    if min_p:
        keep &= p >= min_p * p.max()
    if top_k:
        kth = p.sort(descending=True).values[top_k - 1]
        keep &= p >= kth
    if top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        order = q.argsort(descending=True)
        cum = q[order].cumsum(0)
        n_keep = int((cum < top_p).sum()) + 1  # smallest prefix with mass >= top_p
        top = torch.zeros(V, dtype=torch.bool)
        top[order[:n_keep]] = True
        keep &= top
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.5, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=10, top_p=0.9),
    dict(temperature=1.2, min_p=0.05, top_k=8, top_p=0.95),
    dict(temperature=1.0, top_k=100),  # larger than the vocabulary: no filter
    dict(temperature=1.0, top_p=1.0),
]


@pytest.mark.parametrize("sort_top_p", [False, True], ids=["head", "sorted"])  # CPU's top-p route, and a GPU's
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filtered_distribution_is_exact(case, sort_top_p):
    logits = fixed_logits()
    counts = draw(SamplingParams(**case), logits, sort_top_p=sort_top_p)
    probs = reference(logits, **{k: (v if not (k == "top_k" and v >= V) else 0) for k, v in case.items()})
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    assert chi_square_pvalue(counts, probs) > ALPHA


@pytest.mark.parametrize("sort_top_p", [False, True], ids=["head", "sorted"])
def test_top_p_set_larger_than_the_head(sort_top_p):
    """A flat distribution over 2,048 tokens whose top-p set holds far more than the sampler's 512-token head: both
    routes give the exact filtered distribution (the head route falls back to a sort for that row), beside a top-k
    row and an unfiltered one in the same batch, and draw only from it."""
    vocab = 2048
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    p = torch.softmax(logits.double(), dim=-1)
    order = p.argsort(descending=True)
    n_keep = int((p[order].cumsum(0) < 0.9).sum()) + 1
    assert n_keep > 512
    want = torch.zeros(vocab, dtype=torch.float64)
    want[order[:n_keep]] = p[order[:n_keep]]
    want /= want.sum()
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=7), SamplingParams(), SamplingParams(top_p=0.9, seed=5)]
    sampler = BatchedSampler(vocab, torch.device("cpu"), sort_top_p=sort_top_p)
    probs = sampler.final_probs(logits.expand(len(params), vocab).clone(), params).double()
    for row in (0, 3):
        assert torch.equal(probs[row] > 0, want > 0)
        assert torch.allclose(probs[row], want, atol=1e-7)
    assert int((probs[1] > 0).sum()) == 7 and bool((probs[2] > 0).all())
    reqs = make_requests(SamplingParams(top_p=0.9), 2000)
    tokens = torch.tensor(Sampler(vocab, torch.device("cpu"), sort_top_p=sort_top_p).sample(
        logits.expand(2000, vocab).clone(), reqs).token_ids)
    assert bool((want[tokens] > 0).all())


def test_dense_penalties_equal_the_sparse_ones():
    """Off the CPU the penalties run over every entry (no read-back of which are seen): bit for bit what the CPU's
    seen-entries-only arithmetic gives, for positive and negative logits, prompt-only and output tokens."""
    from llmserve.sample.penalties import apply_penalties

    g = torch.Generator().manual_seed(11)
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, generator=g) * 3
    counts = torch.randint(0, 4, (rows, vocab), generator=g, dtype=torch.int32) * (torch.rand(rows, vocab, generator=g) < 0.1)
    in_prompt = torch.rand(rows, vocab, generator=g) < 0.05
    penalties = (torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1, 1.0]), torch.tensor([0.0, 0.5, -0.4, 1.0, 0.2, 0.0]),
                 torch.tensor([0.0, 0.3, 0.7, -0.5, 0.0, 1.5]))
    sparse = apply_penalties(logits.clone(), counts, in_prompt, *penalties, dense=False)
    dense = apply_penalties(logits.clone(), counts, in_prompt, *penalties, dense=True)
    assert torch.equal(sparse, dense) and not torch.equal(sparse, logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU suite, benchmarks/gpu_suite.sh)")
def test_sampling_is_launched_without_waiting_for_the_device():
    """On a GPU, queueing a step's sampling (temperature, top-k, top-p, min-p, seeded rows; penalties, logit bias,
    banned and allowed ids, min_tokens) reads nothing back from the device, so async output processing and async scheduling overlap the step: torch's sync debug mode raises at
    any synchronizing call."""
    rows = make_requests(SamplingParams(temperature=0.8, top_p=0.9), 3) + make_requests(
        SamplingParams(top_k=5, top_p=0.7, min_p=0.05), 2) + make_requests(SamplingParams(top_p=0.95, seed=3), 2) + \
        make_requests(SamplingParams(temperature=0), 2) + make_requests(SamplingParams(
            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={3: 2.0},
            bad_words_ids=[4], min_tokens=2, allowed_token_ids=[1, 2, 3, 5, 6]), 2)
    sampler = Sampler(V, torch.device("cuda"))
    logits = torch.randn(len(rows), V, device="cuda")
    sampling = [SamplingRow(r.request_id, r.params, r.eos_token_ids, r.prompt_token_ids, r.output_token_ids,
                            r.num_output_tokens) for r in rows]
    torch.cuda.set_sync_debug_mode("error")
    try:
        fetch = BatchedSampler.sample_deferred(sampler, logits, sampling)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = fetch()
    assert len(out.token_ids) == len(rows) and all(0 <= t < V for t in out.token_ids)


def test_tiny_top_p_is_greedy():
    logits = fixed_logits()
    counts = draw(SamplingParams(temperature=1.0, top_p=1e-6), logits, n=500)
    assert counts[logits.argmax()] == 500


def test_temperature_near_zero_is_greedy():
    logits = fixed_logits()
    counts = draw(SamplingParams(temperature=1e-6), logits, n=200)
    assert counts[logits.argmax()] == 200


def test_ties_at_top_k_cutoff_are_kept():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0] + [-5.0] * (V - 4))
    counts = draw(SamplingParams(temperature=1.0, top_k=2), logits, n=6000)
    assert counts[4:].sum() == 0
    assert (counts[1:4] > 0).all()  # the three tied at the cutoff all stay
    probs = reference(logits, top_k=2)
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_rows_with_different_parameters_in_one_batch():
    logits = fixed_logits()
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5)]
    reqs = []
    for j, p in enumerate(mixed):
        reqs += [Request(f"{j}-{i}", [1], p, [0]) for i in range(4000)]
    out = torch.tensor(Sampler(V, torch.device("cpu")).sample(logits.expand(len(reqs), V).clone(), reqs).token_ids)
    greedy, topk, topp = out[:4000], out[4000:8000], out[8000:]
    assert (greedy == logits.argmax()).all()
    for counts, probs in ((torch.bincount(topk, minlength=V).double(), reference(logits, top_k=3)),
                          (torch.bincount(topp, minlength=V).double(), reference(logits, top_p=0.5))):
        assert counts[probs == 0].sum() == 0
        assert chi_square_pvalue(counts, probs) > ALPHA


def test_penalties_match_transformers_processors():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g) * 3  # plenty of negative logits
    prompts = [[1, 2, 3], [4, 5], [6]]
    outputs = [[3, 7, 7, 8], [9], []]
    params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    reqs = []
    for i, (pr, out) in enumerate(zip(prompts, outputs)):
        r = Request(str(i), pr, params, [0])
        for t in out:
            r.append_output_token(t)
        reqs.append(r)
    sampler = Sampler(V, torch.device("cpu"))

    # Expected: transformers' repetition processor over prompt+output, then OpenAI's frequency/presence.
    expected = logits.clone()
    rep = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    for i, r in enumerate(reqs):
        ids = torch.tensor([r.all_token_ids])
        expected[i] = rep(ids, expected[i : i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=V).float()
        expected[i] -= 0.5 * counts + 0.25 * (counts > 0).float()
    out = sampler.sample(logits.clone(), reqs)
    assert out.token_ids == expected.argmax(-1).tolist()
    # exact values: ask for logprobs at temperature 0 (computed at temperature 1 after penalties)
    lp_params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, logprobs=20)
    for r in reqs:
        r.params = lp_params
    out = Sampler(V, torch.device("cpu")).sample(logits.clone(), reqs)
    for i in range(3):
        ref = torch.log_softmax(expected[i], -1)
        assert len(out.logprobs[i]) == 20
        for t, v in out.logprobs[i].items():
            assert v == pytest.approx(float(ref[t]), abs=1e-5)


def test_logit_bias_and_bans():
    logits = torch.zeros(2, V)
    p = SamplingParams(temperature=0, logit_bias={5: 100, 6: 500}, bad_words_ids=[6])
    reqs = make_requests(p, 2)
    assert Sampler(V, torch.device("cpu")).sample(logits, reqs).token_ids == [5, 5]
    assert p.logit_bias[6] == 100  # clamped as OpenAI does


def test_allowed_token_ids():
    counts = draw(SamplingParams(temperature=1.0, allowed_token_ids=[3, 4]), fixed_logits(), n=2000)
    assert counts.sum() == counts[3] + counts[4] and counts[3] > 0 and counts[4] > 0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 0] = 50  # eos
    logits[0, 9] = 40  # a stop token id
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    r = make_requests(p, 1)[0]
    assert Sampler(V, torch.device("cpu")).sample(logits.clone(), [r]).token_ids[0] not in (0, 9)
    r.append_output_token(5)
    r.append_output_token(5)
    assert Sampler(V, torch.device("cpu")).sample(logits.clone(), [r]).token_ids == [0]


def test_seeded_rows_ignore_neighbours():
    logits = fixed_logits()
    p = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(V, torch.device("cpu"), seed=1).sample(logits.expand(1, V).clone(), [Request("s", [1], p, [0])]).token_ids
    for batch in (3, 17):
        reqs = [Request(f"n{i}", [1], SamplingParams(temperature=1.0), [0]) for i in range(batch)]
        reqs.insert(batch // 2, Request("s", [1], p, [0]))
        out = Sampler(V, torch.device("cpu"), seed=batch).sample(logits.expand(batch + 1, V).clone(), reqs).token_ids
        assert out[batch // 2] == alone[0]


def test_logprobs_are_a_distribution_and_match_logits():
    logits = fixed_logits()
    p = SamplingParams(temperature=0.7, logprobs=5)
    out = Sampler(V, torch.device("cpu")).sample(logits.expand(4, V).clone(), make_requests(p, 4))
    ref = torch.log_softmax(logits / 0.7, -1)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) in (5, 6)
        assert sum(math.exp(v) for v in lp.values()) <= 1 + 1e-6
        assert lp[tok] == pytest.approx(float(ref[tok]), abs=1e-5)


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(logprobs=-2), "logprobs"),  # the most a request may ask for is the engine's --max-logprobs
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["x"] * 33), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(temperature="hot"), "temperature"),
    (dict(seed=1.5), "seed"),
])
def test_bad_values_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)
