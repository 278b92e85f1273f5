"""How accurate ``gated_delta_rule`` is with positive gates (growth), per chunk size.

Gated DeltaNet's gates are ``<= 0`` (decay); the op allows positive ones, but its chunk
form then multiplies and inverts within each chunk factors up to ``exp`` of the chunk's
gate sum, and rounding grows with them. This measures it on the CPU in float32 against
a float64 per-step loop (MLX's CPU backend has float64): for each constant gate per
token and chunk size, the largest relative error (max abs difference over max abs
value) of ``o``, of the final state and of each of the six gradients, for the chunk
form and for the float32 per-step oracle (``naive_recurrent_gated_delta_rule``), and
the number of non-finite gradient values (an error counts only the finite values; NaN
where none is finite, or where the reference is not).
Shape: B=1, T (``--T``), Hk=Hv=1, Dk=Dv=16 (``--D``), unit keys, ``beta`` in [0.1, 0.9]
(or ``--beta``), an initial state of standard deviation ``--state-std``. With ``beta`` in
[0.1, 0.9] and D = 16 the state grows with the gates (its largest value exp(+1.2 * 64)
times the first), and an error relative to the largest value hides a wrong small one;
``--D 2 --beta 1`` keeps the state bounded (each step replaces the state's part along
its key, and two dimensions are covered within a few steps), where the chunk form's
cancellations within a chunk show in full. ``--channel``: the same gate in
every key channel, given per channel (``g`` of shape ``[B, T, Hv, Dk]``, the Kimi Delta
Attention path).

    python bench/growth_gates.py --json bench-out/growth_gates.json
"""

from __future__ import annotations

import argparse
import math
import sys

from _common import (
    OUT,
    Once,
    check_outputs,
    finite_float,
    gdn_chunking,
    meta,
    non_negative_float,
    positive_int,
    write_json,
)

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(
    T: int,
    D: int,
    gate: float,
    state_std: float,
    seed: int = 0,
    channel: bool = False,
    beta: float | None = None,
):
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((1, T, 1, D), key=keys[0])
    k = mx.random.normal((1, T, 1, D), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, T, 1, D), key=keys[2])
    if beta is None:
        beta = mx.random.uniform(0.1, 0.9, (1, T, 1), key=keys[3])
    else:
        beta = mx.full((1, T, 1), beta)
    h0 = state_std * mx.random.normal((1, 1, D, D), key=keys[4])
    w = mx.random.normal((1, T, 1, D), key=keys[5])
    g = mx.full((1, T, 1, D) if channel else (1, T, 1), gate)
    return [q, k, v, g, beta, h0], w


def _loop64(q, k, v, g, beta, h0):
    """The recurrence one step at a time, in float64 (the reference); ``g`` per head
    ``[B, T, H]`` or per key channel ``[B, T, H, Dk]``."""
    import mlx.core as mx

    q, k, v, g, beta, S = (x.astype(mx.float64) for x in (q, k, v, g, beta, h0))
    scale = q.shape[-1] ** -0.5
    outs = []
    for t in range(q.shape[1]):
        a = mx.exp(g[:, t])
        S = S * (a[..., None, :] if g.ndim == 4 else a[..., None, None])
        err = v[:, t] - (S @ k[:, t][..., None])[..., 0]
        S = S + (beta[:, t][..., None] * err)[..., :, None] * k[:, t][..., None, :]
        outs.append(scale * (S @ q[:, t][..., None])[..., 0])
    return mx.stack(outs, axis=1), S


def measure(
    gate: float,
    chunk_sizes: list[int],
    T: int,
    D: int,
    state_std: float,
    channel: bool = False,
    beta: float | None = None,
) -> list[dict]:
    import mlx.core as mx

    import chunkscan

    xs, w = _inputs(T, D, gate, state_std, channel=channel, beta=beta)

    def run(fn):
        def loss(*a):
            o, s = fn(*a)
            return (o * w.astype(o.dtype)).sum() + s.sum()

        o, s = fn(*xs)
        grads = mx.grad(loss, argnums=tuple(range(6)))(*xs)
        return [o, s, *grads]

    with mx.stream(mx.cpu):
        ref = run(_loop64)
        impls = {"naive": lambda *a: chunkscan.naive_recurrent_gated_delta_rule(
            *a[:5], initial_state=a[5])}  # fmt: skip
        for C in chunk_sizes:
            impls[f"chunk {C}"] = lambda *a, C=C: chunkscan.gated_delta_rule(
                *a[:5], initial_state=a[5], chunk_size=C
            )
        # the chunk each ran at: the op cuts it to T (and rounds it up to whole
        # sub-chunks of 8 for a per-channel gate), so "chunk 16" and "chunk 64" at T = 16
        # were two identical rows, told apart by their labels only (found by probing)
        ran = {f"chunk {C}": gdn_chunking(*xs[:5], chunk_size=C).C for C in chunk_sizes}
        rows = []
        for impl, fn in impls.items():
            got = run(fn)
            row = {"T": T, "gate": gate, "impl": impl, "state_std": state_std}
            row["chunk_run"] = ran.get(impl)  # None: the per-step loop
            row["channel"] = channel
            row["D"], row["beta"] = D, beta  # beta None: uniform in [0.1, 0.9]
            row["max_abs_o"] = mx.abs(ref[0]).max().item()
            bad = 0
            for name, a, b in zip(NAMES, got, ref):
                # in float64: the reference cast to float32 overflowed to inf, and every
                # error divided by it read 0.0 (found by probing, session 48)
                a = a.astype(mx.float64)
                finite = mx.isfinite(a)
                n_bad = int((~finite).sum().item())
                bad += n_bad if name.startswith("d") else 0
                diff = mx.where(finite, mx.abs(a - b), 0.0).max()
                row[name] = (diff / mx.maximum(mx.abs(b).max(), 1e-300)).item()
                if n_bad and not name.startswith("d"):
                    # o or the final state not finite: NaN, not the finite part's error
                    # (it read 0.0 where every value of the final state was NaN; probing)
                    row[name] = math.nan
                    row[f"non_finite_{name}"] = n_bad
                elif n_bad == a.size or not mx.isfinite(b).all().item():
                    # no finite value to compare, or a reference past float64's range:
                    # no error to give (both read 0.0; found by probing, session 48)
                    row[name] = math.nan
            row["non_finite_grads"] = bad
            rows.append(row)
    return rows


def _impl_label(row: dict) -> str:
    """``row["impl"]``, with the chunk it ran at where that is not the one asked for."""
    ran = row.get("chunk_run")  # absent in rows written before it
    if ran is not None and row["impl"] != f"chunk {ran}":
        return f"{row['impl']} (ran {ran})"
    return row["impl"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--gates", type=finite_float, nargs="+", action=Once, default=[0.0, -0.3, 0.3, 0.6, 1.2]
    )
    p.add_argument("--chunk-sizes", type=positive_int, nargs="+", action=Once, default=[8, 16, 64])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=[64, 128])
    p.add_argument("--D", type=positive_int, default=16)
    p.add_argument("--state-std", type=non_negative_float, nargs="+", action=Once, default=[1.0])
    p.add_argument("--beta", type=finite_float, default=None,
                   help="one beta for every step (default: uniform in [0.1, 0.9])")  # fmt: skip
    p.add_argument("--channel", action="store_true",
                   help="the gate per key channel, [B, T, Hv, Dk] (default: per head)")  # fmt: skip
    p.add_argument("--json", default=str(OUT / "growth_gates.json"))
    args = p.parse_args(argv)
    check_outputs(p, {"--json": args.json})
    rows = []
    for T in args.T:
        for std in args.state_std:
            for gate in args.gates:
                rows += measure(gate, args.chunk_sizes, T, args.D, std, args.channel, args.beta)
    print("| T | gate | state std | max abs o | impl | o | final | worst gradient | non-finite "
          "gradients |")  # fmt: skip
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        # over the gradients with an error (NaN: none to give); Python's max of a list
        # holding NaN depends on the order
        known = [r[n] for n in NAMES[2:] if not math.isnan(r[n])]
        worst = max(known) if known else math.nan
        # the gate in as many digits as it has ({:+.1f} printed 0.05 and 0.1 both as
        # +0.1; found by probing); one decimal reads as before (+0.0, -0.3, +1.2)
        cells = [f"{r['T']}", f"{float(r['gate']):+}", f"{r['state_std']:g}"]
        cells += [f"{r['max_abs_o']:.2g}", _impl_label(r)]
        cells += [f"{r['o']:.1e}", f"{r['final']:.1e}", f"{worst:.1e}"]
        cells.append(str(r["non_finite_grads"]))
        print("| " + " | ".join(cells) + " |")
    write_json(args.json, meta(__file__, argv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
