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
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"  # default output folder (git-ignored)
KiB = 1024.0


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
    """:func:`chunkscan.commands.measure.provenance` (argv, commit, date, versions) with the
    GPU's name in ``device``, plus ``extra``."""
    from chunkscan.commands.measure import provenance

    return {**provenance(), "device": device(), **extra}


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
