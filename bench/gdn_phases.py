"""Where the Gated DeltaNet op's fwd+bwd time goes: its phases timed one by one.

The op (``chunkscan/ops/gated_delta/chunk.py``) walks groups of chunks; per group the
forward prepares (WY/UT form), runs the state pass and builds the outputs, and the
backward recomputes the preparation, builds the state-independent part of the state
gradient, runs the reverse state pass and the group's input gradients. This script
runs each phase of ONE group on its own (``mx.eval`` and a device sync around it,
median of ``--repeats``), multiplies by the number of groups at that ``T`` and sets
the sum beside one whole fwd+bwd call of the op at the same shape. Where the whole call
takes longer, the difference is what the phases leave out (the concatenations, the
non-finite masks, MLX building the graph); where it takes less, the phases overlap in
the whole call (evaluated apart, each waits for the device and pays its own start).

By default the per-group functions run unfused (``_COMPILE_GROUPS`` off), as they do
inside ``mx.grad`` (docs/gated_delta.md); ``--fused`` compiles them as a forward-only
call would. ``--kernels off`` runs the portable state passes. Phases that depend on
the state pass see its outputs, computed once beforehand.

    python bench/gdn_phases.py --T 4096                          # CPU: small shape
    python3 bench/gdn_phases.py --T 16384 --Hk 16 --Hv 32 --D 128 --dtype bfloat16
    python3 bench/gdn_phases.py --T 4096 --Hk 16 --Hv 32 --D 128 --dtype bfloat16 --gate channel
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

from _common import OUT, check_outputs, meta, positive_int, write_json


def _timed(fn, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``fn()`` evaluated (after one warm-up), and its last result."""
    import mlx.core as mx

    out = fn()
    mx.eval(out)
    mx.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    import chunkscan
    from chunkscan.ops.gated_delta import _passes
    from chunkscan.ops.gated_delta import chunk as op
    from chunkscan.ops.gated_delta._checks import check_inputs

    dt = getattr(mx, args.dtype)
    B, T, Hk, Hv, D = 1, args.T, args.Hk, args.Hv, args.D
    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((B, T, Hk, D), key=keys[0]).astype(dt)
    k = mx.random.normal((B, T, Hk, D), key=keys[1])
    k = (k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))).astype(dt)
    v = mx.random.normal((B, T, Hv, D), key=keys[2]).astype(dt)
    g_shape = (B, T, Hv, D) if args.gate == "channel" else (B, T, Hv)
    g = (-mx.random.uniform(0.01, 0.3, g_shape, key=keys[3])).astype(dt)
    beta = mx.random.uniform(0.05, 1.0, (B, T, Hv), key=keys[4]).astype(dt)
    h0 = 0.1 * mx.random.normal((B, Hv, D, D), key=keys[5])
    mx.eval(q, k, v, g, beta, h0)
    kernels = {"auto": None, "off": False}[args.kernels]
    C = args.chunk_size or op.default_chunk_size(kernels, D, D)
    op._COMPILE_GROUPS = args.fused

    # The whole op, fwd+bwd of sum(o * w) + sum(state), for the comparison.
    w = mx.random.normal(v.shape).astype(dt)

    def loss(q, k, v, g, beta, h0):
        o, s = chunkscan.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, chunk_size=C, kernels=kernels
        )
        return mx.sum(o * w) + mx.sum(s)

    grad = mx.grad(loss, argnums=tuple(range(6)))
    default_size = op._group_size
    if args.group_chunks:  # the whole op in the groups the phases are timed in (it took
        # the op's default grouping, so the two sides compared different groupings)
        op._group_size = lambda *a, **kw: args.group_chunks
    try:
        whole, _ = _timed(lambda: grad(q, k, v, g, beta, h0), args.repeats)
    finally:
        op._group_size = default_size

    # One group, phase by phase (the op's own functions, as its core calls them).
    spec = check_inputs("gdn_phases", q, k, v, g, beta, None, h0, C, None)
    chunks = op._Chunking(spec)
    size = args.group_chunks or op._group_size(spec, chunks.C)
    n = min(size, chunks.N)
    n_groups = -(-chunks.N // n)
    L, G = B * Hv, Hv // Hk
    xs = [chunks.to_chunks(x)[:, :n] for x in (q, k, v, g, beta)]
    o_bad = mx.zeros((B, n, chunks.C, Hv), dtype=mx.bool_)
    d_o_raw = mx.random.normal((B, n, chunks.C, Hv, D)).astype(dt)
    d_state = mx.random.normal((L, D, D))
    mx.eval(xs, o_bad, d_o_raw, d_state)

    def lanes(x):
        return x.reshape((L,) + tuple(x.shape[3:]))

    def per_head(x):
        return x.reshape((B, Hk, G) + tuple(x.shape[1:]))

    if spec.channel:  # the core's choice (chunk._make_core)
        from chunkscan.ops.gated_delta import _channel

        prepare = functools.partial(_channel.prepare, full=False)
        prepare_full = functools.partial(_channel.prepare, full=True)
        group_backward = _channel.group_backward
    else:
        prepare = prepare_full = op._prepare
        group_backward = op._group_backward
    inits = h0.reshape(1, L, D, D)
    phases: dict[str, float] = {}
    phases["prepare"], p = _timed(lambda: vars(prepare(*xs, spec.scale)), args.repeats)
    p = SimpleNamespace(**p)

    def forward_pass():
        return _passes.state_pass(
            None, lanes(p.decay), lanes(p.w), lanes(p.u), lanes(p.kt), None, reverse=False,
            loads={0: 0}, stores={}, inits=inits, kernels=kernels,
        )[0]  # fmt: skip

    phases["state pass"], entering = _timed(forward_pass, args.repeats)
    phases["outputs"], _ = _timed(
        lambda: op._group_outputs(p, per_head(entering), o_bad, dt), args.repeats
    )
    if prepare_full is prepare:  # the same function, recomputed
        phases["prepare again (backward)"] = phases["prepare"]
    else:
        phases["prepare again (backward)"], full = _timed(
            lambda: vars(prepare_full(*xs, spec.scale)), args.repeats
        )
        p = SimpleNamespace(**full)

    def backward_prep():
        d_o = d_o_raw.astype(mx.float32).reshape(B, n, chunks.C, Hk, G, D)
        d_o = d_o.transpose(0, 3, 4, 1, 2, 5)
        return d_o, d_o.swapaxes(-1, -2) @ (p.qg - p.p @ p.w)

    phases["state-gradient terms"], (d_o, h) = _timed(backward_prep, args.repeats)

    def reverse_pass():
        return _passes.state_pass(
            d_state, lanes(p.decay), lanes(p.kt), None, lanes(p.w), lanes(h), reverse=True,
            loads={}, stores={}, inits=None, kernels=kernels,
        )[0]  # fmt: skip

    phases["reverse state pass"], d_leaving = _timed(reverse_pass, args.repeats)
    phases["group gradients"], _ = _timed(
        lambda: group_backward(p, xs, per_head(entering), per_head(d_leaving), d_o),
        args.repeats,
    )
    # the groups' worth of chunks (a last, partial group counted as its share: it was
    # counted whole; found by probing)
    total = chunks.N / n * sum(phases.values())
    return {
        "T": T, "B": B, "Hk": Hk, "Hv": Hv, "D": D, "dtype": args.dtype, "gate": args.gate,
        "C": chunks.C,
        "chunks": chunks.N, "group_chunks": n, "groups": n_groups, "fused": args.fused,
        "kernels": args.kernels, "device": str(mx.default_device()),
        "phase_ms_per_group": {k_: v_ * 1e3 for k_, v_ in phases.items()},
        "phases_ms_all_groups": total * 1e3, "whole_op_ms": whole * 1e3,
        "whole_minus_phases_ms": (whole - total) * 1e3,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, default=4096)
    p.add_argument("--Hk", type=positive_int, default=2)
    p.add_argument("--Hv", type=positive_int, default=4)
    p.add_argument("--D", type=positive_int, default=64, help="Dk = Dv")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--gate", choices=["head", "channel"], default="head",
                   help="g per value head, or per key channel (its own preparation)")  # fmt: skip
    p.add_argument("--chunk-size", type=positive_int, default=None, help="default: the op's")
    p.add_argument("--group-chunks", type=positive_int, default=None,
                   help="default: the op's budget")  # fmt: skip
    p.add_argument("--fused", action="store_true", help="compile the per-group functions")
    p.add_argument("--kernels", choices=["auto", "off"], default="auto")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--json", default=str(OUT / "gdn_phases.json"))
    args = p.parse_args(argv)
    if args.Hv % args.Hk:  # a traceback, or an error row and exit status 0 (probing)
        p.error(f"argument --Hv: {args.Hv} is not a multiple of --Hk {args.Hk}")
    check_outputs(p, {"--json": args.json})
    row = run(args)
    n = row["groups"]
    print(
        f"T={row['T']} C={row['C']}: {row['chunks']} chunks in {n} groups of "
        f"{row['group_chunks']} ({row['device']}, fused={row['fused']}, "
        f"kernels={row['kernels']})"
    )
    share = row["chunks"] / row["group_chunks"]  # groups' worth, a partial one its share
    for name, ms in row["phase_ms_per_group"].items():
        print(f"  {name:<26} {ms:9.2f} ms per group  {share * ms:9.2f} ms in all")
    print(f"  {'sum of the phases':<26} {'':>22} {row['phases_ms_all_groups']:9.2f} ms")
    print(f"  {'the whole op, fwd+bwd':<26} {'':>22} {row['whole_op_ms']:9.2f} ms")
    write_json(args.json, meta(__file__, argv), [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
