"""``selective_scan``: Mamba's selective state-space recurrence, chunked.

Per channel ``c`` and state index ``n`` (the S6 recurrence of Mamba, a decay per channel
and state index)::

    h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] x_t[c] B_t[n]
    y_t[c] = sum_n h_t[c, n] C_t[n] + D[c] x_t[c]

How: :func:`chunkscan.scan` over chunks of ``chunk_size`` steps (the backward keeps the
state entering each chunk and recomputes one chunk at a time). Within a chunk the
``L`` steps' decays ``a_t = exp(dt_t A)`` and inputs ``b_t = dt_t x_t B_t`` (each
``[B, L, Dc, N]`` float32) are combined by a log-depth inclusive scan
(:func:`chunkscan.ops.diagonal.inclusive_scan`, Hillis-Steele:
``ceil(log2 L)`` rounds of ``(a, b)_t <- (a_t a_{t-s}, a_t b_{t-s} + b_t)``), so a chunk is
a constant number of batched ops, not ``L`` steps: only products of decays ``<= 1`` (for
``dt >= 0``, ``A <= 0``) and sums, never a division, so no overflow where a cumulative
sum of log-decays would need one. The backward is MLX's autograd of that chunk.
"""

from __future__ import annotations

import mlx.core as mx

from ...scan import scan
from ..diagonal.chunk import inclusive_scan
from ._checks import F32, check_inputs


def default_chunk_size() -> int:
    """The chunk :func:`selective_scan` takes by default: 8 on every device. On an H100
    (Falcon-Mamba 7B's layer, bfloat16, T = 2048 / 8192;
    ``bench/results/h100/mamba_h100_*c8c3323.json``): 0.448 / 1.975 s at 530 / 386
    KiB/token, against 0.310 / 1.144 at 1738 / 722 with 16 and 0.221 / 0.923 at 7802 /
    2159 with 64 (mlx-lm's loop: 1.304 / 6.256 s at 1103 / 1994): of these only 8 holds
    less than mlx-lm's loop at both lengths (4 was not measured there). On the CPU (2
    cores, Mamba's layer at 1536 channels, a state of 16, T = 1024, float32;
    ``bench/results/cpu/mamba_{,c4_,c16_,c32_}8f46674.json``): 5.91 s at 132.0 KiB/token,
    against 5.34 / 132.0 with 4 (10% faster at the same peak: other buffers set it at
    this size; 4 keeps twice the states, one ``[Dc, N]`` per chunk), 6.23 / 140.8 with
    16, 7.09 / 201.8 with 32. Apple GPUs take it, unmeasured there."""
    return 8


def _chunk(h, xs, params):
    """One chunk: the state leaving it and its outputs (float32; ``params`` is ``(A,)``,
    or ``(A, D)`` with the skip term ``D x``)."""
    x, dt, B, C = (v.astype(F32) for v in xs)
    A, *D = params
    a = mx.exp(dt[..., None] * A)
    b = (dt * x)[..., None] * B[:, :, None, :]
    decay, states = inclusive_scan(a, b)
    states = states + decay * h[:, None]
    y = (states * C[:, :, None, :]).sum(-1)
    if D:
        y = y + D[0] * x
    return states[:, -1], y


def selective_scan(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array | None = None,
    *,
    initial_state: mx.array | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Mamba's selective scan (S6), with a backward whose memory is the state entering
    each chunk plus one chunk's recomputation.

    Per channel ``c`` and state index ``n``::

        h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] x_t[c] B_t[n]
        y_t[c] = sum_n h_t[c, n] C_t[n] + D[c] x_t[c]

    ``dt`` is the step size as the recurrence uses it (Mamba's ``softplus(dt_proj(.))``,
    after any bias and clipping), ``A`` the continuous decay rates (Mamba's
    ``-exp(A_log)``; a growing state, ``A > 0``, may overflow within a chunk where the
    loop's steps stay finite). Computed in float32 whatever the inputs' dtype. Values and
    gradients (of ``x``, ``dt``, ``A``, ``B``, ``C``, ``D`` and ``initial_state``) match
    :func:`chunkscan.ops.selective_scan.naive_selective_scan`, the per-step loop, to
    float32 rounding. Works eagerly, under ``mx.compile`` and ``nn.value_and_grad``;
    ``mx.vmap`` / ``mx.jvp`` are not supported (as :func:`chunkscan.scan`).

    Args:
        x (array): ``[B, T, Dc]`` inputs; float32, bfloat16 or float16.
        dt (array): ``[B, T, Dc]`` step sizes.
        A (array): ``[Dc, N]`` decay rates (``<= 0`` for a decaying state).
        B (array): ``[B, T, N]`` input projections (one per token, shared by channels).
        C (array): ``[B, T, N]`` output projections.
        D (array, optional): ``[Dc]`` skip weights; ``None``: no skip term.
        initial_state (array, optional): ``[B, Dc, N]``; default zeros.
        chunk_size (int, optional): Steps per chunk (need not divide ``T``); its
            recomputation peaks at about ``28 + 2 log2 chunk_size`` float32 arrays of
            ``[B, chunk_size, Dc, N]`` eagerly, about 5 more compiled (measured from 32
            to 256 steps), and between 11 and 42 at 16 steps or fewer, varying between
            runs (docs/selective_scan.md). Default: :func:`default_chunk_size` (8).

    Returns:
        tuple: ``(y [B, T, Dc]`` in ``x``'s dtype, ``final state [B, Dc, N]`` float32).

    Raises:
        TypeError: an argument is not an ``mx.array``, or ``chunk_size`` not an int.
        ValueError: a shape or dtype out of the layout above, or ``chunk_size < 1``.
    """
    fn = "selective_scan"
    given = 1 if chunk_size is None else chunk_size  # None: the default; 0 or False raise
    batch, T, dc, n = check_inputs(fn, x, dt, A, B, C, D, initial_state, given)
    chunk_size = default_chunk_size() if chunk_size is None else int(chunk_size)
    h0 = mx.zeros((batch, dc, n), dtype=F32) if initial_state is None else initial_state.astype(F32)
    if T == 0:
        return mx.zeros((batch, 0, dc), dtype=x.dtype), h0
    # A in float32 before the scan, as the oracle: its gradient is summed over the chunks
    # in float32 and rounded once (found by probing, session 49: a bfloat16 A's gradient
    # summed chunk by chunk in bfloat16 lost a quarter of itself over 1024 chunks).
    # D x inside the chunk, with D a float32 parameter as A, so that x is read once and
    # its gradient rounded once to its dtype (found by probing, session 51: D x outside the
    # scan added two gradients of a bfloat16 x, each rounded, off by up to its own size
    # where they cancel).
    params = (A.astype(F32),) if D is None else (A.astype(F32), D.astype(F32))
    h, y = scan(_chunk, h0, (x, dt, B, C), chunk_size=chunk_size, params=params, axis=1)
    return y.astype(x.dtype), h
