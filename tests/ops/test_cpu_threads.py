"""Products split across CPU threads (``chunkscan.ops._cpu_threads``): bit for bit the
unsplit product, split where it should be, and the setting's checks."""

from __future__ import annotations

import re
import threading

import mlx.core as mx
import pytest
from helpers import attention_inputs
from helpers import gated_delta_inputs as make_inputs
from helpers import gdn_outputs_and_grads as outputs_and_grads

import chunkscan
from chunkscan.ops import _cpu_threads
from chunkscan.ops.attention import blocked
from chunkscan.ops.gated_delta import chunk as chunk_module
from chunkscan.ops.gated_delta import gated_delta_rule


@pytest.fixture
def split_all(monkeypatch):
    """Every product with a batch axis is split (the tests' shapes are small)."""
    monkeypatch.setattr(_cpu_threads, "MIN_FLOPS", 0)
    calls = []
    real = mx.matmul

    def counted(a, b, *, stream=None):
        calls.append(stream)
        return real(a, b, stream=stream)

    monkeypatch.setattr(_cpu_threads.mx, "matmul", counted)
    return calls


SHAPES = [
    ((5, 3, 4), (5, 4, 6)),  # one batch axis
    ((2, 3, 1, 7, 8, 4), (2, 3, 5, 7, 4, 8)),  # a broadcast axis (key heads), as the op's
    ((1, 6, 4), (3, 1, 4, 2)),  # more batch axes on one side
    ((1, 4, 6, 6), (4, 1, 6, 6)),  # each side broadcast along the other's split axis
]


@pytest.mark.parametrize("threads", ["2", "3", "8"])
@pytest.mark.parametrize("shapes", SHAPES, ids=["batch", "broadcast", "ranks", "cross"])
def test_a_split_product_is_the_product_bit_for_bit(split_all, monkeypatch, shapes, threads):
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", threads)
    a = mx.random.normal(shapes[0], key=mx.random.key(1))
    b = mx.random.normal(shapes[1], key=mx.random.key(2))
    for x, y in ((a, b), (b.swapaxes(-1, -2), a.swapaxes(-1, -2))):  # transposed views
        got = _cpu_threads.matmul(x, y)
        assert mx.array_equal(got, x @ y).item()
    assert any(s is not None for s in split_all), "nothing was split"


def test_one_thread_and_small_products_are_not_split(split_all, monkeypatch):
    a, b = mx.ones((4, 8, 8)), mx.ones((4, 8, 8))
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "1")
    _cpu_threads.matmul(a, b)
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "2")
    _cpu_threads.matmul(mx.ones((1, 8, 8)), b[:1])  # no batch axis of two
    monkeypatch.setattr(_cpu_threads, "MIN_FLOPS", 2 * 4 * 8**3 + 1)
    _cpu_threads.matmul(a, b)
    assert split_all == []  # each an unsplit a @ b
    monkeypatch.setattr(_cpu_threads, "MIN_FLOPS", 0)
    _cpu_threads.matmul(a, b)
    assert len(split_all) == 2  # the control: two slices


@pytest.mark.parametrize("channel", [False, True], ids=["scalar-gate", "channel-gate"])
def test_the_op_is_bit_for_bit_the_one_thread_op(split_all, monkeypatch, channel):
    """Values and all six gradients of the op, every product split, equal the call on
    one thread (packed sequences, several groups)."""
    monkeypatch.setattr(chunk_module, "_GROUP_BYTES", 3 * 4 * 2 * 16 * 16 * 20)
    cu = [0, 9, 30, 61]
    inputs = make_inputs(1, 61, 2, 4, 16, 8, n_states=3, channel=channel)
    runs = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", threads)
        runs[threads] = outputs_and_grads(gated_delta_rule, inputs, chunk_size=8, cu_seqlens=cu)
    assert any(s is not None for s in split_all), "nothing was split"
    for a, b in zip(runs["1"], runs["2"]):
        assert mx.array_equal(a, b).item()


def test_a_forward_only_call_takes_the_setting_in_effect(monkeypatch):
    """A forward-only call runs its groups through ``mx.compile``, which reads the
    setting when it traces: one trace per function kept the process's first count (the
    products still split in two after ``CHUNKSCAN_CPU_THREADS=1``; found by probing).
    Each count now has its own trace."""
    monkeypatch.setattr(chunk_module, "_COMPILED", {})
    seen = []
    real = chunk_module.matmul

    def noted(a, b):
        seen.append(_cpu_threads.threads())
        return real(a, b)

    monkeypatch.setattr(chunk_module, "matmul", noted)
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 4, 16, 8)
    outs = {}
    for threads in ("2", "1", "2"):
        seen.clear()
        monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", threads)
        o, s = gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=8)
        mx.eval(o, s)
        outs.setdefault(threads, (o, s))
        if threads == "1":
            assert seen and set(seen) == {1}, seen  # traced anew, on one thread
    for a, b in zip(outs["1"], outs["2"]):
        assert mx.array_equal(a, b).item()


def test_the_setting(monkeypatch):
    """Read and checked at every product, split or not (a bad value passed small
    products silently, found by probing); at most ``LIMIT`` (1000 made 199 streams)."""
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", " 3 ")
    assert _cpu_threads.threads() == 3
    monkeypatch.delenv("CHUNKSCAN_CPU_THREADS")
    assert 1 <= _cpu_threads.threads() <= _cpu_threads.MAX_THREADS
    for bad, error in (
        ("0", "must be from 1 (one thread, no split) to 64 but is 0"),
        ("65", "must be from 1 (one thread, no split) to 64 but is 65"),
        ("two", "a whole number of threads"),
    ):
        monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", bad)
        with pytest.raises(ValueError, match=re.escape(error)):
            _cpu_threads.matmul(mx.ones((2, 2)), mx.ones((2, 2)))


def test_vectors_are_left_to_matmul(split_all, monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "2")
    a, b = mx.arange(4.0), mx.ones((3, 4, 6))
    assert mx.array_equal(_cpu_threads.matmul(a, b), a @ b).item()
    assert mx.array_equal(_cpu_threads.matmul(b.swapaxes(-1, -2), a), b.swapaxes(-1, -2) @ a)
    assert split_all == []


def _in_thread(fn):
    box = []
    worker = threading.Thread(target=lambda: box.append(fn()))
    worker.start()
    worker.join()
    return box[0]


@pytest.mark.parametrize("first", ["main", "worker"])
def test_every_python_thread_splits_with_streams_of_its_own(split_all, monkeypatch, first):
    """MLX's streams belong to the Python thread that made them: with one shared set,
    every thread but the first to split a product failed with ``There is no
    Stream(cpu, 1) in current thread`` (found by probing; the op at T = 256 in a worker
    thread after a call in the main one)."""
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "2")
    monkeypatch.setattr(_cpu_threads, "_LOCAL", threading.local())  # no streams yet
    a = mx.random.normal((4, 8, 8), key=mx.random.key(1))
    mx.eval(a)  # an array made lazily in one thread cannot be evaluated in another

    def product():
        out = _cpu_threads.matmul(a, a)
        mx.eval(out)
        return out

    order = [product, lambda: _in_thread(product)]
    results = [step() for step in (order if first == "main" else order[::-1])]
    assert all(mx.array_equal(r, a @ a).item() for r in results)
    assert sum(s is not None for s in split_all) == 4  # each thread: two slices


def test_past_the_stream_budget_a_thread_does_not_split(split_all, monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "2")
    monkeypatch.setattr(_cpu_threads, "_LOCAL", threading.local())
    monkeypatch.setattr(_cpu_threads, "MAX_STREAMS", _cpu_threads._MADE[0])
    a = mx.ones((4, 8, 8))
    assert mx.array_equal(_cpu_threads.matmul(a, a), a @ a).item()
    assert split_all == []


@pytest.mark.parametrize("mask", ["causal", None], ids=["causal", "none"])
def test_blocked_attention_is_bit_for_bit_the_one_thread_op(split_all, monkeypatch, mask):
    """Attention's blocked form (the CPU's beyond ``mx.fast``'s short calls), every
    product split: values and gradients equal the call on one thread."""
    monkeypatch.setattr(blocked, "FAST_MAX_SCORES", 0)
    q, k, v, ct = attention_inputs(2, 4, 2, 40, 40, 16)

    def run():
        def fn(q, k, v):
            return chunkscan.attention(q, k, v, scale=0.25, mask=mask, chunk_size=16)

        return mx.vjp(fn, [q, k, v], [ct])

    runs = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", threads)
        runs[threads] = run()
    assert any(s is not None for s in split_all), "nothing was split"
    flat = [[*o, *g] for o, g in runs.values()]
    assert all(mx.array_equal(a, b).item() for a, b in zip(*flat))


def test_the_default_and_the_size_of_a_product(split_all, monkeypatch):
    """Unset, the threads are the usable cores, at most MAX_THREADS; the batch axes count
    in a product's size; on a GPU nothing is split (each survived a mutation)."""
    import os

    monkeypatch.delenv("CHUNKSCAN_CPU_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert _cpu_threads._threads() == max(1, min(_cpu_threads.MAX_THREADS, cores))
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "2")
    per_matrix = 2 * 8**3  # 64 of them: above the floor only with the batch counted
    monkeypatch.setattr(_cpu_threads, "MIN_FLOPS", 32 * per_matrix)
    _cpu_threads.matmul(mx.ones((64, 8, 8)), mx.ones((64, 8, 8)))
    assert len(split_all) == 2
    split_all.clear()
    monkeypatch.setattr(_cpu_threads.mx, "default_device", lambda: mx.gpu)
    _cpu_threads.matmul(mx.ones((64, 8, 8)), mx.ones((64, 8, 8)))
    assert split_all == []
