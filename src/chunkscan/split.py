"""``split``: cut an array into chunks whose gradient is concatenated, not summed.

MLX's slice ``x[lo:hi]`` has the vjp ``slice_update(zeros_like(x), g)``: each chunk's
gradient is a zero-padded buffer as large as ``x``, and a chunk loop sums T/C of them.
``mx.split`` builds a single ``Split`` primitive only for fewer than 10 pieces. The
split here is one custom function for up to ``_FAN_OUT`` (16) pieces: forward slices
(views), backward one concatenate of the piece cotangents (ordering rule 4 in
:mod:`chunkscan._ordering`). More pieces are cut as a tree of such functions
(:func:`split_at`), whose gradient is one concatenate per node: each level of the tree
copies the cotangents at most once.

Pieces are cut with one ``Slice`` each (:func:`slices_at`), never with the
multi-output ``Split`` primitive: ``mx.compile`` (mlx <= 0.32.4) can merge two
equivalent multi-output primitives in the wrong direction (``tape_order`` in
``compile_simplify`` records only one output of each) and then fails with
``IndexError: _Map_base::at``. See docs/design.md.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys

import mlx.core as mx

from . import _tree


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` covering ``range(length)``; the last chunk may be short."""
    return [(lo, min(lo + chunk_size, length)) for lo in range(0, length, chunk_size)]


def sqrt_blocks(n: int) -> list[tuple[int, int]]:
    """:func:`chunk_bounds` of ``n`` items in about ``sqrt(n)`` blocks of about
    ``sqrt(n)``: how ``scan`` (its saved carries) and ``linear_attention`` (its saved
    group states) stack the arrays their custom functions return, so that the outputs,
    and the sibling list MLX gives each (docs/design.md, "Many outputs"), stay ``O(n)``
    in all."""
    return chunk_bounds(n, math.isqrt(n - 1) + 1 if n else 1)


def check_chunk_size(
    fn: str, chunk_size: object, *, example: int = 32, none: str | None = None
) -> int | None:
    """The one check of every ``chunk_size`` argument in chunkscan (scan, split, the
    ops, :func:`chunkscan.mlx_lm.patch`, ``chunkscan lora``).

    ``chunk_size`` must be an integer ``>= 1`` (a Python or NumPy int; a ``bool`` is not
    an int here); ``None`` passes only where ``none`` says what it means (e.g. ``"for
    the automatic size"``). ``example`` is the value the fix suggests. Returns
    ``chunk_size`` as a Python int (or ``None``).

    Raises:
        TypeError: ``chunk_size`` is not an int (nor an allowed ``None``).
        ValueError: ``chunk_size`` is an int below 1.
    """
    if chunk_size is None and none is not None:
        return None
    or_none = f", or None {none}" if none is not None else ""
    if isinstance(chunk_size, (bool, np_bool())) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(
            f"[{fn}] chunk_size must be an int{' or None' if none is not None else ''} but "
            f"got {chunk_size!r}. Pass e.g. chunk_size={example}{or_none}."
        )
    if chunk_size < 1:
        raise ValueError(
            f"[{fn}] chunk_size must be at least 1 but got {chunk_size}. Pass a positive "
            f"int such as {example}{or_none}."
        )
    return int(chunk_size)


@functools.cache
def np_bool() -> type:
    """NumPy's bool scalar type where NumPy is installed (it is no ``numbers.Integral``
    but reads as an int to a careless check), else a type nothing is an instance of."""
    try:
        import numpy
    except ImportError:
        return type("NoNumpyBool", (), {})
    return numpy.bool_


def is_numpy_array(x: object) -> bool:
    """Whether ``x`` is a NumPy array (without importing NumPy: where it was never
    imported, nothing is one)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(x, numpy.ndarray)


def check_axis(fn: str, axis: object) -> int:
    """``axis`` as a Python int: an int or NumPy integer (a NumPy one was refused where
    ``chunk_size`` took it; found by probing), not a bool."""
    if isinstance(axis, (bool, np_bool())) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"[{fn}] axis must be an int but got {axis!r}. Pass e.g. axis=0.")
    return int(axis)


def normalize_axis(fn: str, axis: int, ndim: int, what: str) -> int:
    """``axis`` as a non-negative index for an array of ``ndim`` dimensions (negative
    axes count from the end, per array)."""
    axis = check_axis(fn, axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"[{fn}] axis {axis} is out of range for {what} with {ndim} dimensions.")
    return axis % ndim


def common_length(
    fn: str, leaves: list[mx.array], axes: list[int], names: list[str], what: str, fix: str
) -> int:
    """The one length of ``leaves`` along their ``axes``; else a ``ValueError`` from
    ``fn`` listing each leaf's (``what``: "every leaf of xs must have the same length
    along axis 1"; ``fix``: the sentence that ends it)."""
    lengths = [x.shape[ax] for x, ax in zip(leaves, axes)]
    if len(set(lengths)) > 1:
        listing = ";\n".join(
            f"  * {n} has length {t} (shape {tuple(x.shape)})"
            for n, t, x in zip(names, lengths, leaves)
        )
        raise ValueError(f"[{fn}] {what}, but they differ:\n{listing}.\n{fix}")
    return lengths[0] if lengths else 0


def split(x: mx.array, chunk_size: int, axis: int = 0) -> list[mx.array]:
    """Split ``x`` along ``axis`` into pieces of ``chunk_size`` (the last may be shorter).

    Unlike slicing in a loop, the gradient is assembled by concatenating the pieces'
    cotangents, never by summing zero-padded buffers the size of ``x``: one concatenate
    for up to 16 pieces; for more, :func:`split_at` cuts a tree of at most 16 pieces per
    node, and each level's concatenates together copy ``x`` at most once (two levels up
    to 256 pieces, three up to 4096).

    Args:
        x (array): The array to split, e.g. ``[T, H, D]``.
        chunk_size (int): Length of each piece along ``axis``; need not divide it.
        axis (int, optional): The axis to split. Default: ``0``.

    Returns:
        list(array): ``ceil(x.shape[axis] / chunk_size)`` arrays.

    Raises:
        TypeError: ``x`` is not an array, or ``chunk_size`` / ``axis`` not an int.
        ValueError: ``chunk_size`` is below 1, ``axis`` is out of range, or ``x`` has
            length 0 along ``axis`` (nothing to split).

    Example:
        >>> qs = chunkscan.split(q, 32)          # q: [T, H, D]
        >>> len(qs) == -(-q.shape[0] // 32)
        True
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"[split] x must be an mx.array but got {type(x).__name__}.")
    chunk_size = check_chunk_size("split", chunk_size)
    axis = normalize_axis("split", axis, x.ndim, "x")
    length = x.shape[axis]
    if length == 0:
        raise ValueError("[split] x has length 0 along the split axis; nothing to split.")
    bounds = chunk_bounds(length, chunk_size)
    # One piece goes through the custom function too, not back as ``[x]``: under
    # ``mx.compile(shapeless=True)`` a trace with no primitive here would be reused,
    # silently one piece, at a longer length; the custom function raises there instead
    # ("cannot infer output shapes"), as with several pieces.
    return split_at(x, [lo for lo, _ in bounds[1:]], axis)


def slices_at(x: mx.array, indices: list[int], axis: int) -> list[mx.array]:
    """``mx.split(x, indices, axis)`` as one ``Slice`` per piece (see the module doc)."""
    bounds = [0, *indices, x.shape[axis]]
    lead = (slice(None),) * axis
    return [x[lead + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:])]


#: Most pieces one custom function returns. MLX gives every output of a primitive the
#: list of its siblings (``array::make_arrays``), so an ``n``-output primitive costs
#: ``O(n^2)`` time and memory to build, trace and differentiate: a flat split of one
#: 20000-step chunk took ~20 GiB. :func:`split_at` therefore splits hierarchically,
#: ``_FAN_OUT`` pieces per level (``O(n * _FAN_OUT)`` siblings in all, one concatenate
#: per level in the gradient).
_FAN_OUT = 16


def split_at(x: mx.array, indices: list[int], axis: int) -> list[mx.array]:
    """Split at sorted ``indices`` with a concatenate as the gradient (no checks).

    Up to ``_FAN_OUT`` pieces are one custom function; more are cut as a tree: first
    into at most ``_FAN_OUT`` blocks of consecutive pieces, then each block in turn.
    The gradient of each custom function is one concatenate of its pieces' cotangents,
    so each level of the tree copies ``x`` at most once, and a split into ``n`` pieces costs
    ``O(n)`` to build and at most ``ceil(log(n) / log(_FAN_OUT))`` copies of ``x`` to
    differentiate.
    """
    n = len(indices) + 1
    if n <= _FAN_OUT:
        return _split_flat(x, indices, axis)
    per = -(-n // _FAN_OUT)  # pieces per block
    bounds = [0, *indices, x.shape[axis]]
    starts = list(range(0, n, per))
    blocks = _split_flat(x, [bounds[j] for j in starts[1:]], axis)
    out: list[mx.array] = []
    for j, block in zip(starts, blocks):
        inner = [b - bounds[j] for b in bounds[j + 1 : min(j + per, n)]]
        out.extend(split_at(block, inner, axis) if inner else [block])
    return out


def _split_flat(x: mx.array, indices: list[int], axis: int) -> list[mx.array]:
    """One custom function: slices forward, one concatenate backward."""

    @mx.custom_function
    def _split(a):
        return slices_at(a, indices, axis)

    @_split.vjp
    def _split_vjp(primals, cotangents, outputs):
        return mx.concatenate(_tree.as_list(cotangents), axis=axis)

    return list(_split(x))
