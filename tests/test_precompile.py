"""chunkscan._precompile: our own compile of the CUDA kernels, its disk cache, its
fallback to ``mx.fast.cuda_kernel``; on a CUDA device, the precompiled kernels against
MLX's build of the same sources."""

from __future__ import annotations

import os
import warnings

import mlx.core as mx
import pytest
from helpers import max_rel

from chunkscan import _backend, _precompile

HAS_CUDA = _backend.cuda_device()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")

SOURCE = "out[0] = static_cast<T>(x[0] * n + x_shape[1]);"


def test_build_source_follows_the_argument_order():
    """Inputs, outputs, then one int per dimension of each input whose shape the source
    reads (rebuilt as ``<name>_shape``), then the template constants."""
    src = _precompile.build_source(
        "k_1", "// header\n", SOURCE, [("x", mx.float32, 2), ("y", mx.int32, 1)],
        [("out", mx.bfloat16)], [("n", 3), ("T", mx.bfloat16), ("flag", True)],
    )  # fmt: skip
    assert src.startswith(_precompile.PRELUDE + "// header\n")
    signature = src[src.index('extern "C"') : src.index(") {")]
    assert signature.split("(", 1)[1].split(",") == [
        "\n    const float* x", "\n    const int32_t* y", "\n    __nv_bfloat16* out",
        "\n    int x_shape_0", "\n    int x_shape_1",
    ]  # fmt: skip
    body = src[src.index(") {") :]
    assert "const int x_shape[2] = {x_shape_0, x_shape_1};" in body
    assert "constexpr int n = 3;" in body and "using T = __nv_bfloat16;" in body
    assert "constexpr bool flag = true;" in body and "y_shape" not in src
    assert body.index("constexpr int n") < body.index(SOURCE)
    with pytest.raises(ValueError, match="x_strides has no precompiled form"):
        _precompile.build_source("k", "", "x_strides[0];", [("x", mx.float32, 1)],
                                 [("out", mx.float32)], [])  # fmt: skip


def test_binaries_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path / "cache"))
    calls = []

    def compile_fn(source, arch):
        calls.append((source, arch))
        return b"\x7fELF" + source.encode()

    key, binary = _precompile.cached_binary("src", "90", compile_fn, "13.0")
    assert binary == b"\x7fELFsrc" and calls == [("src", "90")]
    assert os.listdir(tmp_path / "cache") == [f"{key}.cubin"]
    assert _precompile.cached_binary("src", "90", compile_fn, "13.0") == (key, binary)
    assert len(calls) == 1  # read back, not compiled again
    for args in (
        ("src", "80", compile_fn, "13.0"),
        ("src", "90", compile_fn, "12.9"),
        ("src", "90", compile_fn, "13.0", "ptx"),
        ("src2", "90", compile_fn, "13.0"),
    ):
        assert _precompile.cached_binary(*args)[0] != key  # fmt: skip
    assert len(calls) == 5
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")
    assert _precompile.cached_binary("src", "90", compile_fn, "13.0")[1] == binary  # unwritable


def test_a_damaged_cache_file_is_built_again(tmp_path, monkeypatch):
    """An empty or cut cache file (a crash between the write and the rename, a full
    disk) was returned as it was at every call, and MLX failed to load it naming no
    file (found by probing): a file that is no ELF cubin, or PTX without its version,
    is a miss, built again and replaced. A write that fails leaves no file behind."""
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path / "cache"))
    calls = []

    def compile_fn(source, arch):
        calls.append(source)
        return b"\x7fELF" + source.encode()

    key, binary = _precompile.cached_binary("src", "90", compile_fn, "13.0")
    cached = tmp_path / "cache" / f"{key}.cubin"
    for damaged in (b"", b"\x7fEL", b"garbage"):
        cached.write_bytes(damaged)
        assert _precompile.cached_binary("src", "90", compile_fn, "13.0") == (key, binary)
        assert cached.read_bytes() == binary
    assert len(calls) == 4
    ptx = lambda source, arch: b"//\n// NVVM\n.version 8.5\n.target sm_90\n"  # noqa: E731
    key, text = _precompile.cached_binary("p", "90", ptx, "13.0", "ptx")
    (tmp_path / "cache" / f"{key}.ptx").write_bytes(b"// cut")
    assert _precompile.cached_binary("p", "90", ptx, "13.0", "ptx") == (key, text)
    (tmp_path / "cache" / f"{key}.ptx").unlink()
    (tmp_path / "cache" / f"{key}.ptx").mkdir()  # a folder where the file goes
    assert _precompile.cached_binary("p", "90", ptx, "13.0", "ptx") == (key, text)
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([f"{key}.ptx", cached.name])


def test_the_cache_folder_setting(monkeypatch, tmp_path):
    """``~`` expanded and blanks ignored in ``CHUNKSCAN_CUDA_CACHE``, a relative
    ``XDG_CACHE_HOME`` ignored (the XDG rule): ``'~/cc'`` was a folder named ``~`` in
    the working directory (found by probing)."""
    home = os.path.expanduser("~")
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", "~/cc")
    assert _precompile.cache_dir() == os.path.join(home, "cc")
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", "  ")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert _precompile.cache_dir() == os.path.join(home, ".cache", "chunkscan", "cuda")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _precompile.cache_dir() == str(tmp_path / "chunkscan" / "cuda")


class FakeCompiler:
    version = "0.0"

    def __init__(self, fail: bool = False):
        self.fail, self.sources, self.archs, self.paths = fail, [], [], []

    def compile(self, source, arch, ptx=False, source_path=None):
        if self.fail:
            raise RuntimeError("NVRTC compile failed (status 6): nope")
        self.sources.append(source)
        self.archs.append(arch)
        self.paths.append(source_path)
        return b"\x7fELFbinary:" + source.encode() + (b"+lines" if source_path else b"")


def _kernel(fallback_calls):
    def fallback():
        fallback_calls.append(1)
        return lambda **kw: ["from mlx", kw]

    return _precompile.Kernel("k", ["x", "y"], ["out"], SOURCE, "", 4096, fallback)


def _fake_device(monkeypatch, tmp_path, fake) -> list[dict]:
    """Builds by ``fake`` into a cache under ``tmp_path`` for sm_90; the launches
    ``mx.fast.precompiled_cuda_kernel`` would make are recorded in the returned list."""
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(_precompile, "compiler", lambda: fake)
    monkeypatch.setattr(_precompile, "device_arch", lambda: "90")
    launched: list[dict] = []
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: launched.append(kw) or [])
    return launched


def test_kernel_passes_shapes_as_scalars(tmp_path, monkeypatch):
    fake = FakeCompiler()
    launched = _fake_device(monkeypatch, tmp_path, fake)
    fallbacks = []
    kernel = _kernel(fallbacks)
    x, y = mx.zeros((2, 5)), mx.zeros((3,), dtype=mx.int32)
    args = dict(template=[("n", 2), ("T", mx.float32)], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                output_shapes=[(1,)], output_dtypes=[mx.float32])  # fmt: skip
    kernel(inputs=[x, y], **args)
    (call,) = launched
    assert call["scalars"] == [2, 5] and call["shared_memory"] == 4096
    assert call["ensure_row_contiguous"] and call["grid"] == (64, 1, 1)
    assert call["name"].startswith("k_") and f"void {call['name']}(" in fake.sources[0]
    assert call["compiled_source"] == b"\x7fELFbinary:" + fake.sources[0].encode()
    kernel(inputs=[x, y], **args)
    assert len(fake.sources) == 1  # one build per dtypes, ranks and template
    kernel(inputs=[x.astype(mx.bfloat16), y], **args)
    assert len(fake.sources) == 2 and launched[2]["name"] != call["name"]
    other = _kernel(fallbacks)  # a new process: the disk cache, no compile
    other(inputs=[x, y], **args)
    assert len(fake.sources) == 2 and launched[3]["name"] == call["name"]
    # another template value: its own build (the C = 32 binary ran for C = 64 when the
    # template was left out of the in-process key; mutation audit)
    kernel(inputs=[x, y], **dict(args, template=[("n", 3), ("T", mx.float32)]))
    assert len(fake.sources) == 3 and launched[4]["name"] not in (call["name"], launched[2]["name"])
    # another architecture (a second, different GPU as the default device): its own
    # build, not the cubin already held for sm_90
    monkeypatch.setattr(_precompile, "device_arch", lambda: "80")
    kernel(inputs=[x, y], **args)
    assert fake.archs == ["90", "90", "90", "80"]
    assert not fallbacks


def test_line_information_for_profiling(tmp_path, monkeypatch):
    """CHUNKSCAN_CUDA_LINEINFO=1: the source written to <cache>/src/<symbol>.cu and
    compiled under that name with line information, cached under its own key (a build
    without it is not reused, nor reuses it)."""
    fake = FakeCompiler()
    launched = _fake_device(monkeypatch, tmp_path, fake)
    args = dict(inputs=[mx.zeros((2, 5)), mx.zeros((3,), dtype=mx.int32)],
                template=[("n", 2), ("T", mx.float32)], grid=(64, 1, 1), threadgroup=(64, 1, 1),
                output_shapes=[(1,)], output_dtypes=[mx.float32])  # fmt: skip
    _kernel([])(**args)
    monkeypatch.setenv("CHUNKSCAN_CUDA_LINEINFO", "1")
    _kernel([])(**args)
    monkeypatch.delenv("CHUNKSCAN_CUDA_LINEINFO")
    _kernel([])(**args)  # from the disk cache: the build without line information
    assert fake.paths[0] is None and len(fake.paths) == 2
    path = fake.paths[1]
    assert path == str(tmp_path / "src" / f"{launched[1]['name']}.cu")
    assert open(path).read() == fake.sources[1]
    assert launched[1]["compiled_source"].endswith(b"+lines")
    assert not launched[0]["compiled_source"].endswith(b"+lines")
    assert launched[2]["compiled_source"] == launched[0]["compiled_source"]
    # one kernel object, the switch set after its first build: the build with line
    # information (it launched the binary without, and wrote no source; probing)
    kernel = _kernel([])
    kernel(**args)
    monkeypatch.setenv("CHUNKSCAN_CUDA_LINEINFO", "1")
    kernel(**args)
    assert launched[4]["compiled_source"].endswith(b"+lines")
    assert not launched[3]["compiled_source"].endswith(b"+lines")


def test_kernel_falls_back_to_mlx_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(_precompile, "compiler", lambda: FakeCompiler(fail=True))
    monkeypatch.setattr(_precompile, "device_arch", lambda: "90")
    monkeypatch.setattr(_precompile, "_WARNED", set())
    fallbacks = []
    kernel = _kernel(fallbacks)
    args = dict(inputs=[mx.zeros((2, 5)), mx.zeros((3,))], template=[], grid=(1, 1, 1),
                threadgroup=(1, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.float32])  # fmt: skip
    with pytest.warns(RuntimeWarning, match="compiling the CUDA kernel k ourselves failed"):
        assert kernel(**args)[0] == "from mlx"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel(**args)[0] == "from mlx"
    assert fallbacks == [1]  # built once


def test_mode(monkeypatch):
    for value, mode in (("0", "0"), ("ptx", "ptx"), ("1", "cubin"), ("", "cubin"), (" 0 ", "0")):
        monkeypatch.setenv("CHUNKSCAN_CUDA_PRECOMPILE", value)
        assert _precompile.mode() == mode
    monkeypatch.delenv("CHUNKSCAN_CUDA_PRECOMPILE")
    assert _precompile.mode() == "cubin"
    for junk in ("false", "off", "cubin"):  # they had left it on, silently
        monkeypatch.setenv("CHUNKSCAN_CUDA_PRECOMPILE", junk)
        with pytest.raises(ValueError, match="CHUNKSCAN_CUDA_PRECOMPILE must be 0"):
            _precompile.mode()


def test_without_cuda_the_kernels_are_mlx_s(monkeypatch):
    """Off a CUDA device (or with CHUNKSCAN_CUDA_PRECOMPILE=0) ``cuda_kernel`` builds
    ``mx.fast.cuda_kernel`` directly: on a CPU-only MLX that raises, naming the op."""
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    monkeypatch.setattr(_backend, "_CUDA_KERNELS", {})
    with pytest.raises(RuntimeError, match=r"\[op\] the CUDA kernel is unavailable"):
        _backend.cuda_kernel("op", "k", ["x"], ["out"], "out[0] = x[0];", "", 0)


# ------------------------------------------------------------------- on a CUDA device


def _gdn_and_attention_results():
    from helpers import gated_delta_inputs, gdn_outputs_and_grads

    from chunkscan import gated_delta_rule
    from chunkscan.ops.attention import blocked

    inputs = gated_delta_inputs(1, 300, 2, 4, 128, 128)
    cu = [0, 100, 101, 300]
    gdn = gdn_outputs_and_grads(gated_delta_rule, inputs, chunk_size=64)
    gdn += gdn_outputs_and_grads(gated_delta_rule, gated_delta_inputs(1, 300, 2, 4, 128, 128,
                                 n_states=3), chunk_size=64, cu_seqlens=cu)  # fmt: skip
    pass_only = gdn_outputs_and_grads(gated_delta_rule, inputs, chunk_size=128)  # state pass
    keys = mx.random.split(mx.random.key(3), 4)
    q, k, v, w = (mx.random.normal((1, 4, 256, 128), key=kk).astype(mx.bfloat16) for kk in keys)

    def loss(q, k, v):
        o = blocked.blocked_attention(q, k, v, scale=0.09, mask="causal")
        return mx.sum(o.astype(mx.float32) * w.astype(mx.float32))

    att = [blocked.blocked_attention(q, k, v, scale=0.09, mask="causal")]
    att += list(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))
    out = gdn + pass_only + att
    mx.eval(out)
    return out


@needs_cuda
def test_cuda_precompiled_kernels_equal_mlx_s(monkeypatch, tmp_path):
    """Every kernel family (the fused Gated DeltaNet kernels, the state-pass kernel, the
    attention kernels) compiled here, then by ``mx.fast.cuda_kernel``: the same values
    and gradients, bit for bit (the same source and compiler: measured difference 0 on
    the H200, run 17, bench/results/h200/tests_h200_precompile_cb4738b.txt). No fallback
    may happen on the device."""
    monkeypatch.setenv("CHUNKSCAN_CUDA_CACHE", str(tmp_path))
    from chunkscan.ops.attention import blocked

    monkeypatch.setattr(_backend, "_CUDA_KERNELS", {})
    monkeypatch.setattr(blocked, "_use_fast", lambda spec, dtype: False)  # the kernels at T = 256
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warns: none may
        # chunk_size=128 runs the state pass alone, as meant, and gated_delta_rule warns
        # that the fused kernels skip that size: raised here on the H200 (run 103)
        warnings.filterwarnings(
            "ignore", r".*chunk_size=128 is not a size the fused", RuntimeWarning
        )
        ours = _gdn_and_attention_results()
    built = list(_backend._CUDA_KERNELS.values())
    assert built and all(isinstance(k, _precompile.Kernel) and k._mlx is None for k in built)
    names = {k.name for k in built}
    assert "chunkscan_attn_dkdv" in names  # prepare: its tensor-core form on a GPU (run 104)
    assert names & {"chunkscan_gdn_prepare", "chunkscan_gdn_prepare_tc"}
    # FMA, wmma or mma.sync tensor cores (the last with TF32, the default on CUDA: run 54)
    assert names & {"chunkscan_state_pass", "chunkscan_state_pass_tc", "chunkscan_state_pass_mma"}
    assert len(os.listdir(tmp_path)) >= len(built)
    monkeypatch.setenv("CHUNKSCAN_CUDA_PRECOMPILE", "0")
    mlx = _gdn_and_attention_results()
    errors = [max_rel(a, b) for a, b in zip(ours, mlx)]
    print(f"precompiled vs mx.fast.cuda_kernel, max relative difference: {max(errors):.3g}")
    assert max(errors) == 0, errors


def test_finding_the_compiler(monkeypatch, tmp_path):
    """The libraries this process maps are found by name (as NVRTC is, once MLX's CUDA
    back-end has loaded it); only existing include folders are passed; a compiler that
    cannot be opened is asked for once per process."""
    if os.path.exists("/proc/self/maps"):
        libc = _precompile._loaded_library("libc.so")
        assert libc and os.path.isfile(libc)
    assert _precompile._loaded_library("libno-such-library") is None
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    (tmp_path / "cuda" / "include").mkdir(parents=True)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda"))
    dirs = _precompile._include_dirs()
    assert str(tmp_path / "cuda" / "include") in dirs and all(os.path.isdir(d) for d in dirs)
    attempts = []

    def no_nvrtc():
        attempts.append(1)
        raise RuntimeError("no NVRTC library found (test)")

    monkeypatch.setattr(_precompile, "_NVRTC", [])
    monkeypatch.setattr(_precompile, "_open_nvrtc", no_nvrtc)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no NVRTC library found"):
            _precompile.compiler()
    assert attempts == [1]


def test_device_arch_from_device_info_else_the_driver(monkeypatch):
    """``mx.device_info()``'s compute capability (the parse ``_backend`` uses for its
    limits), else the driver's attributes, else an error (which falls back to MLX).
    Taken as off a CUDA device: on one the capability is asked once and kept, so the
    faked answers below went unread (run 103 on the H200)."""
    monkeypatch.setattr(_backend, "cuda_device", lambda: False)
    monkeypatch.setattr(
        mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0}
    )
    assert _precompile.device_arch() == "90"
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "cpu"})
    asked = []
    monkeypatch.setattr(_backend, "_driver_attributes",
                        lambda i, attrs: asked.append(attrs) or [12, 1])  # fmt: skip
    assert _precompile.device_arch() == "121" and asked == [(75, 76)]
    monkeypatch.setattr(_backend, "_driver_attributes", lambda i, attrs: None)
    with pytest.raises(RuntimeError, match="compute capability is unknown"):
        _precompile.device_arch()


def test_a_kernel_is_kept_per_shared_memory_size(monkeypatch):
    """One source launched with two dynamic shared memory sizes (attention's kernels
    take the size per call) is two kernels: with the size left out of the key the second
    ran with the first's 16384 bytes (mutation audit)."""
    monkeypatch.setattr(_backend, "_CUDA_KERNELS", {})
    monkeypatch.setattr(_backend, "cuda_device", lambda: True)
    monkeypatch.setenv("CHUNKSCAN_CUDA_PRECOMPILE", "1")
    small = _backend.cuda_kernel("t", "k", ["x"], ["out"], SOURCE, "", 16384)
    large = _backend.cuda_kernel("t", "k", ["x"], ["out"], SOURCE, "", 98304)
    assert isinstance(small, _precompile.Kernel) and isinstance(large, _precompile.Kernel)
    assert (small.shared_memory, large.shared_memory) == (16384, 98304)
    assert _backend.cuda_kernel("t", "k", ["x"], ["out"], SOURCE, "", 16384) is small
