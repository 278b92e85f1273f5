"""The checks of a ``chunkscan lora`` run's settings, made before anything loads: the
YAML file of ``-c`` (it decodes and parses, holds a mapping of known keys, and the values
of flags the parser checks, as the parser checks them: :func:`_check_config`,
:func:`_check_config_values`), the numbers mlx-lm takes unchecked
(:func:`_check_numbers`), an ``lr_schedule``'s rates, ``lora_parameters``, an
``optimizer_config`` (:func:`_check_optimizer_config`) and ``--report-to``
(:func:`_check_report_to`)."""

from __future__ import annotations

import argparse
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .._tree import with_article
from ._lora_common import PROG, _is_number, _is_whole, _mlx_lm_lora, _some
from ._lora_demo import DEMO_DEFAULTS

# The deprecated spelling of --gdn-chunk-size / gdn_chunk_size (a YAML key of that name
# is known, and warned about by the command)
_OLD_FLAG, _OLD_KEY = "--scan-chunk-size", "scan_chunk_size"


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
