"""The sequential state passes (``_passes.state_pass``) against their definition.

The definition is the literal per-chunk loop of the module docstring, written here
with elementwise products and sums only (no matmul), in float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from chunkscan.ops.gated_delta import _passes


def reference_pass(x_in, decay, F, E, G, H, *, reverse, loads, stores, inits):
    L, n, C, Dk = F.shape
    x = None if x_in is None else np.array(x_in, dtype=np.float64)
    F, G = np.array(F, np.float64), np.array(G, np.float64)
    E = None if E is None else np.array(E, np.float64)
    H = None if H is None else np.array(H, np.float64)
    d = np.array(decay, np.float64)
    inits = None if inits is None else np.array(inits, np.float64)
    entering = [None] * n
    stored = [None] * len(stores)
    for c in (range(n - 1, -1, -1) if reverse else range(n)):
        if c in loads:
            x = inits[loads[c]].copy()
        entering[c] = x.copy()
        v = -np.einsum("lik,lrk->lir", F[:, c], x)
        if E is not None:
            v = v + E[:, c]
        x = d[:, c, None, None] * x + np.einsum("lir,lik->lrk", v, G[:, c])
        if H is not None:
            x = x + H[:, c]
        if c in stores:
            stored[stores[c]] = x.copy()
    return np.stack(entering, axis=1), x, stored


def make_inputs(L=3, n=5, C=4, R=6, Dk=8, S=2, with_e=True, with_h=False, seed=0):
    rng = np.random.default_rng(seed)

    def rnd(*shape, s=0.3):
        return mx.array((s * rng.standard_normal(shape)).astype(np.float32))

    decay = mx.array(rng.uniform(0.5, 1.0, (L, n)).astype(np.float32))
    return dict(
        x_in=rnd(L, R, Dk, s=1.0),
        decay=decay,
        F=rnd(L, n, C, Dk),
        E=rnd(L, n, C, R) if with_e else None,
        G=rnd(L, n, C, Dk),
        H=rnd(L, n, R, Dk) if with_h else None,
        inits=rnd(S, L, R, Dk, s=1.0),
    )


CASES = [
    # (reverse, loads, stores, with_e, with_h)
    (False, {}, {4: 0}, True, False),
    (False, {0: 1, 3: 0}, {2: 0, 4: 1}, True, False),
    (True, {4: 0}, {0: 0}, False, True),
    (True, {4: 1, 1: 0}, {2: 1, 0: 0}, True, True),
]


def _run(impl, args, kw):
    if impl == "auto":
        return _passes.state_pass(*args, **kw)
    return _passes.portable_state_pass(*args, **kw, form=impl)


@pytest.mark.parametrize("impl", ["factored", "transition", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_state_pass_matches_definition(case, impl):
    reverse, loads, stores, with_e, with_h = case
    inp = make_inputs(with_e=with_e, with_h=with_h)
    kw = dict(reverse=reverse, loads=loads, stores=stores, inits=inp["inits"])
    args = [inp[k] for k in ("x_in", "decay", "F", "E", "G", "H")]
    ent, x_out, stored = _run(impl, args, kw)
    ref_ent, ref_x, ref_stored = reference_pass(*args, **kw)
    # float32 against float64: measured max abs error ~1e-7 on these O(1) values.
    np.testing.assert_allclose(np.array(ent), ref_ent, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.array(x_out), ref_x, rtol=0, atol=2e-5)
    assert len(stored) == len(ref_stored)
    for a, b in zip(stored, ref_stored):
        np.testing.assert_allclose(np.array(a), b, rtol=0, atol=2e-5)
