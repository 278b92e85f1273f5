"""What the first call of ``gated_delta_rule`` costs: the kernels MLX compiles for it.

MLX compiles every fused elementwise kernel it runs the first time it meets it: on the
CPU backend into one library per kernel under ``<TMPDIR>/mlx/<version>/cpu``, on CUDA
into PTX under ``MLX_PTX_CACHE_DIR`` (default ``<tmp>/mlx/<version>/ptx``); later
processes load them from there. Each configuration here runs in a fresh process with
both folders empty, and reports the kernels that appeared, the first call's time and a
second call's time. Modes:

- ``fwd``: the forward alone, eager (the per-group functions are ``mx.compile``d);
- ``fwdbwd``: all six gradients, eager (under ``mx.grad`` the inputs are tracers, and
  MLX runs a compiled function's plain ops: nothing is fused);
- ``compiled``: the same under ``mx.compile`` (how a training step runs).

    python bench/first_call.py                       # B=1, T=256, Hk=2, Hv=4, D=32, C=16
    python bench/first_call.py --T 1024 --gate channel --json bench-out/first.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

from _common import (
    OUT,
    Once,
    check_outputs,
    child_env,
    empty_kernel_caches,
    exit_status,
    kernels_compiled,
    meta,
    positive_float,
    positive_int,
    write_json,
)

MODES = ("fwd", "fwdbwd", "compiled")


def measure(mode: str, B: int, T: int, Hk: int, Hv: int, D: int, C: int, gate: str) -> dict:
    """One configuration (in its own process, see :func:`main`)."""
    import mlx.core as mx

    import chunkscan

    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((B, T, Hk, D), key=keys[0])
    k = mx.random.normal((B, T, Hk, D), key=keys[1])
    k = k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))
    v = mx.random.normal((B, T, Hv, D), key=keys[2])
    g = -mx.random.uniform(0.01, 0.3, (B, T, Hv) + ((D,) if gate == "channel" else ()),
                           key=keys[3])  # fmt: skip
    beta = mx.random.uniform(0.05, 1.0, (B, T, Hv), key=keys[4])
    h0 = 0.1 * mx.random.normal((B, Hv, D, D), key=keys[5])
    w = mx.random.normal((B, T, Hv, D), key=keys[5])
    inputs = [q, k, v, g, beta, h0]
    mx.eval(inputs, w)

    def forward(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=C)

    def loss(*xs):
        o, state = forward(*xs)
        return mx.sum(o * w) + mx.sum(state)

    grads = mx.grad(loss, argnums=tuple(range(6)))
    fn = {"fwd": forward, "fwdbwd": grads, "compiled": mx.compile(grads)}[mode]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        mx.eval(fn(*inputs))
        times.append(time.perf_counter() - t0)
    # the chunk the op ran at (cut to T, whole sub-chunks of 8 for a per-channel gate):
    # the rows held the --C asked alone (C = 16 at T = 8; found by probing)
    from _common import gdn_chunking

    return {"first_seconds": times[0], "second_seconds": times[1],
            "chunk_run": gdn_chunking(q, k, v, g, beta, chunk_size=C).C,
            "device": str(mx.default_device())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", action=Once, default=list(MODES), choices=MODES)
    p.add_argument("--B", type=positive_int, default=1)
    p.add_argument("--T", type=positive_int, default=256)
    p.add_argument("--Hk", type=positive_int, default=2)
    p.add_argument("--Hv", type=positive_int, default=4)
    p.add_argument("--D", type=positive_int, default=32, help="Dk = Dv")
    p.add_argument("--C", type=positive_int, default=16, help="chunk size")
    p.add_argument("--gate", choices=["head", "channel"], default="head")
    p.add_argument("--timeout", type=positive_float, default=600.0)
    p.add_argument("--json", default=str(OUT / "first_call.json"))
    args = p.parse_args(argv)
    if args.Hv % args.Hk:  # a traceback, or an error row and exit status 0 (probing)
        p.error(f"argument --Hv: {args.Hv} is not a multiple of --Hk {args.Hk}")
    check_outputs(p, {"--json": args.json})

    from chunkscan.commands.measure import run_isolated

    rows: list[dict[str, Any]] = []
    shape = dict(B=args.B, T=args.T, Hk=args.Hk, Hv=args.Hv, D=args.D, C=args.C, gate=args.gate)
    for mode in dict.fromkeys(args.modes):  # each once (a repeat ran twice)
        with tempfile.TemporaryDirectory() as empty:
            env = dict(child_env(bench=True), **empty_kernel_caches(empty))
            row = run_isolated("first_call:measure", dict(shape, mode=mode),
                               timeout=args.timeout, env=env)  # fmt: skip
            row = dict(shape, mode=mode, **row, kernels_compiled=kernels_compiled(empty))
        rows.append(row)
        print(
            f"{mode:>9}: {row['kernels_compiled']:4d} kernels compiled, first call "
            f"{row.get('first_seconds', float('nan')):7.2f} s, second "
            f"{row.get('second_seconds', float('nan')):6.3f} s {row.get('error', '')}",
            flush=True,
        )
    write_json(args.json, meta(__file__, argv), rows)
    return exit_status(rows, "first_call.py")


if __name__ == "__main__":
    sys.exit(main())
