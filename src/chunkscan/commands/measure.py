"""Memory and time measurement, each configuration in a fresh process.

A memory figure is ``mx.get_peak_memory()`` above the active memory before the call,
after ``mx.clear_cache()`` and ``mx.reset_peak_memory()``. Peak memory and the buffer
cache leak between runs in one process, so every configuration runs in its own
subprocess (:func:`run_isolated`), which calls ``module:function(**config)`` and sends
back the dict it returns as JSON.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..ops import _cpu_threads

MiB = 1024.0 * 1024.0
_MARK = "@@chunkscan-result@@"


def peak_above_active(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` (evaluating what it returns); return ``(result, peak bytes)``."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return out, float(mx.get_peak_memory() - before)


def median_seconds(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` (evaluated) over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_RECORDED_ENV = ("CHUNKSCAN_", "MLX_")
# Output files under bench/results/ whose changes do not mark a commit +dirty.
_OUTPUT_EXTS = ("json", "md", "txt", "log", "png", "gz", "csv")


def code_commit() -> str:
    """:func:`git_commit` of the chunkscan checkout this process imports (what
    :func:`provenance` records): read it before a run, for ``provenance(code_before=)``."""
    return git_commit(os.path.abspath(__file__))


def provenance(code_before: str | None = None) -> dict[str, Any]:
    """What a measurement file records about its run: argv, git commit (or
    ``CHUNKSCAN_COMMIT`` where set, for a tree copied without its git metadata; where git
    knows the tree and names another commit or state, that one too as ``git_commit``),
    date, device (with the GPU's name where ``nvidia-smi`` knows it), versions, the
    ``CHUNKSCAN_*`` / ``MLX_*`` environment variables set (they change what runs) and the
    threads the CPU products use (:func:`chunkscan.ops._cpu_threads.threads`).

    ``code_before``: :func:`code_commit` read when the run began. The commit recorded is
    that one, and where git reads another now, that one too as ``git_commit_after`` (a
    run that read the commit after measuring credited a commit made meanwhile with every
    row; found by probing, sessions 51 and 52)."""
    import platform

    now = code_commit()
    here = now if code_before is None else code_before
    commit = os.environ.get("CHUNKSCAN_COMMIT") or here
    versions = {"python": platform.python_version(), "mlx": mx.__version__}
    # The copy imported here (an installed distribution's metadata can name another).
    versions["chunkscan"] = importlib.import_module("chunkscan").__version__
    for name in ("mlx_lm", "numpy", "torch", "triton", "fla"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:
            continue
    # A CHUNKSCAN_COMMIT left set in a shell named other code than the checkout ran
    # (noted in session 46): where git knows this file and disagrees, both are kept.
    head, _, state = here.partition("+")
    given, _, given_state = commit.partition("+")
    disagrees = here != "unknown" and (not head.startswith(given) or state != given_state)
    return {
        "argv": list(sys.argv),
        "commit": commit,
        **({"git_commit": here} if disagrees else {}),
        **({"git_commit_after": now} if now != here else {}),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device(),
        "versions": versions,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RECORDED_ENV)},
        "cpu_threads": _cpu_threads_in_effect(),
    }


def git_commit(path: str) -> str:
    """The commit of the git checkout that tracks the file ``path``, with ``+dirty``
    where a tracked file changed or an untracked one (not ignored) is there, outputs
    under ``bench/results/`` aside; ``"unknown"`` outside one. Untracked files count: a
    run of a script no commit holds recorded a clean commit (found by probing)."""
    here, name = os.path.split(path)
    try:
        run = functools.partial(
            subprocess.run, cwd=here, capture_output=True, text=True, check=True
        )
        # Only a repository that tracks this file: chunkscan installed inside someone
        # else's repository recorded that one's commit (found by probing).
        run(["git", "ls-files", "--error-unmatch", name])
        head = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        # Changes to committed outputs (bench/results/'s data) are not the code's: a
        # run that rewrote its own file made the next command of a batch record
        # +dirty (14 of the CPU results did). Run scripts there (.sh) still count.
        status = ["git", "status", "--porcelain", "--untracked-files=normal", "--", ":(top)"]
        outputs = [f":(top,exclude,glob)bench/results/**/*.{ext}" for ext in _OUTPUT_EXTS]
        dirty = run([*status, *outputs]).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device() -> str:
    """The default MLX device, with the GPU's name where ``nvidia-smi`` knows it (``chunkscan
    repro`` recorded no GPU name; found by probing), the machine and its CPU count."""
    import platform

    name = str(mx.default_device())
    if mx.default_device() != mx.gpu:  # (a CPU run named the machine's GPU; found by review)
        return f"{name}, {platform.machine()}, {os.cpu_count()} cpus"
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


def _cpu_threads_in_effect() -> int | str:
    """The threads the CPU products use, or why ``CHUNKSCAN_CPU_THREADS`` is refused:
    provenance is written after measuring, and a bad value (which the measured code may
    never read) raised there and lost every result (found by probing)."""
    try:
        return _cpu_threads.threads()
    except ValueError as e:
        return f"refused: {e}"


class NoOrdering:
    """Stands in for :mod:`chunkscan._ordering` with no scheduling edges: set it as an
    op module's ``_ordering`` to switch the mechanism off (the negative control of a
    memory guard: the bound must then fail)."""

    @staticmethod
    def _same(arrays: list, deps: Any = None) -> list:
        return list(arrays)

    carry_after_outputs = recompute_after_cotangent = cotangent_after_gradients = _same
    keep_apart = prepare_after_carry = _same


_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float written as its name (``"nan"``, ``"inf"``,
    ``"-inf"``), which JSON has no numbers for: ``json.dumps`` writes a bare ``NaN``,
    which jq, JavaScript and other strict parsers refuse. :func:`from_strict_json`
    reads them back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def from_strict_json(value: Any) -> Any:
    """:func:`strict_json` undone: the strings ``"nan"``, ``"inf"`` and ``"-inf"`` are
    floats again, in dicts and lists at any depth."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: from_strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_strict_json(v) for v in value]
    return value


def run_isolated(
    target: str,
    config: dict[str, Any],
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``target`` (``"package.module:function"``) with ``config`` in a new process.

    Returns the function's dict, or ``{"error": ...}`` when the process failed, ran
    out of memory or timed out. The working folder is not put on the new process's
    ``sys.path`` (``PYTHONSAFEPATH=1``, Python 3.11 and later): ``python -m`` put it
    first, and a ``statistics.py`` there failed every configuration of ``chunkscan
    repro`` (found by probing); the target comes from ``PYTHONPATH`` or the install.
    The folder this process imported ``chunkscan`` from comes first on ``PYTHONPATH``:
    the new process measures the copy whose commit the caller records (a run of another
    checkout's ``src`` measured the installed copy under that checkout's commit; found
    by probing, session 48).
    """
    cmd = [sys.executable, "-m", "chunkscan.commands.measure", target, json.dumps(config)]
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONSAFEPATH", "1")
    full_env.update(env or {})
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (ours, full_env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    if proc.returncode in (-9, 137):
        reason = "killed (out of memory?)"
    elif proc.returncode < 0 and not tail:  # a signal, and nothing written: name it
        reason = f"killed by {_signal_name(-proc.returncode)}"
    else:
        reason = " | ".join(tail)
    return {"error": f"exit {proc.returncode}: {reason}"}


def _signal_name(number: int) -> str:
    """``SIGSEGV`` for 11; the number where Python does not know it."""
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _main(argv: list[str]) -> None:
    target, config = argv[0], json.loads(argv[1])
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**config)
    print(_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
