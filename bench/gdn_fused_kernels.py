"""The fused Gated DeltaNet chunk kernels (``_chunk_cuda``) and state passes timed one
by one, for one group of chunks at the Qwen3-Next layer shape (B=1, Hk=16, Hv=32,
Dk=Dv=128, bf16 inputs): where the op's time goes on a CUDA device.

    python3 bench/gdn_fused_kernels.py --tokens 4096 --json bench-out/gdn_fused_kernels.json

Each row: ``kernel``, ``ms`` (median of ``--repeats`` launches, each evaluated and
synchronised alone), ``tokens`` (the group's), ``ms_per_16k`` (scaled to 16384 tokens).
"""

from __future__ import annotations

import argparse
import sys

from _common import OUT, meta, write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the group")
    p.add_argument("--C", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=str(OUT / "gdn_fused_kernels.json"))
    args = p.parse_args(argv)

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
    rows = []
    for name, fn in stages.items():
        sec = median_seconds(fn, repeats=args.repeats, warmup=2)
        rows.append({"kernel": name, "ms": sec * 1e3, "tokens": n * C,
                     "ms_per_16k": sec * 1e3 * 16384 / (n * C)})  # fmt: skip
        print(f"{name:>22}: {sec * 1e3:8.3f} ms  ({rows[-1]['ms_per_16k']:7.2f} ms per 16k)")
    total = sum(r["ms_per_16k"] for r in rows) + rows[0]["ms_per_16k"]  # prepare twice
    print(f"{'fwd + bwd':>22}: {total:8.2f} ms per 16k tokens (prepare twice: the backward "
          f"recomputes it)")  # fmt: skip
    write_json(args.json, meta(shape={"B": B, "Hk": Hk, "Hv": Hv, "D": D, "C": C}), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
