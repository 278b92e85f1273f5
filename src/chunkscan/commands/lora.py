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
:func:`chunkscan.commands._lora_data._read_examples`) and none is empty, that the numbers
mlx-lm takes unchecked are in range (``--batch-size``, ``--iters``, ``--num-layers``,
``--val-batches``, ``--learning-rate``, ...: :data:`_WHOLE_NUMBERS`; ``--batch-size -2``
hung mlx-lm for ever, ``--num-layers 0`` trained every layer; ``--iters`` at least
``--grad-accumulation-steps``), that an ``lr_schedule`` builds, its rate within
``--learning-rate``'s bounds at every step up to ``--iters``, and ``--report-to`` names
installed services, that the YAML file decodes and parses, its ``optimizer_config``
builds the optimizer mlx-lm builds (:func:`_check_optimizer_config`), and that a
``--resume-adapter-file`` comes with ``--train`` (one from ``-c`` without it: a warning
that it is not read), loads,
and has this run's fine-tune type, rank and scale, its layers and projections among
those this run wraps (:func:`chunkscan.commands._lora_adapters._check_resumed_adapters`),
and says what is wrong; a failed Hub download is reported in one line, not as a
traceback. Once the model is wrapped, a resumed file's tensors must all name its
parameters, with their shapes
(:func:`chunkscan.commands._lora_adapters._check_resumed_weights_fit`); after training,
the saved adapters must be finite
(:func:`chunkscan.commands._lora_adapters._check_saved_adapters`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import re
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
from ._lora_adapters import (
    _adapter_stamps,
    _check_adapter_paths,
    _check_resumed_adapters,
    _check_saved_adapters,
    _resumed_weights_must_fit,
    _say_what_a_failure_left,
)
from ._lora_common import (
    PROG,
    _is_number,
    _is_whole,
    _layer_count,
    _model_config,
    _rebound,
    _some,
)
from ._lora_data import _check_data
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
            f"{PROG}: mlx_lm.lora {getattr(mlx_lm, '__version__', '?')} has no "
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
        except UnicodeDecodeError as e:  # a traceback (found by probing, session 52)
            raise SystemExit(_not_text(args["config"], e)) from None
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
    # The demo's settings in both passes of _main (its folders only once they exist):
    # the first pass, without them, checked the grad-accumulation remainder and an
    # lr_schedule up to mlx-lm's --iters 1000, not the demo's 30, and the second pass's
    # warnings are silenced (found by probing, session 52)
    if args.get("demo"):
        demo = dict(DEMO_DEFAULTS)
        if demo_dir is not None:
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
    _check_optimizer_config(args)
    _check_report_to(args)
    return types.SimpleNamespace(**args)


def _not_text(path: str, error: UnicodeDecodeError) -> str:
    """The message for a ``-c`` file whose bytes do not decode as the text ``open``
    reads (the locale's encoding, as ``mlx_lm.lora`` opens it; UTF-8 almost everywhere):
    a Latin-1 comment was a ``UnicodeDecodeError`` traceback (found by probing, session
    52). Its line and byte are counted in the raw bytes (the text layer decodes a chunk
    at a time, so the error's position is the chunk's)."""
    try:
        with open(path, "rb") as raw:
            data = raw.read()
        data.decode(error.encoding)
        at = None
    except (OSError, LookupError):
        at = None
    except UnicodeDecodeError as e:
        at = e.start
    where, encoding = "", error.encoding.upper()  # (utf-8: UTF-8)
    if at is not None:
        line = len(re.findall(rb"\r\n|\r|\n", data[:at])) + 1
        where = f" at line {line} (byte {at} of the file)"
    return (
        f"{PROG}: -c {path}: the config file is not {encoding} text{where}; "
        f"mlx_lm.lora reads it as {encoding}. Convert the file, or pass another file."
    )


def _unread_resume_from_config(args: dict, given: set[str]) -> None:
    """A ``resume_adapter_file`` from ``-c`` (not in ``given``, the command line's) in a
    run that does not train is not read: mlx-lm reads it only when training, and runs a
    ``--test`` whose config names one. So it is not refused (that came with a message
    naming a flag the user never passed; found by review, session 50): a warning says
    it is not read, and it is dropped. ``--resume-adapter-file`` on the command line
    without ``--train`` is refused
    (:func:`chunkscan.commands._lora_adapters._check_resumed_adapters`)."""
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


def _optimizer_classes() -> dict[str, type]:
    """The optimizer classes ``mlx_lm.lora``'s ``train_model`` builds, by the names it
    reads (its ``--optimizer`` choices, lower-cased)."""
    import mlx.optimizers as optim

    return {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon, "sgd": optim.SGD,
            "adafactor": optim.Adafactor}  # fmt: skip


def _check_optimizer_config(args: dict) -> None:
    """With ``--train``, ``optimizer_config`` (YAML only; it replaces mlx-lm's whole) as
    mlx-lm's ``train_model`` reads it: ``optimizer_config.get(<--optimizer, lower-cased>,
    {})``, then ``<its class>(learning_rate=..., **that)``. So it must be a mapping, the
    chosen optimizer's entry a mapping that sets no ``learning_rate`` (mlx-lm passes its
    own), and the class must take its keywords: built here with a stand-in rate (cheap).
    Found by probing, session 52: ``5``, ``{adam: {bogus: 1}}`` and ``{adam:
    {learning_rate: 0.1}}`` failed after the model loaded and after mlx-lm had rewritten
    ``adapter_config.json``. A key that names no optimizer (``Adam``: mlx-lm looks up
    the lower-cased name) is never read: a warning. The other optimizers' entries are
    not read either, nor checked."""
    if not args.get("train"):
        return
    config, name = args.get("optimizer_config"), args.get("optimizer")
    classes = _optimizer_classes()
    if not isinstance(name, str) or name.lower() not in classes:
        return  # (a YAML optimizer is checked with its flag's choices; left to mlx-lm)
    name = name.lower()
    where = f"{PROG}: optimizer_config (from -c {args.get('config')})"
    example = "{adamw: {weight_decay: 0.01}}"
    if not isinstance(config, dict):
        raise SystemExit(
            f"{where} must be a mapping of optimizer names to their settings, such as "
            f"{example}, not {config!r}."
        )
    unread = [repr(key) for key in config if key not in classes]
    if unread and config is not _mlx_lm_lora().CONFIG_DEFAULTS.get("optimizer_config"):
        warnings.warn(
            f"{where}: {_some(unread)} name{'s' if len(unread) == 1 else ''} no optimizer "
            f"mlx-lm builds ({', '.join(classes)}, lower-case), so "
            f"{'it is' if len(unread) == 1 else 'they are'} not read.",
            UserWarning,
            stacklevel=3,
        )
    settings = config.get(name, {})
    if not isinstance(settings, dict):
        raise SystemExit(
            f"{where}: {name} (this run's --optimizer) must be a mapping of "
            f"{classes[name].__name__}'s keywords (or be left out), not {settings!r}."
        )
    if "learning_rate" in settings:
        raise SystemExit(
            f"{where}: {name} sets learning_rate, which mlx-lm passes itself (from "
            f"--learning-rate or lr_schedule). Remove it; set --learning-rate (YAML: "
            f"learning_rate) instead."
        )
    try:
        classes[name](learning_rate=1e-5, **settings)
    except Exception as e:  # noqa: BLE001 (any of the class's own errors)
        raise SystemExit(
            f"{where}: mlx-lm's mlx.optimizers.{classes[name].__name__}(learning_rate=..., "
            f"**{settings!r}) fails ({type(e).__name__}: {e}). Give it the keywords (and "
            f"values) {classes[name].__name__} takes."
        ) from None


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
            f"MLX peak memory so far {mx.get_peak_memory() / MiB:,.0f} MiB"
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
    # mlx-lm's Metal kernel on an Apple GPU, its per-token loop elsewhere (the note named
    # a kernel, where a CPU or CUDA run went through the loop; found by probing)
    validation = (
        ", which runs Gated DeltaNet through mlx-lm's own path: its Metal kernel on an Apple "
        "GPU, its per-token loop elsewhere"
        if has_gdn
        else ""
    )
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
            f"{PROG}: {source} is a Hugging Face dataset, which mlx-lm reads with "
            f"the datasets package, not installed here: pip install datasets (or "
            f"'mlx-lm[train]'), or pass a local data folder."
        )


def _check_something_to_do(args: types.SimpleNamespace) -> None:
    """``--train`` or ``--test`` (with ``--demo`` too: ``train: false`` in its ``-c``
    wrote and loaded the model, then failed; found by probing)."""
    if not args.train and not args.test:
        demo = "" if getattr(args, "demo", False) else "; or --demo for an offline demo"
        raise SystemExit(
            f"{PROG}: nothing to do: pass --train (finetune) and/or --test "
            f"(evaluate), as with mlx_lm.lora{demo}."
        )


def _check_local_inputs(args: types.SimpleNamespace) -> None:
    """What can be told of a local ``--data`` and ``--model`` folder before anything
    loads (with and without ``--demo``, whose folders may be the user's: it skipped
    these before; found by probing): :func:`chunkscan.commands._lora_data._check_data` and
    :func:`_check_layers`."""
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
            f"{PROG}: --model {args.model} holds no model*.safetensors (the "
            f"weights mlx-lm loads). Pass a converted MLX model folder (mlx_lm.convert)."
        )
    where = f"{PROG}: --model {args.model}: config.json"
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
# ... but not these, which the patterns match and which hold a tokenizer's settings, not
# the tokenizer: a folder with tokenizer_config.json alone passed, then transformers
# failed with a 30-line traceback while mlx-lm loaded it (found by probing, session 52)
_TOKENIZER_SETTINGS = frozenset({"tokenizer_config.json"})


def _check_tokenizer_files(model: str) -> None:
    """A local model folder holds some tokenizer's files (its settings alone,
    :data:`_TOKENIZER_SETTINGS`, are none): with none, mlx-lm loaded a tokenizer that
    turned every example into no tokens, and training stopped at its first batch with an
    ``IndexError`` traceback from mlx-lm's data set (found by probing, session 40)."""
    folder = pathlib.Path(model)
    found = (p for pattern in _TOKENIZER_FILES for p in folder.glob(pattern))
    if not any(p.name not in _TOKENIZER_SETTINGS for p in found):
        settings = sorted(p.name for p in folder.glob("*") if p.name in _TOKENIZER_SETTINGS)
        only = f"; its {', '.join(settings)} holds settings, not a tokenizer" if settings else ""
        raise SystemExit(
            f"{PROG}: --model {model} holds no tokenizer files (tokenizer.json, "
            f"tokenizer.model, vocab.json, ...{only}: mlx-lm loads the tokenizer from the "
            f"model folder). Copy them from the model's source, or pass the source's name."
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
            f"{PROG}: --num-layers {args.num_layers}"
            f"{' (mlx_lm.lora default)' if default else ''} "
            f"asks for more layers than --model {args.model} has ({count}: "
            f"num_hidden_layers in its config.json). Pass --num-layers {count} or less, "
            f"or -1 for all of them."
        )


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
                f"{PROG}: {flag} {value} is a folder without config.json; pass "
                f"{folder} (config.json, *.safetensors, tokenizer files) or a Hugging "
                f"Face repo id."
            )
        if model and (p / DEMO_MARKER).is_file() and _reads_as_repo_id(value):
            # a demo written at a repo id's path stood in for that repo (probing)
            print(
                f"{PROG}: {flag} {value} is the local folder of a tiny random "
                f"model that chunkscan lora --demo wrote (its {DEMO_MARKER}), not the "
                f"Hugging Face repo of that name; delete or rename the folder to use the "
                f"repo.",
                file=sys.stderr,
                flush=True,
            )
        return str(p)
    if p.exists():
        raise SystemExit(f"{PROG}: {flag} {value} is a file; pass {folder}.")
    if not _reads_as_repo_id(value):
        raise SystemExit(
            f"{PROG}: {flag} {value}: no such folder (and not a Hugging Face repo "
            f"id, namespace/name). Pass {folder} that exists, or a repo id such as "
            f"mlx-community/...; or try chunkscan lora --demo."
        )
    if model and _hub_offline() and not _in_hub_cache(value, "config.json"):
        raise SystemExit(
            f"{PROG}: {flag} {value} is not a local folder and not in the local "
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
            f"{PROG}: no arguments. Pass --model (a folder or a Hugging Face repo "
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
                f"{PROG}: a Hugging Face Hub lookup failed for --model "
                f"{args.model} or --data {args.data} ({type(e).__name__}: {first}). "
                "Check the repo id and the network, or pass local folders."
            ) from None
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="chunkscan-lora-demo-") as demo_dir:
        with warnings.catch_warnings():  # the first resolve_args gave its warnings (the
            # same: it read the demo's settings too)
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
            f"chunkscan lora --demo: done; MLX peak memory "
            f"{mx.get_peak_memory() / MiB:,.0f} MiB; {where}"
        )
    return 0
