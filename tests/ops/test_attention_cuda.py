"""The CUDA backward of chunkscan.attention (ops/attention/_cuda.py).

Everywhere: which calls the kernels take, that the dispatch sends them there and only
there, that their construction is guarded and that their shared memory fits; with g++,
the kernels' CUDA sources run on the CPU through tools/cuda_emulate.py (values against
the oracle, as below). Where MLX has a CUDA GPU: values of o, dq, dk, dv against the
float32 oracle on the upcast inputs, next to the blocked path's own error (run them with
`bash bench/h200_suite.sh tests`; the output is committed under bench/results/h200/).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil

import mlx.core as mx
import pytest
from helpers import attention_inputs as make_inputs
from helpers import cuda_emulator, fake_cuda_limits, max_rel, rel_rmse

from chunkscan import _backend
from chunkscan.ops.attention import _cuda, blocked, naive_attention
from chunkscan.ops.attention._checks import check_inputs

HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")


def _spec(T, S, D, Dv, mask, dtype=mx.bfloat16, Hq=4, Hkv=2):
    q, k, v, _ = make_inputs(1, Hq, Hkv, T, S, D, Dv, dtype=dtype)
    return check_inputs("t", q, k, v, 1.0, mask, None)


def test_supports():
    assert _cuda.supports(_spec(64, 64, 256, 256, "causal"), mx.bfloat16)
    assert _cuda.supports(_spec(30, 70, 64, 128, "causal"), mx.bfloat16)  # T < S
    assert not _cuda.supports(_spec(30, 70, 64, 128, "causal"), mx.float16)  # range of p~
    assert _cuda.supports(_spec(70, 30, 64, 64, None), mx.bfloat16)
    assert not _cuda.supports(_spec(70, 30, 64, 64, "causal"), mx.bfloat16)  # rows see nothing
    assert not _cuda.supports(_spec(8, 8, 64, 64, None), mx.float32)
    assert not _cuda.supports(_spec(8, 8, 96, 64, None), mx.bfloat16)  # D % 64
    assert not _cuda.supports(_spec(8, 8, 64, 32, None), mx.bfloat16)  # Dv < 64
    assert not _cuda.supports(_spec(8, 8, 64, 288, None), mx.bfloat16)  # Dv > 256
    assert not _cuda.supports(_spec(8, 8, 64, 64, mx.ones((8, 8), mx.bool_)), mx.bfloat16)
    # a scale whose product with log2(e) overflows float32: every kernel output was NaN
    # (their scores are taken in base 2; found by the emulator probe, session 35)
    for scale, taken in ((2.3e38, True), (-2.3e38, True), (2.4e38, False), (-3e38, False)):
        spec = dataclasses.replace(_spec(8, 8, 64, 64, None), scale=scale)
        assert _cuda.supports(spec, mx.bfloat16) is taken, scale


@pytest.mark.parametrize("kib, sizes", [(163, (64, 128, 192)), (99, (64,))])
def test_supports_follows_the_device_shared_memory(monkeypatch, kib, sizes):
    """An A100 (163 KiB per block) takes head sizes up to 192, a consumer GPU (99 KiB)
    64 only; larger heads run the blocked ops instead of failing at launch."""
    fake_cuda_limits(monkeypatch, kib)
    for D in (64, 128, 192, 256):
        assert _cuda.supports(_spec(8, 8, D, D, None), mx.bfloat16) == (D in sizes), D


def test_shared_memory_fits_every_head_size():
    for D in range(64, 257, 64):
        for Dv in range(64, 257, 64):
            sm = _cuda.smem_bytes(D, Dv)
            assert max(sm.values()) <= _cuda._SMEM_LIMIT, (D, Dv, sm)


def test_dispatch_sends_supported_calls_to_the_kernel(monkeypatch):
    calls = []

    def fake(spec, q, k, v, o, do):
        calls.append(spec)
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v)

    def fake_forward(spec, q, k, v):
        calls.append("fwd")
        return mx.zeros((spec.B, spec.Hq, spec.T, spec.Dv), q.dtype)

    monkeypatch.setattr(blocked, "use_kernels", lambda kernels=None, fn=None: kernels is not False)
    monkeypatch.setattr(_cuda, "backward", fake)
    monkeypatch.setattr(_cuda, "forward", fake_forward)

    def grads(dtype, mask, **kw):
        q, k, v, ct = make_inputs(1, 4, 2, 40, 40, 64, dtype=dtype)
        f = lambda q, k, v: [blocked.blocked_attention(q, k, v, scale=0.2, mask=mask, **kw)]  # noqa: E731
        return mx.vjp(f, [q, k, v], [ct])[1]

    dq = grads(mx.bfloat16, "causal")[0]
    assert len(calls) == 2 and calls[0] == "fwd" and not mx.any(dq).item()
    grads(mx.float32, "causal")  # float32: the blocked ops
    grads(mx.bfloat16, mx.ones((40, 40), mx.bool_))  # array mask: the blocked ops
    dq = grads(mx.bfloat16, "causal", kernels=False)[0]  # switched off
    assert len(calls) == 2 and mx.any(dq).item()


@pytest.mark.skipif(HAS_CUDA, reason="checks the guard where there is no CUDA")
def test_kernel_construction_is_guarded():
    with pytest.raises(RuntimeError, match=r"\[attention\] the CUDA kernel is unavailable"):
        _cuda._kernel("dq", 1024)


def _grads(kw, fn, *xs, **extra):
    """``[o, dq, dk, dv]`` of ``fn(q, k, v, **kw, **extra)`` for ``xs = (q, k, v, ct)``."""
    f = lambda q, k, v: [fn(q, k, v, **kw, **extra)]  # noqa: E731
    outs, gs = mx.vjp(f, list(xs[:3]), [xs[3]])
    return [outs[0], *gs]


# (B, Hq, Hkv, T, S, D, Dv, mask, dtype, grow): grow = keys scaled up along S (x1 to x4),
# so that row maxima rise over the key tiles and the online reference moves: in the
# second case 429 of the 4800 rows move it after their first tile (counted on the CPU
# by replaying the kernel's rule on the same inputs); without grow, none do.
CUDA_CASES = [
    (1, 16, 2, 300, 300, 256, 256, "causal", mx.bfloat16, False),  # Qwen3-Next heads
    (1, 16, 2, 300, 300, 256, 256, "causal", mx.bfloat16, True),
    (2, 4, 4, 130, 257, 64, 128, "causal", mx.bfloat16, False),  # T < S, Dv != D, G = 1
    (1, 8, 1, 1, 77, 128, 128, "causal", mx.bfloat16, False),  # T = 1, G = 8
    (2, 4, 2, 96, 40, 64, 64, None, mx.bfloat16, False),  # no mask, T > S
    (1, 2, 1, 64, 64, 256, 64, None, mx.bfloat16, False),  # one tile each way
]


@needs_cuda
@pytest.mark.parametrize(
    "case",
    CUDA_CASES,
    ids=["B{}-Hq{}-Hkv{}-T{}-S{}-D{}-Dv{}-{}-{}-grow{}".format(*c) for c in CUDA_CASES],
)
def test_cuda_backward_against_the_upcast_oracle(case, monkeypatch):
    B, Hq, Hkv, T, S, D, Dv, mask, dtype, grow = case
    used = []
    real = _cuda.backward
    monkeypatch.setattr(_cuda, "backward", lambda *a: used.append(1) or real(*a))
    q, k, v, ct = make_inputs(B, Hq, Hkv, T, S, D, Dv, dtype=dtype)
    if grow:
        k = (k.astype(mx.float32) * (1 + 3 * mx.arange(S) / S)[:, None]).astype(dtype)
    grads = functools.partial(_grads, dict(scale=D**-0.5, mask=mask))
    ref = grads(naive_attention, *[x.astype(mx.float32) for x in (q, k, v, ct)])
    got = grads(blocked.blocked_attention, q, k, v, ct)  # automatic: the kernel
    assert used, "the automatic path did not use the kernel"
    ops = grads(blocked.blocked_attention, q, k, v, ct, kernels=False)
    compiled = mx.compile(lambda *xs: grads(blocked.blocked_attention, *xs))(q, k, v, ct)
    # o: the forward kernel against the blocked path's forward (MLX's fused kernel).
    # Both paths round p and ds to the input dtype before their products, so the
    # kernel's error against float32 is of the blocked ops' size. Measured on the H200
    # (bench/results/h200/tests_h200_attention_cuda.txt): kernel rel. RMSE 0.3x-1.2x
    # the ops', max relative error 0.2x-1.4x the ops' (at most 5.8e-3 in bf16).
    # Bounds: 2x the blocked path's own errors, measured here in the same call.
    for name, a, b, c, r in zip(("o", "dq", "dk", "dv"), got, ops, compiled, ref):
        assert a.dtype == dtype and a.shape == r.shape, name
        e_k, e_o, e_c = rel_rmse(a, r), rel_rmse(b, r), rel_rmse(c, r)
        m_k, m_o = max_rel(a, r), max_rel(b, r)
        print(f"{name}: kernel {e_k:.2e} ops {e_o:.2e} compiled {e_c:.2e} "
              f"max-rel kernel {m_k:.2e} ops {m_o:.2e}")  # fmt: skip
        assert e_k <= 2 * e_o + 1e-6, f"{name}: kernel {e_k:.2e} vs ops {e_o:.2e}"
        assert e_c <= 2 * e_o + 1e-6, f"{name}: compiled {e_c:.2e} vs ops {e_o:.2e}"
        assert m_k <= 2 * m_o + 1e-6, f"{name}: max-rel kernel {m_k:.2e} vs ops {m_o:.2e}"


@needs_cuda
def test_cuda_kernels_read_transposed_inputs(monkeypatch):
    """mlx-lm passes views ([B, T, H, D] transposed to [B, H, T, D]): the kernels see the
    same values as on row-contiguous copies (MLX copies them: ensure_row_contiguous),
    so the results are identical, bit for bit."""
    B, Hq, Hkv, T, D = 1, 4, 2, 200, 128
    q, k, v, ct = make_inputs(B, Hq, Hkv, T, T, D, dtype=mx.bfloat16)
    base = [mx.contiguous(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]  # [B, T, H, D]
    views = [x.transpose(0, 2, 1, 3) for x in base]  # q, k, v's values, strided views
    mx.eval(views)

    def run(q, k, v):
        f = lambda q, k, v: [blocked.blocked_attention(q, k, v, scale=D**-0.5, mask="causal")]  # noqa: E731
        outs, gs = mx.vjp(f, [q, k, v], [ct])
        return [outs[0], *gs]

    used = []
    real = _cuda.backward
    monkeypatch.setattr(_cuda, "backward", lambda *a: used.append(1) or real(*a))
    for a, b in zip(run(*views), run(q, k, v)):
        assert mx.array_equal(a, b).item()
    assert len(used) == 2, "the calls did not take the kernels"


def _one_element_in(x):
    """``x``'s values as a row-contiguous view one element into a buffer (MLX hands such
    a view to a kernel as it is: 2 bytes past a 16-byte boundary for bf16)."""
    flat = mx.concatenate([mx.zeros((1,), dtype=x.dtype), x.reshape(-1)])
    return flat[1:].reshape(x.shape)


@needs_cuda
def test_cuda_kernels_read_inputs_at_an_odd_offset(monkeypatch):
    """q, k, v and the cotangent as views one element into a buffer: the kernels' 16-byte
    loads of them were misaligned (a fault on the device; found by the emulator probe,
    session 35); now eight 2-byte loads each, and every result equals the aligned call's,
    bit for bit."""
    B, Hq, Hkv, T, D = 1, 4, 2, 200, 128
    q, k, v, ct = make_inputs(B, Hq, Hkv, T, T, D, dtype=mx.bfloat16)
    odd = [_one_element_in(x) for x in (q, k, v, ct)]
    mx.eval(odd)
    kw = dict(scale=D**-0.5, mask="causal")
    used = []
    real = _cuda.backward
    monkeypatch.setattr(_cuda, "backward", lambda *a: used.append(1) or real(*a))
    for a, b in zip(_grads(kw, blocked.blocked_attention, *odd),
                    _grads(kw, blocked.blocked_attention, q, k, v, ct)):  # fmt: skip
        assert mx.array_equal(a, b).item()
    assert len(used) == 2, "the calls did not take the kernels"


# ------------------------------------------------------------- emulated on the CPU

EMULATED_CASES = [
    (1, 2, 1, 70, 70, 64, 64, "causal"),  # two tiles each way, ragged, G = 2
    (1, 2, 2, 40, 100, 64, 128, None),  # no mask, T < S, Dv != D
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")
@pytest.mark.parametrize("case", EMULATED_CASES, ids=["causal-2tiles", "nomask-Dv128"])
def test_emulated_kernels_against_the_upcast_oracle(case, monkeypatch):
    """The three kernels' CUDA sources run on the CPU (tools/cuda_emulate.py: wmma,
    warp shuffles and block votes emulated) inside the op, under the same bounds as
    the CUDA test above: 2x the blocked ops' own error against the float32 oracle."""
    B, Hq, Hkv, T, S, D, Dv, mask = case
    monkeypatch.setattr(_backend, "RUNNER", cuda_emulator().run)
    monkeypatch.setattr(blocked, "uses_cuda_kernels", lambda spec, dtype, kernels: (
        kernels is not False and _cuda.supports(spec, dtype)))  # fmt: skip
    monkeypatch.setattr(blocked, "_use_fast", lambda spec, dtype: False)
    used = []
    real = _cuda.backward
    monkeypatch.setattr(_cuda, "backward", lambda *a: used.append(1) or real(*a))
    q, k, v, ct = make_inputs(B, Hq, Hkv, T, S, D, Dv, dtype=mx.bfloat16)
    grads = functools.partial(_grads, dict(scale=D**-0.5, mask=mask))
    ref = grads(naive_attention, *[x.astype(mx.float32) for x in (q, k, v, ct)])
    got = grads(blocked.blocked_attention, q, k, v, ct)
    assert used, "the kernels did not run"
    calls = len(used)
    ops = grads(blocked.blocked_attention, q, k, v, ct, kernels=False)
    assert len(used) == calls, "kernels=False ran the kernels"
    # Not bitwise the ops' results, as the same path twice would be (each output on its
    # own was too strict: since the ops' scores are float32 (session 39) their dv can
    # equal the kernels' bit for bit)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(got, ops)), "the same path twice?"
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), got, ops, ref):
        assert a.dtype == mx.bfloat16 and a.shape == r.shape, name
        e_k, e_o = rel_rmse(a, r), rel_rmse(b, r)
        assert e_k <= 2 * e_o + 1e-6, f"{name}: kernel {e_k:.2e} vs ops {e_o:.2e}"
        assert max_rel(a, r) <= 2 * max_rel(b, r) + 1e-6, name


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")
def test_emulated_kernels_read_inputs_at_an_odd_offset(monkeypatch):
    """Every input of the three kernels one element past a 16-byte boundary (as MLX
    passes a view at an odd offset): bitwise the aligned run's values. Their 16-byte
    loads of such inputs stopped the emulator (a fault on a device; session 35)."""
    emu = cuda_emulator()
    monkeypatch.setattr(_backend, "RUNNER", emu.run)
    monkeypatch.setattr(blocked, "uses_cuda_kernels", lambda spec, dtype, kernels: (
        kernels is not False and _cuda.supports(spec, dtype)))  # fmt: skip
    monkeypatch.setattr(blocked, "_use_fast", lambda spec, dtype: False)
    B, Hq, Hkv, T, S, D, Dv, mask = EMULATED_CASES[0]
    q, k, v, ct = make_inputs(B, Hq, Hkv, T, S, D, Dv, dtype=mx.bfloat16)
    grads = functools.partial(_grads, dict(scale=D**-0.5, mask=mask), blocked.blocked_attention)
    aligned = grads(q, k, v, ct)
    monkeypatch.setattr(emu, "ODD_INPUTS", frozenset({"q", "k", "v", "dout", "o"}))
    for name, a, b in zip(("o", "dq", "dk", "dv"), aligned, grads(q, k, v, ct)):
        assert mx.array_equal(a, b).item(), name
