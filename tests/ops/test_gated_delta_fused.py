"""The fused chunk kernels of gated_delta_rule (``_chunk_cuda``).

Everywhere with a C++20 compiler, the kernels' CUDA sources run on the CPU through
``tools/cuda_emulate.py`` (every CUDA thread an OS thread, ``__syncthreads`` a
barrier), inside the real op with the portable state passes: values and all six
gradients against the per-step float32 oracle. The bound, 1e-4 max relative error, is
about 13x the worst measured: the emulated kernels measured 1.5e-7 to 1.3e-6 at these
shapes with Dk <= 64 and up to 7.9e-6 (dg) at Qwen3-Next's Dk = Dv = 128 (the portable
path: 1.6e-7 to 1.3e-6, and 7.8e-6 for that dg: the size of the sums, not the kernels;
test_gated_delta.py's shapes, Dk <= 16, take 1e-5), so an
indexing or math slip fails by orders of magnitude (a gate sum off by one step gave
0.07 to 0.3). On a CUDA device the
compiled kernels run the same checks, with MLX_ENABLE_TF32=0 as every float32 test on
CUDA (``bash bench/h200_suite.sh fused``; outputs in bench/results/h200/).
"""

from __future__ import annotations

import math
import shutil
import warnings

import mlx.core as mx
import pytest
from helpers import (
    cuda_emulator,
    emulate_kernels,
    fake_cuda_limits,
    fake_fused_kernels,
    max_rel,
    spoil_token,
)
from helpers import gated_delta_inputs as make_inputs
from helpers import gdn_low_precision_pair as low_precision_pair
from helpers import gdn_outputs_and_grads as outputs_and_grads

from chunkscan import _backend
from chunkscan.ops.gated_delta import _chunk_cuda, gated_delta_rule
from chunkscan.ops.gated_delta import chunk as chunk_module
from chunkscan.ops.gated_delta import naive_recurrent_gated_delta_rule as naive
from chunkscan.ops.gated_delta._checks import Spec

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture
def emulated(monkeypatch):
    """The op with the fused kernels run by the emulator (the state passes portable:
    pass ``kernels=False``), wherever ``supports`` holds."""
    monkeypatch.setattr(_backend, "RUNNER", cuda_emulator().run)
    monkeypatch.setattr(
        chunk_module, "_fused", lambda spec, C, kernels, strict=False: _chunk_cuda.supports(
            C, spec.Dk, spec.Dv, spec.channel, strict=strict)
    )  # fmt: skip
    calls = []
    real = _chunk_cuda._launch

    def counted(which, *args, **kwargs):
        calls.append(which)
        return real(which, *args, **kwargs)

    monkeypatch.setattr(_chunk_cuda, "_launch", counted)
    return calls


def assert_close(got, ref, tol=1e-4):
    errors = {n: max_rel(a, b) for n, a, b in zip(NAMES, got, ref)}
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"max relative error above {tol}: {bad}"


def test_supports():
    assert _chunk_cuda.supports(64, 128, 128, False)
    assert _chunk_cuda.supports(32, 32, 96, False)
    assert not _chunk_cuda.supports(64, 128, 128, True)  # per-channel gates
    assert not _chunk_cuda.supports(128, 128, 128, False)  # chunk size
    assert not _chunk_cuda.supports(64, 256, 128, False)  # head size
    assert not _chunk_cuda.supports(64, 48, 128, False)  # not a multiple of 32
    assert _chunk_cuda.supports(64, 128, 128, False, lanes=65535)
    assert not _chunk_cuda.supports(64, 128, 128, False, lanes=65536)  # grid y limit


def test_dispatch():
    spec = Spec(1, 100, 1, 2, 128, 128, 0.1, 64, None)
    assert chunk_module._fused(spec, 64, True)
    assert not chunk_module._fused(spec, 64, False)
    assert not chunk_module._fused(spec, 128, True)
    channel = Spec(1, 100, 1, 2, 128, 128, 0.1, 64, None, channel=True)
    assert not chunk_module._fused(channel, 64, True)
    wide = Spec(4096, 100, 1, 32, 128, 128, 0.1, 64, None)  # 131072 lanes
    assert not chunk_module._fused(wide, 64, True)


def test_scratch_sizes_the_groups():
    spec = Spec(1, 4096, 16, 32, 128, 128, 0.1, 64, None)
    per_chunk = 4 * 32 * _chunk_cuda.scratch_floats(64, 128, 128)
    assert chunk_module._group_size(spec, 64, 10 * per_chunk, fused=True) == 10


def test_default_group_budget():
    """64 MiB on the CPU; on a CUDA GPU 1/8 of its memory, 1 to 16 GiB (run 91: one
    group at T = 65536 on the H200 ran the op in 31.5 ms compiled / 33.0 eager against
    35.7 / 37.8 with four, 6-28% more peak); 1 GiB where the memory is unknown (and on
    Apple GPUs)."""
    if HAS_CUDA:  # MLX reports the device's memory (total_memory), so the budget scales
        total = _backend.cuda_memory_bytes()
        assert total is not None and total > 1 << 30
        assert chunk_module._default_group_bytes() == chunk_module._gpu_group_bytes(total)
    else:
        assert chunk_module._default_group_bytes() == 64 << 20
        assert _backend.cuda_memory_bytes() is None
    gib = 1 << 30
    assert chunk_module._gpu_group_bytes(141 * 10**9) == 16 * gib  # an H200
    assert chunk_module._gpu_group_bytes(80 * gib) == 10 * gib
    assert chunk_module._gpu_group_bytes(24 * gib) == 3 * gib
    assert chunk_module._gpu_group_bytes(6 * gib) == gib
    assert chunk_module._gpu_group_bytes(None) == gib
    assert _backend.cuda_memory_bytes({"total_memory": 5}) == 5
    assert _backend.cuda_memory_bytes({"memory_size": 7, "architecture": "x"}) == 7
    assert _backend.cuda_memory_bytes({"device_name": "x"}) is None


def group_arrays(B, n, C, Hk, Hv, Dk, Dv, seed):
    """One group's raw inputs in the chunk layout (``q, k, v, g, beta``), the states
    entering its chunks and the cotangents of those leaving them (``[B Hv, n, Dv, Dk]``),
    an output cotangent and no non-finite rows."""
    keys = mx.random.split(mx.random.key(seed), 7)
    q = 0.3 * mx.random.normal((B, n, C, Hk, Dk), key=keys[0])
    k = 0.3 * mx.random.normal((B, n, C, Hk, Dk), key=keys[1])
    v = mx.random.normal((B, n, C, Hv, Dv), key=keys[2])
    g = -0.3 * mx.random.uniform(shape=(B, n, C, Hv), key=keys[3])
    beta = mx.random.uniform(shape=(B, n, C, Hv), key=keys[4])
    S = 0.1 * mx.random.normal((B * Hv, n, Dv, Dk), key=keys[5])
    dS = 0.1 * mx.random.normal((B * Hv, n, Dv, Dk), key=keys[6])
    d_o = mx.random.normal((B, n, C, Hv, Dv), key=keys[0])
    o_bad = mx.zeros((B, n, C, Hv), dtype=mx.bool_)
    return q, k, v, g, beta, S, dS, d_o, o_bad


@needs_cxx
def test_emulated_stages_match_the_batched_ops(emulated):
    """Each kernel against the batched MLX function it replaces, one group of two
    chunks (measured max relative differences 6.8e-8 to 4.1e-7; bound 1e-5): a failure
    names the stage. The scale is not the default (the kernels compile it in: a kernel
    built for another scale would fail here), and ``prepare`` without ``a`` (the
    forward's) gives the same other outputs bit for bit."""
    from types import SimpleNamespace

    B, n, C, Hk, Hv, Dk, Dv = 1, 2, 32, 1, 2, 32, 64
    G, L = Hv // Hk, B * Hv
    q, k, v, g, beta, S, dS, d_o, o_bad = group_arrays(B, n, C, Hk, Hv, Dk, Dv, seed=0)
    scale = 0.7 * Dk**-0.5
    ref = chunk_module._prepare_arrays(q, k, v, g, beta, scale)
    pr = SimpleNamespace(**ref, scale=scale)

    def heads(x):  # [B, Hk, 1 or G, ...] -> [L, ...]
        x = mx.broadcast_to(x, (B, Hk, G) + tuple(x.shape[3:]))
        return x.reshape((L,) + tuple(x.shape[3:]))

    def per_head(x):  # [L, ...] -> [B, Hk, G, ...]
        return x.reshape((B, Hk, G) + tuple(x.shape[1:]))

    p = _chunk_cuda.prepare(q, k, v, g, beta, scale)
    p_fwd = _chunk_cuda.prepare(q, k, v, g, beta, scale, with_a=False)
    assert p_fwd.a is None
    for key in ("p", "w", "u", "kt", "decay"):
        assert mx.array_equal(getattr(p_fwd, key), getattr(p, key)).item(), key
    d_o6 = d_o.reshape(B, n, C, Hk, G, Dv).transpose(0, 3, 4, 1, 2, 5)
    sg = _chunk_cuda.state_gradients(p, S, dS, d_o, o_bad, v)
    got = {
        "a": p.a, "p": p.p, "w": p.w, "u": p.u, "kt": p.kt, "decay": p.decay,
        "o": _chunk_cuda.outputs(q, g, p, S, o_bad, mx.float32),
        "h": _chunk_cuda.state_gradient_input(q, g, p, d_o, o_bad),
        **dict(zip(("dq", "dk", "dv", "dg", "dbeta"),
                   _chunk_cuda.input_gradients((q, k, v, g, beta), p, sg))),
    }  # fmt: skip
    want = {key: heads(ref[key]) for key in ("a", "p", "w", "u", "kt", "decay")}
    want["o"] = chunk_module._group_outputs_arrays(pr.qg, pr.p, pr.u, pr.w, per_head(S), o_bad)
    want["h"] = heads(d_o6.swapaxes(-1, -2) @ (pr.qg - pr.p @ pr.w))
    grads = chunk_module._group_backward_arrays(ref, [q, k, v, g, beta], per_head(S),
                                                per_head(dS), d_o6, scale)  # fmt: skip
    want.update(zip(("dq", "dk", "dv", "dg", "dbeta"), grads))
    errors = {key: max_rel(got[key], want[key]) for key in want}
    assert all(e <= 1e-5 for e in errors.values()), errors


@needs_cxx
@pytest.mark.parametrize("tv", [None, "32"], ids=["one-slice", "two-slices"])
def test_emulated_input_grads_reads_only_the_causal_part_of_d_p(emulated, monkeypatch, tv):
    """``state_grads``' tensor-core form writes ``d_p`` (``d_o v_new^T``, ``[C, C]``) in
    full; ``input_grads`` uses its causal part only (``t <= i``, where it is read). With
    NaN above the diagonal (in every partial sum: one slice of Dv, copied; two, added
    as they load) its gradients are bit for bit those of the causal part alone. Without
    that mask the NaN reaches them (``gam``, zero above the diagonal, does not stop it:
    0 NaN is NaN)."""
    from types import SimpleNamespace

    if tv is not None:
        monkeypatch.setenv("CHUNKSCAN_GDN_TV", tv)
    B, n, C, Hk, Hv, Dk, Dv = 1, 2, 32, 1, 1, 32, 64
    q, k, v, g, beta, S, dS, d_o, o_bad = group_arrays(B, n, C, Hk, Hv, Dk, Dv, seed=1)
    xs = (q, k, v, g, beta)
    p = _chunk_cuda.prepare(*xs, Dk**-0.5)
    sg = _chunk_cuda.state_gradients(p, S, dS, d_o, o_bad, v)
    assert sg.nv == (1 if tv is None else 2)
    upper = mx.arange(C)[None, :] > mx.arange(C)[:, None]
    causal = vars(sg) | {"dp": mx.where(upper, 0.0, sg.dp)}
    spoilt = vars(sg) | {"dp": mx.where(upper, math.nan, sg.dp)}
    want = _chunk_cuda.input_gradients(xs, p, SimpleNamespace(**causal))
    got = _chunk_cuda.input_gradients(xs, p, SimpleNamespace(**spoilt))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert mx.array_equal(a, b).item(), name


# (B, T, Hk, Hv, Dk, Dv, C, h0): T not a multiple of C, Hv = 2 Hk and 4 Hk, Dk != Dv,
# two slices of Dv (Dv = 128), B = 2, no initial state.
CASES = [
    (1, 100, 1, 2, 32, 64, 32, True),
    (2, 64, 2, 2, 64, 32, 64, False),
    (1, 70, 1, 4, 32, 128, 32, True),
    (1, 100, 1, 1, 128, 128, 64, True),  # Qwen3-Next's heads: every product's real tiling
    (1, 40, 1, 1, 128, 128, 32, False),  # the same at C = 32
]


# The emulator lands a cp.async copy at its group's wait (a read before the wait fails);
# the Qwen3-Next cases also run with copies landing at issue (a copy issued before the
# barrier that ends the other threads' reads of its buffer fails there: found by review).
ORACLE_RUNS = [(c, "at wait") for c in CASES] + [(c, "at issue") for c in CASES[3:]]


@needs_cxx
@pytest.mark.parametrize(
    "case, landing", ORACLE_RUNS,
    ids=[f"T{c[1]}-G{c[3] // c[2]}-Dv{c[5]}-{w.replace(' ', '-')}" for c, w in ORACLE_RUNS],
)  # fmt: skip
def test_emulated_matches_oracle(emulated, monkeypatch, case, landing):
    emu = cuda_emulator()  # a module of its own: the fixture's runner replaced
    monkeypatch.setattr(emu, "COPIES_LAND", landing)
    monkeypatch.setattr(_backend, "RUNNER", emu.run)
    B, T, Hk, Hv, Dk, Dv, C, with_h0 = case
    inputs = make_inputs(B, T, Hk, Hv, Dk, Dv)
    if not with_h0:
        inputs = inputs[:5]
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=C, kernels=False)
    assert set(emulated) == set(_chunk_cuda._KERNELS)  # every kernel ran
    assert_close(got, outputs_and_grads(naive, inputs))


@needs_cxx
def test_emulated_saving_group_states(emulated, monkeypatch):
    """The fused kernels with ``chunk._SAVE = "groups"`` (the backward recomputes the
    states entering each group's chunks), one chunk per group, packed sequences."""
    monkeypatch.setattr(chunk_module, "_SAVE", "groups")
    monkeypatch.setattr(chunk_module, "_GROUP_BYTES", 1)
    cu = [0, 30, 70, 100]
    inputs = make_inputs(1, 100, 1, 2, 32, 64, n_states=3)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, kernels=False, cu_seqlens=cu)
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs, cu_seqlens=cu))


@needs_cxx
def test_emulated_backward_reuses_the_last_groups_preparation(emulated, monkeypatch):
    """With ``save_states="chunks"`` the backward takes the last group's preparation from
    the forward instead of launching ``prepare`` again: one launch fewer, and every
    value and gradient exactly those of the recomputing backward (the same kernel on
    the same inputs). ``"groups"`` keeps nothing more; nor does the switch, off."""
    monkeypatch.setattr(chunk_module, "_GROUP_BYTES", 1)  # one chunk per group: 4 groups
    inputs = make_inputs(1, 100, 1, 2, 32, 64)
    runs, prepares = {}, {}
    for keep, save in ((True, "chunks"), (False, "chunks"), (True, "groups")):
        monkeypatch.setattr(chunk_module, "_KEEP_PREPARED", keep)
        emulated.clear()
        runs[keep, save] = outputs_and_grads(
            gated_delta_rule, inputs, chunk_size=32, kernels=False, save_states=save
        )
        prepares[keep, save] = emulated.count("prepare")
    assert prepares == {(True, "chunks"): 7, (False, "chunks"): 8, (True, "groups"): 8}
    for key in ((False, "chunks"), (True, "groups")):
        for name, a, b in zip(NAMES, runs[True, "chunks"], runs[key]):
            assert mx.array_equal(a, b).item(), (key, name)
    assert_close(runs[True, "chunks"], outputs_and_grads(naive, inputs))


def test_keep_prepared_switch_is_checked(monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_GDN_KEEP_PREPARED", "0")
    assert chunk_module._keep_last_preparation() is False
    monkeypatch.delenv("CHUNKSCAN_GDN_KEEP_PREPARED")
    assert chunk_module._keep_last_preparation() is True
    monkeypatch.setenv("CHUNKSCAN_GDN_KEEP_PREPARED", "yes")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_KEEP_PREPARED must be"):
        chunk_module._keep_last_preparation()


@needs_cxx
@pytest.mark.parametrize("nt, tv", [(256, 32), (512, 64)])
def test_emulated_tuning_knobs(emulated, monkeypatch, nt, tv):
    """Every kernel with 256 and with 512 threads per block, and ``state_grads`` with 32
    and 64 columns of Dv (CHUNKSCAN_GDN_NT / _TV; the defaults mix them), at C = 64 (the
    triangular inverse's two doubling levels) against the oracle. But ``input_grads``:
    with float32 products (the emulator's) its loop over the value heads does not fit
    512 threads' registers, so it keeps 256 (the TF32 tests below run it with 512)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_NT", str(nt))
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", str(tv))
    assert all(_chunk_cuda.threads(w, 64) == nt for w in _chunk_cuda._KERNELS)
    assert _chunk_cuda.threads("input_grads", 64, 32, 64) == 256
    assert _chunk_cuda.slice_columns(64) == tv
    inputs = make_inputs(1, 70, 1, 2, 32, 64)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs))


# Opt-in shared memory per block: an H100 / H200, an A100, consumer GPUs (sm_86/89/120).
# Since output's blocks take TV columns each (101.0 KiB at C = 64, 42.5 at C = 32 with 32
# columns), C = 32 fits the 99 KiB devices too.
DEVICES = {227: {64: True, 32: True}, 163: {64: False, 32: True}, 99: {64: False, 32: True}}


@pytest.mark.parametrize("kib", DEVICES, ids=[f"{k}KiB" for k in DEVICES])
def test_supports_follows_the_device_shared_memory(monkeypatch, kib):
    """The kernels are taken only where every one fits the device's shared memory per
    block (a launch would fail otherwise); where they do not, the batched ops run."""
    fake_cuda_limits(monkeypatch, kib)
    for C, fits in DEVICES[kib].items():
        assert _chunk_cuda.supports(C, 128, 128, False) == fits, C
        tv = _chunk_cuda.slice_columns(128, C, 128)
        sizes = [_chunk_cuda.smem_bytes(w, C, 128, 128, _chunk_cuda.threads(w, C, 128, 128), tv)
                 for w in _chunk_cuda._KERNELS]  # fmt: skip
        assert (max(sizes) <= kib * 1024) == fits, (C, sizes)
    assert _chunk_cuda.supports(32, 64, 64, False)  # smaller heads fit everywhere


def test_defaults_shrink_to_fit_the_device(monkeypatch):
    """The H200's choices: at C = 64 all 128 columns of Dv in one output / state_grads
    block, state_grads with 512 threads (219.25 KiB, its pieces of Dk 64 columns wide;
    187.25 with pieces of 32), output with 256 in two steps of 64 columns (101 KiB: two
    blocks a multiprocessor), 64 columns at C = 32, 512 threads for input_grads at C = 64
    (256 at C = 32, heads of 96 and with float32 products, where its loop over the value
    heads needs more registers: _loop_fits_512), 256 for the rest; where they would not
    fit, pieces of 32, 64 columns, then 32, and 256 threads."""
    fake_cuda_limits(monkeypatch, 227)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")  # TF32 products, as on a CUDA GPU
    assert _chunk_cuda.slice_columns(128, 64, 128) == 128
    assert _chunk_cuda.slice_columns(128, 32, 128) == 64
    assert _chunk_cuda.slice_columns(64, 64, 64) == 64  # one slice of 64: the same NV
    assert _chunk_cuda.slice_columns(128) == 64  # without C and Dk: TV
    for which, nt in (("output", 256), ("state_grads", 512), ("prepare", 256),
                      ("input_grads", 512)):  # fmt: skip
        assert _chunk_cuda.threads(which, 64, 128, 128) == nt, which
    assert _chunk_cuda.output_step_columns(128) == 64
    assert _chunk_cuda.smem_bytes("output", 64, 128, 128) == 101 * 1024
    assert _chunk_cuda.output_step_columns(32) == 32  # a narrower block: one step
    assert _chunk_cuda.threads("state_grads", 32, 128, 128) == 256
    assert _chunk_cuda.threads("input_grads", 32, 128, 128) == 256  # registers (below)
    assert _chunk_cuda.threads("input_grads", 64, 96, 96) == 256
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "64")  # two slices of Dv: 166 registers at 512
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 256
    monkeypatch.setenv("CHUNKSCAN_GDN_NT", "512")  # forced, it still keeps 256 there
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 256
    assert _chunk_cuda.threads("state_grads", 64, 128, 128) == 512
    monkeypatch.delenv("CHUNKSCAN_GDN_TV")
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 512
    monkeypatch.delenv("CHUNKSCAN_GDN_NT")
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "0")
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 256
    assert _chunk_cuda.threads("state_grads", 64, 128, 128) == 512  # input_grads alone
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    # state_grads' pieces of Dk: 64 columns in a wide block (219.25 KiB), else 32
    assert _chunk_cuda.piece_columns(64, 128, 128, 128, 512) == 64
    assert _chunk_cuda.smem_bytes("state_grads", 64, 128, 128) == 219.25 * 1024
    assert _chunk_cuda.piece_columns(64, 96, 128, 128, 512) == 32  # 64 does not divide 96
    assert _chunk_cuda.piece_columns(64, 128, 128, 64, 256) == 32
    fake_cuda_limits(monkeypatch, 219)  # still one slice, in pieces of 32 (187.25 KiB)
    assert _chunk_cuda.slice_columns(128, 64, 128) == 128
    assert _chunk_cuda.piece_columns(64, 128, 128, 128, 512) == 32
    assert _chunk_cuda.smem_bytes("state_grads", 64, 128, 128) == 187.25 * 1024
    fake_cuda_limits(monkeypatch, 187)  # an A100's 163 KiB and below: 64 columns
    assert _chunk_cuda.slice_columns(128, 64, 128) == 64
    assert _chunk_cuda.threads("state_grads", 64, 128, 128) == 256
    fake_cuda_limits(monkeypatch, 104)  # C=64: state_grads 104.25 KiB with 64 columns
    assert _chunk_cuda.slice_columns(128, 64, 128) == 32
    assert _chunk_cuda.slice_columns(128, 32, 128) == 64  # 57.6 KiB
    assert _chunk_cuda.supports(32, 128, 128, False)
    fake_cuda_limits(monkeypatch, 227)
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 512
    fake_cuda_limits(monkeypatch, 224)  # input_grads: 224.25 KiB with 512 threads, 223.25 with 256
    assert _chunk_cuda.threads("input_grads", 64, 128, 128) == 256


def test_layout_answers_follow_each_calls_settings(monkeypatch):
    """The layout functions keep their answers per settings and device limits
    (``_chunk_cuda._planned``; the limits: the test above): a variable's new value
    counts from the next call (within one call's settings block the first read holds),
    and an invalid value raises at every call, not only the first."""
    from chunkscan import _backend

    monkeypatch.delenv("CHUNKSCAN_GDN_TV", raising=False)
    assert _chunk_cuda.slice_columns(128, 64, 128) == 128
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "64")
    assert _chunk_cuda.slice_columns(128, 64, 128) == 64
    with _backend.settings_read_once():
        assert _chunk_cuda.slice_columns(128, 64, 128) == 64
        monkeypatch.setenv("CHUNKSCAN_GDN_TV", "32")
        assert _chunk_cuda.slice_columns(128, 64, 128) == 64
    assert _chunk_cuda.slice_columns(128, 64, 128) == 32
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "48")
    fix = "but is 48. Set it to one of those, or unset it"  # (the fix was missing; probing)
    message = f"variable CHUNKSCAN_GDN_TV must be 32, 64 or 128 {fix}"
    for _ in range(2):
        with pytest.raises(ValueError, match=message):
            _chunk_cuda.slice_columns(128, 64, 128)
    monkeypatch.delenv("CHUNKSCAN_GDN_TV")
    for name, bad, call in (
        ("CHUNKSCAN_GDN_NT", "300", lambda: _chunk_cuda.threads("prepare", 64)),
        ("CHUNKSCAN_GDN_OUT_TH", "48", lambda: _chunk_cuda.output_step_columns(128)),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"variable {name} must be .* but is {bad}. Set it"):
            call()
        monkeypatch.delenv(name)


def test_a_forced_width_that_does_not_fit_raises(monkeypatch):
    """``CHUNKSCAN_GDN_TV=128`` on a GPU of 99 KiB a block: the blocks of that width do
    not fit, and the fused kernels were off (and the default chunk size 128, not 32)
    without a word (found by probing); it raises where the default width fits, names
    the default, and leaves sizes that no width fits alone."""
    from chunkscan.ops.gated_delta import _passes

    fake_cuda_limits(monkeypatch, 99)
    monkeypatch.setattr(_passes, "cuda_device", lambda: True)
    monkeypatch.setattr(_passes, "use_kernels", lambda kernels=None, fn="": kernels is not False)
    monkeypatch.delenv("CHUNKSCAN_GDN_TV", raising=False)
    assert chunk_module.default_chunk_size(None, 128, 128) == 32
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "32")
    assert _chunk_cuda.supports(32, 128, 128, False)
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "128")
    assert not _chunk_cuda.supports(64, 128, 128, False)  # no width fits at 64 here
    message = r"CHUNKSCAN_GDN_TV=128 gives blocks .* unset it for the default \(64 here\)"
    with pytest.raises(ValueError, match=message):
        _chunk_cuda.supports(32, 128, 128, False, strict=True)
    with pytest.raises(ValueError, match=message):
        chunk_module.default_chunk_size(None, 128, 128)
    # sizes only looked at (not asked for) do not raise: a call at chunk_size=16 or 128
    # (the batched ops, where the width does nothing) raised from the look for a better
    # size to name in its warning (found by review)
    assert not _chunk_cuda.supports(32, 128, 128, False)

    def spec(C):
        return Spec(1, 40, 1, 2, 128, 128, 1.0, C, None)

    with pytest.raises(ValueError, match=message):
        chunk_module._fused_sizes(spec(32), True)  # the size a call asks for
    monkeypatch.setattr(chunk_module, "_WARNED_SIZES", set())
    for C in (16, 128):
        assert chunk_module._fused_sizes(spec(C), True) == ()
        chunk_module._warn_on_a_size_the_kernels_skip(spec(C))  # no better size: quiet


@pytest.mark.parametrize("kib, default", [(227, 64), (163, 32), (99, 32), (80, 128)])
def test_default_chunk_size_follows_the_device(monkeypatch, kib, default):
    """On CUDA the default chunk size is the largest the fused kernels take (64, then
    32), else 128 (the batched ops, as with the kernels off)."""
    from chunkscan.ops.gated_delta import _passes

    fake_cuda_limits(monkeypatch, kib)
    monkeypatch.setattr(_passes, "cuda_device", lambda: True)
    monkeypatch.setattr(_passes, "use_kernels", lambda kernels=None, fn="": kernels is not False)
    assert chunk_module.default_chunk_size() == default
    assert chunk_module.default_chunk_size(None, 128, 128) == default
    assert chunk_module.default_chunk_size(False) == 128
    if kib == 80:  # smaller heads still fit at C = 32
        assert chunk_module.default_chunk_size(None, 64, 64) == 32
    # heads of a few key channels (the kernels take Dk >= 32): at most 4 Dk
    assert chunk_module.default_chunk_size(False, 16, 16) == 64
    assert chunk_module.default_chunk_size(None, 4, 64) == 16


def test_a_chunk_size_the_kernels_skip_warns_once(monkeypatch):
    """An explicit ``chunk_size=64`` where the GPU's shared memory takes only 32 (an
    A100 at heads of 64) ran the batched MLX ops, several times slower, with no word
    (found by the emulator probe). It now warns once per size and heads, naming the
    size to pass; a size the kernels take, or the default, does not warn."""
    fake_cuda_limits(monkeypatch, 163)
    fake_fused_kernels(monkeypatch.setattr)
    monkeypatch.setattr(chunk_module, "_WARNED_SIZES", set())
    inputs = make_inputs(1, 64, 1, 2, 64, 64)

    def call(**kw):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            mx.eval(gated_delta_rule(*inputs[:5], **kw))
        return [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]

    msg = call(chunk_size=64)
    assert len(msg) == 1 and "chunk_size=64 is not a size the fused CUDA kernels take" in msg[0]
    assert "Pass chunk_size=32" in msg[0] and "163 KiB" in msg[0]
    assert call(chunk_size=64) == []  # once
    assert call(chunk_size=32) == [] and call() == []
    fake_cuda_limits(monkeypatch, 227)  # an H100 / H200 takes 64
    monkeypatch.setattr(chunk_module, "_WARNED_SIZES", set())
    assert call(chunk_size=64) == []


def test_tuning_knobs_reject_other_values(monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_GDN_NT", "128")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_NT must be 256 or 512"):
        _chunk_cuda.threads("prepare", 64)
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "16")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_TV must be 32, 64 or 128"):
        _chunk_cuda.slice_columns(128)
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "64")
    assert _chunk_cuda.slice_columns(96) == 32  # 64 does not divide Dv


@needs_cxx
@pytest.mark.parametrize(
    "tf32, nt", [("0", None), ("1", None), ("1", "512")],
    ids=["float32-products", "tf32-products", "tf32-products-512-threads"],
)  # fmt: skip
def test_emulated_one_slice_of_128_columns(emulated, monkeypatch, tf32, nt):
    """``output`` and ``state_grads`` with all 128 columns of Dv in one block
    (CHUNKSCAN_GDN_TV=128, a tuning value: ``input_grads`` then reads one partial sum,
    not two) against the oracle, float32 and tf32 products, and with 512 threads per
    block (CHUNKSCAN_GDN_NT=512: 16 warps for state_grads' one block per multiprocessor)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "128")
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", tf32)
    if nt is not None:
        monkeypatch.setenv("CHUNKSCAN_GDN_NT", nt)
    assert _chunk_cuda.slice_columns(128) == 128 and _chunk_cuda.slice_columns(64) == 32
    inputs = make_inputs(1, 70, 1, 2, 32, 128)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs), tol=TF32_TOL if tf32 == "1" else 1e-4)


def check_output_steps(monkeypatch, th: str, **kw) -> None:
    """``output`` and its state-gradient input with a block's 128 columns of Dv in steps
    of ``th`` (CHUNKSCAN_GDN_OUT_TH; the default is two of 64): 32 gives four steps, each
    reloading S's rows, u's and d_o's columns; 128 one step with 512 threads (the kernel
    before it took steps). Against the oracle, tf32 products."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "128")
    monkeypatch.setenv("CHUNKSCAN_GDN_OUT_TH", th)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    assert _chunk_cuda.output_step_columns(128) == int(th)
    assert _chunk_cuda.threads("output", 64, tv=128) == (512 if th == "128" else 256)
    inputs = make_inputs(1, 70, 1, 2, 32, 128)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, **kw)
    assert_close(got, outputs_and_grads(naive, inputs), tol=TF32_TOL)


@needs_cxx
@pytest.mark.parametrize("th", ["32", "128"])
def test_emulated_output_steps(emulated, monkeypatch, th):
    check_output_steps(monkeypatch, th, kernels=False)
    assert set(emulated) == set(_chunk_cuda._KERNELS)


def test_output_steps_knob_is_checked(monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_GDN_OUT_TH", "48")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_OUT_TH must be 32, 64 or 128"):
        _chunk_cuda.output_step_columns(128)


@needs_cxx
def test_emulated_with_every_kernel(monkeypatch):
    """The whole op as it runs on CUDA, every kernel emulated: the fused chunk kernels
    and the state-pass kernel (``kernels=None``, the dispatch of a CUDA device; the
    forward state pass on tensor cores and the reverse one on FMAs, ``input_grads``
    with its q / k products on tensor cores: the defaults), and the three small kernels
    of ``_rows_cuda`` (the non-finite rows, their reach along each sequence, dq and dk
    summed over the value heads)."""
    from chunkscan.ops.gated_delta import _passes

    emu, names = emulate_kernels(monkeypatch)
    monkeypatch.setattr(_passes, "use_kernels", lambda kernels=None, fn="": kernels is not False)
    cu = [0, 45, 100]
    inputs = make_inputs(1, 100, 1, 2, 32, 64, n_states=2)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, cu_seqlens=cu)
    passes = {"chunkscan_state_pass_tc", "chunkscan_state_pass"}
    tc = _chunk_cuda._TC_KERNELS  # their q / k products on tensor cores, the default
    small = {"chunkscan_gdn_non_finite_rows", "chunkscan_gdn_non_finite_reach"}
    assert set(names) == passes | small | {
        f"chunkscan_gdn_{w}" + ("_tc" if w in tc else "") for w in _chunk_cuda._KERNELS
    }
    assert_close(got, outputs_and_grads(naive, inputs, cu_seqlens=cu))
    # Every input a caller can hand the kernels (MLX passes views as they are), one
    # element past a 16-byte boundary in every kernel that reads it: bitwise the same.
    # The state passes' loads of the initial states faulted there (session 35).
    monkeypatch.setattr(emu, "ODD_INPUTS", frozenset({"q", "k", "v", "g", "beta", "dout",
                                                      "inits", "obad"}))  # fmt: skip
    odd = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, cu_seqlens=cu)
    for name, a, b in zip(NAMES, got, odd):
        assert mx.array_equal(a, b).item(), name


@needs_cxx
def test_emulated_packed_sequences(emulated):
    cu = [0, 30, 100, 101]
    inputs = make_inputs(1, 101, 1, 2, 32, 32, n_states=3)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, cu_seqlens=cu,
                            kernels=False)  # fmt: skip
    assert emulated
    assert_close(got, outputs_and_grads(naive, inputs, cu_seqlens=cu))


@needs_cxx
@pytest.mark.parametrize("T, cu", [(41, None), (41, [0, 20, 41])], ids=["one", "packed"])
def test_emulated_sequences_shorter_than_a_chunk(emulated, T, cu):
    """Sequences shorter than ``chunk_size=64`` (the longest 41 and 21 tokens) run the
    fused kernels at 64 and 32, padded (before, the chunk was cut to the longest
    sequence, a size no kernel takes, and the batched MLX ops ran: found by probing)."""
    n = 1 if cu is None else len(cu) - 1
    inputs = make_inputs(1, T, 1, 2, 32, 32, n_states=n)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, cu_seqlens=cu,
                            kernels=False)  # fmt: skip
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs, cu_seqlens=cu))
    spec = chunk_module.check_inputs("t", *inputs[:5], None, None, 64, cu)
    assert chunk_module._Chunking(spec, chunk_module._fused_sizes(spec, True)).C == (
        64 if cu is None else 32
    )


@needs_cxx
@pytest.mark.parametrize("tf32", ["0", "1"], ids=["float32-products", "tf32-products"])
def test_emulated_low_precision_is_the_float32_call_rounded(emulated, monkeypatch, tf32):
    """bf16 inputs are read and converted by the kernels, everything else is float32:
    o and every gradient equal the float32 call rounded, exactly; with TF32 products too
    (the same float32 values are rounded to tf32 the same way)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", tf32)
    inputs = make_inputs(1, 40, 1, 2, 32, 32, dtype=mx.bfloat16)
    got, ref = low_precision_pair(inputs, chunk_size=32, kernels=False)
    assert emulated
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == (mx.float32 if name in ("final_state", "dh0") else mx.bfloat16), name
        assert mx.array_equal(a, b.astype(a.dtype)).item(), name


@needs_cxx
def test_emulated_mixed_input_dtypes(emulated):
    """q, k, v in bf16, g in float32, beta in float16: each gradient in its input's
    dtype and, against the batched path, equal in low precision (measured: 0) and
    within 1e-5 in float32 (measured 1.3e-7 to 2.1e-7). Bound for low precision: one
    bf16 rounding step, 2^-7."""
    inputs = make_inputs(1, 70, 1, 2, 32, 32, dtype=mx.bfloat16)
    inputs[3] = inputs[3].astype(mx.float32)
    inputs[4] = inputs[4].astype(mx.float16)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, kernels=False)
    assert emulated
    emulated.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_module, "_fused", lambda spec, C, kernels, strict=False: False)
        ref = outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, kernels=False)
    assert not emulated
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype, name
        assert max_rel(a, b) <= (1e-5 if a.dtype == mx.float32 else 2**-7), name
    assert [x.dtype for x in got[2:7]] == [x.dtype for x in inputs[:5]]


def test_tensor_core_products_switch(monkeypatch):
    """``CHUNKSCAN_GDN_TC``: ``auto`` (the default) takes the tensor cores unless the
    device reports a compute capability below 8.0; anything but auto / 0 / 1 raises."""
    monkeypatch.delenv("CHUNKSCAN_GDN_TC", raising=False)
    for cc, on in (((7, 5), False), ((8, 0), True), ((9, 0), True), (None, True)):
        monkeypatch.setattr(_chunk_cuda, "compute_capability", lambda cc=cc: cc)
        assert _chunk_cuda.tc_products() is on, cc
    monkeypatch.setattr(_chunk_cuda, "compute_capability", lambda: (7, 5))
    monkeypatch.setenv("CHUNKSCAN_GDN_TC", "1")
    assert _chunk_cuda.tc_products()
    monkeypatch.setenv("CHUNKSCAN_GDN_TC", "0")
    assert not _chunk_cuda.tc_products()
    monkeypatch.setenv("CHUNKSCAN_GDN_TC", "yes")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_TC"):
        _chunk_cuda.tc_products()


def test_launch_plans_follow_the_environment_at_each_call(monkeypatch):
    """A launch's plan (the kernel's name, header and threads) is worked out once per shape
    and environment, since every group launches; a variable changed between two calls
    still changes the next launch."""
    seen = []

    def runner(name, header, source, inputs, outputs, template, grid, group, smem):
        seen.append((name, "#define CS_SCALAR_LOADS 1" in header, group[0]))
        return [mx.zeros(shape, dtype) for _, shape, dtype in outputs]

    monkeypatch.setattr(_backend, "RUNNER", runner)
    monkeypatch.setenv("CHUNKSCAN_GDN_TC", "0")  # the plain name on every device
    q, v, g = mx.zeros((1, 2, 32, 1, 32)), mx.zeros((1, 2, 32, 2, 32)), mx.zeros((1, 2, 32, 2))
    for loads, nt in ((None, None), ("1", None), (None, None), (None, "512")):
        for var, value in (("CHUNKSCAN_GDN_SCALAR_LOADS", loads), ("CHUNKSCAN_GDN_NT", nt)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        _chunk_cuda.prepare(q, q, v, g, g, 0.5)
    plain = "chunkscan_gdn_prepare"
    assert seen == [(plain, False, 256), (plain + "_scalar_loads", True, 256),
                    (plain, False, 256), (plain, False, 512)]  # fmt: skip


@needs_cxx
def test_emulated_tensor_core_and_fma_products(emulated, monkeypatch):
    """``prepare`` and ``input_grads`` with their q / k products on the tensor cores
    (emulated as the H200 sums, ``tools/cuda_emulate.py``) and as FMA loops
    (``CHUNKSCAN_GDN_TC=0``): both within the issue's 1e-4 of the oracle (measured at
    this shape, float32: 1.1e-6 for dg, the rest 1.2e-7 to 6.6e-7 with the tensor cores,
    1.8e-7 to 6.1e-7 without), and not the same values (the switch changes the
    arithmetic)."""
    inputs = make_inputs(1, 70, 1, 2, 32, 64)
    ref = outputs_and_grads(naive, inputs)
    runs = {}
    for tc in ("0", "1"):
        monkeypatch.setenv("CHUNKSCAN_GDN_TC", tc)
        runs[tc] = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
        assert_close(runs[tc], ref)
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(runs["0"], runs["1"]))


@needs_cxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_emulated_wide_and_single_loads_agree(emulated, monkeypatch, dtype):
    """``csg::load_tile`` reads 16 bytes per load (8 bf16 / fp16 or 4 float32 values,
    unpacked from their bits) where the addresses allow, else one element per load
    (``CHUNKSCAN_GDN_SCALAR_LOADS=1`` forces that): both give every value and gradient
    bit for bit, for each input dtype, with two partial sums per state-gradient slice
    (``CHUNKSCAN_GDN_TV=32``, Dv = 64)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TV", "32")
    inputs = make_inputs(1, 40, 1, 2, 32, 64, dtype=dtype)
    runs = []
    for scalar in ("0", "1"):
        monkeypatch.setenv("CHUNKSCAN_GDN_SCALAR_LOADS", scalar)
        runs.append(outputs_and_grads(gated_delta_rule, inputs, chunk_size=32, kernels=False))
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    for name, a, b in zip(NAMES, *runs):
        assert mx.array_equal(a, b).item(), name
    assert_close([x.astype(mx.float32) for x in runs[0]],
                 outputs_and_grads(naive, [x.astype(mx.float32) for x in inputs]),
                 tol=1e-4 if dtype == mx.float32 else 2**-7)  # fmt: skip


NON_FINITE = [("q", -math.inf, False), ("k", math.nan, False), ("g", math.inf, False),
              ("beta", math.nan, False), ("q", math.nan, True), ("k", math.inf, True),
              ("v", math.nan, True)]  # fmt: skip


@needs_cxx
@pytest.mark.parametrize("name, value, tf32", NON_FINITE)
def test_emulated_non_finite_input_is_causal(emulated, monkeypatch, name, value, tf32):
    """NaN where the per-step loop has it, nothing before: the kernels read non-finite
    inputs as zero and give them no gradient, as the batched ops do. ``tf32``: TF32
    products, where ``input_grads`` reads q, k and v for that test early (EARLY); the
    same causality. (Its per-element test itself is not visible here: the output from a
    non-finite input on is NaN and its cotangent read as zero, so the gradient there is
    zero either way; breaking the test passed this, checked by hand.)"""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1" if tf32 else "0")
    T, t = 40, 20
    inputs = make_inputs(1, T, 1, 2, 32, 32)
    i = spoil_token(inputs, name, value, t)
    w = mx.random.normal((1, T, 2, 32), key=mx.random.key(5))

    def loss(*xs):
        o, _ = gated_delta_rule(*xs[:5], initial_state=xs[5], chunk_size=32, kernels=False)
        return mx.sum(mx.where(mx.arange(T)[None, :, None, None] < t, o * w, 0.0))

    o, _ = gated_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=32, kernels=False)
    o_ref, _ = naive(*inputs[:5], initial_state=inputs[5])
    finite = mx.all(mx.isfinite(o), axis=(2, 3))[0].tolist()
    assert finite == mx.all(mx.isfinite(o_ref), axis=(2, 3))[0].tolist()
    assert all(finite[:t]) and not finite[t]
    grads = mx.grad(loss, argnums=tuple(range(6)))(*inputs)
    assert emulated
    for gr in grads:
        assert mx.all(mx.isfinite(gr)).item()
    assert mx.abs(grads[i][:, t:]).max().item() == 0.0


def check_cotangent_of_non_finite_output_ignored(kernels: bool, C: int, D: int) -> None:
    """A cotangent where the output is NaN (from a non-finite k on) changes no gradient:
    ``state_gradient_input`` and ``state_grads`` read ``d_o`` as zero there, as the
    batched ops do (the causal tests mask their loss there, so they cannot see this)."""
    T, t = 2 * C + 8, C + 4
    inputs = make_inputs(1, T, 1, 2, D, D)
    spoil_token(inputs, "k", math.nan, t)
    ct = mx.random.normal((1, T, 2, D), key=mx.random.key(6))

    def f(*xs):
        return gated_delta_rule(*xs[:5], initial_state=xs[5], chunk_size=C, kernels=kernels)

    o, _ = f(*inputs)
    assert mx.all(mx.isfinite(o[:, :t])).item() and not mx.any(mx.isfinite(o[:, t:])).item()
    grads = [mx.vjp(f, inputs, [c, mx.zeros_like(inputs[5])])[1]
             for c in (ct, mx.where(mx.isfinite(o), ct, 0.0))]  # fmt: skip
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), *grads):
        assert mx.all(mx.isfinite(a)).item(), name
        assert mx.array_equal(a, b).item(), name


@needs_cxx
def test_emulated_cotangent_of_a_non_finite_output_is_ignored(emulated):
    check_cotangent_of_non_finite_output_ignored(False, 32, 32)
    assert emulated


# ------------------------------------------------------------------- on a CUDA device

# TF32 products (CHUNKSCAN_GDN_TF32=1): every operand rounded to tf32 (unit roundoff
# 2^-11 ~ 4.9e-4), float32 sums. Emulated at the shape below (C = 64, float32, portable
# state passes) the errors were 2.4e-4 to 7.4e-4 against the oracle (o 5.1e-4, dq 7.4e-4,
# dg 7.1e-4; 2.3e-4 to 7.1e-4 before input_grads' FMA products took TF32 too, 2.5e-4 to
# 4.0e-4 before prepare's did); the bound is ~2x that, far below what a wrong tile,
# layout or sign gives (O(1)).
TF32_TOL = 1.5e-3


@needs_cxx
def test_emulated_tf32_products(emulated, monkeypatch):
    """``output``, ``state_grads`` and ``input_grads`` with one tf32 product per tile:
    within :data:`TF32_TOL` of the oracle, and not the float32 kernels' values."""
    inputs = make_inputs(1, 70, 1, 2, 32, 64)
    ref = outputs_and_grads(naive, inputs)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    print({n: f"{max_rel(a, b):.2e}" for n, a, b in zip(NAMES, got, ref)})
    assert_close(got, ref, tol=TF32_TOL)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "0")
    exact = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    assert_close(exact, ref)
    # o and every input gradient come from a TF32 kernel (final_state and dh0 from the
    # portable state passes here)
    assert all(not mx.array_equal(a, b).item() for a, b in zip(got[2:7], exact[2:7]))
    assert not mx.array_equal(got[0], exact[0]).item()


@needs_cxx
def test_emulated_tf32_heads_of_96(emulated, monkeypatch):
    """Heads of 96 (six 16-wide tiles per row, which 8 warps do not divide: each tile
    loads its own B fragment in csg::tc_run) with TF32 products, against the oracle.
    Session 11's tc_run did not compile there (a static_assert)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    inputs = make_inputs(1, 70, 1, 2, 96, 96)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    assert set(emulated) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs), tol=TF32_TOL)


# tile_pos of tiles 0..X-1, positions 0..7 of each, plain then spread (csg, TF32 builds)
TILE_POS = r"""
  const int i = threadIdx.x;
  plain[i] = csg::tile_pos<false>(i / 8, i % 8);
  spread[i] = csg::tile_pos<true>(i / 8, i % 8);
"""


@needs_cxx
@pytest.mark.parametrize("tiles", [2, 6, 8])
def test_emulated_spread_tiles_use_every_bank(tiles):
    """``csg::tile_pos`` as the kernels compile it: spread or plain, a dimension's tiles
    (16 rows each: positions 0..7 and those + 8) cover each row once. Spread, lane
    (g, t) reading row k + t, column tile_pos(x, g) of an operand at row stride 4 mod 32
    (``!KA`` / ``!KB``) hits bank 4 t + tile_pos(x, g) mod 32: 32 banks for 32 lanes,
    where plain tiles put them on 20 banks, 12 of them twice (the negative control).
    The accumulator's column pairs (position 2 t) stay side by side, and their 8-byte
    accesses by half a warp (g < 4 or g >= 4) cover 32 banks spread."""
    header = "#define CS_TF32 1\n#define CS_TC 1\n" + _chunk_cuda._HEADER + _chunk_cuda._HEADER_TC
    n = 8 * tiles
    plain, spread = cuda_emulator().run(
        "tile_pos", header, TILE_POS, [], [("plain", (n,), mx.int32), ("spread", (n,), mx.int32)],
        [], (n, 1, 1), (n, 1, 1), 0)  # fmt: skip
    plain, spread = plain.tolist(), spread.tolist()
    for pos in (plain, spread):
        rows = [r + hi for r in pos for hi in (0, 8)]
        assert sorted(rows) == list(range(16 * tiles))

    def banks(pos, x, ld=68):  # one warp's reads at one k step: rows t, columns tile_pos
        return {(t * ld + pos[8 * x + g]) % 32 for g in range(8) for t in range(4)}

    for x in range(tiles):
        assert len(banks(spread, x)) == 32
        assert len(banks(plain, x)) == 20
        for half in (range(4), range(4, 8)):  # 8-byte accumulator accesses, row stride 68
            words = {(g * 68 + spread[8 * x + 2 * t] + c) % 32
                     for g in half for t in range(4) for c in (0, 1)}  # fmt: skip
            assert len(words) == 32


def test_tf32_products_switch(monkeypatch):
    """``CHUNKSCAN_GDN_TF32``: auto (the default) follows MLX's own float32 matmuls, TF32
    on a CUDA device unless ``MLX_ENABLE_TF32`` reads as 0 by C's atoi, float32
    elsewhere; 1 / 0 force it; anything else raises naming the variable."""
    monkeypatch.delenv("CHUNKSCAN_GDN_TF32", raising=False)
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    for cuda, mlx_tf32, on in (
        (False, None, False),
        (True, None, True),
        (True, "0", False),
        (True, "1", True),
        # MLX reads the variable with C's atoi: no leading digits is 0, TF32 off
        # ("" and "false" read as on before; found by probing).
        (True, "", False),
        (True, "false", False),
        (True, "off", False),
        (True, "0x10", False),
        (True, " 2", True),
        (True, "1e3", True),
        (True, "4294967296", False),
        (False, "1", False),
    ):
        monkeypatch.setattr(_backend, "cuda_device", lambda cuda=cuda: cuda)
        if mlx_tf32 is None:
            monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
        else:
            monkeypatch.setenv("MLX_ENABLE_TF32", mlx_tf32)
        assert _backend.tf32_products() is on, (cuda, mlx_tf32)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    assert _backend.tf32_products()
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "0")
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    assert not _backend.tf32_products()
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "fast")
    with pytest.raises(ValueError, match="CHUNKSCAN_GDN_TF32"):
        _backend.tf32_products()


QWEN = (1, 300, 2, 4, 128, 128)  # T not a multiple of 64, Hv = 2 Hk, Dv in one slice


@needs_cuda
def test_cuda_cotangent_of_a_non_finite_output_is_ignored():
    """The same on the device, every kernel on, at the Qwen3-Next head size."""
    check_cotangent_of_non_finite_output_ignored(True, 64, 128)


@needs_cuda
@pytest.mark.parametrize("tv", [None, "64"], ids=["default-slices", "two-slices"])
@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no-h0"])
def test_cuda_fused_matches_oracle(with_h0, tv, monkeypatch):
    """The fused op against the oracle and the portable op; with ``tv`` = 64 (two slices
    of Dv, two partial sums for input_grads: the default at C = 32 and on devices with
    less shared memory than an H100's) too."""
    if tv is not None:
        monkeypatch.setenv("CHUNKSCAN_GDN_TV", tv)
    inputs = make_inputs(*QWEN)
    if not with_h0:
        inputs = inputs[:5]
    assert chunk_module._fused(Spec(*QWEN[:2], *QWEN[2:], 0.1, 64, None), 64, True)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    assert_close(got, outputs_and_grads(naive, inputs))
    portable = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, kernels=False)
    assert_close(got, portable)


@needs_cuda
def test_cuda_fused_packed_and_compiled():
    cu = [0, 100, 101, 300]
    inputs = make_inputs(*QWEN, n_states=3)
    ref = outputs_and_grads(naive, inputs, cu_seqlens=cu)
    assert_close(outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, cu_seqlens=cu), ref)
    compiled = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, cu_seqlens=cu,
                                 compiled=True)  # fmt: skip
    assert_close(compiled, ref)


@needs_cuda
@pytest.mark.parametrize("T, cu", [(41, None), (41, [0, 20, 41])], ids=["one", "packed"])
def test_cuda_sequences_shorter_than_a_chunk(T, cu, monkeypatch):
    """On the device: sequences shorter than the chunk run the fused kernels, padded to
    64 and 32 (``test_emulated_sequences_shorter_than_a_chunk``), against the oracle."""
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    launched = []
    real = _chunk_cuda._launch
    monkeypatch.setattr(
        _chunk_cuda, "_launch", lambda w, *a, **k: launched.append(w) or real(w, *a, **k)
    )
    n = 1 if cu is None else len(cu) - 1
    inputs = make_inputs(1, T, *QWEN[2:], n_states=n)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, cu_seqlens=cu)
    assert set(launched) == set(_chunk_cuda._KERNELS)
    assert_close(got, outputs_and_grads(naive, inputs, cu_seqlens=cu))


@needs_cuda
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "portable"])
def test_cuda_second_derivatives(kernels, monkeypatch):
    """On the device: a gradient of the gradient fails loudly with the kernels (they
    have no derivative: MLX's own message) and matches the oracle without them, with
    float32 products, to the op's float32 tolerance
    (``test_gated_delta.py::test_second_derivatives_match_the_oracle`` on the CPU)."""
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    inputs = make_inputs(1, 80, 1, 2, 32, 32)

    def squared_dq(op, **kwargs):
        def loss(q, h0):
            o, s = op(q, *inputs[1:5], initial_state=h0, **kwargs)
            return o.sum() + s.sum()

        def norm(q, h0):
            return (mx.grad(loss)(q, h0) ** 2).sum()

        return mx.grad(norm, argnums=(0, 1))(inputs[0], inputs[5])

    if kernels:
        with pytest.raises(ValueError, match="Not implemented for CustomKernel"):
            mx.eval(squared_dq(gated_delta_rule, chunk_size=32, kernels=True))
        return
    got = squared_dq(gated_delta_rule, chunk_size=32, kernels=False)
    ref = squared_dq(naive)
    assert all(max_rel(a, b) <= 1e-4 for a, b in zip(got, ref))


@needs_cuda
@pytest.mark.parametrize("tf32", ["0", "1"], ids=["float32-products", "tf32-products"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_cuda_fused_low_precision_is_the_float32_call_rounded(dtype, tf32, monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", tf32)
    got, ref = low_precision_pair(make_inputs(*QWEN, dtype=dtype), chunk_size=64)
    for name, a, b in zip(NAMES, got, ref):
        assert mx.array_equal(a, b.astype(a.dtype)).item(), name


@needs_cuda
def test_cuda_tf32_products_match_oracle(monkeypatch):
    """The op with TF32 products (``CHUNKSCAN_GDN_TF32=1``: the chunk kernels' and both
    state passes'; the default on CUDA unless ``MLX_ENABLE_TF32=0``) within
    :data:`TF32_TOL` of the float32 oracle, and not the float32 kernels' values."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    inputs = make_inputs(*QWEN)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    ref = outputs_and_grads(naive, inputs)
    print({n: f"{max_rel(a, b):.2e}" for n, a, b in zip(NAMES, got, ref)})
    assert_close(got, ref, tol=TF32_TOL)
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "0")
    exact = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    assert not any(mx.array_equal(a, b).item() for a, b in zip(got, exact))


@needs_cuda
@pytest.mark.parametrize("th", ["32", "128"])
def test_cuda_output_steps(monkeypatch, th):
    check_output_steps(monkeypatch, th)


@needs_cuda
def test_cuda_fma_products_match_oracle(monkeypatch):
    """The chunk kernels with their q / k products as FMA loops (``CHUNKSCAN_GDN_TC=0``;
    the other CUDA tests run the default, tensor cores on the H200)."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TC", "0")
    inputs = make_inputs(*QWEN)
    assert_close(outputs_and_grads(gated_delta_rule, inputs, chunk_size=64),
                 outputs_and_grads(naive, inputs))  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_cuda_wide_loads_single_loads_and_odd_offsets_agree(monkeypatch, dtype):
    """The kernels' 16-byte loads against one element per load
    (``CHUNKSCAN_GDN_SCALAR_LOADS=1``), and inputs given as views one element into a
    buffer (MLX passes such views to the kernels as they are: the 16-byte path would be
    misaligned, so ``load_tile`` takes the other): every value and gradient equal."""
    inputs = make_inputs(1, 256, 2, 4, 128, 128, dtype=dtype)  # T a multiple of C: views
    runs = []
    for scalar in ("0", "1"):
        monkeypatch.setenv("CHUNKSCAN_GDN_SCALAR_LOADS", scalar)
        runs.append(outputs_and_grads(gated_delta_rule, inputs, chunk_size=64))
    monkeypatch.setenv("CHUNKSCAN_GDN_SCALAR_LOADS", "0")
    odd = list(inputs)
    for i in range(3):  # q, k, v one element into a buffer
        flat = mx.concatenate([mx.zeros((1,), dtype=dtype), inputs[i].reshape(-1)])
        odd[i] = flat[1:].reshape(inputs[i].shape)
    mx.eval(odd)
    runs.append(outputs_and_grads(gated_delta_rule, odd, chunk_size=64))
    for name, a, b, c in zip(NAMES, *runs):
        assert mx.array_equal(a, b).item(), name
        assert mx.array_equal(a, c).item(), name


@needs_cuda
@pytest.mark.parametrize("tf32", ["0", "1"])
def test_cuda_initial_state_at_an_odd_offset(monkeypatch, tf32):
    """A float32 initial state given as a view one element into a buffer reaches the
    state passes as it is; their 16- / 8-byte and wmma loads of it were misaligned (a
    fault on the device; found by the emulator probe, session 35). Every value and
    gradient equals the aligned call's, with the 3xTF32 wmma and the TF32 mma forward
    passes and the FMA reverse pass."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", tf32)
    inputs = make_inputs(1, 256, 2, 4, 128, 128)
    aligned = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    odd = list(inputs)
    flat = mx.concatenate([mx.zeros((1,), dtype=mx.float32), inputs[5].reshape(-1)])
    odd[5] = flat[1:].reshape(inputs[5].shape)
    mx.eval(odd)
    got = outputs_and_grads(gated_delta_rule, odd, chunk_size=64)
    for name, a, b in zip(NAMES, aligned, got):
        assert mx.array_equal(a, b).item(), name


@needs_cuda
def test_cuda_tf32_heads_of_96(monkeypatch):
    """Heads of 96 on the device with TF32 products (csg::tc_run's per-tile B
    fragments), against the oracle."""
    monkeypatch.setenv("CHUNKSCAN_GDN_TF32", "1")
    inputs = make_inputs(1, 300, 2, 4, 96, 96)
    got = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    ref = outputs_and_grads(naive, inputs)
    print("heads of 96, TF32:", {n: f"{max_rel(a, b):.2e}" for n, a, b in zip(NAMES, got, ref)})
    assert_close(got, ref, tol=TF32_TOL)


@needs_cuda
def test_cuda_fused_saving_group_states(monkeypatch):
    """``CHUNKSCAN_GDN_SAVE=groups`` with the real kernels: one chunk per group, packed
    sequences starting inside the run; the recomputed entering states come from the
    same state-pass kernel on the same inputs, so every value and gradient equals the
    default's exactly, and both match the oracle."""
    monkeypatch.setattr(chunk_module, "_GROUP_BYTES", 1)
    cu = [0, 100, 101, 300]
    inputs = make_inputs(*QWEN, n_states=3)
    runs = {}
    for save in ("groups", "chunks"):
        monkeypatch.setattr(chunk_module, "_SAVE", save)
        runs[save] = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64, cu_seqlens=cu)
    for name, a, b in zip(NAMES, runs["groups"], runs["chunks"]):
        assert mx.array_equal(a, b).item(), name
    assert_close(runs["groups"], outputs_and_grads(naive, inputs, cu_seqlens=cu))


@needs_cuda
@pytest.mark.parametrize("groups", [1, 3])
def test_cuda_backward_reuses_the_last_groups_preparation(monkeypatch, groups):
    """The last group's preparation kept from the forward (the default) against the
    backward recomputing it (``CHUNKSCAN_GDN_KEEP_PREPARED=0``), with the real kernels,
    one group and three: every value and gradient equal."""
    inputs = make_inputs(*QWEN)
    if groups > 1:  # T = 300: five chunks, in groups of two
        monkeypatch.setattr(chunk_module, "_group_size", lambda *a, **k: 2)
    runs = {}
    for keep in (True, False):
        monkeypatch.setattr(chunk_module, "_KEEP_PREPARED", keep)
        runs[keep] = outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    for name, a, b in zip(NAMES, runs[True], runs[False]):
        assert mx.array_equal(a, b).item(), name
