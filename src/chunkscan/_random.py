"""MLX's global random key around a recomputation.

``scan`` and ``checkpoint`` run the user's function again in the backward. A random op
in it without an explicit ``key`` (``mx.random.bernoulli`` in a dropout, say) draws
from MLX's global key, which has moved on since the forward, so the recomputation
would see other numbers than the forward did and the gradient would be that of
another function. As PyTorch's checkpoint does by default, the forward notes the key
each call started from when the call drew from it, and the recomputation starts from
that key again; the global key gets its value back afterwards, so the backward takes
nothing from the user's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx


def key() -> Any:
    """The global key now (compare with ``is``: every draw replaces it)."""
    return mx.random.state[0]


def drawn_from(before: Any) -> Any:
    """``before`` if the global key has moved since it was read (the call in between
    drew from it), else ``None``."""
    return before if mx.random.state[0] is not before else None


@contextlib.contextmanager
def replaying(start: Any) -> Iterator[None]:
    """Run the block from the global key ``start`` (``None``: as it is), then give the
    global key back the value it had before.

    MLX has no setter for its key (``mx.random.state`` is read-only), so the key array
    is assigned in place (``key[...] = start``), the same update ``mx.compile`` makes
    with ``outputs=[mx.random.state]``. Not the array that is the key on entry: a user
    may hold it. One tiny draw first makes the key a new array of our own."""
    if start is None:
        yield
        return
    before = mx.array(mx.random.state[0])  # a copy of the key's value, not the array
    mx.random.uniform(shape=(1,))  # the key is now a new array, referenced by no one else
    mx.random.state[0][...] = start
    try:
        yield
    finally:
        mx.random.state[0][...] = before
