"""How long the Python side of one eager Gated DeltaNet fwd+bwd on the fused CUDA path
takes: building the lazy graph of ``mx.value_and_grad`` of the op's loss (the op's own
code, its hand-written vjp, the kernels' launch plans, MLX's vjp), without running it.

The kernels are faked (each launch returns lazy zeros of its outputs' shapes, through
``chunkscan._backend.RUNNER``: ``tests/helpers.py``'s ``fake_fused_kernels``) and taken
as on a CUDA GPU, so this runs on any machine, the CPU included, and builds the graph
the H200 builds: Qwen3-Next layer shape (B=1, Hk=16, Hv=32, Dk=Dv=128, bf16), C = 64,
groups of ``--group-mib`` (default 4096: the H200's budget from session 23 to 28, 1/32
of its memory capped at 4096, one group at T = 16384, four at 65536; since session 29
the H200 takes 16384, 1/8 of its memory, one group up to T = 65536: pass
``--group-mib 16384`` for its graph there; runs before session 23 took 1024, five
groups, the default of a GPU of 32 GB or less). On the device itself
``bench/gpu_gaps.py`` times the same build ("graph built in"). Run a tree's own
sources with ``PYTHONPATH=<tree>/src``.

    python bench/graph_build.py --T 16384 --repeats 80

``--real`` (a CUDA device only) builds with the real kernels instead (each launch through
``mx.fast.precompiled_cuda_kernel``, after a first evaluated call that compiles them;
the builds are not evaluated), and ``--profile N`` prints cProfile's N costliest
functions over the timed builds (their own time). ``--json`` (default
``bench-out/graph_build.json``) writes the row printed, every build's milliseconds
(sorted) and the run's provenance (``bench/_common.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import (
    OUT,
    check_outputs,
    meta,
    non_negative_int,
    positive_int,
    stop_without_cuda,
    write_json,
)


def build_times(
    T: int, repeats: int, group_mib: int, real: bool = False, profile: int = 0
) -> list[float]:
    """Seconds of ``repeats`` builds (after three to warm up), sorted."""
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan
    from chunkscan.ops.gated_delta import chunk as chunk_module

    if not real:
        from _common import import_test_helpers

        import_test_helpers().fake_fused_kernels()
    chunk_module._GROUP_BYTES = group_mib << 20
    xs, w, w_s = _inputs(T, 1, 16, 32, 128, 128, "bfloat16", 0)
    mx.eval(xs, w, w_s)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=64)

    step = make_step(op, w, w_s, "loss")
    if real:
        mx.eval(step(*xs))  # the kernels compiled (or read from their cache) and loaded
    for _ in range(3):
        step(*xs)
    times = []
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(*xs)
        times.append(time.perf_counter() - t0)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return sorted(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, default=16384)
    p.add_argument("--repeats", type=positive_int, default=80)
    p.add_argument("--group-mib", type=positive_int, default=4096)
    p.add_argument("--real", action="store_true", help="the real kernels (a CUDA device)")
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="N",
                   help="print cProfile's N costliest functions")  # fmt: skip
    p.add_argument("--json", default=str(OUT / "graph_build.json"))
    args = p.parse_args(argv)
    # --real off CUDA built the portable graph and printed it as the kernels' (found by
    # probing)
    if args.real and stop_without_cuda("graph_build --real"):
        return 2
    check_outputs(p, {"--json": args.json})
    ts = build_times(args.T, args.repeats, args.group_mib, args.real, args.profile)
    row = {
        "T": args.T, "real": args.real, "group_mib": args.group_mib, "repeats": args.repeats,
        "median_ms": statistics.median(ts) * 1e3, "min_ms": ts[0] * 1e3,
        "p10_ms": ts[len(ts) // 10] * 1e3, "build_ms": [t * 1e3 for t in ts],
    }  # fmt: skip
    print(
        f"T={args.T}{' (real kernels)' if args.real else ''}: graph build median "
        f"{row['median_ms']:.2f} ms "
        f"(min {row['min_ms']:.2f}, 10th percentile {row['p10_ms']:.2f}; "
        f"{args.repeats} builds)"
    )
    write_json(args.json, meta(__file__, argv), [row])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
