"""Every scheduling edge chunkscan adds to the graph, explained in one place.

MLX evaluates a graph from a tape built breadth-first from the outputs (``eval_impl``
in ``mlx/transforms.cpp``): a node joins the tape once its last consumer has been
visited, the tape runs from the back, and a buffer is freed when its last consumer has
run. For a chain ``c0 -> c1 -> ...`` where each ``c_t`` also feeds a side branch that
rejoins the graph only near the outputs, the whole chain runs first and every side
branch afterwards, so every ``c_t`` is alive at once. In a recurrence the chain is the
carry (forward) or the carry cotangent (backward), and the side branches are the
per-step outputs or the per-step input gradients. ``mx.checkpoint`` does not change
that: it recomputes from ``depends(primals, outputs)``, so the recompute waits for the
forward outputs but not for the incoming cotangent, and nothing orders the chunks.

``mx.depends(inputs, deps)`` returns ``inputs`` unchanged but makes them wait for
``deps``; it survives ``mx.compile`` and its vjp passes the cotangent through. chunkscan
uses it for exactly five rules, each a function below:

1. :func:`carry_after_outputs` (forward): a chunk's outgoing carry waits for that
   chunk's outputs, so each output branch runs, and frees what it needs, before the
   chain moves on to the next chunk. ``scan`` also makes it wait for each stacked
   block of saved carries, so the block's separate carries are freed as it goes.
2. :func:`recompute_after_cotangent` (backward): the recomputation of chunk ``i``
   waits for the cotangent flowing into chunk ``i``, so chunks are recomputed one at
   a time, last to first, instead of all at once up front. It gates the chunk's
   carry *and* its inputs (in ``scan`` the constant ones too, since session 52, in a
   ``Depends`` of their own: see :func:`keep_apart`): ``Depends`` is never merged by
   ``mx.compile``'s common-subexpression elimination, so the recomputation cannot be
   merged with the forward's work on the same inputs (which would keep the forward's
   per-chunk values alive until the backward).
3. :func:`cotangent_after_gradients` (backward): the cotangent leaving chunk ``i``
   waits for all of chunk ``i``'s input and parameter gradients, so chunk ``i``'s
   recomputed intermediates are consumed and freed before chunk ``i - 1`` starts.
4. Gradients of chunked inputs are assembled with one concatenate per input (see
   :mod:`chunkscan.split`), never by summing zero-padded full-length buffers; that
   rule needs no edge, only the right primitive.
5. :func:`prepare_after_carry` (forward, for ops that prepare many chunks at once,
   and ``scan``'s chunks): the inputs of a group of chunks wait for the carry entering
   the group, so that the groups' batched, state-independent work runs one group after
   the other instead of all up front (where every group's intermediates would be alive
   at once). In ``scan`` each chunk's input slices wait for its incoming carry (since
   session 46: without it the state-independent part of a chunk function, such as
   ``dplr_delta_rule``'s pairwise decays and triangular inverse, ran for every chunk
   first: its backward's peak grew 3.61 MiB from T = 256 to 1024 at chunks of 32, 1.31
   with the edge, ``tests/ops/test_dplr_delta.py``). ``checkpoint`` makes each call's
   arguments wait for one another (:func:`all_together`): it cannot tell the carry.

All helpers accept and return flat lists of arrays. Empty dependency lists are a
no-op, so callers never special-case them.

One more rule is not an edge but a habit: never keep a Python reference to a graph
array in a closure that outlives the call (a custom function's vjp does), and never in
a reference cycle (a nested function that calls itself). Such a reference keeps the
whole graph that produced the array alive: in ``checkpoint`` it cost about ten MiB
per chunk at H = 8, D = 128, C = 32, i.e. memory growing with T again.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def _after(arrays: Sequence[mx.array], deps: Sequence[mx.array]) -> list[mx.array]:
    arrays, deps = list(arrays), list(deps)
    if not arrays or not deps:
        return arrays
    return list(mx.depends(arrays, deps))


def carry_after_outputs(carry: Sequence[mx.array], outputs: Sequence[mx.array]) -> list[mx.array]:
    """Rule 1: the outgoing carry leaves only after ``outputs`` are computed."""
    return _after(carry, outputs)


def recompute_after_cotangent(
    primals: Sequence[mx.array], cotangents: Sequence[mx.array]
) -> list[mx.array]:
    """Rule 2: recompute a chunk only once the cotangent flowing into it exists."""
    return _after(primals, cotangents)


def cotangent_after_gradients(
    cotangent: Sequence[mx.array], gradients: Sequence[mx.array]
) -> list[mx.array]:
    """Rule 3: pass the carry cotangent on only after the chunk's other gradients."""
    return _after(cotangent, gradients)


def prepare_after_carry(inputs: Sequence[mx.array], carry: Sequence[mx.array]) -> list[mx.array]:
    """Rule 5: prepare a group of chunks only once the carry entering it exists."""
    return _after(inputs, carry)


def keep_apart(arrays: Sequence[mx.array]) -> list[mx.array]:
    """Not an ordering rule: ``arrays`` through a ``Depends`` on themselves, so that
    ``mx.compile``'s common-subexpression elimination cannot merge what is computed
    from them with the same computation elsewhere in the graph (a ``Depends`` is never
    merged). Anchored on nothing else: ``scan`` had anchored its constant inputs on the
    initial carry, a differentiated primal, and a second derivative taken as the
    product of two ``mx.grad`` calls came out half (MLX's vjp through that
    ``Depends``; found by probing), and an integer input used as indices raised. Since
    session 52 ``scan`` gates them by rule 2 instead (anchored on themselves, their
    input-only work ran for nearly every chunk up front) and passes them to the
    recomputation's vjp as primals, which keeps that second derivative whole; this is
    the tests' negative control (``scan._GATE_CONSTANTS`` off)."""
    return _after(arrays, arrays)


def all_together(arrays: Sequence[mx.array]) -> list[mx.array]:
    """Rules 1, 3 and 5 when a function does not say which output is the carry.

    Every returned array waits for all of ``arrays``. Used by
    :func:`chunkscan.checkpoint`, whose outputs (forward), input gradients (backward)
    and arguments (forward, rule 5 since session 52: a loop's call waits for the carry
    from the call before, whichever argument it is) are opaque tuples.

    In ``checkpoint``'s forward (its rule 1) MLX 0.32.4 does not need it: no test
    shape or form (eager, compiled, ``grad``, a second derivative, forward only) moved
    the peak by more than 0.1 MiB without it (a mutation audit, session 34), since under
    a transform the outputs of a custom function are one primitive, which waits for all
    of them, and outside one MLX's breadth-first tape already runs the chunks in turn.
    It is kept as a guard against a change of either in MLX.
    """
    arrays = list(arrays)
    if len(arrays) < 2:
        return arrays
    return list(mx.depends(arrays, arrays))
