"""What one tensor-core product gives on this GPU: ``wmma::mma_sync`` (16 x 16 x 8, tf32
operands, float32 accumulator) on random problems, saved with its inputs so that
``tools/cuda_emulate.py``'s model of it can be checked against the hardware on a machine
without a GPU (``tests/tools/test_cuda_emulate.py`` reads the committed file).

    python3 bench/tc_probe.py --out bench-out/tc_probe.npz

The operands are tf32 values already (10 mantissa bits), so the file records only how
the products are summed: the accumulator ``c`` and the eight products of each output,
with magnitudes spread over 2^-8 .. 2^8 and random signs, and in a third of the
problems ``c`` near the negated sum (cancellation).
"""

from __future__ import annotations

import argparse
import os
import sys

import mlx.core as mx
import numpy as np

HEADER = r"""
#include <mma.h>
"""
SOURCE = r"""
  using namespace nvcuda;
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> fc;
  const int p = blockIdx.x;  // one warp, one problem per block
  wmma::load_matrix_sync(fa, a + p * 128, 8);
  wmma::load_matrix_sync(fb, b + p * 128, 16);
  wmma::load_matrix_sync(fc, c + p * 256, 16, wmma::mem_row_major);
  wmma::mma_sync(fc, fa, fb, fc);
  wmma::store_matrix_sync(d + p * 256, fc, 16, wmma::mem_row_major);
"""


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest tf32 value (10 mantissa bits), still as float32."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def problems(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``a [n, 16, 8]``, ``b [n, 8, 16]``, ``c [n, 16, 16]`` float32 (a and b tf32)."""
    rng = np.random.default_rng(seed)

    def spread(*shape):
        mag = np.exp2(rng.uniform(-8, 8, shape)) * rng.uniform(1, 2, shape)
        return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)

    a, b = tf32(spread(n, 16, 8)), tf32(spread(n, 8, 16))
    c = spread(n, 16, 16)
    exact = np.einsum("pik,pkj->pij", a.astype(np.float64), b.astype(np.float64))
    cancel = np.arange(n) % 3 == 0
    c[cancel] = (-exact[cancel] * (1 + 1e-3 * rng.standard_normal(exact[cancel].shape))).astype(
        np.float32
    )
    return a, b, c


def run(a: np.ndarray, b: np.ndarray, c: np.ndarray, runner=None) -> np.ndarray:
    """``d = a @ b + c`` by one ``mma_sync`` per problem: on the default CUDA device, or
    through ``runner`` (``tools/cuda_emulate.py``'s ``run``)."""
    from chunkscan import _backend

    n = a.shape[0]
    saved = _backend.RUNNER
    _backend.RUNNER = runner
    try:
        kernel = _backend.cuda_kernel("tc_probe", "chunkscan_tc_probe", ["a", "b", "c"], ["d"],
                                      SOURCE, HEADER, 0)  # fmt: skip
        (d,) = kernel(
            inputs=[mx.array(a), mx.array(b), mx.array(c)], template=[], grid=(32 * n, 1, 1),
            threadgroup=(32, 1, 1), output_shapes=[(n, 16, 16)], output_dtypes=[mx.float32],
        )  # fmt: skip
    finally:
        _backend.RUNNER = saved
    return np.array(d)


def build_parser() -> argparse.ArgumentParser:
    from _common import OUT, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=positive_int, default=96, help="problems (16 x 16 outputs each)")
    # under the checkout's bench-out/, as the other scripts write: it went to bench-out/
    # of the folder run from (found by probing)
    p.add_argument("--out", default=str(OUT / "tc_probe.npz"))
    return p


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import check_outputs, meta, stop_without_cuda

    p = build_parser()
    args = p.parse_args(argv)
    if stop_without_cuda("tc_probe"):
        return 2
    check_outputs(p, {"--out": args.out})
    if not args.out.endswith(".npz"):  # numpy adds it: check the file it writes too
        args.out += ".npz"
        check_outputs(p, {"--out": args.out})

    a, b, c = problems(args.n)
    d = run(a, b, c)
    exact = np.einsum("pik,pkj->pij", a.astype(np.float64), b.astype(np.float64)) + c
    err = np.abs(d - exact) / np.maximum(np.abs(exact), 1e-30)
    print(f"[tc_probe] {d.size} outputs; relative error to the exact sum: median "
          f"{np.median(err):.2e}, max {err.max():.2e}; below it {np.mean(d < exact):.3f}, "
          f"above {np.mean(d > exact):.3f}")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    np.savez_compressed(args.out, a=a, b=b, c=c, d=d, meta=np.array(repr(meta(__file__, argv))))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
