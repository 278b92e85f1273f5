"""The package's CUDA kernels compiled once, by us, and kept on disk.

``mx.fast.cuda_kernel`` compiles each kernel template with NVRTC in every new process
(MLX 0.32 does not write custom kernels to its PTX disk cache), and prepends MLX's
device header, which alone costs NVRTC about 1.5 s per kernel: a kernel with an empty
body took 1.5-2.1 s with that header and 0.04 s without it (NVRTC 12.9 on this
project's CPU machine). The Gated DeltaNet op's first call compiles 7-9 templates:
22.2 s on the H200 at T = 16384, against 4.2 s with this module's build into an empty
cache and 0.36 s from the cache (``docs/gated_delta.md``, "Compiling the kernels").

Here the same kernel (the same source, template constants and argument order as MLX's
``build_kernel``) is built with a small prelude instead of MLX's header (the kernels use
nothing of it), compiled with the NVRTC library that MLX itself has loaded, for the
device's own architecture, and the binary kept under ``CHUNKSCAN_CUDA_CACHE`` (default
``$XDG_CACHE_HOME/chunkscan/cuda`` where ``XDG_CACHE_HOME`` is set, else
``~/.cache/chunkscan/cuda``). It runs through ``mx.fast.precompiled_cuda_kernel``. An
input's ``<name>_shape``, which MLX passes as a struct, is passed as that many ``int``
scalars and rebuilt as an array at the top of the kernel.

Where a step before the launch fails (no NVRTC library found, a compile error, an MLX
without ``precompiled_cuda_kernel``) the kernel is built by ``mx.fast.cuda_kernel`` as
before, after one warning. A failure when MLX loads the module (at evaluation) is not
caught: ``CHUNKSCAN_CUDA_PRECOMPILE=0`` (read each time a kernel is asked for) switches
all of this off; ``=ptx`` keeps PTX instead of a cubin (the driver then translates it when
the module loads).

For profiling, ``CHUNKSCAN_CUDA_LINEINFO=1`` compiles with line information
(``--generate-line-info``) and writes each kernel's full source to
``<cache>/src/<symbol>.cu``, the file name NVRTC records, so that Nsight Compute can
show the warp-stall samples per source line (``ncu --import-source yes ...``, then
``--page source --print-source cuda,sass``). Such binaries are cached under their own
keys; the code is the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import os
import sys
import threading
import warnings

import mlx.core as mx

from . import _backend

_CUDA_TYPES = {
    mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half",
    mx.int32: "int32_t", mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t",
    mx.bool_: "bool",
}  # fmt: skip

# What the kernels need of a C++ environment. NVRTC has no <cstdint> of its own; a
# typedef repeated with the same type is legal, should a CUDA header define them too.
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
"""


def mode() -> str:
    """``CHUNKSCAN_CUDA_PRECOMPILE``: ``"0"`` (off: ``mx.fast.cuda_kernel``), ``"ptx"``
    (PTX, which the driver translates when the module loads), or ``"1"`` / unset, the
    default: a cubin for the device. Anything else raises naming the variable (a typo
    such as ``false`` had left precompilation on; found by probing)."""
    value = _backend.env_choice(
        "CHUNKSCAN_CUDA_PRECOMPILE", "chunkscan",
        ("0", "1", "ptx"),
        "0 (MLX builds the kernels), 1 (a cubin for the device, the default) or ptx",
    )  # fmt: skip
    return value if value in ("0", "ptx") else "cubin"


def line_info() -> bool:
    """``CHUNKSCAN_CUDA_LINEINFO``: ``1`` compiles with line information (profiling);
    ``0``, ``auto`` or unset, without; anything else raises (``yes`` read as off;
    found by probing)."""
    return bool(
        _backend.env_switch(
            "CHUNKSCAN_CUDA_LINEINFO", "chunkscan",
            "1 (line information, for profiling) or 0 / auto (none, the default)",
        )
    )  # fmt: skip


def template_lines(template, type_name=_CUDA_TYPES.__getitem__) -> list[str]:
    """MLX's template arguments ``[(name, bool | int | dtype)]`` as the C++ lines its
    ``build_kernel`` puts at the top of a kernel; ``type_name`` maps a dtype to its C++
    type (``tools/cuda_emulate.py`` and ``tools/cuda_compile_check.py`` use this too)."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {type_name(value)};")
    return lines


def shape_inputs(source: str, input_names: list[str]) -> list[str]:
    """The inputs whose shape the source reads (``<name>_shape``, as MLX detects it)."""
    return [n for n in input_names if f"{n}_shape" in source]


def build_source(
    symbol: str,
    header: str,
    source: str,
    inputs: list[tuple[str, mx.Dtype, int]],
    outputs: list[tuple[str, mx.Dtype]],
    template: list[tuple[str, object]],
) -> str:
    """The whole translation unit of one kernel template. ``inputs``: ``(name, dtype,
    ndim)``; ``outputs``: ``(name, dtype)``; ``template``: ``(name, int | bool |
    mx.Dtype)``. Parameters: the input pointers, the output pointers, then ``ndim``
    ints per input whose shape the source reads (the order of
    ``mx.fast.precompiled_cuda_kernel``'s arguments: inputs, outputs, scalars)."""
    for n, _, _ in inputs:
        for suffix in ("_strides", "_ndim"):
            if n + suffix in source:
                raise ValueError(f"{symbol}: {n}{suffix} has no precompiled form")
    shaped = set(shape_inputs(source, [n for n, _, _ in inputs]))
    params = [f"    const {_CUDA_TYPES[dt]}* {n}" for n, dt, _ in inputs]
    params += [f"    {_CUDA_TYPES[dt]}* {n}" for n, dt in outputs]
    body = []
    for n, _, nd in inputs:
        if n in shaped:
            params += [f"    int {n}_shape_{i}" for i in range(nd)]
            dims = ", ".join(f"{n}_shape_{i}" for i in range(nd))
            body.append(f"  const int {n}_shape[{nd}] = {{{dims}}};")
    body += template_lines(template)
    return (
        PRELUDE + header + f'\nextern "C" __global__ void {symbol}(\n' + ",\n".join(params)
        + ") {\n" + "\n".join(body) + "\n" + source + "\n}\n"
    )  # fmt: skip


class Nvrtc:
    """NVRTC through ctypes: :meth:`compile` returns a cubin for ``sm_<arch>``."""

    def __init__(self, lib: ctypes.CDLL, includes: list[str]) -> None:
        self.lib, self.includes = lib, includes
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
        self.version = f"{major.value}.{minor.value}"

    @staticmethod
    def _check(status: int, what: str, log: str = "") -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC {what} failed (status {status}){': ' + log if log else ''}")

    def compile(
        self, source: str, arch: str, ptx: bool = False, source_path: str | None = None
    ) -> bytes:
        """The cubin (or, with ``ptx``, the PTX) of ``source`` for ``sm_<arch>``; with
        ``source_path`` (where ``source`` is written), with line information naming it."""
        lib, prog = self.lib, ctypes.c_void_p()
        name = (source_path or "k.cu").encode()
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name, 0, None, None),
            "create",
        )
        try:
            opts = [f"--gpu-architecture={'compute' if ptx else 'sm'}_{arch}".encode()]
            if source_path:
                opts.append(b"--generate-line-info")
            opts += [f"--include-path={d}".encode() for d in self.includes]
            status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if status != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                self._check(status, "compile", log.value.decode(errors="replace")[:2000])
            get_size, get = (
                (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx
                else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            )  # fmt: skip
            size = ctypes.c_size_t()
            self._check(get_size(prog, ctypes.byref(size)), "output size")
            out = ctypes.create_string_buffer(size.value)
            self._check(get(prog, out), "output")
            return out.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has mapped whose name starts with
    ``stem`` (MLX's CUDA back-end links NVRTC), else ``None``."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def _include_dirs() -> list[str]:
    """Where CUDA's headers are, the places MLX looks (``CUDA_HOME``, ``CUDA_PATH``,
    ``/usr/local/cuda``) and the NVIDIA wheels' ``include`` folders."""
    dirs = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH")
            if os.environ.get(v)]  # fmt: skip
    dirs.append("/usr/local/cuda/include")
    for base in sys.path:
        dirs += sorted(glob.glob(os.path.join(base, "nvidia", "*", "include")))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _open_nvrtc() -> Nvrtc:
    path = _loaded_library("libnvrtc.so")  # not libnvrtc-builtins
    candidates = [path] if path else ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for name in candidates:
        try:
            return Nvrtc(ctypes.CDLL(name), _include_dirs())
        except OSError as e:
            errors.append(str(e))
    raise RuntimeError(f"no NVRTC library found ({'; '.join(errors)})")


_NVRTC: list = []  # [Nvrtc] once opened, [exception] where that failed


def compiler() -> Nvrtc:
    """The process's :class:`Nvrtc` (opened once; raises ``RuntimeError`` where none)."""
    if not _NVRTC:
        try:
            _NVRTC.append(_open_nvrtc())
        except RuntimeError as e:
            _NVRTC.append(e)
    if isinstance(_NVRTC[0], Exception):
        raise _NVRTC[0]
    return _NVRTC[0]


def cache_dir() -> str:
    """``CHUNKSCAN_CUDA_CACHE`` (``~`` expanded; blank is unset), else
    ``$XDG_CACHE_HOME/chunkscan/cuda`` (an absolute one: a relative one is ignored, as
    the XDG specification says), else ``~/.cache/chunkscan/cuda``. ``'~/cc'`` was a
    folder named ``~`` in the working directory, ``' '`` a folder named so (found by
    probing)."""
    own = os.environ.get("CHUNKSCAN_CUDA_CACHE", "").strip()
    if own:
        return os.path.expanduser(own)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "chunkscan", "cuda")


def _usable(binary: bytes, kind: str) -> bool:
    """Whether a cached file is a binary of its kind: a cubin an ELF file, PTX text
    that declares its version. An empty or cut file (a crash between the write and the
    rename, a full disk) was returned as it was, at every call, and MLX failed to load
    it with no word of the file (found by probing)."""
    if kind == "ptx":
        return b".version" in binary[:4096]
    return binary[:4] == b"\x7fELF"


def cached_binary(
    source: str, arch: str, compile_fn, version: str, kind: str = "cubin"
) -> tuple[str, bytes]:
    """``(key, binary)`` for ``source`` on ``sm_<arch>``: read from :func:`cache_dir`,
    else ``compile_fn(source, arch)`` and written there (atomically; a cache that
    cannot be written is skipped). ``key`` hashes the source, the architecture, the
    compiler's version and ``kind`` (``"cubin"`` or ``"ptx"``, the file's suffix)."""
    key = hashlib.sha256(f"{version}\0{arch}\0{kind}\0{source}".encode()).hexdigest()[:20]
    path = os.path.join(cache_dir(), f"{key}.{kind}")
    try:
        with open(path, "rb") as fh:
            binary = fh.read()
        if _usable(binary, kind):
            return key, binary
    except OSError:
        pass
    binary = compile_fn(source, arch)
    # per process and thread: two threads of one process shared the name (probing)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(binary)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a failed write left its file (probing)
            os.remove(tmp)
    return key, binary


def _write_source(source: str, symbol: str) -> str:
    """``source`` written to ``<cache>/src/<symbol>.cu`` (CHUNKSCAN_CUDA_LINEINFO=1);
    its absolute path."""
    path = os.path.abspath(os.path.join(cache_dir(), "src", f"{symbol}.cu"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(source)
    return path


def device_arch() -> str:
    """The default CUDA device's compute capability as ``"90"`` (for ``sm_90``): from
    ``mx.device_info()``, else the driver."""
    cc = _backend.compute_capability() or _backend._driver_attributes(
        _backend._default_index(), (_backend._ATTR_CC_MAJOR, _backend._ATTR_CC_MINOR)
    )
    if cc is None:
        raise RuntimeError("the device's compute capability is unknown")
    return f"{cc[0]}{cc[1]}"


class Kernel:
    """A callable with ``mx.fast.cuda_kernel``'s call signature that runs the kernel
    precompiled (see the module docstring); ``fallback()`` builds MLX's own kernel, used
    from the first failure on."""

    def __init__(self, name, input_names, output_names, source, header, shared_memory,
                 fallback) -> None:  # fmt: skip
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header, self.shared_memory = source, header, shared_memory
        self._fallback, self._mlx = fallback, None
        self._binaries: dict[tuple, tuple[str, bytes]] = {}
        self.shaped = shape_inputs(source, input_names)

    def binary(self, inputs, template, output_dtypes) -> tuple[str, bytes]:
        """``(symbol, cubin)`` for a call's dtypes, ranks and template on the default
        device's architecture (a process may use GPUs of more than one)."""
        arch = _backend.once_per_block("<arch>", device_arch)
        # Lists, not generators, into the key: 9 launches build it at every call. The
        # line-information switch too: set after a first build, it was ignored (the
        # binary without it launched, no source written; found by probing).
        spec = (arch, tuple([x.dtype for x in inputs]), tuple([x.ndim for x in inputs]),
                tuple(output_dtypes), tuple([(n, v) for n, v in template]),
                line_info())  # fmt: skip
        hit = self._binaries.get(spec)
        if hit is None:
            nvrtc = compiler()
            # The symbol carries a hash of the source: MLX caches modules by name.
            probe = build_source("SYMBOL", self.header, self.source,
                                 [(n, x.dtype, x.ndim) for n, x in zip(self.input_names, inputs)],
                                 list(zip(self.output_names, output_dtypes)), template)  # fmt: skip
            digest = hashlib.sha256(probe.encode()).hexdigest()[:16]
            symbol = f"{self.name}_{digest}"
            src = probe.replace("void SYMBOL(", f"void {symbol}(", 1)
            kind, version = mode(), nvrtc.version
            compile_fn = functools.partial(nvrtc.compile, ptx=kind == "ptx")
            if line_info():
                path = _write_source(src, symbol)
                compile_fn = functools.partial(compile_fn, source_path=path)
                version += "+lineinfo"  # its own cache key
            hit = (symbol, cached_binary(src, arch, compile_fn, version, kind)[1])
            self._binaries[spec] = hit
        return hit

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        if self._mlx is None:
            try:
                symbol, cubin = self.binary(inputs, template, output_dtypes)
                scalars = [int(d) for n, x in zip(self.input_names, inputs)
                           if n in self.shaped for d in x.shape]  # fmt: skip
                return mx.fast.precompiled_cuda_kernel(
                    name=symbol, compiled_source=cubin, inputs=inputs,
                    output_shapes=output_shapes, output_dtypes=output_dtypes,
                    scalars=scalars, grid=grid, threadgroup=threadgroup,
                    shared_memory=self.shared_memory, ensure_row_contiguous=True,
                )  # fmt: skip
            except (RuntimeError, ValueError, AttributeError, OSError) as e:
                _warn_once(self.name, e)
                self._mlx = self._fallback()
        return self._mlx(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                         output_shapes=output_shapes, output_dtypes=output_dtypes)  # fmt: skip


_WARNED: set = set()


def _warn_once(name: str, error: Exception) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"[chunkscan] compiling the CUDA kernel {name} ourselves failed ({error}); "
            f"mx.fast.cuda_kernel builds it instead (slower first call). "
            f"CHUNKSCAN_CUDA_PRECOMPILE=0 skips the attempt.",
            RuntimeWarning,
            stacklevel=3,
        )
