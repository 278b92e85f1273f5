"""How :func:`chunkscan.scan` handles ``nn.Module`` parameters: the modules ``f``
reaches without being passed them (:func:`_warn_on_captured_modules`, which warns with
:class:`ClosureCaptureWarning` where they would get no gradient), binding a passed
module to each chunk's parameters and putting it back (:func:`_modules_set`), and the
warnings and errors of a module ``f`` replaces or receives flattened
(:func:`_check_params_kept`, :func:`_explain_flattened_module`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from . import _capture, _tree


class ClosureCaptureWarning(UserWarning):
    """``f`` reaches an ``nn.Module`` with trainable parameters that ``scan`` is not
    passed, so cannot differentiate (a zero gradient)."""


def _check_params_kept(module: nn.Module, p: list[mx.array], p_def: tuple) -> None:
    """Warn where ``f`` replaced a trainable parameter of the ``params`` module (``p``,
    tree ``p_def``: what it held as ``f`` started) in the first chunk's forward call:
    scan sets the module's trainable parameters to the chunk's handles at every chunk
    and puts them back after it, so a replacement does not reach the next chunk. State
    kept there (``self.pos = self.pos + 1`` on an unfrozen step counter) started again
    from the value before the scan at every chunk (found by probing: outputs and
    gradients off, no error). A warning, not an error:
    values ``f`` derives again at each call are replaced as well and stay right (a layer
    under ``nn.utils.checkpoint``, which sets fresh handles; weight norm; weights tied
    by assignment; an index or mask rebuilt: a first cut that raised refused them,
    review). An in-place update (``self.pos += 1``) cannot be told from here."""
    leaves, treedef = _tree.flatten(module.trainable_parameters())
    if treedef == p_def and all(a is b for a, b in zip(leaves, p)):
        return
    # Items appended to a list of the module (a log f keeps) are new paths, not
    # replacements: kept as they are (test_a_list_a_module_appends_to_grows_once_per_step).
    now = dict(zip(_tree.paths(treedef, "params"), leaves))
    names = [n for n, a in zip(_tree.paths(p_def, "params"), p) if n in now and now[n] is not a]
    if not names:
        return
    what = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    warnings.warn(
        f"[scan] f replaced {what} of params ({type(module).__name__}) in the first chunk. "
        "scan passes params to every chunk as they were before the scan and puts them "
        "back after each chunk, so a replacement does not reach the next chunk: state "
        "that changes from step to step (a step counter) belongs in the carry (init). "
        "Values f derives again at each call (a layer under nn.utils.checkpoint, weight "
        "norm, tied weights) are fine: filter this warning for them.",
        UserWarning,
        stacklevel=5,
    )


def _explain_flattened_module(error: Exception, module: nn.Module) -> None:
    """Where ``f`` failed on a plain dict where it called the ``params`` module, raise a
    ``TypeError`` saying why: ``mx.compile`` and ``mx.checkpoint`` (around ``f``, its
    step, or behind a lambda or partial) hand the function a dict of the module's arrays,
    and ``chunkscan.checkpoint`` refuses a module. The error was MLX's "'dict' object is
    not callable" from the user's step, or chunkscan.checkpoint's advice to pass
    ``params=module``, which was given (found by probing). A wrapped ``f`` that reads
    the dict by key works, and is left alone (review). An attribute error of a dict that
    is not a flattened module (:func:`_flattened_module`: ``cfg.scale`` on a config dict)
    is the user's own and stays as it was (it was rewritten into this advice, as a
    ``TypeError``; found by probing, session 51)."""
    text = str(error)
    flattened = "'dict' object" in text or (
        text.startswith("[checkpoint]") and "is an nn.Module" in text
    )
    obj, name = getattr(error, "obj", None), getattr(error, "name", None)
    if isinstance(error, AttributeError) and isinstance(obj, dict) and isinstance(name, str):
        flattened = _flattened_module(obj, name, module)
    if not flattened or text.startswith("[scan] f failed on a plain dict"):  # nested scans
        return
    raise TypeError(
        f"[scan] f failed on a plain dict, probably where it used the params module "
        f"({type(module).__name__}): a wrapper that flattens its arguments (mx.compile, "
        "mx.checkpoint around f or its step) hands f a dict of the module's arrays, and "
        "chunkscan.checkpoint takes no module. Pass f unwrapped: scan already recomputes "
        "each chunk in its backward, so no checkpoint is needed, and mx.compile can go "
        "around the whole loss instead; or pass params=module.trainable_parameters() and "
        f"call module.update(params) in f. ({type(error).__name__}: {text})"
    ) from error


def _flattened_module(obj: dict, name: str, module: nn.Module) -> bool:
    """Whether ``obj``, a dict on which the attribute ``name`` was not found, is
    ``module`` or one of its submodules flattened into its arrays: its values arrays or
    containers (a config dict's are not), its keys among that module's, and ``name`` an
    attribute of that module (``mod.layers``, ``mod["proj"].weight``, ``mod.children``),
    read without running the user's code (``hasattr`` ran a property; review)."""
    if not all(isinstance(v, (mx.array, dict, list, tuple)) for v in dict.values(obj)):
        return False
    keys, missing = set(dict.keys(obj)), object()  # (dict's own: a subclass's are the user's)
    return any(
        keys <= set(m) and (name in m or inspect.getattr_static(m, name, missing) is not missing)
        for _, m in module.named_modules()
    )


def _updates_itself(bound: tuple, p: list[mx.array]) -> bool:
    """Whether ``f``'s call left the bound module holding the chunk's handles on
    ``params`` (``model.update(params)`` in ``f``, MLX's functional pattern): then the
    recomputation needs no binding (it cost a walk and two updates of the module per
    chunk)."""
    module, _, where, held = bound
    leaves = _tree.flatten(module.trainable_parameters())[0]
    # ... and not the arrays it held before (the ids of params' own, which p would be
    # without fresh handles: the binding would then be skipped wrongly)
    return len(leaves) == len(where) and all(
        a is p[i] and id(a) != before for a, i, before in zip(leaves, where, held)
    )


@contextlib.contextmanager
def _modules_set(sets: list[tuple[nn.Module, Any]], everything: bool):
    """Set each module of ``sets`` to its tree (``Module.update``; ``None``: left as it
    is) for the block, and put back on exit, last first, what each held on entry: all
    of its arrays where ``everything`` (the recomputation), else its trainable
    parameters (see :meth:`chunkscan.scan._Plan.modules_set`). Where ``everything``,
    the block runs on fresh handles of all the module's arrays (``astype`` to the same
    dtype: no copy), so that an in-place update in ``f`` (``self.n += 1``) changes those
    and not the arrays put back: it kept its object, and moved twice per step (found by
    probing, session 41). A set that raises leaves those before it put back."""
    kept = []
    # One fresh handle per array object: an array held in two places (``self.view =
    # self.buf``) stays one array, so that an in-place write through one is read
    # through the other (two handles lost that gradient; found by review).
    fresh: dict[int, mx.array] = {}

    def handle(a: mx.array) -> mx.array:
        if id(a) not in fresh:
            fresh[id(a)] = a.astype(a.dtype)
        return fresh[id(a)]

    lengths: list[tuple[list, int]] = []  # the modules' lists, cut back at exit
    try:
        for module, tree in sets:
            arrays = module.parameters() if everything else module.trainable_parameters()
            kept.append((module, arrays))
            if everything:
                lengths += _list_lengths(module)
                module.update(tree_map(handle, arrays))
            if tree is not None:
                module.update(tree)
        yield
    finally:
        for module, arrays in reversed(kept):
            module.update(arrays)
        for items, n in lengths:
            del items[n:]


def _list_lengths(module: nn.Module) -> list[tuple[list, int]]:
    """``(list, its length)`` for every list the module and its submodules hold in an
    attribute, public or private: what the recomputation appends to one (a history
    ``f`` keeps, ``self.hist.append(x)``) is cut off again, so that each step appends
    once, as in the loop (twice before, the recomputation's in reverse chunk order;
    found by probing)."""
    found = []
    for m in module.modules():
        for value in [*m.values(), *vars(m).values()]:
            if isinstance(value, list):
                found.append((value, len(value)))
    return found


def _warn_on_captured_modules(
    f: Callable, passed_leaves: list[mx.array], passed_def, params_module: nn.Module | None = None
) -> tuple[list[nn.Module], list[tuple[nn.Module, Any, list[int], list[int]]]]:
    """Every ``nn.Module`` ``f`` reaches without being passed it, found by
    :func:`chunkscan._capture.captured_modules` (the walk runs once per call); and warn
    once per ``nn.Module`` with trainable parameters that ``f`` reaches without
    being passed it (closures, globals, ``functools.partial``, bound methods, class
    methods, ``stepwise``'s step; see :mod:`chunkscan._capture`). Passed, so fine: a
    module whose every trainable array is one of ``params``' (``passed_leaves``, its
    tree ``passed_def``): the ``params`` module and its submodules, ``self`` captured by
    a method that passes ``params=self.cell`` where ``self.cell`` is its only trainable
    part (or the method reads only ``self.cell`` off it); and a module whose parameter
    tree ``params`` is, in structure, shapes and dtypes
    (``params=model.trainable_parameters()`` with ``model.update(params)`` in ``f``;
    under a transform ``params`` are the transform's arrays, not the module's).
    The last two warned falsely before (found by probing). One test covers these, and a
    module with no trainable array. The match by structure is not taken where
    ``params`` is a module (``params_module``) or another captured module holds its
    arrays: the match could only be another module of the same architecture (a forward
    and a backward cell), whose gradient was zero without a warning; where two or more
    match and none holds them (under a transform), one warning names them all (both
    found by probing). Matched against the whole of ``params`` only: a module that is a
    part of it (``params`` a dict of two modules' trees, under a transform) warns
    falsely; matching every subtree missed true warnings and cost O(n^2) (a review).

    Returns the modules found, and for each module whose every trainable array is one
    of ``passed_leaves`` (by identity), ``(module, tree of its trainable parameters,
    index in passed_leaves of each leaf, id of each leaf)``: what
    :meth:`chunkscan.scan._Plan.modules_set` and :func:`_updates_itself` need (ids, not
    the arrays: the plan holds no primal)."""
    passed: dict[int, int] = {}
    for i, a in enumerate(passed_leaves):
        passed.setdefault(id(a), i)
    kinds = [(a.shape, a.dtype) for a in passed_leaves]
    step = getattr(f, "_chunkscan_step", None)
    unpassed, alike, params_found, bound = [], [], params_module is not None, []
    found = _capture.captured_modules(f, params_module)
    for path, value in found:
        tree = value.trainable_parameters()  # walks the module: once
        leaves, treedef = _tree.flatten(tree)
        shaped = _tree.same_structure(treedef, passed_def) and kinds == [
            (a.shape, a.dtype) for a in _tree.reorder_like(passed_def, tree)
        ]
        if all(id(a) in passed for a in leaves):
            params_found = params_found or (shaped and bool(leaves))
            if leaves:
                ids = [id(a) for a in leaves]
                bound.append((value, treedef, [passed[i] for i in ids], ids))
        elif shaped:
            alike.append((path, value))
        else:
            unpassed.append((path, value))
    if len(alike) > 1 and not params_found:
        # Two or more modules of params' architecture (a forward and a backward cell)
        # and none of them params' own arrays (under a transform): one may be the
        # module params stands for, the others get no gradient (found by probing).
        names = " and ".join(repr(path[-1]) for path, _ in alike)
        warnings.warn(
            f"[scan] f captures the nn.Modules {names}, each of the structure, shapes and "
            "dtypes of params: at most one of them is the module params stands for (updated "
            "from it in f); the others' parameters are constants inside scan and get no "
            "gradient (if f updates each of them from params, shared weights, this does "
            "not apply). Pass a module that holds them all as params=module (each an "
            "attribute of it), and use the third argument of f.",
            ClosureCaptureWarning,
            stacklevel=3,
        )
    elif params_found:  # params' module is passed: another of its architecture is not
        unpassed += alike
    for path, value in unpassed:
        name = path[-1]
        # (a bound method's self, or what it reads off self: "through self.proj")
        closure = len(path) == 1 and path[0].split(".")[0].split("[")[0] != "self"
        how = "by closure" if closure else "through " + " -> ".join(path)
        dotted = name.split(".")  # a module's attribute (cfg.net) is an expression too
        arg = name if all(n.isidentifier() for n in dotted) and name != "self" else "module"
        if step is not None:
            use = "take it as the third argument of step: step(carry, x, params)"
        else:
            use = "use the third argument of f: f(carry, xs, params)"
        # The chunk function or step is the module itself (scan(cell), stepwise(cell),
        # partial(cell)): it was named by an internal variable, 'f' or 'step' (probing).
        partial_of = f.func if isinstance(f, functools.partial) else None
        if path[0] == _capture.PARAMS_CALL:  # read in the params module's __call__
            message = (
                f"[scan] the params module's {path[1]} reaches the nn.Module {name!r} "
                f"({type(value).__name__}) through {' -> '.join(path)}; its parameters are "
                "constants inside scan and get no gradient. Make it an attribute of the "
                f"params module (self.{arg if arg != 'module' else 'sub'} = ... in its "
                "__init__), so that params holds it."
            )
        elif any(value is g for g in (f, step, partial_of)):
            message = (
                f"[scan] {'the step' if value is step else 'f'} is itself an nn.Module "
                f"({type(value).__name__}); its parameters are constants inside scan and "
                "get no gradient. Pass the module as params too (scan(..., "
                "params=module)) and use the third argument of its __call__."
            )
        else:
            message = (
                f"[scan] f captures the nn.Module {name!r} ({type(value).__name__}) {how}; "
                "its parameters are constants inside scan and get no gradient. Pass it as "
                f"params={arg} and {use}."
            )
        warnings.warn(message, ClosureCaptureWarning, stacklevel=3)
    return [value for _, value in found], bound
