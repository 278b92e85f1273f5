"""Which backend's fused kernels the ops use (one rule for every op).

An op with CUDA kernels (the Gated DeltaNet state passes, attention's forward and
backward) uses them when the default device is a CUDA GPU, unless switched off: by the
op's argument
``kernels=False``, or for every op by the environment variable
``CHUNKSCAN_CUDA_KERNELS=0`` (read at each call). ``kernels=True`` asks for the kernel
where the backend has one; elsewhere the portable path runs.

Each op takes its kernels only for calls whose kernels fit the device: their shared
memory per block within :func:`cuda_limits` (asked of the CUDA driver), so a GPU with
less shared memory than an H100 (an A100, consumer GPUs) gets the kernels that fit
and the portable ops for the rest instead of a launch failure.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from .split import np_bool

# The settings an op reads "at each call" are read once per call: inside
# settings_read_once(), getenv() and cuda_device() keep what they found (per thread) until
# the outermost block ends. An eager Gated DeltaNet fwd+bwd asked the environment about
# a hundred times (a fifth of its Python, bench/graph_build.py), all before its first
# kernel could start.
_CALL = threading.local()


@contextlib.contextmanager
def settings_read_once(read: dict | None = None) -> Iterator[None]:
    """Within this block (nested blocks share the outermost one's), each environment
    variable (:func:`getenv`) and the default device's kind (:func:`cuda_device`) are
    read once; a change to either takes effect at the next block. ``read``: what an
    earlier block read (:func:`settings_in_effect`), taken as read here: a call's
    backward block reads what its forward's did (one plan per call, and half the reads
    of an eager fwd+bwd)."""
    if getattr(_CALL, "memo", None) is not None:
        yield
        return
    _CALL.memo = {} if read is None else read
    try:
        yield
    finally:
        _CALL.memo = None


def settings_in_effect() -> dict | None:
    """What the current :func:`settings_read_once` block has read (it grows as the block
    reads more; plain values only), ``None`` outside a block."""
    return getattr(_CALL, "memo", None)


def reads_settings_once(fn):
    """``fn`` run inside :func:`settings_read_once` (its name and docstring kept)."""
    return reads_settings_of(None)(fn)


def reads_settings_of(read: dict | None):
    """A decorator: ``fn`` run inside ``settings_read_once(read)`` (a custom function's
    vjp, given what its forward read)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with settings_read_once(read):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def once_per_block(key: object, read, *args):
    """``read(*args)``, kept under ``key`` until the :func:`settings_read_once` block
    ends (outside any block, read every time): what a call works out from its settings
    alone. ``key`` must be no variable's name (:func:`getenv` keeps those here)."""
    memo = getattr(_CALL, "memo", None)
    if memo is None:
        return read(*args)
    if key not in memo:
        memo[key] = read(*args)
    return memo[key]


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read once per :func:`settings_read_once`."""
    # once_per_block's lookup written out, one call layer fewer: an eager Gated DeltaNet
    # fwd+bwd asks about a hundred times (bench/graph_build.py).
    memo = getattr(_CALL, "memo", None)
    if memo is None:
        value = os.environ.get(name)
    elif name in memo:
        value = memo[name]
    else:
        value = memo[name] = os.environ.get(name)
    return default if value is None else value


def check_kernels(fn: str, kernels: object) -> None:
    """Raise unless ``kernels`` is ``True``, ``False`` (a NumPy bool too, as every
    other switch takes: ``np.False_`` was refused as "not True, False or None"; found by
    probing) or ``None`` (``kernels=0`` or ``"no"`` would otherwise read as a request
    for the kernels)."""
    if kernels is None or isinstance(kernels, bool):  # the usual case, asked first
        return
    if not isinstance(kernels, np_bool()):
        raise TypeError(
            f"[{fn}] kernels must be True, False or None but got {kernels!r} "
            f"({type(kernels).__name__}). Pass kernels=False for the portable ops, or None "
            f"(the default) for the CUDA kernels where they apply."
        )


def plain_int(text: str) -> int:
    """``int(text)`` for ASCII digits with an optional sign (surrounding blanks
    allowed) only: ``int`` also reads ``1_0`` (as 10) and other scripts' digits. A
    ``ValueError`` otherwise. (``bench/_common.py`` keeps its own: it imports no MLX.)"""
    if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) is None:
        raise ValueError(f"not a plain integer: {text!r}")
    return int(text)


def env_int(name: str, fn: str, what: str, allowed: tuple[int, ...] | None = None) -> int | None:
    """The environment variable ``name`` as an int (``None`` where unset or empty), one
    of ``allowed`` where given; anything else raises a ``ValueError`` that names the
    variable, ``fn`` and ``what`` it means (e.g. ``"a whole number of MiB such as
    1024"``, ``"32, 64 or 128"``)."""
    text = getenv(name, "").strip()
    if not text:
        return None
    try:
        value = plain_int(text)
    except ValueError:
        raise ValueError(
            f"[{fn}] the environment variable {name} must be {what} but is {text!r}. "
            f"Set it to such a number, or unset it for the default."
        ) from None
    if allowed is not None and value not in allowed:
        raise ValueError(
            f"[{fn}] the environment variable {name} must be {what} but is {value}. "
            f"Set it to one of those, or unset it for the default."
        )
    return value


def env_group_mib(name: str, fn: str) -> int | None:
    """The environment variable ``name`` as a group budget in MiB, at least 1 (``None``
    where unset); anything else raises a ``ValueError`` naming it and ``fn`` (a zero
    would read as one-chunk groups, the slowest form)."""
    mib = env_int(name, fn, "a whole number of MiB such as 1024")
    if mib is not None and mib < 1:
        raise ValueError(
            f"[{fn}] the environment variable {name} must be at least 1 (MiB of one "
            f"group's scratch) but is {mib}. Set a budget such as 1024, or unset it for "
            f"the default."
        )
    return mib


def env_choice(name: str, fn: str, choices: tuple[str, ...], what: str) -> str | None:
    """The environment variable ``name`` as one of ``choices`` (``None`` where unset or
    empty); anything else raises a ``ValueError`` that names the variable, ``fn`` and
    ``what`` the choices mean."""
    text = getenv(name, "").strip()
    if not text:
        return None
    if text not in choices:
        raise ValueError(
            f"[{fn}] the environment variable {name} must be {what} but is {text!r}. "
            f"Set it to one of those, or unset it for the default."
        )
    return text


def env_switch(name: str, fn: str, what: str) -> bool | None:
    """An ``auto`` / ``0`` / ``1`` environment variable (:func:`env_choice`): ``True``
    for ``1``, ``False`` for ``0``, ``None`` for ``auto``, unset or empty (the caller's
    default)."""
    value = env_choice(name, fn, ("auto", "0", "1"), what)
    return None if value in (None, "auto") else value == "1"


def use_kernels(kernels: bool | None = None, fn: str = "chunkscan") -> bool:
    """Whether the fused CUDA kernels are used: ``kernels`` if given, else on when the
    default device is a CUDA GPU and ``CHUNKSCAN_CUDA_KERNELS`` is not ``0``
    (:func:`check_kernels` first; any value but ``0``, ``1``, ``auto`` or empty
    raises)."""
    check_kernels(fn, kernels)
    if kernels is not None and not kernels:
        return False
    # "false" or "off" used to keep the kernels on: env_switch raises for them.
    if kernels is None and env_switch(
        "CHUNKSCAN_CUDA_KERNELS", fn,
        "0 (the portable MLX ops) or 1 / auto (the CUDA kernels where they apply, the "
        "default)",
    ) is False:  # fmt: skip
        return False
    return cuda_device()


def cuda_device() -> bool:
    """Whether the default device is a CUDA GPU (asked once per
    :func:`settings_read_once`)."""
    return once_per_block("<cuda>", _ask_cuda_device)


def _ask_cuda_device() -> bool:
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def tf32_products(fn: str = "chunkscan") -> bool:
    """Whether the kernels may multiply float32 operands in TF32 (one tensor-core
    product, each operand rounded to 10 mantissa bits, float32 sums), by
    ``CHUNKSCAN_GDN_TF32`` (read at each call): ``1`` yes, ``0`` no, ``auto`` or unset:
    as MLX's own float32 matmuls on this device, that is on a CUDA GPU unless
    ``MLX_ENABLE_TF32`` reads as 0 by C's ``atoi`` (``0``, but also ``""``, ``false``,
    ``off``: :func:`c_atoi`; MLX's default is TF32 there; it reads the variable once per
    process, this at each call). Elsewhere (the CPU, the emulator) auto is float32."""
    forced = env_switch(
        "CHUNKSCAN_GDN_TF32", fn,
        "auto (TF32 products where MLX multiplies float32 in TF32: CUDA with "
        "MLX_ENABLE_TF32 unset or not 0, the default), 1 (always) or 0 (float32 products)",
    )  # fmt: skip
    if forced is not None:
        return forced
    if not cuda_device():
        return False
    text = getenv("MLX_ENABLE_TF32")
    return True if text is None else c_atoi(text) != 0


def c_atoi(text: str) -> int:
    """C's ``atoi(text)`` as glibc computes it on a 64-bit machine, which is how MLX
    reads its integer variables (``env::get_var``): leading blanks, a sign and the
    digits up to the first other character; no digits is 0 (``""``, ``"false"``,
    ``"off"``: so ``MLX_ENABLE_TF32=false`` turns MLX's TF32 off, and it must turn ours
    off too; found by probing); ``strtol``'s saturation, then the cut to 32 bits."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    if m is None:
        return 0
    n = max(-(2**63), min(2**63 - 1, int(m.group(1))))
    return (n + 2**31) % 2**32 - 2**31


_CUDA_KERNELS: dict[tuple, object] = {}

# Where every kernel of the package runs: None, ``mx.fast.cuda_kernel``; the tests set it
# to ``tools/cuda_emulate.py``'s ``run`` to run the kernel sources on the CPU.
RUNNER = None

# The kernels' inputs that carry nothing: one array for every launch and every call, so a
# group adds no fill op (the slots a launch does not read: UNUSED), and one float32 scalar
# array per value (a kernel's parameters: param). Made from Python data, so they hold
# data and no graph: MLX evaluates an array only in the thread whose stream made it, and
# a lazy mx.zeros made at import failed every kernel call of another thread (training in
# a worker thread; found by probing, session 54).
UNUSED = mx.array([0.0] * 4, dtype=mx.float32)
_PARAMS: dict[float, mx.array] = {}


def param(x: float) -> mx.array:
    """``[x]`` as a float32 array, the same array for every launch with that value."""
    a = _PARAMS.get(x)
    if a is None:
        a = _PARAMS[x] = mx.array([x], dtype=mx.float32)
    return a


def cuda_kernel(
    fn: str,
    name: str,
    inputs: list[str],
    outputs: list[str],
    source: str,
    header: str,
    shared_memory: int,
):
    """The kernel ``name`` as a callable with ``mx.fast.cuda_kernel``'s call signature,
    built once per (name, shared memory, header, source). By default it is compiled by
    :mod:`chunkscan._precompile` (our NVRTC call, a disk cache, no MLX header: a first
    call in seconds, not tens of seconds) and falls back to ``mx.fast.cuda_kernel``;
    with ``CHUNKSCAN_CUDA_PRECOMPILE=0``, ``mx.fast.cuda_kernel`` alone (MLX fixes the
    dynamic shared memory at construction and compiles each template once per process).
    Raises ``RuntimeError`` naming ``fn`` where MLX has no CUDA back-end. With
    :data:`RUNNER` set, everything goes to it instead."""
    if RUNNER is not None:
        return _through_runner(RUNNER, name, inputs, outputs, source, header, shared_memory)
    mode = _precompile.mode()
    key = (name, shared_memory, header, source, mode)
    kernel = _CUDA_KERNELS.get(key)
    if kernel is None:

        def mlx_kernel():
            try:
                return mx.fast.cuda_kernel(
                    name=name,
                    input_names=inputs,
                    output_names=outputs,
                    source=source,
                    header=header,
                    ensure_row_contiguous=True,
                    shared_memory=shared_memory,
                )
            except Exception as e:  # no CUDA back-end (CPU-only MLX)
                raise RuntimeError(f"[{fn}] the CUDA kernel is unavailable: {e}") from e

        if mode == "0" or not cuda_device():
            kernel = mlx_kernel()
        else:
            kernel = _precompile.Kernel(
                name, inputs, outputs, source, header, shared_memory, mlx_kernel
            )
        _CUDA_KERNELS[key] = kernel
    return kernel


def _through_runner(runner, name, input_names, output_names, source, header, shared_memory):
    """A callable with ``mx.fast.cuda_kernel``'s call signature that runs the kernel
    through ``runner`` (see :data:`RUNNER`)."""

    def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        return runner(
            name, header, source, list(zip(input_names, inputs)),
            list(zip(output_names, output_shapes, output_dtypes)), template, grid,
            threadgroup, shared_memory,
        )  # fmt: skip

    return call


@dataclass(frozen=True)
class CudaLimits:
    """What the kernels' launch configurations depend on, for one CUDA device.

    ``smem_per_block``: the opt-in maximum of dynamic shared memory per block (bytes);
    ``smem_per_sm``: shared memory per multiprocessor; ``sm_count``: multiprocessors;
    ``source``: where the figures come from (``"driver"``, ``"compute capability X.Y"``,
    ``"no CUDA device"`` or ``"unknown GPU"``)."""

    smem_per_block: int
    smem_per_sm: int
    sm_count: int
    source: str


# Per compute capability (the CUDA programming guide's table): opt-in shared memory per
# block and per multiprocessor, KiB. Only used where the driver cannot be asked.
_SMEM_KIB_BY_CC = {
    (8, 0): (163, 164), (8, 6): (99, 100), (8, 7): (163, 164), (8, 9): (99, 100),
    (9, 0): (227, 228), (10, 0): (227, 228), (10, 3): (227, 228), (12, 0): (99, 100),
    (12, 1): (99, 100),
}  # fmt: skip
# No CUDA device (the CPU emulator runs the kernels): an H100 / H200 SXM, the device the
# kernels were tuned and tested on. An unknown GPU: the smallest of the table.
_SM90 = CudaLimits(227 * 1024, 228 * 1024, 132, "no CUDA device")
_SMALLEST = CudaLimits(99 * 1024, 100 * 1024, 132, "unknown GPU")

# The CUDA driver API's device attributes (cuda.h, CUdevice_attribute).
_ATTR_SM_COUNT, _ATTR_SMEM_PER_SM, _ATTR_SMEM_PER_BLOCK_OPTIN = 16, 81, 97
_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76


def cuda_limits() -> CudaLimits:
    """The shared-memory limits and multiprocessor count of the default CUDA device (see
    :class:`CudaLimits`), asked once of the CUDA driver (``libcuda``); where that fails,
    from the compute capability that ``mx.device_info()`` reports, and else the smallest
    limits of any GPU MLX supports. Without a CUDA device: an H200's (for the emulator)."""
    if not cuda_device():
        return _SM90
    index = _default_index()
    limits = _LIMITS.get(index)
    if limits is None:
        limits = _driver_limits(index) or _limits_from_device_info() or _SMALLEST
        _LIMITS[index] = limits
    return limits


_LIMITS: dict[int, CudaLimits] = {}


def _default_index() -> int:
    """The default device's index (asked once per :func:`settings_read_once`: the text
    match below took a tenth of an eager fwd+bwd's Python on the H200, run 86)."""
    return once_per_block("<index>", lambda: _device_index(mx.default_device()))


def _device_index(device) -> int:
    """The index of an ``mx.Device`` (``Device(gpu, 1)`` -> 1; MLX's Python binding has
    no attribute for it), 0 where its text has none."""
    m = re.search(r",\s*(\d+)\)\s*$", str(device))
    return int(m.group(1)) if m else 0


def _driver_attributes(index: int, attrs: tuple[int, ...], lib=None) -> list[int] | None:
    """The CUDA driver's device attributes ``attrs`` (``CUdevice_attribute`` values) of
    device ``index``; ``None`` where the driver library or a call fails, or a value is not
    positive. ``lib``: a loaded ``libcuda`` (tests pass a fake)."""
    import ctypes

    try:
        if lib is None:
            lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
            return None
        values = []
        for attr in attrs:
            v = ctypes.c_int()
            if lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev) != 0 or v.value <= 0:
                return None
            values.append(v.value)
    except (OSError, AttributeError):
        return None
    return values


def _driver_limits(index: int, lib=None) -> CudaLimits | None:
    """:class:`CudaLimits` from the CUDA driver for device ``index`` (``None`` where the
    driver library or a call fails); ``lib``: a loaded ``libcuda`` (tests pass a fake)."""
    attrs = (_ATTR_SMEM_PER_BLOCK_OPTIN, _ATTR_SMEM_PER_SM, _ATTR_SM_COUNT)
    values = _driver_attributes(index, attrs, lib)
    return None if values is None else CudaLimits(*values, source="driver")


def compute_capability(info: dict | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of the default device from ``mx.device_info()`` (or ``info``),
    ``None`` where it reports none. On a CUDA device it is asked once per device and
    kept: MLX's ``device_info()`` there also reads the device's free memory (through
    NVML) at every call, and launches ask for the capability every time."""
    if info is None and cuda_device():
        return _kept_per_device(_CAPABILITY, lambda: _read_capability(None))
    return _read_capability(info)


_CAPABILITY: dict[int, tuple[int, int] | None] = {}


def _kept_per_device(cache: dict, read):
    """``read()`` for the default device, asked once per device and kept in ``cache``."""
    index = _default_index()
    if index not in cache:
        cache[index] = read()
    return cache[index]


def cuda_memory_bytes(info: dict | None = None) -> int | None:
    """The default CUDA device's total memory in bytes, from ``mx.device_info()`` (or
    ``info``; its ``total_memory`` or ``memory_size``), asked once per device and kept
    as :func:`compute_capability` is; ``None`` without a CUDA device or the figure."""
    if info is None:
        if not cuda_device():
            return None
        return _kept_per_device(_MEMORY, lambda: cuda_memory_bytes(_device_info()))
    for key in ("total_memory", "memory_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


_MEMORY: dict[int, int | None] = {}


def _device_info() -> dict:
    try:
        return dict(mx.device_info())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return {}


def _read_capability(info: dict | None) -> tuple[int, int] | None:
    info = _device_info() if info is None else info
    try:
        return int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    except (KeyError, TypeError, ValueError):
        return None


def _limits_from_device_info(info: dict | None = None) -> CudaLimits | None:
    """:class:`CudaLimits` from the compute capability in ``mx.device_info()`` (``None``
    where it is missing or not in the table)."""
    cc = compute_capability(info)
    if cc is None:
        return None
    kib = _SMEM_KIB_BY_CC.get(cc)
    if kib is None:
        return None
    return CudaLimits(kib[0] * 1024, kib[1] * 1024, 132, f"compute capability {cc[0]}.{cc[1]}")


# Last: _precompile reads this module's functions at call time (an import here, at the
# top of each launch, took about a microsecond per launch).
from . import _precompile  # noqa: E402
