"""What one launch costs the CPU on MLX's CUDA back-end, by kind of launch and by the
size of a precompiled kernel's binary.

MLX's ``CustomKernel::eval_gpu`` names the module of every launch by a hash of the
kernel's whole source (for ``mx.fast.precompiled_cuda_kernel``: its cubin), computed at
every evaluation (``fmt::format("{}_{:x}", name_, std::hash<std::string>{}(source_))``
in ``mlx/backend/cuda/custom_kernel.cpp``, MLX 0.32.4). The fused Gated DeltaNet
kernels' cubins are 100-210 KB. This times chains of ``--launches`` dependent launches
of one tiny kernel (1024 floats, one block): MLX's own ``add``, ``mx.fast.cuda_kernel``,
and the same kernel precompiled (our NVRTC call) as a cubin, then that cubin with
``--pads`` KiB of zero bytes appended (the driver reads an ELF image's size from its
headers; MLX hashes every byte). Per kind: the Python build of the chain and its
``mx.eval`` + ``mx.synchronize``, each per launch, median of ``--repeats``. Where the
GPU runs each tiny kernel in a few microseconds, the evaluation's time per launch is
the CPU's encoding. A CUDA device only.

    python3 bench/launch_cost.py --launches 400 --pads 64 128 256 1024

``--real`` also prints the sizes of the binaries of the op's kernels (one small fwd+bwd
of ``chunkscan.gated_delta_rule`` at the Qwen3-Next head shape). ``--json`` (default
``bench-out/launch_cost.json``) writes one row per kind (microseconds per launch) and
the run's provenance (``bench/_common.py``; the binaries' sizes in its ``op_binaries``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import (
    OUT,
    Once,
    check_outputs,
    meta,
    non_negative_int,
    positive_int,
    stop_without_cuda,
    write_json,
)

N = 1024
_SOURCE = """
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 1024) out[i] = x[i] + 1.0f;
"""


def _precompiled_cubin() -> tuple[str, bytes]:
    from chunkscan import _precompile

    symbol = "launch_cost_add"
    src = (
        _precompile.PRELUDE
        + f'extern "C" __global__ void {symbol}(const float* x, float* out) {{{_SOURCE}}}\n'
    )
    return symbol, _precompile.compiler().compile(src, _precompile.device_arch())


def kinds(pads: list[int]):
    """``[(label, one launch: x -> y)]``."""
    import mlx.core as mx

    out = [("mlx add", lambda x: x + 1.0)]
    k = mx.fast.cuda_kernel(
        name="launch_cost_add_mlx", input_names=["x"], output_names=["out"], source=_SOURCE
    )

    def mlx_kernel(x):
        return k(inputs=[x], grid=(N, 1, 1), threadgroup=(N, 1, 1),
                 output_shapes=[(N,)], output_dtypes=[mx.float32])[0]  # fmt: skip

    out.append(("mx.fast.cuda_kernel", mlx_kernel))
    symbol, cubin = _precompiled_cubin()
    for pad in [0] + pads:
        image = cubin + bytes(pad << 10)

        def pre(x, image=image):
            return mx.fast.precompiled_cuda_kernel(
                name=symbol, compiled_source=image, inputs=[x], output_shapes=[(N,)],
                output_dtypes=[mx.float32], scalars=[], grid=(N, 1, 1),
                threadgroup=(N, 1, 1),
            )[0]  # fmt: skip

        out.append((f"cubin {len(image) / 1024:.0f} KiB", pre))
    return out


def time_chain(fn, launches: int, repeats: int) -> tuple[float, float]:
    """Median seconds per launch: ``(build, eval)`` of a chain of ``launches``."""
    import mlx.core as mx

    x = mx.zeros((N,), dtype=mx.float32)
    mx.eval(fn(x))  # compile / load
    builds, evals = [], []
    for _ in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        y = x
        for _ in range(launches):
            y = fn(y)
        t1 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        t2 = time.perf_counter()
        builds.append((t1 - t0) / launches)
        evals.append((t2 - t1) / launches)
    return statistics.median(builds[1:]), statistics.median(evals[1:])


def real_sizes() -> list[dict]:
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan
    from chunkscan import _backend

    xs, w, w_s = _inputs(256, 1, 16, 32, 128, 128, "bfloat16", 0)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0)

    mx.eval(make_step(op, w, w_s, "loss")(*xs))
    sizes = []
    for kernel in _backend._CUDA_KERNELS.values():
        for symbol, binary in getattr(kernel, "_binaries", {}).values():
            print(f"  {len(binary) / 1024:7.1f} KiB  {symbol}")
            sizes.append({"symbol": symbol, "kib": len(binary) / 1024})
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=positive_int, default=400)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--pads", type=non_negative_int, nargs="*", action=Once,
                   default=[64, 128, 256, 1024], help="KiB")  # fmt: skip
    p.add_argument("--real", action="store_true")
    p.add_argument("--json", default=str(OUT / "launch_cost.json"))
    args = p.parse_args(argv)
    if stop_without_cuda("launch_cost"):  # a traceback on a CPU before
        return 2
    check_outputs(p, {"--json": args.json})
    print(f"{'kind':>22}  build us/launch  eval us/launch  ({args.launches} launches)")
    rows = []
    for label, fn in kinds(args.pads):
        build, ev = time_chain(fn, args.launches, args.repeats)
        print(f"{label:>22}  {build * 1e6:15.1f}  {ev * 1e6:14.1f}", flush=True)
        row = {"kind": label, "launches": args.launches, "repeats": args.repeats}
        rows.append(dict(row, build_us_per_launch=build * 1e6, eval_us_per_launch=ev * 1e6))
    extra = {}
    if args.real:
        print("the op's kernels' binaries:")
        extra["op_binaries"] = real_sizes()
    write_json(args.json, meta(__file__, argv, **extra), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
