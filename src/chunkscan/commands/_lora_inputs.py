"""The checks of a ``chunkscan lora`` run's sources, made before anything loads: that
there is something to do, that ``--model`` and ``--data`` name an existing folder or a
Hugging Face repo id (:func:`_check_source`), what a local model folder holds (weights,
a known ``model_type``, tokenizer files, enough layers) and, through
:mod:`chunkscan.commands._lora_data` and :mod:`chunkscan.commands._lora_adapters`,
its data files and adapter paths (:func:`check_args`, the whole list)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import types
from typing import Any

import mlx.core as mx

from ._lora_adapters import _check_adapter_paths, _check_resumed_adapters
from ._lora_common import PROG, _layer_count, _mlx_lm_lora, _model_config
from ._lora_data import _check_data
from ._lora_demo import DEMO_MARKER, _reads_as_repo_id


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
    these before; found by probing): :func:`chunkscan.commands._lora_data._check_data`,
    :func:`_check_layers` and :func:`_check_full_fine_tune`."""
    if not getattr(args, "hf_dataset", None) and pathlib.Path(args.data).is_dir():
        _check_data(args)
    _check_model_type(args)
    _check_layers(args)
    _check_full_fine_tune(args)


def _check_full_fine_tune(args: types.SimpleNamespace) -> None:
    """``--fine-tune-type full`` trains every weight, and MLX cannot differentiate a
    quantized one (``QuantizedMatmul::vjp``): with a quantized local model mlx-lm ran
    validation, wrote its ``adapter_config.json`` and failed at the first step with a
    traceback (found by probing, session 54). Quantized as mlx-lm tells it: a layer
    whose weights come with ``scales`` (its ``load_model`` quantizes those), read off
    the tensor names of ``model*.safetensors`` (``mx.load`` is lazy: no data is read;
    ``config.json``'s keys alone missed a nested ``quantization_config`` and refused an
    fp8 one that mlx-lm dequantizes; review)."""
    if not args.train or getattr(args, "fine_tune_type", None) != "full":
        return
    for path in sorted(pathlib.Path(args.model).glob("model*.safetensors")):
        try:
            names = mx.load(str(path)).keys()
        except Exception:  # noqa: BLE001 (an unreadable file is mlx-lm's to report)
            return
        scaled = next((n for n in names if n.endswith(".scales")), None)
        if scaled is not None:
            raise SystemExit(
                f"{PROG}: --fine-tune-type full on --model {args.model}, a quantized model "
                f"({path.name} holds {scaled}): MLX cannot differentiate quantized weights. "
                f"Train lora or dora adapters on it (QLoRA), or fully fine-tune the model "
                f"before quantization."
            )


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
