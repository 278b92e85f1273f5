"""Low-precision error of ``chunkscan.attention`` where the softmax is peaked, by path.

bfloat16 ``q``, ``k`` (scaled by ``--mags``), ``v`` and the output cotangent, causal,
scale 1/8 (D = 64: scores up to a few hundred units at a magnitude of 30); the maximum
absolute error of ``o``, ``dq``, ``dk``, ``dv`` against the float32 oracle on the same
rounded inputs, for: the CUDA kernels' sources run on the CPU by
``tools/cuda_emulate.py`` (bfloat16 products summed in float32, as on the tensor cores:
the scores stay float32), the blocked MLX ops (``kernels=False``: float32 scores since
session 39; before, each score was rounded to bfloat16 as it left its product), and
``mx.fast.scaled_dot_product_attention`` on this device (on the CPU: scores rounded to
bfloat16). Needs g++ (C++20); any machine, nothing of a GPU's.

    python bench/attention_peaked.py --json bench-out/attention_peaked.json
"""

from __future__ import annotations

import argparse

from _common import OUT, Once, check_outputs, finite_float, meta, write_json


def measure(mags: list[float], T: int) -> list[dict]:
    import mlx.core as mx

    from chunkscan import _backend
    from chunkscan.ops.attention import _cuda, blocked, naive_attention

    helpers = __import__("_common").import_test_helpers()
    saved = [(_backend, "RUNNER"), (blocked, "uses_cuda_kernels"), (blocked, "_use_fast")]
    saved = [(m, n, getattr(m, n)) for m, n in saved]
    _backend.RUNNER = helpers.cuda_emulator().run
    blocked.uses_cuda_kernels = lambda spec, dtype, kernels: (
        kernels is not False and _cuda.supports(spec, dtype)
    )
    blocked._use_fast = lambda spec, dtype: False

    def grads(fn, q, k, v, ct, **kw):
        o, g = mx.vjp(lambda *a: [fn(*a, **kw)], [q, k, v], [ct])
        return [o[0], *g]

    rows = []
    try:
        for mag in mags:
            keys = mx.random.split(mx.random.key(3), 4)
            shapes = [(1, 2, T, 64), (1, 1, T, 64), (1, 1, T, 64), (1, 2, T, 64)]
            xs = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]
            xs[0], xs[1] = xs[0] * mag, xs[1] * mag
            rounded = [x.astype(mx.bfloat16) for x in xs]
            kw = dict(scale=0.125, mask="causal")
            ref = grads(naive_attention, *[x.astype(mx.float32) for x in rounded], **kw)
            paths = {
                "cuda kernels (emulated)": grads(blocked.blocked_attention, *rounded, **kw),
                "blocked ops": grads(blocked.blocked_attention, *rounded, kernels=False, **kw),
                "mx.fast": grads(mx.fast.scaled_dot_product_attention, *rounded, **kw),
            }
            for path, got in paths.items():
                row = {"mag": mag, "T": T, "path": path}
                for name, a, r in zip(("o", "dq", "dk", "dv"), got, ref):
                    row[f"{name}_max_abs_error"] = mx.abs(a.astype(mx.float32) - r).max().item()
                    row[f"{name}_max_abs"] = mx.abs(r).max().item()
                rows.append(row)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # finite: nan and inf ran and wrote NaN rows (found by probing)
    p.add_argument("--mags", type=finite_float, nargs="+", action=Once, default=[1.0, 10.0, 30.0])
    p.add_argument("--T", type=int, default=64, choices=(64, 128))
    p.add_argument("--json", default=str(OUT / "attention_peaked.json"))
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    rows = measure(args.mags, args.T)
    write_json(args.json, meta(__file__, argv, T=args.T, mags=args.mags), rows)
    print(f"{'mag':>5}  {'path':<24}" + "".join(f"{n:>18}" for n in ("o", "dq", "dk", "dv")))
    for r in rows:
        errs = "".join(
            f"{r[f'{n}_max_abs_error']:>9.2e} of {r[f'{n}_max_abs']:<7.2g}"
            for n in ("o", "dq", "dk", "dv")
        )
        print(f"{r['mag']:>5}  {r['path']:<24}{errs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
