"""``unit_lower_inverse``: ``(I + L)^-1`` for strictly lower triangular ``L``, in
products only (every backend), with its vjp; the UT inverse of the WY preparation
(:mod:`.chunk`, :mod:`._channel`)."""

from __future__ import annotations

import mlx.core as mx

from ... import _tree

_SMALL = 8  # below this block size the triangular inverse uses elementwise products


@mx.custom_function
def unit_lower_inverse(lower: mx.array) -> mx.array:
    """``(I + lower)^-1`` for strictly lower triangular ``lower`` ``[..., n, n]``.

    Recursive 2x2 block inversion, all blocks of one size at once:
    ``[[X11, 0], [-X22 L21 X11, X22]]``. Products only, so it runs on every backend.
    Only the strictly lower part of ``lower`` is read, in the value and the gradient:
    the diagonal and the upper part get a zero gradient. A ``lower`` that is not a
    square ``[..., n, n]`` raises ``ValueError`` (MLX's stack or pad errors before;
    found by probing).
    """
    if not isinstance(lower, mx.array) or lower.ndim < 2 or lower.shape[-1] != lower.shape[-2]:
        got = tuple(lower.shape) if isinstance(lower, mx.array) else type(lower).__name__
        raise ValueError(
            f"[unit_lower_inverse] lower must be a square [..., n, n] array but got {got}."
        )
    n = lower.shape[-1]
    size = 1 << (n - 1).bit_length()
    batch = tuple(lower.shape[:-2])
    if size != n:
        lower = mx.pad(lower, [(0, 0)] * len(batch) + [(0, size - n), (0, size - n)])
    off_diagonal = []
    blocks = mx.expand_dims(lower, -3)  # [..., 1, size, size]
    b = size
    while b > 1:
        h = b // 2
        off_diagonal.append(blocks[..., h:, :h])
        blocks = mx.stack([blocks[..., :h, :h], blocks[..., h:, h:]], axis=-3)
        blocks = blocks.reshape(batch + (-1, h, h))
        b = h
    x = mx.ones(batch + (size, 1, 1), dtype=lower.dtype)
    for l21 in reversed(off_diagonal):
        p, h = l21.shape[-3], l21.shape[-1]
        x = x.reshape(batch + (p, 2, h, h))
        x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
        x21 = -_mm(x22, _mm(l21, x11))
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        bottom = mx.concatenate([x21, x22], axis=-1)
        x = mx.concatenate([top, bottom], axis=-2)
    x = x.reshape(batch + (size, size))
    return x[..., :n, :n] if size != n else x


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    x = _tree.as_list(output)[0]
    ct = _tree.as_list(cotangent)[0]
    xt = x.swapaxes(-1, -2)
    # the value reads the strictly lower part only: the rest gets no gradient (it got
    # -X^T ct X^T's entries there; found by probing, session 40)
    return mx.tril(-(xt @ (ct @ xt)), k=-1)


def _mm(a: mx.array, b: mx.array) -> mx.array:
    """Matrix product; small blocks as broadcast products (BLAS calls cost more)."""
    if a.shape[-1] < _SMALL:
        return mx.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return a @ b
