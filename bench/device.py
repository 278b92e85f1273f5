"""On-device entry point: the whole benchmark suite in one command, under a time budget.

Stages (``--stages``, run in this order, each in child processes):

- ``env``: versions (python, torch, triton, fla, mlx, mlx-lm), ``nvidia-smi``, a tiny
  MLX smoke test on the default device;
- ``fla``: ``bench/fla_gdn.py`` (flash-linear-attention's ``chunk_gated_delta_rule``,
  fwd+bwd, with its reference check);
- ``gdn``: ``bench/gated_delta.py``, unchanged, one invocation per T (chunkscan at every
  T; mlx-lm's ``gated_delta_ops``, ``mx.fast.gated_delta_update`` and the per-token
  ``chunkscan.scan`` up to ``--loop-max-T``), merged into one JSON;
- ``profile``: where chunkscan's time goes: forward only vs fwd+bwd, Python graph
  building vs evaluation, and time against ``chunk_size`` at fixed T;
- ``repro``: the seed experiment (:mod:`chunkscan.commands.repro`), the same ``measure`` the CLI
  ``chunkscan repro`` runs, one fresh process per configuration, but with a global
  budget: configurations whose predicted time (from the same mode at the smaller T)
  exceeds what is left are skipped, and the JSON is rewritten after every one.

Every stage writes its JSON as it goes, so a run stopped by its time limit still leaves
data under ``--out``. Files (at most 8 come back from the device): ``env_<tag>.json``,
``fla_gdn_<tag>.json``, ``gdn_<tag>.json`` (op rows + profile), ``gdn_<tag>.png``,
``repro_<tag>.json``, ``repro_<tag>.png``.

On the H200 (see docs/benchmarks.md for the exact calls; ``--setup`` installs the wheels
carried in ``.whl/`` into /tmp/site and unpacks MLX's CUDA build from ``.mlxcuda/``)::

    python3 bench/device.py --setup --stages env fla --budget 240 --out $OUT
    python3 bench/device.py --setup --stages env gdn profile --budget 500 --out $OUT
    python3 bench/device.py --stages repro --budget 540 --out $OUT

Here, on the CPU, the same suite at tiny sizes (fla is skipped without CUDA)::

    python bench/device.py --local

``--report DIR`` prints the Markdown tables of the JSON files found in DIR.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = pathlib.Path("/tmp/site")
MLX_DIR = pathlib.Path("/tmp/mlx")
KiB = 1024.0
STAGES = ("env", "fla", "gdn", "profile", "repro")

# sizes: (device, local)
SIZES = {
    "device": {
        "gdn_T": [1024, 2048, 4096, 8192, 16384, 32768, 65536],
        "loop_T": [1024, 4096],
        "scan_T": [1024],
        "fla_T": [1024, 2048, 4096, 8192, 16384, 32768, 65536],
        "profile_T": [16384, 65536],
        "profile_chunks": [32, 64, 128, 256],
        "profile_chunk_T": 16384,
        "repro": {"H": 32, "D": 128, "chunk": 32, "T": [256, 1024, 4096, 8192], "check": 1024},
        "repeats": 3,
    },
    "local": {
        "gdn_T": [64, 128],
        "loop_T": [64],
        "scan_T": [64],
        "fla_T": [256, 512],
        "profile_T": [128],
        "profile_chunks": [32, 64],
        "profile_chunk_T": 128,
        "repro": {"H": 4, "D": 32, "chunk": 8, "T": [32, 64], "check": 64},
        "repeats": 2,
    },
}
REPRO_MODES = ["plain", "mx.checkpoint", "cs.checkpoint+split", "cs.scan"]
REPRO_LAST = ["cs.checkpoint"]  # if time allows


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def log(msg: str) -> None:
    print(f"[device {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child_env(local: bool) -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "src")]
    if not local:
        paths += [str(SITE), str(MLX_DIR)]
    old = os.environ.get("PYTHONPATH")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def sh(cmd: list[str] | str, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd``, streaming its output; ``(returncode, output)`` (124 on timeout)."""
    log(f"$ {cmd if isinstance(cmd, str) else ' '.join(cmd)}  (timeout {timeout:.0f} s)")
    try:
        proc = subprocess.run(
            cmd,
            shell=isinstance(cmd, str),
            env=env,
            cwd=ROOT,
            timeout=max(1.0, timeout),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        out = out.decode() if isinstance(out, bytes) else out
        print(out, flush=True)
        log("timed out")
        return 124, out
    print(proc.stdout, end="", flush=True)
    return proc.returncode, proc.stdout


def write_json(path: pathlib.Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- setup


def setup() -> None:
    """Install the carried wheels into /tmp/site; unpack MLX's CUDA build into /tmp/mlx."""
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if wheels and not (SITE / ".done").exists():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels]
        rc, _ = sh(cmd, 300)
        if rc:
            raise SystemExit(f"wheel install failed ({rc})")
        # mlx_lm/__init__.py imports its generate/convert stack (transformers and more);
        # the benchmark needs only mlx_lm.models.gated_delta, which imports mlx alone.
        init = SITE / "mlx_lm" / "__init__.py"
        if init.exists():
            init.write_text("from ._version import __version__  # trimmed for the bench\n")
        (SITE / ".done").touch()
    MLX_DIR.mkdir(parents=True, exist_ok=True)
    for part in ("part.aa", "part.ab"):
        src = ROOT / ".mlxcuda" / part
        if src.exists() and not (MLX_DIR / part).exists():
            shutil.copy(src, MLX_DIR / part)
            log(f"copied {part} to {MLX_DIR}")
    parts = [MLX_DIR / "part.aa", MLX_DIR / "part.ab"]
    if all(p.exists() for p in parts) and not (MLX_DIR / "mlx" / "core").exists():
        if not (MLX_DIR / "mlx").exists():
            rc, _ = sh(f"cat {parts[0]} {parts[1]} | xz -d -T8 | tar x -C {MLX_DIR}", 300)
            if rc:
                raise SystemExit(f"MLX unpack failed ({rc})")
        for p in parts:
            p.unlink()


# ----------------------------------------------------------------------------- stages


PY_VERSIONS = r"""
import json, platform, importlib
out = {"python": platform.python_version()}
for name in ("numpy", "torch", "triton", "fla", "mlx_lm"):
    try:
        m = importlib.import_module(name)
        out[name] = getattr(m, "__version__", "?")
    except Exception as exc:
        out[name] = "unavailable: " + repr(exc)[:200]
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
    out["torch_gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:
    pass
try:
    import mlx.core as mx
    out["mlx"] = mx.__version__
    out["mlx_device"] = str(mx.default_device())
    a = mx.random.normal((512, 512))
    out["mlx_smoke"] = float(mx.sum(a @ a.T).item())
    out["mlx_fast_gated_delta_update"] = hasattr(mx.fast, "gated_delta_update")
    from mlx_lm.models.gated_delta import gated_delta_ops  # noqa: F401
    out["mlx_lm_gated_delta_import"] = "ok"
except Exception as exc:
    out["mlx_error"] = repr(exc)[:500]
print("@@env@@" + json.dumps(out))
"""


def stage_env(args, sizes, budget: Budget, env) -> None:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    rc, out = sh([sys.executable, "-c", PY_VERSIONS], min(120, budget.left()), env)
    for line in out.splitlines():
        if line.startswith("@@env@@"):
            info.update(json.loads(line[len("@@env@@") :]))
    if shutil.which("nvidia-smi"):
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
        rc, out = sh(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], 30)
        info["nvidia_smi"] = out.strip()
    info["nproc"] = os.cpu_count()
    write_json(args.out / f"env_{args.tag}.json", info)


def stage_fla(args, sizes, budget: Budget, env) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        log("fla: torch is not installed here: skipped")
        return
    path = args.out / f"fla_gdn_{args.tag}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "fla_gdn.py"), "--json", str(path)]
    cmd += ["--T", *map(str, sizes["fla_T"]), "--budget", str(max(10, budget.left() - 60))]
    if args.local:
        cmd += ["--Hk", "2", "--Hv", "4", "--D", "32", "--check", "32"]
    rc, _ = sh(cmd, budget.left(), env)
    if rc:
        log(f"fla: exit {rc}")


def stage_gdn(args, sizes, budget: Budget, env) -> None:
    """bench/gated_delta.py, unchanged, once per (T, impls); rows merged as they come."""
    path = args.out / f"gdn_{args.tag}.json"
    merged = _load(path) or {"meta": {}, "rows": [], "profile": []}
    merged["meta"]["gated_delta_argv"] = []
    tmp = pathlib.Path("/tmp/chunkscan-gdn")
    tmp.mkdir(exist_ok=True)
    plan = [(T, ["chunkscan"]) for T in sizes["gdn_T"]]
    for T in sizes["loop_T"]:
        plan.append((T, ["mlx_fast", "mlx_lm"] + (["scan"] if T in sizes["scan_T"] else [])))
    for T, impls in plan:
        if budget.left() < 20:
            merged["rows"] += [{"impl": i, "T": T, "error": "skipped: budget"} for i in impls]
            continue
        out_json = tmp / f"T{T}-{'-'.join(impls)}.json"
        cmd = [sys.executable, str(ROOT / "bench" / "gated_delta.py"), "--T", str(T)]
        cmd += ["--impls", *impls, "--repeats", str(sizes["repeats"]), "--loop-max-T", str(T)]
        cmd += ["--timeout", str(int(max(10, budget.left() - 5)))]
        cmd += ["--json", str(out_json), "--png", "", "--md", ""]
        merged["meta"]["gated_delta_argv"].append(cmd[1:])
        started = time.perf_counter()
        rc, text = sh(cmd, budget.left(), env)
        res = _load(out_json)
        if res is None:
            err = f"gated_delta.py exit {rc}: " + " | ".join(text.strip().splitlines()[-3:])
            merged["rows"] += [{"impl": i, "T": T, "error": err[:800]} for i in impls]
        else:
            for row in res["rows"]:
                row["process_wall_s"] = time.perf_counter() - started
                if "seconds" in row:
                    row["tokens_per_s"] = T / row["seconds"]
            merged["rows"] += res["rows"]
        write_json(path, merged)


def _gdn_setup(T: int, chunk_size: int, dtype: str):
    """Qwen3-Next layer inputs, ``chunkscan.gated_delta_rule`` and its value-and-grad
    over all six inputs (the loss of ``bench/gated_delta.py``): ``(xs, f, grad)``."""
    import mlx.core as mx

    from bench.gated_delta import _inputs, _op

    xs, w, w_s = _inputs(T, 1, 16, 32, 128, 128, dtype, 0)
    mx.eval(xs, w, w_s)
    f = _op("chunkscan", 128, chunk_size)

    def loss(*a):
        o, final = f(*a)
        return mx.sum((o * w).astype(mx.float32)) + mx.sum(final * w_s)

    return xs, f, mx.value_and_grad(loss, argnums=tuple(range(6)))


def profile_gdn(
    T: int, chunk_size: int = 64, repeats: int = 3, fwd: bool = True, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """chunkscan.gated_delta_rule at the Qwen3-Next layer shape: where the time goes.

    Run in a fresh process (:func:`chunkscan.commands.measure.run_isolated`). ``build``: the
    Python call that returns the lazy outputs (graph construction, including the custom
    backward's Python loop over chunks); ``eval``: ``mx.eval`` of them (scheduling,
    kernel launches and GPU work).
    """
    import mlx.core as mx

    xs, f, grad = _gdn_setup(T, chunk_size, dtype)

    def split_times(call) -> dict[str, float]:
        mx.eval(call())  # warm-up
        build, ev, total = [], [], []
        for _ in range(repeats):
            mx.synchronize()
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            mx.eval(out)
            mx.synchronize()
            t2 = time.perf_counter()
            build.append(t1 - t0)
            ev.append(t2 - t1)
            total.append(t2 - t0)
            del out
        med = statistics.median
        return {"build_s": med(build), "eval_s": med(ev), "total_s": med(total)}

    row: dict[str, Any] = {"T": T, "chunk_size": chunk_size, "n_chunks": -(-T // chunk_size)}
    row["fwd_bwd"] = split_times(lambda: grad(*xs))
    if fwd:
        row["fwd"] = split_times(lambda: f(*xs))
    row["device"] = str(mx.default_device())
    return row


def timing_runs(T: int, chunk_size: int = 64, runs: int = 8, dtype: str = "bfloat16") -> dict:
    """Every run's fwd+bwd wall time, warm, then again right after ``mx.clear_cache()``.

    ``bench/gated_delta.py`` clears the buffer cache for its memory figure just before
    its timed runs; this shows what that, and run-to-run noise, do to a median.
    """
    import mlx.core as mx

    xs, f, grad = _gdn_setup(T, chunk_size, dtype)

    def timed(n):
        out = []
        for _ in range(n):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(grad(*xs))
            mx.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    first = timed(1)
    warm = timed(runs)
    mx.synchronize()
    mx.clear_cache()
    after_clear = timed(max(2, runs // 2))
    return {
        "T": T,
        "chunk_size": chunk_size,
        "first": first,
        "warm": warm,
        "after_clear_cache": after_clear,
        "cache_bytes": mx.get_cache_memory(),
    }


def stage_profile(args, sizes, budget: Budget, env) -> None:
    from chunkscan.commands.measure import run_isolated

    path = args.out / f"gdn_{args.tag}.json"
    merged = _load(path) or {"meta": {}, "rows": [], "profile": []}
    merged.setdefault("profile", [])
    plan = [(T, 64, True) for T in sizes["profile_T"]]
    plan += [(sizes["profile_chunk_T"], c, False) for c in sizes["profile_chunks"] if c != 64]
    if args.profile:
        plan = [(int(T), int(c), c == "64") for T, c in (x.split(":") for x in args.profile)]
    for T in args.timing_runs or []:
        log(f"timing runs T={T}")
        res = run_isolated("bench.device:timing_runs", {"T": T}, timeout=budget.left(), env=env)
        log(f"  -> {json.dumps(res)}")
        merged.setdefault("timing_runs", []).append(res)
        write_json(path, merged)
    for T, c, fwd in plan:
        if budget.left() < 20:
            merged["profile"].append({"T": T, "chunk_size": c, "error": "skipped: budget"})
            continue
        config = {"T": T, "chunk_size": c, "repeats": sizes["repeats"], "fwd": fwd}
        log(f"profile {config}")
        res = run_isolated("bench.device:profile_gdn", config, timeout=budget.left(), env=env)
        res.update({k: v for k, v in config.items() if k not in res})
        log(f"  -> {json.dumps(res)}")
        merged["profile"].append(res)
        write_json(path, merged)


def stage_repro(args, sizes, budget: Budget, env) -> None:
    """The seed experiment, as ``chunkscan repro`` runs it, under a global time budget."""
    import tempfile

    from chunkscan.commands import repro
    from chunkscan.commands.measure import run_isolated

    r = sizes["repro"]
    Ts = sorted(r["T"])
    configs = []
    for modes in (REPRO_MODES, REPRO_LAST):
        for T in Ts:
            for mode in modes:
                configs += [(mode, grads, T) for grads in ("state", "qkv")]
    meta = {"H": r["H"], "D": r["D"], "chunk": r["chunk"], "compiled": False}
    meta.update({"modes": repro.MODES, "grads": repro.GRADS, "check_max_T": r["check"]})
    result: dict[str, Any] = {"meta": meta, "rows": []}
    path = args.out / f"repro_{args.tag}.json"
    ref_dir = tempfile.mkdtemp(prefix="chunkscan-repro-")
    walls: dict[tuple[str, str], tuple[int, float]] = {}
    for n, (mode, grads, T) in enumerate(configs, 1):
        prev = walls.get((mode, grads))
        predicted = prev[1] * T / prev[0] * 1.3 if prev else 0.0
        if budget.left() < 15 or predicted > budget.left():
            res: dict[str, Any] = {
                "error": f"skipped: predicted {predicted:.0f} s, {budget.left():.0f} s left"
            }
        elif prev and "error" in _row(result, mode, grads, prev[0]):
            res = {"error": f"skipped: failed at T={prev[0]}"}
        else:
            config = dict(mode=mode, grads=grads, T=T, H=r["H"], D=r["D"], chunk=r["chunk"])
            config.update(repeats=1, compiled=False, check_max_T=r["check"], ref_dir=ref_dir)
            started = time.perf_counter()
            res = run_isolated(
                "chunkscan.commands.repro:measure",
                config,
                timeout=min(args.config_timeout, budget.left()),
                env=env,
            )
            res["process_wall_s"] = time.perf_counter() - started
            walls[(mode, grads)] = (T, res["process_wall_s"])
        result["rows"].append({"mode": mode, "grads": grads, "T": T, **res})
        status = res.get("error") or (
            f"{res['peak_mib']:9.1f} MiB {res['seconds']:8.3f} s "
            f"(process {res['process_wall_s']:.1f} s)"
        )
        log(f"[{n:>2}/{len(configs)}] {grads:<5} {mode:<20} T={T:<6} {status}")
        write_json(path, result)
    shutil.rmtree(ref_dir, ignore_errors=True)
    try:
        import mlx.core as mx

        meta.update({"mlx": mx.__version__, "device": str(mx.default_device())})
    except Exception as exc:  # keep the data even if this fails
        meta.update({"mlx": "?", "device": repr(exc)})
    write_json(path, result)
    print(repro.format_table(result["rows"], Ts), flush=True)
    if not args.no_plot:
        repro.plot(result["rows"], meta, str(args.out / f"repro_{args.tag}.png"))


def _row(result: dict, mode: str, grads: str, T: int) -> dict:
    for row in result["rows"]:
        if (row["mode"], row["grads"], row["T"]) == (mode, grads, T):
            return row
    return {}


def _load(path: pathlib.Path) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- report

IMPL_ORDER = ["fla", "chunkscan", "mlx_fast", "mlx_lm", "scan"]


def gdn_rows(folder: pathlib.Path, tag: str) -> list[dict[str, Any]]:
    rows = []
    fla = _load(folder / f"fla_gdn_{tag}.json")
    if fla:
        rows += fla["rows"]
    gdn = _load(folder / f"gdn_{tag}.json")
    if gdn:
        rows += gdn["rows"]
    return rows


def gdn_table(rows: list[dict[str, Any]]) -> str:
    fla = {r["T"]: r for r in rows if r.get("impl") == "fla" and "seconds" in r}
    lines = [
        "| impl | T | fwd+bwd (ms) | ktokens/s | peak (KiB/token) | time / fla | memory / fla |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    key = {name: i for i, name in enumerate(IMPL_ORDER)}
    for r in sorted(rows, key=lambda r: (r["T"], key.get(r.get("impl"), 9))):
        if "seconds" not in r:
            lines.append(f"| {r.get('impl')} | {r['T']} | {r.get('error', '?')[:90]} | | | | |")
            continue
        ref = fla.get(r["T"])
        ratio_t = f"{r['seconds'] / ref['seconds']:.1f}x" if ref else ""
        ratio_m = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x" if ref else ""
        lines.append(
            f"| {r['impl']} | {r['T']} | {r['seconds'] * 1e3:.1f} | "
            f"{r['T'] / r['seconds'] / 1e3:.1f} | {r['kib_per_token']:.1f} | "
            f"{ratio_t} | {ratio_m} |"
        )
    return "\n".join(lines)


def profile_table(profile: list[dict[str, Any]]) -> str:
    lines = [
        "| T | chunk | chunks | fwd+bwd (ms) | of which build (ms) | eval (ms) "
        "| fwd (ms) | fwd build (ms) | ms / chunk (fwd+bwd) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in profile:
        if "fwd_bwd" not in p:
            lines.append(f"| {p['T']} | {p['chunk_size']} | | {p.get('error', '?')[:80]} |||||")
            continue
        fb, fw = p["fwd_bwd"], p.get("fwd")
        fwd = f"{fw['total_s'] * 1e3:.1f} | {fw['build_s'] * 1e3:.1f}" if fw else " | "
        lines.append(
            f"| {p['T']} | {p['chunk_size']} | {p['n_chunks']} | {fb['total_s'] * 1e3:.1f} | "
            f"{fb['build_s'] * 1e3:.1f} | {fb['eval_s'] * 1e3:.1f} | {fwd} | "
            f"{fb['total_s'] * 1e3 / p['n_chunks']:.2f} |"
        )
    return "\n".join(lines)


def plot_gdn(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in IMPL_ORDER:
        pts = sorted((r["T"], r) for r in rows if r.get("impl") == impl and "seconds" in r)
        if not pts:
            continue
        Ts = [t for t, _ in pts]
        ax_t.plot(Ts, [r["seconds"] * 1e3 for _, r in pts], "o-", label=impl)
        ax_m.plot(Ts, [r["kib_per_token"] for _, r in pts], "o-", label=impl)
    for ax, ylabel in ((ax_t, "fwd+bwd time (ms)"), (ax_m, "peak above inputs (KiB / token)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(folder: pathlib.Path, tag: str, plot: bool = True) -> str:
    parts = []
    env = _load(folder / f"env_{tag}.json")
    if env:
        parts.append("env: " + json.dumps(env))
    fla = _load(folder / f"fla_gdn_{tag}.json")
    if fla:
        parts.append("fla: " + json.dumps(fla["meta"]) + "\ncheck: " + json.dumps(fla.get("check")))
    rows = gdn_rows(folder, tag)
    if rows:
        parts.append(gdn_table(rows))
        if plot:
            title = "Gated DeltaNet layer (B=1, Hk=16, Hv=32, D=128, bf16), fwd+bwd"
            plot_gdn(rows, folder / f"gdn_{tag}.png", title)
    gdn = _load(folder / f"gdn_{tag}.json")
    if gdn and gdn.get("profile"):
        parts.append(profile_table(gdn["profile"]))
    rep = _load(folder / f"repro_{tag}.json")
    if rep:
        from chunkscan.commands.repro import format_table

        Ts = sorted({r["T"] for r in rep["rows"]})
        parts.append(format_table(rep["rows"], Ts))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local", action="store_true", help="tiny sizes on this machine's MLX")
    p.add_argument("--setup", action="store_true", help="install .whl/ and unpack .mlxcuda/")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all stages")
    p.add_argument("--config-timeout", type=float, default=240.0, help="repro, per config")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/chunkscan-device")
    p.add_argument("--tag", default=None, help="file suffix (default: h200, or local)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timing-runs", nargs="+", type=int, default=None, metavar="T")
    p.add_argument(
        "--profile", nargs="+", default=None, metavar="T:CHUNK", help="profile these instead"
    )
    p.add_argument("--report", default=None, metavar="DIR", help="print tables of DIR's JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.tag = args.tag or ("local" if args.local else "h200")
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    if args.report:
        print(report(pathlib.Path(args.report), args.tag, plot=not args.no_plot))
        return 0
    args.out = pathlib.Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    if args.setup:
        setup()
    env = child_env(args.local)
    if not args.local:
        sys.path[2:2] = [str(SITE), str(MLX_DIR)]
    sizes = SIZES["local" if args.local else "device"]
    for name in STAGES:
        if name not in args.stages:
            continue
        log(f"stage {name}: {budget.left():.0f} s left")
        try:
            globals()[f"stage_{name}"](args, sizes, budget, env)
        except Exception as exc:  # one stage failing must not lose the others
            log(f"stage {name} failed: {type(exc).__name__}: {exc}")
    log("tables")
    try:
        print(report(args.out, args.tag, plot=not args.no_plot), flush=True)
    except Exception as exc:
        log(f"report failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
