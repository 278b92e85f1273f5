"""``chunkscan lora``: ``mlx_lm.lora`` under :func:`chunkscan.mlx_lm.patch` (the chunked
recurrences and attention).

Runs mlx-lm's own LoRA command (its parser, defaults, data loading, trainer and
adapter saving) inside :func:`chunkscan.mlx_lm.patch`, so the Gated DeltaNet layers
of Qwen3-Next / Qwen3.5 models train through :func:`chunkscan.gated_delta_rule`, the
attention layers of every model that calls mlx-lm's ``scaled_dot_product_attention``
through :func:`chunkscan.attention`, and their memory per token stays flat. Every
``mlx_lm.lora`` flag is accepted, plus:

- ``--gdn-chunk-size N`` (YAML key ``gdn_chunk_size``): steps per chunk of
  :func:`chunkscan.gated_delta_rule` in the Gated DeltaNet layers (default:
  :func:`op_default_chunk_size`); the resolved value is saved in ``adapter_config.json``.
  ``--scan-chunk-size`` / ``scan_chunk_size`` are deprecated aliases (they warn).
- ``--demo``: build a tiny random Qwen3-Next model, tokenizer and data set in a
  temporary directory (no network) and train a few steps on it; other flags still
  apply (e.g. ``chunkscan lora --demo --iters 5``); ``--model``/``--data`` paths that
  do not exist yet are written there instead, and kept. The demo never writes into a
  directory it did not create (it marks its own with a ``.chunkscan-demo`` file): an
  existing ``--model`` folder with a ``config.json`` (or ``--data`` folder with a
  ``train.jsonl``) is used as it is, any other existing folder is refused; so is an
  existing ``--adapter-path`` folder it did not make (training would replace the
  adapters there with ones of a model deleted at exit; found by probing).

Settings merge as in ``mlx_lm.lora``: command line > YAML (``-c``) > defaults. Before
anything is loaded, the command checks that there is something to do (``--train`` or
``--test``) and that ``--model`` and ``--data`` name an existing folder or a Hugging
Face repo id (``namespace/name``), that every data file there reads as mlx-lm reads it
(one JSON example per line, none blank, each with the first line's keys:
:func:`_read_examples`) and none is empty, that the numbers
mlx-lm takes unchecked are in range (``--batch-size``, ``--iters``, ``--num-layers``,
``--val-batches``, ``--learning-rate``, ...: :data:`_WHOLE_NUMBERS`; ``--batch-size -2``
hung mlx-lm for ever, ``--num-layers 0`` trained every layer; ``--iters`` at least
``--grad-accumulation-steps``), that an ``lr_schedule`` builds, its rate within
``--learning-rate``'s bounds at every step up to ``--iters``, and ``--report-to`` names
installed services, that the YAML file parses and that a ``--resume-adapter-file`` comes
with ``--train`` (one from ``-c`` without it: a warning that it is not read), loads,
and has this run's fine-tune type, rank and scale, its layers and projections among
those this run wraps (:func:`_check_resumed_adapters`), and says
what is wrong; a failed Hub download is reported in one line, not as a traceback. Once
the model is wrapped, a resumed file's tensors must all name its parameters, with their
shapes (:func:`_check_resumed_weights_fit`); after training, the saved adapters must be
finite (:func:`_check_saved_adapters`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import pathlib
import re
import stat
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .._backend import plain_int
from .._tree import with_article
from ..ops.gated_delta.chunk import SAVE_MODES
from ..split import check_chunk_size
from ._stdout import guarded_stdout, say

MiB = 1024.0 * 1024.0

DEMO_DEFAULTS = {
    "train": True,
    "iters": 30,
    "batch_size": 2,
    "num_layers": -1,
    "learning_rate": 2e-3,
    "max_seq_length": 512,
    "steps_per_report": 5,
    "steps_per_eval": 30,
    "val_batches": 2,
    "save_every": 1000,
}


# What chunkscan lora uses of mlx_lm.lora (mlx-lm 0.32.x): a release without one of these
# ended in an AttributeError after the banner (found by probing).
_LORA_NAMES = ("build_parser", "CONFIG_DEFAULTS", "yaml", "yaml_loader", "run",
               "get_reporting_callbacks")  # fmt: skip


def _mlx_lm_lora():
    try:
        import mlx_lm.lora as lora
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(
            f"chunkscan lora needs mlx-lm >= 0.32.2 (Python >= 3.11; pip install "
            f"'chunkscan[lm]'): {e}"
        ) from e
    missing = [name for name in _LORA_NAMES if not hasattr(lora, name)]
    if missing:
        import mlx_lm

        raise SystemExit(
            f"chunkscan lora: mlx_lm.lora {getattr(mlx_lm, '__version__', '?')} has no "
            f"{', '.join(missing)}, which chunkscan lora wraps (written for mlx-lm 0.32.x). "
            f"Install mlx-lm 0.32.x (pip install 'mlx-lm>=0.32.2,<0.33'), or train with "
            f"chunkscan.mlx_lm.patch() around your own mlx-lm code."
        )
    return lora


def op_default_chunk_size() -> int:
    """The ``chunk_size`` :func:`chunkscan.gated_delta_rule` uses when given none, for
    head sizes ``Dk = Dv = 128`` on this machine (:func:`default_chunk_size`'s defaults:
    32 on a CPU, 64 on an Apple GPU; on a CUDA GPU 32, 64 or 128, depending on the fused
    kernels)."""
    from ..ops.gated_delta.chunk import default_chunk_size

    return default_chunk_size()


PROG = "chunkscan lora"
_OLD_FLAG, _OLD_KEY = "--scan-chunk-size", "scan_chunk_size"


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"{PROG}: {old} is deprecated (it sets the Gated DeltaNet op's chunk, not a scan's); "
        f"use {new}.",
        FutureWarning,
        stacklevel=2,
    )


def _chunk_size_arg(text: str) -> int:
    """argparse ``type`` of ``--gdn-chunk-size``: :func:`chunkscan.split.check_chunk_size`."""
    try:  # ASCII digits only: int() read 1_6 as 16, and other scripts' digits (probing)
        value: object = plain_int(text)
    except ValueError:
        value = text
    try:
        return check_chunk_size(PROG, value, example=op_default_chunk_size())
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_arg(parse):
    """``parse`` (mlx-lm's ``_parse_size``: "512", "1.5G", "100MB") as an argparse type:
    its ``decimal.InvalidOperation`` or ``KeyError`` for "abc" or "-5" came out of
    argparse as a traceback (found by probing)."""

    def size(text: str) -> int:
        try:
            value = parse(text)
        except Exception:  # noqa: BLE001 (any of mlx-lm's parse errors)
            value = None
        if not isinstance(value, int) or value < 0:
            raise argparse.ArgumentTypeError(
                f"must be a size in bytes such as 512, 100MB or 1.5G, not {text!r}"
            )
        return value

    return size


class _GdnChunkSize(argparse.Action):
    """Stores ``--gdn-chunk-size``; warns when it is given as ``--scan-chunk-size``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == _OLD_FLAG:
            _warn_renamed(_OLD_FLAG, "--gdn-chunk-size")
        setattr(namespace, self.dest, values)


def build_parser():
    """``mlx_lm.lora.build_parser()`` plus ``--gdn-chunk-size``, ``--gdn-save-states``
    and ``--demo``."""
    parser = _mlx_lm_lora().build_parser()
    parser.prog = PROG
    parser.description = (
        "LoRA or QLoRA finetuning (mlx_lm.lora) under chunkscan.mlx_lm.patch(): the "
        "recurrences of Gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi Linear / K3, "
        "Olmo hybrid, Bailing MoE V3), Lightning attention (Bailing), Mamba / Mamba2 / "
        "Jamba and RWKV-7, and "
        "softmax attention, trained through chunkscan's ops in memory that does not grow "
        "with the sequence."
    )
    # mlx_lm.lora gives these two a non-None default, so their YAML keys never
    # apply; None restores CLI > YAML > defaults (CONFIG_DEFAULTS has both).
    parser.set_defaults(clear_cache_threshold=None, trust_remote_code=None)
    for action in parser._actions:
        if action.dest == "clear_cache_threshold" and action.type is not None:
            action.type = _size_arg(action.type)  # mlx-lm's raises decimal's errors
            # mlx_lm.lora never passes it to training (docs/mlx_lm.md; found by probing)
            action.help = (action.help or "") + " (No effect in mlx-lm 0.32.2's training.)"
        if action.dest == "optimizer" and action.choices:  # its help left muon out
            action.help = f"Optimizer to use for training: {', '.join(action.choices)}."
    parser.add_argument(
        "--gdn-chunk-size",
        _OLD_FLAG,
        dest="gdn_chunk_size",
        type=_chunk_size_arg,
        action=_GdnChunkSize,
        default=None,
        metavar="N",
        help="Steps per chunk of chunkscan.gated_delta_rule in Gated DeltaNet layers "
        f"(default: {op_default_chunk_size()} on this machine: "
        "chunkscan.ops.gated_delta.default_chunk_size() for heads of 128, which is 32 on "
        "a CPU, 64 on an Apple GPU and 32, 64 or 128 on a CUDA GPU; "
        f"{_OLD_FLAG} is a deprecated alias).",
    )
    parser.add_argument(
        "--gdn-save-states",
        dest="gdn_save_states",
        choices=SAVE_MODES,
        default=None,
        help="What chunkscan.gated_delta_rule keeps for the backward: one state per group "
        "of chunks ('groups', the default: less memory over many layers) or per chunk "
        "('chunks': a slightly faster backward).",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        default=None,
        help="Train a tiny random Qwen3-Next model on synthetic data (offline).",
    )
    return parser


def resolve_args(argv: list[str], demo_dir: str | None = None) -> types.SimpleNamespace:
    """Parse ``argv`` and merge YAML, demo and ``mlx_lm.lora`` defaults."""
    lora = _mlx_lm_lora()
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    given = {k for k, v in args.items() if v is not None}  # the command line's
    if args.get("config"):
        args["config"] = os.path.expanduser(args["config"])  # '~/x.yaml' unread (probing)
        try:
            with open(args["config"]) as f:
                config = lora.yaml.load(f, lora.yaml_loader) or {}
        except OSError as e:
            raise SystemExit(
                f"{PROG}: -c {args['config']}: the config file cannot be read "
                f"({e.strerror or e}). Pass the path of a YAML file."
            ) from None
        except lora.yaml.YAMLError as e:  # a traceback before (found by probing)
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise SystemExit(
                f"{PROG}: -c {args['config']}: the config file is not valid YAML{at} "
                f"({getattr(e, 'problem', None) or type(e).__name__}). Fix it, or pass "
                f"another file."
            ) from None
        config = _check_config(args["config"], config, args, lora.CONFIG_DEFAULTS)
        _check_config_values(args["config"], config, parser, args)
        if _OLD_KEY in config:
            _warn_renamed(f"the YAML key {_OLD_KEY}", "gdn_chunk_size")
            config.setdefault("gdn_chunk_size", config.pop(_OLD_KEY))
        for k, v in config.items():
            if args.get(k) is None:
                args[k] = v
        _unread_resume_from_config(args, given)
    if args.get("demo") and demo_dir is not None:
        demo = dict(DEMO_DEFAULTS)
        demo["model"] = str(pathlib.Path(demo_dir, "model"))
        demo["data"] = str(pathlib.Path(demo_dir, "data"))
        demo["adapter_path"] = str(pathlib.Path(demo_dir, "adapters"))
        for k, v in demo.items():
            if args.get(k) is None:
                args[k] = v
    defaults = dict(lora.CONFIG_DEFAULTS, gdn_chunk_size=op_default_chunk_size(),
                    gdn_save_states="groups", demo=False)  # fmt: skip
    for k, v in defaults.items():
        if args.get(k) is None:
            args[k] = v
    try:  # a YAML value has not been through the parser's check
        check_chunk_size(PROG, args["gdn_chunk_size"], example=op_default_chunk_size())
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{PROG}: gdn_chunk_size (from -c {args.get('config')}): {e}") from None
    _check_numbers(args)
    _check_report_to(args)
    return types.SimpleNamespace(**args)


def _unread_resume_from_config(args: dict, given: set[str]) -> None:
    """A ``resume_adapter_file`` from ``-c`` (not in ``given``, the command line's) in a
    run that does not train is not read: mlx-lm reads it only when training, and runs a
    ``--test`` whose config names one. So it is not refused (that came with a message
    naming a flag the user never passed; found by review, session 50): a warning says
    it is not read, and it is dropped. ``--resume-adapter-file`` on the command line
    without ``--train`` is refused (:func:`_check_resumed_adapters`)."""
    resume = args.get("resume_adapter_file")
    if resume is None or "resume_adapter_file" in given:
        return
    train = args.get("train")
    if train is None:  # not set: the demo's default (it trains), else mlx-lm's (false)
        train = bool(args.get("demo")) and DEMO_DEFAULTS["train"]
    if train:
        return
    warnings.warn(
        f"{PROG}: resume_adapter_file {resume} (from -c {args['config']}) is read only "
        f"with --train (training resumes from it); this run does not train, so it is not "
        f"read (as in mlx_lm.lora).",
        UserWarning,
        stacklevel=3,
    )
    args["resume_adapter_file"] = None


def _check_report_to(args: dict) -> None:
    """``--report-to`` names services mlx-lm reports to, whose packages are installed:
    ``foo`` was mlx-lm's ``ValueError`` traceback, ``wandb`` without the package its
    ``ImportError`` (found by probing). Read as mlx-lm's ``get_reporting_callbacks``
    reads it (comma-separated, stripped, lower-cased), against its ``SUPPORT_CALLBACK``
    and the packages its module imported (``None`` where missing); read in any run."""
    value = args.get("report_to")
    if not isinstance(value, str) or not value:
        return
    try:
        from mlx_lm.tuner import callbacks
    except ImportError:  # pragma: no cover - mlx-lm without it: left to mlx-lm
        return
    known = getattr(callbacks, "SUPPORT_CALLBACK", None)
    if not isinstance(known, dict):
        return
    source = f" (from the command line or -c {args['config']})" if args.get("config") else ""
    for name in (item.strip().lower() for item in value.split(",") if item.strip()):
        if name not in known:
            raise SystemExit(
                f"{PROG}: --report-to {value}{source}: {name!r} is no service mlx-lm reports "
                f"to; it takes {', '.join(known)} (several: comma-separated)."
            )
        if hasattr(callbacks, name) and getattr(callbacks, name) is None:
            raise SystemExit(
                f"{PROG}: --report-to {value}{source}: the {name} package is not installed "
                f"(mlx-lm reports to {name} with it): pip install {name}, or leave out "
                f"--report-to."
            )


# The numbers mlx_lm.lora takes unchecked: the least each may be, the one other value
# it gives a meaning (-1: all), and whether only training reads it. Found by probing:
# --batch-size -2 hung for ever (no batch is ever made), --num-layers 0 trained every
# layer (mlx-lm's layers[-0:]), --iters 0 saved untrained adapters, --max-seq-length 1
# and --steps-per-report 0 ended in tracebacks. --val-batches 0 is left to mlx-lm: it
# skips validation (and reports its loss as nan).
# name: (least, another value allowed, the switch that reads it: None for any run)
_WHOLE_NUMBERS = {
    "batch_size": (1, None, None),
    "max_seq_length": (2, None, None),
    "test_batches": (1, -1, "test"),  # (refused in a training run that never reads it)
    "iters": (1, None, "train"),
    "grad_accumulation_steps": (1, None, "train"),
    "steps_per_report": (1, None, "train"),
    "steps_per_eval": (1, None, "train"),
    "save_every": (1, None, "train"),
    "num_layers": (1, -1, "train"),
    "val_batches": (0, -1, "train"),
    "seed": (0, None, None),  # numpy's seed, mlx_lm.lora.run's first line (probing)
}
_MAX_SEED = 2**32 - 1  # numpy's largest seed
_FLOAT32_MAX = float(mx.finfo(mx.float32).max)


def _check_numbers(args: dict) -> None:
    """Raise ``SystemExit`` naming the option where a number in :data:`_WHOLE_NUMBERS`
    (those only training reads, with ``--train``; ``--test-batches``, with ``--test``)
    or the learning rate (finite, not negative; read without an ``lr_schedule``) is out
    of range, before anything loads."""
    source = f" (from the command line or -c {args['config']})" if args.get("config") else ""
    for name, (least, other, switch) in _WHOLE_NUMBERS.items():
        if switch is not None and not args.get(switch):
            continue
        value = args.get(name)
        whole = _is_whole(value)
        if not whole or not (value >= least or value == other):
            also = f", or {other} for all" if other is not None else ""
            raise SystemExit(
                f"{PROG}: --{name.replace('_', '-')}{source} must be a whole number of at "
                f"least {least}{also}, not {value!r}."
            )
    seed = args.get("seed")
    if isinstance(seed, int) and seed > _MAX_SEED:
        raise SystemExit(f"{PROG}: --seed{source} must be at most 2**32 - 1, not {seed}.")
    if args.get("train"):
        _check_grad_accumulation(args["iters"], args["grad_accumulation_steps"], source)
    _check_lora_parameters(args)
    if args.get("train") and args.get("lr_schedule"):  # mlx-lm's test: its truth
        _check_lr_schedule(args["lr_schedule"], args.get("config"), args["iters"])
    if args.get("train") and not args.get("lr_schedule"):
        rate = args.get("learning_rate")
        if not _is_number(rate) or not 0 <= rate:
            raise SystemExit(
                f"{PROG}: --learning-rate{source} must be a number of at least 0, not {rate!r}."
            )
        # MLX's optimizers hold it as a float32: 1e39, finite to Python, was inf there,
        # and NaN adapters were saved, exit 0 (found by probing)
        if not rate <= _FLOAT32_MAX:
            raise SystemExit(
                f"{PROG}: --learning-rate{source} must be at most float32's largest value "
                f"({_FLOAT32_MAX:.7g}; MLX's optimizers hold it as a float32), not {rate!r}."
            )


def _check_lr_schedule(schedule: Any, config: str | None, iters: int) -> None:
    """With ``--train``, ``lr_schedule`` (YAML only) has the shape mlx-lm's
    ``build_schedule`` reads: a ``name`` of a schedule in ``mlx.optimizers.schedulers``,
    a list of ``arguments`` (its first the initial rate), optional ``warmup`` steps and
    ``warmup_init``; then it is built as mlx-lm builds it, and its rate at every step
    from 0 to ``iters`` must be within ``--learning-rate``'s bounds
    (:func:`_check_schedule_rates`). Found by probing: ``name: cosine`` (an
    ``AttributeError``) or no ``arguments`` (a ``KeyError``) failed after the model had
    loaded and mlx-lm had rewritten ``adapter_config.json``."""
    import inspect

    from mlx.optimizers import schedulers

    where = f"{PROG}: lr_schedule (from -c {config})"
    names = [n for n, f in vars(schedulers).items() if not n.startswith("_")
             and inspect.isfunction(f) and f.__module__ == schedulers.__name__]  # fmt: skip
    example = "{name: cosine_decay, arguments: [1.0e-5, 1000], warmup: 100}"
    if not isinstance(schedule, dict):
        raise SystemExit(f"{where} must be a mapping such as {example}, not {schedule!r}.")
    name = schedule.get("name")
    if name not in names:
        raise SystemExit(
            f"{where}: name must be one of mlx.optimizers.schedulers' "
            f"{', '.join(names)}, not {name!r}. Such as {example}."
        )
    arguments = schedule.get("arguments")
    if not isinstance(arguments, list) or not arguments:
        raise SystemExit(
            f"{where}: arguments must be the list of {name}'s arguments (the first, the "
            f"initial learning rate), not {arguments!r}. Such as {example}."
        )
    try:
        from mlx_lm.tuner.utils import build_schedule

        built = build_schedule(schedule)
        built(mx.array(0, mx.uint64)).item()  # (the errors of a call, said here)
    except Exception as e:  # noqa: BLE001 (any of the schedule's own errors)
        raise SystemExit(
            f"{where}: mlx-lm's build_schedule fails on {schedule!r} ({type(e).__name__}: "
            f"{e}). Give it the arguments mlx.optimizers.schedulers.{name} takes, and a "
            f"warmup of at least 1 step or none."
        ) from None
    _check_schedule_rates(built, iters, where)


def _check_schedule_rates(built: Callable, iters: int, where: str) -> None:
    """The rate of the schedule ``built`` at every step from 0 to ``iters`` is finite,
    at least 0 and at most float32's largest value (``--learning-rate``'s bounds); else
    ``SystemExit`` naming the first step outside them and its rate. Step 0 alone was
    read: a warmup hid a rate of inf (NaN mid-training), and a negative rate or a
    linear_schedule ending at 1e39 passed (found by review, session 50). Evaluated as
    the optimizer calls it (a ``uint64`` step; mlx's schedules take arrays), a block
    of steps at a time, so the memory stays bounded for any ``--iters``."""
    block = 1 << 20
    for start in range(0, iters + 1, block):
        steps = mx.arange(start, min(start + block, iters + 1), dtype=mx.uint64)
        rates = mx.broadcast_to(built(steps), steps.shape)
        bad = mx.logical_not(mx.isfinite(rates) & (rates >= 0))
        if bad.any().item():
            at = int(mx.argmax(bad).item())
            raise SystemExit(
                f"{where}: the learning rate at step {start + at} is "
                f"{rates[at].item():.7g}; at every step up to --iters {iters} it must be "
                f"finite, at least 0 and at most float32's largest value "
                f"({_FLOAT32_MAX:.7g}; MLX's optimizers hold it as a float32). Change the "
                f"schedule's arguments (or warmup_init)."
            )


def _check_grad_accumulation(iters: int, steps: int, source: str) -> None:
    """mlx-lm applies the summed gradients at the iterations that are multiples of
    ``--grad-accumulation-steps`` (``it % steps == 0`` in its ``train``): with fewer
    ``--iters`` no update ran and the untrained adapters were saved, exit 0 (found by
    probing); refused. Where ``--iters`` is no multiple, the last ``iters % steps``
    batches' gradients are never applied: a warning."""
    if iters < steps:
        raise SystemExit(
            f"{PROG}: --iters {iters} is less than --grad-accumulation-steps {steps}"
            f"{source}: mlx-lm updates the weights once every {steps} iterations, so this "
            f"run would update nothing and save untrained adapters. Pass --iters {steps} or "
            f"more (a multiple of {steps}), or a smaller --grad-accumulation-steps."
        )
    left = iters % steps
    if left:
        warnings.warn(
            f"{PROG}: --iters {iters} is not a multiple of --grad-accumulation-steps "
            f"{steps}{source}: the gradients of the last {left} iteration"
            f"{'s' if left > 1 else ''} are never applied (mlx-lm updates the weights at "
            f"every {steps}th). Pass --iters {iters - left} or {iters - left + steps} to use "
            f"every batch.",
            UserWarning,
            stacklevel=4,
        )


def _check_lora_parameters(args: dict) -> None:
    """With ``--train`` of LoRA or DoRA adapters, ``lora_parameters`` (a YAML file's
    replaces mlx-lm's defaults whole) holds ``rank``, ``scale`` and ``dropout``, which
    mlx-lm reads without a default: one left out was a ``KeyError`` after the model
    loaded (found by probing)."""
    if not args.get("train") or args.get("fine_tune_type") == "full":
        return
    source = f" (from -c {args['config']})" if args.get("config") else ""  # no flag sets it
    given = args.get("lora_parameters")
    if not isinstance(given, dict):
        raise SystemExit(
            f"{PROG}: lora_parameters{source} must be a mapping such as "
            f"{{rank: 8, scale: 20.0, dropout: 0.0}}, not {given!r}."
        )
    missing = [k for k in ("rank", "scale", "dropout") if k not in given]
    if missing:
        defaults = _mlx_lm_lora().CONFIG_DEFAULTS.get("lora_parameters", {})
        shown = ", ".join(f"{k}: {defaults[k]}" for k in missing if k in defaults)
        raise SystemExit(
            f"{PROG}: lora_parameters{source} lacks {' and '.join(map(repr, missing))}, "
            f"which mlx-lm reads without a default (a YAML lora_parameters replaces "
            f"mlx-lm's whole); add {shown or 'them'}."
        )
    # Their values, which mlx-lm takes as they are (found by probing): rank 0 trained
    # nothing and exited 0, scale .nan gave NaN adapters, exit 0; a negative rank,
    # dropout 1.5 or a key that is not a string failed after the model loaded.
    rank, scale, dropout = given["rank"], given["scale"], given["dropout"]
    problems = []
    if not (_is_whole(rank) and rank >= 1):
        problems.append(f"rank must be a whole number of at least 1, not {rank!r}")
    if not (_is_number(scale) and math.isfinite(scale)):
        problems.append(f"scale must be a finite number, not {scale!r}")
    if not (_is_number(dropout) and 0 <= dropout < 1):
        problems.append(f"dropout must be a number from 0 up to (not including) 1, not {dropout!r}")
    keys = given.get("keys")
    if keys is not None and not (
        isinstance(keys, list) and keys and all(isinstance(k, str) and k for k in keys)
    ):
        problems.append(
            f"keys must be a list of module names such as [self_attn.q_proj], not {keys!r}"
        )
    if problems:
        raise SystemExit(f"{PROG}: lora_parameters{source}: {'; '.join(problems)}.")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Keys mlx-lm reads from its options without a flag or a default of their own
# (mlx_lm/tuner/datasets.py, with getattr): the warning called them ignored (found by
# probing; without the feature names a dataset of other columns fails to load).
_MLX_LM_DATA_KEYS = frozenset(
    {"hf_dataset", "prompt_feature", "completion_feature", "text_feature", "chat_feature"}
)


def _check_config(path: str, config: Any, args: dict, defaults: dict) -> dict:
    """The YAML file's mapping, checked: its top level must be a mapping; a key spelled
    as its flag (``gdn-chunk-size`` for ``gdn_chunk_size``) raises, since it would be
    ignored (mlx-lm's merge matches keys exactly); any other key no option knows (nor
    :data:`_MLX_LM_DATA_KEYS`) is ignored by mlx-lm too, with a warning here. A switch
    (``demo``, and mlx-lm's whose default is ``false``: ``train``, ``test``, ...) must not
    be a string: a quoted ``"no"`` read as true (``demo: "no"`` ran the demo with its
    settings; found by probing)."""
    if not isinstance(config, dict):
        raise SystemExit(
            f"{PROG}: -c {path}: the config file must hold a mapping of option names to "
            f"values (such as 'gdn_chunk_size: 64'), not {with_article(type(config).__name__)}."
        )
    known = set(args) | set(defaults) | {_OLD_KEY} | _MLX_LM_DATA_KEYS
    for key in config:
        name = str(key)
        if name not in known and name.replace("-", "_") in known:
            raise SystemExit(
                f"{PROG}: -c {path}: the key {name!r} is spelled as a flag; YAML keys use "
                f"underscores: {name.replace('-', '_')!r}."
            )
        if name not in known:
            warnings.warn(
                f"{PROG}: -c {path}: the key {name!r} is no option of {PROG} or mlx_lm.lora "
                "and is ignored.",
                UserWarning,
                stacklevel=3,
            )
    switches = {k for k, v in defaults.items() if isinstance(v, bool)} | {"demo"}
    for key, value in config.items():
        # strings only: 1 and 0 read as mlx-lm reads them (their truth; review)
        if key in switches and isinstance(value, str):
            raise SystemExit(
                f"{PROG}: -c {path}: {key} must be true or false (unquoted), not {value!r}."
            )
    return config


def _check_config_values(
    path: str, config: dict, parser: argparse.ArgumentParser, given: dict
) -> None:
    """The YAML values of options the parser checks as flags, checked as it checks
    them (in place: a size given as text, ``100MB``, becomes its bytes): a choice among
    the flag's choices, a path or name a string. Found by probing: ``fine_tune_type:
    qlora`` or ``optimizer: sgdx`` failed after the model loaded (the second after
    writing its ``adapter_config.json`` over an earlier run's), ``adapter_path: 5`` was
    a ``TypeError``, ``clear_cache_threshold: abc`` passed. A value whose flag is
    ``given`` (the command line's, which wins) is not read, and not checked; nor is
    ``project_name``, which mlx-lm reads only with ``report_to`` and passes on as it is
    (a review found both refused)."""
    for action in parser._actions:
        value = config.get(action.dest)
        if value is None or not action.option_strings or given.get(action.dest) is not None:
            continue
        if action.dest == "project_name":
            continue
        flag = action.option_strings[-1]
        # mlx-lm reads the optimizer's name lower-cased (Adam is adam)
        read = value.lower() if action.dest == "optimizer" and isinstance(value, str) else value
        if action.choices is not None and read not in action.choices:
            shown = ", ".join(map(repr, action.choices))
            raise SystemExit(
                f"{PROG}: -c {path}: {action.dest} must be one of {shown} (as {flag}), "
                f"not {value!r}."
            )
        if action.type is str and not isinstance(value, str):
            raise SystemExit(
                f"{PROG}: -c {path}: {action.dest} must be a string (as {flag}), not "
                f"{value!r}; quote it."
            )
        if action.dest == "clear_cache_threshold":
            try:
                config[action.dest] = action.type(str(value))
            except argparse.ArgumentTypeError as e:
                raise SystemExit(f"{PROG}: -c {path}: {action.dest} {e}.") from None


class _Reports:
    """Training callback printing peak memory at each report, and stopping the run at
    a training loss that is not finite; chains mlx-lm's."""

    def __init__(self, inner: Any, args: types.SimpleNamespace, routes: _Routes | None = None):
        self.inner = inner
        self.args = args
        self.routes = routes
        self.routes_printed = False

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        if not self.routes_printed:
            self.routes_printed = True
            say(_routes_line(self.routes))
        say(
            f"  iter {info['iteration']:>4}: loss {info['train_loss']:.3f}, "
            f"{info['tokens_per_second']:,.0f} tok/s, "
            f"process peak memory so far {mx.get_peak_memory() / MiB:,.0f} MiB"
        )
        if self.inner is not None:
            self.inner.on_train_loss_report(info)
        if not math.isfinite(info["train_loss"]):
            raise SystemExit(_not_finite_loss(info, self.args))

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.on_val_loss_report(info)


# The recurrences' routes of the first report: (the _Routes flag of the model that has
# it, the routed_calls key, what the line says).
_RECURRENCE_ROUTES = (
    ("lightning", "chunkscan.linear_attention",
     "Lightning attention of more than one token -> chunkscan.linear_attention"),
    ("ssd", "chunkscan.linear_attention (Mamba2)",
     "Mamba2 SSD without padding -> chunkscan.linear_attention"),
    ("mamba", "chunkscan.selective_scan", "Mamba's selective scan -> chunkscan.selective_scan"),
    ("rg_lru", "chunkscan.diagonal_recurrence",
     "RG-LRU's scan -> chunkscan.diagonal_recurrence"),
    ("rwkv7", "chunkscan.dplr_delta_rule", "RWKV-7's recurrence -> chunkscan.dplr_delta_rule"),
)  # fmt: skip


def _routes_line(routes: _Routes | None = None) -> str:
    """The training paths' calls so far, by where they went (the seam's
    ``routed_calls``): what the banner cannot tell from the model's modules. A
    recurrence's route is given where the model has it (``routes``, the banner's
    reading of the model folder), with its count even at 0 (a route that never ran
    left no sign: a quantized Mamba model's calls, all mlx-lm's, printed nothing; found
    by probing), and wherever calls went to it; Gated DeltaNet's, with validation's
    note, only where the model has such layers or ``routes`` is not known (it was
    printed for Mamba and RWKV models too)."""
    from .. import mlx_lm as seam

    calls = seam.routed_calls
    stock = calls["mlx-lm's attention"]
    gdn = calls["chunkscan.gated_delta_rule"]
    has_gdn = routes is None or routes.gated_deltanet or gdn > 0
    parts = []
    if has_gdn:
        parts.append(f"Gated DeltaNet training path -> chunkscan.gated_delta_rule {gdn}")
    parts.append(
        f"attention without a cache -> chunkscan.attention {calls['chunkscan.attention']}, "
        f"mlx-lm's {stock}"
        + (" (sinks, a floating mask or mixed dtypes: as in mlx-lm)" if stock else "")
    )
    recurrences = 0
    for flag, key, text in _RECURRENCE_ROUTES:
        if calls[key] or (routes is not None and getattr(routes, flag)):
            parts.append(f"{text} {calls[key]}")
            recurrences += 1
    # the other recurrences take every call without a cache, validation's too (it said
    # attention's alone; found by probing)
    counted = "attention's and the recurrences'" if recurrences else "attention's"
    validation = ", which runs Gated DeltaNet through mlx-lm's inference kernel" if has_gdn else ""
    return (
        f"chunkscan: where the calls went so far (per Python call: a compiled step counts "
        f"once, a checkpointed layer twice; {counted} include validation's{validation}): "
        + "; ".join(parts)
    )


def _not_finite_loss(info: dict[str, Any], args: types.SimpleNamespace) -> str:
    """The message that stops a run whose training loss is not finite. mlx-lm trained
    on and saved NaN adapters, exit 0: with ``--mask-prompt``, a batch whose prompts
    fill ``--max-seq-length`` has no target tokens and its loss is 0 / 0 (found by
    probing)."""
    causes = "a learning rate too high, or float16 overflow"
    if getattr(args, "mask_prompt", False):
        causes = (
            f"with --mask-prompt, a batch whose prompts fill --max-seq-length "
            f"({getattr(args, 'max_seq_length', '?')}) has no target tokens (its loss is "
            f"0 / 0): raise --max-seq-length or drop such examples; or " + causes
        )
    return (
        f"{PROG}: stopped: the training loss is {info['train_loss']} at iteration "
        f"{info['iteration']}; its gradients reach the adapters, so they were not "
        f"saved at the end (a checkpoint saved since the last finite report may hold "
        f"non-finite weights). Likely causes: {causes}."
    )


@contextlib.contextmanager
def _rebound(module: Any, name: str, wrap: Callable[[Any], Any]):
    """``module.<name>`` rebound to ``wrap(original)`` inside the block, restored on exit."""
    original = getattr(module, name)
    setattr(module, name, wrap(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _report_peak_memory(lora: Any, args: types.SimpleNamespace, routes: _Routes | None = None):
    """Rebind ``mlx_lm.lora.get_reporting_callbacks`` (restored on exit).

    ``mlx_lm.lora.run`` ignores its ``training_callback`` argument and builds one from
    ``--report-to``, so this is the only way in.
    """
    return _rebound(
        lora,
        "get_reporting_callbacks",
        lambda original: lambda *a, **k: _Reports(original(*a, **k), args, routes),
    )


def _lora_keys_must_name_modules(lora: Any):
    """Rebind ``mlx_lm.lora.linear_to_lora_layers`` (restored on exit) to check, once
    the model has loaded, that the ``lora_parameters`` keys name modules of the layers
    it wraps (or of the model, by full path): mlx-lm skips a key that names none, and
    with none left ``mx.grad`` failed with "Must specify at least one argument" (found
    by probing). A key naming nothing while others do is warned about (a typo trains
    fewer adapters than asked)."""

    def checked(original, model, num_layers, config, *args, **kwargs):
        keys = config.get("keys") if isinstance(config, dict) else None
        if keys:
            wrapped = model.layers[-max(num_layers, 0) :]
            names = {name for layer in wrapped for name, _ in layer.named_modules()}
            names |= {name for name, _ in model.named_modules()}
            unknown = [key for key in keys if key not in names]
            if unknown:
                linear = (nn.Linear, nn.QuantizedLinear)
                some = sorted(
                    {name for name, m in wrapped[-1].named_modules() if isinstance(m, linear)}
                    if wrapped
                    else ()
                )
                shown = _some(some, 8)
                what = (
                    f"lora_parameters keys {unknown!r} name no module of the "
                    f"{len(wrapped)} layers this run wraps (nor of the model, by full path)"
                )
                if len(unknown) == len(keys):
                    raise SystemExit(
                        f"{PROG}: {what}, so there is nothing to train. Give keys such as "
                        f"{shown or 'the names of its linear layers'} (-c)."
                    )
                warnings.warn(
                    f"{PROG}: {what}; mlx-lm skips them. Its linear layers: {shown}.",
                    UserWarning,
                    stacklevel=2,
                )
        return original(model, num_layers, config, *args, **kwargs)

    return _rebound(
        lora, "linear_to_lora_layers", lambda original: functools.partial(checked, original)
    )


@contextlib.contextmanager
def _resumed_weights_must_fit(lora: Any, args: types.SimpleNamespace):
    """Check a ``--resume-adapter-file`` against the model it is about to be loaded into
    (:func:`_check_resumed_weights_fit`), where the wrapped model exists and the file
    is not loaded yet: after ``mlx_lm.lora.linear_to_lora_layers`` (LoRA, DoRA), and on
    entering ``mlx_lm.lora.train_model`` for ``full`` (no conversion). Both rebound inside
    the block, restored on exit."""
    if not args.train or args.resume_adapter_file is None:
        yield
        return

    def converted(original, model, *a, **k):
        out = original(model, *a, **k)
        _check_resumed_weights_fit(model, args)
        return out

    def train_model(original, run_args, model, *a, **k):
        if run_args.fine_tune_type == "full":
            _check_resumed_weights_fit(model, args)
        return original(run_args, model, *a, **k)

    with (
        _rebound(lora, "linear_to_lora_layers", lambda f: functools.partial(converted, f)),
        _rebound(lora, "train_model", lambda f: functools.partial(train_model, f)),
    ):
        yield


def _check_resumed_weights_fit(model: nn.Module, args: types.SimpleNamespace) -> None:
    """Every tensor of the resumed file (read as mlx-lm reads it: :func:`_resumed_shapes`,
    safetensors or ``.npz``) names a parameter of ``model`` as this run wraps it, with
    that parameter's shape; else ``SystemExit``.
    mlx-lm loads the file with ``strict=False``: adapters of another model lost the
    tensors whose names it lacks in silence, exit 0, and tensors of other shapes failed
    with a ``[matmul]`` traceback mid-training (found by probing). The checks before
    loading catch what the file and its ``adapter_config.json`` tell; this one, what
    only the model tells. (It read a safetensors header, which an ``.npz`` file has
    not: such a file's foreign tensors were dropped in silence; found by review.)"""
    from mlx.utils import tree_flatten

    resume = args.resume_adapter_file
    tensors = _resumed_shapes(resume, pathlib.Path(resume))
    params = {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}
    dropped = sorted(name for name in tensors if name not in params)
    shapes = {n: tensors[n] for n in tensors if n in params}
    mismatched = sorted(n for n, shape in shapes.items() if shape != params[n])
    if not dropped and not mismatched:
        return
    problems = []
    if dropped:
        problems.append(
            f"{len(dropped)} of its {len(tensors)} tensors name no parameter of the model "
            f"({_some(dropped)}), which mlx-lm would drop in silence"
        )
    if mismatched:
        shown = "; ".join(f"{n}: {list(shapes[n])} in the file, {list(params[n])} in the "
                          f"model" for n in mismatched[:2])  # fmt: skip
        problems.append(
            f"{len(mismatched)} of its {len(tensors)} tensors have another shape than the "
            f"model's ({shown}"
            f"{'; ...' if len(mismatched) > 2 else ''}), which would fail mid-training"
        )
    trained_on = _model_config(pathlib.Path(resume).parent, "adapter_config.json").get("model")
    on = f" (its adapter_config.json says they were trained on {trained_on})" if trained_on else ""
    raise SystemExit(
        f"{PROG}: --resume-adapter-file {resume} does not fit --model {args.model} as this "
        f"run wraps it{on}: {'; '.join(problems)} (mlx-lm loads it with strict=False). "
        f"Resume adapters trained on this model with this run's settings, or start without "
        f"--resume-adapter-file."
    )


def _some(names: list[str], n: int = 3) -> str:
    """The first ``n`` of ``names``, then ``...`` where there are more: every message
    that lists some of many names says it so (four had written it out; review)."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


DEMO_MARKER = ".chunkscan-demo"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _demo_dir_needs_writing(flag: str, path: str, files: tuple[str, ...]) -> bool:
    """Whether the demo must write ``path``; raises if it would write someone's folder.

    It writes a folder that does not exist, or one it made earlier (marked with
    :data:`DEMO_MARKER`) that lacks one of ``files`` (what the demo writes there:
    ``--test`` needs the ``test.jsonl`` that demos before session 30 did not write; in
    the data folder only the missing splits are written); it uses any other folder that
    has ``files[0]`` as it is; it refuses everything else.
    """
    p = pathlib.Path(path)
    if (p / DEMO_MARKER).is_file():
        return not all((p / f).is_file() for f in files)
    if (p / files[0]).is_file():
        return False
    for part in (p, *p.parents):  # mkdir failed on a broken link or a file: a traceback
        if part.is_symlink() and not part.exists():  # (found by probing, and review)
            raise SystemExit(
                f"chunkscan lora --demo: {flag} {path}: {part} is a link to "
                f"{os.readlink(part)}, which does not exist, so the demo cannot make its "
                f"folder there. Pass another path, or make the folder the link names."
            )
        if part.exists():
            if part != p and not part.is_dir():
                raise SystemExit(
                    f"chunkscan lora --demo: {flag} {path}: {part} is a file, so the demo "
                    f"cannot make its folder there. Pass another path."
                )
            break
    if not p.exists():
        if _reads_as_repo_id(path):
            # written there, the random model stands in for that repo in later runs
            # from this folder, mlx-lm's own too: it reads a local folder first (found
            # by probing; not refused: it may be the user's own folder's name)
            print(
                f"chunkscan lora --demo: {flag} {path} also reads as a Hugging Face repo "
                f"id; runs from this folder that name it will load the demo's folder (a "
                f"local folder comes first). Pass a path of another form, such as "
                f"demos/{path}, to keep the two apart.",
                file=sys.stderr,
                flush=True,
            )
        return True
    if not p.is_dir():
        raise SystemExit(
            f"chunkscan lora --demo: {flag} {path} is a file, not a folder, so the demo "
            f"cannot write its files there. Pass a path that does not exist yet (the demo "
            f"creates it and keeps it), or a folder."
        )
    raise SystemExit(
        f"chunkscan lora --demo: {flag} {path} is a folder that the demo did not create "
        f"(no {DEMO_MARKER} file in it) and has no {files[0]}, so the demo will not write "
        f"its files there. Pass a path that does not exist yet (the demo creates it and "
        f"keeps it), a folder an earlier demo made, or one that already has {files[0]}."
    )


def _reads_as_repo_id(value: str) -> bool:
    """``value`` has a Hugging Face repo id's form (``namespace/name``; :data:`_REPO_ID`
    starts with a letter or digit, so never ``./`` or ``~``)."""
    return bool(_REPO_ID.match(value))


def _demo_adapter_folder(args: types.SimpleNamespace, demo_dir: str) -> pathlib.Path | None:
    """The folder the demo must make and mark (:data:`DEMO_MARKER`) for its adapters
    when it trains, or ``None``: one in its temporary directory, or made by an earlier
    demo. An existing folder it did not make is refused, before anything is written (the
    demo replaced the adapters of an earlier run there, their ``adapter_config.json``
    then naming a model deleted at exit; found by probing)."""
    path = getattr(args, "adapter_path", None)
    if not args.train or not isinstance(path, str) or path == "":
        return None
    where = pathlib.Path(path)
    if where.resolve().is_relative_to(pathlib.Path(demo_dir).resolve()):
        return None
    if (where / DEMO_MARKER).is_file():
        return None
    if where.exists():
        raise SystemExit(
            f"chunkscan lora --demo: --adapter-path {path} is a folder that the demo did not "
            f"create (no {DEMO_MARKER} file in it), so the demo will not write its adapters "
            f"there (it would replace what is there). Pass a path that does not exist yet "
            f"(the demo creates it and keeps it) or a folder an earlier demo made."
        )
    return where


def _demo_kept(args: types.SimpleNamespace, demo_dir: str) -> str:
    """What the demo's last line says it keeps: the model, data and adapters outside
    its temporary directory (it said the model was removed with the directory when
    only the adapters were in it; found by probing)."""
    temporary = pathlib.Path(demo_dir).resolve()
    kept, gone = [], []
    for what, path in (("model", args.model), ("data", args.data),
                       ("adapters", args.adapter_path)):  # fmt: skip
        if not path:  # --adapter-path '': nothing written
            continue
        inside = pathlib.Path(path).resolve().is_relative_to(temporary)
        (gone if inside else kept).append(what if inside else f"{what} in {path}")
    said = [f"kept: {', '.join(kept)}"] if kept else []
    if gone:
        said.append(
            f"the temporary directory ({', '.join(gone)}) is removed now (pass --model, "
            f"--data and --adapter-path to keep them)"
        )
    return "; ".join(said)


def _mark_demo_folder(path: str | pathlib.Path) -> None:
    """Make ``path`` and mark it as the demo's (:data:`DEMO_MARKER`)."""
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    pathlib.Path(path, DEMO_MARKER).write_text(
        "made by chunkscan lora --demo; it may rewrite the files in this folder\n"
    )


def _write_demo(args: types.SimpleNamespace) -> None:
    from . import demo_model

    todo = [
        (path, write)
        for flag, path, files, write in (
            ("--model", args.model, ("config.json",), demo_model.write_model),
            (
                "--data",
                args.data,
                demo_model.DATASET_FILES,
                functools.partial(demo_model.write_dataset, keep_existing=True),
            ),
        )
        if _demo_dir_needs_writing(flag, path, files)
    ]  # every check first: refuse before writing anything
    for path, write in todo:
        _mark_demo_folder(path)
        write(path)


def _demo_banner(model: str) -> str:
    """The demo's model, or the user's own in a ``--model`` folder that had one (the
    banner said "tiny random Qwen3-Next model" whatever it was; found by probing)."""
    if pathlib.Path(model, DEMO_MARKER).exists():
        return f"chunkscan lora --demo: tiny random Qwen3-Next model in {model}"
    return f"chunkscan lora --demo: your model in {model}, as it is (not the demo's)"


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - mlx-lm depends on it
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _in_hub_cache(repo_id: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def check_args(args: types.SimpleNamespace) -> None:
    """Raise ``SystemExit`` saying what is missing, before anything is loaded."""
    _check_something_to_do(args)
    args.model = _check_source("--model", args.model, "an MLX model folder", model=True)
    if not getattr(args, "hf_dataset", None):
        args.data = _check_source("--data", args.data, "a data folder (train.jsonl, valid.jsonl)")
    if getattr(args, "hf_dataset", None) or not pathlib.Path(args.data).is_dir():
        _check_datasets_installed(args)
    _check_local_inputs(args)
    _check_adapter_paths(args)
    _check_resumed_adapters(args)


def _check_datasets_installed(args: types.SimpleNamespace) -> None:
    """A Hugging Face dataset (a repo id as ``--data``, or ``hf_dataset``) is read with
    the ``datasets`` package, which mlx-lm imports only then and chunkscan's ``lm``
    extra does not install: a ``ModuleNotFoundError`` after the model loaded (found by
    probing)."""
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        source = "hf_dataset" if getattr(args, "hf_dataset", None) else f"--data {args.data}"
        raise SystemExit(
            f"chunkscan lora: {source} is a Hugging Face dataset, which mlx-lm reads with "
            f"the datasets package, not installed here: pip install datasets (or "
            f"'mlx-lm[train]'), or pass a local data folder."
        )


def _check_something_to_do(args: types.SimpleNamespace) -> None:
    """``--train`` or ``--test`` (with ``--demo`` too: ``train: false`` in its ``-c``
    wrote and loaded the model, then failed; found by probing)."""
    if not args.train and not args.test:
        demo = "" if getattr(args, "demo", False) else "; or --demo for an offline demo"
        raise SystemExit(
            "chunkscan lora: nothing to do: pass --train (finetune) and/or --test "
            f"(evaluate), as with mlx_lm.lora{demo}."
        )


def _check_local_inputs(args: types.SimpleNamespace) -> None:
    """What can be told of a local ``--data`` and ``--model`` folder before anything
    loads (with and without ``--demo``, whose folders may be the user's: it skipped
    these before; found by probing): :func:`_check_data` and :func:`_check_layers`."""
    if not getattr(args, "hf_dataset", None) and pathlib.Path(args.data).is_dir():
        _check_data(args)
    _check_model_type(args)
    _check_layers(args)


def _check_model_type(args: types.SimpleNamespace) -> None:
    """A local model folder holds ``model*.safetensors`` and a ``config.json`` that is a
    JSON object with a ``model_type`` this mlx-lm has a model for: no weights, a config
    that was not JSON, or an unknown type, was mlx-lm's error after the checks (found
    by probing)."""
    path = pathlib.Path(args.model, "config.json")
    if not path.is_file():
        return
    if not any(path.parent.glob("model*.safetensors")):  # mlx-lm's error after the checks
        raise SystemExit(
            f"chunkscan lora: --model {args.model} holds no model*.safetensors (the "
            f"weights mlx-lm loads). Pass a converted MLX model folder (mlx_lm.convert)."
        )
    where = f"chunkscan lora: --model {args.model}: config.json"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:
        raise SystemExit(f"{where} is not valid JSON ({e}).") from None
    except OSError:
        return
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise SystemExit(f"{where} names no model_type (mlx-lm picks the model by it).")
    _check_tokenizer_files(args.model)
    if config.get("model_file"):  # the model's own code (trust_remote_code): mlx-lm's call
        return
    try:  # mlx-lm's own lookup (private: where a release lacks it, nothing is said)
        from mlx_lm.utils import _get_classes
    except ImportError:
        return
    try:
        _get_classes(config)
    except ValueError as e:
        import mlx_lm

        raise SystemExit(
            f"{where}: {e} (mlx-lm {getattr(mlx_lm, '__version__', '?')}; its models are "
            f"the modules of mlx_lm/models)."
        ) from e


# Files of a tokenizer in a model folder (Hugging Face's fast and slow tokenizers,
# SentencePiece, tiktoken): a folder with none of them is refused.
# (tekken.json: Mistral's, which transformers reads with mistral-common; review)
_TOKENIZER_FILES = ("tokenizer*", "tekken*", "*.tiktoken", "*.model", "vocab*", "merges*",
                    "spiece*")  # fmt: skip


def _check_tokenizer_files(model: str) -> None:
    """A local model folder holds some tokenizer's files: with none, mlx-lm loaded a
    tokenizer that turned every example into no tokens, and training stopped at its
    first batch with an ``IndexError`` traceback from mlx-lm's data set (found by
    probing, session 40)."""
    folder = pathlib.Path(model)
    if not any(next(folder.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        raise SystemExit(
            f"chunkscan lora: --model {model} holds no tokenizer files (tokenizer.json, "
            f"tokenizer.model, vocab.json, ...: mlx-lm loads the tokenizer from the model "
            f"folder). Copy them from the model's source, or pass the source's name."
        )


def _check_data(args: types.SimpleNamespace) -> None:
    """The data folder holds the splits this run reads, none of them empty, and each
    split a batch reads holds at least ``--batch-size`` examples (mlx-lm: an
    ``IndexError`` for an empty one, a ``ValueError`` traceback after the model loaded
    for a short one; found by probing)."""
    data = pathlib.Path(args.data)
    for wanted, split in ((args.train, "train"), (args.test, "test")):
        if wanted and not (data / f"{split}.jsonl").is_file():
            raise SystemExit(
                f"chunkscan lora: --data {args.data} has no {split}.jsonl, which "
                f"--{split} reads (mlx_lm.lora reads train.jsonl, valid.jsonl and "
                f"test.jsonl from the folder). Add it, or pass another folder."
            )
    # the splits read in batches of --batch-size: train and (for validation) valid with
    # --train, test with --test
    batched = {"train": args.train, "valid": args.train and args.val_batches != 0,
               "test": args.test}  # fmt: skip
    # the splits whose examples this run reads (mlx-lm parses every file's lines, but
    # takes an example's keys only when it reads the example)
    read = {split for split, wanted in batched.items() if wanted}
    for split in ("train", "valid", "test"):
        path = data / f"{split}.jsonl"
        if path.exists() and not path.is_file():  # mlx-lm opens it (found by probing)
            raise SystemExit(
                f"chunkscan lora: --data {args.data}: {split}.jsonl is not a file; mlx-lm "
                f"reads every split file of the folder. Remove or rename it."
            )
        if not path.is_file():
            continue
        examples = _read_examples(path, args, keys=split in read)
        if examples == 0:
            raise SystemExit(
                f"chunkscan lora: --data {args.data}: {split}.jsonl is empty (no line "
                f"holds an example). Add examples, or remove the file."
            )
        if batched[split] and examples < args.batch_size:
            raise SystemExit(
                f"chunkscan lora: --data {args.data}: {split}.jsonl holds {examples} "
                f"example{'s' if examples != 1 else ''}, fewer than --batch-size "
                f"{args.batch_size} (mlx-lm makes no batch of them). Pass --batch-size "
                f"{examples} or less, or add examples."
            )


def _check_layers(args: types.SimpleNamespace) -> None:
    """With ``--train``, ``--num-layers`` (mlx_lm.lora's default: 16) at most the layers
    of a local model folder, as its ``config.json`` counts them (``num_hidden_layers``,
    or its ``text_config``'s): mlx-lm raised after loading the model (found by probing).
    Nothing is said where the count cannot be read (a Hub id, another key)."""
    if not args.train or args.num_layers == -1:
        return
    config = _model_config(args.model)
    count = _layer_count(config)
    if count is not None and args.num_layers > count:
        default = args.num_layers == _mlx_lm_lora().CONFIG_DEFAULTS.get("num_layers")
        raise SystemExit(
            f"chunkscan lora: --num-layers {args.num_layers}"
            f"{' (mlx_lm.lora default)' if default else ''} "
            f"asks for more layers than --model {args.model} has ({count}: "
            f"num_hidden_layers in its config.json). Pass --num-layers {count} or less, "
            f"or -1 for all of them."
        )


def _model_config(model: Any, name: str = "config.json") -> dict:
    """A local model folder's ``config.json`` (or another JSON file ``name`` there) as a
    mapping (``{}`` where it cannot be read)."""
    try:
        with open(pathlib.Path(model, name)) as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):
        return {}
    return config if isinstance(config, dict) else {}


def _layer_count(config: dict) -> int | None:
    """The model's layers (``num_hidden_layers``, or its ``text_config``'s); ``None``
    where the config does not say."""
    text = config.get("text_config")
    count = config.get("num_hidden_layers")
    if count is None and isinstance(text, dict):
        count = text.get("num_hidden_layers")
    return count if _is_whole(count) else None


def _check_adapter_paths(args: types.SimpleNamespace) -> None:
    """``~`` expanded in ``--adapter-path`` and ``--resume-adapter-file``, as in
    ``--model`` and ``--data`` (mlx-lm opened '~/...' as written and wrote into ./~);
    then ``--adapter-path``: training makes a folder there (a file, a broken link or a
    file above it was mlx-lm's error after the model loaded), and ``--test`` alone
    reads a trained run's adapters from it (``adapters.safetensors`` and
    ``adapter_config.json``; found by probing)."""
    for name in ("adapter_path", "resume_adapter_file"):
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
    path = getattr(args, "adapter_path", None)
    if path == "" and args.train:  # mlx-lm wrote into the working folder (probing)
        raise SystemExit(
            "chunkscan lora: --adapter-path '' means no adapters (--test of the model "
            "alone); training writes its adapters into a folder. Pass one."
        )
    if not isinstance(path, str) or path == "":
        return
    where = pathlib.Path(path)
    if args.train:
        for p in (where, *where.parents):
            if p.is_symlink() and not p.exists():
                raise SystemExit(
                    f"chunkscan lora: --adapter-path {path}: {p} is a broken link; "
                    f"training makes a folder there. Pass another folder."
                )
            if p.exists():
                if not p.is_dir():
                    raise SystemExit(
                        f"chunkscan lora: --adapter-path {path}: {p} is a file; training "
                        f"writes its adapters into a folder there. Pass a folder."
                    )
                # mlx-lm's PermissionError came after the model had loaded (probing)
                if not os.access(p, os.W_OK | os.X_OK):
                    raise SystemExit(
                        f"chunkscan lora: --adapter-path {path}: {p} is not writable; "
                        f"training writes its adapters there. Pass a writable folder."
                    )
                break
        _check_adapter_files(path)
    elif args.test:
        missing = [f for f in ("adapters.safetensors", "adapter_config.json")
                   if not (where / f).is_file()]  # fmt: skip
        if missing:
            raise SystemExit(
                f"chunkscan lora: --test reads a trained run's adapters from --adapter-path "
                f"{path}, which holds no {' or '.join(missing)}. Pass the folder of a "
                f"trained run, or --adapter-path '' to test the model without adapters."
            )


def _check_adapter_files(path: str) -> None:
    """The files a training run writes in ``--adapter-path`` are files where they exist:
    a folder named ``adapters.safetensors`` let the run train to the end and lose it at
    the final save (found by probing), and ``adapter_config.json`` is written first."""
    for name in _ADAPTER_FILES:
        p = pathlib.Path(path, name)
        if p.exists() and not p.is_file():
            kind = "a folder" if p.is_dir() else "not a regular file"
            weights = name == _ADAPTER_FILES[0]
            when = " at its end (the trained run would be lost)" if weights else ""
            raise SystemExit(
                f"{PROG}: --adapter-path {path}: {p} is {kind}, where training "
                f"writes its {name}{when}. Remove or rename it, or pass another "
                f"--adapter-path."
            )


def _check_resumed_adapters(args: types.SimpleNamespace) -> None:
    """``--resume-adapter-file`` must exist, load (:func:`_resumed_shapes`), and where an
    ``adapter_config.json`` lies beside it, have this run's fine-tune type, LoRA rank and
    scale: mlx-lm loads it with ``strict=False``, so adapters of another rank were
    loaded with their own shapes, trained, and saved beside a config of this run's rank,
    which then failed to load; at another scale training went on from another model than
    the one trained (found by probing)."""
    resume = getattr(args, "resume_adapter_file", None)
    if resume is None:
        return
    # ignored by mlx-lm, exit 0 (found by probing); only a command line's reaches here
    # without --train (one from -c is warned about and dropped: resolve_args)
    if not getattr(args, "train", False):
        raise SystemExit(
            f"chunkscan lora: --resume-adapter-file {resume} is read only with --train "
            f"(training resumes from it); --test alone reads the adapters in "
            f"--adapter-path ({args.adapter_path!r}). Pass --train, or pass the adapters' "
            f"folder as --adapter-path instead."
        )
    path = pathlib.Path(str(resume)).expanduser()
    if not path.is_file():
        raise SystemExit(
            f"chunkscan lora: --resume-adapter-file {resume}: no such file. Pass the "
            f"adapters.safetensors of an earlier run."
        )
    tensors = _resumed_shapes(resume, path)
    try:
        with open(path.parent / "adapter_config.json") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = {}  # the layers are still read off the file's tensor names
    if not isinstance(saved, dict):
        saved = {}
    lora_parameters = args.lora_parameters if isinstance(args.lora_parameters, dict) else {}
    saved_lora = saved.get("lora_parameters")
    saved_lora = saved_lora if isinstance(saved_lora, dict) else {}
    unloadable = "save adapters that do not load"
    pairs = [("fine_tune_type", saved.get("fine_tune_type"), args.fine_tune_type, unloadable)]
    if args.fine_tune_type != "full":
        pairs.append(("rank", saved_lora.get("rank"), lora_parameters.get("rank"), unloadable))
        # the scale multiplies the adapters' output: resumed at another, training went on
        # from another model than the one trained, in silence (found by probing)
        pairs.append(("scale", saved_lora.get("scale"), lora_parameters.get("scale"),
                      "start from another model than the one trained (the scale multiplies "
                      "the adapters' output)"))  # fmt: skip
    for what, before, now, consequence in pairs:
        if before is not None and now is not None and before != now:
            raise SystemExit(
                f"chunkscan lora: --resume-adapter-file {resume} was trained with {what} "
                f"{before!r} ({path.parent / 'adapter_config.json'}), this run asks for "
                f"{now!r}: mlx-lm would load it anyway (strict=False) and {consequence}. "
                f"Give this run the same {what} ("
                f"{'--fine-tune-type' if what == 'fine_tune_type' else 'lora_parameters in -c'}"
                f"), or start without "
                f"--resume-adapter-file."
            )
    # the file's own tensor names: without its adapter_config.json a LoRA file resumed
    # as full or DoRA, or a DoRA file as LoRA, lost its adapters or their magnitudes in
    # silence (found by probing: a LoRA file resumed as full restarted from the base)
    kind = _tensor_fine_tune_type(tensors)
    if saved.get("fine_tune_type") is None and kind is not None and kind != args.fine_tune_type:
        raise SystemExit(
            f"chunkscan lora: --resume-adapter-file {resume} holds {kind} weights (its "
            f"tensor names), this run asks for --fine-tune-type {args.fine_tune_type}: "
            f"mlx-lm would load it anyway (strict=False) and drop what this run does not "
            f"train. Pass --fine-tune-type {kind}, or start without --resume-adapter-file."
        )
    ranks, now = _lora_ranks(tensors), lora_parameters.get("rank")
    # the file's own shapes: a file without its adapter_config.json beside it went
    # unchecked (found by probing: rank 4 resumed at 8, exit 0, adapters that do not load)
    if args.fine_tune_type != "full" and ranks and isinstance(now, int) and ranks != {now}:
        raise SystemExit(
            f"chunkscan lora: --resume-adapter-file {resume} holds adapters of rank "
            f"{', '.join(map(str, sorted(ranks)))} (its tensors' shapes), this run asks for "
            f"rank {now}: mlx-lm would load them anyway (strict=False) and save adapters "
            f"that do not load. Give this run the same rank (lora_parameters in -c), or "
            f"start without --resume-adapter-file."
        )
    _check_resumed_coverage(args, resume, tensors, lora_parameters)


def _resumed_shapes(resume: Any, path: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors in ``path``, loaded as mlx-lm loads it
    (``mx.load``, which picks the format by the file's extension: safetensors, ``.npz``,
    ...; lazy: no tensor's data is read until it is evaluated, and none is here); else
    ``SystemExit``: the run's ``adapter_config.json`` given instead was ``ValueError:
    [load] Unknown file format json`` after the model loaded (found by probing). One
    reader for every check of the file (a safetensors header reader left an ``.npz``
    file's tensors unchecked; found by review)."""
    try:
        loaded = mx.load(str(path))
    except (ValueError, RuntimeError, OSError) as e:
        problem = str(e)
    else:
        if isinstance(loaded, dict):
            return {name: tuple(value.shape) for name, value in loaded.items()}
        problem = "it holds one array, not named tensors"
    raise SystemExit(
        f"chunkscan lora: --resume-adapter-file {resume} is not a weights file mlx-lm can "
        f"load ({problem}). Pass the adapters.safetensors of an earlier run (not its "
        f"adapter_config.json)."
    )


def _check_resumed_coverage(
    args: types.SimpleNamespace, resume: Any, tensors: dict, lora_parameters: dict
) -> None:
    """The resumed adapters' layers (read off the file's tensor names, ``tensors``)
    are among the last ``--num-layers`` this run wraps (or, ``full``, trains), and
    their modules among this run's ``lora_parameters.keys`` where it lists them: mlx-lm
    loads the file with ``strict=False``, so adapters of a layer or module this run
    does not wrap were dropped, trained no further and left out of the saved file, with
    no message (found by probing: a run resumed with ``--num-layers 1`` lost the other
    layers' adapters, LoRA or full; one with keys listed lost the adapters of the
    default keys)."""
    config = _model_config(args.model)
    if not config and getattr(args, "demo", False):
        # the demo writes its model after these checks: the config it will write (the
        # layers went uncounted, and a resume with --num-layers 1 lost the others'
        # adapters, exit 0; found by probing, session 49)
        from . import demo_model

        config = demo_model.tiny_config()
    count = _layer_count(config)
    wrapped = args.num_layers if args.num_layers != -1 else count
    keys = lora_parameters.get("keys") if args.fine_tune_type != "full" else None
    keys = set(keys) if isinstance(keys, list) else None
    modules = _lora_modules(tensors)
    # mlx-lm also wraps a module its full path names in keys, in any layer (a review
    # found such a resume refused): its tensors are no layer's to count
    whole = {full for _, full in modules if keys is not None and full in keys}
    layers = _tensor_layers({n: v for n, v in tensors.items() if n.rpartition(".")[0] not in whole})
    # Said only where the count is surely the layers mlx-lm builds: not where the
    # config's num_layers disagrees (LongCat-Flash builds num_layers, half of
    # num_hidden_layers) or a tensor names a layer past it (found by review).
    other = config.get("num_layers", count)
    if other != count or (layers and count is not None and max(layers) >= count):
        count = None
    if count is not None and wrapped is not None and layers:
        first = count - wrapped
        outside = sorted(i for i in layers if i < first)
        if outside:
            shown = _some([str(i) for i in outside], 8)
            raise SystemExit(
                f"chunkscan lora: --resume-adapter-file {resume} holds adapters of "
                f"layer{'s' if len(outside) > 1 else ''} {shown}, which --num-layers "
                f"{args.num_layers} does not wrap (the last {wrapped} of the model's "
                f"{count}: from layer {first}): mlx-lm would load "
                f"it anyway (strict=False) and drop them. Pass --num-layers "
                f"{count - outside[0]} or more (-1: all), or start without "
                f"--resume-adapter-file."
            )
    if keys is not None:
        dropped = sorted({inner for inner, full in modules if not {inner, full} & keys})
        if dropped:
            raise SystemExit(
                f"chunkscan lora: --resume-adapter-file {resume} holds adapters of "
                f"{_some(dropped, 6)}, which this "
                f"run's lora_parameters keys {sorted(keys)!r} leave out: mlx-lm would load it "
                f"anyway (strict=False) and drop those adapters. Give this run keys that "
                f"cover them (-c), or start without --resume-adapter-file."
            )


def _tensor_layers(tensors: dict) -> set[int]:
    """The layer indices (``...layers.<i>.``) in a file's tensor names."""
    found = (_LAYER_NAME.search(name) for name in tensors)
    return {int(m.group(1)) for m in found if m}


def _lora_modules(tensors: dict) -> set[tuple[str, str]]:
    """The modules a file's LoRA / DoRA tensors adapt, as ``(name within its layer,
    full path)``, the two names ``lora_parameters`` keys may give (``self_attn.q_proj``;
    ``model.layers.0.self_attn.q_proj``, or ``lm_head`` outside the layers)."""
    modules = set()
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_a", "lora_b", "m") and module:
            m = _LAYER_NAME.search(module + ".")
            modules.add((module[m.end() :] if m else module, module))
    return modules


def _tensor_fine_tune_type(tensors: dict) -> str | None:
    """The fine-tune type a file's tensor names show: ``dora`` where a module holds
    ``lora_a`` / ``lora_b`` and a magnitude ``m``, ``lora`` where those alone, ``full``
    where no module does (the layers' own weights); ``None`` for no tensors."""
    if not tensors:
        return None
    adapted = set()  # lora_a / lora_b may be lists (afm7's fused LoRA: lora_a.0, ...)
    for name in tensors:
        parts = name.split(".")
        at = [i for i, part in enumerate(parts) if part in ("lora_a", "lora_b")]
        if at:
            adapted.add(".".join(parts[: at[0]]))
    if not adapted:
        return "full"
    return "dora" if any(f"{module}.m" in tensors for module in adapted) else "lora"


def _lora_ranks(tensors: dict[str, tuple[int, ...]]) -> set[int]:
    """The ranks of a file's LoRA / DoRA adapters (``tensors``: tensor name -> shape),
    from the shapes of their ``lora_b``: ``[r, out]``, or ``[experts, out, r]``
    (mlx-lm's SwitchLinear)."""
    ranks = set()
    for name, shape in tensors.items():
        if name.endswith(".lora_b") and len(shape) in (2, 3):
            ranks.add(shape[0] if len(shape) == 2 else shape[-1])
    return ranks


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _read_examples(path: pathlib.Path, args: types.SimpleNamespace, keys: bool = True) -> int:
    """The examples of a data file, read as mlx-lm reads them (every line one JSON
    object; the first line's keys choose the format: ``prompt`` and ``completion``,
    ``messages`` or ``text``, under their ``*_feature`` names; with ``keys``, for a split
    this run reads, every line then needs that format's keys); 0 for a file of blank
    lines only. Else the command stops naming the file and the line, before the model
    loads: mlx-lm parsed each line with ``json.loads`` after loading the model, so one
    blank line (a trailing empty line too) was a ``JSONDecodeError`` naming neither,
    and a missing key a ``KeyError`` (found by probing). Read a line at a time."""
    prompt = getattr(args, "prompt_feature", None) or "prompt"
    completion = getattr(args, "completion_feature", None) or "completion"
    chat = getattr(args, "chat_feature", None) or "messages"
    text = getattr(args, "text_feature", None) or "text"
    where = f"chunkscan lora: --data {args.data}: {path.name}"
    needed: tuple[str, ...] = ()
    blank = None  # the first blank line: an error unless every line is blank
    count = 0
    # as mlx-lm iterates it (text mode: lines end at \n, \r\n or \r, where
    # str.splitlines would also cut at a U+2028 inside a JSON string)
    # strictly decoded, as mlx-lm decodes it (errors="replace" passed a file that is not
    # UTF-8, then mlx-lm's UnicodeDecodeError came after loading; found by probing)
    with open(path, encoding="utf-8") as f:
        for number, line in _numbered_lines(f, where):
            if not line.strip():
                blank = blank or number
                continue
            if blank is not None:  # a blank line before an example (the first too)
                _blank_line(where, blank)
            count += 1
            example = _parse_example(where, number, line)
            if count == 1:
                needed = _example_format(where, example, prompt, completion, chat, text, args)
                if keys and needed != (text,):
                    _check_chat_template(where, needed, args)
            lacking = [k for k in needed if k not in example] if keys else []
            if lacking:
                raise SystemExit(
                    f"{where} line {number} lacks {' and '.join(map(repr, lacking))}, which "
                    f"line 1 has: mlx-lm reads every example in line 1's format."
                )
            if keys:
                _check_example_values(where, number, example, needed, chat)
                _check_example_not_empty(where, number, example, needed, chat, args.model)
    if blank is not None and count:  # blank lines at the end (all blank: "is empty")
        _blank_line(where, blank)
    return count


def _numbered_lines(f, where: str):
    """``(number, line)`` of a text file opened strictly as UTF-8; bytes that do not
    decode stop the command naming their line (counted in the raw bytes: the text
    layer decodes a chunk of lines at a time)."""
    try:
        yield from enumerate(f, 1)
    except UnicodeDecodeError:
        with open(f.name, "rb") as raw:
            data = raw.read()
        try:
            data.decode("utf-8")
            at = len(data)  # (not reached: the same bytes failed above)
        except UnicodeDecodeError as e:
            at = e.start
        # lines as the text layer ends them: at \r\n, \n or a lone \r (a review
        # found the line of a \r-ended file miscounted)
        line = len(re.findall(rb"\r\n|\r|\n", data[:at])) + 1
        raise SystemExit(
            f"{where} line {line} is not UTF-8 (byte {at} of the "
            f"file); mlx-lm reads the file as UTF-8. Convert the file."
        ) from None


def _check_example_values(where: str, number: int, example: dict, needed, chat: str) -> None:
    """The values of an example's format keys have the type mlx-lm's tokenizer calls
    take (a string; the chat's messages, a list): ``{"text": null}`` failed mid-training
    (found by probing)."""
    for key in needed:
        value, want = example[key], (list if key == chat else str)
        if not isinstance(value, want):
            kind = {type(None): "null", bool: "boolean", int: "number", float: "number",
                    dict: "object"}.get(type(value), type(value).__name__)  # fmt: skip
            raise SystemExit(
                f"{where} line {number}: {key!r} is a JSON {kind}, not a "
                f"{'list of messages' if want is list else 'string'}, which mlx-lm reads."
            )


def _check_example_not_empty(
    where: str, number: int, example: dict, needed, chat: str, model: Any
) -> None:
    """An example mlx-lm cannot make a sequence of, refused (found by probing: each
    failed mid-training, after the model loaded): a chat of no messages (transformers:
    "Cannot apply chat template to an empty conversation"), and an empty or
    whitespace-only ``text`` where the local model's ``tokenizer.json`` makes no tokens
    of it (an ``IndexError`` in mlx-lm's ``TextDataset``: a word-level tokenizer, as the
    demo's). A tokenizer that adds a BOS token makes BOS + EOS of ``""``, and a
    byte-level BPE tokens of spaces: mlx-lm trains on them, and so does this command
    (an empty ``text`` was refused for every tokenizer; found by review, session 50);
    where ``tokenizer.json`` cannot be read up front, it is left to mlx-lm. ``prompt`` /
    ``completion`` go through the chat template, which adds its own text: not checked."""
    if needed == (chat,):
        if not example[chat]:
            raise SystemExit(
                f"{where} line {number}: {chat!r} is an empty list; mlx-lm's chat template "
                f"takes at least one message. Remove the line or give it messages."
            )
        return
    if len(needed) != 1:
        return
    (key,) = needed
    value = example[key]
    if (value == "" or value.isspace()) and _tokenizer_ids(model, value) == []:
        what = "empty" if value == "" else "only whitespace"
        raise SystemExit(
            f"{where} line {number}: {key!r} is {what}, of which --model {model}'s "
            f"tokenizer makes no tokens (mlx-lm: an IndexError mid-training). Remove the "
            f"line or give it text."
        )


def _tokenizer_ids(model: Any, text: str) -> list[int] | None:
    """The token ids a local model folder's ``tokenizer.json`` gives ``text`` (special
    tokens added, as mlx-lm's ``tokenizer.encode``); ``None`` where it cannot be read."""
    path = pathlib.Path(str(model)).expanduser() / "tokenizer.json"
    stamp = _stamp(path)
    tokenizer = None if stamp is None else _local_tokenizer(str(path), stamp)
    return None if tokenizer is None else tokenizer.encode(text).ids


@functools.lru_cache(maxsize=4)
def _local_tokenizer(path: str, stamp: tuple[int, int]):
    """``path`` read as a ``tokenizers`` tokenizer (once per ``stamp``); ``None`` where
    it cannot be."""
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)
    except Exception:  # noqa: BLE001 (another format, no package: left to mlx-lm)
        return None


def _blank_line(where: str, number: int) -> None:
    raise SystemExit(
        f"{where} line {number} is blank; mlx-lm reads every line as one JSON example. "
        "Remove the line."
    )


def _parse_example(where: str, number: int, line: str) -> dict:
    """One line of a data file as the JSON object it must be."""
    try:
        example = json.loads(line)
    except ValueError as e:
        raise SystemExit(f"{where} line {number} is not valid JSON ({e}).") from None
    if not isinstance(example, dict):
        raise SystemExit(
            f"{where} line {number} is a JSON {type(example).__name__}, not an object "
            f"of an example's fields."
        )
    return example


def _example_format(where, example, prompt, completion, chat, text, args) -> tuple[str, ...]:
    """The keys of the format mlx-lm picks from the first example (as its
    ``create_dataset``)."""
    if prompt in example and completion in example:
        return (prompt, completion)
    if chat in example:
        return (chat,)
    if text not in example:
        raise SystemExit(
            f"{where} line 1 has none of the keys mlx-lm reads ({text!r}; {prompt!r} "
            f"and {completion!r}; or {chat!r}; its keys: {sorted(example)!r}). See "
            "mlx-lm's LORA.md, section Data."
        )
    if getattr(args, "mask_prompt", False):
        raise SystemExit(
            f"{where} holds {text!r} examples, which have no prompt to mask: "
            f"--mask-prompt takes {prompt!r} / {completion!r} or {chat!r} examples."
        )
    return (text,)


def _check_chat_template(where: str, needed: tuple[str, ...], args: types.SimpleNamespace) -> None:
    """``prompt`` / ``completion`` and chat examples go through the tokenizer's chat
    template: a local model folder whose tokenizer has none (the demo's had none) was a
    traceback after the model loaded (found by probing). Not asked of a Hub model."""
    model = pathlib.Path(str(args.model)).expanduser()
    if not model.is_dir() or _has_chat_template(model):
        return
    raise SystemExit(
        f"{where} holds {' / '.join(map(repr, needed))} examples, which mlx-lm formats with "
        f"the tokenizer's chat template, but --model {args.model} has none (no "
        f"chat_template in tokenizer_config.json, no chat_template.jinja). Use 'text' "
        f"examples, or a model whose tokenizer has a chat template."
    )


def _has_chat_template(model: pathlib.Path) -> bool:
    """Whether a local model folder's tokenizer has a chat template (the places
    transformers reads it from)."""
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return True  # unread: left to mlx-lm
    return not isinstance(config, dict) or bool(config.get("chat_template"))


def _check_source(flag: str, value: Any, folder: str, model: bool = False) -> str:
    """``value`` must be an existing folder (a model's with config.json) or a repo id
    (``namespace/name``), and with ``HF_HUB_OFFLINE`` a model repo must be cached.
    Returns what to pass on: a folder with ``~`` expanded (mlx-lm would read an
    unexpanded one as a repo id), else ``value``."""
    value = str(value)
    p = pathlib.Path(value).expanduser()
    if p.is_dir():
        if model and not (p / "config.json").is_file():
            raise SystemExit(
                f"chunkscan lora: {flag} {value} is a folder without config.json; pass "
                f"{folder} (config.json, *.safetensors, tokenizer files) or a Hugging "
                f"Face repo id."
            )
        if model and (p / DEMO_MARKER).is_file() and _reads_as_repo_id(value):
            # a demo written at a repo id's path stood in for that repo (probing)
            print(
                f"chunkscan lora: {flag} {value} is the local folder of a tiny random "
                f"model that chunkscan lora --demo wrote (its {DEMO_MARKER}), not the "
                f"Hugging Face repo of that name; delete or rename the folder to use the "
                f"repo.",
                file=sys.stderr,
                flush=True,
            )
        return str(p)
    if p.exists():
        raise SystemExit(f"chunkscan lora: {flag} {value} is a file; pass {folder}.")
    if not _reads_as_repo_id(value):
        raise SystemExit(
            f"chunkscan lora: {flag} {value}: no such folder (and not a Hugging Face repo "
            f"id, namespace/name). Pass {folder} that exists, or a repo id such as "
            f"mlx-community/...; or try chunkscan lora --demo."
        )
    if model and _hub_offline() and not _in_hub_cache(value, "config.json"):
        raise SystemExit(
            f"chunkscan lora: {flag} {value} is not a local folder and not in the local "
            f"Hugging Face cache, and HF_HUB_OFFLINE is set, so it cannot be downloaded. "
            f"Unset HF_HUB_OFFLINE, or pass {folder} that exists."
        )
    return value


def _hub_errors() -> tuple[type[BaseException], ...]:
    try:
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover
        return ()
    return tuple(
        getattr(errors, name)
        for name in ("HfHubHTTPError", "LocalEntryNotFoundError", "HFValidationError")
        if hasattr(errors, name)
    )


def run(args: types.SimpleNamespace) -> None:
    """Run ``mlx_lm.lora.run(args)`` with the Gated DeltaNet patch applied."""
    from .. import mlx_lm as seam

    lora = _mlx_lm_lora()
    with seam.patch(chunk_size=args.gdn_chunk_size, save_states=args.gdn_save_states) as handle:
        routes = _model_routes(args.model, handle.families)
        if routes is not None and routes.lightning:
            gdn = (
                "Lightning attention (mlx-lm's recurrent_gla) training path -> "
                "chunkscan.linear_attention (its default chunk: 64 on a CPU, 256 on a GPU)"
            )
        elif routes is not None and routes.mamba:
            gdn = (
                "Mamba's selective scan (mlx-lm's per-token loop) training path -> "
                "chunkscan.selective_scan (its default chunk: 8)"
            )
        elif routes is not None and routes.rwkv7:
            gdn = (
                "RWKV-7's recurrence (mlx-lm's per-token loop) training path -> "
                "chunkscan.dplr_delta_rule (its default chunk: 8 on a CPU, 32 on a GPU)"
            )
        elif routes is not None and routes.rg_lru:
            gdn = (
                "RG-LRU's scan (mlx-lm's rnn_scan) training path -> "
                "chunkscan.diagonal_recurrence (its default chunk: 64; but mlx-lm's "
                "recurrent_gemma.Model skips nn.Module.__init__, so mlx_lm.lora's freeze "
                "and nn.value_and_grad fail on it with an AttributeError about '_no_grad', "
                'as without chunkscan: docs/mlx_lm.md, "RG-LRU")'
            )
        elif routes is not None and routes.ssd:
            gdn = (
                "Mamba2 SSD (mlx-lm's ssm_attn) training path -> chunkscan.linear_attention "
                "(calls without a padding mask; its default chunk: 64 on a CPU, 256 on a GPU)"
            )
        elif routes is not None and not routes.gated_deltanet:
            gdn = f"{routes.model_type} has no Gated DeltaNet layers"  # not "patched: qwen3_next"
        else:
            gdn = (
                f"Gated DeltaNet training path -> chunkscan.gated_delta_rule "
                f"(chunk_size={args.gdn_chunk_size}, save_states={args.gdn_save_states}; "
                f"patched: {', '.join(handle.families)})"
            )
        if routes is None:
            attention = (
                "attention training path -> chunkscan.attention (where the model calls "
                "mlx-lm's scaled_dot_product_attention without sinks or a floating mask; "
                "the first report counts each path's calls)"
            )
        elif routes.attention:  # per call: sinks and floating masks stay mlx-lm's
            attention = (
                "attention training path -> chunkscan.attention (calls without sinks or "
                "a floating mask; the first report counts each path's calls)"
            )
        else:  # gemma2 and olmo write their own softmax, plamo2 calls mx.fast's, mamba none
            attention = (
                f"{routes.model_type} does not call mlx-lm's scaled_dot_product_attention "
                f"(its attention, if any, trains as in mlx-lm)"
            )
        say(f"chunkscan: {gdn}; {attention}")
        seam.routed_calls.clear()  # patch()'s own probes called the paths
        before = _adapter_stamps(args)
        with (
            _report_peak_memory(lora, args, routes),
            _lora_keys_must_name_modules(lora),
            _resumed_weights_must_fit(lora, args),
            _say_what_a_failure_left(args, before),
        ):
            lora.run(args)
    if args.train:
        _check_saved_adapters(args)


_ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


def _check_saved_adapters(args: types.SimpleNamespace) -> None:
    """Raise ``SystemExit`` where the adapters a training run saved hold a value that is
    not finite. The loss check (:class:`_Reports`) sees each report's loss, computed
    before that step's update, so a divergence in the last steps was saved as NaN
    adapters, exit 0 (found by probing). A missing file is mlx-lm's to explain."""
    path = pathlib.Path(args.adapter_path, _ADAPTER_FILES[0])
    if not path.is_file():
        return
    saved = mx.load(str(path))
    bad = [name for name, value in saved.items() if not mx.isfinite(value).all().item()]
    if bad:
        raise SystemExit(
            f"{PROG}: the adapters saved in {path} hold NaN or inf values ({len(bad)} of "
            f"{len(saved)} tensors: {_some(sorted(bad))}): training diverged after the last "
            f"loss report. Do not use them; train again with a lower --learning-rate (or "
            f"lr_schedule), or a float32 model where this one is float16."
        )


def _adapter_stamps(args: types.SimpleNamespace) -> tuple | None:
    """The size and time of ``adapters.safetensors`` and ``adapter_config.json`` in the
    folder a training run writes, as they are now (``None`` for a missing file)."""
    path = getattr(args, "adapter_path", None)
    if not args.train or not isinstance(path, str) or path == "":
        return None
    return tuple(_stamp(pathlib.Path(path, name)) for name in _ADAPTER_FILES)


def _stamp(path: pathlib.Path) -> tuple[int, int] | None:
    """A file's time and size; ``None`` for no file (a folder of that name was called
    an earlier run's weights; found by probing)."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def _say_what_a_failure_left(args: types.SimpleNamespace, before: tuple | None):
    """Where a training run fails after mlx-lm has written its ``adapter_config.json``
    (first) and before the weights (at the end), an earlier run's weights are left
    beside this run's config, which ``--test`` or ``mlx_lm.load`` would read as this
    run's: say so on stderr (found by probing)."""
    try:
        yield
    except BaseException:
        if before is not None:
            weights, config = before
            now_weights, now_config = _adapter_stamps(args)
            if weights is not None and now_weights == weights and now_config != config:
                print(
                    f"{PROG}: this run failed before saving its weights: "
                    f"{pathlib.Path(args.adapter_path, _ADAPTER_FILES[0])} is still an "
                    f"earlier run's, beside this run's {_ADAPTER_FILES[1]} (delete both, "
                    f"or train again, before testing or loading them).",
                    file=sys.stderr,
                    flush=True,
                )
        raise


class _Routes(NamedTuple):
    model_type: str
    gated_deltanet: bool  # runs a patched family's Gated DeltaNet layers
    attention: bool  # some module of the model holds the patched attention
    lightning: bool = False  # runs a family whose recurrent_gla is patched (Bailing linear)
    ssd: bool = False  # its layers' modules call a patched ssm_attn's module (Mamba2)
    mamba: bool = False  # runs a family whose Mamba layer method is patched (mamba, jamba)
    rwkv7: bool = False  # runs a family whose RWKV-7 layer method is patched (rwkv7)
    rg_lru: bool = False  # runs a family whose rnn_scan is patched (recurrent_gemma)


def _model_routes(model: str, families: tuple[str, ...]) -> _Routes | None:
    """What the patch reaches in the model of a local model folder, found as mlx-lm
    finds it (``model_type`` remapped by its architecture); ``None`` where this cannot
    be told (a Hub id, an unreadable config). Gated DeltaNet: the model runs one of
    ``families``' layers (the seam's own test, ``chunkscan.mlx_lm._covered``; the raw
    ``model_type`` was not enough: Bailing MoE V3 checkpoints say ``bailing_hybrid``,
    and a family may subclass a patched one; found by review). Attention: a module of
    the model's layers holds the patch's attention by the seam's name (``_ATTN``);
    gemma2 and olmo compute attention themselves and plamo2 calls ``mx.fast``'s, so the banner
    said "attention training path -> chunkscan.attention" for runs that never called it
    (found by probing)."""
    from .. import mlx_lm as seam

    try:
        with open(pathlib.Path(model, "config.json")) as f:
            config = json.load(f)
        from mlx_lm.utils import _get_classes

        model_class = _get_classes(config)[0]
        module = model_class.__module__  # mlx_lm.models.<remapped type>
        patched = {f"mlx_lm.models.{name}" for name in families}
        covered = seam._covered(module.rsplit(".", 1)[1], patched)
        lightning = {f"mlx_lm.models.{name}" for name in seam.lightning_patched_modules()}
        lightning_covered = seam._covered(module.rsplit(".", 1)[1], lightning)
        modules = _layer_modules(model_class)
    except Exception:  # noqa: BLE001 (any failure: say nothing about the routes)
        return None
    installed = seam._INSTALLED_ATTENTION
    attention = any(getattr(m, seam._ATTN, None) is installed for m in modules)
    # Mamba2: a layer's module imports ssm_update from the module whose ssm_attn is rebound
    ssd_modules = {f"mlx_lm.models.{name}" for name in seam.ssd_patched_modules()}
    ssd = any(
        callable(value) and getattr(value, "__module__", None) in ssd_modules
        for m in modules
        for value in vars(m).values()
    )
    mamba = {f"mlx_lm.models.{name}" for name in seam.mamba_patched_modules()}
    mamba_covered = seam._covered(module.rsplit(".", 1)[1], mamba)
    rwkv7 = {f"mlx_lm.models.{name}" for name in seam.rwkv7_patched_modules()}
    rwkv7_covered = seam._covered(module.rsplit(".", 1)[1], rwkv7)
    rg_lru = {f"mlx_lm.models.{name}" for name in seam.rg_lru_patched_modules()}
    rg_lru_covered = seam._covered(module.rsplit(".", 1)[1], rg_lru)
    return _Routes(str(config["model_type"]), covered, attention, lightning_covered, ssd,
                   mamba_covered, rwkv7_covered, rg_lru_covered)  # fmt: skip


def _layer_modules(model_class: type) -> list[types.ModuleType]:
    """The ``mlx_lm.models`` modules that define ``model_class``, its bases, and the
    ``nn.Module`` classes and modules their modules name, transitively (qwen3_5 names
    qwen3_next's attention layer, gemma3 the module gemma3_text)."""
    import mlx.nn as nn

    seen: dict[str, types.ModuleType] = {}
    todo = [c.__module__ for c in model_class.__mro__]
    while todo:
        name = todo.pop()
        # base defines the attention function (the patch rebinds it there too): no layer
        if name in seen or not name.startswith("mlx_lm.models.") or name.endswith(".base"):
            continue
        seen[name] = module = sys.modules[name]
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, nn.Module):
                todo.append(value.__module__)
            elif isinstance(value, types.ModuleType):  # gemma3: from . import gemma3_text
                todo.append(value.__name__)
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chunkscan lora``. Its stdout is guarded for the whole command
    (:func:`guarded_stdout`): a reader that leaves (``| head -1``) ends neither
    chunkscan's lines nor mlx-lm's (its ``print`` and rich console wrote to the closed
    pipe and lost the run; found by review, session 50); they go to ``os.devnull``."""
    with guarded_stdout():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # a user's setting kept (probing)
    if not argv:
        build_parser().print_usage(sys.stderr)
        print(
            "chunkscan lora: no arguments. Pass --model (a folder or a Hugging Face repo "
            "id), --data and --train, plus any mlx_lm.lora flag; or try --demo (offline).",
            file=sys.stderr,
        )
        return 2
    args = resolve_args(argv)  # --demo (or an abbreviation, or demo: true in -c) decides
    if not args.demo:
        check_args(args)
        try:
            run(args)
        except _hub_errors() as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(
                f"chunkscan lora: a Hugging Face Hub lookup failed for --model "
                f"{args.model} or --data {args.data} ({type(e).__name__}: {first}). "
                "Check the repo id and the network, or pass local folders."
            ) from None
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="chunkscan-lora-demo-") as demo_dir:
        with warnings.catch_warnings():  # the first resolve_args gave its warnings
            warnings.simplefilter("ignore")
            args = resolve_args(argv, demo_dir)
        # ~ expanded as without --demo (_check_source): '~/dm/model' from -c or quoted
        # was a folder named ~ in the working folder (found by probing, session 49)
        for key in ("model", "data"):
            if isinstance(getattr(args, key, None), str):
                setattr(args, key, os.path.expanduser(getattr(args, key)))
        # The checks made without --demo: the demo's folders may be the user's own
        # (a --data folder it uses as it is; found by probing)
        _check_something_to_do(args)
        _check_adapter_paths(args)
        _check_resumed_adapters(args)
        adapters = _demo_adapter_folder(args, demo_dir)  # (refuses before any writing)
        _write_demo(args)
        _check_local_inputs(args)
        if adapters is not None:
            _mark_demo_folder(adapters)
        # stdout's prints by say(): `chunkscan lora --demo | head -1` raised
        # BrokenPipeError at the next line and lost the run (found by probing)
        say(_demo_banner(args.model))
        run(args)
        where = _demo_kept(args, demo_dir)
        say(
            f"chunkscan lora --demo: done; process peak memory "
            f"{mx.get_peak_memory() / MiB:,.0f} MiB; {where}"
        )
    return 0
