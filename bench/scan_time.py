"""Time of chunkscan's modes against mx.checkpoint on the reporter's recurrence.

Memory needs a fresh process per configuration (``chunkscan repro``); time does not,
and is steadier as a ratio measured in one process: every mode is warmed up, then the
modes run in alternation for ``--rounds`` rounds, so a change in machine load hits all
of them alike. Reported: median wall and CPU (process) seconds, and their ratio to
``mx.checkpoint`` in the same gradient case.

    python bench/scan_time.py --T 1024 --rounds 7 --json bench/results/cpu/scan_time_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from chunkscan.commands import reporter

BASELINE = "mx.checkpoint"


def time_modes(T: int, grads: str, modes: list[str], args) -> dict[str, dict[str, float]]:
    s0, q, k, v = reporter.make_inputs(T, args.H, args.D)
    mx.eval(s0, q, k, v)
    fns = {m: reporter.gradient_fn(m, grads, args.chunk, args.compile) for m in modes}
    for fn in fns.values():  # warm-up (and compile)
        mx.eval(fn(s0, q, k, v))
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            mx.eval(fn(s0, q, k, v))
            mx.synchronize()
            wall[m].append(time.perf_counter() - w0)
            cpu[m].append(time.process_time() - c0)
    out = {}
    for m in modes:
        out[m] = {"wall_s": statistics.median(wall[m]), "cpu_s": statistics.median(cpu[m])}
    for m in modes:
        out[m]["wall_ratio"] = out[m]["wall_s"] / out[BASELINE]["wall_s"]
        out[m]["cpu_ratio"] = out[m]["cpu_s"] / out[BASELINE]["cpu_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    from _common import Once, check_outputs, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[1024])
    p.add_argument("--H", type=positive_int, default=8)
    p.add_argument("--D", type=positive_int, default=128)
    p.add_argument("--chunk", type=positive_int, default=32)
    p.add_argument(
        "--modes",
        nargs="+",
        action=Once,
        default=["cs.scan", "cs.checkpoint+split"],
        choices=[m for m in reporter.MODES if m != BASELINE],
        help=f"modes timed against {BASELINE}",
    )
    p.add_argument(
        "--grads",
        nargs="+",
        action=Once,
        default=list(reporter.GRADS),
        choices=list(reporter.GRADS),
    )
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    # each once (a repeated mode was timed and saved twice; found by probing)
    modes = [BASELINE] + [m for m in dict.fromkeys(args.modes) if m != BASELINE]
    rows = []
    print(
        f"mlx {mx.__version__} {mx.default_device()} H={args.H} D={args.D} C={args.chunk}"
        f"{' compiled' if args.compile else ''}, {args.rounds} alternating rounds"
    )
    print("| grads | T | mode | wall s | x mx.checkpoint | cpu s | x mx.checkpoint |")
    print("|---|---|---|---|---|---|---|")
    for grads in args.grads:
        for T in args.T:
            res = time_modes(T, grads, modes, args)
            for m in modes:
                r = res[m]
                rows.append({"grads": grads, "T": T, "mode": m, **r})
                print(
                    f"| {grads} | {T} | {m} | {r['wall_s']:.3f} | {r['wall_ratio']:.2f} | "
                    f"{r['cpu_s']:.3f} | {r['cpu_ratio']:.2f} |",
                    flush=True,
                )
    if args.json:
        # _common.meta(), as the other scripts record: provenance() alone had no GPU name
        # in "device" (found by probing)
        from _common import json_text, meta

        info = meta(__file__, argv, H=args.H, D=args.D, chunk=args.chunk, rounds=args.rounds,
                    compiled=args.compile)  # fmt: skip
        with open(args.json, "w") as fh:
            fh.write(json_text({"meta": info, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
