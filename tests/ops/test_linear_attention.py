"""chunkscan.linear_attention against its per-step oracle: values, the five
gradients, resets, low precision, compile, checks, and backward memory."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import gated_delta_inputs, max_rel, peak_growth

from chunkscan import linear_attention, naive_recurrent_linear_attention

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dh0")
# float32 against the float32 oracle: measured at most 4.7e-7 over the cases of
# test_matches_the_oracle (values, final state, five gradients); the bound is about 10x.
FP32_TOL = 5e-6
# Second derivatives, float32 against the oracle: measured at most 4.9e-7
# (test_second_derivative_matches_the_oracle); the bound is about 10x.
SECOND_TOL = 5e-6


def inputs(B, T, Hk, Hv, Dk, Dv, seed=0, dtype=mx.float32):
    """``q, k, v, g, h0`` (``gated_delta_inputs``' ranges: unit keys, g in [-0.5, -0.01])."""
    q, k, v, g, _, h0 = gated_delta_inputs(B, T, Hk, Hv, Dk, Dv, dtype=dtype, seed=seed)
    return q, k, v, g, h0


def outputs_and_grads(fn, q, k, v, g, h0, *, compiled=False, exact_in=None, **kwargs):
    """``[o, final_state, dq, dk, dv, dg, dh0]`` under random cotangents (values
    representable in ``exact_in`` where given: a low-precision output's cotangent is
    then not rounded)."""
    B, T, Hv, Dv = v.shape
    w = mx.random.normal((B, T, Hv, Dv), key=mx.random.key(11))
    ws = mx.random.normal(h0.shape, key=mx.random.key(12))
    if exact_in is not None:
        w, ws = (x.astype(exact_in).astype(mx.float32) for x in (w, ws))

    def run(q, k, v, g, h0):
        return fn(q, k, v, g, initial_state=h0, **kwargs)

    def loss(q, k, v, g, h0):
        o, s = run(q, k, v, g, h0)
        return mx.sum(o.astype(mx.float32) * w) + mx.sum(s * ws)

    grad = mx.grad(loss, argnums=(0, 1, 2, 3, 4))
    if compiled:
        run, grad = mx.compile(run), mx.compile(grad)
    return [*run(q, k, v, g, h0), *grad(q, k, v, g, h0)]


def assert_close(got, ref, tol=FP32_TOL):
    errors = {n: max_rel(a, b) for n, a, b in zip(NAMES, got, ref)}
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"max relative error above {tol}: {bad}"


CASES = [  # (B, T, Hk, Hv, Dk, Dv, C)
    (1, 1, 1, 1, 4, 4, 64),
    (2, 37, 2, 4, 8, 5, 16),  # T not a multiple of C, Hv = 2 Hk, Dk != Dv
    (1, 64, 1, 3, 6, 9, 64),  # one chunk, three value heads to a key head
    (1, 65, 2, 2, 16, 16, 1),
    (1, 100, 1, 2, 8, 8, 7),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_matches_the_oracle(case):
    B, T, Hk, Hv, Dk, Dv, C = case
    xs = inputs(B, T, Hk, Hv, Dk, Dv)
    ref = outputs_and_grads(naive_recurrent_linear_attention, *xs)
    assert_close(outputs_and_grads(linear_attention, *xs, chunk_size=C), ref)


def test_no_gate_and_a_scale():
    """``g=None`` is plain linear attention (the oracle with zero gates; no ``dg``)."""
    q, k, v, g, h0 = inputs(1, 40, 1, 2, 8, 8)
    zero = mx.zeros_like(g)
    got = linear_attention(q, k, v, initial_state=h0, scale=0.3, chunk_size=16)
    ref = naive_recurrent_linear_attention(q, k, v, zero, initial_state=h0, scale=0.3)
    assert max_rel(got[0], ref[0]) <= FP32_TOL and max_rel(got[1], ref[1]) <= FP32_TOL


def test_compiled_is_eager():
    xs = inputs(2, 37, 2, 4, 8, 5)
    eager = outputs_and_grads(linear_attention, *xs, chunk_size=16)
    assert_close(outputs_and_grads(linear_attention, *xs, chunk_size=16, compiled=True), eager)


def test_minus_inf_resets_the_state():
    """``g_t = -inf``: the outputs from ``t`` on are those of a call starting at ``t``
    from a zero state, and nothing is NaN, values or gradients (every span of gates is
    a sum of the gates it covers: no ``-inf - (-inf)``)."""
    T, t, C = 40, 21, 16
    q, k, v, g, h0 = inputs(1, T, 1, 2, 8, 8)
    g = mx.where((mx.arange(T) == t)[None, :, None], -mx.inf, g)
    got = outputs_and_grads(linear_attention, q, k, v, g, h0, chunk_size=C)
    for name, x in zip(NAMES, got):
        assert not mx.isnan(x).any().item(), name
    tail = [x[:, t:] for x in (q, k, v, g)]
    o_tail, s_tail = linear_attention(*tail, initial_state=mx.zeros_like(h0), chunk_size=C)
    assert max_rel(got[0][:, t:], o_tail) <= FP32_TOL
    assert max_rel(got[1], s_tail) <= FP32_TOL
    assert_close(got, outputs_and_grads(naive_recurrent_linear_attention, q, k, v, g, h0))


@pytest.mark.parametrize("dtype, bound", [(mx.bfloat16, 0.008), (mx.float16, 0.001)])
def test_low_precision_is_the_float32_call_rounded(dtype, bound):
    """bfloat16 / float16 inputs: the products and the state are float32, so the call
    is the float32 call on the same rounded inputs up to the rounding of ``o``, ``dq``,
    ``dk`` and ``dv`` to the input dtype: measured at most 2.2e-3 (bf16) and 2.6e-4 (f16)
    (bound about 4x); with cotangents the dtype represents, the float32 results
    (``final_state``, ``dg``, ``dh0``) are the float32 call's bit for bit (bound
    ``FP32_TOL``). Products left in the input dtype (q and k not cast: the scores
    rounded) put ``dg`` 1.6e-3 off and still passed the first bound (mutation)."""
    xs = inputs(1, 70, 2, 4, 16, 16)
    rounded = [x.astype(dtype) for x in xs[:3]] + list(xs[3:])
    got = outputs_and_grads(linear_attention, *rounded, chunk_size=16, exact_in=dtype)
    up = [x.astype(mx.float32) for x in rounded[:3]] + list(xs[3:])
    ref = outputs_and_grads(linear_attention, *up, chunk_size=16, exact_in=dtype)
    assert got[0].dtype == dtype and got[1].dtype == mx.float32
    assert_close(got, ref, bound)
    for name in ("final_state", "dg", "dh0"):
        i = NAMES.index(name)
        assert max_rel(got[i], ref[i]) <= FP32_TOL, name


def test_checks_name_the_op():
    q, k, v, g, h0 = inputs(1, 8, 1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"\[linear_attention\] g must have 3 dimensions"):
        linear_attention(q, k, v, mx.zeros((1, 8, 2, 4)))
    with pytest.raises(ValueError, match=r"\[linear_attention\] v must have 4 dimensions"):
        linear_attention(q, k, v[0])
    with pytest.raises(ValueError, match=r"\[linear_attention\] g must have shape"):
        linear_attention(q, k, v, g[:, :4])
    with pytest.raises(ValueError, match=r"\[linear_attention\] initial_state must have"):
        linear_attention(q, k, v, g, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match=r"\[linear_attention\] chunk_size"):
        linear_attention(q, k, v, g, chunk_size=0)
    with pytest.raises(TypeError, match=r"\[naive_recurrent_linear_attention\] scale"):
        naive_recurrent_linear_attention(q, k, v, g, scale="1")
    # (found by probing) other ranks of g got Gated DeltaNet's "or 4 [B, T, Hv, Dk]";
    # the state's note named mlx-lm's layout as this op's; the oracle took chunk_size=0
    with pytest.raises(ValueError, match=r"g must have 3 dimensions \[B, T, Hv\] .*\(4, 1\)\. "):
        linear_attention(q, k, v, mx.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"key dim first: pass h\.swapaxes\(-1, -2\)"):
        linear_attention(q, k, v, g, initial_state=mx.zeros((1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"\[naive_recurrent_linear_attention\] chunk_size"):
        naive_recurrent_linear_attention(q, k, v, g, chunk_size=0)


def test_the_default_chunk_is_the_devices(monkeypatch):
    """64 on the CPU (its fastest), 256 on a GPU (the least memory there at about the
    time of 64 and 128; measured on an H100)."""
    from chunkscan.ops.linear_attention import chunk

    q, k, v, g, h0 = inputs(1, 150, 1, 2, 8, 8)
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # (a GPU's default: 256)
    assert chunk.default_chunk_size() == 64
    got = linear_attention(q, k, v, g, initial_state=h0)
    ref = linear_attention(q, k, v, g, initial_state=h0, chunk_size=64)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert chunk.default_chunk_size() == 256


def test_group_budget_setting(monkeypatch):
    """``CHUNKSCAN_LA_GROUP_MIB`` sizes the groups (the same values, to float32 rounding
    of the state products); a budget below 1 MiB or not a number raises, naming it."""
    from chunkscan.ops.linear_attention import chunk

    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    xs = inputs(1, 40, 1, 2, 256, 256)  # 3.3 MB a chunk of 4: 1 MiB groups hold one
    small = SimpleNamespace(chunk_size=4, Dk=256, Dv=256, B=1, Hv=2, T=40)
    assert chunk._groups(small)[0][1] == 4  # the CPU's 16 MiB: C chunks
    ref = linear_attention(*xs[:4], initial_state=xs[4], chunk_size=4)
    spec = SimpleNamespace(chunk_size=64, Dk=256, Dv=256, B=1, Hv=2, T=8192)  # 5.2 MB a chunk
    assert chunk._groups(spec)[0][1] == 3  # the CPU's 16 MiB
    monkeypatch.setenv("CHUNKSCAN_LA_GROUP_MIB", "2048")
    assert chunk._groups(spec)[0][1] == 64  # at most C chunks
    monkeypatch.setenv("CHUNKSCAN_LA_GROUP_MIB", "1")
    assert chunk._groups(spec)[0][1] == chunk._groups(small)[0][1] == 1
    got = linear_attention(*xs[:4], initial_state=xs[4], chunk_size=4)
    assert all(max_rel(a, b) <= FP32_TOL for a, b in zip(got, ref))
    for bad in ("0", "big"):
        monkeypatch.setenv("CHUNKSCAN_LA_GROUP_MIB", bad)
        with pytest.raises(ValueError, match="CHUNKSCAN_LA_GROUP_MIB"):
            linear_attention(*xs[:4], chunk_size=4)
        # at T = 0 too, as gated_delta_rule's (it passed there: found by review)
        with pytest.raises(ValueError, match="CHUNKSCAN_LA_GROUP_MIB"):
            linear_attention(*(x[:, :0] for x in xs[:4]), chunk_size=4)


def test_empty_sizes():
    q, k, v, g, h0 = inputs(1, 8, 1, 2, 4, 4)
    o, s = linear_attention(q[:, :0], k[:, :0], v[:, :0], g[:, :0], initial_state=h0)
    assert o.shape == (1, 0, 2, 4) and mx.array_equal(s, h0).item()


_MEMORY_SHAPE = dict(B=1, Hk=2, Hv=4, Dk=32, Dv=32)


def _all_gradients_bound(C: int, lengths: tuple[int, int]) -> float:
    """The growth all five gradients may take at :data:`_MEMORY_SHAPE` from
    ``lengths[0]`` to ``lengths[1]``: the inputs' gradients, the output and its
    cotangent, the state kept per group of ``C`` chunks of ``C``, four states of slack."""
    sh = _MEMORY_SHAPE
    state = 4 * sh["Hv"] * sh["Dv"] * sh["Dk"]
    inputs_ = 4 * (2 * sh["Hk"] * sh["Dk"] + sh["Hv"] * sh["Dv"] + sh["Hv"])
    output = 4 * sh["Hv"] * sh["Dv"]
    return (lengths[1] - lengths[0]) * (inputs_ + 2 * output + state / C**2) + 4 * state


def test_backward_memory_is_one_group():
    """Peak growth of all five gradients from T = 256 to 1024 (fresh processes; C = 4,
    groups of four chunks) within the inputs' gradients, the output and its cotangent,
    the state kept per group and slack of four states: measured 1.81 MiB eager, 1.40
    under mx.compile, against a bound of 2.32 (session 51, with rule 2); 1.67-1.70 and
    1.33-1.36 with the saved states in blocks (session 52). The negative controls: the
    whole sequence one group (30.0 MiB); the ordering rules of chunkscan._ordering
    switched off one at a time: the state leaving a group before its outputs exist (rule
    1: 5.28), the cotangent leaving a group before its gradients (rule 3: 8.03); and,
    eager, the blocks of the saved states' cotangents (MLX's zeros here) not waiting for
    the cotangent flowing into their last group (2.70: MLX materialized every block's
    zeros up front; compiled 1.69, under the bound: not checked there). (Rule 5, a
    group's forward after the state entering it, measured no effect on this op, eager
    or compiled, and it does not take it; rule 2 of the groups: the next test.)"""
    shape = dict(_MEMORY_SHAPE, C=4)
    bound = _all_gradients_bound(4, (256, 1024))
    for compiled in (False, True):
        growth = peak_growth("linear_attention_backward_peak", dict(shape, compiled=compiled))
        assert growth <= bound, f"grew by {growth / 2**20:.2f} > {bound / 2**20:.2f} MiB"
    for control in (
        dict(one_group=True),
        dict(no_edge="carry_after_outputs"),
        dict(no_edge="cotangent_after_gradients"),
    ):
        grew = peak_growth("linear_attention_backward_peak", dict(shape, **control))
        assert grew > bound, f"{control} grew by {grew / 2**20:.2f} MiB only"
    grew = peak_growth("linear_attention_unordered_zeros_peak", shape)
    assert grew > bound, f"unordered zeros grew by {grew / 2**20:.2f} MiB only"


def test_backward_memory_of_q_alone_is_within_all_fives():
    """The gradient of ``q`` alone keeps at most what all five gradients may
    (``test_backward_memory_is_one_group``'s bound: the inputs' gradients, the output and
    its cotangent, the state kept per group, four states of slack), at C = 8 (T = 1024
    to 4096) and C = 64, the CPU's default (2048 to 8192), eager and compiled: measured
    5.18 / 4.93 MiB against 6.86 and 4.53 / 4.51 against 12.18. Negative control: rule 2
    off (a group's recomputation before the cotangent entering it exists) at C = 64,
    24.2 / 24.7: MLX then ran every group's cotangent-free work first (found by probing,
    session 51). (At C = 8 rule 2 costs q alone what all five take, more than without
    it: review, session 51.)"""
    shape = dict(_MEMORY_SHAPE, q_only=True)
    for C, lengths in ((8, (1024, 4096)), (64, (2048, 8192))):
        for compiled in (False, True):
            config = dict(shape, C=C, compiled=compiled)
            growth = peak_growth("linear_attention_backward_peak", config, lengths=lengths)
            limit = _all_gradients_bound(C, lengths)
            assert growth <= limit, f"C={C}: grew by {growth / 2**20:.2f} > {limit / 2**20:.2f} MiB"
    lengths = (2048, 8192)
    for compiled in (False, True):
        config = dict(shape, C=64, compiled=compiled, no_edge="recompute_after_cotangent")
        grew = peak_growth("linear_attention_backward_peak", config, lengths=lengths)
        assert grew > _all_gradients_bound(64, lengths), (
            f"rule 2 off grew by {grew / 2**20:.2f} MiB only"
        )


@pytest.mark.parametrize("name, value", [("k", math.nan), ("v", math.inf), ("g", math.nan),
                                         ("g", math.inf), ("q", math.nan)])  # fmt: skip
def test_non_finite_input_reaches_what_the_loop_reaches(name, value):
    """A non-finite input at token ``t`` (batch row 0) reads as zero inside the op and
    NaN goes where the per-step loop has non-finite outputs: from ``t`` on (``k``, ``v``,
    ``g``: NaN or ``+inf``), or ``o[t]`` alone (``q``), and the final state. The tokens
    before ``t`` keep their values and gradients: those of the call on the tokens
    before ``t`` alone (found by probing: a NaN ``k`` or infinite ``v`` made the earlier
    tokens of its chunk NaN, the masked zeros of the chunk products times it). Every
    channel of the token is bad here: the masks are per token and head (one bad channel
    of ``v`` makes all the head's channels NaN, where the loop loses that one: docs)."""
    T, t, C = 40, 21, 16
    xs = dict(zip("qkvg", inputs(2, T, 1, 2, 4, 4)[:4]))
    h0 = inputs(2, T, 1, 2, 4, 4)[4]
    x = xs[name]
    hit = (mx.arange(2) == 0).reshape((2,) + (1,) * (x.ndim - 1))
    hit = mx.logical_and(hit, (mx.arange(T) == t).reshape((1, T) + (1,) * (x.ndim - 2)))
    xs[name] = mx.where(hit, value, x)
    o, s = linear_attention(**xs, initial_state=h0, chunk_size=C)
    o_ref, s_ref = naive_recurrent_linear_attention(**xs, initial_state=h0)
    finite, finite_ref = (mx.all(mx.isfinite(a), axis=3) for a in (o, o_ref))  # [B, T, Hv]
    assert mx.array_equal(finite, finite_ref).item()
    assert not finite[0, t].any().item() and finite[1].all().item()
    state_finite = [mx.all(mx.isfinite(a), axis=(2, 3)) for a in (s, s_ref)]
    assert mx.array_equal(*state_finite).item()
    seen = finite_ref[..., None]
    assert max_rel(mx.where(seen, o, 0.0), mx.where(seen, o_ref, 0.0)) <= FP32_TOL
    w = mx.random.normal((2, t, 2, 4), key=mx.random.key(5))

    def grads(q, k, v, g, h0):
        def loss(q, k, v, g, h0):
            o = linear_attention(q, k, v, g, initial_state=h0, chunk_size=C)[0]
            return mx.sum(o[:, :t] * w)

        return mx.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, h0)

    got = grads(*xs.values(), h0)
    ref = grads(*(a[:, :t] for a in xs.values()), h0)
    for nm, a, b in zip(NAMES[2:], got, ref):
        a = a if nm == "dh0" else a[:, :t]
        assert max_rel(a, b) <= FP32_TOL, nm


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_cotangent_stays_in_its_chunk_and_before(value):
    """A non-finite cotangent of ``o[t]``: the gradients of every later chunk and of the
    other batch row are those of the same call with that cotangent zero, bit for bit;
    ``d initial_state`` of that row is non-finite, as the loop's (its groups' state
    products read a non-finite cotangent as zero and put NaN only where it reaches)."""
    T, t, C = 40, 20, 8
    q, k, v, g, h0 = inputs(2, T, 1, 2, 4, 3)
    w = mx.random.normal((2, T, 2, 3), key=mx.random.key(6))
    hit = (mx.arange(2)[:, None, None, None] == 0) & (mx.arange(T)[:, None, None] == t)
    bad_w, zero_w = mx.where(hit, value, w), mx.where(hit, 0.0, w)

    def vjp(fn, ct):
        def f(q, k, v, g, h0):
            return fn(q, k, v, g, initial_state=h0, chunk_size=C)[0]

        return mx.vjp(f, [q, k, v, g, h0], [ct])[1]

    bad, ok = vjp(linear_attention, bad_w), vjp(linear_attention, zero_w)
    ref = vjp(naive_recurrent_linear_attention, bad_w)
    end = (t // C + 1) * C  # the end of t's chunk
    for name, gb, go in zip("qkvg", bad[:4], ok[:4]):
        assert mx.array_equal(gb[1], go[1]).item(), name  # the other row
        assert mx.array_equal(gb[0, end:], go[0, end:]).item(), name  # later chunks
    assert mx.array_equal(bad[4][1], ok[4][1]).item()
    assert not mx.isfinite(bad[4][0]).all().item() and not mx.isfinite(ref[4][0]).all().item()


def test_second_derivative_matches_the_oracle():
    """The backward is MLX ops, so it differentiates: the gradients of a function of
    ``dq`` and ``dg`` (which read the states) against the oracle's, with several groups:
    the states the forward saved get cotangents, which join the state's where it was
    saved (without that: 0.43 off; ``dk`` reads no state and missed it)."""
    from chunkscan.ops.linear_attention import chunk

    q, k, v, g, h0 = inputs(1, 50, 1, 2, 4, 4)

    def grads(fn, **kw):
        def squares(q, k, v, g):
            def loss(q, k, v, g):
                o, s = fn(q, k, v, g, initial_state=h0, **kw)
                return mx.sum(o * o) + mx.sum(s * s)

            dq, dg = mx.grad(loss, argnums=(0, 3))(q, k, v, g)
            return mx.sum(dq * dq) + mx.sum(dg * dg)

        return mx.grad(squares, argnums=(0, 1, 2, 3))(q, k, v, g)

    ref = grads(naive_recurrent_linear_attention)
    saved = chunk._CHUNKS_PER_C
    try:
        chunk._CHUNKS_PER_C = 1 / 8  # groups of one chunk: seven groups at C = 8
        got = grads(linear_attention, chunk_size=8)
    finally:
        chunk._CHUNKS_PER_C = saved
    for name, a, b in zip("qkvg", got, ref):
        assert max_rel(a, b) <= SECOND_TOL, name


def test_many_groups_keep_outputs_per_primitive_bounded():
    """One group per token (C = 1, tiny heads): the states the forward keeps for the
    backward leave its custom function stacked in about sqrt(n) blocks of about sqrt(n),
    not as one output per group. Every output of a primitive lists its siblings in MLX,
    so n outputs cost O(n^2) host time and memory, outside MLX's allocator (which
    ``mx.get_peak_memory`` does not see, and which RSS or time in a fresh process would
    measure only flakily): the count of outputs is the check. Found by probing, session
    52: the forward at T = 8192 took 13.0 s and 2709 MiB of peak RSS with one output
    per group, 6.6 s and 657 MiB in blocks (docs/linear_attention.md,
    ``bench/results/cpu/many_groups_linear_attention_fwd_*.json``). The forward's widest
    primitive has 10 and 18 outputs at 64 and 256 groups, 65 and 257 before (the
    negative control: the previous chunk.py fails this); with the gradients, at most
    those or the 16 pieces of :func:`chunkscan.split`'s tree (the backward's cuts).
    Values and gradients against the oracle at 256 (blocks of 16, the last one short)."""
    from helpers import max_outputs_of_one_primitive

    for T in (64, 256):
        xs = inputs(1, T, 1, 1, 2, 2)
        got = outputs_and_grads(linear_attention, *xs, chunk_size=1)
        bound = 2 + math.isqrt(T) + 1
        assert max_outputs_of_one_primitive(got[:2]) <= bound, T
        assert max_outputs_of_one_primitive(got) <= max(bound, 16), T
    assert_close(got, outputs_and_grads(naive_recurrent_linear_attention, *xs))


@pytest.mark.parametrize("family", ["bailing_moe_linear", "bailing_hybrid"])
def test_matches_mlx_lm_recurrent_gla(family):
    """mlx-lm's ``recurrent_gla`` (the Bailing linear models' Lightning attention, heads
    before time, a constant log-decay per head, the state ``[B, H, Dk, Dv]``) is this op
    with ``g`` that constant at every token and the state transposed: measured 1.7e-7 /
    2.3e-7 (o, state) against bailing_hybrid's chunked form, 4.6e-7 / 8.2e-7 against
    bailing_moe_linear's per-token loop; bound ``FP32_TOL``."""
    module = pytest.importorskip(f"mlx_lm.models.{family}")
    q, k, v, g, h0 = inputs(2, 45, 3, 3, 8, 8)
    slope = -mx.array([0.05, 0.3, 1.0])
    h = h0.swapaxes(-1, -2)
    heads_first = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    if family == "bailing_hybrid":
        y, s = module.recurrent_gla(*heads_first, slope, scale=0.4, h=h)
    else:
        y, s = module.recurrent_gla(*heads_first, slope, 0.4, h=h)
    gates = mx.broadcast_to(slope, g.shape)
    o, final = linear_attention(q, k, v, gates, scale=0.4, initial_state=h0, chunk_size=16)
    assert max_rel(o, y.transpose(0, 2, 1, 3)) <= FP32_TOL
    assert max_rel(final, s.swapaxes(-1, -2)) <= FP32_TOL
