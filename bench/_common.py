"""What every benchmark records and how it writes: one place for the bench scripts.

``meta()`` gives the provenance of a run (argv, git commit, date, device, versions);
``write_json`` writes ``{"meta": ..., "rows": [...]}``. Default outputs go under
``bench-out/`` (git-ignored), never over the committed files in ``bench/results/``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"  # default output folder (git-ignored)
KiB = 1024.0


def git_commit() -> str:
    """``CHUNKSCAN_COMMIT`` when set (a copied tree on a device machine, whose git
    metadata, if any, is not this tree's: an H200 run recorded a stale commit), else the
    checkout's commit (``+dirty`` when it has changes)."""
    if os.environ.get("CHUNKSCAN_COMMIT"):
        return os.environ["CHUNKSCAN_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("mlx", "mlx_lm", "numpy", "torch", "triton", "fla"):
        try:
            module = __import__(name)
            if name == "mlx":
                import mlx.core as mx

                out["mlx"] = mx.__version__
            else:
                out[name] = getattr(module, "__version__", "?")
        except Exception:
            continue
    return out


def device() -> str:
    """The default MLX device, with the GPU's name where ``nvidia-smi`` knows it."""
    import mlx.core as mx

    name = str(mx.default_device())
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
        if gpu:
            name += f" ({gpu.splitlines()[0]})"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{name}, {platform.machine()}, {os.cpu_count()} cpus"


def meta(**extra: Any) -> dict[str, Any]:
    return {
        "argv": sys.argv,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device(),
        "versions": versions(),
        **extra,
    }


def write_json(path: str | pathlib.Path, meta_: dict[str, Any], rows: list[dict]) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta_, "rows": rows}, indent=1) + "\n")


def child_env(bench: bool = False) -> dict[str, str]:
    """``PYTHONPATH`` for measuring processes: the checkout's ``src`` and root first
    (and ``bench/``, for targets named by their bench module, with ``bench=True``)."""
    parts = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    if bench:
        parts.insert(0, str(ROOT / "bench"))
    return {"PYTHONPATH": os.pathsep.join(p for p in parts if p)}
