"""Per-channel gates (Kimi Delta Attention): ``g`` of shape ``[B, T, Hv, Dk]``.

The oracle against a hand-written float64 loop, then the chunk form against the
oracle: values and all six gradients, extreme gates, packed sequences, mx.compile,
non-finite input and backward memory scaling (fresh processes, with a negative
control).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from helpers import gated_delta_inputs, max_rel, peak_growth
from helpers import gdn_outputs_and_grads as outputs_and_grads

from chunkscan.ops.gated_delta import gated_delta_rule, naive_recurrent_gated_delta_rule


def make_channel_inputs(B, T, Hk, Hv, Dk, Dv, n_states=None, seed=0, lo=0.01, hi=0.5):
    """Unit keys, beta in (0, 1), per-channel g uniform in [-hi, -lo] (float32)."""
    return gated_delta_inputs(B, T, Hk, Hv, Dk, Dv, n_states=n_states, seed=seed,
                              channel=True, lo=lo, hi=hi)  # fmt: skip


def hand_loop(q, k, v, g, beta, h0, scale):
    """The recurrence written out in float64 numpy, one channel product at a time."""
    q, k, v, g, beta, S = (np.array(x, np.float64) for x in (q, k, v, g, beta, h0))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    o = np.zeros((B, T, Hv, Dv))
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                S[b, h] = S[b, h] * np.exp(g[b, t, h])[None, :]
                pred = S[b, h] @ k[b, t, hk]
                S[b, h] += beta[b, t, h] * np.outer(v[b, t, h] - pred, k[b, t, hk])
                o[b, t, h] = scale * S[b, h] @ q[b, t, hk]
    return o, S


def test_oracle_matches_hand_loop():
    q, k, v, g, beta, h0 = make_channel_inputs(2, 9, 1, 2, 4, 3)
    o, s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = hand_loop(q, k, v, g, beta, h0, 4**-0.5)
    # float32 against float64 on O(1) values: measured max abs error ~3e-7.
    np.testing.assert_allclose(np.array(o), o_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(s), s_ref, rtol=0, atol=1e-5)
    # A per-channel gate equal across channels is the scalar gate.
    o1, s1 = naive_recurrent_gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=h0)
    g_same = mx.broadcast_to(g[..., :1], g.shape)
    o2, s2 = naive_recurrent_gated_delta_rule(q, k, v, g_same, beta, initial_state=h0)
    assert mx.allclose(o1, o2, atol=1e-6).item() and mx.allclose(s1, s2, atol=1e-6).item()


@pytest.mark.parametrize("fn", [gated_delta_rule, naive_recurrent_gated_delta_rule])
def test_channel_gate_shape_errors(fn):
    q, k, v, g, beta, _ = make_channel_inputs(2, 5, 1, 2, 4, 3)
    name = fn.__name__
    message = (
        f"[{name}] a per-channel g must have shape [B, T, Hv, Dk] = (2, 5, 2, 4) but got "
        "(2, 5, 2, 3). Pass one log-decay per token, value head and key channel."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(q, k, v, g[..., :3], beta)
    message = (
        f"[{name}] g must have 3 dimensions [B, T, Hv] (one gate per head) or 4 "
        "[B, T, Hv, Dk] (one per key channel) but got shape (2, 5)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(q, k, v, g[..., 0, 0], beta)


# ------------------------------------------------------------- chunk form vs the oracle

import math  # noqa: E402

from chunkscan.ops.gated_delta import chunk as chunk_module  # noqa: E402
from chunkscan.ops.gated_delta._checks import Spec  # noqa: E402

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# Measured max relative error of the chunk form against the oracle (fp32) over these
# cases: 1e-7 to 6e-7 for o, the state and all six gradients, also for gates down to
# -20 per step and -inf. The bound is about 15x the worst (the 1e-4, > 100x
# above, let a 3e-5 error of the scale pass; mutation audit).
TOL = 1e-5


def assert_close(got, ref, tol=TOL, names=NAMES):
    errors = {n: max_rel(a, b) for n, a, b in zip(names, got, ref)}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol}
    assert not bad, f"max relative error above {tol}: {bad}"
    assert not any(mx.isnan(x).any().item() for x in got)


# (B, T, Hk, Hv, Dk, Dv, C): T not a multiple of C, Hv = 2 Hk, Dk != Dv, C = 1, C > T,
# C not a multiple of the sub-chunk (rounded up), several sub-chunks per chunk.
CASES = [
    (1, 1, 1, 1, 4, 3, 64),
    (2, 45, 1, 2, 8, 6, 16),
    (1, 70, 2, 4, 16, 8, 64),
    (1, 50, 1, 2, 8, 12, 7),
    (1, 12, 1, 2, 4, 6, 1),
    (1, 40, 1, 1, 8, 4, 41),
    (2, 100, 1, 2, 8, 6, 40),
]


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-T{c[1]}-C{c[6]}" for c in CASES])
def test_fp32_matches_oracle(case):
    B, T, Hk, Hv, Dk, Dv, C = case
    inputs = make_channel_inputs(B, T, Hk, Hv, Dk, Dv)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=C)
    ref = outputs_and_grads(naive_recurrent_gated_delta_rule, inputs)
    assert_close(got, ref)


@pytest.mark.parametrize(
    "lo, hi", [(1e-3, 1e-3), (1e-3, 20.0), (5.0, 20.0), (20.0, 20.0)],
    ids=["-1e-3", "-1e-3..-20", "-5..-20", "-20"],
)  # fmt: skip
def test_gate_ranges(lo, hi):
    """Per-step gates from -1e-3 to -20 in every channel, chunks of 32 (two
    sub-chunks): products down to exp(-640) underflow to zero, never to NaN."""
    inputs = make_channel_inputs(1, 75, 1, 2, 8, 6, lo=lo, hi=hi)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32)
    ref = outputs_and_grads(naive_recurrent_gated_delta_rule, inputs)
    assert_close(got, ref)


@pytest.mark.parametrize("gate", [-math.inf, -1e4, -30.0], ids=["-inf", "-1e4", "-30"])
def test_hard_resets_per_channel(gate):
    """g = -inf (a reset of one key column) at random (token, head, channel) and at
    t = 0 in every channel (which wipes the initial state: dh0 = 0 in both)."""
    inputs = make_channel_inputs(1, 75, 1, 2, 8, 6, lo=1e-3, hi=3.0)
    hit = mx.random.uniform(shape=inputs[3].shape, key=mx.random.key(9)) < 0.1
    hit = hit | (mx.arange(75)[None, :, None, None] == 0)
    inputs[3] = mx.where(hit, gate, inputs[3])
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32)
    ref = outputs_and_grads(naive_recurrent_gated_delta_rule, inputs)
    assert_close(got[:-1], ref[:-1])
    assert mx.abs(got[-1]).max().item() <= 1e-10 and mx.abs(ref[-1]).max().item() <= 1e-10


def test_equal_channels_are_the_scalar_gate():
    """A per-channel gate equal in every channel gives the scalar op's results."""
    inputs = make_channel_inputs(1, 70, 1, 2, 8, 6)
    scalar = list(inputs)
    scalar[3] = inputs[3][..., 0]
    inputs[3] = mx.broadcast_to(scalar[3][..., None], inputs[3].shape)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32)
    ref = outputs_and_grads(gated_delta_rule, scalar, chunk_size=32)
    got[5] = mx.sum(got[5], axis=-1)  # dg summed over the channels is the scalar dg
    assert_close(got, ref, tol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs(dtype):
    """bf16/fp16 inputs: float32 inside, outputs and gradients in the input dtypes. Both
    sides compute in float32 from the same rounded inputs: measured relative RMSE
    <= 2.1e-5 (dq, bf16) against the oracle; tolerance 1e-3."""
    inputs = make_channel_inputs(2, 130, 2, 4, 32, 16)
    inputs = [x.astype(dtype) for x in inputs[:5]] + [inputs[5]]
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32)
    ref = outputs_and_grads(naive_recurrent_gated_delta_rule, inputs)
    assert got[0].dtype == dtype and got[1].dtype == mx.float32
    assert [x.dtype for x in got[2:7]] == [dtype] * 5
    for name, a, b in zip(NAMES, got, ref):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        err = (mx.sqrt(mx.sum((a - b) ** 2)) / mx.sqrt(mx.sum(b * b))).item()
        assert err <= 1e-3, (name, err)


# Packed sequences: tests/ops/test_gated_delta.py::test_packed_sequences[...-channel].


def test_compiled_and_groups(monkeypatch):
    """Under mx.compile, one chunk per group and three per group, no initial state."""
    inputs = make_channel_inputs(2, 75, 1, 2, 8, 6)
    ref = outputs_and_grads(naive_recurrent_gated_delta_rule, inputs)
    for group_bytes in (1, None):
        monkeypatch.setattr(chunk_module, "_GROUP_BYTES", group_bytes)
        got = outputs_and_grads(gated_delta_rule, inputs, compiled=True, chunk_size=16)
        assert_close(got, ref)
    xs = inputs[:5]
    cts = [mx.random.normal(inputs[2].shape), mx.random.normal(inputs[5].shape)]

    def run(fn, **kw):
        outs, grads = mx.vjp(lambda *a: list(fn(*a, **kw)), xs, cts)
        return list(outs) + list(grads)

    assert_close(run(gated_delta_rule, chunk_size=16), run(naive_recurrent_gated_delta_rule))


BAD = [("g", math.nan), ("g", math.inf), ("v", math.nan), ("k", math.inf)]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_non_finite_input_is_causal(name, value):
    """A non-finite value at token t (one channel of one head for g) never reaches the
    values or gradients of earlier tokens, and gives NaN where the loop does."""
    T, t, C = 40, 21, 16  # t in the second chunk, second sub-chunk
    inputs = make_channel_inputs(1, T, 1, 2, 4, 3)
    i = ("q", "k", "v", "g", "beta").index(name)
    bad = list(inputs)
    hit = (mx.arange(T) == t).reshape(1, T, 1, 1) & (mx.arange(bad[i].shape[-1]) == 1)
    hit = hit & (mx.arange(bad[i].shape[2]) == 0)[:, None]
    bad[i] = mx.where(hit, value, bad[i])
    o, s = gated_delta_rule(*bad[:5], initial_state=bad[5], chunk_size=C)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(*bad[:5], initial_state=bad[5])
    finite = mx.all(mx.isfinite(o), axis=(2, 3))[0].tolist()
    assert finite == mx.all(mx.isfinite(o_ref), axis=(2, 3))[0].tolist()
    assert all(finite[:t]) and not finite[t]
    assert mx.all(mx.isfinite(s)).item() == mx.all(mx.isfinite(s_ref)).item()
    w = mx.random.normal(o.shape, key=mx.random.key(5))

    def grads(fn, xs):
        def f(*a):
            return mx.sum(fn(*a[:5], initial_state=a[5], chunk_size=C)[0][:, :t] * w[:, :t])

        return mx.grad(f, argnums=tuple(range(6)))(*xs)

    got = grads(gated_delta_rule, bad)
    ref = grads(naive_recurrent_gated_delta_rule, [x[:, :t] for x in inputs[:5]] + [inputs[5]])
    for d, d_ref in zip(got[:5], ref[:5]):
        assert mx.all(mx.isfinite(d)).item()
        assert max_rel(d[:, :t], d_ref) <= TOL
        assert mx.abs(d[:, t:]).max().item() == 0.0
    assert max_rel(got[5], ref[5]) <= TOL


# -------------------------------------------------------------------- memory scaling

MEM = dict(Hk=2, Hv=4, Dk=32, Dv=32, C=32)


def test_backward_memory_is_linear_in_inputs_and_states():
    """Peak growth from T = 256 to 2048 within the inputs' gradients, the output and
    its cotangent and the T / C saved states: measured 3.45 MiB against a bound of
    5.34 (3.39 with the GPUs' form of the state pass). The negative controls must
    break it: one group of all chunks (every chunk's sub-chunk arrays alive at once)
    97.9 MiB; rule 5 off 12.3 MiB, measured with the GPUs' form of the state pass
    (``"transition"``), whose outputs recompute ``u - w S^T`` from the preparation, as
    the kernels' do. With the CPU's form the outputs take that from the pass, which
    orders the preparations by itself: rule 5 off grew 3.47 MiB there, the edge is
    then redundant. (At T = 1024 rule 5 off grew 2.0 MiB against a bound of 2.3 once
    the per-group non-finite checks took fewer ops: the edge matters at longer
    inputs.)"""
    T1, T4 = 256, 2048
    s = MEM
    spec = Spec(1, T4, s["Hk"], s["Hv"], s["Dk"], s["Dv"], 1.0, s["C"], None, channel=True)
    per_chunk = (1 << 40) // chunk_module._group_size(spec, s["C"], 1 << 40)
    two_chunks = 2 * per_chunk + 1  # groups of two chunks
    target = "gated_delta_backward_peak"  # all six gradients, in a fresh process

    def growth(group_bytes, no_edge=None, pass_form=None):
        cfg = dict(MEM, B=1, group_bytes=group_bytes, channel=True, no_edge=no_edge)
        return peak_growth(target, dict(cfg, pass_form=pass_form), lengths=(T1, T4))

    state = 4 * s["Hv"] * s["Dv"] * s["Dk"]
    inputs = 4 * (2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"] + s["Hv"] * s["Dk"] + s["Hv"])
    output = 4 * s["Hv"] * s["Dv"]
    bound = (T4 - T1) * (inputs + 2 * output + state / s["C"]) + 4 * state
    for form in (None, "transition"):
        bounded = growth(two_chunks, pass_form=form)
        assert bounded <= bound, f"{form}: grew {bounded / 2**20:.2f} > {bound / 2**20:.2f} MiB"
    unbounded = growth(1 << 40)  # negative control: a single group
    assert unbounded > bound, f"control grew by {unbounded / 2**20:.2f} MiB only"
    # Negative control of rule 5: the groups' inputs no longer wait for the state
    # entering them, so the preparations are no longer one at a time.
    unordered = growth(two_chunks, no_edge="prepare_after_carry", pass_form="transition")
    assert unordered > bound, f"rule-5 control grew by {unordered / 2**20:.2f} MiB only"


def test_backward_groups_keep_to_the_byte_budget():
    """The op's groups keep their scratch near the budget it is given (``_GROUP_BYTES``;
    ``CHUNKSCAN_GDN_GROUP_MIB`` outside the tests), the per-channel sub-chunk arrays
    included. At a budget of 8 MiB, growth from T = 256 to 2048 within the bound of the
    test above (what grows with T) plus the budget itself: one group's scratch at 2048
    is at most the budget, at 256 at least nothing. Derived from the budget, not from
    ``_group_size``, so that a miscount there moves the peak and not the bound: without
    the sub-chunk term the groups were 5.4x as many chunks (28 for 5 here) and the
    backward's peak at the default 64 MiB went from 81 to 294 MiB (found by mutation,
    as the test above derives its budget from ``_group_size`` itself). Measured 3.13
    MiB against a bound of 13.34; without the term 36.3; one group of all chunks, the
    negative control, 97.9."""
    T1, T4, budget = 256, 2048, 8 << 20
    s = MEM
    state = 4 * s["Hv"] * s["Dv"] * s["Dk"]
    inputs = 4 * (2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"] + s["Hv"] * s["Dk"] + s["Hv"])
    output = 4 * s["Hv"] * s["Dv"]
    bound = (T4 - T1) * (inputs + 2 * output + state / s["C"]) + 4 * state + budget

    def growth(group_bytes):
        cfg = dict(MEM, B=1, group_bytes=group_bytes, channel=True)
        return peak_growth("gated_delta_backward_peak", cfg, lengths=(T1, T4))

    bounded = growth(budget)
    assert bounded <= bound, f"grew {bounded / 2**20:.2f} > {bound / 2**20:.2f} MiB"
    unbounded = growth(1 << 40)  # negative control: a single group
    assert unbounded > 2 * bound, f"control grew by {unbounded / 2**20:.2f} MiB only"
