"""``checkpoint``: ``mx.checkpoint`` with the ordering edges that bound its memory.

For users who write the chunk loop themselves. Each call is one custom function whose
forward makes every output wait for all outputs (rule 1), whose backward recomputes
only once the incoming cotangents exist (rule 2) and hands on its input gradients only
together (rule 3). Pair it with :func:`chunkscan.split` for the chunk inputs (rule 4).
"""

from __future__ import annotations

import collections
import functools
import itertools
import numbers
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from . import _ordering, _random, _tree

F = TypeVar("F", bound=Callable[..., Any])


#: Where an output leaf is an array (the others are kept as the forward returned them).
_ARRAY = object()


def checkpoint(fun: F) -> F:
    """Checkpoint ``fun`` like ``mx.checkpoint``, keeping backward memory bounded.

    A drop-in for ``mx.checkpoint``: same call signature, same values and gradients.
    Only the inputs are kept for the backward pass; ``fun`` is recomputed there. Unlike
    ``mx.checkpoint``, the recomputation of one call waits for the cotangent flowing
    into it and the gradients it returns leave together, so in a chunk loop the
    backward recomputes one chunk at a time and frees it before the next.

    Args:
        fun (callable): Takes arrays or pytrees of arrays (positional or keyword) and
            returns an array or a pytree of arrays. Non-array leaves of the arguments
            (ints, floats, strings) are passed through unchanged as constants; integer
            and boolean arrays (indices, masks) are constants of the recomputation
            (their gradient is zero). An ``nn.Module`` argument (or one inside a tree
            argument) raises: capture it in ``fun`` instead (it then gets no gradient),
            or use :func:`chunkscan.scan` with ``params=`` for its weights' gradients.
            Any other object (a dataclass, a ``SimpleNamespace``) is passed as a
            constant, as by ``mx.checkpoint``, its arrays without a gradient; where
            its attributes hold arrays or modules, a ``UserWarning`` says so (pass
            them as arrays or in a list, tuple or dict to differentiate them, or
            capture the object in ``fun``'s closure to keep them constant).
            Non-array leaves of what ``fun`` returns (a count, a string) come back as
            the forward returned them, as from ``mx.checkpoint``; at least one leaf
            must be an array, and none an ``nn.Module``.

    Returns:
        callable: With the signature of ``fun``.

    Note:
        As with ``mx.checkpoint``, ``fun`` must be a function of its arguments: the
        backward calls it again, so Python state it reads (a call counter, a global
        that has changed since) gives the gradient of another function, with no
        error. State that ``fun`` updates in place on a module it captures
        (``nn.BatchNorm``'s running statistics in training mode) is updated again by
        the recomputation, as with ``mx.checkpoint`` (:func:`chunkscan.scan` puts it
        back). Arrays that ``fun`` captures by closure are constants: they get no
        gradient. Pass everything you differentiate (weights
        included) as arguments. A weight passed to every call of a chunk loop gets
        one gradient per call, and MLX sums them only at the end of the backward (as
        with ``mx.checkpoint``): the backward then also keeps about ``T / C``
        weight-sized gradients (``tests/test_memory.py``, a shared weight). For such
        weights use :func:`chunkscan.scan` with ``params=``, whose backward adds each
        chunk's gradient to one running sum.

        Transforms: reverse mode (second derivatives too) and ``mx.compile``. Unlike
        ``mx.checkpoint``, ``mx.vmap`` and ``mx.jvp`` only for a ``fun`` of one output
        array, and not of its gradient: the edge that makes several outputs leave
        together has no vmap or jvp rule in MLX ("Not implemented for Depends"; see
        ``docs/design.md``, "Supported transforms").

        Unlike ``mx.checkpoint``, random ops in ``fun`` that draw from MLX's global
        key (``nn.Dropout``, ``mx.random.*`` without ``key=``) draw the same numbers
        in the recomputation (and in the forward's second run under ``mx.jvp`` or
        ``mx.vmap``) as in the forward; the recomputation leaves the global key as it
        found it, and draws of the backward itself (in a custom vjp) take from the
        user's key. Reading the key without drawing from it is not noticed
        (``docs/design.md``, "Random ops in a recomputed function").

    Example:
        >>> step = chunkscan.checkpoint(run_chunk)    # run_chunk(s, q, k, v) -> (s, y)
        >>> for qc, kc, vc in zip(*(chunkscan.split(a, 32) for a in (q, k, v))):
        ...     s, y = step(s, qc, kc, vc)
    """
    if not callable(fun):
        raise TypeError(f"[checkpoint] fun must be callable but got {type(fun).__name__}.")
    # Whether an earlier call of the same structure (the arguments' tree and non-array
    # leaves) returned several arrays (a carry and outputs): such calls' arguments then
    # wait for one another (rule 5, below). Per structure, not per function: one flag
    # kept the edge for a later one-output call (a ``both=True`` switch), and its
    # ``mx.vmap`` failed (found by review, session 52). A structure not seen yet takes
    # the flag of its kind (the same, with ints and floats by their type) where every
    # call of that kind returned several arrays: a loop passing each chunk's offset as
    # a Python int made every call a structure never seen, and none got the edge (its
    # memory grew with T; found by probing, session 54). At most _STRUCTURES of each kept.
    several_outputs: dict[Any, bool] = {}
    several_of_kind: dict[Any, bool] = {}

    @functools.wraps(fun)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = _tree.flatten((args, kwargs))
        if any(isinstance(leaf, nn.Module) for leaf in leaves):
            _raise_on_module(fun, args, kwargs)
        if any(_held_fields(leaf) for leaf in leaves):
            _warn_on_array_holder(fun, args, kwargs)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, mx.array)]
        arrays = [leaves[i] for i in slots]
        # The closures below outlive this call (the vjp runs later), so they keep only
        # the non-array leaves: a reference to an argument array would keep the graph
        # that produced it alive, one chunk's worth per call.
        template = [None if isinstance(leaf, mx.array) else leaf for leaf in leaves]
        structure = _structure(treedef, template)
        kind = _structure(treedef, template, numbers_by_type=True)
        del leaves, args, kwargs
        out_defs: list[tuple] = []
        starts = _random.Starts()  # the global random key, if the forward drew from it

        def call(values: list[mx.array]) -> list[mx.array]:
            full = list(template)
            for i, a in zip(slots, values):
                full[i] = a
            a_args, a_kwargs = _tree.unflatten(treedef, full)
            out = fun(*a_args, **a_kwargs)
            out_leaves, out_def = _tree.flatten(out)
            modules = [
                f"{path} ({type(leaf).__name__})"
                for path, leaf in zip(_tree.paths(out_def, "the output"), out_leaves)
                if isinstance(leaf, nn.Module)
            ]
            if modules:
                raise TypeError(
                    f"[checkpoint] no leaf of the output may be an nn.Module: "
                    f"{', '.join(modules)}. Return the module's output arrays, not the module."
                )
            # Other non-array leaves (a token count, a string) pass through as the
            # forward returned them, as from mx.checkpoint (they raised; found by
            # probing, session 51).
            out_arrays = [leaf for leaf in out_leaves if isinstance(leaf, mx.array)]
            if not out_arrays:  # MLX's custom function of no outputs crashes the process
                raise ValueError(
                    f"[checkpoint] fun must return at least one array but returned {out!r}. "
                    "Return what the rest of the computation uses."
                )
            kept = [_ARRAY if isinstance(leaf, mx.array) else leaf for leaf in out_leaves]
            out_defs.append((out_def, kept))
            several = len(out_arrays) > 1
            _remember(several_outputs, structure, several)
            _remember(several_of_kind, kind, several and several_of_kind.get(kind, True))
            return _ordering.all_together(out_arrays)

        @mx.custom_function
        def forward(*primals):
            # Rule 5 without knowing which argument is the carry: each waits for all of
            # them, so a loop's call runs its work on its inputs alone (decays, a
            # triangular inverse) only once the carry from the call before exists (MLX
            # ran that part of every call first and kept it: found by probing, session
            # 52, as in scan before session 46). Only for a fun seen returning several
            # arrays (a loop's carry and outputs; the first call has no call before):
            # the Depends has no vmap or jvp rule, which a one-output fun keeps (found
            # by review, the same session). Integer and boolean arguments behind a
            # stop_gradient: mx.jvp of the custom function sends tangents to every
            # primal, and one used as indices raised ("Cannot calculate JVP with respect
            # to indices"; found by probing, session 53).
            waited = [a if mx.issubdtype(a.dtype, mx.inexact) else mx.stop_gradient(a)
                      for a in primals]  # fmt: skip
            seen = several_outputs.get(structure)
            if seen is None:
                seen = several_of_kind.get(kind, False) and _BY_KIND
            if seen and _INPUTS_TOGETHER:
                waited = _ordering.all_together(waited)
            with starts.forward():  # (run again by mx.jvp and mx.vmap: replayed)
                return call(waited)

        @forward.vjp
        def backward(primals, cotangents, outputs):
            cotangents = _tree.as_list(cotangents)
            primals = _tree.as_list(primals)
            # Integer and boolean arguments (indices, masks) are constants of the
            # recomputation: MLX has no gradient with respect to indices, and asking for
            # one raised ("[gather] Cannot calculate VJP with respect to indices") where
            # the function without the checkpoint differentiated (found by probing).
            diff = [mx.issubdtype(a.dtype, mx.inexact) for a in primals]
            primals = _ordering.recompute_after_cotangent(primals, cotangents)
            # The Depends makes them outputs of the cotangents, so a second derivative
            # would ask for that gradient again (the same error, found by probing):
            # they leave it without one.
            primals = [a if d else mx.stop_gradient(a) for a, d in zip(primals, diff)]

            # Every primal enters the vjp, the integer and boolean ones behind a
            # stop_gradient inside: captured by ``recompute`` instead, a second derivative
            # built from two mx.grad calls came out wrong (found by probing, session 42).
            def recompute(*values: mx.array) -> list[mx.array]:
                outs = call([a if d else mx.stop_gradient(a) for a, d in zip(values, diff)])
                forward_done()
                return outs

            with starts.recompute() as forward_done:
                _, grads = mx.vjp(recompute, primals, cotangents)
            grads = [g if d else mx.zeros_like(a) for g, a, d in zip(grads, primals, diff)]
            return _ordering.all_together(grads)

        outs = iter(_tree.as_list(forward(*arrays)))
        out_def, kept = out_defs[0]
        return _tree.unflatten(out_def, [next(outs) if k is _ARRAY else k for k in kept])

    return checkpointed  # type: ignore[return-value]


def _structure(treedef: tuple, template: list, numbers_by_type: bool = False) -> tuple | None:
    """A call's structure (its arguments' tree, its non-array leaves), hashable, or
    ``None`` where a leaf is not (such calls get no rule-5 edge). ``numbers_by_type``:
    its kind, with each int and float leaf by its type (bools by their value)."""
    if numbers_by_type:  # (NumPy's numbers too; NumPy's booleans are no numbers.Real)
        template = [type(leaf) if isinstance(leaf, numbers.Real) and not isinstance(leaf, bool)
                    else leaf for leaf in template]  # fmt: skip
    key = (treedef, tuple(template))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember(flags: dict[Any, bool], key: Any, value: bool) -> None:
    """``flags[key] = value``, the newest last, at most ``_STRUCTURES`` kept (``None``, a
    structure that cannot be hashed: not kept)."""
    if key is None:
        return
    flags.pop(key, None)
    flags[key] = value
    while len(flags) > _STRUCTURES:
        flags.pop(next(iter(flags)))


def _is_method(fun: Callable) -> bool:
    """Whether ``fun`` was defined in a class body (``Block.__call__``)."""
    qualname = getattr(fun, "__qualname__", "")
    return "." in qualname.rsplit("<locals>.", 1)[-1]


def _raise_on_module(fun: Callable, args: tuple, kwargs: dict) -> None:
    """Raise naming the argument that is, or holds, an ``nn.Module``: flattened as the
    dict of its arrays, it reached ``fun`` as a plain dict ("'dict' object is not
    callable"; found by probing, inside a tuple or list argument too)."""
    for path, leaf in _named_leaves(args, kwargs):
        if isinstance(leaf, nn.Module):
            method = " (self: checkpoint decorates a method)" if (
                path == "argument 0" and _is_method(fun)) else ""  # fmt: skip
            raise TypeError(
                f"[checkpoint] {path}{method} is an nn.Module ({type(leaf).__name__}); "
                "checkpoint passes arrays and pytrees of arrays, and would hand fun a "
                "plain dict of the module's arrays. Capture the module in fun's closure "
                "instead (it then gets no gradient, as with mx.checkpoint), or, for "
                "gradients of its weights, use chunkscan.scan with params=module."
            )


def _named_leaves(args: tuple, kwargs: dict):
    """``(path, leaf)`` for every leaf of the call's arguments, the path as the
    messages name it (``argument 0[1]``, ``keyword argument 'm'['net']``)."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r}", a) for k, a in kwargs.items()]
    for where, a in named:
        leaves, treedef = _tree.flatten(a)
        yield from zip(_tree.paths(treedef, where), leaves)


def _held_fields(leaf: Any) -> list[str]:
    """The attributes (``.name``) of a leaf that is not an array (a dataclass, a
    ``SimpleNamespace``), or the items (``[i]``) of a ``collections.deque`` leaf, that
    are, or hold within three levels of lists, tuples and dicts, arrays or modules
    (:func:`_holds`: bounded, as this runs at every call); ``[]`` for a leaf never
    looked into. (A deque of arrays reached ``fun`` as a constant with no warning: a
    zero gradient, as with ``mx.checkpoint``; found by probing, session 40.)"""
    if isinstance(leaf, _NEVER_HOLDERS) or isinstance(leaf, type):
        return []
    if isinstance(leaf, collections.deque):  # (a subclass too; review)
        items = itertools.islice(leaf, _ITEMS)
        return [f"[{i}]" for i, item in enumerate(items) if _holds(item, depth=3)]
    return [f".{name}" for name in _arrays_in_attributes(leaf)]


# Leaves never looked into: what cannot hold an array, and Python modules (a module
# passed as an argument had its namespace scanned at every call; review).
_NEVER_HOLDERS = (mx.array, str, bytes, int, float, complex, type(None), types.ModuleType,
                  types.FunctionType, types.BuiltinFunctionType)  # fmt: skip
_ITEMS = 64  # items of a list, tuple or dict attribute looked at


def _arrays_in_attributes(obj: Any) -> list[str]:
    """The names of ``obj``'s attributes that are, or hold, arrays or modules (read
    without running the user's code: :func:`._capture.attributes`)."""
    from ._capture import attributes

    return [name for name, value in attributes(obj) or () if _holds(value, depth=3)]


def _holds(value: Any, depth: int) -> bool:
    """Whether ``value`` is, or holds within ``depth`` levels of lists, tuples, deques
    and dicts (the first :data:`_ITEMS` items of each), an array or a module: a parameter tree
    (``model.parameters()``: dicts of lists of dicts) held by a config object was
    missed when only one level was looked at (found by review)."""
    if isinstance(value, (mx.array, nn.Module)):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        items = itertools.islice(value.values(), _ITEMS)
    elif isinstance(value, (list, tuple)):
        items = value[:_ITEMS]
    elif isinstance(value, collections.deque):  # (a deque in a deque was missed; review)
        items = itertools.islice(value, _ITEMS)
    else:
        return False
    return any(_holds(v, depth - 1) for v in items)


def _warn_on_array_holder(fun: Callable, args: tuple, kwargs: dict) -> None:
    """Warn naming the argument that holds arrays or modules in its attributes: passed
    as a constant, as by ``mx.checkpoint``, they got no gradient with no sign of it
    (found by probing; a constant table, such as a rotary embedding's, is the usual
    case, so a warning and not an error)."""
    for path, leaf in _named_leaves(args, kwargs):
        held = _held_fields(leaf)
        if held:
            fields = ", ".join(held[:4])
            warnings.warn(
                f"[checkpoint] {path} of {getattr(fun, '__qualname__', 'fun')} is "
                f"{_tree.with_article(type(leaf).__name__)} holding arrays or modules ({fields}); "
                "checkpoint, as mx.checkpoint, passes it as a constant: they get no "
                "gradient. Pass the arrays themselves (or a dict of them) to "
                "differentiate them; capture the object in fun's closure to keep "
                "them constant without this warning.",
                UserWarning,
                stacklevel=3,
            )
            return


# Whether each call's arguments wait for one another in the forward (rule 5 above);
# the tests' negative control.
_INPUTS_TOGETHER = True
# Whether a call structure not seen yet takes its kind's flag (numbers by type; see
# checkpoint); the tests' negative control of the int-offset loop.
_BY_KIND = True
# How many call structures a checkpointed function remembers for it (the oldest goes).
_STRUCTURES = 64
