"""llmserve's low-bit matmul (llmserve/kernels/lowbit_linear.cpp), by each of its routes (AMX tiles; AVX512-BF16
without AMX; AVX2 for float32 activations, as they are or quantized to int8), and the engine serving on it.

The kernel is checked against the float64 product of the same bf16 activations and the weight it dequantizes to,
over row counts on both sides of its passes (16-row tiles and 32-row passes with AMX, 12-row passes with
AVX512-BF16); the only rounding it adds is the float32 sum and the output's bf16 (2^-8 relative at most). On the
default model's weights it must rebuild exactly the bf16 weights the bf16 path holds (the file's Q4_1 and Q8_0
blocks), so an engine serving on it chooses the same greedy tokens as bf16, up to near-ties from the summation
order."""

import pytest
import torch

from llmserve import kernels
from llmserve.layers.quant import GroupWeight
from llmserve.platforms.cpu import cpu_has_fast_bf16
from llmserve.errors import InvalidRequestError
from tests.helpers import greedy, lowbit_rows, run_to_completion
from tests.test_continuous_batching import PROMPTS
from tests.test_precision_modes import TIE_TOL, _recorded


@pytest.fixture(scope="module")
def make_engine(make_cpu_engine):
    return make_cpu_engine  # this module tests CPU-only features


ISA = kernels.lowbit_linear_isa()
# A CPU with AMX has AVX512-BF16 too, so both routes run (and are tested) there.
ROUTES = {"amx": ["amx", "avx512_bf16"], "avx512_bf16": ["avx512_bf16"]}.get(ISA, [])
requires_kernel = pytest.mark.skipif(not ROUTES, reason=f"no low-bit kernel here ({kernels.build_error() or 'CPU without AMX or AVX512-BF16'})")
requires_amx = pytest.mark.skipif(ISA != "amx", reason="CPU without AMX")
requires_vnni = pytest.mark.skipif(kernels.lowbit_linear_int8_isa() != "avx512_int8",
                                   reason=f"no bf16 int8 route here ({kernels.build_error() or 'CPU without AVX512-VNNI'})")
requires_avx2 = pytest.mark.skipif(kernels.lowbit_linear_float32_isa() != "avx2",
                                   reason=f"no float32 low-bit route here ({kernels.build_error() or 'CPU without AVX2'})")


def _matmul_bound(x, w):
    """|error| allowed: the output's bf16 rounding, plus the bf16 rounding of each weight (steps of more than a few
    rows multiply by the weights rounded to bf16, as the bf16 path does; fewer rows by their exact float32 values)
    and float32 summation. A wrong code or scale would cost a whole quantization step, 1/15 of a group's range."""
    ref = x.double() @ w.double().T
    return ref, 2**-8 * ref.abs() + (2**-9 + 1e-5) * (x.double().abs() @ w.double().abs().T)


@requires_kernel
@pytest.mark.parametrize("route", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_f,in_f", [(32, 32), (96, 576), (64, 1536)])
def test_kernel_matches_float64(route, bits, out_f, in_f):
    if route not in ROUTES:
        pytest.skip(f"no {route} route on this CPU")
    g = torch.Generator().manual_seed(out_f + in_f + bits)
    w = GroupWeight(torch.randn(out_f, in_f, generator=g) * 0.05, bits, route)
    dense = w.dequantize()
    # partial tiles, one or two tiles a pass, one or more passes (AMX: 16 and 32 rows; AVX512-BF16: 12, and up to 8
    # rows with the codes built in registers, both tiles at once up to 4, one at a time from 5)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 24, 25, 31, 32, 33, 70):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        y = w.matmul(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        ref, bound = _matmul_bound(x, dense)
        assert ((y.double() - ref).abs() <= bound).all(), (rows, ((y.double() - ref).abs() - bound).max())
    assert w.matmul(torch.empty(0, in_f, dtype=torch.bfloat16)).shape == (0, out_f)


@requires_avx2
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_f,in_f", [(32, 32), (96, 576), (64, 1536)])
def test_avx2_route_matches_float64(bits, out_f, in_f):
    """float32 activations, float32 result: the weights are multiplied at their float32 values (code * scale +
    offset, rounded once), so the only error is float32 rounding, far below a quantization step; and each row's
    result is the same whatever the number of rows."""
    g = torch.Generator().manual_seed(out_f + in_f + bits)
    w = GroupWeight(torch.randn(out_f, in_f, generator=g) * 0.05, bits, "avx2")
    dense = w.dequantize().double()
    for rows in (1, 2, 5, 6, 7, 12, 13, 70):  # one row, and passes of 6 rows, full and partial
        x = torch.randn(rows, in_f, generator=g)
        y = w.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (rows, out_f)
        ref = x.double() @ dense.T
        bound = 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-6
        assert ((y.double() - ref).abs() <= bound).all(), (rows, ((y.double() - ref).abs() - bound).max())
        for i in (0, rows - 1):  # batch-invariant: a row alone gives the same bits as within any step
            assert torch.equal(w.matmul(x[i:i + 1]), y[i:i + 1]), (rows, i)
    assert w.matmul(torch.empty(0, in_f)).shape == (0, out_f)
    with pytest.raises(RuntimeError, match="x must be 2-D float32 on this route"):
        w.matmul(x.bfloat16())
    with pytest.raises(RuntimeError, match=f"x has {in_f - 16} columns, the weight {in_f}"):
        w.matmul(x[:, :in_f - 16].contiguous())


def _int8_reference(x, w: GroupWeight):
    """What the int8 routes compute, in float64: each row's activations rounded to int8 per group of 32 (step
    = max |x| / 127; x * (127 / max |x|) in float32, as the kernels round it) against code * scale, plus offset times
    the group's float32 sum of x (not of its int8 copy)."""
    groups = x.view(x.shape[0], -1, 32).float()
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127) / amax  # tensor / tensor divides; 127 / tensor multiplies by a reciprocal
    codes = torch.round(groups * torch.where(amax > 0, inv, torch.zeros_like(amax)))
    q = codes.double() * (amax.double() / 127)
    dense = w.dequantize().double()
    if w.offsets is None:
        return q.view_as(x) @ dense.T
    out_f, in_f = dense.shape
    offsets = w.offsets.transpose(1, 2).reshape(out_f, in_f // 32, 1).double().expand(-1, -1, 32).reshape(out_f, in_f)
    return q.view_as(x) @ (dense - offsets).T + x.double() @ offsets.T


@pytest.mark.parametrize("route,bits", [("avx2_int8", 4), ("avx2_int8", 8), ("avx512_int8", 4)])
@pytest.mark.parametrize("out_f,in_f", [(32, 32), (96, 576), (64, 1536)])
def test_int8_routes_match_their_quantized_activations(route, bits, out_f, in_f):
    """Integer sums are exact, so each int8 route matches the float64 product of the int8-rounded activations to
    its output's rounding (float32 on avx2_int8, bf16 on avx512_int8), whatever the number of rows (passes of 4 or
    12, full and partial), bit for bit for a row alone; an all-zero group and a constant weight group stay exact.
    Against the unrounded activations the error is about quantization noise: at most half an activation step per
    product."""
    dtype = torch.float32 if route == "avx2_int8" else torch.bfloat16
    if kernels.lowbit_linear_int8_route(dtype) != route:
        pytest.skip(f"no {route} route here ({kernels.build_error() or 'CPU without its instructions'})")
    g = torch.Generator().manual_seed(out_f + in_f + bits)
    weight = torch.randn(out_f, in_f, generator=g) * 0.05
    weight[:, :32] = 0.02  # scale 0: every code 0, the offset carries the group
    w = GroupWeight(weight, bits, route)
    dense = w.dequantize().double()
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 25, 70):
        x = torch.randn(rows, in_f, generator=g).to(dtype)
        x[0, :32] = 0  # step 0
        y = w.matmul(x)
        assert y.dtype == dtype and y.shape == (rows, out_f)
        ref = _int8_reference(x, w)
        bound = 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-6 + (2**-8 * ref.abs() if dtype == torch.bfloat16 else 0)
        assert ((y.double() - ref).abs() <= bound).all(), (rows, ((y.double() - ref).abs() - bound).max())
        half_step = (x.view(rows, -1, 32).abs().amax(-1) / 254).double().repeat_interleave(32, dim=1)
        assert ((y.double() - x.double() @ dense.T).abs() <= half_step @ dense.abs().T + bound).all()
        for i in (0, rows - 1):
            assert torch.equal(w.matmul(x[i:i + 1]), y[i:i + 1]), (rows, i)
    assert w.matmul(torch.empty(0, in_f, dtype=dtype)).shape == (0, out_f)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match=f"x must be 2-D {'float32' if dtype == torch.float32 else 'bfloat16'} on this route"):
        w.matmul(x.to(other))


@requires_vnni
def test_avx512_int8_route_takes_4_bit_codes_only():
    w = GroupWeight(torch.randn(32, 64), 8, "avx512_int8")
    with pytest.raises(RuntimeError, match="the 'avx512_int8' route takes 4-bit codes only"):
        w.matmul(torch.randn(2, 64).bfloat16())


@requires_avx2
def test_engine_in_float32_with_w4a8_near_float32(make_engine):
    """decode_quantization w4a8 (opt-in) in float32 on an AVX2 CPU multiplies the Q4_1 codes against int8
    activations, as llama.cpp does; the LM head and the QKV projection keep float32 activations. Every step runs on it, with float32's
    greedy tokens up to near-ties and logits within 6.0 (activation rounding, measured 2.9 on Zen 1, 3.6 on Zen 4; test_precision_modes,
    which also checks batched against alone)."""
    engine = make_engine(dtype="float32", decode_quantization="w4a8")
    w = engine.executor.info.weights
    assert (w.decode_quantization, w.lowbit_kernel, w.lowbit_max_rows) == ("w4a8", "avx2", None)
    assert all(method == ("int8/avx2" if n.endswith("lm_head") else "int4/avx2" if n.endswith("qkv_proj")
                          else "int4/avx2_int8") for n, method in w.methods.items())
    assert w.float_weight_bytes == 0
    assert _rows_on_the_kernel(engine) == EVERY_STEP_ON_THE_KERNEL
    _assert_same_greedy_tokens_as(engine, make_engine, "float32", logit_tol=6.0)


@requires_vnni
def test_engine_in_bf16_with_w4a8_takes_the_vnni_route_near_bf16(make_engine):
    """decode_quantization w4a8 in bf16 on an AVX512-VNNI CPU: the Q4_1 codes against int8 activations on every
    step; the LM head and the QKV projection keep bf16 activations (the AVX512-BF16 or AMX route). bf16's greedy
    tokens up to near-ties, logits within 6.0 (activation rounding, measured 4.6 on Zen 4; test_precision_modes)."""
    engine = make_engine(dtype="bfloat16", decode_quantization="w4a8")
    w = engine.executor.info.weights
    assert (w.decode_quantization, w.lowbit_kernel, w.lowbit_max_rows) == ("w4a8", ISA, None)
    assert all(method == (f"int8/{ISA}" if n.endswith("lm_head") else f"int4/{ISA}" if n.endswith("qkv_proj")
                          else "int4/avx512_int8") for n, method in w.methods.items())
    assert w.float_weight_bytes == 0
    assert _rows_on_the_kernel(engine) == EVERY_STEP_ON_THE_KERNEL
    _assert_same_greedy_tokens_as(engine, make_engine, "bfloat16", logit_tol=6.0)


def test_w4a8_bad_settings_are_refused(make_engine, monkeypatch):
    message = "w4a8 runs on CPU with llmserve's kernels only: in float32 on a CPU with AVX2, FMA and F16C, or in bfloat16 with AVX512-VNNI"
    monkeypatch.setattr(kernels, "lowbit_linear_float32_isa", lambda: None)  # a CPU or build without the routes
    monkeypatch.setattr(kernels, "lowbit_linear_int8_isa", lambda: None)
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(InvalidRequestError, match=message):
            make_engine(dtype=dtype, decode_quantization="w4a8")
    assert make_engine(dtype="float32", decode_quantization="auto").executor.info.weights.decode_quantization == "int4"


@requires_avx2
def test_engine_in_float32_serves_every_step_on_avx2_with_float32s_tokens(make_engine):
    """A float32 engine (the default on CPUs without native bf16) on the default Q4_1 model takes its int4 codes on
    the AVX2 route for every step and drops the float32 copy of the layers, choosing float32's greedy tokens up to
    near-ties."""
    engine = make_engine(dtype="float32")
    w = engine.executor.info.weights
    assert (w.decode_quantization, w.lowbit_kernel, w.lowbit_max_rows) == ("int4", "avx2", None)
    assert all(method == ("int8/avx2" if n.endswith("lm_head") else "int4/avx2") for n, method in w.methods.items())
    assert w.float_weight_bytes == 0
    assert _rows_on_the_kernel(engine) == EVERY_STEP_ON_THE_KERNEL  # the prefill too
    _assert_same_greedy_tokens_as(engine, make_engine, "float32", logit_tol=0.05)  # float32 rounding only


def test_auto_dtype_is_float32_on_cpus_without_native_bf16(monkeypatch):
    """Where oneDNN has no native bf16 (AVX2-only CPUs) bf16 matmuls are emulated, ~4x slower than float32."""
    from llmserve.config import EngineConfig
    from llmserve.platforms import cpu, get_platform

    assert cpu.cpu_has_fast_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    platform = get_platform("cpu")
    for native, expected in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(cpu, "cpu_has_fast_bf16", lambda native=native: native)
        assert platform.resolve_dtype(EngineConfig(device="cpu")) == expected
        assert platform.resolve_dtype(EngineConfig(device="cpu", dtype="bfloat16")) == torch.bfloat16
        assert platform.resolve_dtype(EngineConfig(device="cpu", dtype="float32")) == torch.float32


@requires_kernel
@pytest.mark.parametrize("name,bits", [("model.layers.0.self_attn.q_proj.weight", 4),
                                       ("model.layers.7.mlp.down_proj.weight", 4),
                                       ("model.embed_tokens.weight", 8)])
def test_rebuilds_the_files_weights_exactly(default_files, name, bits):
    """Q4_1 layers and the Q8_0 embedding (the tied LM head): the weight the kernel multiplies by is the bf16 weight."""
    w = next(t for n, t in default_files.weights() if n == name)
    assert torch.equal(GroupWeight(w, bits).dequantize().bfloat16(), w.bfloat16())


@requires_kernel
def test_generic_weights_round_to_the_nearest_code():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    groups = w.view(64, -1, 32)
    for bits, step in ((4, (groups.amax(-1) - groups.amin(-1)) / 15), (8, groups.abs().amax(-1) / 127)):
        err = (GroupWeight(w, bits).dequantize() - w).abs().view(64, -1, 32)
        # half a step, plus the float16 rounding of scale and offset (under 2^-11 of a code's value) and the bf16
        # rounding of the weight (2^-9 of it)
        bound = (0.5 + 127 * 2**-11) * step.unsqueeze(-1) + 2**-8 * groups.abs()
        assert (err <= bound).all() and (err / step.unsqueeze(-1)).mean() > 0.1, bits
    flat = torch.zeros(32, 64)  # a constant group: scale 0
    assert torch.equal(GroupWeight(flat, 4).dequantize(), flat)
    assert torch.equal(GroupWeight(flat + 0.5, 4).dequantize(), flat + 0.5)


@requires_kernel
def test_kernel_rejects_mismatched_inputs():
    w4, w8 = GroupWeight(torch.randn(64, 64), 4), GroupWeight(torch.randn(64, 64), 8)

    def op(x, codes, scales, offsets, route=ISA):
        return torch.ops.llmserve_kernels.lowbit_linear(x, codes, scales, offsets, route)

    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="the 'tiles' route is not available on this CPU or build"):
        op(x, w4.codes, w4.scales, w4.offsets, "tiles")
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        op(x.float(), w4.codes, w4.scales, w4.offsets)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        op(x[:, :32].contiguous(), w4.codes, w4.scales, w4.offsets)
    with pytest.raises(RuntimeError, match="4-bit codes need offsets"):
        op(x, w4.codes, w4.scales, None)
    with pytest.raises(RuntimeError, match="8-bit codes take none"):
        op(x, w8.codes, w8.scales, w4.offsets)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        op(x, w4.codes, w4.scales.float(), w4.offsets)
    with pytest.raises(RuntimeError, match="512 .4-bit. or 1024 .8-bit. bytes"):
        op(x, w4.codes[:, :, :256].contiguous(), w4.scales, w4.offsets)


@requires_kernel
@pytest.mark.parametrize("route", ["amx", "avx512_bf16"])
def test_engine_serves_every_step_on_the_kernel_with_bf16s_tokens(make_engine, monkeypatch, route):
    """By either route (AVX512-BF16 forced here on a CPU with AMX too), llmserve's kernel serves every step and the
    bf16 copy is dropped."""
    if route not in ROUTES:
        pytest.skip(f"no {route} route on this CPU")
    monkeypatch.setattr(kernels, "lowbit_linear_isa", lambda: route)
    engine = make_engine(dtype="bfloat16")
    w = engine.executor.info.weights
    assert (w.decode_quantization, w.lowbit_kernel, w.lowbit_max_rows) == ("int4", route, None)
    assert all(method == (f"int8/{route}" if n.endswith("lm_head") else f"int4/{route}")
               for n, method in w.methods.items())
    assert w.float_weight_bytes == 0  # (the tied embedding keeps its own weight: the greedy tokens below need it)
    assert _rows_on_the_kernel(engine) == EVERY_STEP_ON_THE_KERNEL  # the prefill too
    _assert_same_greedy_tokens_as(engine, make_engine, "bfloat16")


# A 40-token prompt that decodes 3 tokens, every step on the kernel: the 4 projections of 30 layers at 40 rows, then
# at 1 row twice; the LM head at 1 row in each of the 3 steps (only the sampled row's logits are computed).
EVERY_STEP_ON_THE_KERNEL = {40: 4 * 30, 1: 2 * 4 * 30 + 3}


def _rows_on_the_kernel(engine) -> dict[int, int]:
    def run():
        engine.add_request("long", list(range(100, 140)), greedy(3, ignore_eos=True))
        run_to_completion(engine)

    return lowbit_rows(run)


def _assert_same_greedy_tokens_as(engine, make_engine, dtype: str, logit_tol: float | None = None):
    """Greedy tokens equal to the engine of this dtype without low-bit weights, up to near-ties; with logit_tol, the
    logits of rows computed from the same tokens within it. And no KV block left behind."""
    ours = _recorded(engine, PROMPTS)
    ref = _recorded(make_engine(dtype=dtype, decode_quantization="none"), PROMPTS)
    for rid, (tokens, logits) in ours.items():
        ref_tokens, ref_logits = ref[rid]
        j = next((k for k, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        if j is not None:  # only a near-tie may go the other way
            assert ref_logits[j][tokens[j]] >= ref_logits[j].max() - TIE_TOL, (rid, j)
        if logit_tol is not None:
            same = len(tokens) if j is None else j + 1
            assert (logits[:same] - ref_logits[:same]).abs().max() < logit_tol, rid
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@requires_kernel
def test_a_row_limit_keeps_bf16_weights_for_larger_steps(make_engine):
    """--decode-quantization-max-rows 64: steps of up to 64 rows take the kernel, larger ones the bf16 weights, kept
    packed."""
    engine = make_engine(dtype="bfloat16", decode_quantization_max_rows=64)
    w = engine.executor.info.weights
    assert (w.lowbit_kernel, w.lowbit_max_rows) == (ISA, 64)
    assert w.methods["model.layers.0.mlp.down_proj"] == f"int4/{ISA} up to 64 rows, else onednn_packed"
    assert w.uses_lowbit(64) and not w.uses_lowbit(65)

    def run():
        for rid, prompt in (("short", range(100, 140)), ("long", range(200, 270))):
            engine.add_request(rid, list(prompt), greedy(2, ignore_eos=True))
            run_to_completion(engine)

    # the 70-token prompt took the bf16 weights; each of the 4 steps' one logits row took the LM head's codes
    assert lowbit_rows(run) == {40: 4 * 30, 1: 2 * 4 * 30 + 4}
    _assert_same_greedy_tokens_as(engine, make_engine, "bfloat16")


def test_without_the_kernel_torchs_serve_small_steps(make_engine, monkeypatch):
    """No low-bit kernel of llmserve's (no compiler, or a CPU without AMX or AVX512-BF16): torch's int4 kernel
    serves steps of up to 4 rows and the bf16 weights stay for the rest."""
    monkeypatch.setattr(kernels, "lowbit_linear_isa", lambda: None)
    engine = make_engine(dtype="bfloat16")
    w = engine.executor.info.weights
    assert (w.lowbit_kernel, w.lowbit_max_rows) == ("torch", 4)
    fallback = "onednn_packed" if cpu_has_fast_bf16() else "float"  # packed only where oneDNN does bf16
    assert w.methods["model.layers.0.mlp.down_proj"] == f"int4/torch up to 4 rows, else {fallback}"
    assert w.float_weight_bytes > 0 or fallback == "onednn_packed"
    assert w.uses_lowbit(4) and not w.uses_lowbit(5)
