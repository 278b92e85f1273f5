"""What :func:`chunkscan.scan` checks of its arguments and of ``f``'s outputs: that
``f`` (or ``stepwise``'s step) takes the arguments scan passes (:func:`_check_arity`),
``stepwise``'s axis against scan's, the ``xs`` leaves' lengths, the ``xs_grad`` mask,
and that every chunk's ``ys`` have the first chunk's structure, shapes and dtypes
(:func:`_check_ys`). Each error names the argument and the fix."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from . import _tree
from .split import common_length, normalize_axis, np_bool


def _check_arity(f: Callable, has_params: bool) -> None:
    """Raise when ``f`` (or ``stepwise``'s step) cannot take the arguments scan passes.

    Functions whose signature cannot be read (some builtins) are not checked; ``*args``
    functions accept anything and pass.
    """
    step = getattr(f, "_chunkscan_step", None)
    target, name = (f, "f") if step is None else (step, "step")
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    n = 3 if has_params else 2
    try:
        sig.bind(*range(n))
    except TypeError:
        pass
    else:
        return
    sig = sig.replace(
        parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
        return_annotation=sig.empty,
    )
    args = "(carry, xs, params)" if name == "f" else "(carry, x, params)"
    if has_params:
        raise TypeError(
            f"[scan] params= is given, so {name} is called as {name}{args}, but "
            f"{name}{sig} does not take three positional arguments. Add a third parameter "
            f"for the params to {name}, or leave params= out."
        )
    raise TypeError(
        f"[scan] no params= is given, so {name} is called as {name}{args.replace(', params', '')}, "
        f"but {name}{sig} does not take two positional arguments. Pass params= (the third "
        f"argument), or give {name} two parameters."
    )


def _stepwise_axis(f: Callable) -> int | None:
    """The axis ``f`` was made with, where it is a ``stepwise`` chunk function given one
    (one made without takes ``scan``'s: ``stepwise.scan_axis``); else ``None``."""
    if getattr(f, "_chunkscan_step", None) is None:
        return None
    return getattr(f, "_chunkscan_axis", None)


def _check_stepwise_axis(f: Callable, axis: int, leaves: list[mx.array], treedef: tuple) -> None:
    """Raise where ``f`` is a ``stepwise`` chunk function made with an axis that is not
    ``scan``'s (compared per xs leaf, negative axes counted from its end): it would step
    along another axis, silently where the lengths agree (a batch as long as the chunk).
    One made without an axis takes ``scan``'s when called (``stepwise.scan_axis``)."""
    own = _stepwise_axis(f)
    if own is None:
        return
    for x, name in zip(leaves, _tree.paths(treedef, "xs")):
        steps_on = normalize_axis("stepwise", own, x.ndim, name)
        if steps_on != axis % x.ndim:
            raise ValueError(
                f"[scan] axis={axis} but f is stepwise(step, axis={own}), which steps along "
                f"axis {steps_on} of {name} (shape {tuple(x.shape)}), not {axis % x.ndim}. "
                "Give stepwise the same axis as scan, or leave its axis out: it then takes "
                "scan's."
            )


def _check_stepwise_ys_axis(f: Callable, axis: int, ys: Any) -> None:
    """The ys side of :func:`_check_stepwise_axis`: a ``stepwise`` axis that is scan's
    on every xs leaf may still be another axis of a ys leaf of another rank (``axis=-2``
    against scan's ``1``: xs ``[B, T, D]``, ys ``[B, T]``), where stepwise stacks the
    steps on its axis and scan joins the chunks on its own: values transposed within
    each chunk, no error (found by probing)."""
    own = _stepwise_axis(f)
    if own is None or own == axis:
        return
    leaves, treedef = _tree.require_arrays("scan", "ys", ys)
    for y, name in zip(leaves, _tree.paths(treedef, "ys")):
        if y.ndim and own % y.ndim != axis % y.ndim:  # (stacked steps: ndim >= 1)
            raise ValueError(
                f"[scan] axis={axis} but f is stepwise(step, axis={own}), which stacks the "
                f"steps of {name} (shape {tuple(y.shape)}) on its axis {own % y.ndim}, not "
                f"{axis % y.ndim}. Give stepwise the same axis as scan, or leave its axis "
                "out: it then takes scan's."
            )


def _check_xs(leaves: list[mx.array], treedef: tuple, axis: int) -> tuple[list[int], int]:
    if not leaves:
        raise ValueError("[scan] xs must have at least one array leaf; its length gives T.")
    names = _tree.paths(treedef, "xs")
    axes = [normalize_axis("scan", axis, x.ndim, name) for x, name in zip(leaves, names)]
    length = common_length(
        "scan", leaves, axes, names,
        f"every leaf of xs must have the same length along axis {axis}",
        "Pass inputs of one sequence length T.",
    )  # fmt: skip
    if length == 0:
        raise ValueError(f"[scan] xs has length 0 along axis {axis}; there is nothing to scan.")
    return axes, length


def _grad_mask(xs_grad: Any, leaves: list, treedef: tuple, xs: Any) -> list[bool]:
    # NumPy bools too (they were refused as "not a bool ... (bool)"; found by probing).
    bools = (bool, np_bool())
    if isinstance(xs_grad, bools):
        mask = [bool(xs_grad)] * len(leaves)
    else:
        mask, mask_def = _tree.flatten(xs_grad)
        if not _tree.same_structure(mask_def, treedef) or not all(
            isinstance(m, bools) for m in mask
        ):
            raise TypeError(
                "[scan] xs_grad must be a bool or a tree of bools with the structure of xs, "
                f"but got {xs_grad!r} ({type(xs_grad).__name__}) for xs of "
                f"{len(leaves)} leaves ({type(xs).__name__}: a tuple takes a tuple, a list a "
                "list, a dict the same keys, a namedtuple the same namedtuple, a None entry "
                "None). Use e.g. xs_grad=False, or (True, False, True) for xs=(q, k, v)."
            )
        if mask_def != treedef:  # the same dict keys in another order: take xs's
            mask = _tree.reorder_like(treedef, xs_grad)
        mask = [bool(m) for m in mask]
    # Integer and boolean leaves (token ids, masks) have no gradient: constants.
    return [m and mx.issubdtype(x.dtype, mx.inexact) for m, x in zip(mask, leaves)]


class _YsSpec:
    """What the first chunk's ys looked like: structure, and per leaf shape and dtype."""

    def __init__(self) -> None:
        self.treedef: tuple | None = None
        self.leaves: list[tuple[tuple[int, ...], mx.Dtype]] = []


def _check_ys(ys: Any, spec: _YsSpec, chunk_len: int, axis: int) -> list[mx.array]:
    leaves, ys_def = _tree.require_arrays("scan", "ys", ys)
    if spec.treedef is None:
        spec.treedef = ys_def
        spec.leaves = [(tuple(y.shape), y.dtype) for y in leaves]
    elif not _tree.same_structure(spec.treedef, ys_def):
        raise TypeError(
            "[scan] f must return ys with the same structure for every chunk, but the "
            "structure changed between chunks. Return the same tree of outputs each time."
        )
    if ys_def != spec.treedef:  # the same dict keys in another order: take the first's
        leaves, ys_def = _tree.reorder_like(spec.treedef, ys), spec.treedef
    problems = []
    for name, y, (ref_shape, ref_dtype) in zip(_tree.paths(ys_def, "ys"), leaves, spec.leaves):
        if not -y.ndim <= axis < y.ndim or y.shape[axis] != chunk_len:
            problems.append(
                f"{name} has shape {tuple(y.shape)} but the chunk has {chunk_len} "
                f"step{'s' if chunk_len != 1 else ''} on axis {axis}"
            )
            continue
        ax = axis % y.ndim
        others = tuple(d for k, d in enumerate(y.shape) if k != ax)
        ref_others = tuple(d for k, d in enumerate(ref_shape) if k != ax)
        if len(ref_shape) != y.ndim or others != ref_others or y.dtype != ref_dtype:
            problems.append(
                f"{name} has {_tree.describe(y)} in this chunk but shape {ref_shape} and "
                f"dtype {ref_dtype} in the first"
            )
    if problems:
        raise ValueError(
            "[scan] the ys of every chunk must stack along the scanned axis, but they do not:\n"
            + ";\n".join(f"  * {p}" for p in problems)
            + f".\nReturn outputs with the chunk's length on axis {axis} and the same other "
            "dimensions and dtype in every chunk."
        )
    return leaves
