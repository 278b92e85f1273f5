"""chunkscan.selective_scan (Mamba's S6 recurrence) against its per-step oracle: values,
the seven gradients, low precision, compile, checks, and backward memory."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import max_rel, peak_growth, selective_scan_inputs
from helpers import state_op_outputs_and_grads as outputs_and_grads

from chunkscan import naive_selective_scan, selective_scan

NAMES = ("y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "dh0")
# float32 against the float32 oracle: measured at most 5.7e-7 over the cases of
# test_matches_the_oracle (values, final state, seven gradients); the bound is about 10x.
FP32_TOL = 5e-6


def errors(got, ref):
    return {n: max_rel(a, b) for n, a, b in zip(NAMES, got, ref)}


CASES = [  # (B, T, Dc, N, chunk)
    (1, 1, 3, 2, 8),
    (2, 5, 4, 3, 8),  # T < chunk
    (1, 37, 6, 4, 8),  # T not a multiple of the chunk
    (2, 64, 5, 16, 16),
    (1, 50, 3, 5, 1),
    (1, 50, 3, 5, 3),
    (1, 40, 4, 4, 64),
]


@pytest.mark.parametrize("B, T, Dc, N, C", CASES)
def test_matches_the_oracle(B, T, Dc, N, C):
    args = selective_scan_inputs(B, T, Dc, N, seed=T)
    got = outputs_and_grads(selective_scan, args, chunk_size=C)
    ref = outputs_and_grads(naive_selective_scan, args)
    bad = {n: e for n, e in errors(got, ref).items() if not e <= FP32_TOL}
    assert not bad, f"max relative error above {FP32_TOL}: {bad}"


def test_compiled_matches_eager():
    args = selective_scan_inputs(2, 45, 4, 6)
    eager = outputs_and_grads(selective_scan, args, chunk_size=8)
    compiled = outputs_and_grads(selective_scan, args, chunk_size=8, compiled=True)
    bad = {n: e for n, e in errors(compiled, eager).items() if not e <= FP32_TOL}
    assert not bad, bad


def test_no_skip_and_no_initial_state():
    """``D=None`` is no skip term; no ``initial_state`` starts from zeros."""
    x, dt, A, B, C, D, _ = selective_scan_inputs(1, 21, 3, 4)
    y, h = selective_scan(x, dt, A, B, C, chunk_size=4)
    y0, h0 = naive_selective_scan(x, dt, A, B, C)
    assert max_rel(y, y0) <= FP32_TOL and max_rel(h, h0) <= FP32_TOL
    yd, _ = selective_scan(x, dt, A, B, C, D, chunk_size=4)
    assert max_rel(yd - y, D * x) <= FP32_TOL


# bfloat16 / float16 inputs against the same call on their float32 upcast (the op
# computes in float32: the only difference is the rounding of y and of the gradients of
# the low-precision inputs x, dt, B, C, each rounded once). Measured: equal, every
# element, in both dtypes (three seeds). With D, x's gradient was two gradients each
# rounded and added in x's dtype before session 51 (found by probing: up to the
# element's own size off where they cancel; 371 of 1024 elements differed): that code
# fails here.
ROUNDED = ("y", "dx", "ddt", "dB", "dC")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_low_precision_is_the_upcast_call_rounded_once(dtype):
    args = selective_scan_inputs(1, 40, 4, 8, dtype=dtype)
    up = tuple(a.astype(mx.float32) for a in args)
    got = outputs_and_grads(selective_scan, args, chunk_size=8, exact_in=dtype)
    ref = outputs_and_grads(selective_scan, up, chunk_size=8, exact_in=dtype)
    assert got[0].dtype == dtype and got[1].dtype == mx.float32
    for name, a, b in zip(NAMES, got, ref):
        want = b.astype(dtype) if name in ROUNDED else b
        assert mx.array_equal(a, want), (name, max_rel(a, b))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=mx.zeros((2, 3))), "x must have 3 dimensions"),
        (dict(dt=mx.zeros((1, 5, 3))), "dt must have shape"),
        (dict(A=mx.zeros((4,))), "A must have shape"),
        (dict(B=mx.zeros((1, 5, 3))), r"B must have shape \[1, 5, 2\]"),
        (dict(D=mx.zeros((2,))), "D must have shape"),
        (dict(initial_state=mx.zeros((1, 2, 4))), "initial_state must have shape"),
        (dict(x=mx.zeros((1, 5, 4), dtype=mx.int32)), "x must have dtype"),
    ],
)
def test_bad_inputs_are_named(change, match):
    z = mx.zeros
    args = dict(x=z((1, 5, 4)), dt=z((1, 5, 4)), A=z((4, 2)), B=z((1, 5, 2)), C=z((1, 5, 2)),
                D=None, initial_state=None)  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=match):
        selective_scan(**args)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        selective_scan(*list(args.values())[:5], chunk_size=2.0)


@pytest.mark.parametrize(
    "chunk_size, error", [(0, ValueError), (False, TypeError), (-3, ValueError)]
)
def test_a_chunk_size_below_one_raises(chunk_size, error):
    """0 and False raise, as in the oracle (the op took them for its default; review)."""
    x, dt, A, B, C, _, _ = selective_scan_inputs(1, 5, 2, 3)
    for fn in (selective_scan, naive_selective_scan):
        with pytest.raises(error, match="chunk_size"):
            fn(x, dt, A, B, C, chunk_size=chunk_size)


@pytest.mark.parametrize("name", ["x", "dt", "B"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_input_reaches_what_the_loop_reaches(name, value):
    """A NaN or infinity in ``x``, ``dt`` or ``B`` at one step of a chunk's middle: the
    outputs, the final state and the seven gradients are non-finite exactly where the
    per-step loop's are (the parallel scan's products and sums reach what the loop's
    steps reach), and equal elsewhere."""
    args = list(selective_scan_inputs(1, 16, 3, 4))
    index = {"x": 0, "dt": 1, "B": 3}[name]
    bad = np.array(args[index])
    bad[0, 5, 1] = value
    args[index] = mx.array(bad)
    got = outputs_and_grads(selective_scan, args, chunk_size=8)
    ref = outputs_and_grads(naive_selective_scan, args)
    for n, a, b in zip(NAMES, got, ref):
        finite = np.isfinite(np.array(b))
        assert np.array_equal(np.isfinite(np.array(a)), finite), n
        ok_a, ok_b = np.array(a)[finite], np.array(b)[finite]
        if ok_b.size:  # the finite entries within the float32 bound of the oracle tests
            assert np.abs(ok_a - ok_b).max() <= FP32_TOL * max(np.abs(ok_b).max(), 1e-30), n


def test_empty_sequence():
    x, dt, A, B, C, D, h0 = selective_scan_inputs(2, 0, 3, 4)
    y, h = selective_scan(x, dt, A, B, C, D, initial_state=h0)
    assert y.shape == (2, 0, 3) and mx.array_equal(h, h0).item()


def test_backward_memory_is_one_chunk():
    """Peak growth of all seven gradients from T = 256 to 1024 (fresh processes; 64
    channels, a state of 16, chunks of 8) within the gradients of the per-token inputs,
    the output, its cotangent and the skip term's temporaries (float32: ``2 Dc + 2 N``
    and ``4 Dc`` per token) and the state kept per chunk, plus slack of four states:
    measured 0.82 / 0.64 MiB eager / compiled against the bound of 1.61. The
    negative control: the whole sequence one chunk (no carries, its parallel scan
    recomputed at once), 153 MiB (``bench/results/cpu/memory_tests_98117e4.jsonl``)."""
    shape = dict(B=1, Dc=64, N=16)
    Dc, N, C = shape["Dc"], shape["N"], 8
    state = 4 * Dc * N
    bound = (1024 - 256) * (4 * (2 * Dc + 2 * N) + 4 * 4 * Dc + state / C) + 4 * state
    for compiled in (False, True):
        growth = peak_growth("selective_scan_backward_peak", dict(shape, C=C, compiled=compiled))
        assert growth <= bound, f"grew by {growth / 2**20:.2f} > {bound / 2**20:.2f} MiB"
    grew = peak_growth("selective_scan_backward_peak", dict(shape, C=4096))
    assert grew > bound, f"one chunk grew by {grew / 2**20:.2f} MiB only"


def test_a_chunks_recomputation_holds_a_few_dozen_chunk_arrays():
    """The memory of one chunk's recomputation, in arrays of ``[B, L, Dc, N]`` float32
    (``L`` the chunk): the peak of all seven gradients with the whole sequence one chunk
    (``T = L``, nothing else of that size), as its growth from ``T = 1`` (fresh
    processes, medians of three; ``pytest -s`` prints it; 64 channels, a state of 16).
    The docs said ``4 ceil(log2 L)`` (12 at L = 8, 32 at 256); measured by probing,
    session 52, about ``28 + 2 log2 L`` eager and 5 more compiled from L = 32 to 256
    (2 more per doubling: one more round of the scan), 11 to 42 at L <= 16, varying
    between processes of one configuration there (docs/selective_scan.md; this test,
    five runs: 27-32 eager and 13-27 compiled at L = 8, 38-40 / 44-47 at 64, 44 / 51
    at 256; recorded: bench/results/cpu/memory_tests_selective_scan_chunk_0a52f06.jsonl).
    Bound ``40 + 4 log2 L``, loose, against a regression of the form. Negative control:
    the chunk as a product with a matrix of decays ``[L, L, Dc, N]`` (the form the docs
    explain the log-depth scan avoids): 545 arrays at L = 64."""
    shape = dict(B=1, Dc=64, N=16, C=4096)  # C >= T: the whole sequence one chunk

    def arrays(target: str, L: int, **config) -> float:
        growth = peak_growth(target, dict(shape, **config), lengths=(1, L))
        return growth / (4 * shape["B"] * L * shape["Dc"] * shape["N"])

    for L in (8, 64, 256):
        bound = 40 + 4 * math.log2(L)
        for compiled in (False, True):
            got = arrays("selective_scan_backward_peak", L, compiled=compiled)
            mode = "compiled" if compiled else "eager"
            print(f"\nL={L} {mode}: {got:.1f} arrays (bound {bound:.0f})")
            assert got <= bound, (L, compiled, got)
    got = arrays("selective_scan_matrix_chunk_peak", 64)
    print(f"\nL=64 matrix of decays (the control): {got:.1f} arrays")
    assert got > 40 + 4 * math.log2(64), got


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_a_half_precision_A_is_summed_over_the_chunks_in_float32(dtype):
    """A's gradient gathers a share from every chunk: summed in A's own dtype chunk by
    chunk, later shares were rounded away once the sum was some 256 of them (bfloat16:
    2048 where the oracle gives 8160 at T = 8192, C = 8; found by probing, session 49).
    Now it is the oracle's, whose float32 sum is rounded once: one rounding of ``dtype``
    apart at most (measured: equal): A is cast to float32 before the scan, which sums
    a param's gradient in its dtype. Negative control: ``scan(params=(A,))`` with the
    cast inside the chunk, as before, fails here (0.75 bfloat16, 9.8e-4 float16)."""
    T, Dc, N = 4096, 2, 2
    x, B, C = mx.ones((1, T, Dc)), mx.ones((1, T, N)), mx.ones((1, T, N))
    dt = mx.full((1, T, Dc), 0.1)

    def d_A(fn, **kw):
        loss = lambda A: fn(x, dt, A, B, C, **kw)[0].astype(mx.float32).sum()  # noqa: E731
        return mx.grad(loss)(mx.full((Dc, N), -1.0, dtype=dtype))

    got, ref = d_A(selective_scan, chunk_size=4), d_A(naive_selective_scan)
    assert got.dtype == dtype
    assert max_rel(got, ref) <= {mx.bfloat16: 2**-8, mx.float16: 2**-11}[dtype]
