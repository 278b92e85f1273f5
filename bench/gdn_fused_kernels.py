"""The fused Gated DeltaNet chunk kernels (``_chunk_cuda``) and state passes timed one
by one, for one group of chunks at the Qwen3-Next layer shape (B=1, Hk=16, Hv=32,
Dk=Dv=128, bf16 inputs): where the op's time goes on a CUDA device.

    python3 bench/gdn_fused_kernels.py --tokens 4096 --json bench-out/gdn_fused_kernels.json

Each row: ``kernel``, ``ms`` (median of ``--repeats`` launches, each evaluated and
synchronised alone), ``tokens`` (the group's), ``ms_per_16k`` (scaled to 16384 tokens).
The meta records the kernels' tuning (``threads`` per kernel: ``CHUNKSCAN_GDN_NT`` or
the defaults, ``tv``: ``CHUNKSCAN_GDN_TV`` or the default).

``--profile`` instead runs each chunk kernel once with its phase clocks on
(``CHUNKSCAN_GDN_PROFILE=1``: thread 0 of four blocks prints ``clock64`` cycles per
phase, the phases named in ``_chunk_cuda``'s ``CS_MARK`` comments); rows ``kernel``,
``block``, ``cycles`` (one per phase).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _common import OUT, check_outputs, meta, positive_int, stop_without_cuda, write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens of the group")
    p.add_argument("--C", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--profile", action="store_true", help="phase clocks, no timing")
    p.add_argument("--json", default=str(OUT / "gdn_fused_kernels.json"))
    args = p.parse_args(argv)
    if args.tokens < args.C:  # no chunk at all
        p.error(f"argument --tokens: must be at least --C ({args.C}) but got {args.tokens}")
    if stop_without_cuda("gdn_fused_kernels"):
        return 2
    check_outputs(p, {"--json": args.json})
    if args.profile:
        os.environ["CHUNKSCAN_GDN_PROFILE"] = "1"

    import mlx.core as mx

    from chunkscan.commands.measure import median_seconds
    from chunkscan.ops.gated_delta import _chunk_cuda as cc
    from chunkscan.ops.gated_delta import _passes

    B, Hk, Hv, D, C = 1, 16, 32, 128, args.C
    n = args.tokens // C
    L = B * Hv
    keys = mx.random.split(mx.random.key(0), 8)
    bf = mx.bfloat16
    q = mx.random.normal((B, n, C, Hk, D), key=keys[0]).astype(bf)
    k = mx.random.normal((B, n, C, Hk, D), key=keys[1])
    k = (k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))).astype(bf)
    v = mx.random.normal((B, n, C, Hv, D), key=keys[2]).astype(bf)
    g = -mx.random.uniform(0.01, 0.5, (B, n, C, Hv), key=keys[3]).astype(bf)
    beta = mx.random.uniform(0.05, 1.0, (B, n, C, Hv), key=keys[4]).astype(bf)
    d_o = mx.random.normal((B, n, C, Hv, D), key=keys[5]).astype(bf)
    o_bad = mx.zeros((B, n, C, Hv), dtype=mx.bool_)
    x0 = mx.zeros((L, D, D))
    scale = D**-0.5
    mx.eval(q, k, v, g, beta, d_o, o_bad, x0)

    pr = cc.prepare(q, k, v, g, beta, scale)
    mx.eval(vars(pr)["a"], pr.p, pr.w, pr.u, pr.kt, pr.decay)

    def fwd_pass():
        return _passes.state_pass(x0, pr.decay, pr.w, pr.u, pr.kt, None, reverse=False,
                                  loads={}, stores={}, inits=None, kernels=True)[0]  # fmt: skip

    s = fwd_pass()
    h = cc.state_gradient_input(q, g, pr, d_o, o_bad)
    mx.eval(s, h)

    def rev_pass():
        return _passes.state_pass(x0, pr.decay, pr.kt, None, pr.w, h, reverse=True, loads={},
                                  stores={}, inits=None, kernels=True)[0]  # fmt: skip

    ds = rev_pass()
    sg = cc.state_gradients(pr, s, ds, d_o, o_bad, v)
    mx.eval(ds, vars(sg)["dvn"], sg.dw, sg.dqg, sg.dkt, sg.dp, sg.m2, sg.ddec)
    stages = {
        "prepare": lambda: list(vars(cc.prepare(q, k, v, g, beta, scale)).values())[:6],
        "forward_pass": fwd_pass,
        "outputs": lambda: cc.outputs(q, g, pr, s, o_bad, bf),
        "state_gradient_input": lambda: cc.state_gradient_input(q, g, pr, d_o, o_bad),
        "reverse_pass": rev_pass,
        "state_gradients": lambda: [
            x for x in vars(cc.state_gradients(pr, s, ds, d_o, o_bad, v)).values()
            if isinstance(x, mx.array)
        ],
        "input_gradients": lambda: cc.input_gradients((q, k, v, g, beta), pr, sg),
    }  # fmt: skip
    tv = cc.slice_columns(D, C, D)
    threads = {w: cc.threads(w, C, D, D, tv) for w in cc._KERNELS}
    info = meta(__file__, argv, shape={"B": B, "Hk": Hk, "Hv": Hv, "D": D, "C": C}, threads=threads,
                tv=tv, profile=args.profile)  # fmt: skip
    if args.profile:
        del stages["forward_pass"], stages["reverse_pass"]
        rows = [row for fn in stages.values() for row in _phase_clocks(fn)]
        write_json(args.json, info, rows)
        return 0
    rows = []
    for name, fn in stages.items():
        sec = median_seconds(fn, repeats=args.repeats, warmup=2)
        rows.append({"kernel": name, "ms": sec * 1e3, "tokens": n * C,
                     "ms_per_16k": sec * 1e3 * 16384 / (n * C)})  # fmt: skip
        print(f"{name:>22}: {sec * 1e3:8.3f} ms  ({rows[-1]['ms_per_16k']:7.2f} ms per 16k)")
    total = sum(r["ms_per_16k"] for r in rows) + rows[0]["ms_per_16k"]  # prepare twice
    print(f"{'fwd + bwd':>22}: {total:8.2f} ms per 16k tokens (prepare twice: the backward "
          f"recomputes it)")  # fmt: skip
    write_json(args.json, info, rows)
    return 0


def _phase_clocks(fn) -> list[dict]:
    """Run ``fn`` once with the C-level stdout captured (the kernels' device ``printf``
    goes there) and parse its ``CSPROF kernel bx by cycles...`` lines."""
    import mlx.core as mx

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            mx.eval(fn())
            mx.synchronize()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[0] == "CSPROF":
            cycles = [int(x) for x in parts[4:]]
            while cycles and cycles[-1] == 0:
                cycles.pop()
            rows.append({"kernel": parts[1], "block": [int(parts[2]), int(parts[3])],
                         "cycles": cycles})  # fmt: skip
            print(f"{parts[1]:>12} block {parts[2]:>4},{parts[3]:>3}: " +
                  " ".join(f"{c:>7}" for c in cycles))  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
