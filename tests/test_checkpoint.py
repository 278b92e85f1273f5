"""chunkscan.checkpoint: a drop-in for mx.checkpoint with the same values and gradients."""

import collections
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import max_rel

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


def compiled_and_eager_loops():
    """``(eager, compiled, exact)``: the value and four gradients of a ``chunkscan.
    checkpoint`` loop eager, under ``mx.compile``, and of the float64 loop on the CPU
    (rounded to float32). Also what run 98 prints on the GPU."""
    s0, q, k, v = reporter.make_inputs(40, 2, 8, seed=4)

    def value_and_grads(mode):
        def loss(s0, q, k, v):
            s, y = reporter.forward(mode, s0, q, k, v, 8, state_only=False)
            return (y * y).sum() + s.sum()

        return mx.value_and_grad(loss, argnums=(0, 1, 2, 3))

    def flat(result):
        return [result[0], *result[1]]

    fn = value_and_grads("cs.checkpoint+split")
    eager, compiled = flat(fn(s0, q, k, v)), flat(mx.compile(fn)(s0, q, k, v))
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        exact = flat(value_and_grads("plain")(*(a.astype(mx.float64) for a in (s0, q, k, v))))
        exact = [x.astype(mx.float32) for x in exact]
        mx.eval(exact)
    return eager, compiled, exact


def test_compiled_loop_matches_eager():
    """``mx.compile`` of a ``chunkscan.checkpoint`` loop gives eager's value and gradients
    to within the loop's own float32 error. Both are measured against the float64 loop on
    the CPU: on a GPU the compiled graph fuses elementwise ops and rounds differently, and
    an elementwise ``rtol=1e-5`` failed on the H200 at elements that cancel (run 97). The
    compiled error may be at most 4x eager's (floor: 8 float32 ulps of the largest
    element; a wrong compiled gradient is off by O(1))."""
    floor = 8 * float(np.finfo(np.float32).eps)
    for e, c, x in zip(*compiled_and_eager_loops()):
        assert max_rel(c, x) <= 4 * max(max_rel(e, x), floor)


def test_error_not_callable():
    with pytest.raises(
        TypeError, match=re.escape("[checkpoint] fun must be callable but got int.")
    ):
        chunkscan.checkpoint(3)


def test_non_array_output_leaves_pass_through_as_from_mx_checkpoint():
    """A block returning ``{"y": ..., "n_tokens": 3, "aux": 0.0, "tag": "a"}``: the
    non-array leaves come back as the forward returned them, the arrays' values and
    gradients as ``mx.checkpoint``'s (measured: equal); they raised a ``TypeError``
    (found by probing, session 51). A module among the outputs still raises."""
    x = mx.random.normal((4, 3), key=mx.random.key(0))
    w = mx.random.normal((3, 3), key=mx.random.key(1))

    def block(x, w):
        return {"y": mx.tanh(x @ w), "n_tokens": x.shape[0], "aux": 0.0, "tag": ["a", x * 2]}

    outs = {}
    for name, ck in (("mx", mx.checkpoint), ("chunkscan", chunkscan.checkpoint)):
        out = ck(block)(x, w)
        loss = lambda w: (ck(block)(x, w)["y"] ** 2).sum()  # noqa: E731, B023
        outs[name] = (out, mx.grad(loss)(w))
    (got, g_got), (ref, g_ref) = outs["chunkscan"], outs["mx"]
    assert (got["n_tokens"], got["aux"], got["tag"][0]) == (4, 0.0, "a")
    assert mx.array_equal(got["y"], ref["y"]) and mx.array_equal(got["tag"][1], ref["tag"][1])
    assert mx.array_equal(g_got, g_ref)
    msg = "[checkpoint] no leaf of the output may be an nn.Module: the output[2] (Linear)."
    with pytest.raises(TypeError, match=re.escape(msg)):
        chunkscan.checkpoint(lambda x: (x, 3, nn.Linear(2, 2)))(mx.zeros((2,)))


@pytest.mark.parametrize("out", [None, (), {"a": None}, 1.0])
def test_error_no_array_output(out):
    """A function that returns no array raises (before session 27: MLX's custom function
    of no outputs crashed the process, as ``mx.checkpoint`` does)."""
    msg = f"[checkpoint] fun must return at least one array but returned {out!r}."
    with pytest.raises(ValueError, match=re.escape(msg)):
        chunkscan.checkpoint(lambda x: out)(mx.zeros((2,)))


def test_integer_and_boolean_arguments_are_constants():
    """Indices and a mask passed as arguments: the gradients of the float arguments match
    the function without the checkpoint (measured: equal, 0.0), where MLX's vjp with
    respect to the indices raised (``[gather] Cannot calculate VJP with respect to
    indices``, as mx.checkpoint still does; found by probing); the integer and boolean
    arguments get zeros of their dtype."""
    x = mx.random.normal((4, 3), key=mx.random.key(0))
    w = mx.random.normal((3, 3), key=mx.random.key(1))
    idx, keep = mx.array([0, 2, 2]), mx.array([True, False, True])

    def f(a, i, w, m):
        return mx.where(m, a[i] @ w, 0.0)

    def loss(g):
        return lambda a, i, w, m: (g(a, i, w, m) ** 2).sum()

    plain = mx.grad(loss(f), argnums=(0, 2))(x, idx, w, keep)
    ck = mx.grad(loss(chunkscan.checkpoint(f)), argnums=(0, 2))(x, idx, w, keep)
    for a, b in zip(ck, plain):
        assert mx.array_equal(a, b).item()
    _, grads = mx.vjp(chunkscan.checkpoint(f), [x, idx, w, keep], [mx.ones((3, 3))])
    assert grads[1].dtype == idx.dtype and not mx.any(grads[1]).item()
    assert grads[3].dtype == mx.bool_ and not mx.any(grads[3]).item()
    with pytest.raises(ValueError, match="with respect to indices"):
        mx.grad(loss(mx.checkpoint(f)))(x, idx, w, keep)

    # A second derivative raised the same error, from the Depends of rule 2 (found by
    # probing); now equal to the function without the checkpoint (measured 0.0; bound
    # 1e-6, a few float32 roundings of a reordered sum).
    def twice(g):
        first = mx.grad(loss(g), argnums=(0, 2))
        return mx.grad(lambda a, i, w, m: sum((d**2).sum() for d in first(a, i, w, m)))

    want = twice(f)(x, idx, w, keep)
    got = twice(chunkscan.checkpoint(f))(x, idx, w, keep)
    assert max_rel(got, want) <= 1e-6


def test_error_module_argument():
    """An nn.Module argument raises and names the fix (it reached ``fun`` as a plain dict
    of its arrays: "'dict' object is not callable"; found by probing)."""
    lin = nn.Linear(3, 3)
    msg = "[checkpoint] argument 0 is an nn.Module (Linear); checkpoint passes arrays"
    with pytest.raises(TypeError, match=re.escape(msg)):
        chunkscan.checkpoint(lambda m, a: m(a))(lin, mx.zeros((2, 3)))
    with pytest.raises(TypeError, match=re.escape("keyword argument 'm' is an nn.Module")):
        chunkscan.checkpoint(lambda a, m: m(a))(mx.zeros((2, 3)), m=lin)
    # Inside a tuple, list or dict argument too (they reached fun as a plain dict).
    with pytest.raises(TypeError, match=re.escape("argument 0[0] is an nn.Module (Linear)")):
        chunkscan.checkpoint(lambda p: p[0](p[1]))((lin, mx.zeros((2, 3))))
    with pytest.raises(TypeError, match=re.escape("keyword argument 'net'['m'] is an nn.Module")):
        chunkscan.checkpoint(lambda a, net: net["m"](a))(mx.zeros((2, 3)), net={"m": lin})

    class Block(nn.Module):  # a decorated method: argument 0 is self, and says so
        @chunkscan.checkpoint
        def __call__(self, a):
            return a

    msg = "argument 0 (self: checkpoint decorates a method) is an nn.Module (Block)"
    with pytest.raises(TypeError, match=re.escape(msg)):
        Block()(mx.zeros((2, 3)))


def test_an_object_holding_arrays_warns():
    """A dataclass or ``SimpleNamespace`` argument holding arrays (or a module) is passed
    as a constant, as by ``mx.checkpoint``: its arrays got a zero gradient with no sign
    of it (found by probing). It warns naming the argument and the fields, once per
    call; the values are ``mx.checkpoint``'s. An object holding neither, a Python
    module, and an object held in a closure pass without a warning."""
    import dataclasses
    import types
    import warnings

    @dataclasses.dataclass
    class State:
        h: mx.array
        scale: float = 2.0

    def fun(s, x):
        return mx.tanh(s.h * x * s.scale)

    x, h = mx.array([0.5, -1.0, 2.0]), mx.array([1.0, 2.0, 3.0])
    msg = "[checkpoint] argument 0 of test_an_object_holding_arrays_warns.<locals>.fun is a "
    with pytest.warns(UserWarning, match=re.escape(msg + "State holding arrays or modules (.h)")):
        got = mx.grad(lambda h: chunkscan.checkpoint(fun)(State(h), x).sum())(h)
    want = mx.grad(lambda h: mx.checkpoint(fun)(State(h), x).sum())(h)
    np.testing.assert_array_equal(np.array(got), np.array(want))  # both zero: constants
    msg = "keyword argument 's'[1] of test_an_object_holding_arrays_warns.<locals>.<lambda> "
    ns = types.SimpleNamespace(w=h, hs=[h], net=nn.Linear(3, 3), n=3)
    with pytest.warns(UserWarning, match=re.escape(msg + "is a SimpleNamespace holding arrays "
                                                   "or modules (.w, .hs, .net)")):  # fmt: skip
        chunkscan.checkpoint(lambda x, s: x * s[1].w)(x, s=(1, ns))
    # a parameter tree (dicts of lists of dicts) held by a config object: missed when one
    # level was looked at (found by review)
    tree = types.SimpleNamespace(params=nn.Sequential(nn.Linear(3, 3)).trainable_parameters())
    with pytest.warns(UserWarning, match=re.escape("holding arrays or modules (.params)")):
        chunkscan.checkpoint(lambda x, s: x * 2)(x, tree)
    # a deque of arrays, which the pytree does not look into: a zero gradient and no
    # warning (found by probing, session 40)
    with pytest.warns(UserWarning, match=re.escape("is a deque holding arrays or modules ([1])")):
        got = mx.grad(lambda h: chunkscan.checkpoint(lambda d: (d[1] * 2).sum())(
            collections.deque([3, h])))(h)  # fmt: skip
    assert mx.all(got == 0).item()

    class Queue(collections.deque):  # a subclass, and a deque within (review)
        pass

    for held in (Queue([h]), {"a": collections.deque([collections.deque([h])])}):
        with pytest.warns(UserWarning, match="holding arrays or modules"):
            chunkscan.checkpoint(lambda x, s: x * 2)(x, held)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = types.SimpleNamespace(scale=3.0, name="cfg")
        out = chunkscan.checkpoint(lambda x, c, m: x * c.scale)(x, cfg, np)
        np.testing.assert_array_equal(np.array(out), np.array(x * 3.0))
        held = State(h)
        chunkscan.checkpoint(lambda x: fun(held, x))(x)


def _chunk_loop(run, h, xs, w):
    """``h`` after ``run(h, x_chunk, w)`` over ``xs`` in chunks of 2 steps."""
    for x in chunkscan.split(xs, 2):
        h = run(h, x, w)
    return h


def _dropout_chunk(h, x, w):
    """Steps of ``tanh(2 h w + x)`` under a dropout mask drawn from MLX's global key."""
    for t in range(x.shape[0]):
        keep = mx.random.bernoulli(0.5, h.shape)
        h = mx.tanh(mx.where(keep, 2 * h * w, 0.0) + x[t])
    return h


def test_random_ops_draw_the_same_numbers_in_the_recomputation():
    """A dropout in the checkpointed function: its recomputation starts from the global
    key its forward started from (``chunkscan._random``), so the gradient is the plain
    loop's under the same seed, and the recomputation takes nothing from the user's stream
    (``mx.checkpoint`` recomputes with new masks: a different gradient, no error)."""
    xs = mx.random.normal((6, 4), key=mx.random.key(1))
    w = mx.random.normal((4,), key=mx.random.key(2))

    def loss(w, wrap):
        return (_chunk_loop(wrap(_dropout_chunk), mx.ones((4,)), xs, w) ** 2).sum()

    results = []
    for wrap in (lambda f: f, chunkscan.checkpoint):
        mx.random.seed(0)
        value, grad = mx.value_and_grad(loss)(w, wrap)
        results.append((value, grad, mx.random.normal((2,))))
    (v0, g0, n0), (v1, g1, n1) = results
    # Measured difference 0: the recomputation runs the forward's ops on the same masks.
    assert mx.array_equal(v0, v1).item() and mx.array_equal(g0, g1).item()
    assert mx.array_equal(n0, n1).item()


def test_a_key_read_after_the_forward_keeps_its_value():
    """The key as the checkpointed calls leave it, read inside the loss and used with
    ``key=``, keeps its value through the backward (as ``tests/test_scan.py``'s test of
    the same name: without ``_random.replaying``'s first draw the held key was set in
    place to a replayed call's start key; found by mutation). Values by copy (numpy)."""
    xs = mx.random.normal((6, 4), key=mx.random.key(1))
    w = mx.random.normal((4,), key=mx.random.key(2))
    seen = {}

    def loss(w, wrap):
        h = _chunk_loop(wrap(_dropout_chunk), mx.ones((4,)), xs, w)
        key = mx.random.state[0]
        seen["key"], seen["value"] = key, np.array(key)
        return (h**2).sum() + (mx.random.normal((4,), key=key) * w).sum()

    results = []
    for wrap in (lambda f: f, chunkscan.checkpoint):
        mx.random.seed(0)
        value, grad = mx.value_and_grad(loss)(w, wrap)
        mx.eval(value, grad)
        results.append((seen["value"], np.array(seen["key"]), value, grad))
    (ref_read, ref_after, v0, g0), (read, after, v1, g1) = results
    assert (read == ref_read).all() and (ref_after == ref_read).all()
    assert (after == read).all(), f"the held key became {after} (was {read})"
    assert mx.array_equal(v0, v1).item() and mx.array_equal(g0, g1).item()


def test_second_derivatives_match_plain_autograd():
    """A gradient of the gradient through a checkpointed chunk loop equals plain
    autograd's (the backward is ops MLX differentiates again). Measured max relative
    error 2e-8."""
    xs = mx.random.normal((6, 3), key=mx.random.key(5))
    w0 = mx.random.normal((3,), key=mx.random.key(6))

    def chunk(h, x, w):
        for t in range(x.shape[0]):
            h = mx.tanh(h * w + x[t])
        return h

    def loss(w, wrap):
        return (_chunk_loop(wrap(chunk), mx.ones((3,)), xs, w) ** 3).sum()

    def second(wrap):
        return mx.grad(lambda w: (mx.grad(loss)(w, wrap) ** 2).sum())(w0)

    ref = second(lambda f: f)
    got = second(chunkscan.checkpoint)
    err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    assert err <= 1e-5, err


def test_jvp_with_an_integer_argument_used_as_indices():
    """mx.jvp of a one-output checkpoint sends a tangent to every argument, and gather
    raised "Cannot calculate JVP with respect to indices" (as mx.checkpoint does; found
    by probing, session 53): integer arguments are constants of the call, stopped. The
    plain function's tangent, exactly (fails without the stop)."""
    x = mx.random.normal((3, 4), key=mx.random.key(0))
    idx = mx.array([3, 0, 1])

    def fun(x, idx):
        return mx.tanh(mx.take_along_axis(x, idx[:, None], axis=1))

    tangents = [
        mx.jvp(lambda x, fn=fn: fn(x, idx), [x], [mx.ones_like(x)])[1][0]
        for fn in (chunkscan.checkpoint(fun), fun)
    ]
    assert mx.array_equal(*tangents).item()


def test_vmap_and_jvp_of_one_output_only():
    """docs/design.md's transforms table: ``mx.vmap`` and ``mx.jvp`` of a one-output
    ``fun`` give ``fun``'s values; with two outputs (their ``Depends``) MLX raises, never
    a silent result. If MLX's behaviour changes, this test says so (update the docs)."""
    x, t = mx.random.normal((3, 4)), mx.random.normal((3, 4))

    def one(a):
        return mx.sin(a) * 2

    def two(a):
        return mx.sin(a), mx.cos(a)

    c = chunkscan.checkpoint(one)
    assert mx.array_equal(mx.vmap(c)(x), mx.vmap(one)(x))
    assert mx.array_equal(mx.jvp(c, [x], [t])[1][0], mx.jvp(one, [x], [t])[1][0])
    # with two array arguments too, called again (rule 5's edge between its arguments,
    # session 52, made these raise: found by review; it is for funs of several outputs)

    def layer(a, w):
        return mx.tanh(a @ w)

    w, c = mx.random.normal((4, 4)), chunkscan.checkpoint(layer)
    for _ in range(2):
        mapped = [mx.vmap(f, in_axes=(0, None))(x, w) for f in (c, layer)]
        assert mx.allclose(*mapped).item()
        got, want = mx.jvp(c, [x, w], [t, w])[1][0], mx.jvp(layer, [x, w], [t, w])[1][0]
        assert mx.allclose(got, want).item()

    # after a call of the same function returning two arrays (a switch): the one-output
    # call keeps them (one flag per function kept the edge; found by review, session 52)
    def switched(a, b, both=False):
        z = mx.sin(a) * b
        return (z, z + 1) if both else z

    c = chunkscan.checkpoint(switched)
    mx.eval(c(x, x, both=True))
    assert mx.allclose(mx.vmap(c)(x, x), mx.vmap(switched)(x, x)).item()
    tangents = [mx.jvp(f, [x, x], [t, t])[1][0] for f in (c, switched)]
    assert mx.allclose(*tangents).item()
    c2 = chunkscan.checkpoint(two)
    for name, run in (("vmap", lambda: mx.vmap(c2)(x)), ("jvp", lambda: mx.jvp(c2, [x], [t]))):
        with pytest.raises(ValueError, match=re.escape(f"[Primitive::{name}] Not implemented")):
            mx.eval(run())


@pytest.mark.xfail(strict=True, raises=IndexError, reason="MLX compile_simplify (docs/design.md)")
def test_compiled_second_derivative_of_a_loop_returning_one_value_twice():
    """The known limit of docs/design.md, "An MLX compile bug chunkscan works around": a
    loop of two calls whose function returns, beside its carry, two equal computations
    from one argument (``mx.broadcast_to(w, (1, D))`` twice); ``mx.compile`` of the
    Hessian-vector product raises MLX's ``IndexError: _Map_base::at`` (found by a fuzz,
    session 53), where eagerly it equals the loop without a checkpoint (measured: 0 and
    2.3e-8; bound 1e-6, a reordered float32 sum)."""
    D = 3
    x = mx.random.normal((2, D), key=mx.random.key(0))
    w = mx.random.normal((D,), key=mx.random.key(1))
    w1, w3 = (mx.random.normal((2, D), key=mx.random.key(s)) for s in (4, 6))

    def f(c, xc, w):
        return mx.tanh(w * xc[0]), mx.broadcast_to(w, (1, D)), mx.broadcast_to(w, (1, D))

    def hvp_of(step):
        def loss(x, w):
            c, y1s, y2s = mx.zeros((D,)), [], []
            for i in range(2):
                c, y1, y2 = step(c, x[i : i + 1], w)
                y1s.append(y1)
                y2s.append(y2)
            y1, y2 = mx.concatenate(y1s), mx.concatenate(y2s)
            return (w1 * y1 * y1).sum() + (w3 * y2 * y2).sum()

        g = mx.grad(loss, argnums=(0, 1))
        return mx.grad(lambda x, w: sum(a.sum() for a in g(x, w)), argnums=(0, 1))

    ref = hvp_of(f)(x, w)
    assert all(max_rel(a, b) <= 1e-6 for a, b in zip(hvp_of(chunkscan.checkpoint(f))(x, w), ref))
    got = mx.compile(hvp_of(chunkscan.checkpoint(f)))(x, w)
    assert all(max_rel(a, b) <= 1e-6 for a, b in zip(got, ref))


def test_the_kind_of_a_call_counts_numbers_by_type():
    """Rule 5's flag of a structure not seen yet comes from its kind, where numbers
    count by their type: a loop's per-chunk offset, a Python or a NumPy int (a NumPy int
    was a new kind every call; found by review, session 54). Switches count by value."""
    from chunkscan.checkpoint import _structure

    def kind(leaf):
        return _structure((), [leaf], numbers_by_type=True)

    assert kind(3) == kind(5) and kind(2.5) == kind(0.5)
    assert kind(np.int64(3)) == kind(np.int64(9)) and kind(np.float32(1)) == kind(np.float32(2))
    assert kind(True) != kind(False) and kind(np.bool_(True)) != kind(np.bool_(False))
    assert kind("a") != kind("b") and kind(None) != kind(3)
