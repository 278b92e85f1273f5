"""chunkscan.split: pieces, gradient equal to slicing's, errors."""

import re

import mlx.core as mx
import pytest
from helpers import max_outputs_of_one_primitive

import chunkscan


@pytest.mark.parametrize(
    "T,chunk,axis", [(10, 3, 0), (64, 4, 0), (9, 9, 0), (9, 20, 0), (7, 2, 1), (7, 3, -1)]
)
def test_pieces_and_gradient(T, chunk, axis):
    shape = [5, 5]
    shape[axis] = T
    x = mx.random.normal(tuple(shape))
    pieces = chunkscan.split(x, chunk, axis=axis)
    assert len(pieces) == -(-T // chunk)
    assert mx.array_equal(mx.concatenate(pieces, axis=axis), x)

    def via_split(x):
        return sum(((p * p) * (i + 1)).sum() for i, p in enumerate(chunkscan.split(x, chunk, axis)))

    def via_slices(x):
        ax = axis % x.ndim
        total = mx.array(0.0)
        for i, lo in enumerate(range(0, T, chunk)):
            idx = [slice(None)] * x.ndim
            idx[ax] = slice(lo, lo + chunk)
            p = x[tuple(idx)]
            total = total + ((p * p) * (i + 1)).sum()
        return total

    assert mx.array_equal(mx.grad(via_split)(x), mx.grad(via_slices)(x))


def test_unused_pieces_get_zero_gradient():
    x = mx.random.normal((12, 2))
    g = mx.grad(lambda x: chunkscan.split(x, 5)[1].sum())(x)
    expected = mx.concatenate([mx.zeros((5, 2)), mx.ones((5, 2)), mx.zeros((2, 2))])
    assert mx.array_equal(g, expected)


def test_errors():
    with pytest.raises(
        ValueError, match=re.escape("[split] chunk_size must be at least 1 but got 0.")
    ):
        chunkscan.split(mx.zeros((4,)), 0)
    with pytest.raises(TypeError, match=re.escape("[split] x must be an mx.array but got list.")):
        chunkscan.split([1, 2], 1)
    with pytest.raises(
        ValueError, match=re.escape("[split] axis 1 is out of range for x with 1 dimensions.")
    ):
        chunkscan.split(mx.zeros((4,)), 2, axis=1)


def test_many_pieces_use_primitives_of_bounded_fan_out():
    """An n-output primitive costs O(n^2) in MLX (every output lists its siblings): a
    flat split of one 20000-step chunk took ~20 GiB. 1000 pieces must be cut as a tree
    of at most 16 pieces per primitive, with values and gradient unchanged."""
    x = mx.random.normal((1000, 3))
    pieces = chunkscan.split(x, 1)
    assert len(pieces) == 1000
    assert max_outputs_of_one_primitive(pieces) <= 16
    assert all(mx.array_equal(p, x[i : i + 1]) for i, p in enumerate(pieces))
    weights = mx.random.normal((1000, 3))

    def via_split(x):
        return sum((p * weights[i : i + 1]).sum() for i, p in enumerate(chunkscan.split(x, 1)))

    g = mx.grad(via_split)(x)
    assert mx.array_equal(g, weights)
    # The check itself sees a wide primitive: mx.split into 9 pieces is one Split.
    assert max_outputs_of_one_primitive(mx.split(x, 8)) == 8


def test_numpy_integers_and_reals_are_accepted_numpy_bools_are_not():
    """A NumPy integer ``chunk_size`` (``np.int64`` from an array's shape arithmetic) and
    a NumPy ``scale`` work as their Python values everywhere (before, ``np.int64`` and
    ``np.float32`` were rejected while ``np.float64``, a float subclass, passed); a
    NumPy bool is no chunk size, like a Python bool."""
    np = pytest.importorskip("numpy")
    x = mx.arange(10.0)
    assert [p.tolist() for p in chunkscan.split(x, np.int64(4))] == [
        p.tolist() for p in chunkscan.split(x, 4)
    ]
    step = chunkscan.stepwise(lambda c, x: (c + x, c))
    for size in (np.int32(3), 3):
        assert chunkscan.scan(step, mx.zeros(()), x, chunk_size=size)[0].item() == 45.0
    with pytest.raises(TypeError, match=re.escape("[split] chunk_size must be an int")):
        chunkscan.split(x, np.bool_(True))
    q = mx.random.normal((1, 2, 8, 4), key=mx.random.key(0))
    for scale in (np.float32(0.5), np.float64(0.5)):
        got = chunkscan.attention(q, q, q, scale=scale, mask="causal")
        assert mx.array_equal(got, chunkscan.attention(q, q, q, scale=0.5, mask="causal")).item()
    g = -mx.ones((1, 8, 2)) * 0.1
    k = q.transpose(0, 2, 1, 3) / 2
    args = (k, k, k, g, mx.ones((1, 8, 2)) * 0.5)
    o, _ = chunkscan.gated_delta_rule(*args, scale=np.float32(0.5), chunk_size=np.int64(4))
    assert mx.array_equal(o, chunkscan.gated_delta_rule(*args, scale=0.5, chunk_size=4)[0]).item()


def test_shapeless_compile_raises_even_for_one_piece():
    """Traced first at a length of one piece, a shapeless trace would be reused, one
    piece, at a longer length: per-chunk cumulative sums off by 3 at T = 20 when the
    one piece came back as ``[x]`` with no primitive. Now it raises, as for several."""

    def per_chunk_cumsum(x):
        return mx.concatenate([mx.cumsum(p, axis=0) for p in chunkscan.split(x, 8)])

    for T in (8, 5, 20):
        f = mx.compile(per_chunk_cumsum, shapeless=True)
        with pytest.raises(ValueError, match="cannot infer output shapes"):
            mx.eval(f(mx.ones((T, 3))))
    # The same function without shapeless compilation retraces per length.
    f = mx.compile(per_chunk_cumsum)
    mx.eval(f(mx.ones((8, 3))))
    expected = mx.concatenate([mx.cumsum(mx.ones((n, 3)), axis=0) for n in (8, 8, 4)])
    assert mx.array_equal(f(mx.ones((20, 3))), expected)
