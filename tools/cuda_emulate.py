"""Run an ``mx.fast.cuda_kernel`` source on the CPU, one thread per CUDA thread.

A development aid, not a CUDA implementation: the kernel's source (the same string the
package hands to MLX) is compiled with the host C++ compiler into a program in which
every CUDA thread of a block is an OS thread, ``__syncthreads()`` is a barrier, the
block's dynamic shared memory is one buffer, and the blocks of the grid run one after
another. It runs the *logic* of a kernel (indexing, barriers, arithmetic) where no GPU
is reachable, so that a device run is not spent on an indexing bug. It does not
emulate warps: kernels that use warp shuffles, ``cp.async``, tensor cores or rely on
lock-step execution cannot run here (the emulated kernels use none of these).

Supported in kernel sources: ``threadIdx``, ``blockIdx``, ``blockDim``, ``gridDim``,
``__syncthreads``, dynamic shared memory through ``CS_DYN_SMEM(name)`` (the kernels'
header defines it for CUDA as ``extern __shared__ float name[]``), float math from
``<cmath>``, ``__nv_bfloat16`` / ``__half`` storage with float conversions, and
input dtypes float32, bfloat16, float16, int32 and bool.

    outs = run(name, header, source, inputs, outputs, template, grid, threadgroup, smem)

``inputs``: ``[(name, mx.array)]``; ``outputs``: ``[(name, shape, mx.Dtype)]``;
``template``: ``[(name, int | bool | mx.Dtype)]``; ``grid`` counts threads, as in MLX.
Outputs start zero-filled (MLX's outputs start uninitialised: kernels must write every
element they own), shared memory NaN-filled before each block. Where the compiler has
AddressSanitizer the program is built with it: an access past an input, an output or
the dynamic shared memory stops the run with the sanitizer's report. Needs ``g++``
(C++20).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

import mlx.core as mx
import numpy as np

_CACHE = os.path.join(tempfile.gettempdir(), "chunkscan_cuda_emulate")

_TYPES = {
    mx.float32: ("float", np.float32, None),
    mx.bfloat16: ("__nv_bfloat16", np.uint16, mx.uint16),
    mx.float16: ("__half", np.float16, None),
    mx.int32: ("int32_t", np.int32, None),
    mx.bool_: ("bool", np.bool_, None),
}

_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#define CS_EMULATE 1
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __grid_constant__
struct cs_dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local cs_dim3 threadIdx, blockIdx;
static cs_dim3 blockDim, gridDim;
static std::barrier<>* cs_barrier = nullptr;
static float* cs_smem_base = nullptr;
inline void __syncthreads() { cs_barrier->arrive_and_wait(); }
#define CS_DYN_SMEM(name) float* name = cs_smem_base
struct __nv_bfloat16 {
  uint16_t bits = 0;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if (std::isnan(f)) { bits = 0x7fc0; return; }
    u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
    bits = static_cast<uint16_t>(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
  }
};
using __half = _Float16;
using std::isfinite;
using std::isnan;
"""

_MAIN = r"""
static std::vector<char> cs_read(const char* path, size_t n) {
  std::vector<char> b(n);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(b.data(), 1, n, f) != n) {
    std::fprintf(stderr, "read %%s\n", path); std::exit(2);
  }
  std::fclose(f);
  return b;
}
int main(int argc, char** argv) {
  const char* dir = argv[1];
  char path[4096];
%(READS)s
  blockDim = {%(TX)d, %(TY)d, %(TZ)d};
  gridDim = {%(GX)d, %(GY)d, %(GZ)d};
  const int nt = %(TX)d * %(TY)d * %(TZ)d;
  std::vector<float> smem((%(SMEM)d + 3) / 4);  // exact: AddressSanitizer sees overflows
  cs_smem_base = smem.data();
  std::barrier<> bar(nt);
  cs_barrier = &bar;
  std::vector<std::thread> threads;
  for (int t = 0; t < nt; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = {unsigned(t %% %(TX)d), unsigned((t / %(TX)d) %% %(TY)d),
                   unsigned(t / (%(TX)d * %(TY)d))};
      for (unsigned bz = 0; bz < gridDim.z; ++bz)
        for (unsigned by = 0; by < gridDim.y; ++by)
          for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            blockIdx = {bx, by, bz};
            if (t == 0) std::fill(smem.begin(), smem.end(), std::nanf(""));
            bar.arrive_and_wait();
            cs_kernel(%(ARGS)s);
            bar.arrive_and_wait();
          }
    });
  }
  for (auto& th : threads) th.join();
%(WRITES)s
  return 0;
}
"""


def _ctype(dtype: mx.Dtype) -> str:
    if dtype not in _TYPES:
        raise TypeError(f"[cuda_emulate] unsupported dtype {dtype}")
    return _TYPES[dtype][0]


def build(header, source, inputs, outputs, template, grid, threadgroup, smem) -> str:
    """The C++ program (see the module docstring)."""
    params, args, reads, writes = [], [], [], []
    for i, (name, arr) in enumerate(inputs):
        ct = _ctype(arr.dtype)
        params.append(f"const {ct}* {name}")
        args.append(f"reinterpret_cast<const {ct}*>(in{i}.data())")
        reads.append(
            f'  std::snprintf(path, sizeof path, "%s/in{i}", dir);\n'
            f"  auto in{i} = cs_read(path, {arr.nbytes});"
        )
    for i, (name, shape, dtype) in enumerate(outputs):
        ct = _ctype(dtype)
        size = int(np.prod(shape)) * dtype.size
        params.append(f"{ct}* {name}")
        args.append(f"reinterpret_cast<{ct}*>(out{i}.data())")
        reads.insert(0, f"  std::vector<char> out{i}({size}, 0);")
        writes.append(
            f'  std::snprintf(path, sizeof path, "%s/out{i}", dir);\n'
            f'  {{ FILE* f = std::fopen(path, "wb"); std::fwrite(out{i}.data(), 1, {size}, f); '
            f"std::fclose(f); }}"
        )
    consts = []
    for name, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};")
        else:
            consts.append(f"  using {name} = {_ctype(value)};")
    blocks = [g // t for g, t in zip(grid, threadgroup)]
    fields = dict(
        READS="\n".join(reads), WRITES="\n".join(writes), ARGS=", ".join(args),
        TX=threadgroup[0], TY=threadgroup[1], TZ=threadgroup[2],
        GX=blocks[0], GY=blocks[1], GZ=blocks[2], SMEM=smem,
    )  # fmt: skip
    kernel = (
        "static void cs_kernel(" + ", ".join(params) + ") {\n"
        + "\n".join(consts) + "\n" + source + "\n}\n"
    )  # fmt: skip
    return _PRELUDE + header + "\n" + kernel + _MAIN % fields


def available() -> bool:
    return shutil.which("g++") is not None


_ASAN: list[bool] = []


def _sanitizer_flags() -> list[str]:
    """AddressSanitizer where the compiler has it: a kernel that reads or writes past
    an input, an output or its dynamic shared memory stops with a report."""
    if not _ASAN:
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "probe.cpp")
            with open(src, "w") as fh:
                fh.write("int main() { return 0; }\n")
            cmd = ["g++", "-fsanitize=address", src, "-o", os.path.join(d, "probe")]
            ok = subprocess.run(cmd, capture_output=True).returncode == 0
            ok = ok and subprocess.run([os.path.join(d, "probe")], env=_ENV).returncode == 0
        _ASAN.append(ok)
    return ["-fsanitize=address", "-fno-omit-frame-pointer"] if _ASAN[0] else []


_ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}


def run(name, header, source, inputs, outputs, template, grid, threadgroup, smem):
    """Compile (cached by source) and run; returns the outputs as MLX arrays."""
    del name
    if any(g % t for g, t in zip(grid, threadgroup)):
        raise ValueError(f"[cuda_emulate] grid {grid} is not a multiple of {threadgroup}")
    prog = build(header, source, inputs, outputs, template, grid, threadgroup, smem)
    os.makedirs(_CACHE, exist_ok=True)
    key = hashlib.sha1((prog + " ".join(_sanitizer_flags())).encode()).hexdigest()[:16]
    exe = os.path.join(_CACHE, key)
    if not os.path.exists(exe):
        src = exe + ".cpp"
        with open(src, "w") as fh:
            fh.write(prog)
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-w", *_sanitizer_flags(), src, "-o",
               exe + ".tmp"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"[cuda_emulate] g++ failed:\n{res.stderr[:6000]}")
        os.replace(exe + ".tmp", exe)
    with tempfile.TemporaryDirectory() as d:
        for i, (_, arr) in enumerate(inputs):
            view = _TYPES[arr.dtype][2]
            data = np.array(arr.view(view) if view is not None else arr)
            data.astype(_TYPES[arr.dtype][1], copy=False).tofile(os.path.join(d, f"in{i}"))
        res = subprocess.run([exe, d], capture_output=True, text=True, env=_ENV)
        if res.returncode:
            raise RuntimeError(f"[cuda_emulate] kernel run failed: {res.stderr[:3000]}")
        outs = []
        for i, (_, shape, dtype) in enumerate(outputs):
            raw = np.fromfile(os.path.join(d, f"out{i}"), dtype=_TYPES[dtype][1])
            arr = mx.array(raw.reshape(shape))
            outs.append(arr.view(dtype) if _TYPES[dtype][2] is not None else arr)
        return outs
