"""Cost of one ``scan(stepwise(step))`` gradient against the chunk length (or of
``linear_attention`` at a chunk size: ``--op linear_attention``).

Each configuration runs in a fresh process (``chunkscan.commands.measure.run_isolated``):
wall seconds of one gradient (after nothing: the first call, as a user sees it) and
the process's peak RSS above the inputs. RSS, not ``mx.get_peak_memory``: an MLX
primitive with ``n`` outputs costs ``O(n^2)`` outside MLX's allocator (sibling
lists), which is what this guards (see docs/design.md, "Many outputs").

    python bench/stepwise_chunk.py --T 500 1000 2000 20000            # one chunk each
    python bench/stepwise_chunk.py --T 1000 2000 4000 --chunk 1       # many chunks
    python bench/stepwise_chunk.py --op linear_attention --T 2048 8192 --chunk 1 --H 1 \
        --D 2 [--forward]         # one group per token (its saved states' outputs)

``--json`` (default ``bench-out/stepwise_chunk.json``) writes the rows of the table
(``T``, ``chunk``, ``H``, ``D``, ``op``, ``forward``, ``seconds``, ``rss_mib`` or
``error``; ``chunk`` the one scan ran at, ``--chunk`` cut to ``T``) and the run's
provenance (``bench/_common.py``). ``linear_attention``: ``q``, ``k``, ``v`` of
``[1, T, H, D]``, ``g = -0.05``, the gradients of all four (``--forward``: the forward
alone, evaluated), ``chunk_size = --chunk``; run another checkout's code with
``PYTHONPATH=<it>/src`` (its commit is recorded).
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from _common import (  # bench/ is this script's sys.path[0]
    OUT,
    Once,
    check_outputs,
    child_env,
    exit_status,
    meta,
    positive_float,
    positive_int,
    write_json,
)

import chunkscan
from chunkscan.commands import reporter
from chunkscan.commands.measure import run_isolated


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def measure(
    T: int, chunk: int, H: int, D: int, op: str = "stepwise", forward: bool = False
) -> dict:  # fmt: skip
    if op == "linear_attention":
        s0 = -0.05 * mx.ones((1, T, H))  # (the gates, in the first argument's place)
        q, k, v = (mx.random.normal((1, T, H, D), key=mx.random.key(i)) for i in range(3))
    else:
        s0, q, k, v = reporter.make_inputs(T, H, D)
    mx.eval(s0, q, k, v)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS
    before = _vm_hwm()

    def run(s0, q, k, v):
        if op == "linear_attention":
            y, s = chunkscan.linear_attention(q, k, v, s0, chunk_size=chunk)
        else:
            step = chunkscan.stepwise(reporter.step)
            s, y = chunkscan.scan(step, s0, (q, k, v), chunk_size=chunk)
        return y, s

    def loss(s0, q, k, v):
        y, s = run(s0, q, k, v)
        return y.sum() + s.sum()

    t0 = time.perf_counter()
    mx.eval(run(s0, q, k, v) if forward else mx.grad(loss, argnums=(0, 1, 2, 3))(s0, q, k, v))
    return {"seconds": time.perf_counter() - t0, "rss_mib": (_vm_hwm() - before) / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[500, 1000, 2000])
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="steps per chunk (default: T; one over T runs, and is recorded, "
                   "as T)")  # fmt: skip
    p.add_argument("--H", type=positive_int, default=2)
    p.add_argument("--D", type=positive_int, default=8)
    p.add_argument("--op", choices=("stepwise", "linear_attention"), default="stepwise")
    p.add_argument("--forward", action="store_true", help="the forward alone")
    p.add_argument("--timeout", type=positive_float, default=600.0)
    p.add_argument("--json", default=str(OUT / "stepwise_chunk.json"))
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    print("| T | chunk | seconds | peak RSS MiB |\n|---|---|---|---|")
    rows = []
    for T in args.T:
        # the chunk scan runs at: it cuts one to T, and the rows recorded --chunk 100 at
        # T = 8 (found by probing)
        chunk = min(args.chunk or T, T)
        cfg = dict(T=T, chunk=chunk, H=args.H, D=args.D, op=args.op, forward=args.forward)
        res = run_isolated(
            "stepwise_chunk:measure", cfg, timeout=args.timeout, env=child_env(bench=True)
        )
        rows.append(dict(cfg, **res))
        if "error" in res:
            print(f"| {T} | {chunk} | {res['error']} | |", flush=True)
        else:
            print(f"| {T} | {chunk} | {res['seconds']:.2f} | {res['rss_mib']:.0f} |", flush=True)
    write_json(args.json, meta(__file__, argv), rows)
    return exit_status(rows, "stepwise_chunk.py")


if __name__ == "__main__":
    sys.exit(main())
