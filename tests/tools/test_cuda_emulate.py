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
