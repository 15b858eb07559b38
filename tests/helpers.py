"""Small helpers shared by tests: run an engine to completion, capture the logits it samples from."""

from __future__ import annotations

import collections

import torch

from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, object]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return done


def run_streams(engine: LLMEngine, work: list, check_integrity: bool = False):
    """Adds the (prompt, params) requests, steps until all are done; returns each request's final output and the text
    its stream delivered (per sample), after checking that no KV block is left behind (and, if asked, the KV
    manager's integrity after every step)."""
    streamed: dict[tuple[str, int], str] = {}
    ids = [engine.add_request(None, p, params) for p, params in work]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                streamed[out.request_id, c.index] = streamed.get((out.request_id, c.index), "") + c.delta_text
            if out.finished:
                done[out.request_id] = out
        if check_integrity:
            engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [done[i] for i in ids], [[streamed[i, c.index] for c in done[i].outputs] for i in ids]


class LogitsRecorder:
    """Keeps the logits of every row the engine samples one token from, per request (executor.watch_logits)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.logits: dict[str, list[torch.Tensor]] = {}
        self._watch = None

    def _record(self, request_ids, logits):
        for rid, row in zip(request_ids, logits):
            self.logits.setdefault(rid, []).append(row.detach().clone())

    def __enter__(self):
        self._watch = self.engine.executor.watch_logits(self._record)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)


LOWBIT_OPS = ("llmserve_kernels::lowbit_linear", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def lowbit_rows(run) -> dict[int, int]:
    """How many low-bit matmuls (llmserve's kernel or torch's) ran at each number of rows while `run()` ran, as
    torch's profiler saw them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    rows = [e.input_shapes[0][0] for e in prof.events() if e.name in LOWBIT_OPS]
    return dict(collections.Counter(rows))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def save_tiny_llama(path, vocab: int, seed: int, layers: int = 2, heads: int = 4, kv_heads: int = 2, max_positions: int = 512,
                    head_scale: float = 1.0) -> str:
    """A random-weight Llama checkpoint (safetensors) small enough to run thousands of requests in a test.
    head_scale > 1 makes a confident model (peaked next-token distributions)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def generate_with_logits(engine: LLMEngine, prompts, params_list) -> tuple[list, list]:
    """Runs the prompts as one batch; returns their outputs and the logits each sampled from, in prompt order."""
    with LogitsRecorder(engine) as rec:
        ids = [engine.add_request(None, p, params) for p, params in zip(prompts, params_list)]
        done = run_to_completion(engine)
    return [done[i] for i in ids], [torch.stack(rec.logits[i]) for i in ids]


def assert_same_generation(outs, logits, ref_outs, ref_logits, atol=1e-4):
    """Equal tokens, and logits within atol + atol * |logit| (two runs that sum in different orders)."""
    for out, ref, lg, ref_lg in zip(outs, ref_outs, logits, ref_logits):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert lg.shape == ref_lg.shape
        torch.testing.assert_close(lg, ref_lg, atol=atol, rtol=atol)  # logits reach |20|: 1e-4 of them too


def assert_each_request_as_if_alone(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> None:
    """Each prompt's logits at every step, run in a batch with the others, are bitwise those it gets alone (the
    deterministic mode's promise)."""
    def logits(batch):
        with LogitsRecorder(engine) as rec:
            for i, p in enumerate(batch):
                engine.add_request(f"r{i}-{len(batch)}", p, greedy(max_tokens, ignore_eos=True))
            run_to_completion(engine)
        return [torch.stack(rec.logits[f"r{i}-{len(batch)}"]) for i in range(len(batch))]

    together = logits(prompts)
    for i, p in enumerate(prompts):
        assert torch.equal(logits([p])[0], together[i]), i


def randomize_weights(model, seed=0):
    """Every parameter drawn from N(0, 0.15), norms' around 1: logits far from ties, unlike a fresh model's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.ndim == 1 else 0.0))
    return model


def save_randomized(model, path):
    """A transformers model with randomized weights, saved as safetensors to `path`; returns it, in eval mode."""
    model = randomize_weights(model).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def random_prompts(vocab: int = 320, lengths=(5, 23, 70), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
