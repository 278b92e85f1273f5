"""Run-time checks of what chunkscan relies on in MLX."""

from __future__ import annotations

import re

import mlx.core as mx

MIN_MLX = (0, 32, 4)


def _parse(version: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a version string; a pre-release such as ``0.32.4rc1``
    (also ``-rc1``, ``.rc1``, ``c1``, ``a``, ``b``, ``alpha``, ``beta``, ``pre``,
    ``preview``, ``dev``) reads as the release before it (``(0, 32, 3)``: it lacks what
    the release has); a leading ``v`` and an epoch (``1!``) are skipped, and a piece's
    trailing letters do not join its digits (``0.32.3rc1`` read as 0.32.31 before)."""
    text = version.strip().lower().split("!")[-1].lstrip("v")
    release = re.match(r"\d+(?:\.\d+)*", text)
    parts = [int(p) for p in release.group(0).split(".")[:3]] if release else []
    parts += [0] * (3 - len(parts))
    rest = text[release.end() :] if release else ""
    if re.match(r"[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)", rest):
        parts = _before(parts)
    return tuple(parts)


def _before(parts: list[int]) -> list[int]:
    """The release just before ``parts`` in this ordering (0.32.4 -> 0.32.3; 0.33.0 ->
    0.32.999)."""
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] > 0:
            return parts[:i] + [parts[i] - 1] + [999] * (len(parts) - i - 1)
    return parts


def check_mlx() -> None:
    """Raise ``ImportError`` when the installed MLX lacks what chunkscan needs."""
    needed = ("depends", "custom_function", "vjp", "result_type")
    missing = [name for name in needed if not hasattr(mx, name)]
    version = getattr(mx, "__version__", "unknown")
    if missing or _parse(version) < MIN_MLX:
        raise ImportError(
            f"chunkscan needs mlx >= {'.'.join(map(str, MIN_MLX))} with mx.depends and "
            f"mx.custom_function, but found mlx {version}"
            + (f" without {', '.join('mx.' + m for m in missing)}" if missing else "")
            + ". Upgrade with: pip install -U 'mlx>=0.32.4'."
        )
