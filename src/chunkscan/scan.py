"""``scan``: a chunked scan whose backward keeps T/C carries plus one chunk.

The whole sequence is one ``mx.custom_function``. Its forward runs the chunks in order
and returns, besides the final carry and the outputs, the carry entering every chunk
(the only values kept for the backward pass). Its backward walks the chunks in
reverse, recomputes each from its saved carry with ``mx.vjp`` and applies the ordering
rules of :mod:`chunkscan._ordering` so that the scheduler really finishes, and frees,
one chunk before it starts the next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import _ordering, _random, _tree
from ._scan_checks import (
    _check_arity,
    _check_stepwise_axis,
    _check_stepwise_ys_axis,
    _check_xs,
    _check_ys,
    _grad_mask,
    _YsSpec,
)
from ._scan_params import ClosureCaptureWarning as ClosureCaptureWarning  # (public)
from ._scan_params import (  # (names of scan's own: the tests patch _modules_set here)
    _check_params_kept,
    _explain_flattened_module,
    _modules_set,
    _updates_itself,
    _warn_on_captured_modules,
)
from .split import (
    check_axis,
    check_chunk_size,
    chunk_bounds,
    slices_at,
    split_at,
    sqrt_blocks,
)
from .stepwise import check_compiled_axis, scan_axis


def scan(
    f: Callable[..., tuple[Any, Any]],
    init: Any,
    xs: Any,
    *,
    chunk_size: int = 32,
    params: Any = None,
    axis: int = 0,
    xs_grad: bool | Any = True,
) -> tuple[Any, Any]:
    """Scan ``f`` over chunks of ``xs``, keeping only the carries between chunks and
    recomputing each chunk in the backward pass.

    ``f(carry, xs_chunk) -> (carry, ys_chunk)``, or ``f(carry, xs_chunk, params)`` when
    ``params`` is given. ``xs_chunk`` is ``xs`` cut to at most ``chunk_size`` steps along
    ``axis``; ``ys_chunk`` must have the same length on ``axis``. Values and gradients
    match, to float tolerance, this loop::

        carry, ys = init, []
        for lo in range(0, T, chunk_size):
            carry, y = f(carry, take(xs, slice(lo, lo + chunk_size), axis), params)
            ys.append(y)
        return carry, concatenate(ys, axis)

    Unlike the loop (with or without ``mx.checkpoint``), backward memory is
    ``T / chunk_size`` carries plus one chunk's recomputation plus the gradients
    themselves (and about ``sqrt(T / chunk_size)`` carries of zeros: MLX's cotangents
    of the saved carries, which the backward reads for second derivatives), whichever
    of ``init``, ``xs`` and ``params`` the gradient is taken with respect to. Works
    eagerly, under ``mx.compile`` and under ``nn.value_and_grad``. Use
    :func:`chunkscan.stepwise` to write ``f`` per step. One difference from the loop: an
    output the loss never reads (a diagnostic ``ys`` leaf, an unused carry leaf) gets a
    zero cotangent, as with ``mx.checkpoint``, so an infinite derivative there
    (``log|x|`` or ``sqrt`` at 0) makes ``0 * inf = NaN`` in the gradients; compute such
    outputs under ``mx.stop_gradient`` (docs/design.md, "Known limits").

    ``f`` must be a function of its arguments (the backward calls it again on the same
    ones): the same Python state when recomputed, as with ``mx.checkpoint``; and it gets
    handles of its own on the carry, xs and params leaves, so an in-place update
    (``h = params["h0"]; h += ...``) lasts for that call, where the loop above would
    carry an update of ``params`` on to the next chunks.

    Random ops in ``f`` that draw from MLX's global key (``nn.Dropout``,
    ``mx.random.*`` without ``key=``) draw the same numbers when the backward recomputes
    a chunk as in its forward (and in the forward's second run under ``mx.jvp`` or
    ``mx.vmap``, where those run: a scan with no carry whose ``T`` fits in one chunk);
    the recomputation leaves the global key as it found it, and draws of the backward
    itself (in a custom vjp) take from the user's key. Reading the key without drawing
    from it is not noticed (``docs/design.md``, "Random ops in a recomputed function").

    Supported transforms: reverse mode (``mx.grad``, ``mx.vjp``, ``mx.value_and_grad``,
    ``nn.value_and_grad``), also nested (second derivatives, whose memory grows with T
    as plain autograd's: they keep the first backward's recomputations), and
    ``mx.compile`` (which retraces once per input shape).
    Not supported, and failing at the first call with MLX's message (never silently):
    ``mx.vmap`` and ``mx.jvp`` (``Not implemented for Depends``: put a batch axis into
    ``init`` and ``xs`` instead; a scan without a carry whose ``T`` fits in one chunk
    has nothing to order and runs them, with the loop's values) and
    ``mx.compile(..., shapeless=True)`` (``Slice cannot infer output shapes``: the chunk
    boundaries depend on the shapes).

    Args:
        f (callable): The chunk function.
        init (tree of array): Initial carry, e.g. ``[H, Dv, Dk]``. Integer and
            boolean leaves (a position counter) get no gradient, here and in ``params``.
        xs (tree of array): Length ``T`` on ``axis`` for every leaf, e.g. ``[T, H, D]``.
        chunk_size (int, optional): Steps per chunk; need not divide ``T``.
            Default: ``32``.
        params (tree of array or nn.Module, optional): Arrays ``f`` differentiates,
            passed as its third argument. Arrays ``f`` captures by closure are
            constants and get **no gradient**; pass them here. Their gradients are
            summed over the chunks in each leaf's dtype, as MLX's autograd sums a
            loop's: a bfloat16 leaf's sum stops growing once it is some 256 chunks'
            shares; pass such a leaf in float32 (cast before the scan) where chunks
            are many. An ``nn.Module`` is
            passed to ``f`` as itself, with its trainable parameters differentiated
            (what ``nn.value_and_grad`` needs); arrays it updates in place (such as
            ``nn.BatchNorm``'s running statistics) are updated once per step, as by a
            loop: the backward's recomputation restores them (those of a module ``f``
            reaches without ``params`` too). The recomputation reads such state as the
            forward left it, so no output may depend on state ``f`` updates (a step
            counter in the module: wrong gradients); keep that in the carry. A
            trainable parameter ``f`` changes does not reach the next chunk: one
            replaced warns (``UserWarning``; harmless for values derived again at each
            call, such as a layer under ``nn.utils.checkpoint``), and an in-place
            update (``self.pos += 1``) is lost unseen. The module holds the chunk's
            arrays while ``f`` runs and gets its own back after each chunk (forward
            and backward): another thread must not update it (or a module ``f``
            reaches) during the call, or the update is undone. ``scan`` warns
            (:class:`ClosureCaptureWarning`) about each ``nn.Module`` with trainable
            parameters that ``f`` reaches without it: through closures, globals,
            ``functools.partial``, bound methods, ``stepwise``'s step, or the
            ``__call__`` of the ``params`` module's class (a bounded walk; what it does
            not follow: ``docs/design.md``, "Known limits"). With
            ``params``, ``f`` (or the step) must take a third argument. A module
            cannot be called through a wrapper that flattens its arguments
            (``mx.compile``, ``mx.checkpoint``, ``chunkscan.checkpoint`` around ``f``
            or its step: a ``TypeError`` that says so). Default: ``None``.
        axis (int, optional): Scanned axis of every ``xs`` and ``ys`` leaf; a
            negative axis counts from the end of each leaf. ``stepwise(step)`` steps
            along it, also wrapped (a partial, a lambda). Default: ``0``.
        xs_grad (bool or tree of bool, optional): ``False`` (for all of ``xs``, or per
            leaf as a tree like ``xs``) declares that no gradient is needed for those
            inputs: they are treated as constants (``mx.stop_gradient``), which saves
            their gradient computation in the backward pass. Integer and boolean
            leaves (token ids, masks) never get a gradient, whatever ``xs_grad``
            says. Default: ``True``.

    Returns:
        tuple: ``(carry, ys)``; ``ys`` concatenated on ``axis``, e.g. ``[T, H, Dv]``.

    Example:
        >>> def run(s, x):                 # s: [H, D, D]; x = (q, k, v), each [C, H, D]
        ...     ...                        # the per-step loop over the chunk
        ...     return s, y                # y: [C, H, D]
        >>> s, y = chunkscan.scan(run, s0, (q, k, v), chunk_size=32)
    """
    if not callable(f):
        raise TypeError(f"[scan] f must be callable but got {type(f).__name__}.")
    chunk_size = check_chunk_size("scan", chunk_size)
    axis = check_axis("scan", axis)
    init_leaves, init_def = _tree.require_arrays("scan", "init", init)
    xs_leaves, xs_def = _tree.require_arrays("scan", "xs", xs)
    axes, length = _check_xs(xs_leaves, xs_def, axis)
    grad_mask = _grad_mask(xs_grad, xs_leaves, xs_def, xs)
    _check_arity(f, params is not None)
    _check_stepwise_axis(f, axis, xs_leaves, xs_def)

    module = params if isinstance(params, nn.Module) else None
    if module is not None:
        p_leaves, p_def = _tree.require_arrays("scan", "params", module.trainable_parameters())
    else:
        p_leaves, p_def = _tree.require_arrays("scan", "params", params)
    captured, bound = _warn_on_captured_modules(f, p_leaves, p_def, params_module=module)

    plan = _Plan(
        f=f,
        has_params=params is not None,
        module=module,
        captured=[m for m in captured if m is not module],
        bound=bound if module is None else [],
        init_def=init_def,
        init_specs=[_tree.ShapeDtype(a.shape, a.dtype) for a in init_leaves],
        xs_def=xs_def,
        axes=axes,
        grad_mask=grad_mask,
        bounds=chunk_bounds(length, chunk_size),
        p_def=p_def,
        axis=axis,
    )
    whole = mx.custom_function(plan.forward)
    whole.vjp(plan.backward)
    diff_xs = [x for x, g in zip(xs_leaves, grad_mask) if g]
    # The constant xs leaves (integer, boolean, or left out by xs_grad) are primals too,
    # behind a stop_gradient, last: held by the plan instead, they were captured arrays
    # of the custom function, which mx.vmap cannot map (a one-chunk carryless scan over
    # token ids failed with "Attempting to eval an array without a primitive"; found by
    # probing, session 50), and they kept the graph that made them alive with the vjp.
    consts = [mx.stop_gradient(x) for x, g in zip(xs_leaves, grad_mask) if not g]
    outs = _tree.as_list(whole(*init_leaves, *diff_xs, *p_leaves, *consts))
    n_init, n_ys = len(init_leaves), plan.n_ys(len(outs))
    carry_out = _tree.unflatten(init_def, outs[:n_init])
    ys_out = _tree.unflatten(plan.ys_spec.treedef, outs[n_init : n_init + n_ys])
    return carry_out, ys_out


class _Plan:
    """Everything about one ``scan`` call except the arrays it differentiates.

    ``forward`` and ``backward`` are the custom function and its vjp over the flat
    primals ``init leaves + differentiable xs leaves + params leaves + constant xs
    leaves`` (the last behind a ``stop_gradient``; zero cotangents). The forward
    returns ``final carry + ys + the carries entering chunks 1..n-1``, the latter
    stacked in blocks of about ``sqrt(n)`` chunks (per block, one array per carry leaf
    with the block's chunks on a new leading axis): every output of a primitive lists
    its siblings in MLX, so ``n`` separate outputs would cost ``O(n^2)``. The plan holds
    no reference to a primal: the vjp outlives the call, and a held array would keep
    the graph that produced it alive.
    """

    def __init__(
        self,
        *,
        f,
        has_params,
        module,
        captured,
        bound,
        init_def,
        init_specs,
        xs_def,
        axes,
        grad_mask,
        bounds,
        p_def,
        axis,
    ):
        self.f, self.has_params, self.module = f, has_params, module
        # Modules f reaches without params (_capture): the recomputation runs them on
        # fresh handles and puts their arrays back afterwards (state f updates, as
        # nn.BatchNorm's running statistics in training mode, moves once per step).
        self.captured = captured
        # Captured modules whose every trainable array is one of params' (a module f
        # calls, params its own arrays): (module, its tree, the index in params of
        # each leaf, the id of each leaf). They read the chunk's params in the
        # recomputation (modules_set), but for those f itself updates from them (found
        # after the first chunk's call).
        self.bound = bound
        self.init_def, self.init_specs = init_def, init_specs
        self.xs_def, self.axes, self.grad_mask = xs_def, axes, grad_mask
        self.bounds, self.p_def, self.axis = bounds, p_def, axis
        self.cuts = [lo for lo, _ in bounds[1:]]
        n_saved = len(bounds) - 1
        # Blocks of saved carries (chunk indices 1..n-1): about sqrt(n) blocks of
        # about sqrt(n) carries keep the outputs, and their sibling lists, O(n) in all.
        self.saved_blocks = [(lo + 1, hi + 1) for lo, hi in sqrt_blocks(n_saved)]
        self.block_ends = {hi - 1 for _, hi in self.saved_blocks}
        self.n_init, self.n_dx = len(init_specs), sum(grad_mask)
        diff_axes = [ax for ax, g in zip(axes, grad_mask) if g]
        const_axes = [ax for ax, g in zip(axes, grad_mask) if not g]
        self.diff_axes, self.const_axes = diff_axes, const_axes
        self.ys_spec = _YsSpec()
        # Per chunk, the global random key its forward call started from, where it drew
        # from it (_random): the recomputation draws the same numbers.
        self.starts = _random.Starts()

    def n_ys(self, n_outputs: int) -> int:
        return n_outputs - self.n_init * (1 + len(self.saved_blocks))

    def chunked(
        self, leaves: list[mx.array], axes: list[int], differentiable: bool = False
    ) -> list[list[mx.array]]:
        """Per leaf, its chunks (views). ``differentiable``: cut with :func:`split_at`,
        whose vjp concatenates (one concatenate up to 16 chunks, a tree above); else
        plain slices, whose vjp is a zero-padded buffer as large as the leaf per chunk
        (fine where no vjp is built: inside the custom function's forward)."""
        if not self.cuts:
            return [[x] for x in leaves]
        cut = split_at if differentiable and _SPLIT_IN_BACKWARD else slices_at
        return [cut(x, self.cuts, ax) for x, ax in zip(leaves, axes)]

    def unstacked(self, blocks: list[mx.array]) -> list[list[mx.array]]:
        """Per chunk ``1..n-1``, its carry leaves, from the stacked blocks the forward
        returns (or from their cotangents)."""
        n = self.n_init
        out = []
        for b, (lo, hi) in enumerate(self.saved_blocks):
            stacked = blocks[b * n : (b + 1) * n]
            # A slice, not leaf[j]: MLX 0.32.4's vjp of an integer index of a zero-size
            # array divides by zero (SIGFPE), and a second derivative of scan takes it
            # for a zero-size carry leaf (found by probing)
            out.extend(
                [leaf[j : j + 1].reshape(leaf.shape[1:]) for leaf in stacked]
                for j in range(hi - lo)
            )
        return out

    def without_constants(self, primals: list) -> tuple[list, list[mx.array]]:
        """The custom function's primals split into ``init + diff xs + params`` and the
        constant xs leaves."""
        cut = len(primals) - len(self.const_axes)
        return primals[:cut], primals[cut:]

    def split_primals(self, primals: list) -> tuple[list, list, list]:
        n0, n1 = self.n_init, self.n_init + self.n_dx
        return primals[:n0], primals[n0:n1], primals[n1:]

    def xs_chunk(self, diff_chunk: list[mx.array], const_chunk: list[mx.array]) -> list[mx.array]:
        """One chunk's xs leaves in ``xs`` order, from its differentiable and constant
        leaves."""
        diff, const = iter(diff_chunk), iter(const_chunk)
        return [next(diff) if g else next(const) for g in self.grad_mask]

    def call_chunk(
        self, i: int, carry: list, xs_chunk: list, p: list, recompute: bool = False
    ) -> tuple[list, list]:
        """Run ``f`` on chunk ``i``; check and flatten what it returns. ``recompute``:
        the backward's second run, which leaves the modules' arrays as it found them
        (see :meth:`modules_set`)."""
        # f gets handles of its own on the carry and xs leaves: an in-place update in f
        # (``c += ...``, ``c[...] = ...``) rebinds the handle it was given, and the
        # forward keeps the carry handles that enter each chunk for the backward (the
        # recomputation cuts its xs chunks again from the primals). With the shared handles the
        # backward recomputed from the updated carry (found by probing: wrong
        # gradients, no error, from three chunks on). The params leaves too: an update
        # of one in f reached the next chunk's forward but not the recomputation (found
        # by probing: d/dh0 21 against the loop's 24). ``astype`` to the same dtype is
        # a new handle on the same array: no graph node, no copy.
        if _FRESH_HANDLES:
            carry = [c.astype(c.dtype) for c in carry]
            xs_chunk = [x.astype(x.dtype) for x in xs_chunk]
            p = [x.astype(x.dtype) for x in p]
        carry_tree = _tree.unflatten(self.init_def, carry)
        xs_tree = _tree.unflatten(self.xs_def, xs_chunk)
        with (
            scan_axis(self.axis),  # stepwise functions without an axis take scan's
            check_compiled_axis(self.f, self.axis, carry_tree, xs_tree),
            _modules_set(self.modules_set(p, recompute), everything=recompute),
        ):
            if not self.has_params:
                out = self.f(carry_tree, xs_tree)
            elif self.module is not None:
                check = i == 0 and not recompute
                # What the module holds as f starts: one submodule under two names (a
                # block shared by depth) holds one handle at both paths, not p's two
                # (compared with p, it warned falsely; found by probing, session 49).
                held = _tree.flatten(self.module.trainable_parameters()) if check else None
                try:
                    out = self.f(carry_tree, xs_tree, self.module)
                except (TypeError, AttributeError) as e:
                    _explain_flattened_module(e, self.module)
                    raise
                if check:
                    _check_params_kept(self.module, *held)
            else:
                out = self.f(carry_tree, xs_tree, _tree.unflatten(self.p_def, p))
                if i == 0 and not recompute and self.bound:
                    self.bound = [b for b in self.bound if not _updates_itself(b, p)]
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                "[scan] f must return a pair (carry, ys) but returned "
                f"{_tree.describe_return(out)}. Return a tuple of two: the new carry and this "
                "chunk's outputs."
            )
        new_carry = _tree.check_carry("scan", self.init_specs, self.init_def, out[0])
        lo, hi = self.bounds[i]
        _check_stepwise_ys_axis(self.f, self.axis, out[1])
        ys = _check_ys(out[1], self.ys_spec, hi - lo, self.axis)
        if not new_carry and not ys:  # MLX's custom function of no outputs crashes
            raise ValueError(
                "[scan] f returned no array: neither a carry (init has none) nor ys. "
                "Return at least one array, as the carry or as an output."
            )
        return new_carry, ys

    def modules_set(self, p: list[mx.array], recompute: bool) -> list[tuple[nn.Module, Any]]:
        """The modules whose arrays a call of ``f`` on a chunk sets, and to what
        (``None``: kept only), for :func:`_modules_set`:

        - the ``params`` module: its trainable parameters set to ``p`` (the chunk's
          handles on them); after the backward's recomputation all its arrays are put
          back, so that state ``f`` updates in place (``nn.BatchNorm``'s running
          statistics in training mode) moves once per step, as in the loop, not twice
          (before session 27 it did);
        - (the captured modules that are not bound are set once around the whole
          backward, :meth:`captured_set`, not per chunk);
        - in the recomputation, the bound modules (``bound``: a module ``f`` calls by
          closure whose every trainable array is one of ``params``, ``model.update(
          params)`` before ``scan`` or ``nn.value_and_grad(model, ...)`` passing
          ``params=model.trainable_parameters()``): their trainable arrays set to the
          ones ``mx.vjp`` differentiates. Where ``f`` did not read its third argument
          the recomputation read the module's own arrays, constants to ``mx.vjp``: a
          zero gradient, no warning (found by probing, session 40). The forward needs
          no binding: it reads the same values, and no gradient flows through it; nor
          does a module that ``f`` updates from its third argument itself (seen after
          the first chunk's call: :func:`_updates_itself`).

        Items a recomputation appends to a list of a module are cut off again
        (:func:`_list_lengths`); one walk of each module per call."""
        sets: list[tuple[nn.Module, Any]] = []
        if recompute:
            sets += [
                (m, _tree.unflatten(td, [p[i] for i in where])) for m, td, where, _ in self.bound
            ]
        if self.module is not None:
            sets.append((self.module, _tree.unflatten(self.p_def, p)))
        return sets

    def captured_set(self):
        """The backward's block for the modules ``f`` reaches by closure and reads
        (captured, not bound): on fresh handles of their arrays for the whole
        recomputation, their arrays put back after it, so that state ``f`` updates in
        them moves once per step, as in the loop (replaced or updated in place: state
        reached by closure moved twice per step, silently; found by probing, sessions
        39 and 41). Once per backward, not per chunk: set per chunk, a frozen base model
        of 2402 arrays captured by closure cost 335 ms a step against 60 at 32 chunks
        (review)."""
        bound = {id(b[0]) for b in self.bound}  # (set per chunk, as modules_set says)
        sets = [(m, None) for m in self.captured if id(m) not in bound]
        return _modules_set(sets, everything=True)

    def forward(self, *primals: mx.array) -> list[mx.array]:
        primals, consts = self.without_constants(list(primals))
        # stop_gradient again inside: mx.jvp of the custom function sends tangents to
        # every primal, and one used as indices raised (gather has no jvp there); the
        # integer and boolean carry and params leaves too (an index table in params
        # raised so; found by probing, session 53)
        primals = [_stopped_unless_float(a) for a in primals]
        const_chunks = self.chunked([mx.stop_gradient(c) for c in consts], self.const_axes)
        carry, diff_xs, p = self.split_primals(primals)
        diff_chunks = self.chunked(diff_xs, self.diff_axes)
        ys_per_chunk, saved, block = [], [], []
        ys: list[mx.array] = []
        for i in range(len(self.bounds)):
            if i > 0:
                block.append(carry)
            if i in self.block_ends:
                stacked = [mx.stack(list(leaf)) for leaf in zip(*block)]
                saved.extend(stacked)
                block = []
                # Rule 1 again: the stacked block is an output; the chain moves on
                # only once it exists, so the block's separate carries are freed now
                # rather than all at the end of the forward.
                carry = _ordering.carry_after_outputs(carry, stacked)
            xs_i = self.xs_chunk([c[i] for c in diff_chunks], [c[i] for c in const_chunks])
            # Rule 5: the chunk's inputs wait for the carry entering it, so that the
            # work f does on the inputs alone (dplr_delta_rule's pairwise decays and
            # triangular inverse) runs chunk by chunk, not every chunk's up front, all
            # alive at once (found by probing: dplr_delta_rule's backward grew 3.61 MiB
            # from T = 256 to 1024 at chunks of 32 against 1.31 with the edge,
            # bench/results/cpu/memory_tests_98117e4.jsonl).
            # With no carry (init None: a chunked loss), the previous chunk's outputs
            # stand for it: every edge anchored on an empty carry was skipped, and the
            # chunks ran together (found by probing, session 47; a chunked cross-entropy's
            # backward grew 6.60 MiB from T = 256 to 1024 without the edges, -0.32 with
            # them: tests/test_memory.py, memory_tests_carryless_d845282.jsonl).
            xs_i = _ordering.prepare_after_carry(xs_i, carry if carry else ys)
            with self.starts.forward(i):  # (run again by mx.jvp and mx.vmap: replayed)
                carry, ys = self.call_chunk(i, carry, xs_i, p)
            # Rule 1: the carry leaves the chunk only after the chunk's outputs exist.
            # (Not in the recomputation: its outgoing carry is never used, and the
            # Depends would make the vjp recompute ys a state-only gradient never needs.)
            carry = _ordering.carry_after_outputs(carry, ys)
            ys_per_chunk.append(ys)
        ys = [
            mx.concatenate(list(parts), axis=self.axis % parts[0].ndim)
            if len(parts) > 1
            else parts[0]
            for parts in zip(*ys_per_chunk)
        ]
        return carry + ys + saved

    def backward(self, primals, cotangents, outputs) -> list[mx.array]:
        primals, cotangents = _tree.as_list(primals), _tree.as_list(cotangents)
        outputs = _tree.as_list(outputs)
        n_init = self.n_init
        n_ys = self.n_ys(len(outputs))
        primals, consts = self.without_constants(primals)
        const_chunks = self.chunked(consts, self.const_axes)
        init, diff_xs, p = self.split_primals(primals)
        carries_in = [init, *self.unstacked(outputs[n_init + n_ys :])]
        ct_carry = cotangents[:n_init]
        ct_ys = cotangents[n_init : n_init + n_ys]
        # The saved carries are outputs too: a gradient of this backward (a second
        # derivative) sends them cotangents, which join the carry's at their chunk.
        # In a first derivative they are MLX's zeros, and one block of them (about
        # sqrt(n) carries) is alive while its chunks are processed: at T = 2048, C = 16
        # in tests/test_memory.py's shape, 14.2 MiB peak against 13.3 without them.
        ct_saved = [None, *self.unstacked(cotangents[n_init + n_ys :])]
        # Cut with split_at: a second derivative differentiates this backward, and a
        # plain slice's vjp is a zero-padded buffer of the whole length per chunk
        # (found by probing: the second derivative's peak grew superlinearly, 359 MiB
        # at T = 4096 against 208 for the per-step loop).
        ct_ys_chunks = self.chunked(ct_ys, [self.axis % c.ndim for c in ct_ys], True)
        diff_chunks = self.chunked(diff_xs, self.diff_axes, True)

        # Integer and boolean carry and params leaves (a position counter, an index
        # table) are constants of the recomputation, as in ``checkpoint``: MLX has no
        # gradient with respect to indices, and asking the vjp for one raised
        # ("[gather] Cannot calculate VJP with respect to indices") where the loop
        # differentiated (found by probing). They get zero cotangents.
        floats = [mx.issubdtype(a.dtype, mx.inexact) for a in init + diff_xs + p]
        with self.captured_set():
            grads = self._backward_chunks(
                init, diff_xs, p, carries_in, ct_carry, ct_saved, ct_ys_chunks, diff_chunks,
                const_chunks, floats,
            )  # fmt: skip
        # the constants' cotangents, one per primal as the custom function requires:
        # zeros that nothing evaluates (the constants sit behind a stop_gradient)
        return grads + [mx.zeros_like(c) for c in consts]

    def _backward_chunks(
        self, init, diff_xs, p, carries_in, ct_carry, ct_saved, ct_ys_chunks, diff_chunks,
        const_chunks, floats,
    ) -> list[mx.array]:  # fmt: skip
        """:meth:`backward`'s reverse loop over the chunks."""
        n_dx, n_chunks = self.n_dx, len(self.bounds)
        d_xs_chunks: list[list[mx.array]] = [[] for _ in range(n_dx)]
        d_p: list[mx.array] = []
        done: list[mx.array] = []  # the chunk after's gradients (anchors without a carry)
        for i in reversed(range(n_chunks)):
            # Rule 2: recompute chunk i only once the cotangent flowing into it exists.
            # It gates the xs chunks too: Depends is never merged by mx.compile's
            # common-subexpression elimination, so the recomputation cannot be merged
            # with the forward's work on the same xs (which would keep the forward's
            # per-chunk values alive until the backward).
            # With no carry: once the chunk after has its gradients, and this chunk's
            # ys cotangent exists (see the forward).
            flowing_in = ct_carry if ct_carry else done + [c[i] for c in ct_ys_chunks]
            waited = _ordering.recompute_after_cotangent(
                carries_in[i] + [c[i] for c in diff_chunks], flowing_in
            )
            # The constant inputs wait for it too, in a Depends of their own (rule 2; a
            # Depends is never merged, so mx.compile cannot merge their recomputation
            # with the forward's). Not in ``waited``: outputs of one Depends are
            # siblings, and mx.vjp differentiates the siblings of a primal too. They
            # were anchored on themselves only (keep_apart), and the work a chunk does
            # on them alone (with xs_grad=False, or token ids: decays, a triangular
            # inverse) ran for nearly every chunk up front: 4.92 MiB of growth from
            # T = 256 to 1024 against -0.34 gated (found by probing, session 52;
            # tests/test_memory.py's constant-inputs test). They enter the vjp below as
            # primals: captured by chunk_fn behind this edge, a second derivative built
            # from two mx.grad calls came out half (the same probing; docs/design.md,
            # "Known limits").
            consts = [c[i] for c in const_chunks]
            if _GATE_CONSTANTS:
                consts = _ordering.recompute_after_cotangent(consts, flowing_in)
            else:  # the tests' negative control: the edge before session 52
                consts = _ordering.keep_apart(consts)

            # With no carry the params wait too: a chunk whose work reads no
            # differentiated input but them (every xs constant: a chunked loss over
            # token ids) had nothing else to wait on (review, session 47: its growth
            # 3.00 MiB eager, 13.75 compiled, from T = 256 to 1024). The vjp takes the
            # Depends' outputs as its primals, so no gradient goes through the edge.
            # Not with a carry: where f reads a param by closure inside a checkpoint of
            # its own, MLX gave half a second derivative built from two mx.grad calls
            # through such an edge (found by review, session 48, when it was tried for a
            # carry the work does not read; docs/design.md, "Known limits").
            primals_i = waited + (
                p if ct_carry else _ordering.recompute_after_cotangent(p, flowing_in)
            )
            if not all(floats):
                # Out of the Depends above they are outputs of the cotangents: a second
                # derivative would ask for their gradient again.
                primals_i = [a if d else mx.stop_gradient(a) for a, d in zip(primals_i, floats)]

            # Every primal enters the vjp, the integer and boolean ones behind a
            # stop_gradient inside: captured by chunk_fn instead (a step counter in the
            # carry), a second derivative built from two mx.grad calls came out wrong
            # (found by probing, session 42; chunkscan.checkpoint alike). The constant
            # xs chunks too (after the differentiated ones, their gradients dropped).
            n_main = len(primals_i)
            captured = [] if _CONSTANTS_AS_PRIMALS else consts  # (the negative control)

            def chunk_fn(
                *args: mx.array, i: int = i, captured: list = captured, n: int = n_main
            ) -> list[mx.array]:
                full = [a if d else mx.stop_gradient(a) for a, d in zip(args[:n], floats)]
                const_in = [mx.stop_gradient(a) for a in args[n:]] + captured
                c, dx, pp = self.split_primals(full)
                xs_i = self.xs_chunk(dx, const_in)
                new_c, ys = self.call_chunk(i, c, xs_i, pp, recompute=True)
                forward_done()
                return _distinct(new_c + ys)

            # scan_axis around the whole vjp, not only the call: a wrapper's own backward
            # (chunkscan.checkpoint or mx.checkpoint around a stepwise function without an
            # axis) recomputes it inside this vjp, after the call has returned; it stepped
            # along axis 0 there (found by probing: wrong gradients, no error, where a
            # batch was as long as the chunk).
            axis_held = scan_axis(self.axis) if _AXIS_IN_BACKWARD else contextlib.nullcontext()
            grads = primals_i  # (no float leaf: zeros for every one, below)
            if any(floats):
                cts = ct_carry + [c[i] for c in ct_ys_chunks]
                vjp_primals = primals_i + (consts if _CONSTANTS_AS_PRIMALS else [])
                with self.starts.recompute(i) as forward_done, axis_held:
                    _, grads = mx.vjp(chunk_fn, vjp_primals, cts)
                grads = grads[:n_main]
            grads = [g if d else mx.zeros_like(a) for g, a, d in zip(grads, primals_i, floats)]
            d_carry, d_x, d_p_i = self.split_primals(grads)
            d_p = [a + b for a, b in zip(d_p, d_p_i)] if d_p else d_p_i
            done = d_x + d_p  # (the sum, as rule 3's: each chunk's d_p_i freed in turn)
            if i > 0:
                d_carry = [a + b for a, b in zip(d_carry, ct_saved[i])]
            # Rule 3: the carry cotangent moves on only after this chunk's gradients.
            ct_carry = _ordering.cotangent_after_gradients(d_carry, d_x + d_p)
            for parts, g in zip(d_xs_chunks, d_x):
                parts.append(g)

        # Rule 4: one concatenate per input, no zero-padded per-chunk buffers.
        d_xs = [
            mx.concatenate(parts[::-1], axis=ax) if len(parts) > 1 else parts[0]
            for parts, ax in zip(d_xs_chunks, self.diff_axes)
        ]
        return ct_carry + d_xs + d_p


# Whether f gets handles of its own on the carry and xs leaves (see _Plan.call_chunk);
# the tests switch it off as the negative control.
_FRESH_HANDLES = True

# Whether the backward's constant xs chunks wait for the cotangent flowing into their
# chunk (rule 2; else anchored on themselves, as before session 52), and whether they
# enter the recomputation's vjp as primals (else captured by its function): see
# _Plan._backward_chunks; the tests' negative controls.
_GATE_CONSTANTS = True
_CONSTANTS_AS_PRIMALS = True

# Whether scan's axis holds through the whole vjp of a chunk in the backward (see there);
# the tests switch it off as the negative control.
_AXIS_IN_BACKWARD = True

# Whether the backward cuts xs and the ys cotangents with split_at (a concatenate as
# their vjp) rather than slices (see _Plan.backward); the tests' negative control.
_SPLIT_IN_BACKWARD = True


def _stopped_unless_float(a: mx.array) -> mx.array:
    """``a``, behind a ``stop_gradient`` where it is not floating (indices, masks)."""
    return a if mx.issubdtype(a.dtype, mx.inexact) else mx.stop_gradient(a)


def _distinct(arrays: list[mx.array]) -> list[mx.array]:
    """``arrays`` passed through a ``Depends`` each. ``mx.vjp`` keeps one cotangent per
    output array, so where ``f`` returns one array in two places (a carry ``(h, h)``, or
    ``h`` as the carry and as the output) the second place's cotangent was dropped
    (found by probing: half the gradient, no error). The ``Depends`` hands its cotangent
    on to the array, where MLX adds the two. All, not only the repeats of a Python
    object: two Python handles can hold one array (``h.astype(h.dtype)`` is ``h``), and
    Python cannot tell them apart. The first too: MLX 0.32.4's ``mx.vjp`` leaves out an
    output made by ``mx.stop_gradient`` and gives each later output the cotangent of the
    one before it, the last dropped (``vjp(lambda x: [stop_gradient(x), 2 * x], [x],
    [0, 1])`` is 0), so a first output under ``stop_gradient`` (an online softmax's
    running max, an integer carry leaf passed on, which scan stops itself) shifted every
    other output's cotangent by one: wrong gradients, no error, or a shape error from
    MLX (found by probing, session 53)."""
    return [mx.depends([a], [a])[0] for a in arrays]
