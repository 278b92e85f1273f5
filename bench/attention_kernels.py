"""Time the two CUDA backward kernels of chunkscan.attention separately (CUDA only).

    python bench/attention_kernels.py --T 8192 16384 [--json out.json]

Qwen3-Next's attention shape (B=1, Hq=16, Hkv=2, D=256, bf16, causal); for each T:
the median milliseconds of the dq kernel, of the dk/dv kernel, and of
``mx.fast.scaled_dot_product_attention``'s forward, measured in this process after a
warm-up, and the tensor-core rate each kernel reaches (matrix-product FLOPs over its
time: 3 products per visited tile for dq, 4 for dk/dv).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))


def measure(T: int, repeats: int) -> dict:
    """One T: the median milliseconds and tensor-core rates of the three calls."""
    import mlx.core as mx

    from chunkscan.commands.measure import median_seconds
    from chunkscan.ops.attention import _cuda
    from chunkscan.ops.attention._checks import check_inputs

    B, Hq, Hkv, D = 1, 16, 2, 256
    ks = mx.random.split(mx.random.key(0), 4)
    q, do = (mx.random.normal((B, Hq, T, D), key=k).astype(mx.bfloat16) for k in ks[:2])
    k, v = (mx.random.normal((B, Hkv, T, D), key=k).astype(mx.bfloat16) for k in ks[2:])
    spec = check_inputs("bench", q, k, v, D**-0.5, "causal", None)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask="causal")
    mx.eval(q, k, v, do, o)
    nqb, nkb = -(-T // _cuda.BR), -(-T // _cuda.BC)

    def dq():
        return _cuda.dq_pass(spec, q, k, v, do, o)

    _, lse, delta = dq()
    mx.eval(lse, delta)

    def dkdv():
        return _cuda.dkdv_pass(spec, q, k, v, do, delta, lse)

    def fwd():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask="causal")

    tiles = sum(min(nkb, (qb * 64 + 64 + 63) // 64) for qb in range(nqb))  # causal tiles
    per_tile = 2 * 64 * 64 * D
    row = {"T": T}
    for name, fn, products in (("dq", dq, 3), ("dkdv", dkdv, 4), ("fwd_mx_fast", fwd, 2)):
        s = median_seconds(fn, repeats=repeats, warmup=1)
        row[f"{name}_ms"] = 1000 * s
        row[f"{name}_tflops"] = products * per_tile * tiles * Hq * B / s / 1e12
    return row


def main(argv: list[str] | None = None) -> int:
    from _common import Once, check_outputs, json_text, meta, positive_int, stop_without_cuda

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[8192, 16384])
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if stop_without_cuda("attention_kernels"):
        return 2
    check_outputs(p, {"--json": args.json}, optional=("--json",))
    rows = []
    for T in args.T:
        row = measure(T, args.repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        m = meta(__file__, argv)
        pathlib.Path(args.json).write_text(json_text({"meta": m, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
