"""Which backend's fused kernels the ops use (one rule for every op).

An op with CUDA kernels (the Gated DeltaNet state passes, attention's forward and
backward) uses them when the default device is a CUDA GPU, unless switched off: by the
op's argument
``kernels=False``, or for every op by the environment variable
``CHUNKSCAN_CUDA_KERNELS=0`` (read at each call). ``kernels=True`` asks for the kernel
where the backend has one; elsewhere the portable path runs.
"""

from __future__ import annotations

import os

import mlx.core as mx


def check_kernels(fn: str, kernels: object) -> None:
    """Raise unless ``kernels`` is ``True``, ``False`` or ``None`` (``kernels=0`` or
    ``"no"`` would otherwise read as a request for the kernels)."""
    if kernels is not None and not isinstance(kernels, bool):
        raise TypeError(
            f"[{fn}] kernels must be True, False or None but got {kernels!r} "
            f"({type(kernels).__name__}). Pass kernels=False for the portable ops, or None "
            f"(the default) for the CUDA kernels where they apply."
        )


def use_kernels(kernels: bool | None = None, fn: str = "chunkscan") -> bool:
    """Whether the fused CUDA kernels are used: ``kernels`` if given, else on when the
    default device is a CUDA GPU and ``CHUNKSCAN_CUDA_KERNELS`` is not ``0``
    (:func:`check_kernels` first)."""
    check_kernels(fn, kernels)
    if kernels is False:
        return False
    if os.environ.get("CHUNKSCAN_CUDA_KERNELS", "1") == "0" and kernels is None:
        return False
    return cuda_device()


def cuda_device() -> bool:
    """Whether the default device is a CUDA GPU."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


_CUDA_KERNELS: dict[tuple, object] = {}

# Where every kernel of the package runs: None, ``mx.fast.cuda_kernel``; the tests set it
# to ``tools/cuda_emulate.py``'s ``run`` to run the kernel sources on the CPU.
RUNNER = None


def cuda_kernel(
    fn: str,
    name: str,
    inputs: list[str],
    outputs: list[str],
    source: str,
    header: str,
    shared_memory: int,
):
    """``mx.fast.cuda_kernel`` built once per (name, shared memory, header, source): MLX
    fixes the dynamic shared memory at construction and caches the compiled module per
    source, i.e. per template. Raises ``RuntimeError`` naming ``fn`` where MLX has no CUDA
    back-end (construction fails there, not only the call). With :data:`RUNNER` set, a
    callable with the kernel's call signature that hands everything to it instead."""
    if RUNNER is not None:
        return _through_runner(RUNNER, name, inputs, outputs, source, header, shared_memory)
    key = (name, shared_memory, header, source)
    kernel = _CUDA_KERNELS.get(key)
    if kernel is None:
        try:
            kernel = mx.fast.cuda_kernel(
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
