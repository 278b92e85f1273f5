"""The small CUDA kernels of gated_delta_rule (``_rows_cuda``) against the MLX ops
they replace: the same bits, run by the CPU emulator everywhere with ``g++`` and compiled
on a CUDA device (``-k cuda``; outputs in bench/results/h200/)."""

from __future__ import annotations

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import cuda_emulator, spoil_token
from helpers import gated_delta_inputs as make_inputs

from chunkscan import _backend
from chunkscan.ops.gated_delta import _rows_cuda, gated_delta_rule
from chunkscan.ops.gated_delta import chunk as chunk_module
from chunkscan.ops.gated_delta._checks import Spec

HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(_backend, "RUNNER", cuda_emulator().run)


def spoilt_inputs(B, T, Hk, G, Dk, Dv, dtype, channel, seed):
    """Random inputs with a NaN, a +inf and a -inf in every input, after T / 3 (so
    that every head has good tokens before its first bad one)."""
    rng = np.random.default_rng(seed)
    Hv = Hk * G
    shapes = {"q": (B, T, Hk, Dk), "k": (B, T, Hk, Dk), "v": (B, T, Hv, Dv),
              "g": (B, T, Hv, Dk) if channel else (B, T, Hv), "beta": (B, T, Hv)}  # fmt: skip
    xs = {}
    for name, shape in shapes.items():
        x = rng.normal(size=shape).astype(np.float32)
        late = x[:, T // 3 :].reshape(-1)
        late[rng.integers(0, late.size, size=3)] = (math.nan, math.inf, -math.inf)
        x[:, T // 3 :] = late.reshape(x[:, T // 3 :].shape)
        xs[name] = mx.array(x).astype(dtype)
    return xs


def spec_of(xs, seqs=None) -> Spec:
    B, T, Hk, Dk = xs["q"].shape
    Hv, Dv = xs["v"].shape[-2:]
    return Spec(B, T, Hk, Hv, Dk, Dv, Dk**-0.5, 16, seqs, channel=xs["g"].ndim == 4)


CASES = [  # (B, T, Hk, G, Dk, Dv, dtype, channel, packed)
    (2, 37, 2, 2, 32, 64, mx.bfloat16, False, False),
    (1, 40, 3, 1, 40, 8, mx.float32, False, True),
    (1, 23, 1, 3, 16, 32, mx.float16, True, False),
]


def check_masks(case, seed=0):
    B, T, Hk, G, Dk, Dv, dtype, channel, packed = case
    xs = spoilt_inputs(B, T, Hk, G, Dk, Dv, dtype, channel, seed)
    seqs = ((0, 11), (11, 30), (30, T)) if packed else None
    spec = spec_of(xs, seqs)
    args = [xs[n] for n in ("q", "k", "v", "g", "beta")]
    ref = chunk_module._non_finite_reach(spec, *args, kernel=False)
    got = chunk_module._non_finite_reach(spec, *args, kernel=True)
    for r, x in zip(ref, got):
        assert r.dtype == x.dtype and r.shape == x.shape
        assert mx.array_equal(r, x).item()
    o_bad = np.array(ref[0])
    assert o_bad.any() and not o_bad.all()  # the case exercises both


REACH_CASES = [  # (B, Hv, T, packed): one tile of the kernel's 1024 tokens, and three
    (2, 3, 37, False),
    (1, 2, 2500, True),
    (3, 1, 3000, False),
]


def check_reach(case, seed=0):
    """non_finite_reach against the MLX ops on sparse random flags (about 0.7 per head
    and batch row, q's 0.5) and random sequence boundaries, one right after a flagged
    row and two seven tokens after one (negative controls: the carry between tiles,
    the restart in the scan's join, each dropped, fail)."""
    B, Hv, T, packed = case
    rng = np.random.default_rng(seed)
    bad_rows = mx.array((rng.random((B, Hv, T)) < 0.7 / T).astype(np.int32))
    q_bad = mx.array(rng.random((B, T, Hv)) < 0.5 / T)
    seqs = None
    if packed:
        # a sequence starting right after a flagged row, and two a few tokens after one
        flagged = np.nonzero(np.array(bad_rows).any(axis=(0, 1)))[0]
        after = {int(flagged[0]) + 1} | {int(f) + 7 for f in flagged[1:3]}
        cuts = set(rng.integers(1, T, size=12).tolist()) | after | {1, T - 1}
        offsets = [0, *sorted(c for c in cuts if 0 < c < T), T]
        seqs = tuple(zip(offsets, offsets[1:]))
    ref = chunk_module._reach(bad_rows, q_bad, seqs)
    got = _rows_cuda.non_finite_reach(bad_rows, q_bad, seqs)
    for r, x in zip(ref, got):
        assert r.dtype == x.dtype and r.shape == x.shape
        assert mx.array_equal(r, x).item()
    seq_bad = np.array(ref[1])
    assert seq_bad.any() and not seq_bad.all()  # the case exercises both


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=["bf16-G2", "fp32-packed", "fp16-channel-G3"])
def test_emulated_non_finite_rows_match_the_ops(emulated, case):
    check_masks(case)


@needs_cxx
@pytest.mark.parametrize("case", REACH_CASES, ids=["short", "packed", "batched"])
def test_emulated_non_finite_reach_matches_the_ops(emulated, case):
    check_reach(case)


def test_supported_shapes():
    assert _rows_cuda.rows_supported(65535, 32, 30)
    assert not _rows_cuda.rows_supported(1, 33, 1)  # a warp per key head, 1024 threads
    assert not _rows_cuda.rows_supported(1, 1, 31)  # a flag bit per value head
    assert not _rows_cuda.rows_supported(65536, 1, 1)  # the grid's second dimension


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=["bf16-G2", "fp32-packed", "fp16-channel-G3"])
def test_cuda_non_finite_rows_match_the_ops(case):
    check_masks(case)


@needs_cuda
@pytest.mark.parametrize("case", REACH_CASES, ids=["short", "packed", "batched"])
def test_cuda_non_finite_reach_matches_the_ops(case):
    check_reach(case)


@needs_cuda
@pytest.mark.parametrize(
    "name, value", [("q", -math.inf), ("k", math.nan), ("v", math.inf), ("g", math.inf)]
)
def test_cuda_op_with_non_finite_input_matches_the_portable_op(monkeypatch, name, value):
    """The whole op on the device with one non-finite input at token t, the kernels on
    (the fused kernels and the flags of non_finite_rows) and off: NaN from t on in both,
    the same values before t (TF32 off: float32 products both ways; the fused kernels'
    errors are ~1e-6, test_gated_delta_fused), and gradients finite, none for the
    spoilt input from t on."""
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    T, t = 200, 100
    inputs = make_inputs(1, T, 1, 2, 64, 64)
    i = spoil_token(inputs, name, value, t)
    w = mx.random.normal((1, T, 2, 64), key=mx.random.key(5))

    def run(kernels):
        def loss(*xs):
            o, _ = gated_delta_rule(*xs[:5], initial_state=xs[5], chunk_size=64, kernels=kernels)
            return mx.sum(mx.where(mx.arange(T)[None, :, None, None] < t, o * w, 0.0))

        o, s = gated_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=64,
                                kernels=kernels)  # fmt: skip
        return o, s, mx.grad(loss, argnums=tuple(range(6)))(*inputs)

    (o, s, grads), (o_ref, s_ref, grads_ref) = run(True), run(False)
    finite = mx.all(mx.isfinite(o), axis=(2, 3))[0].tolist()
    assert finite == mx.all(mx.isfinite(o_ref), axis=(2, 3))[0].tolist()
    assert all(finite[:t]) and not finite[t]
    assert mx.allclose(o[:, :t], o_ref[:, :t], rtol=1e-4, atol=1e-5).item()
    assert mx.array_equal(mx.isnan(s), mx.isnan(s_ref)).item()
    for gr, ref in zip(grads, grads_ref):
        assert mx.all(mx.isfinite(gr)).item()
        assert mx.allclose(gr, ref, rtol=1e-4, atol=1e-5).item()
    assert mx.abs(grads[i][:, t:]).max().item() == 0.0
