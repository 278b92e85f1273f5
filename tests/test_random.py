"""MLX's global random key in ``scan`` and ``checkpoint`` (``chunkscan._random``) where
their function runs more than once: the forward again under ``mx.jvp`` and ``mx.vmap``,
and draws of the backward itself. The plain recomputation's replay is tested in
``tests/test_scan.py`` and ``tests/test_checkpoint.py``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import chunkscan
from chunkscan import _random


def _dropout(x):
    """Half of ``x``, drawn from the global key (a dropout without ``key=``)."""
    return x * mx.random.bernoulli(0.5, x.shape).astype(x.dtype)


def _scan_of(fun):
    """``fun`` in a scan with no carry whose ``T`` fits in one chunk."""
    return lambda x: chunkscan.scan(lambda _, xc: (None, fun(xc)), None, x, chunk_size=16)[1]


_WRAPPED = {"checkpoint": chunkscan.checkpoint(_dropout), "one-chunk scan": _scan_of(_dropout)}


def _transformed(transform: str, fn, x):
    """(values, the key's next draw) of ``fn`` under ``transform``, from seed 5."""
    mx.random.seed(5)
    if transform == "jvp":
        _, (out,) = mx.jvp(fn, [x], [mx.ones_like(x)])  # the tangent: the mask
    else:
        out = mx.vmap(fn)(x)
    return out, mx.random.randint(0, 1 << 30, (2,))


@pytest.mark.parametrize("transform", ["jvp", "vmap"])
@pytest.mark.parametrize("wrapper", list(_WRAPPED))
def test_jvp_and_vmap_replay_the_forwards_draws(wrapper, transform, monkeypatch):
    """MLX runs a custom function's forward again under ``mx.jvp`` and ``mx.vmap``; that
    run drew from the key as the first had left it: the tangent was that of another mask
    than the output's, the mapped values not the plain function's, and the key moved
    twice (found by probing, session 53). Equal to the function without the wrapper,
    exactly (the same draws); with later runs noting keys of their own (the negative
    control) they differ."""
    x = mx.arange(1.0, 33.0).reshape(4, 8)
    ref = _transformed(transform, _dropout, x)
    got = _transformed(transform, _WRAPPED[wrapper], x)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    monkeypatch.setattr(_random, "_REPLAY_FORWARD_RERUNS", False)
    got = _transformed(transform, _WRAPPED[wrapper], x)
    assert not any(mx.array_equal(a, b).item() for a, b in zip(got, ref))


@pytest.mark.parametrize("transform", ["jvp", "vmap"])
@pytest.mark.parametrize("wrapper", ["checkpoint", "one-chunk scan"])
def test_a_key_f_holds_keeps_its_value_under_jvp_and_vmap(wrapper, transform):
    """``f`` keeps the key after its draw (to log it) and the loss draws after the call:
    the replayed second run gave the global key its value back in place, into the key
    array that run had read, so the held key changed (found by review, session 53;
    fails with the restore in place). Compared by value (numpy) with the key as read."""
    held = []

    def fun(x):
        y = _dropout(x)
        held.append((mx.random.state[0], np.array(mx.random.state[0])))
        return y

    wrapped = {"checkpoint": chunkscan.checkpoint(fun), "one-chunk scan": _scan_of(fun)}[wrapper]
    x = mx.arange(1.0, 33.0).reshape(4, 8)
    _transformed(transform, lambda x: wrapped(x) + mx.random.uniform(shape=x.shape), x)
    assert len(held) == 2 and all((np.array(k) == v).all() for k, v in held)


_D, _C = 4, 4


def _noisy_backward(drawn: list):
    """The identity, whose vjp scales the cotangent by noise from the global key."""

    @mx.custom_function
    def identity(h):
        return h

    @identity.vjp
    def _(primals, cotangent, output):
        noise = mx.random.uniform(shape=(_D,))
        drawn.append(noise)
        return (cotangent * (1 + noise),)

    return identity


def _chunk_with_noise(drawn: list):
    identity = _noisy_backward(drawn)

    def f(h, xc):
        noise = mx.random.uniform(shape=(xc.shape[0], _D))  # a forward draw: replayed
        ys = []
        for t in range(xc.shape[0]):
            h = identity(mx.tanh(h + xc[t] * noise[t]))
            ys.append(h)
        return h, mx.stack(ys)

    return f


def _noise_of_the_backward(mode: str) -> tuple[list[float], mx.array, mx.array]:
    """(the backward's draws, the gradient, the key's next draw) of ``mode`` from seed 0."""
    drawn: list[mx.array] = []
    f = _chunk_with_noise(drawn)
    x = mx.linspace(0.5, 1.5, 8 * _D).reshape(8, _D)

    def loss(x):
        if mode == "scan":
            return chunkscan.scan(f, mx.zeros((_D,)), x, chunk_size=_C)[1].sum()
        step = chunkscan.checkpoint(f) if mode == "checkpoint" else f
        h, ys = mx.zeros((_D,)), []
        for xc in chunkscan.split(x, _C):
            h, y = step(h, xc)
            ys.append(y)
        return mx.concatenate(ys).sum()

    mx.random.seed(0)
    grad = mx.grad(loss)(x)
    mx.eval(grad, drawn)
    return [d[0].item() for d in drawn], grad, mx.random.randint(0, 1 << 30, (2,))


@pytest.mark.parametrize("mode", ["scan", "checkpoint"])
def test_the_backwards_own_draws_continue_the_users_stream(mode, monkeypatch):
    """A draw of the backward itself (a custom vjp adding gradient noise) inside a
    replayed chunk drew from the replay: each chunk's backward repeated the numbers of
    the chunk after it (found by probing, session 53: 5 distinct of 8). Once the
    recomputed forward has run the key is the user's again, and the draws, the gradient
    and the next draw equal the plain loop's, exactly; with the key replayed through
    the whole vjp (the negative control) the draws repeat."""
    ref_drawn, ref_grad, ref_next = _noise_of_the_backward("loop")
    assert len(set(ref_drawn)) == 8
    drawn, grad, next_draw = _noise_of_the_backward(mode)
    assert drawn == ref_drawn
    assert mx.array_equal(grad, ref_grad).item() and mx.array_equal(next_draw, ref_next).item()
    monkeypatch.setattr(_random, "_HAND_BACK_AFTER_FORWARD", False)
    assert len(set(_noise_of_the_backward(mode)[0])) < 8


@pytest.mark.xfail(strict=True, reason="a key read without a draw is not noted (docs/design.md)")
def test_a_key_read_without_a_draw_is_not_replayed():
    """The known limit: ``f`` reading the global key without drawing from it
    (``key=mx.random.split(mx.random.state[0])[0]``) leaves it where it was, so no key
    is noted for the chunk, and a draw after the scan (an output dropout) moves it
    before the recomputation reads it: the gradient is that of another mask (found by
    probing, session 53: relative error 1.1)."""
    x = mx.linspace(0.5, 1.5, 32).reshape(8, 4)

    def f(h, xc):
        mask = mx.random.bernoulli(0.5, xc.shape, key=mx.random.split(mx.random.state[0])[0])
        h = h + (xc * mask).sum(0)
        return h, None

    def loss(x, chunked):
        if chunked:
            h, _ = chunkscan.scan(f, mx.zeros((4,)), x, chunk_size=4)
        else:
            h = f(f(mx.zeros((4,)), x[:4])[0], x[4:])[0]
        return (h**2 * mx.random.uniform(shape=(4,))).sum()

    grads = []
    for chunked in (False, True):
        mx.random.seed(0)
        grads.append(mx.grad(loss)(x, chunked))
    assert mx.array_equal(*grads).item()
