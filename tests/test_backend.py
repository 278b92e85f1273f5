"""chunkscan._backend: the device limits the CUDA kernels' configurations follow."""

from __future__ import annotations

import ctypes
import re

import mlx.core as mx
import pytest

import chunkscan
from chunkscan import _backend, _compat
from chunkscan.ops.gated_delta import chunk as chunk_module


class FakeDriver:
    """Stands in for ``libcuda``: ``cuInit``, ``cuDeviceGet``, ``cuDeviceGetAttribute``
    with the values of ``attrs`` (a missing attribute fails, like an old driver)."""

    def __init__(self, attrs: dict[int, int], init: int = 0):
        self.attrs, self.init, self.asked = attrs, init, []

    def cuInit(self, flags):
        return self.init

    def cuDeviceGet(self, dev, index):
        ctypes.cast(dev, ctypes.POINTER(ctypes.c_int))[0] = index
        return 0 if index == 0 else 101  # CUDA_ERROR_INVALID_DEVICE

    def cuDeviceGetAttribute(self, value, attr, dev):
        self.asked.append(attr)
        if attr not in self.attrs:
            return 1
        ctypes.cast(value, ctypes.POINTER(ctypes.c_int))[0] = self.attrs[attr]
        return 0


A100 = {97: 163 * 1024, 81: 164 * 1024, 16: 108}


def test_driver_limits():
    lib = FakeDriver(A100)
    got = _backend._driver_limits(0, lib)
    assert got == _backend.CudaLimits(163 * 1024, 164 * 1024, 108, "driver")
    assert sorted(lib.asked) == [16, 81, 97]


@pytest.mark.parametrize(
    "lib, index",
    [(FakeDriver(A100, init=100), 0), (FakeDriver(A100), 1), (FakeDriver({97: 1, 81: 1}), 0),
     (FakeDriver({**A100, 97: 0}), 0), (object(), 0)],
    ids=["no device", "bad index", "attribute missing", "zero", "no such symbol"],
)  # fmt: skip
def test_driver_limits_none_where_the_driver_fails(lib, index):
    assert _backend._driver_limits(index, lib) is None


def test_limits_from_the_compute_capability():
    a100 = _backend._limits_from_device_info(
        {"compute_capability_major": 8, "compute_capability_minor": 0}
    )
    assert (a100.smem_per_block, a100.smem_per_sm) == (163 * 1024, 164 * 1024)
    assert a100.source == "compute capability 8.0"
    h100 = _backend._limits_from_device_info(
        {"compute_capability_major": "9", "compute_capability_minor": "0"}
    )
    assert h100.smem_per_block == 227 * 1024
    unknown = {"compute_capability_major": 7, "compute_capability_minor": 5}
    assert _backend._limits_from_device_info(unknown) is None
    assert _backend._limits_from_device_info({"device_name": "cpu"}) is None


def test_without_a_cuda_device_the_limits_are_an_h200s():
    if _backend.cuda_device():
        pytest.skip("a CUDA device is present")
    assert _backend.cuda_limits() == _backend._SM90


def test_cuda_limits_falls_back_in_order(monkeypatch):
    """Driver, then compute capability, then the smallest GPU; asked once per device."""
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    monkeypatch.setattr(_backend, "_LIMITS", {})
    calls = []
    monkeypatch.setattr(_backend, "_driver_limits", lambda i: calls.append(i) or None)
    monkeypatch.setattr(_backend, "_limits_from_device_info", lambda: None)
    assert _backend.cuda_limits() == _backend._SMALLEST
    assert _backend.cuda_limits() == _backend._SMALLEST
    assert calls == [_backend._device_index(mx.default_device())]  # cached
    monkeypatch.setattr(_backend, "_LIMITS", {})
    a100 = _backend.CudaLimits(163 * 1024, 164 * 1024, 132, "compute capability 8.0")
    monkeypatch.setattr(_backend, "_limits_from_device_info", lambda: a100)
    assert _backend.cuda_limits() == a100


def test_compute_capability_is_asked_once_per_cuda_device(monkeypatch):
    """On a CUDA device ``mx.device_info()`` (which also reads the free memory through
    NVML) is asked once per device; elsewhere, and for an ``info`` given, at each call."""
    calls = []

    def info():
        calls.append(1)
        return {"compute_capability_major": 9, "compute_capability_minor": 0}

    monkeypatch.setattr(mx, "device_info", info)
    monkeypatch.setattr(_backend, "_CAPABILITY", {})
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    assert _backend.compute_capability() == (9, 0)
    assert _backend.compute_capability() == (9, 0)
    assert len(calls) == 1
    given = {"compute_capability_major": 8, "compute_capability_minor": 6}
    assert _backend.compute_capability(given) == (8, 6)
    monkeypatch.setattr(_backend, "cuda_device", lambda: False)
    _backend.compute_capability()
    _backend.compute_capability()
    assert len(calls) == 3


def test_device_index():
    assert _backend._device_index(mx.Device(mx.gpu, 3)) == 3
    assert _backend._device_index(mx.Device(mx.cpu, 0)) == 0
    assert _backend._device_index("no index") == 0


@pytest.mark.skipif(not _backend.cuda_device(), reason="needs MLX with a CUDA GPU")
def test_cuda_limits_come_from_the_driver():
    """On a CUDA machine the limits are the driver's (not a table's guess)."""
    limits = _backend.cuda_limits()
    assert limits.source == "driver", limits
    assert limits.smem_per_block >= 48 * 1024 and limits.sm_count > 0


def test_integer_environment_variables_name_themselves_when_malformed(monkeypatch):
    """A tuning variable that is no int raises a message naming it and the op (before:
    a bare ``invalid literal for int()``)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_GROUP_MIB", " 256 ")
    assert _backend.env_int("CHUNKSCAN_GDN_GROUP_MIB", "op", "MiB") == 256
    monkeypatch.setenv("CHUNKSCAN_GDN_GROUP_MIB", "")
    assert _backend.env_int("CHUNKSCAN_GDN_GROUP_MIB", "op", "MiB") is None
    monkeypatch.setenv("CHUNKSCAN_GDN_GROUP_MIB", "1.5")
    q = mx.random.normal((1, 8, 2, 4))
    msg = ("[gated_delta_rule] the environment variable CHUNKSCAN_GDN_GROUP_MIB must be a "
           "whole number of MiB such as 1024 but is '1.5'.")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(msg)):
        chunkscan.gated_delta_rule(q, q, q, -mx.ones((1, 8, 2)), mx.ones((1, 8, 2)) / 2)
    for odd in ("1_0", "\u0661\u0660", "0x10"):  # int() read the first two as 10
        monkeypatch.setenv("CHUNKSCAN_GDN_GROUP_MIB", odd)
        with pytest.raises(ValueError, match="must be a whole number of MiB"):
            chunkscan.gated_delta_rule(q, q, q, -mx.ones((1, 8, 2)), mx.ones((1, 8, 2)) / 2)
    for bad in ("0", "-5"):  # before: one-chunk groups, silently
        monkeypatch.setenv("CHUNKSCAN_GDN_GROUP_MIB", bad)
        msg = f"GROUP_MIB must be at least 1 (MiB of one group's scratch) but is {bad}."
        with pytest.raises(ValueError, match=re.escape(msg)):
            chunkscan.gated_delta_rule(q, q, q, -mx.ones((1, 8, 2)), mx.ones((1, 8, 2)) / 2)


def test_switch_variables_reject_what_they_would_misread(monkeypatch):
    """``CHUNKSCAN_CUDA_KERNELS`` off only for ``0``: ``false`` or ``off`` used to keep
    the kernels on with no word, now they raise; ``CHUNKSCAN_GDN_SAVE`` is read
    stripped, as the integer variables are (``" groups"`` raised)."""
    for flag in (" 0", "0"):
        monkeypatch.setenv("CHUNKSCAN_CUDA_KERNELS", flag)
        assert _backend.use_kernels(None, "op") is False
        assert _backend.use_kernels(True, "op") is _backend.cuda_device()
    for flag in ("1", "auto", ""):
        monkeypatch.setenv("CHUNKSCAN_CUDA_KERNELS", flag)
        assert _backend.use_kernels(None, "op") is _backend.cuda_device()
    for flag in ("false", "off", "no"):
        monkeypatch.setenv("CHUNKSCAN_CUDA_KERNELS", flag)
        with pytest.raises(ValueError, match=re.escape("must be 0 (the portable MLX ops)")):
            _backend.use_kernels(None, "op")
    # on a CUDA device (faked: on the CPU every answer above is False either way, so
    # reading "auto" as off, or the variable beating kernels=True, passed; mutation)
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    for flag in ("1", "auto", ""):
        monkeypatch.setenv("CHUNKSCAN_CUDA_KERNELS", flag)
        assert _backend.use_kernels(None, "op") is True
    monkeypatch.setenv("CHUNKSCAN_CUDA_KERNELS", "0")
    assert _backend.use_kernels(None, "op") is False
    assert _backend.use_kernels(True, "op") is True  # the argument wins
    monkeypatch.delenv("CHUNKSCAN_CUDA_KERNELS")
    monkeypatch.setenv("CHUNKSCAN_GDN_SAVE", " groups ")
    assert chunk_module._saved_states() == "groups"


def test_settings_are_read_once_per_block(monkeypatch):
    """Inside ``settings_read_once`` (each call of the Gated DeltaNet op and of its
    backward) a variable keeps the value first read and the device kind the first
    answer; the next block reads both again; outside any block every read is fresh."""
    monkeypatch.setenv("CHUNKSCAN_TEST_SETTING", "a")
    kinds = iter([True, False, True])
    monkeypatch.setattr(_backend.mx.cuda, "is_available", lambda: next(kinds))
    monkeypatch.setattr(_backend.mx, "default_device", lambda: _backend.mx.gpu)
    with _backend.settings_read_once():
        assert _backend.getenv("CHUNKSCAN_TEST_SETTING") == "a"
        assert _backend.cuda_device() is True
        monkeypatch.setenv("CHUNKSCAN_TEST_SETTING", "b")
        with _backend.settings_read_once():  # nested: the outer block's reads
            assert _backend.getenv("CHUNKSCAN_TEST_SETTING") == "a"
        assert _backend.getenv("CHUNKSCAN_TEST_SETTING") == "a"
        assert _backend.getenv("CHUNKSCAN_TEST_UNSET", "x") == "x"
        assert _backend.cuda_device() is True
    assert _backend.getenv("CHUNKSCAN_TEST_SETTING") == "b"
    assert _backend.cuda_device() is False
    assert _backend.cuda_device() is True
    asked = []
    monkeypatch.setattr(_backend, "_device_index", lambda device: asked.append(device) or 1)
    with _backend.settings_read_once():
        assert _backend._default_index() == _backend._default_index() == 1
    assert _backend._default_index() == 1
    assert len(asked) == 2


def _reads_per_call(monkeypatch, step) -> dict:
    """How often one call of ``step`` read each chunkscan or MLX variable; asserts that
    the next call reads each again as often (nothing kept across calls)."""
    import collections
    import os

    reads = collections.Counter()
    real = os.environ.get

    def counted(name, default=None):
        reads[name] += 1
        return real(name, default)

    monkeypatch.setattr(_backend.os.environ, "get", counted)
    step()
    ours = {n: c for n, c in reads.items() if n.startswith(("CHUNKSCAN_", "MLX_"))}
    step()
    assert {n: reads[n] for n in ours} == {n: 2 * c for n, c in ours.items()}
    return ours


def test_gated_delta_rule_reads_its_settings_once_per_call(monkeypatch):
    """One fwd+bwd of the fused path (its kernels faked: lazy zeros, the graph is only
    built) reads each variable once: the backward takes what its forward read (before
    session 30 each block read them, twice in all; before settings_read_once, up to 33
    times each here: CHUNKSCAN_GDN_NT); the next call reads them again."""
    from helpers import fake_fused_kernels

    from chunkscan.ops.gated_delta import gated_delta_rule

    fake_fused_kernels(monkeypatch.setattr)
    q, k = mx.ones((1, 128, 1, 32)), mx.ones((1, 128, 1, 32))
    v, g, beta = mx.ones((1, 128, 2, 64)), -mx.ones((1, 128, 2)), mx.ones((1, 128, 2))

    def loss(q):
        return gated_delta_rule(q, k, v, g, beta, chunk_size=64)[0].sum()

    ours = _reads_per_call(monkeypatch, lambda: mx.value_and_grad(loss)(q))
    assert len(ours) >= 5 and max(ours.values()) == 1, ours


def test_attention_reads_its_settings_once_per_call(monkeypatch):
    """One fwd+bwd of the blocked attention (eight blocks, each product split across
    CPU streams where it is large enough) reads each variable once: the backward takes
    what its forward read (before session 30, once in each; before that, once per
    product, ``CHUNKSCAN_CPU_THREADS`` 56 times here); the next call reads them again."""
    import chunkscan
    from chunkscan.ops.attention import blocked

    monkeypatch.setattr(blocked, "FAST_MAX_SCORES", 0)
    q = mx.ones((1, 2, 64, 16))
    k = v = mx.ones((1, 1, 64, 16))

    def loss(q):
        return chunkscan.attention(q, k, v, scale=0.25, mask="causal", chunk_size=8).sum()

    ours = _reads_per_call(monkeypatch, lambda: mx.value_and_grad(loss)(q))
    assert "CHUNKSCAN_CPU_THREADS" in ours and max(ours.values()) == 1, ours


@pytest.mark.parametrize(
    "version, parsed",
    [
        ("0.32.4", (0, 32, 4)),
        ("0.32.10", (0, 32, 10)),
        ("0.32.3rc1", (0, 32, 2)),  # read as 0.32.31 before (found by probing)
        ("0.32.4rc1", (0, 32, 3)),  # a pre-release lacks what its release has
        ("0.33.0.dev20261201", (0, 32, 999)),
        ("0.32.4.post1", (0, 32, 4)),
        ("0.32.4-rc1", (0, 32, 3)),
        ("0.32.4.rc1", (0, 32, 3)),
        ("0.32.4c1", (0, 32, 3)),
        ("0.32.4pre1", (0, 32, 3)),
        ("v0.32.4", (0, 32, 4)),
        ("1!0.32.4", (0, 32, 4)),
        ("1.0", (1, 0, 0)),
    ],
)
def test_mlx_versions_are_read_as_releases(version, parsed, monkeypatch):
    assert _compat._parse(version) == parsed
    monkeypatch.setattr(mx, "__version__", version)
    if parsed < _compat.MIN_MLX:
        with pytest.raises(ImportError, match=re.escape(f"but found mlx {version}.")):
            _compat.check_mlx()
    else:
        _compat.check_mlx()


def test_the_kernels_constant_inputs_are_usable_from_another_thread():
    """The arrays every kernel launch takes (``UNUSED``, the packed-sequence index of an
    unpacked call) were lazy ops made at import or first use: MLX evaluates an array
    only in the thread whose stream made it, so a kernel call from a worker thread (a
    trainer thread) raised "There is no Stream(cpu, 0) in current thread" (found by
    probing, session 54). A fresh process, so that the main thread makes them first."""
    import subprocess
    import sys

    code = """
import threading
import mlx.core as mx
from chunkscan import _backend
from chunkscan.ops.gated_delta import _rows_cuda
_rows_cuda._sequence_of_tokens(None)  # made in the main thread, as at a first call
errors = []
def use():
    try:
        mx.eval(_backend.UNUSED + 0, _rows_cuda._sequence_of_tokens(None) + 0)
    except Exception as e:
        errors.append(repr(e))
t = threading.Thread(target=use)
t.start()
t.join()
print(errors or "ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr
