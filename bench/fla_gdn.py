"""flash-linear-attention's ``chunk_gated_delta_rule``: fwd+bwd time and peak memory per token.

The PyTorch/Triton reference point for ``bench/gated_delta.py`` (CUDA only). Same
problem and the same accounting as the MLX side:

- shape: one Qwen3-Next layer by default (B=1, Hk=16, Hv=32, Dk=Dv=128; fla's GVA,
  value head ``h`` reads key head ``h // (Hv // Hk)``), bf16 q, k, v, g, beta and a
  float32 initial state, the same input distributions as ``bench/gated_delta.py``;
- loss ``sum(o * w) + sum(final_state * w_s)``, gradients for q, k, v, g, beta and the
  initial state (``torch.autograd.grad``, so the gradients are outputs, as in MLX); with
  ``measure(..., harness="cotangents")`` (what ``bench/gdn_vs_fla.py`` runs by default)
  the same gradients given ``w`` and ``w_s`` as the outputs' cotangents, no loss;
- memory: ``torch.cuda.max_memory_allocated()`` above ``memory_allocated()`` just before
  the call (inputs excluded; forward, backward and the gradients themselves included),
  after ``empty_cache()`` and ``reset_peak_memory_stats()``;
- time: CUDA events around forward + backward, median of ``--repeats`` calls after
  ``--warmup`` calls (which also run Triton's autotuning); the host wall clock around
  the same calls is recorded too (``wall_seconds``), as MLX's figure is a wall clock.

fla 0.6.0 raises in the gated ``chunk_bwd_dqkwg`` on Hopper with 3.4.0 <= Triton < 3.7.1
(fla issue #640: a Triton miscompile reported for block width 64; fla picks 128 on
Hopper). ``--lift-hopper-guard`` (default on) sets the module flag that guard reads, and
``--check`` first compares every output and gradient with a float32 per-step reference
at a small T on the same inputs, so a wrong kernel shows up in the JSON instead of
passing silently.

With ``--gate channel`` the gate is per key channel, ``g`` ``[B, T, Hv, Dk]`` (Kimi Delta
Attention, ``bench/gated_delta.py --gate channel``), and the op is fla's ``chunk_kda``
(the decay given precomputed, as here: ``use_gate_in_kernel=False``); the reference
decays the state's key rows, ``S <- diag(exp(g_t)) S``.

    python bench/fla_gdn.py --json bench-out/fla_gdn_h200.json
    python bench/fla_gdn.py --T 1024 16384 --repeats 20
    python bench/fla_gdn.py --gate channel --T 2048 4096 16384
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
KiB = 1024.0
DEFAULT_T = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def versions() -> dict[str, Any]:
    import torch
    import triton

    out: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__}
    try:
        import fla

        out["fla"] = getattr(fla, "__version__", "?")
    except Exception as exc:
        out["fla"] = f"import failed: {exc!r}"
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
    return out


def _commit() -> str | None:
    """This checkout's commit (``CHUNKSCAN_COMMIT`` first, as in ``bench/_common.py``:
    a copied tree's git metadata may not be the tree's), ``+dirty`` where tracked files
    differ from it (as ``bench/_common.py`` marks it; missing here before, found by
    probing)."""
    import os
    import subprocess

    if os.environ.get("CHUNKSCAN_COMMIT"):
        return os.environ["CHUNKSCAN_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True, timeout=20).stdout.strip()  # fmt: skip

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def lift_hopper_guard() -> str | None:
    """Let fla 0.6.0 run its gated backward on Hopper with Triton < 3.7.1 (see above)."""
    import fla.ops.common.chunk_o as chunk_o

    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 forced to True"


def make_inputs(
    T: int,
    B: int = 1,
    Hk: int = 16,
    Hv: int = 32,
    Dk: int = 128,
    Dv: int = 128,
    dtype: str = "bfloat16",
    seed: int = 0,
    device: str = "cuda",
    gate: str = "head",
):
    """``(xs, w, w_s)``: ``xs = [q, k, v, g, beta, h0]`` leaves that need gradients;
    ``g`` is ``[B, T, Hv]``, or ``[B, T, Hv, Dk]`` with ``gate="channel"``."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, device=device)

    q = normal(B, T, Hk, Dk)
    k = normal(B, T, Hk, Dk)
    k = k / k.norm(dim=-1, keepdim=True)
    v = normal(B, T, Hv, Dv)
    g = -uniform(0.01, 0.3, B, T, Hv, *((Dk,) if gate == "channel" else ()))
    beta = uniform(0.05, 1.0, B, T, Hv)
    h0 = 0.1 * normal(B, Hv, Dk, Dv)  # fla's state layout is [K, V]
    w = normal(B, T, Hv, Dv).to(dt)
    w_s = normal(B, Hv, Dk, Dv)
    xs = [x.to(dt) for x in (q, k, v, g, beta)] + [h0]
    xs = [x.detach().requires_grad_(True) for x in xs]
    return xs, w, w_s


def fla_op(q, k, v, g, beta, h0):
    """fla's chunked op: ``chunk_gated_delta_rule``, or ``chunk_kda`` for a 4-D ``g``."""
    scale = q.shape[-1] ** -0.5
    if g.ndim == 4:
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True
    )


def reference_op(q, k, v, g, beta, h0):
    """Per-step recurrence in float32 (autograd through a Python loop; small T only)."""
    import torch

    G = v.shape[2] // q.shape[2]
    scale = q.shape[-1] ** -0.5
    qf = q.float().repeat_interleave(G, dim=2)
    kf = k.float().repeat_interleave(G, dim=2)
    vf, gf, bf = v.float(), g.float(), beta.float()
    state = h0.float()  # [B, Hv, Dk, Dv]
    outs = []
    for t in range(q.shape[1]):
        decay = gf[:, t].exp()  # [B, Hv] or, per key channel, [B, Hv, Dk]
        state = state * (decay[..., None] if decay.ndim == 3 else decay[..., None, None])
        pred = torch.einsum("bhk,bhkv->bhv", kf[:, t], state)
        delta = bf[:, t][..., None] * (vf[:, t] - pred)
        state = state + kf[:, t][..., :, None] * delta[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qf[:, t], state))
    return torch.stack(outs, dim=1), state


def _loss(op, xs, w, w_s):
    o, final = op(*xs)
    return (o * w).float().sum() + (final * w_s).sum(), o, final


def fwd_bwd(xs, w, w_s, harness: str = "loss"):
    """The gradients of the six inputs. ``harness``: ``"loss"``, of ``sum(o * w) +
    sum(final * w_s)`` (the loss's product, cast and sum in the call); ``"cotangents"``,
    the backward given ``w`` and ``w_s`` as the cotangents of ``o`` and the final state
    (the same gradients, the op's forward and backward alone)."""
    import torch

    if harness == "cotangents":
        o, final = fla_op(*xs)
        return torch.autograd.grad((o, final), xs, grad_outputs=(w, w_s))
    loss, _, _ = _loss(fla_op, xs, w, w_s)
    return torch.autograd.grad(loss, xs)


def check(T: int = 128, seed: int = 1, **shape) -> dict[str, Any]:
    """Relative errors ``|fla - ref| / |ref|`` of o, final state and the six gradients
    (``shape`` may carry ``gate``)."""
    import torch

    xs, w, w_s = make_inputs(T, seed=seed, **shape)
    loss, o, final = _loss(fla_op, xs, w, w_s)
    grads = torch.autograd.grad(loss, xs)
    ref_xs = [x.detach().float().requires_grad_(True) for x in xs]
    ref_loss, ref_o, ref_final = _loss(reference_op, ref_xs, w.float(), w_s)
    ref_grads = torch.autograd.grad(ref_loss, ref_xs)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    got = [o, final, *grads]
    ref = [ref_o, ref_final, *ref_grads]
    errors = {}
    for name, a, b in zip(names, got, ref):
        a, b = a.detach().double(), b.detach().double()
        if not torch.isfinite(a).all():
            errors[name] = math.inf
            continue
        errors[name] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    worst = max(errors.values())
    return {"T": T, "rel_errors": errors, "worst": worst, "ok": worst < 2e-2}


def _sync():
    import torch

    torch.cuda.synchronize()


def measure(
    T: int,
    repeats: int = 10,
    warmup: int = 3,
    dtype: str = "bfloat16",
    seed: int = 0,
    harness: str = "loss",
    **shape,
) -> dict[str, Any]:
    import torch

    xs, w, w_s = make_inputs(T, dtype=dtype, seed=seed, **shape)
    for _ in range(warmup):
        fwd_bwd(xs, w, w_s, harness)
    # memory: peak above what is allocated just before the call (inputs excluded)
    _sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = fwd_bwd(xs, w, w_s, harness)
    _sync()
    peak = float(torch.cuda.max_memory_allocated() - before)
    del grads
    # time: fwd+bwd, CUDA events and the host clock around the same calls
    gpu, wall = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync()
        t0 = time.perf_counter()
        start.record()
        grads = fwd_bwd(xs, w, w_s, harness)
        end.record()
        _sync()
        wall.append(time.perf_counter() - t0)
        gpu.append(start.elapsed_time(end) / 1e3)
        del grads
    # forward only (no graph kept)
    fwd = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fla_op(*xs)
            end.record()
            _sync()
            if i >= warmup:
                fwd.append(start.elapsed_time(end) / 1e3)
    seconds = statistics.median(gpu)
    B = xs[0].shape[0]
    return {
        "impl": "fla",
        "op": "chunk_kda" if xs[3].ndim == 4 else "chunk_gated_delta_rule",
        "T": T,
        "dtype": dtype,
        "chunk_size": 64,
        "seconds": seconds,
        "wall_seconds": statistics.median(wall),
        "fwd_seconds": statistics.median(fwd),
        "tokens_per_s": B * T / seconds,
        "peak_bytes": peak,
        "kib_per_token": peak / KiB / T,
        "repeats": repeats,
        "harness": harness,
    }


def build_parser() -> argparse.ArgumentParser:
    from _common import Once, non_negative_float, non_negative_int, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=DEFAULT_T)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--B", type=positive_int, default=1)
    p.add_argument("--Hk", type=positive_int, default=16)
    p.add_argument("--Hv", type=positive_int, default=32)
    p.add_argument("--D", type=positive_int, default=128, help="Dk = Dv")
    p.add_argument("--gate", choices=["head", "channel"], default="head",
                   help="g per value head, or per key channel (fla's chunk_kda)")  # fmt: skip
    p.add_argument("--check", type=non_negative_int, default=128,
                   help="T of the reference check; 0: skip")  # fmt: skip
    p.add_argument(
        "--lift-hopper-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run fla 0.6.0's gated backward on Hopper with Triton < 3.7.1 (see module doc)",
    )
    p.add_argument("--budget", type=non_negative_float, default=0.0, help="seconds; 0: no limit")
    p.add_argument("--json", default=str(ROOT / "bench-out" / "fla_gdn.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from _common import check_outputs, json_text

    check_outputs(parser, {"--json": args.json}, optional=("--json",))
    started = time.perf_counter()
    try:
        import torch
    except ImportError:  # a traceback before (found by probing)
        print("[bench.fla_gdn] fla's kernels need PyTorch with a CUDA GPU; PyTorch is not "
              "installed.", file=sys.stderr)  # fmt: skip
        return 2
    if not torch.cuda.is_available():
        print("[bench.fla_gdn] fla's kernels need a CUDA GPU; none found.", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("fla") is None:  # every row an error before
        print("[bench.fla_gdn] fla (flash-linear-attention, fla-core) is not installed.",
              file=sys.stderr)  # fmt: skip
        return 2
    shape = {"B": args.B, "Hk": args.Hk, "Hv": args.Hv, "Dk": args.D, "Dv": args.D,
             "gate": args.gate}  # fmt: skip
    import platform

    versions_ = versions()
    device = f"{versions_.get('gpu', 'cuda')}, {platform.machine()}"
    # the argv main parsed, as _common.meta records it: sys.argv was the caller's where
    # main(argv) ran in-process (found by probing)
    ran = ["python", "bench/fla_gdn.py", *(sys.argv[1:] if argv is None else argv)]
    meta: dict[str, Any] = {"argv": ran, "commit": _commit(), "device": device,
                            "shape": shape, "versions": versions_}  # fmt: skip
    meta["hopper_guard"] = lift_hopper_guard() if args.lift_hopper_guard else "kept"
    print(json.dumps(meta), flush=True)
    result: dict[str, Any] = {"meta": meta, "rows": []}

    def write():
        if args.json:
            pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as fh:  # strict: its errors may be inf
                fh.write(json_text(result))

    if args.check:
        try:
            result["check"] = check(T=args.check, **shape)
        except Exception as exc:
            result["check"] = {"error": f"{type(exc).__name__}: {exc}"}
        print("check:", json.dumps(result["check"]), flush=True)
        write()
    for T in args.T:
        if args.budget and time.perf_counter() - started > args.budget:
            row = {"impl": "fla", "T": T, "error": "skipped: budget"}  # printed and written
        else:
            try:
                row = measure(T, args.repeats, args.warmup, args.dtype, **shape)
            except Exception as exc:  # OOM or a kernel failure: keep going
                row = {"impl": "fla", "T": T, "error": f"{type(exc).__name__}: {exc}"[:500]}
                torch.cuda.empty_cache()
        result["rows"].append(row)
        if "error" in row:
            print(f"fla T={T:>6}: {row['error']}", flush=True)
        else:
            print(
                f"fla T={T:>6}: {row['seconds'] * 1e3:9.2f} ms "
                f"(wall {row['wall_seconds'] * 1e3:.2f}, fwd {row['fwd_seconds'] * 1e3:.2f}) "
                f"{row['tokens_per_s'] / 1e6:7.2f} Mtok/s {row['kib_per_token']:8.1f} KiB/token",
                flush=True,
            )
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
