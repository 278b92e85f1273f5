"""The two sequential passes of Gated DeltaNet, behind one interface.

Both the forward state pass and the backward state-gradient pass are one recurrence
over the chunks of a group, per lane (a lane is one value head of one sequence row)::

    for c in order:                       # 0..n-1, or n-1..0 with reverse=True
        if c in loads:  X = inits[loads[c]]
        entering[c] = X
        V = E[c] - F[c] @ X^T             # [C, R]
        X = decay[c] * X + V^T @ G[c] + H[c]   # decay[c] [Dk]: X * decay[c][None, :]
        if c in stores: stored[stores[c]] = X

with ``X`` of shape ``[R, Dk]`` in float32. Forward: ``F = W``, ``E = U``, ``G = K *
to_end``, ``H = 0``: ``X`` is the state, ``entering[c]`` the state entering chunk ``c``.
Backward (reversed): ``F = K * to_end``, ``E = 0``, ``G = W``, ``H = R`` (the
state-independent part of the state gradient): ``X`` is the state cotangent,
``entering[c]`` the cotangent of the state leaving chunk ``c``.

Implementations (see :func:`state_pass`):

- portable, plain MLX ops, in one of two forms that give the same values:
  ``"transition"``: one ``addmm`` per chunk, ``X @ M_c + B_c`` with
  ``M_c = decay_c I - F_c^T G_c`` and ``B_c = E_c^T G_c + H_c`` formed for the whole
  group in a few batched ops (fewest ops per chunk: the choice on GPUs, where each op
  costs tens of microseconds); ``"factored"``: the loop above as written, four ops
  per chunk but half the multiply-adds when ``C < Dk`` (the choice on the CPU);
- ``cuda``: one CUDA kernel launch per group, chosen automatically on a
  CUDA device unless switched off (``CHUNKSCAN_CUDA_KERNELS=0`` or ``kernels=False``).
"""

from __future__ import annotations

import mlx.core as mx

from ..._backend import cuda_device, use_kernels
from .._cpu_threads import matmul
from . import _pass_cuda

__all__ = ["cuda_device", "portable_state_pass", "state_pass", "use_kernels"]

F32 = mx.float32


def state_pass(
    x_in: mx.array | None,
    decay: mx.array,
    F: mx.array,
    E: mx.array | None,
    G: mx.array,
    H: mx.array | None,
    *,
    reverse: bool,
    loads: dict[int, int],
    stores: dict[int, int],
    inits: mx.array | None,
    kernels: bool | None = None,
    values: bool = False,
) -> tuple:
    """Run the recurrence above over one group of ``n`` chunks.

    Args:
        x_in (array, optional): ``[L, R, Dk]`` float32, ``X`` entering the group (in
            processing order); ``None`` when the first processed chunk loads.
        decay (array): ``[L, n]`` float32, or ``[L, n, Dk]`` (per key channel: ``X``
            is multiplied column-wise, ``X * decay[c][None, :]``).
        F (array): ``[L, n, C, Dk]`` float32.
        E (array, optional): ``[L, n, C, R]`` float32; ``None`` means zeros.
        G (array): ``[L, n, C, Dk]`` float32.
        H (array, optional): ``[L, n, R, Dk]`` float32; ``None`` means zeros.
        reverse (bool): Process the chunks last to first.
        loads (dict): chunk index -> index into ``inits``: ``X`` is replaced before
            the chunk.
        stores (dict): chunk index -> slot: ``X`` after the chunk is returned in
            ``stored[slot]`` (slots ``0..len(stores)-1``).
        inits (array, optional): ``[S, L, R, Dk]`` float32, read by ``loads``.
        kernels (bool, optional): Use the backend's fused kernel where there is one.
            Default: ``None`` (automatic; see :func:`use_kernels`).
        values (bool): Also return every chunk's ``V`` (see below).

    Returns:
        tuple: ``(entering [L, n, R, Dk], x_out [L, R, Dk], stored)`` where ``stored``
        is a list of ``[L, R, Dk]`` arrays in slot order; with ``values=True`` a fourth
        item, ``V`` of every chunk ``[L, n, C, R]`` where the implementation forms it
        (the portable ``"factored"`` form, the CPU's), else ``None``: the caller
        recomputes it (in the forward ``V = U - W S^T`` is the part of the outputs that
        the state feeds; in the backward, ``-(K * to_end) dS^T``, a term of ``dU``).
    """
    if use_kernels(kernels):
        if _pass_cuda.supports(F, G, E, H):
            out = _pass_cuda.state_pass(
                x_in, decay, F, E, G, H, reverse=reverse, loads=loads, stores=stores, inits=inits
            )
            return (*out, None) if values else out
    return portable_state_pass(
        x_in, decay, F, E, G, H, reverse=reverse, loads=loads, stores=stores, inits=inits,
        values=values,
    )  # fmt: skip


def portable_state_pass(
    x_in: mx.array | None,
    decay: mx.array,
    F: mx.array,
    E: mx.array | None,
    G: mx.array,
    H: mx.array | None,
    *,
    reverse: bool,
    loads: dict[int, int],
    stores: dict[int, int],
    inits: mx.array | None,
    form: str | None = None,
    values: bool = False,
) -> tuple:
    """The recurrence in plain MLX ops, in the form ``form`` (``None``: ``"factored"``
    on the CPU, ``"transition"`` elsewhere; see the module docstring); ``values`` as
    :func:`state_pass`'s (only the factored form forms ``V``)."""
    if form is None:
        form = "factored" if mx.default_device() == mx.cpu else "transition"
    # [L, n] -> [L, n, 1, 1]; per channel [L, n, Dk] -> [L, n, 1, Dk]
    d = decay[..., None, None] if decay.ndim == 2 else decay[..., None, :]
    if form == "factored":
        vs: list[mx.array | None] = [None] * F.shape[1]

        def step(x: mx.array, c: int) -> mx.array:
            v = -matmul(F[:, c], x.swapaxes(-1, -2))  # [L, C, R]
            if E is not None:
                v = v + E[:, c]
            vs[c] = v
            x = d[:, c] * x + matmul(v.swapaxes(-1, -2), G[:, c])
            return x + H[:, c] if H is not None else x

        out = _walk(x_in, F.shape[1], reverse, loads, stores, inits, step)
        return (*out, mx.stack(vs, axis=1)) if values else out
    M = d * mx.eye(F.shape[-1], dtype=F32) - F.swapaxes(-1, -2) @ G  # [L, n, Dk, Dk]
    if E is not None:
        Bt = E.swapaxes(-1, -2) @ G  # [L, n, R, Dk]
        Bt = Bt + H if H is not None else Bt
    else:
        Bt = H

    def step(x: mx.array, c: int) -> mx.array:
        return x @ M[:, c] if Bt is None else mx.addmm(Bt[:, c], x, M[:, c])

    out = _walk(x_in, F.shape[1], reverse, loads, stores, inits, step)
    return (*out, None) if values else out


def _walk(x_in, n, reverse, loads, stores, inits, step):
    """The chunk loop of the module docstring around ``x = step(x, c)``."""
    x = x_in
    entering: list[mx.array | None] = [None] * n
    stored: list[mx.array | None] = [None] * len(stores)
    for c in range(n - 1, -1, -1) if reverse else range(n):
        if c in loads:
            x = inits[loads[c]]
        entering[c] = x
        x = step(x, c)
        if c in stores:
            stored[stores[c]] = x
    return mx.stack(entering, axis=1), x, stored
