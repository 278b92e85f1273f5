"""Pytrees (nested tuples, lists, dicts of arrays) and the error text about them.

A tree is flattened to a list of leaves plus a *treedef* that rebuilds it. ``None`` is
an empty subtree (no leaves), as in JAX. Paths in messages read like Python
subscripts: ``init['S']``, ``carry[1]``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

# A treedef is one of:
#   ("leaf",)                         a single leaf
#   ("none",)                         None (no leaves)
#   ("dict", keys, children)          a dict with keys in order
#   ("dict", keys, children, type)    an OrderedDict, rebuilt as one (it came back as a
#                                     plain dict before session 30; a subclass still
#                                     does: its constructor may take other arguments)
#   ("seq", type, children)           a list, tuple or namedtuple
_LEAF = ("leaf",)
_NONE = ("none",)


def flatten(tree: Any) -> tuple[list[Any], tuple]:
    """Return ``(leaves, treedef)``; dict keys keep their insertion order."""
    leaves: list[Any] = []
    return leaves, _flatten_into(tree, leaves)


# The recursions below are module-level functions on purpose: a nested function that
# calls itself is a reference cycle, and a cycle that holds arrays keeps their whole
# graph alive until Python's cyclic garbage collector happens to run.
def _flatten_into(node: Any, leaves: list[Any]) -> tuple:
    if node is None:
        return _NONE
    # An nn.Module is a dict, but not a node of these trees: it stays one leaf, so the
    # callers' checks name it. Flattened into its arrays it reached f as a plain dict
    # ("'dict' object is not callable", found by probing: params=(module, w)).
    if isinstance(node, dict) and not isinstance(node, nn.Module):
        keys = tuple(node.keys())
        td = ("dict", keys, tuple(_flatten_into(node[k], leaves) for k in keys))
        return td + (OrderedDict,) if type(node) is OrderedDict else td
    if isinstance(node, (list, tuple)):
        return ("seq", type(node), tuple(_flatten_into(child, leaves) for child in node))
    leaves.append(node)
    return _LEAF


def unflatten(treedef: tuple, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    it = iter(leaves)
    out = _build(treedef, it)
    rest = sum(1 for _ in it)
    if rest:
        raise ValueError(f"unflatten got {rest} leaves more than the tree holds.")
    return out


def _build(td: tuple, it: Any) -> Any:
    kind = td[0]
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    if kind == "dict":
        d = {k: _build(c, it) for k, c in zip(td[1], td[2])}
        return td[3](d) if len(td) > 3 else d
    children = [_build(c, it) for c in td[2]]
    seq_type = td[1]
    if seq_type in (list, tuple):
        return seq_type(children)
    if hasattr(seq_type, "_fields"):  # namedtuple
        return seq_type(*children)
    return seq_type(children)


def as_list(values: Any) -> list[Any]:
    """A custom function's primals/cotangents/outputs as a list.

    ``mx.custom_function`` hands a lone array (not a 1-tuple) to the vjp when the
    function has one input or one output.
    """
    return [values] if isinstance(values, mx.array) else list(values)


def paths(treedef: tuple, name: str) -> list[str]:
    """The subscript path of each leaf, in :func:`flatten` order."""
    out: list[str] = []
    _paths_into(treedef, name, out)
    return out


def _paths_into(td: tuple, prefix: str, out: list[str]) -> None:
    kind = td[0]
    if kind == "leaf":
        out.append(prefix)
    elif kind == "dict":
        for k, c in zip(td[1], td[2]):
            _paths_into(c, f"{prefix}[{k!r}]", out)
    elif kind == "seq":
        for i, c in enumerate(td[2]):
            _paths_into(c, f"{prefix}[{i}]", out)


class ShapeDtype(NamedTuple):
    """Shape and dtype of an array, kept where holding the array itself would keep its
    graph alive."""

    shape: tuple[int, ...]
    dtype: mx.Dtype


def describe(leaf: Any) -> str:
    if isinstance(leaf, (mx.array, ShapeDtype)):
        return f"shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
    return f"type {type(leaf).__name__}"


def describe_return(out: Any) -> str:
    """What a function returned where a pair was due: ``a tuple of 1``, ``a list``,
    ``one array`` (scan said ``type tuple`` for ``(c,)``; found by probing)."""
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    return with_article(type(out).__name__) if not isinstance(out, mx.array) else "one array"


def require_arrays(fn: str, name: str, tree: Any) -> tuple[list[mx.array], tuple]:
    """Flatten ``tree`` and raise a ``TypeError`` naming every non-array leaf."""
    leaves, treedef = flatten(tree)
    bad = [
        f"  * {p} is {_leaf_kind(leaf)}"
        for p, leaf in zip(paths(treedef, name), leaves)
        if not isinstance(leaf, mx.array)
    ]
    if bad:
        kinds = {isinstance(leaf, nn.Module) for leaf in leaves if not isinstance(leaf, mx.array)}
        fixes = []
        if False in kinds and name in _OUTPUTS:  # a return value: no closure to use
            fixes.append("Return arrays: wrap the values with mx.array(...).")
        elif False in kinds:
            fixes.append(
                "Wrap the values with mx.array(...), or close over non-array constants in f."
            )
        if True in kinds and name in _OUTPUTS:
            fixes.append("Return the module's output arrays, not the module.")
        elif True in kinds:
            fixes.append(
                "A module is not a tree of arrays: pass it on its own as scan's "
                "params=module (its trainable parameters get gradients), or close over it "
                "in f (it gets none)."
            )
        fix = " ".join(fixes)
        raise TypeError(
            f"[{fn}] every leaf of {name} must be an mx.array, but some are not:\n"
            + ";\n".join(bad)
            + ".\n"
            + fix
        )
    return leaves, treedef


# The names require_arrays gets for what a function returns (the module hint differs).
_OUTPUTS = ("the output", "ys", "y")


def _leaf_kind(leaf: Any) -> str:
    if isinstance(leaf, nn.Module):
        return f"an nn.Module ({type(leaf).__name__})"
    return with_article(type(leaf).__name__)


def with_article(noun: str) -> str:
    """``noun`` with its indefinite article ("an int", "a float", "a uint8": a type
    name's u reads "you"; "an ndarray"); ``None`` for None's type and kind (messages
    read "a NoneType", "is a None": found by probing)."""
    if noun in ("None", "NoneType"):
        return "None"
    vowel = noun[:1].lower() in "aeio" or noun.startswith("nd")
    return f"{'an' if vowel else 'a'} {noun}"


def _structure_differences(td_a: tuple, name_a: str, td_b: tuple, name_b: str) -> list[str]:
    diffs: list[str] = []

    def walk(a: tuple, pa: str, b: tuple, pb: str) -> None:
        if a[0] != b[0] or (a[0] == "seq" and a[1] is not b[1]):
            diffs.append(
                f"{pa} is {with_article(_kind_name(a))} but {pb} is {with_article(_kind_name(b))}"
            )
            return
        if a[0] == "dict":
            keys_a, keys_b = list(a[1]), list(b[1])
            for k in keys_a:
                if k not in keys_b:
                    diffs.append(f"{pa} has key {k!r} but {pb} does not")
            for k in keys_b:
                if k not in keys_a:
                    diffs.append(f"{pb} has key {k!r} but {pa} does not")
            for k in keys_a:
                if k in keys_b:
                    walk(
                        a[2][keys_a.index(k)], f"{pa}[{k!r}]", b[2][keys_b.index(k)], f"{pb}[{k!r}]"
                    )
        elif a[0] == "seq":
            if len(a[2]) != len(b[2]):
                diffs.append(f"{pa} has {len(a[2])} entries but {pb} has {len(b[2])}")
                return
            for i, (ca, cb) in enumerate(zip(a[2], b[2])):
                walk(ca, f"{pa}[{i}]", cb, f"{pb}[{i}]")

    walk(td_a, name_a, td_b, name_b)
    return diffs


def _kind_name(td: tuple) -> str:
    if td[0] == "seq":
        return td[1].__name__
    return {"leaf": "leaf", "none": "None", "dict": "dict"}[td[0]]


def _sort_for_dict_order(td: tuple) -> tuple:
    """Dicts compare equal whatever their key order; compare sorted."""
    if td[0] == "dict":
        pairs = sorted(zip(td[1], td[2]), key=lambda kv: repr(kv[0]))
        return (
            "dict",
            tuple(k for k, _ in pairs),
            tuple(_sort_for_dict_order(c) for _, c in pairs),
        )
    if td[0] == "seq":
        return ("seq", td[1], tuple(_sort_for_dict_order(c) for c in td[2]))
    return td


def same_structure(td_a: tuple, td_b: tuple) -> bool:
    return _sort_for_dict_order(td_a) == _sort_for_dict_order(td_b)


def check_carry(
    fn: str,
    init_specs: list[ShapeDtype],
    init_def: tuple,
    out_tree: Any,
) -> list[mx.array]:
    """Check that the carry ``f`` returned matches ``init``; return its leaves.

    Raises ``TypeError`` listing every difference: structure first, then shape and
    dtype per leaf.
    """
    out_leaves, out_def = flatten(out_tree)
    diffs = _structure_differences(init_def, "init", out_def, "the returned carry")
    if not diffs:
        if out_def != init_def:  # same keys in another order: take init's order
            out_leaves = reorder_like(init_def, unflatten(out_def, out_leaves))
        for p_in, p_out, a, b in zip(
            paths(init_def, "init"), paths(init_def, "the returned carry"), init_specs, out_leaves
        ):
            if not isinstance(b, mx.array):
                diffs.append(
                    f"{p_in} has {describe(a)} but {p_out} is {with_article(type(b).__name__)}"
                )
            elif tuple(a.shape) != tuple(b.shape):
                diffs.append(
                    f"{p_in} has shape {tuple(a.shape)} but {p_out} has shape {tuple(b.shape)}"
                )
            elif a.dtype != b.dtype:
                diffs.append(f"{p_in} has dtype {a.dtype} but {p_out} has dtype {b.dtype}")
    if diffs:
        raise TypeError(
            f"[{fn}] f must return a carry with the same structure as init, but they differ:\n"
            + ";\n".join(f"  * {d}" for d in diffs)
            + ".\nReturn a carry whose structure, shapes and dtypes match init"
            " (cast with .astype(init.dtype) where a dtype was promoted)."
        )
    return out_leaves


def reorder_like(treedef: tuple, tree: Any) -> list[Any]:
    """Leaves of ``tree`` in the order ``treedef`` visits them (dict key order): for a
    tree that :func:`same_structure` matched with ``treedef``, whose dicts may hold the
    same keys in another order (its own flattening would pair leaves with the wrong
    keys)."""
    out: list[Any] = []
    _reorder_into(treedef, tree, out)
    return out


def _reorder_into(td: tuple, node: Any, out: list[Any]) -> None:
    if td[0] == "leaf":
        out.append(node)
    elif td[0] == "dict":
        for k, c in zip(td[1], td[2]):
            _reorder_into(c, node[k], out)
    elif td[0] == "seq":
        for c, child in zip(td[2], node):
            _reorder_into(c, child, out)
