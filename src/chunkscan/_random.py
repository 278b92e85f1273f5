"""MLX's global random key around a recomputation.

``scan`` and ``checkpoint`` run the user's function again in the backward. A random op
in it without an explicit ``key`` (``mx.random.bernoulli`` in a dropout, say) draws
from MLX's global key, which has moved on since the forward, so the recomputation
would see other numbers than the forward did and the gradient would be that of
another function. As PyTorch's checkpoint does by default, the forward notes the key
each call started from when the call drew from it, and the recomputation starts from
that key again; the global key gets its value back afterwards, so the recomputation
takes nothing from the user's stream. Draws of the backward itself (a custom vjp that
draws gradient noise) come after the recomputed forward and take from the user's
stream (:func:`replaying`'s ``forward_done``), in the order of each chunk's vjp.

A later run of the forward is a recomputation too: MLX has no rule of ours for
``mx.jvp`` and ``mx.vmap`` of a custom function and runs its Python forward again under
the transform, so :class:`Starts` replays each part's first run there as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
def replaying(start: Any) -> Iterator[Callable[[], None]]:
    """Run the block from the global key ``start`` (``None``: as it is), then give the
    global key back the value it had before: when ``forward_done`` is called (below),
    else on exit.

    MLX has no setter for its key (``mx.random.state`` is read-only), so the key array
    is assigned in place (``key[...] = start``), the same update ``mx.compile`` makes
    with ``outputs=[mx.random.state]``. Not the array that is the key on entry: a user
    may hold it. One tiny draw first makes the key a new array of our own.

    Yields ``forward_done``: a recomputation inside ``mx.vjp`` calls it once its forward
    has run, and the block's later draws (the vjp's backward: a custom vjp that draws
    noise) take from the user's key, which they move on, as a plain backward's would.
    Replayed instead, every chunk's backward drew from the key the next chunk's forward
    started from (found by probing, session 53)."""
    if start is None:
        yield _nothing
        return
    before = mx.array(mx.random.state[0])  # a copy of the key's value, not the array
    _set(start)
    handed_back = False

    def forward_done() -> None:
        nonlocal handed_back
        if not handed_back and _HAND_BACK_AFTER_FORWARD:
            _set(before)
            handed_back = True

    try:
        yield forward_done
    finally:
        if not handed_back:  # (into a key of our own: f may hold the block's last one)
            _set(before)


def _set(value: mx.array) -> None:
    """Give the global key ``value``, in a key array of our own (see :func:`replaying`)."""
    mx.random.uniform(shape=(1,))  # the key is now a new array, referenced by no one else
    mx.random.state[0][...] = value


def _nothing() -> None:
    pass


class Starts:
    """The global key each part of one call (a chunk of a ``scan``, a ``checkpoint``
    call) started from on its first run, where that run drew from it.

    ``with starts.forward(part):`` around each run of the part's forward: the first
    notes the key; a later one (``mx.jvp`` and ``mx.vmap`` run the forward again)
    replays it. Under those two transforms the second run drew from the key as the
    first had left it: the tangent was that of another dropout mask, the mapped values
    other than the loop's, and the user's key moved twice (found by probing, session
    53). ``with starts.recompute(part) as forward_done:`` around the backward's
    recomputation replays it too (:func:`replaying`)."""

    def __init__(self) -> None:
        self._first: dict[int, Any] = {}

    @contextlib.contextmanager
    def forward(self, part: int = 0) -> Iterator[None]:
        if part in self._first and _REPLAY_FORWARD_RERUNS:
            with replaying(self._first[part]):
                yield
            return
        before = key()
        yield
        self._first[part] = drawn_from(before)

    def recompute(self, part: int = 0) -> contextlib.AbstractContextManager[Callable[[], None]]:
        return replaying(self._first.get(part))


# Whether a later run of a part's forward replays its first, and whether the key goes
# back to the user's once a recomputation's forward has run (the tests switch them off
# as negative controls: as before session 53).
_REPLAY_FORWARD_RERUNS = True
_HAND_BACK_AFTER_FORWARD = True
