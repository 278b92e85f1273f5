"""What every benchmark records and how it writes: one place for the bench scripts.

``meta()`` gives the provenance of a run (argv, git commit, date, device, versions);
``write_json`` writes ``{"meta": ..., "rows": [...]}``. Default outputs go under
``bench-out/`` (git-ignored), never over the committed files in ``bench/results/``.

Before measuring, a script refuses what would fail only later: numbers out of range
(``positive_int`` and its kin as argparse ``type=``), outputs it cannot write
(:func:`check_outputs`), inputs it cannot read (:func:`readable_file`, and
:func:`read_saved` for its own JSON read back) and, for the CUDA-only scripts, a machine
without CUDA (:func:`cuda_missing`). Each gives one line and exit status 2 where a
traceback, or rows of errors and exit status 0, came after the measuring before (found
by probing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"  # default output folder (git-ignored)
KiB = 1024.0


class Once(argparse.Action):
    """``action=Once`` for a list option (``nargs="+", action=Once``): each value once, in the order
    first given. A repeated impl was measured twice and the ratios took the last copy
    (found by probing)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, list(dict.fromkeys(values)))


def _at_least(convert, kind: str, least: float, strict: bool):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind} but got {text!r}") from None
        if not (value > least if strict else value >= least) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {kind} but got {text!r}")
        return value

    return parse


#: argparse ``type=`` for counts and sizes (a T, repeats, a chunk size): 0 or less fails
#: at parse time, "argument --T: must be a positive integer but got '0'", exit status 2.
def plain_int(text: str) -> int:
    """``int(text)`` for ASCII digits with an optional sign only: ``int`` also reads
    ``5_0`` (as 50) and other scripts' digits (found by probing). chunkscan's
    ``_backend.plain_int``, which this module does not import (it imports no MLX)."""
    if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) is None:
        raise ValueError(text)
    return int(text)


positive_int = _at_least(plain_int, "a positive integer", 0, strict=True)
#: ``type=`` where 0 means something (none, off, the default): a negative number fails.
non_negative_int = _at_least(plain_int, "an integer >= 0", 0, strict=False)
#: ``type=`` for seconds and sizes in MiB or GiB that must be above 0 (a timeout).
positive_float = _at_least(float, "a number > 0", 0.0, strict=True)
#: ``type=`` for seconds where 0 means no limit (a budget).
non_negative_float = _at_least(float, "a number >= 0", 0.0, strict=False)
#: ``type=`` for a value of either sign (a gate): NaN and infinities fail.
finite_float = _at_least(float, "a finite number", -math.inf, strict=True)


def readable_file(text: str) -> str:
    """argparse ``type=`` for an input file (a CSV, a JSON): a missing or unreadable one
    fails at parse time, "argument csv: no such file: 'x.csv'", where a traceback came."""
    path = pathlib.Path(text).expanduser()
    if not path.is_file():
        why = "a directory" if path.is_dir() else "no such file"
        raise argparse.ArgumentTypeError(f"{why}: {text!r}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"not readable: {text!r}")
    return str(path)


def check_outputs(
    parser: argparse.ArgumentParser,
    paths: dict[str, str | os.PathLike | None],
    beside: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
    inputs: tuple[str | os.PathLike, ...] = (),
    plots: tuple[str, ...] = (),
) -> None:
    """Before measuring: ``parser.error`` (exit status 2, one line naming the option)
    where an output of ``paths`` (option -> path; None for an output switched off)
    cannot be written, or a file written beside it with a suffix of ``beside`` (a table,
    a plot). ``""`` switches off the outputs of ``optional`` (the script skips them) and
    is refused for the others (it failed after the measuring: ``IsADirectoryError``). A
    missing parent folder is created, as :func:`write_json` does. A folder given as the
    path, or a file in its parent's place, failed only at the end, after minutes of
    measuring (found by probing). Two outputs in one file (``--json P --md P``, or
    ``--json X.md`` beside its ``.md``), or an output over one of ``inputs``, are refused
    too: the last one written replaced the others, with exit status 0 (probing). A
    symbolic link where an output goes is refused: the output was written through it into
    the file it named (probing). The options of ``plots`` must end in a suffix of
    :data:`PLOT_SUFFIXES`: matplotlib refused another only after the measuring (probing),
    and wrote ``P.png`` for a ``P`` without one."""
    taken = {pathlib.Path(f).resolve(): "an input of this run" for f in inputs}
    for option, path in paths.items():
        if path is None or (str(path) == "" and option in optional):
            continue
        if str(path) == "":
            parser.error(f"argument {option}: an empty path (this script always writes it)")
        if str(path).endswith(("/", os.sep)):  # pathlib drops the slash: a file of that
            # name was written where a folder was meant (found by probing, session 48)
            parser.error(f"argument {option}: {str(path)!r} names a folder; pass a file path")
        path = pathlib.Path(path)
        _refuse_a_link(parser, option, path)
        if path.is_dir():  # before with_suffix, which '.' makes raise
            parser.error(f"argument {option}: {str(path)!r} is a directory")
        if option in plots:
            _check_plot_suffix(parser, option, path)
        if path.suffix in beside:
            parser.error(f"argument {option}: {str(path)!r} ends in {path.suffix}, as a file "
                         f"written beside it does: pass a path ending in .json")  # fmt: skip
        files = [path, *(path.with_suffix(suffix) for suffix in beside)]
        for f in files:
            if f.resolve() in taken:
                parser.error(f"argument {option}: {str(f)!r} is also {taken[f.resolve()]}")
            taken[f.resolve()] = f"written for {option}"
        for f in files:
            _refuse_a_link(parser, option, f)
            if f.is_dir():
                parser.error(f"argument {option}: {str(f)!r} is a directory")
        for folder in (path.parent, *path.parent.parents):
            if folder.exists():
                if not folder.is_dir():
                    parser.error(f"argument {option}: {str(folder)!r} is not a folder")
                break
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument {option}: cannot create the folder of {str(path)!r}: "
                         f"{exc.strerror or exc}")  # fmt: skip
        for f in [path.parent] + [f for f in files if f.exists()]:
            if not os.access(f, os.W_OK):
                parser.error(f"argument {option}: {str(f)!r} is not writable")


#: The suffixes a plot may end in where matplotlib is not installed (it is asked
#: otherwise: eps, tiff, webp and others too; found by review).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot_suffixes() -> tuple[str, ...]:
    """The suffixes matplotlib writes (:data:`PLOT_SUFFIXES` without it)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return PLOT_SUFFIXES
    return tuple(f".{k}" for k in FigureCanvasBase.get_supported_filetypes())


def _check_plot_suffix(parser: argparse.ArgumentParser, option: str, path: pathlib.Path) -> None:
    """``parser.error`` where ``path`` does not end in a suffix matplotlib writes
    (:func:`plot_suffixes`; its ValueError after the measuring before; found by
    probing)."""
    suffixes = plot_suffixes()
    if path.suffix.lower() not in suffixes:
        what = f"ends in {path.suffix}" if path.suffix else "has no suffix"
        parser.error(f"argument {option}: {str(path)!r} {what}, which matplotlib does not "
                     f"write: pass a path ending in {', '.join(suffixes)}")  # fmt: skip


def _refuse_a_link(parser: argparse.ArgumentParser, option: str, path: pathlib.Path) -> None:
    """``parser.error`` where ``path`` is a symbolic link to a file or to nothing yet: the
    output was written through it into the file it named (found by probing). A link to
    something else (``/dev/stdout``) is written to as before (found by review)."""
    if path.is_symlink() and (path.is_file() or not path.exists()):
        parser.error(f"argument {option}: {str(path)!r} is a symbolic link to a file: "
                     "remove it or pass another path")  # fmt: skip


def replotted_inputs(from_json: str | None, json_out: str | None) -> tuple[str, ...]:
    """The ``inputs`` for :func:`check_outputs` of a run that rebuilds its table from
    ``from_json``: the file read, but none where ``--json`` names that same file outside
    ``bench/results/`` (replotting one's last run in ``bench-out/`` in place, which the
    input check had refused; found by review). Over a committed result it stays refused:
    its table and plot are committed beside it."""
    if not from_json:
        return ()
    read = pathlib.Path(from_json).resolve()
    same = bool(json_out) and pathlib.Path(json_out).resolve() == read
    committed = (ROOT / "bench" / "results").resolve() in read.parents
    return () if same and not committed else (from_json,)


def read_saved(
    parser: argparse.ArgumentParser,
    option: str,
    path: str,
    keys: tuple[str, ...],
    row_keys: tuple[str, ...] = (),
    measured_keys: tuple[str, ...] = (),
):
    """The JSON a script's ``--from-json`` rebuilds its table from: ``parser.error`` (exit
    status 2, one line naming the option) where the file is missing or unreadable, is not
    JSON, or is not what the script writes (a dict with ``keys``; with ``keys`` empty, a
    list of row dicts). A traceback came there before (found by probing). With
    ``row_keys`` (and ``measured_keys``, which a row without ``"error"`` needs too), each
    row (``data["rows"]``, or the list itself) must hold the keys the table and plot
    read: a row without one was a KeyError after the checks (found by probing)."""
    file = pathlib.Path(path).expanduser()
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        parser.error(f"argument {option}: {path!r}: no such file")
    except IsADirectoryError:
        parser.error(f"argument {option}: {path!r} is a directory")
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"argument {option}: cannot read {path!r}: {exc}")
    except json.JSONDecodeError as exc:
        parser.error(f"argument {option}: {path!r} is not JSON ({exc})")
    if keys:
        ok = isinstance(data, dict) and all(key in data for key in keys)
        want = f"an object with keys {', '.join(keys)}"
    else:
        ok = isinstance(data, list) and all(isinstance(row, dict) for row in data)
        want = "a list of rows"
    if not ok:
        parser.error(f"argument {option}: {path!r} is not {want}, as this script's --json "
                     "writes")  # fmt: skip
    if row_keys or measured_keys:
        _check_rows(parser, option, path, data["rows"] if keys else data, row_keys,
                    measured_keys)  # fmt: skip
    from chunkscan.commands.measure import from_strict_json

    # A row's own values "nan" and "inf" (as write_json writes them) as floats; not
    # strings elsewhere, such as the argv in meta (an argv holding "nan" read as a float
    # stopped the replot; review, session 49)
    rows = [
        {k: from_strict_json(v) if isinstance(v, str) else v for k, v in row.items()}
        for row in (data["rows"] if keys else data)
    ]
    return dict(data, rows=rows) if keys else rows


def _check_rows(parser, option: str, path: str, rows, row_keys, measured_keys) -> None:
    """``parser.error`` naming the file, the row and the key where a row of ``rows`` is
    not an object or lacks a key of ``row_keys`` (or, with no ``"error"``, of
    ``measured_keys``)."""
    if not isinstance(rows, list):
        parser.error(f"argument {option}: {path!r}: its rows are not a list, as this "
                     "script's --json writes")  # fmt: skip
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            parser.error(f"argument {option}: {path!r}: row {i} is not an object, as this "
                         "script's --json writes")  # fmt: skip
        need = row_keys + (measured_keys if "error" not in row else ())
        missing = [key for key in need if key not in row]
        if missing:
            parser.error(f"argument {option}: {path!r}: row {i} has no key {missing[0]!r}, "
                         "as this script's --json writes")  # fmt: skip


def cuda_missing(script: str, mlx: bool = True, torch: bool = False) -> str | None:
    """What a CUDA-only script prints before it returns 2 on a machine without what it
    needs (one line; None where all is there): MLX with a CUDA GPU as the default device
    (``mlx``), PyTorch with CUDA (``torch``). The scripts gave a Python traceback there
    (found by probing); ``bench/state_pass.py`` and ``bench/tc_probe.py`` print the same
    line."""
    if mlx:
        import mlx.core as mx

        try:
            ok = bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
        except AttributeError:  # an MLX without the CUDA module (Metal)
            ok = False
        if not ok:
            return f"[{script}] needs MLX with a CUDA GPU as the default device."
    if torch:
        try:
            import torch as torch_
        except ImportError:
            return f"[{script}] needs PyTorch with CUDA; PyTorch is not installed."
        if not torch_.cuda.is_available():
            return f"[{script}] needs PyTorch with CUDA; torch.cuda.is_available() is False."
    return None


def stop_without_cuda(script: str, mlx: bool = True, torch: bool = False) -> bool:
    """Print :func:`cuda_missing`'s line and return True where it has one (the script
    then returns 2); False where all is there."""
    why = cuda_missing(script, mlx=mlx, torch=torch)
    if why:
        print(why)
    return why is not None


def meta(script: str | None = None, argv: list[str] | None = None, **extra: Any
         ) -> dict[str, Any]:  # fmt: skip
    """:func:`chunkscan.commands.measure.provenance` (argv, commit, date, device,
    versions), its ``argv`` the one the script's ``main(argv)`` parsed where ``script``
    (its ``__file__``) is given: ``["python", "bench/<script>.py", *argv]``, ``argv``
    ``sys.argv[1:]`` where None, as ``python bench/<script>.py ...`` runs it.
    ``provenance`` records ``sys.argv``: a ``main(argv)`` called in-process (by a test,
    by another script) recorded its caller's command line (found by probing). Plus
    ``scripts_commit`` where the benchmark scripts' checkout is not chunkscan's or
    differs from it (:func:`~chunkscan.commands.measure.git_commit` of this file: a
    clone's edited script, run with another checkout's chunkscan, recorded that
    checkout's clean commit; found by probing), plus ``extra``. With
    ``CHUNKSCAN_COMMIT`` set too (a copied ``src/`` measured, as bench/results/README.md
    describes): ``scripts_commit`` was dropped there (found by probing, session 50); it
    is kept where git knows the scripts and their commit or state is not the one
    ``commit`` names (on the device, where the copied tree carries the checkout's git
    metadata, that is the session's start, as ``git_commit`` records it)."""
    from chunkscan.commands.measure import git_commit, provenance

    out = provenance(_CODE_AT_START)
    if "git_commit_after" in out:
        print(f"{pathlib.Path(script or sys.argv[0]).name}: the checkout changed during the run "
              f"({_CODE_AT_START} before, {out['git_commit_after']} after): its rows may "
              "measure either; run it again", file=sys.stderr)  # fmt: skip
    if script is not None:
        ran = sys.argv[1:] if argv is None else argv
        out["argv"] = ["python", f"bench/{pathlib.Path(script).name}", *ran]
    scripts = git_commit(str(pathlib.Path(__file__).resolve()))
    if scripts == "unknown" and os.environ.get("CHUNKSCAN_COMMIT"):
        return {**out, **extra}  # (the device: nothing known of the scripts' checkout)
    elsewhere = _checkout(__file__) != _checkout(chunkscan_src())
    if _names_another(scripts, out["commit"]) or elsewhere:
        out["scripts_commit"] = f"{scripts} ({ROOT})"
    return {**out, **extra}


def _code_at_start() -> str | None:
    """The commit of the chunkscan measured (``code_commit()``), read as a script starts
    (its argument parser imports this module), for :func:`meta` to record it, not the one
    read after measuring: a commit made while a CPU run measured was credited with every
    row (noted in sessions 51 and 52). ``None`` in the measuring processes, which record
    nothing."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == "chunkscan.commands.measure":
        return None
    from chunkscan.commands.measure import code_commit

    return code_commit()


def _names_another(scripts: str, commit: str) -> bool:
    """Whether ``scripts`` (``git_commit``'s: a full hash, ``+dirty`` where changed) is
    another commit or state than ``commit`` names (``CHUNKSCAN_COMMIT`` may give a short
    hash), as ``provenance`` tells its ``git_commit`` apart."""
    head, _, state = scripts.partition("+")
    given, _, given_state = commit.partition("+")
    return not (given and head.startswith(given)) or state != given_state


def _checkout(path: str) -> str | None:
    """The top folder of the git checkout holding ``path``, or ``None``."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=pathlib.Path(path).resolve().parent,
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def add_save_option(p) -> None:
    """``--save``: what chunkscan's forward keeps for the backward (the op's
    ``save_states``), one configuration per mode given; default: the op's."""
    from chunkscan.ops.gated_delta.chunk import SAVE_MODES

    p.add_argument(
        "--save",
        nargs="+",
        action=Once,
        default=[None],
        choices=SAVE_MODES,
        help="chunkscan only: what the forward keeps for the backward, every chunk's "
        "entering state or each group's (recomputed per chunk in the backward); default: "
        "the op's",
    )


def gdn_chunking(q, k, v, g, beta, chunk_size: int | None = None, kernels: bool | None = None):
    """How :func:`chunkscan.gated_delta_rule` cuts these inputs into chunks (its
    ``_Chunking``: ``.C`` the chunk it runs at, ``.N`` the chunks), as the op decides: a
    ``chunk_size`` of None is the op's default, a chunk is cut to ``T``, rounded up to whole
    sub-chunks of 8 for a per-channel gate and, on the fused CUDA path, to a size the
    kernels take. The scripts recorded the size asked for, which the op had not run at
    (``chunk_size: 32`` at T = 16; found by probing). (``bench/gdn_phases.py`` builds
    its ``_Chunking`` without the fused sizes: on CUDA with T below a chunk its ``C`` can
    differ.)"""
    from chunkscan.ops.gated_delta import _passes
    from chunkscan.ops.gated_delta import chunk as op
    from chunkscan.ops.gated_delta._checks import check_inputs

    if chunk_size is None:
        chunk_size = op.default_chunk_size(kernels, q.shape[-1], v.shape[-1])
    spec = check_inputs("bench", q, k, v, g, beta, None, None, chunk_size, None)
    cuda = _passes.use_kernels(kernels, "gated_delta_rule")
    return op._Chunking(spec, op._fused_sizes(spec, cuda))


def write_json(path: str | pathlib.Path, meta_: dict[str, Any], rows: list[dict]) -> None:
    """``{"meta": meta_, "rows": rows}`` as strict JSON: a non-finite float is written as
    the string ``"nan"``, ``"inf"`` or ``"-inf"`` (a bare ``NaN`` before, which strict
    parsers such as jq refuse; :func:`read_saved` reads them back as floats)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text({"meta": meta_, "rows": rows}) + "\n")


def json_text(value: Any, indent: int = 1) -> str:
    """``value`` as strict JSON text, each non-finite float as its name (``"nan"``, ...;
    :func:`chunkscan.commands.measure.strict_json`), for every result file a script
    writes."""
    from chunkscan.commands.measure import strict_json

    return json.dumps(strict_json(value), indent=indent, allow_nan=False)


def chunkscan_src() -> str:
    """The folder that holds the ``chunkscan`` this process imports (``src`` of the
    checkout it comes from): the measuring processes import the same copy, the one whose
    commit :func:`meta` records. Putting this checkout's ``src`` first instead measured
    one copy and recorded another's commit where chunkscan came from elsewhere (an
    editable install of another checkout; found by probing). Run a checkout's own
    sources with ``PYTHONPATH=<checkout>/src``."""
    import importlib

    return str(pathlib.Path(importlib.import_module("chunkscan").__file__).resolve().parents[1])


def import_test_helpers():
    """``tests/helpers.py`` of the checkout whose chunkscan this process imports (its
    ``fake_fused_kernels``), else of the checkout beside this script. The scripts took
    the folder beside themselves only, so a copy of ``bench/`` run elsewhere stopped
    at ``No module named 'helpers'`` (found by probing)."""
    import importlib

    here = pathlib.Path(__file__).resolve().parents[1]
    for root in (pathlib.Path(chunkscan_src()).parent, here):
        if (root / "tests" / "helpers.py").is_file():
            if str(root / "tests") not in sys.path:
                sys.path.insert(0, str(root / "tests"))
            return importlib.import_module("helpers")
    raise SystemExit(
        f"this script fakes the CUDA kernels with tests/helpers.py of a chunkscan checkout, "
        f"but neither {chunkscan_src()} nor {here} is in one. Run it with a checkout's "
        f"sources: PYTHONPATH=<checkout>/src."
    )


def child_env(bench: bool = False) -> dict[str, str]:
    """``PYTHONPATH`` for measuring processes (started by
    :func:`chunkscan.commands.measure.run_isolated`, which puts :func:`chunkscan_src`'s
    folder first itself): the checkout's root (and ``bench/``, for targets named by
    their bench module, with ``bench=True``)."""
    parts = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    if bench:
        parts.insert(0, str(ROOT / "bench"))
    return {"PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def empty_kernel_caches(folder: str) -> dict[str, str]:
    """Environment for a process whose kernel caches start empty under ``folder``: the
    CPU backend compiles its fused kernels under ``TMPDIR`` (``<TMPDIR>/mlx/<version>
    /cpu``, one library each), CUDA its PTX under ``MLX_PTX_CACHE_DIR``, chunkscan its
    CUDA kernels under ``CHUNKSCAN_CUDA_CACHE`` (``chunkscan._precompile``)."""
    return {"TMPDIR": folder, "MLX_PTX_CACHE_DIR": f"{folder}/ptx",
            "CHUNKSCAN_CUDA_CACHE": f"{folder}/chunkscan"}  # fmt: skip


def kernels_compiled(folder: str | pathlib.Path) -> int:
    """Kernels compiled under ``folder`` (see :func:`empty_kernel_caches`): one ``.so``
    each on the CPU backend, one ``.ptx`` each by MLX on CUDA, one ``.cubin`` (or
    ``.ptx``) each by chunkscan."""
    suffixes = (".so", ".ptx", ".cubin")
    return sum(1 for p in pathlib.Path(folder).rglob("*") if p.suffix in suffixes)


def plot_time_and_memory(
    rows: list[dict[str, Any]],
    path: str | pathlib.Path,
    title: str,
    impls: tuple[str, ...],
    time_key: str,
    time_label: str,
    memory_label: str = "peak above inputs (KiB / token)",
) -> None:
    """Two log-log panels against ``T``: ``row[time_key]`` and ``row["kib_per_token"]``,
    one line per ``impl`` and, where rows record one, ``save`` mode (one line of both
    modes zigzagged between them; found by probing) and ``scratch_mib`` (attention's
    several budgets: the same, found by review), rows with an error skipped. No plot
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))

    def line_of(r: dict[str, Any]) -> tuple:
        return r["impl"], r.get("save"), r.get("scratch_mib")

    lines = dict.fromkeys(line_of(r) for r in rows if r["impl"] in impls)
    lines = sorted(lines, key=lambda line: impls.index(line[0]))  # (stable: saves in order)
    for line, style in zip(lines, itertools.cycle(("o-", "s--", "^:", "D-."))):
        # by T alone: rows of one T (of another save mode) compared their dicts, a
        # TypeError that kept two committed results from rebuilding (found by review)
        pts = sorted(((r["T"], r) for r in rows if line_of(r) == line and time_key in r),
                     key=lambda p: p[0])  # fmt: skip
        if not pts:
            continue
        Ts = [t for t, _ in pts]
        impl, save, scratch = line
        label = impl + ("" if save is None else f" (save={save})")
        label += "" if scratch is None else f" ({scratch:g} MiB scratch)"
        ax_t.plot(Ts, [r[time_key] for _, r in pts], style, label=label, mfc="none")
        ax_m.plot(Ts, [r["kib_per_token"] for _, r in pts], style, label=label, mfc="none")
    for ax, ylabel in ((ax_t, time_label), (ax_m, memory_label)):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_side_by_side_options(p: argparse.ArgumentParser, impls: tuple[str, ...], T: list[int],
                             name: str) -> None:  # fmt: skip
    """The options of a side-by-side script (:func:`run_side_by_side`): ``--T``,
    ``--impls``, ``--dtype``, ``--repeats``, ``--timeout``, ``--json`` and ``--md``
    (``bench-out/<name>.{json,md}`` by default)."""
    p.add_argument("--T", type=positive_int, nargs="+", action=Once, default=T)
    p.add_argument("--impls", nargs="+", action=Once, default=list(impls), choices=impls)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="seconds per configuration")  # fmt: skip
    p.add_argument("--json", default=str(OUT / f"{name}.json"))
    p.add_argument("--md", default=str(OUT / f"{name}.md"))


def add_chunk_size_option(p: argparse.ArgumentParser) -> None:
    """``--chunk-size``: chunkscan's chunk instead of the op's default
    (:func:`patch_chunkscan`)."""
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="chunkscan's chunk (default: the op's)")  # fmt: skip


def patch_chunkscan(impl: str, op_module, chunk_size: int | None) -> int | None:
    """For ``impl == "chunkscan"``: ``chunkscan.mlx_lm.patch()`` for the rest of this
    process (a ``measure`` runs in its own), and ``op_module.default_chunk_size`` (the
    op's ``chunk`` module) replaced by ``chunk_size`` where given, so that the seam's calls
    take it. Returns the chunk the op takes, ``None`` for the other impls."""
    if impl != "chunkscan":
        return None
    import chunkscan.mlx_lm

    chunkscan.mlx_lm.patch()
    if chunk_size:
        op_module.default_chunk_size = lambda: chunk_size
    return op_module.default_chunk_size()


def grad_call(loss, *inputs):
    """A ``call()`` returning ``mx.value_and_grad(loss)`` at ``inputs``, the gradients
    of every input (what :func:`routed_row` times)."""
    import mlx.core as mx

    grad = mx.value_and_grad(loss, argnums=tuple(range(len(inputs))))
    return lambda: grad(*inputs)


def side_by_side_table(rows: list[dict[str, Any]], baseline: str) -> str:
    """A markdown table of :func:`run_side_by_side`'s rows (a chunk column, the chunk
    run, where any row records a ``chunk_size``)."""
    chunk = any(r.get("chunk_size") for r in rows)
    head = ["impl", "T"] + (["chunk"] if chunk else []) + ["fwd+bwd (s)", "peak (KiB/token)",
                                                           f"speedup vs {baseline}"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        ran = r.get("chunk_run", r.get("chunk_size"))  # (rows before chunk_run: as asked)
        cells = [r["impl"], str(r["T"])] + ([str(ran or "")] if chunk else [])
        if "error" in r:
            cells += [r["error"], "", ""]
        else:
            sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
            cells += [f"{r['seconds']:.3f}", f"{r['kib_per_token']:.1f}", sp]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exit_status(rows: list[dict[str, Any]], script: str) -> int:
    """A measuring run's exit status: 1, saying so on stderr, where every row is an
    error (each configuration failed, timed out or was skipped: nothing was measured),
    else 0. Every such run exited 0 (found by probing, session 49), so a batch of runs
    could not tell one that measured nothing; rows that failed beside measured ones are
    results (a baseline out of memory at a large T) and keep the status 0."""
    if rows and all("error" in r for r in rows):
        print(f"{script}: every configuration failed (their errors above): nothing was "
              "measured", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def run_side_by_side(parser, args, target: str, config: dict[str, Any], title: str,
                     baseline: str, script: str | None = None,
                     argv: list[str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Measure ``target`` (``"bench.<script>:measure"``) for each ``--T`` and ``--impls``
    in a fresh process, ``config`` added to each configuration; print each row, add each
    one's ``speedup`` against ``baseline``'s row at its T, print and write the table
    (``--md``) and the rows (``--json``, with :func:`meta` of ``script`` and the ``argv``
    its main parsed). Returns the rows."""
    from chunkscan.commands.measure import run_isolated

    check_outputs(parser, {"--json": args.json, "--md": args.md}, optional=("--json", "--md"))
    rows = []
    for T in dict.fromkeys(args.T):  # each T once
        for impl in args.impls:
            cfg = {"impl": impl, "T": T, "dtype": args.dtype, "repeats": args.repeats, **config}
            # bench/ on the path: the targets import this module (routed_row)
            row = run_isolated(target, cfg, timeout=args.timeout, env=child_env(bench=True))
            row.update({k: v for k, v in cfg.items() if k not in row})
            rows.append(row)
            print(row.get("error") or f"{impl:>10} T={T:>6}: {row['seconds']:8.3f} s "
                  f"{row['kib_per_token']:9.1f} KiB/token", flush=True)  # fmt: skip
    stock = {r["T"]: r for r in rows if r["impl"] == baseline and "error" not in r}
    for r in rows:
        if r["T"] in stock and "error" not in r:
            r["speedup"] = stock[r["T"]]["seconds"] / r["seconds"]
    md = f"{title}\n\n{side_by_side_table(rows, baseline)}\n"
    print()
    print(md)
    if args.json:
        write_json(args.json, meta(script, argv), rows)
    if args.md:
        pathlib.Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.md).write_text(md)
    return rows


def routed_row(impl: str, T: int, call, routed: str | None, repeats: int,
               fields: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The row of a side-by-side ``measure`` (:func:`run_side_by_side`): one warm-up
    ``call()``; where ``routed`` names a key of ``chunkscan.mlx_lm.routed_calls``, the
    check that the ``chunkscan`` impl's call went through the seam once and mlx-lm's
    not at all; then the peak above the active memory and the median of ``repeats``
    warm calls, with ``fields`` (the configuration) first and, where it has a
    ``chunk_size``, ``chunk_run``: the chunk the op ran at, ``T`` where that is shorter
    (the ops scan whole chunks of ``min(chunk_size, T)``; the rows said 64 at T = 16;
    found by probing)."""
    import mlx.core as mx

    import chunkscan.mlx_lm
    from chunkscan.commands.measure import median_seconds, peak_above_active

    mx.eval(call())  # warm-up
    if routed is not None:
        calls = chunkscan.mlx_lm.routed_calls[routed]
        assert calls == (1 if impl == "chunkscan" else 0), calls
    _, peak = peak_above_active(call)
    seconds = median_seconds(call, repeats=repeats, warmup=0)
    if fields.get("chunk_size"):
        fields = {**fields, "chunk_run": min(fields["chunk_size"], T)}
    return {"impl": impl, "T": T, **fields, "seconds": seconds, "peak_bytes": peak,
            "kib_per_token": peak / 1024.0 / T, "device": str(mx.default_device())}  # fmt: skip


def randomize_zeros(module, scale: float) -> None:
    """Give the parameters ``module`` initializes to zero random values (``scale`` times
    a normal draw from MLX's global key): mlx-lm's RWKV-7 and RG-LRU layers start with
    zero mixes and gates, which leave parts of their recurrences unexercised."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    zeros = [(k, v) for k, v in tree_flatten(module.parameters()) if not mx.any(v != 0).item()]
    module.update(tree_unflatten([(k, scale * mx.random.normal(v.shape)) for k, v in zeros]))


_CODE_AT_START = _code_at_start()  # (a module-level read: see _code_at_start)
