"""``stepwise``: turn a per-step function into the chunk function ``scan`` takes."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from . import _tree
from ._capture import MLX_WRAPPER, mlx_wrapped
from .split import check_axis, common_length, normalize_axis, split_at

# The axis of the innermost scan whose chunk function is running (scan.py sets it around
# each call, and around the whole vjp of a chunk in its backward, where a checkpoint
# wrapper recomputes the function): what a stepwise function made without an axis
# steps along. Read at the
# call, so that it holds through any wrapper scan cannot see into (functools.partial, a
# lambda); before, scan re-made a bare stepwise function on its axis and a wrapped one
# stepped along axis 0, silently where a batch was as long as the chunk.
_SCAN = threading.local()


@contextlib.contextmanager
def scan_axis(axis: int) -> Iterator[None]:
    """Within this block, stepwise functions made without an axis step along ``axis``
    (nested blocks: the innermost one's)."""
    previous = getattr(_SCAN, "axis", None)
    _SCAN.axis = axis
    try:
        yield
    finally:
        _SCAN.axis = previous


def _scan_axis() -> int:
    """The axis of the scan calling (:func:`scan_axis`), 0 outside any scan."""
    axis = getattr(_SCAN, "axis", None)
    return 0 if axis is None else axis


def _shapes(carry: Any, xs_chunk: Any) -> tuple:
    """The shapes and dtypes of the array leaves of a call's carry and chunk."""
    leaves, _ = _tree.flatten((carry, xs_chunk))
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, mx.array))


def _compiled(f: Callable) -> bool:
    """Whether ``f`` is ``mx.compile``'s wrapper or wraps one (``__wrapped__``, set by
    ``functools.wraps``: ``chunkscan.checkpoint(mx.compile(...))``)."""
    for _ in range(16):
        if isinstance(f, MLX_WRAPPER):
            return True
        f = getattr(f, "__wrapped__", None)
        if f is None:
            return False
    return False


def _compiled_stepwise(f: Callable) -> Any:
    """Where ``f`` is or wraps an ``mx.compile`` of a ``stepwise`` function, the object
    its attributes are read from (the function, or a wrapper that forwards them); else
    ``None``. Followed: ``__wrapped__`` (``functools.wraps``) and, where a wrapper of
    MLX's (``mx.compile``'s or ``mx.checkpoint``'s, one type) does not forward them, the
    one function it holds (read by the garbage collector's traversal, which runs
    nothing of the user's): ``mx.checkpoint(mx.compile(stepwise(step)))`` was not seen
    (found by probing); and a ``functools.partial``'s function (a partial of a compiled
    one ran its stale trace along the other axis, outputs off by 2.5, no error; found
    by probing, session 50). An ``mx.checkpoint`` taken for an ``mx.compile`` costs
    nothing: its Python runs at every call, so no stale axis is ever found."""
    node, compiled = f, False
    for _ in range(16):
        compiled = compiled or isinstance(node, MLX_WRAPPER)
        if getattr(node, "_chunkscan_runs", None) is not None:
            return node if compiled or _compiled(node) else None
        nxt = getattr(node, "__wrapped__", None)
        if nxt is None and isinstance(node, functools.partial):
            nxt = node.func
        if nxt is None:
            held = mlx_wrapped(node) or []
            nxt = held[0] if len(held) == 1 else None
        if nxt is None:
            return None
        node = nxt
    return None


@contextlib.contextmanager
def check_compiled_axis(f: Callable, axis: int, carry: Any, xs_chunk: Any) -> Iterator[None]:
    """Around ``scan``'s call of its chunk function ``f`` on ``(carry, xs_chunk)``,
    where ``f`` is or wraps an ``mx.compile`` of a ``stepwise`` function made without
    an axis (its attributes forwarded, as ``mx.compile`` and ``functools.wraps`` do):
    keep the axes its Python ran with under a compiled wrapper at these shapes, and
    raise where it did not run (a cached trace ran instead) but ran with another axis
    before: the trace may step along that one, silently where the lengths agree (found
    by probing: a batch as long as the chunk, outputs off by 1.4). MLX keeps a
    function's traces per wrapped function, not per wrapper, and so are the axes
    kept. Axes compare as written (``1`` and ``-2`` stack a ``y`` of lower rank
    differently). Calls outside ``scan`` (axis 0; the compiled wrapper called directly
    leaves a trace too) count, since session 46. Refused where it need not be: a function run
    under ``mx.grad`` (which runs the Python without leaving a trace) along one axis, or
    the uncompiled function called directly, then the compiled one along another axis
    at the same shapes; an axis written two ways; a new ``mx.compile`` of the function
    after one of another axis was freed. One compiled function per axis avoids all of
    them. Not seen: a lambda around the compiled function (an ``mx.checkpoint`` around
    it was not seen before session 39), and an ``mx.compile`` of a chunk function that
    calls a ``stepwise`` function made without an axis inside (traced along axis 0, its
    trace then stepped along 0 under ``scan(axis=1)``: wrong values, no error; found
    by probing, session 47): give such a ``stepwise`` its axis."""
    f = _compiled_stepwise(f)
    runs = getattr(f, "_chunkscan_runs", None)
    if runs is None or getattr(f, "_chunkscan_axis", 0) is not None:
        yield
        return
    before = runs[0]
    yield
    seen = f._chunkscan_axes_run.setdefault(_shapes(carry, xs_chunk), set())
    if runs[0] != before:  # it ran, reading this scan's axis (under mx.grad: no trace)
        seen.add(axis)
        return
    other = sorted(seen - {axis})
    if other:
        raise ValueError(
            f"[scan] axis={axis} but f is a compiled stepwise(step) made without an axis "
            f"that ran at these shapes with axis {other[0]} before, and its compiled "
            f"trace keeps the axis it was made with: it may step along that one here. "
            f"Give stepwise the axis, mx.compile(stepwise(step, axis={axis})), one "
            f"compiled function per axis."
        )


def stepwise(
    step: Callable[..., tuple[Any, Any]], *, axis: int | None = None
) -> Callable[..., tuple[Any, Any]]:
    """Lift ``step(carry, x[, params]) -> (carry, y)`` to a chunk function for ``scan``.

    The returned ``f(carry, xs_chunk[, params])`` runs ``step`` once per step of the
    chunk, ``x`` being ``xs_chunk`` at one index of ``axis`` (that axis removed), and
    stacks the ``y`` along ``axis``. The step inputs are cut with a split whose
    gradient concatenates (:func:`chunkscan.split.split_at`), so no step builds a
    zero-padded chunk-sized gradient; building and differentiating a chunk of ``C``
    steps costs ``O(C)`` time and memory for any ``C`` (``chunk_size >= T``, one chunk,
    included).

    A negative ``axis`` counts from the end of each leaf, as in NumPy: with
    ``axis=-1`` a leaf ``[B, C]`` gives ``x`` leaves ``[B]`` and a leaf ``[B, D, C]``
    gives ``[B, D]``; each ``y`` leaf of rank ``r`` is stacked on axis ``-1`` of the
    ``r + 1``-dimensional result.

    No ordering edge is added between steps: ``scan`` orders whole chunks, which bounds
    memory at one chunk's steps; per-step edges measured 5-10% slower for no gain.

    Args:
        step (callable): The step function; returns a pair ``(carry, y)`` with ``y``
            a tree of arrays (or ``None``) of the same structure, shapes and dtypes at
            every step.
        axis (int, optional): The time axis. Default: ``None``, the ``axis`` of the
            ``scan`` whose chunk function calls it (also through a wrapper such as
            ``functools.partial``, a lambda or a checkpoint, whose recomputation
            in the backward takes it too; the innermost of nested scans; ``0``
            outside ``scan``). An axis given here that is not ``scan``'s raises a
            ``ValueError`` in ``scan`` where ``f`` is the stepwise function itself.

    Returns:
        callable: ``f(carry, xs_chunk[, params]) -> (carry, ys_chunk)``.

    Raises:
        TypeError: ``step`` is not callable or ``axis`` is not an int; when called,
            ``step`` does not return a pair, or returns ``y`` of another structure
            than at the first step.
        ValueError: when called, ``axis`` is out of range for a leaf, the leaves of
            ``xs_chunk`` differ in length along it, ``xs_chunk`` has no step (length 0,
            or no array), or a ``y`` leaf changes shape or dtype between steps.

    Example:
        >>> def rnn(h, x, w):
        ...     h = mx.tanh(x + h @ w)
        ...     return h, h
        >>> h, ys = chunkscan.scan(chunkscan.stepwise(rnn), h0, xs, params=w)
    """
    if not callable(step):
        raise TypeError(f"[stepwise] step must be callable but got {type(step).__name__}.")
    if axis is not None:
        axis = check_axis("stepwise", axis)

    # Made without an axis: how often its Python has run, and (kept by scan, per
    # argument shapes) the axes it ran with under mx.compile: a trace keeps its axis
    # (check_compiled_axis).
    runs = [0]
    axes_run: dict[tuple, set] = {}

    def chunk_fn(carry: Any, xs_chunk: Any, *params: Any) -> tuple[Any, Any]:
        time_axis = axis
        if time_axis is None:
            time_axis = _scan_axis()
            runs[0] += 1
        leaves, xs_def = _tree.require_arrays("stepwise", "xs_chunk", xs_chunk)
        names = _tree.paths(xs_def, "xs_chunk")
        axes = [normalize_axis("stepwise", time_axis, x.ndim, n) for x, n in zip(leaves, names)]
        steps = common_length(
            "stepwise", leaves, axes, names,
            f"every leaf of xs_chunk must have the same length along axis {time_axis}",
            "Pass one chunk of each input.",
        )  # fmt: skip
        if steps == 0:  # scan never passes one; called directly it returned (carry, None)
            what = "holds no array" if not leaves else f"has length 0 along axis {time_axis}"
            raise ValueError(
                f"[stepwise] xs_chunk {what}: there is no step to run. Pass a chunk of at "
                "least one step of each input."
            )
        if axis is None and getattr(_SCAN, "axis", None) is None:
            # Called outside scan (axis 0), maybe through its mx.compile: a trace at these
            # shapes may now step along 0, and scan(axis=1) would run it (found by
            # probing, session 46: no error, wrong values after one direct call).
            axes_run.setdefault(_shapes(carry, xs_chunk), set()).add(0)
        # One step goes through split_at's custom function too (not as [x]): under
        # mx.compile(shapeless=True) a trace with no primitive here was reused at longer
        # chunks, silently one step (found by probing, session 54); as split's one piece
        per_leaf = [split_at(x, list(range(1, steps)), ax) for x, ax in zip(leaves, axes)]
        ys: list[list[mx.array]] = []
        first: tuple | None = None
        for t in range(steps):
            x_t = _tree.unflatten(xs_def, [mx.squeeze(p[t], ax) for p, ax in zip(per_leaf, axes)])
            out = step(carry, x_t, *params)
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(
                    f"[stepwise] step must return a pair (carry, y) but returned "
                    f"{_tree.describe_return(out)} at step {t}. Return a tuple of two: the new "
                    "carry and this step's output (None for no output)."
                )
            carry, y = out
            y_leaves, y_def = _tree.require_arrays("stepwise", "y", y)
            if first is None:
                first = (y_def, [_tree.ShapeDtype(tuple(a.shape), a.dtype) for a in y_leaves])
            else:
                y_leaves = _check_same_y(first, y_def, y_leaves, t)
            ys.append(y_leaves)
        y_names = _tree.paths(first[0], "y")
        for name, spec in zip(y_names, first[1]):
            if not -(len(spec.shape) + 1) <= time_axis <= len(spec.shape):
                raise ValueError(
                    f"[stepwise] {name} has shape {spec.shape} at each step, so the steps "
                    f"cannot be stacked along axis {time_axis} (a stack of rank "
                    f"{len(spec.shape) + 1}). Return a y with an axis {time_axis} to stack "
                    "on, or scan along another axis."
                )
        stacked = [mx.stack(list(parts), axis=time_axis) for parts in zip(*ys)]
        return carry, _tree.unflatten(first[0], stacked)

    chunk_fn._chunkscan_step = step  # type: ignore[attr-defined]  # read by scan's checks
    chunk_fn._chunkscan_axis = axis  # type: ignore[attr-defined]  # None: scan's (scan.py)
    chunk_fn._chunkscan_runs = runs  # type: ignore[attr-defined]  # for check_compiled_axis
    chunk_fn._chunkscan_axes_run = axes_run  # type: ignore[attr-defined]
    return chunk_fn


def _check_same_y(first: tuple, y_def: tuple, y_leaves: list[mx.array], t: int) -> list:
    """Check step ``t``'s ``y`` against step 0's; return its leaves in step 0's order."""
    ref_def, ref_specs = first
    diffs = _tree._structure_differences(ref_def, "y at step 0", y_def, f"y at step {t}")
    if diffs:
        raise TypeError(
            "[stepwise] step must return y with the same structure at every step, but "
            "it changed:\n" + ";\n".join(f"  * {d}" for d in diffs) + ".\nReturn the same "
            "tree of outputs at every step (use zeros where a step has nothing to report)."
        )
    if y_def != ref_def:  # the same dict keys in another order: take step 0's
        y_leaves = _tree.reorder_like(ref_def, _tree.unflatten(y_def, y_leaves))
        y_def = ref_def
    problems = [
        f"{path} has {_tree.describe(a)} but shape {spec.shape} and dtype {spec.dtype} at step 0"
        for path, a, spec in zip(_tree.paths(y_def, f"y at step {t}"), y_leaves, ref_specs)
        if tuple(a.shape) != spec.shape or a.dtype != spec.dtype
    ]
    if problems:
        raise ValueError(
            "[stepwise] the y of every step must stack, but they do not:\n"
            + ";\n".join(f"  * {p}" for p in problems)
            + ".\nReturn outputs of the same shapes and dtypes at every step."
        )
    return y_leaves
