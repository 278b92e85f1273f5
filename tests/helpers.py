"""What the tests share: error measures, one input generator per op, small models, and
the runner of the measurement targets in :mod:`_targets` (each in a fresh process).

Test modules import from here (``from helpers import ...``; pytest puts ``tests/`` on
``sys.path`` through ``conftest.py``), never from each other. The benchmarks may import
it too, with ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import re
from typing import Any

import mlx.core as mx

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# ------------------------------------------------------------------ error measures


def max_rel(a: mx.array, b: mx.array) -> float:
    """``max |a - b| / max |b|`` in float32; the absolute ``max |a - b|`` when ``b`` is
    all zeros (so a zero reference is matched to the tolerance, not divided by 0)."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    scale = mx.abs(b).max().item()
    diff = mx.abs(a - b).max().item()
    return diff / scale if scale > 0 else diff


def initial_state_gradient_errors(
    ops: tuple, args: list, transitions: list, seed: int, Dv: int = 4, **kwargs: Any
) -> list[float]:
    """Max relative errors of the initial state's gradient of each op in ``ops`` (called
    as ``op(*args, initial_state=h0, **kwargs)``, the loss ``sum(final_state * W)``)
    against float64: the loss is linear in the initial state ``h0 [1, 1, Dv, Dk]``, its
    gradient ``W P^T`` with ``P`` the product of the per-token ``transitions`` (float64
    ``[Dk, Dk]`` NumPy arrays, ``S <- S M_t``). ``args``: float64 NumPy arrays;
    ``kwargs`` go to the last op only (the chunk form; the first, the loop)."""
    import numpy as np

    Dk = transitions[0].shape[0]
    rng = np.random.default_rng(seed + 1000)
    h0, W = rng.standard_normal((1, 1, Dv, Dk)), rng.standard_normal((1, 1, Dv, Dk))
    P = np.eye(Dk)
    for M in transitions:
        P = P @ M
    ref = np.einsum("bhvk,jk->bhvj", W, P)
    xs = [mx.array(x.astype(np.float32)) for x in args]
    Wf = mx.array(W.astype(np.float32))

    def error(op, **kw):
        loss = lambda h: (op(*xs, initial_state=h, **kw)[1] * Wf).sum()  # noqa: E731
        got = np.array(mx.grad(loss)(mx.array(h0.astype(np.float32))))
        return float(np.abs(got - ref).max() / np.abs(ref).max())

    return [error(op, **(kwargs if i == len(ops) - 1 else {})) for i, op in enumerate(ops)]


def rel_rmse(a: mx.array, b: mx.array) -> float:
    """``||a - b|| / ||b||`` (Frobenius norms, float32): the relative RMS error."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(mx.sum((a - b) ** 2)) / mx.maximum(mx.sqrt(mx.sum(b * b)), 1e-30)).item()


def assert_trees_close(got: Any, ref: Any, tol: float = 1e-5, name: str = "value") -> None:
    """Same tree structure and shapes, and :func:`max_rel` ``<= tol`` for every leaf."""
    from chunkscan import _tree

    g_leaves, g_def = _tree.flatten(got)
    r_leaves, r_def = _tree.flatten(ref)
    assert _tree.same_structure(g_def, r_def), f"{name}: structures differ"
    for path, a, b in zip(_tree.paths(r_def, name), g_leaves, r_leaves):
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        err = max_rel(a, b)
        assert err <= tol, f"{path}: max relative difference {err:.2e} > {tol:.0e}"


def max_outputs_of_one_primitive(arrays: list[mx.array]) -> int:
    """The most outputs any primitive in the graph of ``arrays`` has (from its DOT)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    # Primitive nodes have numeric ids; an edge "id -> "name"" is one of its outputs.
    counts = collections.Counter(re.findall(r'^(\d+) -> "', buf.getvalue(), re.M))
    return max(counts.values())


# ------------------------------------------------------------------ op inputs


def gated_delta_inputs(
    B: int,
    T: int,
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    dtype: mx.Dtype = mx.float32,
    n_states: int | None = None,
    seed: int = 0,
    channel: bool = False,
    lo: float = 0.01,
    hi: float = 0.5,
) -> list[mx.array]:
    """``[q, k, v, g, beta, h0]`` for :func:`chunkscan.gated_delta_rule`, in a
    numerically sane range: ``q, v`` standard normal, unit-norm keys, ``g`` uniform in
    ``[-hi, -lo]`` (``[B, T, Hv]``, or ``[B, T, Hv, Dk]`` per key channel with
    ``channel=True``), ``beta`` in ``[0.05, 1]``; ``h0`` ``[n_states or B, Hv, Dv, Dk]``
    float32 (scaled 0.5), the others in ``dtype``."""
    kq, kk, kv, kg, kb, ks = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, Hk, Dk), key=kq)
    k = mx.random.normal((B, T, Hk, Dk), key=kk)
    k = k * mx.rsqrt(mx.sum(k * k, axis=-1, keepdims=True))
    v = mx.random.normal((B, T, Hv, Dv), key=kv)
    g = -mx.random.uniform(lo, hi, (B, T, Hv, Dk) if channel else (B, T, Hv), key=kg)
    beta = mx.random.uniform(0.05, 1.0, (B, T, Hv), key=kb)
    h0 = 0.5 * mx.random.normal((n_states or B, Hv, Dv, Dk), key=ks)
    return [x.astype(dtype) for x in (q, k, v, g, beta)] + [h0]


def attention_inputs(
    B: int,
    Hq: int,
    Hkv: int,
    T: int,
    S: int,
    D: int,
    Dv: int | None = None,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
) -> list[mx.array]:
    """``[q, k, v, ct]`` for :func:`chunkscan.attention`, standard normal in ``dtype``:
    ``q`` ``[B, Hq, T, D]``, ``k`` ``[B, Hkv, S, D]``, ``v`` ``[B, Hkv, S, Dv]`` and an
    output cotangent ``ct`` ``[B, Hq, T, Dv]`` (``Dv`` defaults to ``D``)."""
    ks = mx.random.split(mx.random.key(seed), 4)
    Dv = D if Dv is None else Dv
    q = mx.random.normal((B, Hq, T, D), key=ks[0])
    k = mx.random.normal((B, Hkv, S, D), key=ks[1])
    v = mx.random.normal((B, Hkv, S, Dv), key=ks[2])
    ct = mx.random.normal((B, Hq, T, Dv), key=ks[3])
    return [x.astype(dtype) for x in (q, k, v, ct)]


# ------------------------------------------------------------------ mlx-lm models


def small_config(model_type: str = "qwen3_next", **kw: Any) -> dict[str, Any]:
    """A 2-layer model config (GDN, attention), Hk=1 < Hv=2, Dk=32 != Dv=48, vocab 64."""
    from chunkscan.commands.demo_model import tiny_config

    cfg = tiny_config(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=2,
        full_attention_interval=2,
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=48,
        vocab_size=64,
    )
    cfg.update(kw)
    return cfg


def greedy_tokens(model: Any, prompt: mx.array, n: int) -> tuple[list[int], mx.array]:
    """``n`` greedy tokens after ``prompt`` with a KV cache, and the last logits."""
    cache = model.make_cache()
    logits = model(prompt, cache=cache)[:, -1]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok.item())
        logits = model(tok[:, None], cache=cache)[:, -1]
    return out, logits


# ------------------------------------------------------------------ fresh processes


def run_target(name: str, config: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Run ``_targets.<name>(**config)`` in a fresh process; its dict, or ``{"error"}``."""
    from chunkscan.commands.measure import run_isolated

    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return run_isolated(f"_targets:{name}", config, timeout=timeout, env={"PYTHONPATH": path})


def peak_growth(
    target: str,
    config: dict[str, Any],
    lengths: tuple[int, int] = (256, 1024),
    key: str = "peak",
    repeats: int = 3,
    timeout: float = 120,
) -> float:
    """How much ``_targets.<target>``'s ``key`` (a peak in bytes) grows from
    ``T = lengths[0]`` to ``lengths[1]``: at each length the median over ``repeats``
    fresh processes. A process's peak is what the graph's order allows plus whatever
    a late free keeps alive (when the CPU stream's thread releases a buffer relative
    to the next allocation): at the Gated DeltaNet forward test's shape, 15 processes
    gave 574-678 KB at T = 256 and 2179-2229 KB at T = 1024. One sample per length
    once put that test's growth 0.5 KB over its bound; the smallest of three instead
    of the median measured a wider spread of growths (the small length reaches its
    floor more often than the large one)."""

    def median_peak(T: int) -> float:
        peaks = []
        for _ in range(repeats):
            res = run_target(target, dict(config, T=T), timeout=timeout)
            assert "error" not in res, res
            peaks.append(res[key])
        return sorted(peaks)[len(peaks) // 2]

    growth = median_peak(lengths[1]) - median_peak(lengths[0])
    _record_growth(target, config, lengths, key, growth)
    return growth


@functools.cache
def _provenance() -> dict[str, Any]:
    """The run's provenance, once per process (it asks git and the device)."""
    from chunkscan.commands.measure import provenance

    return provenance()


def _record_growth(target: str, config: dict[str, Any], lengths, key: str, growth: float):
    """With ``CHUNKSCAN_RECORD_MEMORY=<file>``, append what :func:`peak_growth` measured
    (one JSON line: the test, target, configuration, lengths, growth in bytes and MiB,
    and the run's ``meta``: argv, commit, device, versions, as every benchmark file has),
    so that the figures the docs quote from the memory tests regenerate from a command
    (``bench/results/README.md``, "memory tests"), not only from the tests' docstrings."""
    path = os.environ.get("CHUNKSCAN_RECORD_MEMORY")
    if not path:
        return
    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "target": target,
           "config": config, "lengths": list(lengths), "key": key, "growth_bytes": growth,
           "growth_mib": round(growth / 2**20, 3), "meta": _provenance()}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def selective_scan_inputs(B: int, T: int, Dc: int, N: int, seed: int = 0, dtype=mx.float32):
    """``(x, dt, A, B, C, D, h0)`` for :func:`chunkscan.selective_scan` as Mamba makes
    them: ``dt`` a softplus (0.05-3), ``A = -exp(.)`` in about [-7, -0.14]."""
    k = mx.random.split(mx.random.key(seed), 7)
    x = mx.random.normal((B, T, Dc), key=k[0])
    dt = mx.logaddexp(mx.random.normal((B, T, Dc), key=k[1]) - 1.0, mx.array(0.0))
    A = -mx.exp(mx.random.uniform(-2.0, 2.0, (Dc, N), key=k[2]))
    Bm, Cm = (mx.random.normal((B, T, N), key=kk) for kk in k[3:5])
    D = mx.random.normal((Dc,), key=k[5])
    h0 = 0.5 * mx.random.normal((B, Dc, N), key=k[6])
    return tuple(a.astype(dtype) for a in (x, dt)) + (A, Bm.astype(dtype), Cm.astype(dtype), D, h0)


def diagonal_inputs(B: int, T: int, D: int, seed: int = 0, dtype=mx.float32):
    """``(x, a, h0)`` for :func:`chunkscan.diagonal_recurrence` as RG-LRU makes them:
    ``a = exp(-8 r softplus(c))`` in about (0.02, 1), inputs scaled by ``sqrt(1 - a^2)``."""
    k = mx.random.split(mx.random.key(seed), 4)
    r = mx.sigmoid(mx.random.normal((B, T, D), key=k[0]))
    c = mx.random.normal((D,), key=k[1])
    a = mx.exp(-8.0 * r * mx.logaddexp(c, mx.array(0.0)))
    x = mx.random.normal((B, T, D), key=k[2]) * mx.sqrt(1 - a * a)
    h0 = mx.random.normal((B, D), key=k[3])
    return x.astype(dtype), a.astype(dtype), h0


def dplr_delta_inputs(B: int, T: int, H: int, Dk: int, Dv: int, seed: int = 0,
                      dtype=mx.float32, strong: bool = False):  # fmt: skip
    """``(q, k, v, a, b, g, h0)`` for :func:`chunkscan.dplr_delta_rule` as RWKV-7 makes
    them: ``a = -kk``, ``b = kk * iclr`` (``kk`` unit rows, ``iclr`` in (0, 1)), ``g =
    log w`` in about [-0.61, 0] (``strong``: down to about -8, decays RWKV-7 never
    makes, for the op's general claim)."""
    key = mx.random.split(mx.random.key(seed), 7)
    q, k, kk, lr, d = (mx.random.normal((B, T, H, Dk), key=kk_) for kk_ in key[:5])
    v = mx.random.normal((B, T, H, Dv), key=key[5])
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    g = -8.0 * mx.sigmoid(2.0 * d) if strong else -0.606531 * mx.sigmoid(d)
    h0 = 0.5 * mx.random.normal((B, H, Dv, Dk), key=key[6])
    low = tuple(x.astype(dtype) for x in (q, 0.5 * k, v, -kk, kk * mx.sigmoid(lr), g))
    return low + (h0,)


def state_op_outputs_and_grads(fn, args, *, out_like: int = 0, compiled: bool = False,
                               exact_in=None, **kwargs) -> list:  # fmt: skip
    """``[output, final state, the gradient of each of args]`` of ``fn(*args[:-1],
    initial_state=args[-1], **kwargs)`` (the ops whose last argument is their initial
    state: selective_scan, dplr_delta_rule, diagonal_recurrence, and their oracles) under
    random cotangents: normal draws (keys 11 and 12) of ``args[out_like]``'s shape for the
    output and of the state's for the final state, rounded to ``exact_in`` where given;
    ``compiled``: the call and its gradient under ``mx.compile``."""
    w = mx.random.normal(args[out_like].shape, key=mx.random.key(11))
    ws = mx.random.normal(args[-1].shape, key=mx.random.key(12))
    if exact_in is not None:
        w, ws = (a.astype(exact_in).astype(mx.float32) for a in (w, ws))

    def run(*a):
        return fn(*a[:-1], initial_state=a[-1], **kwargs)

    def loss(*a):
        out, state = run(*a)
        return mx.sum(out.astype(mx.float32) * w) + mx.sum(state * ws)

    grad = mx.grad(loss, argnums=tuple(range(len(args))))
    if compiled:
        run, grad = mx.compile(run), mx.compile(grad)
    return [*run(*args), *grad(*args)]


def gdn_outputs_and_grads(fn, inputs, *, compiled=False, **kwargs):
    """(o, final_state, dq, dk, dv, dg, dbeta, dh0) under random cotangents. With five
    inputs (no h0) ``fn`` gets ``initial_state=None`` and the list has no dh0."""
    with_h0 = len(inputs) == 6

    def f(*args):
        return list(fn(*args[:5], initial_state=args[5] if with_h0 else None, **kwargs))

    q, v = inputs[0], inputs[2]
    cu = kwargs.get("cu_seqlens")
    n_states = q.shape[0] if cu is None else len(cu) - 1
    state_shape = (n_states, v.shape[2], v.shape[3], q.shape[3])
    k1, k2 = mx.random.split(mx.random.key(123))
    ct_o = mx.random.normal(v.shape, key=k1).astype(q.dtype)
    ct_s = mx.random.normal(state_shape, key=k2)

    def both(*args):
        return mx.vjp(f, list(args), [ct_o, ct_s])

    if compiled:
        both = mx.compile(both)
    outs, grads = both(*inputs)
    return list(outs) + list(grads)


def gdn_low_precision_pair(inputs, **kwargs):
    """``(got, ref)``: :func:`chunkscan.gated_delta_rule`'s outputs and vjp (as
    :func:`gdn_outputs_and_grads` lists them) on the low-precision ``inputs`` (six, with
    h0) and on the same inputs upcast to float32, under the same cotangents (the output
    cotangent drawn in the inputs' dtype)."""
    from chunkscan import gated_delta_rule

    dtype = inputs[0].dtype
    ct_o = mx.random.normal(inputs[2].shape, key=mx.random.key(3)).astype(dtype)
    ct_s = mx.random.normal(inputs[5].shape, key=mx.random.key(4))

    def run(xs, ct):
        def f(q, k, v, g, beta, h0):
            return list(gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kwargs))

        outs, grads = mx.vjp(f, xs, [ct, ct_s])
        return list(outs) + list(grads)

    got = run(inputs, ct_o)
    ref = run([x.astype(mx.float32) for x in inputs], ct_o.astype(mx.float32))
    return got, ref


def cuda_emulator():
    """``tools/cuda_emulate.py`` as a module (it is a tool, not a package module): runs
    CUDA kernel sources on the CPU for the kernel tests."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "cuda_emulate.py"
    spec = importlib.util.spec_from_file_location("cuda_emulate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emulate_kernels(monkeypatch) -> tuple[Any, list[str]]:
    """Every kernel launch run by :func:`cuda_emulator` (``chunkscan._backend.RUNNER``);
    returns the emulator module (its ``ODD_INPUTS`` a test may set) and the list of the
    launched kernels' names, in order."""
    from chunkscan import _backend

    emu, names = cuda_emulator(), []

    def runner(name, *args, **kwargs):
        names.append(name)
        return emu.run(name, *args, **kwargs)

    monkeypatch.setattr(_backend, "RUNNER", runner)
    return emu, names


def fake_cuda_limits(monkeypatch, kib_per_block: int, kib_per_sm: int | None = None) -> None:
    """Make :func:`chunkscan._backend.cuda_limits` report a CUDA device with this much
    shared memory per block (and per multiprocessor): what the kernels' dispatch and
    configurations read. Nothing is launched; use it for ``supports``-level checks."""
    from chunkscan import _backend

    per_sm = (kib_per_sm or kib_per_block + 1) * 1024
    limits = _backend.CudaLimits(kib_per_block * 1024, per_sm, 132, "test")
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    monkeypatch.setattr(_backend, "_LIMITS", {0: limits})
    monkeypatch.setattr(_backend, "_CAPABILITY", {})  # what it asks under the fake stays here


def fake_fused_kernels(set_attr=setattr) -> None:
    """Build the Gated DeltaNet op's fused CUDA path on any machine, without running it:
    every kernel launch returns lazy zeros of its outputs' shapes (through
    :data:`chunkscan._backend.RUNNER`), the fused chunk kernels are taken wherever they
    handle the shape and the state passes' kernel is on (``kernels=False`` still turns
    it off). ``set_attr``: ``monkeypatch.setattr`` in a test; ``setattr`` (the default)
    for a whole process (``bench/graph_build.py``)."""
    from chunkscan import _backend
    from chunkscan.ops.gated_delta import _chunk_cuda, _passes
    from chunkscan.ops.gated_delta import chunk as chunk_module

    def fake(name, header, source, inputs, outputs, template, grid, group, smem):
        return [mx.zeros(shape, dtype) for _, shape, dtype in outputs]

    set_attr(_backend, "RUNNER", fake)
    set_attr(chunk_module, "_fused", lambda spec, C, kernels, strict=False: _chunk_cuda.supports(
        C, spec.Dk, spec.Dv, spec.channel, strict=strict))  # fmt: skip
    set_attr(_passes, "use_kernels", lambda kernels=None, fn="": kernels is not False)


def spoil_token(inputs: list, name: str, value: float, t: int) -> int:
    """Set input ``name`` (one of q, k, v, g, beta: the first five of ``inputs``, from
    :func:`gated_delta_inputs`) to ``value`` at token ``t``, every head and channel, in
    place; returns its index."""
    i = ("q", "k", "v", "g", "beta").index(name)
    T = inputs[i].shape[1]
    hit = (mx.arange(T) == t).reshape((1, T) + (1,) * (inputs[i].ndim - 2))
    inputs[i] = mx.where(hit, mx.array(value, dtype=inputs[i].dtype), inputs[i])
    return i
