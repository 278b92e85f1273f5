"""The checks of a ``chunkscan lora`` run's adapters: ``--adapter-path`` where training
writes (:func:`_check_adapter_paths`), a ``--resume-adapter-file`` against this run's
settings before loading (:func:`_check_resumed_adapters`) and against the wrapped model
once it exists (:func:`_resumed_weights_must_fit`), the saved adapters after training
(:func:`_check_saved_adapters`), and what a failed run left in ``--adapter-path``
(:func:`_say_what_a_failure_left`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import sys
import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ._lora_common import PROG, _layer_count, _model_config, _rebound, _some, _stamp

_ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
            f"{PROG}: --adapter-path '' means no adapters (--test of the model "
            "alone); training writes its adapters into a folder. Pass one."
        )
    if not isinstance(path, str) or path == "":
        return
    where = pathlib.Path(path)
    if args.train:
        for p in (where, *where.parents):
            if p.is_symlink() and not p.exists():
                raise SystemExit(
                    f"{PROG}: --adapter-path {path}: {p} is a broken link; "
                    f"training makes a folder there. Pass another folder."
                )
            if p.exists():
                if not p.is_dir():
                    raise SystemExit(
                        f"{PROG}: --adapter-path {path}: {p} is a file; training "
                        f"writes its adapters into a folder there. Pass a folder."
                    )
                # mlx-lm's PermissionError came after the model had loaded (probing)
                if not os.access(p, os.W_OK | os.X_OK):
                    raise SystemExit(
                        f"{PROG}: --adapter-path {path}: {p} is not writable; "
                        f"training writes its adapters there. Pass a writable folder."
                    )
                break
        _check_adapter_files(path)
    elif args.test:
        missing = [f for f in ("adapters.safetensors", "adapter_config.json")
                   if not (where / f).is_file()]  # fmt: skip
        if missing:
            raise SystemExit(
                f"{PROG}: --test reads a trained run's adapters from --adapter-path "
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
            f"{PROG}: --resume-adapter-file {resume} is read only with --train "
            f"(training resumes from it); --test alone reads the adapters in "
            f"--adapter-path ({args.adapter_path!r}). Pass --train, or pass the adapters' "
            f"folder as --adapter-path instead."
        )
    path = pathlib.Path(str(resume)).expanduser()
    if not path.is_file():
        raise SystemExit(
            f"{PROG}: --resume-adapter-file {resume}: no such file. Pass the "
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
                f"{PROG}: --resume-adapter-file {resume} was trained with {what} "
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
            f"{PROG}: --resume-adapter-file {resume} holds {kind} weights (its "
            f"tensor names), this run asks for --fine-tune-type {args.fine_tune_type}: "
            f"mlx-lm would load it anyway (strict=False) and drop what this run does not "
            f"train. Pass --fine-tune-type {kind}, or start without --resume-adapter-file."
        )
    ranks, now = _lora_ranks(tensors), lora_parameters.get("rank")
    # the file's own shapes: a file without its adapter_config.json beside it went
    # unchecked (found by probing: rank 4 resumed at 8, exit 0, adapters that do not load)
    if args.fine_tune_type != "full" and ranks and isinstance(now, int) and ranks != {now}:
        raise SystemExit(
            f"{PROG}: --resume-adapter-file {resume} holds adapters of rank "
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
        f"{PROG}: --resume-adapter-file {resume} is not a weights file mlx-lm can "
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
                f"{PROG}: --resume-adapter-file {resume} holds adapters of "
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
                f"{PROG}: --resume-adapter-file {resume} holds adapters of "
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


def _check_saved_adapters(args: types.SimpleNamespace) -> None:
    """Raise ``SystemExit`` where the adapters a training run saved hold a value that is
    not finite. The loss check (:class:`chunkscan.commands._lora_reports._Reports`) sees each
    report's loss, computed before that step's update, so a divergence in the last steps
    was saved as NaN adapters, exit 0 (found by probing). A missing file is mlx-lm's to explain."""
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
