"""chunkscan.checkpoint: a drop-in for mx.checkpoint with the same values and gradients."""

import re

import mlx.core as mx
import pytest

import chunkscan
from chunkscan.commands import reporter


@pytest.mark.parametrize("mode", ["cs.checkpoint+split", "cs.checkpoint"])
def test_reporter_loop_gradients_are_identical_to_plain(mode):
    s0, q, k, v = reporter.make_inputs(45, 2, 8, seed=2)

    def grads(m):
        def loss(s0, q, k, v):
            s, y = reporter.forward(m, s0, q, k, v, 8, state_only=False)
            return y.sum()

        return mx.grad(loss, argnums=(0, 1, 2, 3))(s0, q, k, v)

    for a, b in zip(grads(mode), grads("plain")):
        assert mx.array_equal(a, b)


def test_same_as_mx_checkpoint_with_pytrees_kwargs_and_constants():
    def fun(x, pair, *, scale, w):
        a, b = pair
        return {"out": mx.sin(x * scale) @ w + a, "aux": (b * x.sum(),)}

    x, a, b, w = (mx.random.normal(s) for s in [(3, 4), (3, 5), (2,), (4, 5)])

    def loss(ckpt):
        def inner(x, a, b, w):
            out = ckpt(fun)(x, (a, b), scale=0.5, w=w)
            return (out["out"] ** 2).sum() + out["aux"][0].sum()

        return inner

    ref = mx.value_and_grad(loss(mx.checkpoint), argnums=(0, 1, 2, 3))(x, a, b, w)
    got = mx.value_and_grad(loss(chunkscan.checkpoint), argnums=(0, 1, 2, 3))(x, a, b, w)
    assert mx.allclose(ref[0], got[0], rtol=1e-6)
    for r, g in zip(ref[1], got[1]):
        assert mx.allclose(r, g, rtol=1e-6, atol=1e-7)


def test_keeps_name_and_single_array_output():
    def square(x):
        return x * x

    wrapped = chunkscan.checkpoint(square)
    assert wrapped.__name__ == "square"
    x = mx.arange(4, dtype=mx.float32)
    assert mx.array_equal(mx.grad(lambda x: wrapped(x).sum())(x), 2 * x)


def test_compiled_loop_matches_eager():
    s0, q, k, v = reporter.make_inputs(40, 2, 8, seed=4)

    def loss(s0, q, k, v):
        s, y = reporter.forward("cs.checkpoint+split", s0, q, k, v, 8, state_only=False)
        return (y * y).sum() + s.sum()

    fn = mx.value_and_grad(loss, argnums=(0, 1, 2, 3))
    eager = fn(s0, q, k, v)
    compiled = mx.compile(fn)(s0, q, k, v)
    assert mx.allclose(eager[0], compiled[0], rtol=1e-5)
    for a, b in zip(eager[1], compiled[1]):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_error_not_callable():
    with pytest.raises(
        TypeError, match=re.escape("[checkpoint] fun must be callable but got int.")
    ):
        chunkscan.checkpoint(3)


def test_error_non_array_output():
    with pytest.raises(
        TypeError, match=re.escape("[checkpoint] every leaf of the output must be an mx.array")
    ):
        chunkscan.checkpoint(lambda x: (x, 1.0))(mx.zeros((2,)))
