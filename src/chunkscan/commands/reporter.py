"""The reporter's recurrence of MLX issue #4837, written in every mode ``chunkscan repro``
compares.

A decayed delta rule over ``T`` steps with state ``s`` of shape ``(H, D, D)`` and inputs
``q, k, v`` of shape ``(T, H, D)`` (``k`` scaled by 0.05, decay 0.95), cut into chunks of
``C`` steps. Used by :mod:`chunkscan.commands.repro` (the measurement) and by the tests
and benchmarks (as a reference recurrence with a plain-autograd oracle).
"""

from __future__ import annotations

import mlx.core as mx

from ..checkpoint import checkpoint as cs_checkpoint
from ..scan import scan
from ..split import split
from ..stepwise import stepwise

MODES = {
    "plain": "plain autograd, no checkpointing",
    "mx.checkpoint": "the reporter's loop: mx.checkpoint per chunk, slicing",
    "cs.checkpoint": "only mx.checkpoint swapped for chunkscan.checkpoint, slicing kept",
    "cs.checkpoint+split": "chunkscan.checkpoint per chunk, chunkscan.split",
    "cs.scan": "chunkscan.scan(stepwise(step))",
}
GRADS = {"state": "initial state only", "qkv": "q, k and v"}
DECAY = 0.95


def step(s: mx.array, x: tuple[mx.array, mx.array, mx.array]) -> tuple[mx.array, mx.array]:
    """One step of the reporter's recurrence; ``s``: ``[H, D, D]``, ``q, k, v``: ``[H, D]``."""
    q, k, v = x
    s = DECAY * s
    delta = v - (s * k[:, None, :]).sum(-1)
    s = s + delta[:, :, None] * k[:, None, :]
    y = (s * q[:, None, :]).sum(-1)
    return s, y


def run_chunk(s, q, k, v):
    """The reporter's chunk function: a plain loop over the chunk's steps."""
    ys = []
    for t in range(q.shape[0]):
        s, y = step(s, (q[t], k[t], v[t]))
        ys.append(y)
    return s, mx.stack(ys)


def forward(mode: str, s0, q, k, v, chunk: int, state_only: bool):
    """Final state and outputs ``[T, H, D]`` of the recurrence in ``mode``."""
    if mode not in MODES:  # an unknown name ran cs.checkpoint's loop (found by probing)
        raise ValueError(f"mode must be one of {', '.join(MODES)} but got {mode!r}.")
    T = q.shape[0]
    if mode == "plain":
        return run_chunk(s0, q, k, v)
    if mode == "cs.scan":
        return scan(stepwise(step), s0, (q, k, v), chunk_size=chunk, xs_grad=not state_only)
    if mode == "cs.checkpoint+split":
        pieces = zip(*(split(a, chunk) for a in (q, k, v)))
    else:
        # the slice ends within T: MLX takes 32-bit slice indices, and a --chunk of 2**31
        # failed these modes where the others ran (found by probing, session 49)
        pieces = (
            (q[lo : min(lo + chunk, T)], k[lo : min(lo + chunk, T)], v[lo : min(lo + chunk, T)])
            for lo in range(0, T, chunk)
        )
    wrapped = mx.checkpoint(run_chunk) if mode == "mx.checkpoint" else cs_checkpoint(run_chunk)
    s, ys = s0, []
    for qc, kc, vc in pieces:
        s, y = wrapped(s, qc, kc, vc)
        ys.append(y)
    return s, mx.concatenate(ys)


def make_inputs(T: int, H: int, D: int, seed: int = 0):
    """``(s0, q, k, v)``: ``s0`` ``[H, D, D]`` (scaled 0.1), ``q, k, v`` ``[T, H, D]``
    standard normal, ``k`` scaled by 0.05."""
    key = mx.random.key(seed)
    ks = mx.random.split(key, 4)
    s0 = mx.random.normal((H, D, D), key=ks[0]) * 0.1
    q, k, v = (mx.random.normal((T, H, D), key=kk) for kk in ks[1:])
    return s0, q, 0.05 * k, v


def gradient_fn(mode: str, grads: str, chunk: int, compiled: bool):
    """``value_and_grad`` of ``sum(y) + sum(s)`` w.r.t. ``s0`` (``grads="state"``) or
    ``q, k, v`` (``grads="qkv"``), optionally under ``mx.compile``."""
    if grads not in GRADS:  # any other name timed the q, k, v gradients
        raise ValueError(f"grads must be one of {', '.join(GRADS)} but got {grads!r}.")
    argnums = (0,) if grads == "state" else (1, 2, 3)
    state_only = grads == "state"

    def loss(s0, q, k, v):
        s, y = forward(mode, s0, q, k, v, chunk, state_only)
        return y.sum() + s.sum()

    fn = mx.value_and_grad(loss, argnums=argnums)
    return mx.compile(fn) if compiled else fn
