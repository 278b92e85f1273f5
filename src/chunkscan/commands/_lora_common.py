"""Helpers that ``chunkscan lora`` (:mod:`chunkscan.commands.lora`) shares with its
checks of data files (:mod:`chunkscan.commands._lora_data`) and of adapters
(:mod:`chunkscan.commands._lora_adapters`) and the modules beside them: the command's name
in messages, ``mlx_lm.lora`` with the names the command uses of it, reading a
local model folder's ``config.json`` and its layer count, a file's time and size, a
rebinding kept to a block, and the lists of names a message shows."""

from __future__ import annotations

import contextlib
import json
import pathlib
import stat
from collections.abc import Callable
from typing import Any

PROG = "chunkscan lora"
MiB = 1024.0 * 1024.0


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


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@contextlib.contextmanager
def _rebound(module: Any, name: str, wrap: Callable[[Any], Any]):
    """``module.<name>`` rebound to ``wrap(original)`` inside the block, restored on exit."""
    original = getattr(module, name)
    setattr(module, name, wrap(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _some(names: list[str], n: int = 3) -> str:
    """The first ``n`` of ``names``, then ``...`` where there are more: every message
    that lists some of many names says it so (four had written it out; review)."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


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
