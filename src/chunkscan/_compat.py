"""Run-time checks of what chunkscan relies on in MLX."""

from __future__ import annotations

import mlx.core as mx

MIN_MLX = (0, 32, 4)


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_mlx() -> None:
    """Raise ``ImportError`` when the installed MLX lacks what chunkscan needs."""
    missing = [name for name in ("depends", "custom_function", "vjp") if not hasattr(mx, name)]
    version = getattr(mx, "__version__", "unknown")
    if missing or _parse(version) < MIN_MLX:
        raise ImportError(
            f"chunkscan needs mlx >= {'.'.join(map(str, MIN_MLX))} with mx.depends and "
            f"mx.custom_function, but found mlx {version}"
            + (f" without {', '.join('mx.' + m for m in missing)}" if missing else "")
            + ". Upgrade with: pip install -U 'mlx>=0.32.4'."
        )
