"""Micro-benchmark of the Gated DeltaNet state pass: the CUDA kernel against the portable ops.

One call of ``_passes.state_pass`` over ``n`` chunks at the Qwen3-Next shape (L=32 lanes,
R=Dk=128, C=64), forward (``E`` given, ``H=None``) and reverse (``E=None``, ``H`` given),
for each row tile ``--tr`` of the kernel. Reported: the first call (includes the CUDA JIT
compile of the template), the median of ``--runs`` timed calls (``mx.eval`` and
``mx.synchronize`` around each), and at ``--check-n`` chunks the max abs error of both
implementations against a float64 numpy loop (inputs of a contracting recurrence, so the
values are O(1)).

    python3 bench/state_pass.py --out bench-out/state_pass.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

import mlx.core as mx
import numpy as np

from chunkscan.ops.gated_delta import _pass_cuda, _passes


def _inputs(L: int, n: int, C: int, R: int, Dk: int, reverse: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    s = np.sqrt(0.5) / (np.sqrt(C) + np.sqrt(Dk))

    def rnd(*shape, scale):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    inp = dict(
        x_in=rnd(L, R, Dk, scale=1.0),
        decay=mx.array(rng.uniform(0.5, 1.0, (L, n)).astype(np.float32)),
        F=rnd(L, n, C, Dk, scale=s),
        E=None if reverse else rnd(L, n, C, R, scale=0.3),
        G=rnd(L, n, C, Dk, scale=s),
        H=rnd(L, n, R, Dk, scale=0.1) if reverse else None,
        inits=rnd(1, L, R, Dk, scale=1.0),
    )
    mx.eval([v for v in inp.values() if v is not None])
    return inp


def _call(impl: str, inp: dict, reverse: bool, n: int):
    args = [inp[k] for k in ("x_in", "decay", "F", "E", "G", "H")]
    kw = dict(reverse=reverse, loads={}, stores={(0 if reverse else n - 1): 0}, inits=None)
    if impl == "kernel":
        return _pass_cuda.state_pass(*args, **kw)
    return _passes.portable_state_pass(*args, **kw)


def _run_once(impl: str, inp: dict, reverse: bool, n: int) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    ent, x, st = _call(impl, inp, reverse, n)
    mx.eval(ent, x, *st)
    mx.synchronize()
    return time.perf_counter() - t0


def _reference(inp: dict, reverse: bool) -> tuple[np.ndarray, np.ndarray]:
    x = np.array(inp["x_in"], np.float64)
    F, G = np.array(inp["F"], np.float64), np.array(inp["G"], np.float64)
    E = None if inp["E"] is None else np.array(inp["E"], np.float64)
    H = None if inp["H"] is None else np.array(inp["H"], np.float64)
    d = np.array(inp["decay"], np.float64)
    n = F.shape[1]
    ent = np.empty((F.shape[0], n) + x.shape[1:])
    for c in range(n - 1, -1, -1) if reverse else range(n):
        ent[:, c] = x
        v = -(F[:, c] @ x.swapaxes(-1, -2))  # [L, C, R]
        if E is not None:
            v = v + E[:, c]
        x = d[:, c, None, None] * x + v.swapaxes(-1, -2) @ G[:, c]
        if H is not None:
            x = x + H[:, c]
    return ent, x


_REFS: dict[bool, tuple] = {}


def _accuracy(args, reverse: bool) -> dict[str, float]:
    if reverse not in _REFS:
        inp = _inputs(args.L, args.check_n, args.C, args.R, args.Dk, reverse, seed=1)
        _REFS[reverse] = (inp, *_reference(inp, reverse))
    inp, ref_ent, ref_x = _REFS[reverse]
    out = {"value_scale": float(np.abs(ref_ent).max())}
    for impl in ("kernel", "portable"):
        ent, x, _ = _call(impl, inp, reverse, args.check_n)
        err = max(np.abs(np.array(ent) - ref_ent).max(), np.abs(np.array(x) - ref_x).max())
        out[f"{impl}_max_abs_err"] = float(err)
    return out


def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"default_device": str(mx.default_device())}
    try:
        info.update({k: str(v) for k, v in mx.device_info().items()})
    except Exception:
        pass
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except Exception:
        pass
    return info


def build_parser() -> argparse.ArgumentParser:
    from _common import OUT, Once, non_negative_int, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=positive_int, nargs="+", action=Once, default=[64, 256, 1024])
    p.add_argument("--L", type=positive_int, default=32)
    p.add_argument("--R", type=positive_int, default=128)
    p.add_argument("--Dk", type=positive_int, default=128)
    p.add_argument("--C", type=positive_int, default=64)
    p.add_argument(
        "--tr",
        type=positive_int,
        nargs="+",
        action=Once,
        default=[16, 8, 32],
        help="kernel row tiles to time (CHUNKSCAN_PASS_TR); the first is the default",
    )
    p.add_argument("--runs", type=positive_int, default=7)
    p.add_argument("--check-n", type=positive_int, default=64)
    p.add_argument(
        "--skip-portable-above",
        type=non_negative_int,
        default=1024,
        help="time the portable pass only for n up to this",
    )
    # under the checkout's bench-out/, as the other scripts write: it went to bench-out/
    # of the folder run from (found by probing)
    p.add_argument("--out", default=str(OUT / "state_pass.json"))
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    accuracy: list[dict[str, Any]] = []
    errors: list[str] = []
    for reverse in (False, True):
        direction = "reverse" if reverse else "forward"
        for tr in args.tr:
            os.environ["CHUNKSCAN_PASS_TR"] = str(tr)
            cfg = _pass_cuda.choose_config(args.C, args.Dk, args.R, not reverse, L=args.L)
            if _pass_cuda.tc_enabled(reverse):  # the tensor-core kernel's tiling
                cfg = (
                    _pass_cuda.choose_tc_config(args.C, args.Dk, args.R, not reverse, False) or cfg
                )
            try:
                acc = _accuracy(args, reverse)
                accuracy.append({"direction": direction, "tr": tr, "n": args.check_n, **acc})
                print(f"[accuracy] {direction} TR={tr} {cfg}: {acc}", flush=True)
                # Same bound as tests/ops/test_gated_delta_passes.py (fp32 kernel, O(1) values).
                if not acc["kernel_max_abs_err"] < 2e-5:
                    msg = f"[accuracy] {direction} TR={tr}: kernel error above 2e-5: {acc}"
                    print("ACCURACY FAIL " + msg, flush=True)
                    errors.append(msg)
            except Exception:
                msg = f"[accuracy] {direction} TR={tr} {cfg} FAILED:\n{traceback.format_exc()}"
                print(msg, flush=True)
                errors.append(msg)
                continue
            for n in args.n:
                impls = ["kernel"]
                if tr == args.tr[0] and n <= args.skip_portable_above:
                    impls.append("portable")
                inp = _inputs(args.L, n, args.C, args.R, args.Dk, reverse)
                for impl in impls:
                    try:
                        first = _run_once(impl, inp, reverse, n)
                        times = [_run_once(impl, inp, reverse, n) for _ in range(args.runs)]
                    except Exception:
                        msg = f"[time] {impl} {direction} TR={tr} n={n} FAILED:\n"
                        msg += traceback.format_exc()
                        print(msg, flush=True)
                        errors.append(msg)
                        continue
                    row = {
                        "impl": impl,
                        "direction": direction,
                        "n": n,
                        "tr": tr if impl == "kernel" else None,
                        "config": (
                            {"kernel": type(cfg).__name__, **cfg.__dict__}
                            if (impl == "kernel" and cfg)
                            else None
                        ),
                        "first_ms": 1e3 * first,
                        "ms": 1e3 * statistics.median(times),
                        "min_ms": 1e3 * min(times),
                        "runs": args.runs,
                    }
                    row["us_per_chunk"] = 1e3 * row["ms"] / n
                    rows.append(row)
                    print(
                        f"{impl:8s} {direction:7s} TR={row['tr']!s:4s} n={n:5d} "
                        f"median {row['ms']:9.3f} ms  ({row['us_per_chunk']:7.2f} us/chunk)  "
                        f"first {row['first_ms']:9.1f} ms",
                        flush=True,
                    )
            mx.clear_cache()
    os.environ.pop("CHUNKSCAN_PASS_TR", None)
    return {"rows": rows, "accuracy": accuracy, "errors": errors}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | direction | TR | n | median ms | us/chunk | first call ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['direction']} | {r['tr'] or '-'} | {r['n']} | {r['ms']:.3f} "
            f"| {r['us_per_chunk']:.2f} | {r['first_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from _common import check_outputs, stop_without_cuda

    parser = build_parser()
    args = parser.parse_args(argv)
    if stop_without_cuda("state_pass bench"):
        return 2
    if not _passes.use_kernels(True):
        print("[state_pass bench] needs the CUDA kernels on (CHUNKSCAN_CUDA_KERNELS=0).")
        return 2
    check_outputs(parser, {"--out": args.out})
    result = run(args)
    print()
    print(table(result["rows"]))
    from _common import json_text
    from _common import meta as provenance  # bench/ is this script's sys.path[0]

    # argv, commit (CHUNKSCAN_COMMIT where the tree is a copy), date, versions, and the
    # CHUNKSCAN_* / MLX_* variables set (CHUNKSCAN_PASS_TC picks the kernel)
    meta = {
        **provenance(__file__, argv),
        "device_info": _device(),
        "shape": {"L": args.L, "R": args.R, "Dk": args.Dk, "C": args.C},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(json_text({**meta, **result}))
    print(f"\nwrote {args.out}")
    if result["errors"]:
        print(f"{len(result['errors'])} configuration(s) FAILED (see above and the JSON).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
