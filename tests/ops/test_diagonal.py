"""chunkscan.diagonal_recurrence (``h_t = a_t * h_{t-1} + x_t``, RG-LRU's scan) against its
per-step oracle: values, the three gradients, low precision, compile, checks, non-finite
input and backward memory."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import diagonal_inputs, max_rel, peak_growth
from helpers import state_op_outputs_and_grads as outputs_and_grads

from chunkscan import diagonal_recurrence, naive_diagonal_recurrence

NAMES = ("h", "final_state", "dx", "da", "dh0")
# float32 against the float32 oracle: measured at most 1.7e-7 over the cases of
# test_matches_the_oracle (states, final state, three gradients); the bound is about 10x.
FP32_TOL = 2e-6


def errors(got, ref):
    return {n: max_rel(a, b) for n, a, b in zip(NAMES, got, ref)}


CASES = [  # (B, T, D, chunk)
    (1, 1, 3, 8),
    (2, 5, 4, 8),  # T < chunk
    (1, 37, 6, 8),  # T not a multiple of the chunk
    (2, 300, 5, 64),
    (1, 50, 3, 1),
    (1, 50, 3, 3),
]


@pytest.mark.parametrize("B, T, D, C", CASES)
def test_matches_the_oracle(B, T, D, C):
    args = diagonal_inputs(B, T, D, seed=T)
    got = outputs_and_grads(diagonal_recurrence, args, chunk_size=C)
    ref = outputs_and_grads(naive_diagonal_recurrence, args)
    bad = {n: e for n, e in errors(got, ref).items() if not e <= FP32_TOL}
    assert not bad, f"max relative error above {FP32_TOL}: {bad}"


def test_trailing_dimensions():
    """``[B, T, ...]``: the recurrence is elementwise over every trailing axis."""
    x, a, h0 = diagonal_inputs(2, 19, 12)
    x4, a4, h4 = x.reshape(2, 19, 3, 4), a.reshape(2, 19, 3, 4), h0.reshape(2, 3, 4)
    h, last = diagonal_recurrence(x4, a4, initial_state=h4, chunk_size=4)
    ref, ref_last = naive_diagonal_recurrence(x, a, initial_state=h0)
    assert max_rel(h.reshape(2, 19, 12), ref) <= FP32_TOL
    assert max_rel(last.reshape(2, 12), ref_last) <= FP32_TOL


def test_compiled_matches_eager():
    args = diagonal_inputs(2, 45, 4)
    eager = outputs_and_grads(diagonal_recurrence, args, chunk_size=8)
    compiled = outputs_and_grads(diagonal_recurrence, args, chunk_size=8, compiled=True)
    bad = {n: e for n, e in errors(compiled, eager).items() if not e <= FP32_TOL}
    assert not bad, bad


# bfloat16 / float16 inputs against the same call on their float32 upcast (the op
# computes in float32: the only difference is the rounding of h and of the gradients of
# x and a). Measured at most 3.3e-3 / 4.7e-4 over five seeds (the float32 results
# equal); the bound is about 4x.
LOW_TOL = {mx.bfloat16: 1.3e-2, mx.float16: 2e-3}
ROUNDED = ("h", "dx", "da")


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_low_precision_is_the_upcast_call_rounded(dtype):
    args = diagonal_inputs(1, 40, 8, dtype=dtype)
    up = tuple(t.astype(mx.float32) for t in args)
    got = outputs_and_grads(diagonal_recurrence, args, chunk_size=8, exact_in=dtype)
    ref = outputs_and_grads(diagonal_recurrence, up, chunk_size=8, exact_in=dtype)
    assert got[0].dtype == dtype and got[1].dtype == mx.float32
    errs = errors(got, ref)
    assert max(errs[n] for n in ROUNDED) <= LOW_TOL[dtype], errs
    assert max(e for n, e in errs.items() if n not in ROUNDED) <= FP32_TOL, errs


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=mx.zeros((5,))), r"x must have at least 2 dimensions.*x\[None\]"),
        (dict(a=mx.zeros((1, 5))), r"a must have x's shape \(1, 5, 4\)"),
        (dict(initial_state=mx.zeros((1, 5))), r"initial_state must have shape \[1, 4\]"),
        (dict(a=mx.zeros((1, 5, 4), dtype=mx.int32)), "a must have dtype"),
        (dict(a=mx.zeros((1, 5, 4), dtype=mx.int32)), r"Cast it with a.astype\(mx.float32\)"),
        # LRU's decays are complex; a cast drops the imaginary part (found by probing:
        # the message suggested that cast)
        (dict(a=mx.zeros((1, 5, 4), dtype=mx.complex64)), "Complex numbers are not supported"),
    ],
)
def test_bad_inputs_are_named(change, match):
    args = dict(x=mx.zeros((1, 5, 4)), a=mx.zeros((1, 5, 4)), initial_state=None)
    args.update(change)
    for fn in (diagonal_recurrence, naive_diagonal_recurrence):
        with pytest.raises(ValueError, match=match):
            fn(**args)


@pytest.mark.parametrize(
    "chunk_size, error", [(0, ValueError), (False, TypeError), (-3, ValueError), (2.0, TypeError)]
)
def test_a_chunk_size_that_is_not_a_positive_int_raises(chunk_size, error):
    x, a, _ = diagonal_inputs(1, 5, 2)
    for fn in (diagonal_recurrence, naive_diagonal_recurrence):
        with pytest.raises(error, match="chunk_size"):
            fn(x, a, chunk_size=chunk_size)


@pytest.mark.parametrize("name", ["x", "a", "h0"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_input_reaches_what_the_loop_reaches(name, value):
    """A NaN or infinity in ``x``, ``a`` (step 5, a chunk's middle) or the initial state:
    the states, the final state and the three gradients are non-finite exactly where
    the per-step loop's are, and equal elsewhere."""
    args = list(diagonal_inputs(1, 16, 3))
    index = {"x": 0, "a": 1, "h0": 2}[name]
    bad = np.array(args[index])
    bad[(0, 5, 1) if name != "h0" else (0, 1)] = value
    args[index] = mx.array(bad)
    got = outputs_and_grads(diagonal_recurrence, args, chunk_size=8)
    ref = outputs_and_grads(naive_diagonal_recurrence, args)
    for n, a, b in zip(NAMES, got, ref):
        finite = np.isfinite(np.array(b))
        assert np.array_equal(np.isfinite(np.array(a)), finite), n
        ok_a, ok_b = np.array(a)[finite], np.array(b)[finite]
        if ok_b.size:
            assert np.abs(ok_a - ok_b).max() <= FP32_TOL * max(np.abs(ok_b).max(), 1e-30), n


def test_empty_sequence():
    x, a, h0 = diagonal_inputs(2, 0, 3)
    h, last = diagonal_recurrence(x, a, initial_state=h0)
    assert h.shape == (2, 0, 3) and mx.array_equal(last, h0).item()


def test_backward_memory_is_one_chunk():
    """Peak growth of the three gradients from T = 256 to 1024 (fresh processes; 256
    channels, chunks of 64) within twice what the call must keep per token, the
    gradients of ``x`` and ``a`` and the states (float32: ``3 D``), and the state kept
    per chunk (the concatenations of the chunks' states and gradients hold the pieces
    and the whole at once): measured 2.73 / 3.59 MiB eager / compiled against the bound
    of 4.52. The negative control: the whole sequence one chunk (its parallel scan's
    ``log2 T`` rounds recomputed at once), 35.9 MiB
    (``bench/results/cpu/memory_tests_98117e4.jsonl``)."""
    D, C = 256, 64
    bound = 2 * (1024 - 256) * (4 * 3 * D + 4 * D / C)
    for compiled in (False, True):
        growth = peak_growth("diagonal_backward_peak", dict(B=1, D=D, C=C, compiled=compiled))
        assert growth <= bound, f"grew by {growth / 2**20:.2f} > {bound / 2**20:.2f} MiB"
    grew = peak_growth("diagonal_backward_peak", dict(B=1, D=D, C=4096))
    assert grew > bound, f"one chunk grew by {grew / 2**20:.2f} MiB only"
