"""Measurement targets the tests run in fresh processes (through
:func:`helpers.run_target`): each sets up one configuration, measures it and returns a
JSON-able dict. Peak memory and the buffer cache leak between runs in one process,
so none of these is called in the test process itself.

Every target runs on the CPU device, also on a machine with a GPU. What these bounds
guard is the graph's ordering (which scratch is freed before what is computed next),
and the CPU backend frees a buffer once its last user has run. MLX's CUDA backend
holds every buffer of a committed command graph until the graph has run (a graph
per 100 ops, up to 10 in flight; docs/benchmarks.md), so on the GPU the tests' small
shapes sit below that plateau: the blocked attention's backward grew 2.7 -> 13.4 MB
from T=256 to 1024 on an H200 (bench/results/h200/tests_h200_attention_e01091b.txt). GPU
memory is measured at real shapes by the benchmarks (bench/attention.py,
bench/gated_delta.py).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
from helpers import attention_inputs, gated_delta_inputs

import chunkscan
from chunkscan.commands import reporter
from chunkscan.commands.measure import NoOrdering, peak_above_active

mx.set_default_device(mx.cpu)


def gated_delta_backward_peak(
    T: int,
    group_bytes: int,
    B: int,
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    C: int,
    channel: bool = False,
    no_edge: str | None = None,
    save: str | None = None,
    pass_form: str | None = None,
    split_products: bool = False,
) -> dict[str, Any]:
    """Peak bytes above the inputs of all six gradients of ``gated_delta_rule``, the
    op's groups set to ``group_bytes`` (``channel``: a per-channel gate; ``no_edge``:
    one ordering rule of the op switched off, the negative control; ``save``: what the
    forward keeps, ``chunk._SAVE``; ``pass_form``: the portable state pass's form,
    default the CPU's ``"factored"``; ``"transition"`` is the GPUs', which forms no
    ``V`` for the outputs, as the kernels do not; ``split_products``: every product
    split across two CPU threads, :mod:`chunkscan.ops._cpu_threads`)."""
    import functools
    import os

    from chunkscan.ops import _cpu_threads
    from chunkscan.ops.gated_delta import _passes
    from chunkscan.ops.gated_delta import chunk as chunk_module

    if split_products:
        _cpu_threads.MIN_FLOPS = 0
        os.environ["CHUNKSCAN_CPU_THREADS"] = "2"
    else:
        os.environ["CHUNKSCAN_CPU_THREADS"] = "1"

    if pass_form:
        _passes.portable_state_pass = functools.partial(_passes.portable_state_pass, form=pass_form)
    chunk_module._GROUP_BYTES = group_bytes
    chunk_module._SAVE = save
    if no_edge:
        chunk_module._ordering = without(no_edge)
    inputs = gated_delta_inputs(B, T, Hk, Hv, Dk, Dv, channel=channel)
    w = mx.random.normal((B, T, Hv, Dv), key=mx.random.key(7))
    mx.eval(inputs, w)

    def loss(q, k, v, g, beta, h0):
        o, st = chunkscan.gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=C)
        return mx.sum(o * w) + mx.sum(st)

    grad = mx.grad(loss, argnums=tuple(range(6)))
    _, peak = peak_above_active(lambda: grad(*inputs))
    return {"peak": peak}


def gated_delta_forward_peak(
    T: int, B: int, Hk: int, Hv: int, Dk: int, Dv: int, C: int, no_edge: str | None = None
) -> dict[str, Any]:
    """Peak bytes above the inputs of the op's forward alone, one chunk per group."""
    from chunkscan.ops.gated_delta import chunk as chunk_module

    chunk_module._GROUP_BYTES = 1
    if no_edge:
        chunk_module._ordering = without(no_edge)
    inputs = gated_delta_inputs(B, T, Hk, Hv, Dk, Dv)
    mx.eval(inputs)
    _, peak = peak_above_active(
        lambda: chunkscan.gated_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=C)
    )
    return {"peak": peak}


def without(edge: str):
    """:mod:`chunkscan._ordering` with the rule ``edge`` switched off."""
    from chunkscan import _ordering

    class Without:
        def __getattr__(self, name):
            return (lambda arrays, deps: list(arrays)) if name == edge else getattr(_ordering, name)

    return Without()


def shared_weight_backward_peak(T: int, mode: str, C: int, Din: int, D: int) -> dict[str, Any]:
    """Peak bytes above the inputs of the gradients of ``s_t = tanh(0.5 s_{t-1} + x_t W)``
    (``x [T, Din]``, ``W [Din, D]`` shared by every step) with respect to ``x``, ``W``
    and ``s_0``, in chunks of ``C`` steps: ``mode`` ``"scan"`` (``scan(params={"W": W})``)
    or ``"checkpoint"`` (``checkpoint`` of a chunk function taking ``W`` as an argument,
    in a loop over ``split``, as the README's drop-in)."""
    x = mx.random.normal((T, Din), key=mx.random.key(0))
    W = mx.random.normal((Din, D), key=mx.random.key(1)) * Din**-0.5
    s0 = mx.zeros((D,))
    mx.eval(x, W, s0)

    def step(s, x_t, p):
        s = mx.tanh(0.5 * s + x_t @ p["W"])
        return s, s

    def chunk(s, xc, W):
        ys = []
        for t in range(xc.shape[0]):
            s, y = step(s, xc[t], {"W": W})
            ys.append(y)
        return s, mx.stack(ys)

    if mode == "scan":

        def loss(x, W, s0):
            _, y = chunkscan.scan(chunkscan.stepwise(step), s0, x, chunk_size=C, params={"W": W})
            return (y * y).sum()

    elif mode == "checkpoint":
        run = chunkscan.checkpoint(chunk)

        def loss(x, W, s0):
            s, total = s0, 0.0
            for xc in chunkscan.split(x, C):
                s, y = run(s, xc, W)
                total = total + (y * y).sum()
            return total

    else:
        raise ValueError(f"mode must be scan or checkpoint: {mode!r}")
    grad = mx.grad(loss, argnums=(0, 1, 2))
    _, peak = peak_above_active(lambda: grad(x, W, s0))
    return {"peak": peak}


def attention_backward_peak(
    impl: str,
    T: int,
    B: int,
    Hq: int,
    Hkv: int,
    D: int,
    mask: str | None,
    scratch_mib: float,
    compiled: bool = False,
    forward: bool = False,
    no_edge: str | None = None,
) -> dict[str, Any]:
    """Peak bytes above the inputs of ``dq, dk, dv`` of ``sum(o)`` (float32, ``S = T``),
    after one warm-up call; ``forward``: of ``o`` alone. ``impl``: ``"chunkscan"`` (the
    blocked op, never the shortcut to MLX), ``"chunkscan_unordered"`` (the same without
    its ordering edges) or ``"mlx_fast"`` (``mx.fast.scaled_dot_product_attention``,
    whose backward keeps the scores); ``no_edge``: one ordering rule of the blocked op
    switched off (:func:`without`), a negative control."""
    import os

    from chunkscan.ops.attention import blocked

    # The bounds and controls were measured with the products split across two CPU
    # threads (CI's default on two cores); with CHUNKSCAN_CPU_THREADS=1 in the caller's
    # environment the tape's order kept rule 2's control's blocks apart (8.8 MB against
    # the 19.4 it must pass), so the measurement pins its own setting.
    os.environ["CHUNKSCAN_CPU_THREADS"] = "2"
    blocked.SCRATCH_BYTES = int(scratch_mib * (1 << 20))
    blocked.FAST_MAX_SCORES = 0
    if impl == "chunkscan_unordered":
        blocked._ordering = NoOrdering
    if no_edge:
        blocked._ordering = without(no_edge)
    q, k, v, _ = attention_inputs(B, Hq, Hkv, T, T, D)
    mx.eval(q, k, v)
    scale = D**-0.5
    if impl == "mlx_fast":

        def op(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    elif impl in ("chunkscan", "chunkscan_unordered"):

        def op(q, k, v):
            return chunkscan.attention(q, k, v, scale=scale, mask=mask)

    else:
        raise ValueError(f"impl must be chunkscan, chunkscan_unordered or mlx_fast: {impl!r}")
    if forward:
        fn = op
    else:
        fn = mx.grad(lambda q, k, v: op(q, k, v).astype(mx.float32).sum(), argnums=(0, 1, 2))
    if compiled:
        fn = mx.compile(fn)
    mx.eval(fn(q, k, v))  # warm-up
    _, peak = peak_above_active(lambda: fn(q, k, v))
    return {"peak_bytes": peak}


def one_chunk_backward_host_memory(T: int, fan_out: int | None = None) -> dict[str, Any]:
    """Peak RSS growth of the backward of ``scan`` over one chunk of ``T`` steps.

    RSS, not ``mx.get_peak_memory``: the cost being guarded is the graph itself (MLX's
    sibling lists), which lives outside MLX's allocator. The peak is Linux's
    ``VmHWM``, reset first (a forked child inherits its parent's ``ru_maxrss``).
    ``fan_out`` overrides the split's fan-out (huge: the flat split).
    """
    if fan_out is not None:
        importlib.import_module("chunkscan.split")._FAN_OUT = fan_out
    s0, q, k, v = reporter.make_inputs(T, 1, 4)
    mx.eval(s0, q, k, v)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak RSS to the current RSS
    before = _status_bytes("VmHWM")

    def loss(s0, q, k, v):
        s, y = chunkscan.scan(chunkscan.stepwise(reporter.step), s0, (q, k, v), chunk_size=T)
        return y.sum() + s.sum()

    mx.eval(mx.grad(loss, argnums=(0, 1, 2, 3))(s0, q, k, v))
    return {"rss": _status_bytes("VmHWM") - before}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # "VmHWM:  12345 kB"
    raise RuntimeError(f"no {field} in /proc/self/status")


def die_by_signal(number: int) -> dict[str, Any]:
    """The process ends by signal ``number`` before it returns (measure's error text)."""
    import os

    os.kill(os.getpid(), number)
    return {}


def scan_second_derivative_peak(
    T: int, mode: str, C: int, H: int, D: int, split_in_backward: bool | None = None
) -> dict[str, Any]:
    """Peak bytes above the inputs of a second derivative (the gradient of ``sum(dk^2)``
    with respect to q, k, v and the initial state) of the delta-rule loss
    ``sum(y * w) + sum(s_T)``: ``mode`` ``"scan"`` (``scan(stepwise(step))`` in chunks of
    ``C``) or ``"loop"`` (plain autograd of the per-step loop over ``split`` pieces of
    one step); ``split_in_backward=False``: scan's backward cuts with plain slices, the
    negative control (``scan._SPLIT_IN_BACKWARD``); ``None`` leaves the library's default
    (which setting it to ``True`` here had left untested; found by mutation)."""
    if split_in_backward is not None:
        importlib.import_module("chunkscan.scan")._SPLIT_IN_BACKWARD = split_in_backward
    q, k, v = (mx.random.normal((T, H, D), key=mx.random.key(i)) for i in range(3))
    k = 0.15 * k
    s0 = 0.1 * mx.random.normal((H, D, D), key=mx.random.key(3))
    w = mx.random.normal((T, H, D), key=mx.random.key(4))
    mx.eval(q, k, v, s0, w)

    def step(s, x):
        q_t, k_t, v_t = x
        s = 0.95 * s + (v_t - (s * k_t[:, None, :]).sum(-1))[:, :, None] * k_t[:, None, :]
        return s, (s * q_t[:, None, :]).sum(-1)

    def loss(q, k, v, s0):
        if mode == "scan":
            s, y = chunkscan.scan(chunkscan.stepwise(step), s0, (q, k, v), chunk_size=C)
        elif mode == "loop":
            s, ys = s0, []
            for qt, kt, vt in zip(*(chunkscan.split(a, 1) for a in (q, k, v))):
                s, y_t = step(s, (qt[0], kt[0], vt[0]))
                ys.append(y_t)
            y = mx.stack(ys)
        else:
            raise ValueError(f"mode must be scan or loop: {mode!r}")
        return (y * w).sum() + s.sum()

    def squared_first(q, k, v, s0):
        g = mx.grad(loss, argnums=1)(q, k, v, s0)
        return (g * g).sum()

    grad2 = mx.grad(squared_first, argnums=(0, 1, 2, 3))
    _, peak = peak_above_active(lambda: grad2(q, k, v, s0))
    return {"peak": peak}


def gated_delta_second_derivative_peak(
    T: int, group_bytes: int, split_groups: bool | None = None
) -> dict[str, Any]:
    """Peak bytes above the inputs of a second derivative of ``gated_delta_rule``'s
    portable path (the gradient of ``sum(dk^2)`` with respect to q, k, v; B = 1, H = 8,
    D = 32, C = 16), its groups set to ``group_bytes``; ``split_groups=False``: the
    backward cuts its groups with plain slices, the negative control
    (``chunk._SPLIT_GROUPS``); ``None`` leaves the library's default."""
    from chunkscan.ops.gated_delta import chunk as chunk_module

    chunk_module._GROUP_BYTES = group_bytes
    if split_groups is not None:
        chunk_module._SPLIT_GROUPS = split_groups
    B, H, D = 1, 8, 32
    ks = [mx.random.key(i) for i in range(6)]
    q = mx.random.normal((B, T, H, D), key=ks[0])
    k = 0.2 * mx.random.normal((B, T, H, D), key=ks[1])
    v = mx.random.normal((B, T, H, D), key=ks[2])
    g = -0.1 * mx.abs(mx.random.normal((B, T, H), key=ks[3]))
    beta = mx.sigmoid(mx.random.normal((B, T, H), key=ks[4]))
    w = mx.random.normal((B, T, H, D), key=ks[5])
    mx.eval(q, k, v, g, beta, w)

    def loss(q, k, v):
        o, s = chunkscan.gated_delta_rule(q, k, v, g, beta, chunk_size=16, kernels=False)
        return (o * w).sum() + s.sum()

    def squared_dk(q, k, v):
        dk = mx.grad(loss, argnums=1)(q, k, v)
        return (dk * dk).sum()

    grad2 = mx.grad(squared_dk, argnums=(0, 1, 2))
    _, peak = peak_above_active(lambda: grad2(q, k, v))
    return {"peak": peak}


def linear_attention_backward_peak(
    T: int,
    B: int,
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    C: int,
    one_group: bool = False,
    no_edge: str | None = None,
    compiled: bool = False,
    q_only: bool = False,
) -> dict[str, Any]:
    """Peak bytes above the inputs of all five gradients of ``linear_attention``
    (``compiled``: under ``mx.compile``; ``q_only``: the gradient of ``q`` alone); the
    negative controls: ``one_group``, the whole sequence one group (no budget, no cap
    on the chunks per group), or ``no_edge``, one ordering rule of the op switched off
    (:func:`without`)."""
    from chunkscan.ops.linear_attention import chunk as chunk_module

    if one_group:
        chunk_module._GROUP_BYTES = 1 << 60
        chunk_module._CHUNKS_PER_C = T
    if no_edge:
        chunk_module._ordering = without(no_edge)
    q, k, v, g, _, h0 = gated_delta_inputs(B, T, Hk, Hv, Dk, Dv)
    w = mx.random.normal((B, T, Hv, Dv), key=mx.random.key(7))
    mx.eval(q, k, v, g, h0, w)

    def loss(q, k, v, g, h0):
        o, st = chunkscan.linear_attention(q, k, v, g, initial_state=h0, chunk_size=C)
        return mx.sum(o * w) + mx.sum(st)

    grad = mx.grad(loss, argnums=0 if q_only else tuple(range(5)))
    if compiled:
        grad = mx.compile(grad)
    _, peak = peak_above_active(lambda: grad(q, k, v, g, h0))
    return {"peak": peak}


def _state_op_backward_peak(op, args: tuple, out_shape: tuple, C: int,
                            compiled: bool) -> dict[str, Any]:  # fmt: skip
    """Peak bytes above the inputs of the gradients of every argument of ``op(*args[:-1],
    initial_state=args[-1], chunk_size=C)`` (an op whose last argument is its initial
    state), the loss ``sum(out * w) + sum(final state)`` with ``w`` a normal draw (key
    7) of ``out_shape``; ``compiled``: under ``mx.compile``."""
    w = mx.random.normal(out_shape, key=mx.random.key(7))
    mx.eval(args, w)

    def loss(*a):
        out, state = op(*a[:-1], initial_state=a[-1], chunk_size=C)
        return mx.sum(out * w) + mx.sum(state)

    grad = mx.grad(loss, argnums=tuple(range(len(args))))
    if compiled:
        grad = mx.compile(grad)
    _, peak = peak_above_active(lambda: grad(*args))
    return {"peak": peak}


def selective_scan_backward_peak(
    T: int, B: int, Dc: int, N: int, C: int, compiled: bool = False
) -> dict[str, Any]:
    """Peak bytes above the inputs of all seven gradients of ``selective_scan``
    (``compiled``: under ``mx.compile``); a chunk as long as the sequence (``C >= T``)
    is the negative control (one chunk: no carries between chunks, the whole sequence's
    parallel scan recomputed at once)."""
    from helpers import selective_scan_inputs

    args = selective_scan_inputs(B, T, Dc, N)
    return _state_op_backward_peak(chunkscan.selective_scan, args, (B, T, Dc), C, compiled)


def scan_input_work_peak(
    T: int, C: int, D: int, no_edge: str | None = None, state_only: bool = False,
    gate_constants: bool = True, with_params: bool = False, checkpoint_loop: bool | str = False,
    inputs_together: bool = True, by_kind: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Peak bytes above the inputs of the gradients (``q``, ``g``, ``h0``) of a ``scan``
    whose chunk function does most of its work on its inputs alone, as chunkwise delta
    rules do: pairwise decays ``[L, L + 1, D]`` within the chunk and a triangular
    inverse of a matrix built from them (the project's ``unit_lower_inverse``); only
    then the carry. ``no_edge``: one of ``scan``'s ordering rules switched off (rule 5:
    without it MLX ran every chunk's input work first and kept it; found by probing,
    session 46). ``state_only``: ``xs_grad=False``, the gradient of ``h0`` alone;
    ``gate_constants=False``: the backward's constant xs chunks not gated by rule 2
    (``scan._GATE_CONSTANTS``, the negative control; found by probing, session 52).
    ``checkpoint_loop``: the same chunks as a hand-written loop of ``chunkscan.split``
    and ``chunkscan.checkpoint`` (``True``), with each chunk's offset passed as a Python
    int (``"int_offset"``: it lost the edge until session 54, found by probing), or with
    a checkpoint made anew per call (``"inline"``: no edge, a documented limit);
    ``by_kind=False``: a structure not seen yet without its kind's flag (the int-offset
    form's negative control, ``checkpoint._BY_KIND``); ``inputs_together=False``: without
    its rule 5 (``checkpoint._INPUTS_TOGETHER``, the negative control; session 52)."""
    from chunkscan.ops.gated_delta._triangular import unit_lower_inverse

    scan_module = importlib.import_module("chunkscan.scan")
    if no_edge:
        scan_module._ordering = without(no_edge)
    scan_module._GATE_CONSTANTS = gate_constants
    importlib.import_module("chunkscan.checkpoint")._INPUTS_TOGETHER = inputs_together
    importlib.import_module("chunkscan.checkpoint")._BY_KIND = by_kind
    q = mx.random.normal((T, D), key=mx.random.key(0))
    g = -0.5 * mx.random.uniform(shape=(T, D), key=mx.random.key(1))
    w = mx.random.normal((T, D), key=mx.random.key(2))
    h0 = mx.zeros((D,))
    mx.eval(q, g, w, h0)

    def chunk(h, xs, p=1.0):
        q, g = xs
        L = q.shape[0]
        after = mx.arange(L)[:, None] > mx.arange(-1, L)[None, :]  # [L, L + 1]
        decays = mx.exp(mx.cumsum(mx.where(after[..., None], g[:, None], 0.0), axis=0))
        qd = q[:, None] * decays  # [L, L + 1, D]: no carry yet
        below = mx.arange(L)[:, None] > mx.arange(L)[None]
        inv = unit_lower_inverse(mx.where(below, 0.1 * qd[:, 1:].sum(-1), 0.0))
        y = qd[:, 0] * h * p + inv @ (q * h)
        return h * decays[-1, 0] + (q * decays[-1, 1:]).sum(0), y

    params = {"params": mx.array(0.3)} if with_params else {}

    def chunk_at(h, xs, offset):  # (the offset is read as a position would be)
        return chunk(h, xs, p=1.0 + 0 * offset)

    def looped(q, g, h0):
        step, h, ys = chunkscan.checkpoint(chunk), h0, []
        at = chunkscan.checkpoint(chunk_at)
        for i, (qc, gc) in enumerate(zip(chunkscan.split(q, C), chunkscan.split(g, C))):
            if checkpoint_loop == "int_offset":
                h, y = at(h, (qc, gc), i * C)
            elif checkpoint_loop == "inline":
                h, y = chunkscan.checkpoint(chunk)(h, (qc, gc))
            else:
                h, y = step(h, (qc, gc))
            ys.append(y)
        return h, mx.concatenate(ys)

    def loss(q, g, h0):
        if checkpoint_loop:
            h, y = looped(q, g, h0)
        else:
            h, y = chunkscan.scan(chunk, h0, (q, g), chunk_size=C, xs_grad=not state_only, **params)
        return mx.sum(y * w) + mx.sum(h)

    grad = mx.grad(loss, argnums=2 if state_only else (0, 1, 2))
    _, peak = peak_above_active(lambda: grad(q, g, h0))
    return {"peak": peak}


def carryless_backward_peak(
    T: int, C: int, D: int, V: int, forward: bool = False, params_only: bool = False,
    no_edge: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Peak bytes above the inputs of the gradients (hidden states ``[T, D]`` and the
    weight ``[D, V]``) of a chunked cross-entropy written as a ``scan`` with no carry
    (``init=None``): each chunk's logits ``[C, V]`` are its scratch; ``forward``: of
    the loss alone; ``params_only``: of the weight's alone, the hidden states constant
    (``xs_grad=False``). ``no_edge``: one of ``scan``'s ordering rules switched off. Every
    edge was anchored on the carry and so skipped, and the chunks ran together (found
    by probing, session 47)."""
    if no_edge:
        importlib.import_module("chunkscan.scan")._ordering = without(no_edge)
    h = mx.random.normal((T, D), key=mx.random.key(0))
    t = mx.random.randint(0, V, (T,), key=mx.random.key(1))
    w = 0.02 * mx.random.normal((D, V), key=mx.random.key(2))
    mx.eval(h, t, w)

    def chunk(c, xs, w):
        h, t = xs
        logits = h @ w
        nll = mx.logsumexp(logits, -1) - mx.take_along_axis(logits, t[:, None], -1)[:, 0]
        return c, nll

    def loss(h, w):
        xs_grad = not params_only
        return chunkscan.scan(chunk, None, (h, t), chunk_size=C, params=w, xs_grad=xs_grad)[1].sum()

    grad = mx.grad(loss, argnums=1 if params_only else (0, 1))
    _, peak = peak_above_active(lambda: loss(h, w) if forward else grad(h, w))
    return {"peak": peak}


def dplr_delta_backward_peak(
    T: int, B: int, H: int, D: int, C: int, compiled: bool = False, no_edge: str | None = None
) -> dict[str, Any]:
    """Peak bytes above the inputs of all seven gradients of ``dplr_delta_rule``
    (``compiled``: under ``mx.compile``); a chunk as long as the sequence (``C >= T``)
    is the negative control (one chunk: no carries between chunks, the whole sequence's
    pairwise decays recomputed at once); ``no_edge``: one ordering rule of ``scan``
    (the op's chunk loop) switched off, the control of that rule."""
    from helpers import dplr_delta_inputs

    if no_edge:
        importlib.import_module("chunkscan.scan")._ordering = without(no_edge)

    args = dplr_delta_inputs(B, T, H, D, D)
    return _state_op_backward_peak(chunkscan.dplr_delta_rule, args, (B, T, H, D), C, compiled)


def diagonal_backward_peak(
    T: int, B: int, D: int, C: int, compiled: bool = False
) -> dict[str, Any]:
    """Peak bytes above the inputs of the three gradients of ``diagonal_recurrence``
    (``compiled``: under ``mx.compile``); a chunk as long as the sequence (``C >= T``)
    is the negative control (one chunk: no carries between chunks, the whole sequence's
    parallel scan recomputed at once)."""
    from helpers import diagonal_inputs

    args = diagonal_inputs(B, T, D)
    return _state_op_backward_peak(chunkscan.diagonal_recurrence, args, (B, T, D), C, compiled)


def linear_attention_unordered_zeros_peak(T: int, **config: Any) -> dict[str, Any]:
    """:func:`linear_attention_backward_peak` with the backward's blocks of the saved
    states' cotangents (MLX's zeros in a first derivative) not waiting for the cotangent
    flowing into their last group (``chunk._WAIT_SAVED_COTANGENTS`` off): the negative
    control of that edge."""
    from chunkscan.ops.linear_attention import chunk as chunk_module

    chunk_module._WAIT_SAVED_COTANGENTS = False
    return linear_attention_backward_peak(T, **config)


def selective_scan_matrix_chunk_peak(T: int, **config: Any) -> dict[str, Any]:
    """:func:`selective_scan_backward_peak` with the chunk's log-depth scan replaced by a
    chunk-parallel form with a matrix of decays ``[B, L, L, Dc, N]`` (as
    ``linear_attention`` has, one per channel and state index here; its values are not
    checked): the negative control of the chunk's memory test."""
    from chunkscan.ops.selective_scan import chunk as chunk_module

    def matrix_scan(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
        L = a.shape[1]
        logs = mx.cumsum(mx.log(a), axis=1)
        below = (mx.arange(L)[:, None] >= mx.arange(L)[None, :])[None, :, :, None, None]
        spans = mx.minimum(logs[:, :, None] - logs[:, None, :], 0.0)
        weights = mx.where(below, mx.exp(spans), 0.0)
        return mx.exp(logs), (weights * b[:, None]).sum(2)

    chunk_module.inclusive_scan = matrix_scan
    return selective_scan_backward_peak(T, **config)
