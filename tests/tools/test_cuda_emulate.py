"""tools/cuda_emulate.py, the CPU runner of CUDA kernel sources the fused-kernel tests
use: block-wide barriers, shared memory per block, dtypes, and out-of-bounds accesses
stopped by AddressSanitizer."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from helpers import cuda_emulator

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")

HEADER = r"""
#ifndef CS_EMULATE
#define CS_DYN_SMEM(name) extern __shared__ float name[]
#endif
"""

# Each block reverses its 64 values through shared memory (without the barrier, 32 of
# the 64 outputs read the NaN fill: checked by hand, not a test, the OS schedules).
REVERSE = r"""
  CS_DYN_SMEM(sm);
  const int t = threadIdx.x, base = blockIdx.x * 64;
  sm[t] = static_cast<float>(x[base + t]) * 2.f;
  __syncthreads();
  y[base + t] = static_cast<T>(sm[63 - t]);
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_blocks_barriers_and_dtypes(dtype):
    x = mx.arange(3 * 64).astype(dtype)
    (y,) = cuda_emulator().run("rev", HEADER, REVERSE, [("x", x)], [("y", (3 * 64,), dtype)],
                           [("T", dtype)], (3 * 64, 1, 1), (64, 1, 1), 64 * 4)  # fmt: skip
    want = (2 * x.astype(mx.float32)).reshape(3, 64)[:, ::-1].reshape(-1)
    assert y.dtype == dtype
    assert mx.array_equal(y.astype(mx.float32), want).item()


def test_shared_memory_overflow_is_stopped():
    emu = cuda_emulator()
    if not emu._sanitizer_flags():
        pytest.skip("the compiler has no AddressSanitizer")
    x = mx.arange(64).astype(mx.float32)
    with pytest.raises(RuntimeError, match="AddressSanitizer"):  # 63 floats for 64 values
        emu.run("rev", HEADER, REVERSE, [("x", x)], [("y", (64,), mx.float32)],
                [("T", mx.float32)], (64, 1, 1), (64, 1, 1), 63 * 4)  # fmt: skip


def test_mma_sync_sums_as_the_h200_does():
    """The emulator's ``mma_sync`` (tf32, float32 accumulator) against one on the H200:
    ``bench/tc_probe.py``'s 96 problems (24576 outputs, a third of them cancelling),
    recorded in run 29. Every output equal, bit for bit. Rounding the exact sum to
    nearest matches 28% of them, and a model that aligns to 23 bits over all eight
    products at once 10% (the emulator's model before run 29)."""
    import pathlib
    import sys

    import numpy as np

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    try:
        import tc_probe
    finally:
        sys.path.pop(0)
    rec = np.load(root / "bench" / "results" / "h200" / "tc_probe_h200_3d40356.npz")
    got = tc_probe.run(rec["a"], rec["b"], rec["c"], runner=cuda_emulator().run)
    assert got.shape == rec["d"].shape
    assert np.array_equal(got.view(np.uint32), rec["d"].view(np.uint32))
    # the problems do exercise the truncation: to nearest differs on most outputs
    exact = np.einsum("pik,pkj->pij", rec["a"].astype(np.float64), rec["b"]) + rec["c"]
    assert np.mean(exact.astype(np.float32) == rec["d"]) < 0.5


# Four values per thread: a float4 load, or a 16-byte cp.async into shared memory (the
# helper's form the emulator rewrites: tools/cuda_emulate.py, _host_source).
COPY4 = r"""
  CS_DYN_SMEM(sm);
  const int t = threadIdx.x;
  if (VIA_CP) {
    cp16(sm + 4 * t, x + 4 * t);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  } else {
    *reinterpret_cast<float4*>(sm + 4 * t) = *reinterpret_cast<const float4*>(x + 4 * t);
  }
  __syncthreads();
  for (int e = 0; e < 4; ++e) y[4 * t + e] = sm[4 * t + e];
"""
CP16 = r"""
__device__ __forceinline__ void cp16(float* dst, const float* src) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
"""


# Two groups of 16-byte copies (x's first half, then its second), then a wait for all but
# the WAIT most recent groups (WAIT < 0: none) and a barrier.
COPY_GROUPS = r"""
  CS_DYN_SMEM(sm);
  const int t = threadIdx.x;
  cp16(sm + 4 * t, x + 4 * t);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  cp16(sm + 64 + 4 * t, x + 64 + 4 * t);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  if (WAIT == 0) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  if (WAIT == 1) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();
  for (int e = 0; e < 4; ++e) {
    y[4 * t + e] = sm[4 * t + e];
    y[64 + 4 * t + e] = sm[64 + 4 * t + e];
  }
"""


@pytest.mark.parametrize("landing", ["at wait", "at issue"])
@pytest.mark.parametrize("wait", [-1, 1, 0])
def test_a_copy_lands_at_its_groups_wait(wait, landing, monkeypatch):
    """cp.async copies land when their thread waits for their group (session 39; they
    landed at once before, so a kernel that read a tile before waiting for it passed
    here): with no wait a read sees the shared memory as it was (NaN-filled), after
    ``wait_group 1`` the first group only, after ``wait_group 0`` both. With
    ``COPIES_LAND = "at issue"`` every copy has landed at once."""
    emu = cuda_emulator()
    monkeypatch.setattr(emu, "COPIES_LAND", landing)
    x = mx.arange(128).astype(mx.float32)
    (y,) = emu.run(
        "copy_groups", HEADER + CP16, COPY_GROUPS, [("x", x)], [("y", (128,), mx.float32)],
        [("WAIT", wait)], (16, 1, 1), (16, 1, 1), 128 * 4,
    )  # fmt: skip
    landed = {-1: 0, 1: 64, 0: 128}[wait] if landing == "at wait" else 128
    assert mx.array_equal(y[:landed], x[:landed]).item()
    assert mx.isnan(y[landed:]).all().item()


@pytest.mark.parametrize("via_cp", [False, True], ids=["float4", "cp.async"])
def test_misaligned_vector_access_is_stopped(via_cp, monkeypatch):
    """CUDA's alignment rules (session 35): a 16-byte load or cp.async from an address
    that is not a multiple of 16 faults on a device, so the emulator stops there; the
    same kernel on an aligned input (the negative control) runs and copies the values.
    ODD_INPUTS places an input one element past a 16-byte boundary, as MLX passes a view
    at an odd offset."""
    emu = cuda_emulator()
    x = mx.arange(64).astype(mx.float32)
    args = (HEADER + CP16, COPY4, [("x", x)], [("y", (64,), mx.float32)],
            [("VIA_CP", via_cp)], (16, 1, 1), (16, 1, 1), 64 * 4)  # fmt: skip
    (y,) = emu.run("copy4", *args)
    assert mx.array_equal(y, x).item()
    monkeypatch.setattr(emu, "ODD_INPUTS", frozenset({"x"}))
    with pytest.raises(RuntimeError, match="misaligned"):
        emu.run("copy4", *args)


def test_an_unknown_copies_land_raises(monkeypatch):
    """A misspelt mode ran the default silently (found by review)."""
    emu = cuda_emulator()
    monkeypatch.setattr(emu, "COPIES_LAND", "at_issue")
    x = mx.arange(128).astype(mx.float32)
    with pytest.raises(ValueError, match="COPIES_LAND must be 'at wait' or 'at issue'"):
        emu.run(
            "copy_groups", HEADER + CP16, COPY_GROUPS, [("x", x)], [("y", (128,), mx.float32)],
            [("WAIT", 0)], (16, 1, 1), (16, 1, 1), 128 * 4,
        )  # fmt: skip
