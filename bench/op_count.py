"""The primitives in one Gated DeltaNet fwd+bwd graph of the portable path, by kind.

On a GPU every primitive that is not a view is a kernel launch, and MLX's CUDA backend
costs tens of microseconds per launch (``docs/history/benchmarks-sessions-3-29.md``);
under ``mx.grad`` the op's per-group compiled functions run as plain ops, so nothing is
fused. This counts them without running anything: it builds ``mx.value_and_grad`` of
the op's loss at the Qwen3-Next layer shape (B=1, Hk=16, Hv=32, Dk=Dv=128, bf16) with
``kernels=False`` and the state passes in the GPU's form (``"transition"``), and reads
the graph with ``mx.export_to_dot``. Any MLX device, CPU included: the graph does not depend on it,
but for the CPU's split products (:mod:`chunkscan.ops._cpu_threads`: slices and
concatenates a GPU never runs), which this switches off (``CHUNKSCAN_CPU_THREADS=1``;
with the two cores' split the count had read 2380 where the GPU's graph holds 2090 at
T = 16384; found by probing).

    python bench/op_count.py --T 7168 --C 128 --json bench-out/op_count.json

Rows: ``T``, ``C``, ``groups``, ``launches`` (primitives that are not views, inputs'
generation included), ``views``, ``by_kind`` (every primitive kind and its count).
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import re
import sys

from _common import OUT, Once, check_outputs, meta, positive_int, write_json

# Primitives that make no kernel launch of their own on the GPU (views and markers);
# RandomBits and ErfInv make the inputs, counted in ``launches`` but constant in T.
VIEWS = {"Broadcast", "Slice", "Squeeze", "ExpandDims", "Reshape", "Transpose",
         "StopGradient", "Depends"}  # fmt: skip


def count(T: int, C: int, group_mib: int, form: str) -> dict:
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan
    from chunkscan.ops.gated_delta import _passes
    from chunkscan.ops.gated_delta import chunk as chunk_module

    portable = _passes.portable_state_pass
    _passes.portable_state_pass = lambda *a, **k: portable(*a, **dict(k, form=form))
    chunk_module._GROUP_BYTES = group_mib << 20
    xs, w, w_s = _inputs(T, 1, 16, 32, 128, 128, "bfloat16", 0)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, chunk_size=C, kernels=False
        )

    try:
        value, grads = make_step(op, w, w_s, "loss")(*xs)
        buf = io.StringIO()
        mx.export_to_dot(buf, value, *grads)
    finally:
        _passes.portable_state_pass = portable
    kinds = collections.Counter(re.findall(r'label ?= ?"([A-Za-z]+)', buf.getvalue()))
    views = sum(n for kind, n in kinds.items() if kind in VIEWS)
    spec = chunk_module.Spec(1, T, 16, 32, 128, 128, 1.0, C, None)
    per_group = chunk_module._group_size(spec, C)
    n = -(-T // C)
    return {
        "T": T, "C": C, "group_mib": group_mib, "form": form, "groups": -(-n // per_group),
        "launches": sum(kinds.values()) - views, "views": views,
        "by_kind": dict(kinds.most_common()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[3584, 7168])
    p.add_argument("--C", type=positive_int, default=128)
    p.add_argument("--group-mib", type=positive_int, default=1024, help="the op's group budget")
    p.add_argument("--form", choices=("transition", "factored"), default="transition")
    p.add_argument("--json", default=str(OUT / "op_count.json"))
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    os.environ["CHUNKSCAN_CPU_THREADS"] = "1"  # the GPU's graph: no split products
    rows = [count(T, args.C, args.group_mib, args.form) for T in args.T]
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_kind"].items())[:8])
        print(f"T={r['T']} C={r['C']} groups={r['groups']}: {r['launches']} launches, "
              f"{r['views']} views ({top})")  # fmt: skip
    write_json(args.json, meta(__file__, argv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
