"""One Gated DeltaNet fwd+bwd (chunkscan or fla) for Nsight Compute to profile.

Run under ``ncu --profile-from-start off``: the script warms the op up (MLX's and
chunkscan's kernel builds, Triton's autotuning), then brackets exactly one more
fwd+bwd with ``cudaProfilerStart`` / ``cudaProfilerStop`` (through PyTorch's
``torch.cuda.profiler``: MLX and PyTorch share the device's primary context), so ncu
sees that call's kernels and nothing else. Shape: the Qwen3-Next layer of
``bench/gdn_vs_fla.py`` (B=1, Hk=16, Hv=32, Dk=Dv=128, bf16, gradients of all six
inputs) and its two harnesses (``--harness``: ``cotangents``, the default, the op's
forward and backward given the outputs' cotangents; ``loss``, the gradients of ``sum(o *
w) + sum(final * w_s)``, what every profile before session 27 ran).

    ncu --profile-from-start off --clock-control none --csv --page details \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --log-file out.csv python3 bench/ncu_op.py --impl chunkscan --T 16384
    python3 bench/ncu_summary.py out.csv        # one line per kernel

Without ncu it only runs the op; without a CUDA PyTorch it brackets nothing (the CPU
smoke test, ``tests/test_bench_smoke.py``). ``--impl fla`` needs fla-core.
"""

from __future__ import annotations

import argparse
import sys


def chunkscan_call(
    T: int, chunk_size: int | None, kernels: bool | None, harness: str = "cotangents"
):
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan
    from chunkscan.ops.gated_delta import chunk as chunk_module

    xs, w, w_s = _inputs(T, 1, 16, 32, 128, 128, "bfloat16", 0)
    mx.eval(xs, w, w_s)
    C = chunk_size or chunk_module.default_chunk_size(kernels)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, chunk_size=C, kernels=kernels
        )

    step = make_step(op, w, w_s, harness)

    def call():
        mx.eval(step(*xs))
        mx.synchronize()

    return call


def fla_call(T: int, harness: str = "cotangents"):
    import fla_gdn
    import torch

    fla_gdn.lift_hopper_guard()
    xs, w, w_s = fla_gdn.make_inputs(T)

    def call():
        fla_gdn.fwd_bwd(xs, w, w_s, harness)
        torch.cuda.synchronize()

    return call


def main(argv: list[str] | None = None) -> int:
    from _common import non_negative_int, positive_int, stop_without_cuda

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    impls = ("chunkscan", "chunkscan-portable", "fla")
    p.add_argument("--impl", choices=impls, default="chunkscan")
    p.add_argument("--T", type=positive_int, default=16384)
    p.add_argument("--C", type=positive_int, default=None, help="chunkscan's chunk size")
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--harness", choices=("cotangents", "loss"), default="cotangents")
    args = p.parse_args(argv)
    # fla's kernels: a traceback without a CUDA PyTorch before (found by probing)
    if args.impl == "fla" and stop_without_cuda("ncu_op --impl fla", mlx=False, torch=True):
        return 2
    torch = _torch_cuda()
    if args.impl == "fla":
        call = fla_call(args.T, args.harness)
    else:
        kernels = False if args.impl == "chunkscan-portable" else None
        call = chunkscan_call(args.T, args.C, kernels, args.harness)
    for _ in range(args.warmup):
        call()
    if torch is None:
        call()
        print(f"ncu_op: {args.impl} T={args.T} ran (no CUDA PyTorch: nothing bracketed)")
        return 0
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.profiler.stop()
    print(f"ncu_op: {args.impl} T={args.T} profiled one fwd+bwd")
    return 0


def _torch_cuda():
    """PyTorch with CUDA initialised (it brackets the profiled call), else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    return torch


if __name__ == "__main__":
    sys.exit(main())
