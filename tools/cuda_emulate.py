"""Run an ``mx.fast.cuda_kernel`` source on the CPU, one thread per CUDA thread.

A development aid, not a CUDA implementation: the kernel's source (the same string the
package hands to MLX) is compiled with the host C++ compiler into a program in which
every CUDA thread of a block is an OS thread, ``__syncthreads()`` is a barrier, the
block's dynamic shared memory is one buffer, and the blocks of the grid run one after
another. It runs the *logic* of a kernel (indexing, barriers, arithmetic) where no GPU
is reachable, so that a device run is not spent on an indexing bug. Warps are
emulated only through the calls listed below: code that relies on lock-step execution
without them, or uses inline PTX other than ``cp.async`` copies (16 or 4 bytes) behind a
helper function and their ``commit_group`` / ``wait_group N``, cannot run here. A copy
lands at its group's wait, not before (session 39; they landed at once before): a read
that runs ahead of its copy's wait, or of the barrier after the copying thread's wait,
reads the old contents. ``COPIES_LAND = "at issue"`` lands them at once, as before,
which shows the other race instead: a copy issued before every thread has read the
buffer it overwrites.

Supported in kernel sources: ``threadIdx``, ``blockIdx``, ``blockDim``, ``gridDim``,
``__syncthreads``, ``__syncthreads_or``, ``__syncwarp``, ``__shfl_xor_sync``,
``__shfl_up_sync``, ``__shfl_sync`` (each warp has a barrier of its own),
``cs_emu_allgather`` (every lane's value, for a kernel's own emulated form of a
warp-wide instruction), ``float2``, dynamic shared memory
(``extern __shared__ T name[];`` or ``CS_DYN_SMEM(name)``), ``nvcuda::wmma`` fragments
used through ``fill_fragment``, ``load_matrix_sync``, ``mma_sync`` and
``store_matrix_sync`` (every lane holds the whole tile; ``precision::tf32`` fragments,
whose operands lose all but 10 mantissa bits in ``mma_sync``, summed as the H200's
tensor cores sum them, bit for bit, and ``__float_to_tf32``), ``uint4`` / ``float4``
copies, float math from ``<cmath>``, ``__int_as_float`` / ``__float_as_int``,
``__nv_bfloat16`` / ``__half`` storage with float conversions, and input dtypes float32,
bfloat16, float16, int32 and bool.

    outs = run(name, header, source, inputs, outputs, template, grid, threadgroup, smem)

``inputs``: ``[(name, mx.array)]``; ``outputs``: ``[(name, shape, mx.Dtype)]``;
``template``: ``[(name, int | bool | mx.Dtype)]``; ``grid`` counts threads, as in MLX.
Outputs start with every bit set (NaN in float dtypes: MLX's outputs start
uninitialised, so an element a kernel never writes must show), shared memory NaN-filled
before each block. Where the compiler has
AddressSanitizer the program is built with it: an access past an input, an output or
the dynamic shared memory stops the run with the sanitizer's report. Alignment is
CUDA's: ``float4`` / ``uint4`` take 16 bytes, ``float2`` 8 (UndefinedBehaviorSanitizer
stops a misaligned read or write), a ``wmma`` load or store needs a 32-byte aligned
pointer, the shared memory starts 128-byte aligned, and :data:`ODD_INPUTS` places
inputs one element past a 16-byte boundary, as MLX hands a kernel a view at an odd
offset (session 35: the state passes' 16-byte loads of such an initial state, which
faults on a device, ran here). Needs ``g++`` (C++20).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import mlx.core as mx
import numpy as np

from chunkscan._precompile import template_lines  # MLX's template lines, one writer

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
#include <deque>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>
#define CS_EMULATE 1
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
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
#include <algorithm>
using std::max;
using std::min;
#include <atomic>
#include <limits>
#include <type_traits>
namespace cuda { namespace std = ::std; }  // cuda::std::numeric_limits
#include <cstring>
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, sizeof f); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, sizeof x); return x; }
// CUDA's alignment (a vector load from a misaligned address faults on the device; here
// UndefinedBehaviorSanitizer stops the run where the compiler has it)
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
// cp.async of n bytes: both addresses n-byte aligned (PTX). A copy lands only when its
// thread waits for its group, as late as PTX allows: cp.async.commit_group closes the
// thread's open group, cp.async.wait_group N lands every committed group but the N most
// recent, in order. So a read of shared memory before its copy's wait (or before the
// barrier after the copying thread's wait) sees the old contents here, as it may on a
// device. Copies left at the end of a block are dropped.
struct CsCopy { void* dst; const void* src; size_t n; };
thread_local std::vector<CsCopy> cs_cp_open;
thread_local std::deque<std::vector<CsCopy>> cs_cp_groups;
inline void cs_cp_async(void* dst, const void* src, size_t n) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % n) {
    std::fprintf(stderr, "cuda_emulate: cp.async of %zu bytes from %p to %p, misaligned\n", n,
                 src, dst);
    std::abort();
  }
#ifdef CS_CP_AT_ISSUE
  std::memcpy(dst, src, n);
#else
  cs_cp_open.push_back({dst, src, n});
#endif
}
inline void cs_cp_commit() {
  cs_cp_groups.push_back(std::move(cs_cp_open));
  cs_cp_open.clear();
}
inline void cs_cp_wait(size_t pending) {
  while (cs_cp_groups.size() > pending) {
    for (const CsCopy& c : cs_cp_groups.front()) std::memcpy(c.dst, c.src, c.n);
    cs_cp_groups.pop_front();
  }
}
inline void cs_cp_reset() {
  cs_cp_open.clear();
  cs_cp_groups.clear();
}

// Warp-level operations: the 32 threads of a warp meet at a barrier of their own.
static std::vector<std::barrier<>*> cs_warp_barriers;
static double cs_warp_slots[64][32];
static std::atomic<int> cs_block_or{0};
inline int cs_lane() { return int(threadIdx.x) % 32; }
inline int cs_warp() { return int(threadIdx.x) / 32; }
inline void __syncwarp(unsigned = 0xffffffffu) { cs_warp_barriers[cs_warp()]->arrive_and_wait(); }
template <class V> V cs_shfl_from(V v, int src) {  // lane src's v (src outside: own)
  static_assert(sizeof(V) <= sizeof(double), "shuffle of a wider type");
  std::memcpy(&cs_warp_slots[cs_warp()][cs_lane()], &v, sizeof(V));
  __syncwarp();
  V r;
  std::memcpy(&r, &cs_warp_slots[cs_warp()][src >= 0 && src < 32 ? src : cs_lane()], sizeof(V));
  __syncwarp();
  return r;
}
template <class V> V __shfl_xor_sync(unsigned, V v, int lane_mask) {
  return cs_shfl_from(v, cs_lane() ^ lane_mask);
}
template <class V> V __shfl_up_sync(unsigned, V v, int delta) {
  return cs_shfl_from(v, cs_lane() - delta);  // lanes below delta keep their own
}
template <class V> V __shfl_sync(unsigned, V v, int src_lane) {
  return cs_shfl_from(v, src_lane % 32);
}
// Every lane's v, by lane: for emulated forms of warp-wide instructions (such as
// mma.sync with its operands spread over the lanes) that kernels keep behind CS_EMULATE.
// Values of up to 64 bytes (a lane's whole set of fragments: one gather per instruction).
static double cs_warp_wide[64][32][8];
template <class V> void cs_emu_allgather(const V& v, V (&out)[32]) {
  static_assert(sizeof(V) <= sizeof(cs_warp_wide[0][0]), "gather of a wider type");
  std::memcpy(cs_warp_wide[cs_warp()][cs_lane()], &v, sizeof(V));
  __syncwarp();
  for (int i = 0; i < 32; ++i) std::memcpy(&out[i], cs_warp_wide[cs_warp()][i], sizeof(V));
  __syncwarp();
}
inline int __syncthreads_or(int pred) {
  __syncthreads();
  if (pred) cs_block_or.store(1);
  __syncthreads();
  const int r = cs_block_or.load();
  __syncthreads();
  if (threadIdx.x == 0) cs_block_or.store(0);
  __syncthreads();
  return r;
}

// nvcuda::wmma: every lane holds the whole tile (as float); load, store and mma_sync
// act on all of it, so any code that uses fragments only through these calls (and
// fill_fragment) computes what the tensor cores would, in float32 order.
namespace nvcuda { namespace wmma {
namespace precision { struct tf32 {}; }
// float -> tf32 (10 mantissa bits kept), to nearest with ties away from zero, as
// cvt.rna.tf32.f32 does; the tensor cores then read the value as it is
inline float __float_to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
struct row_major {}; struct col_major {};
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
  static constexpr int ROWS = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int COLS = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = ROWS * COLS;
  float x[ROWS * COLS];
};
template <class U, int M, int N, int K, class T, class L, class V>
inline void fill_fragment(fragment<U, M, N, K, T, L>& f, V v) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = float(v);
}
// wmma's rule: the matrix pointer 256-bit (32-byte) aligned; a device faults otherwise.
inline void cs_wmma_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32) {
    std::fprintf(stderr, "cuda_emulate: wmma::%s at %p, not 32-byte aligned\n", what, p);
    std::abort();
  }
}
template <class U, int M, int N, int K, class T, class L, class P>
inline void load_matrix_sync(fragment<U, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  cs_wmma_aligned(p, "load_matrix_sync");
  constexpr bool row = std::is_same_v<L, row_major>;
  using F = fragment<U, M, N, K, T, L>;
  for (int r = 0; r < F::ROWS; ++r)
    for (int c = 0; c < F::COLS; ++c)
      f.x[r * F::COLS + c] = float(row ? p[r * ldm + c] : p[c * ldm + r]);
}
template <int M, int N, int K, class T, class P>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const P* p, unsigned ldm,
                             layout_t l) {
  cs_wmma_aligned(p, "load_matrix_sync");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = float(l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]);
}
template <int M, int N, int K, class T, class P>
inline void store_matrix_sync(P* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                              layout_t l) {
  cs_wmma_aligned(p, "store_matrix_sync");
  __syncwarp();  // every lane writes the same values; none reads a half-written tile
  if (cs_lane() == 0)
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N; ++c)
        (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = P(f.x[r * N + c]);
  __syncwarp();
}
template <int M, int N, int K, class TA, class LA, class TB, class LB, class T>
inline void mma_sync(fragment<accumulator, M, N, K, T>& d,
                     const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b,
                     const fragment<accumulator, M, N, K, T>& c) {
  // tf32 operands: the tensor cores read 10 mantissa bits and drop the rest (a value
  // not passed through __float_to_tf32 is truncated, as on the device)
  auto tf = [](float x, bool on) {
    if (!on || !std::isfinite(x)) return x;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u &= 0xffffe000u;
    std::memcpy(&x, &u, 4);
    return x;
  };
  constexpr bool ta = std::is_same_v<TA, precision::tf32>, tb = std::is_same_v<TB, precision::tf32>;
  // The float32 accumulation as the H200's tensor cores do it, bit for bit on the 24576
  // outputs of bench/tc_probe.py (run 29, bench/results/h200/tc_probe_h200_3d40356.npz;
  // tests/tools/test_cuda_emulate.py): K is taken four products at a time; each step
  // adds its four exact products to the accumulator with every term cut (toward zero) at
  // 2^(e - 25), e the largest exponent among the accumulator's and the products' (a
  // product's exponent is the sum of its operands', before normalising), and truncates
  // the sum to float32. So each step errs by up to a few units in the last place, always
  // toward zero, where a chain of fmaf would round to nearest.
  static_assert(K % 4 == 0, "tensor-core steps of four products");
  float out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = c.x[i * N + j];
      for (int k0 = 0; k0 < K; k0 += 4) {
        double t[5];
        int e = acc != 0.f ? std::ilogb(acc) : INT_MIN;
        bool finite = std::isfinite(acc);
        t[4] = acc;
        for (int k = 0; k < 4; ++k) {
          const float x = tf(a.x[i * K + k0 + k], ta), y = tf(b.x[(k0 + k) * N + j], tb);
          t[k] = double(x) * double(y);
          finite = finite && std::isfinite(t[k]);
          if (x != 0.f && y != 0.f) e = std::max(e, std::ilogb(x) + std::ilogb(y));
        }
        double sum = 0.0;
        if (!finite || e == INT_MIN) {
          for (int k = 0; k < 5; ++k) sum += t[k];
          acc = float(sum);
          continue;
        }
        const double cut = std::ldexp(1.0, e - 25);
        for (int k = 0; k < 5; ++k) sum += std::trunc(t[k] / cut) * cut;
        acc = float(sum);  // to nearest; then toward zero
        if (std::isfinite(acc) && std::fabs(double(acc)) > std::fabs(sum))
          acc = std::nextafter(acc, 0.f);
      }
      out[i * N + j] = acc;
    }
  for (int e = 0; e < M * N; ++e) d.x[e] = out[e];
}
}}  // namespace nvcuda::wmma
"""

_MAIN = r"""
// An input's bytes, ``off`` bytes into its buffer (the buffer 16-byte aligned).
static std::vector<char> cs_read(const char* path, size_t n, size_t off) {
  std::vector<char> b(n + off);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(b.data() + off, 1, n, f) != n) {
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
  // exact (AddressSanitizer sees overflows), and 128-byte aligned as a device's is
  float* smem = static_cast<float*>(
      ::operator new(((%(SMEM)d + 3) / 4) * sizeof(float), std::align_val_t(128)));
  cs_smem_base = smem;
  std::barrier<> bar(nt);
  cs_barrier = &bar;
  for (int w = 0; w * 32 < nt; ++w)
    cs_warp_barriers.push_back(new std::barrier<>(nt - w * 32 < 32 ? nt - w * 32 : 32));
  std::vector<std::thread> threads;
  for (int t = 0; t < nt; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = {unsigned(t %% %(TX)d), unsigned((t / %(TX)d) %% %(TY)d),
                   unsigned(t / (%(TX)d * %(TY)d))};
      for (unsigned bz = 0; bz < gridDim.z; ++bz)
        for (unsigned by = 0; by < gridDim.y; ++by)
          for (unsigned bx = 0; bx < gridDim.x; ++bx) {
            blockIdx = {bx, by, bz};
            if (t == 0) std::fill(smem, smem + (%(SMEM)d + 3) / 4, std::nanf(""));
            bar.arrive_and_wait();
            cs_kernel(%(ARGS)s);
            cs_cp_reset();
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


def _host_source(text: str) -> str:
    """Kernel text for the host compiler: ``#include <mma.h>`` dropped (the prelude
    emulates ``nvcuda::wmma``), a helper ``void f(float* dst, const float* src)`` that
    issues a 16- or 4-byte ``cp.async`` made the prelude's deferred copy with PTX's
    alignment check (both addresses a multiple of the size) and its commit / wait asm
    statements the prelude's (the copy lands at its group's wait), ``extern __shared__
    T name[];`` made a pointer into the block's shared memory."""
    text = text.replace("#include <mma.h>", "")
    # cp.async copies (global to shared, 16 or 4 bytes), commits and waits: the prelude's
    # deferred copies (each lands at its group's wait).
    text = re.sub(r"(void\s+\w+\s*\(\s*float\*\s*(\w+)\s*,\s*const float\*\s*(\w+)\s*\)\s*"
                  r"\{)[^}]*cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], (16|4);[^}]*\}",
                  r"\1 cs_cp_async(\2, \3, \4); }", text)  # fmt: skip
    text = re.sub(r'asm\s+volatile\s*\(\s*"cp\.async\.commit_group;\\n"'
                  r'\s*:::\s*"memory"\s*\)\s*;', "cs_cp_commit();", text)  # fmt: skip
    text = re.sub(r'asm\s+volatile\s*\(\s*"cp\.async\.wait_group (\d+);\\n"'
                  r'\s*:::\s*"memory"\s*\)\s*;', r"cs_cp_wait(\1);", text)  # fmt: skip
    return re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;",
                  r"\1* \2 = reinterpret_cast<\1*>(cs_smem_base);", text)  # fmt: skip


def build(header, source, inputs, outputs, template, grid, threadgroup, smem) -> str:
    """The C++ program (see the module docstring)."""
    header, source = _host_source(header), _host_source(source)
    params, args, reads, writes = [], [], [], []
    for i, (name, arr) in enumerate(inputs):
        ct = _ctype(arr.dtype)
        params.append(f"const {ct}* {name}")
        off = arr.dtype.size if name in ODD_INPUTS else 0
        args.append(f"reinterpret_cast<const {ct}*>(in{i}.data() + {off})")
        # MLX passes an input's shape, strides and ndim where the source names them.
        dims = ", ".join(str(d) for d in arr.shape) or "0"
        strides = [1] * arr.ndim
        for a in range(arr.ndim - 2, -1, -1):
            strides[a] = strides[a + 1] * arr.shape[a + 1]
        for suffix, ct_s, values in (("shape", "int32_t", dims),
                                     ("strides", "int64_t", ", ".join(map(str, strides)) or "0"),
                                     ("ndim", None, str(arr.ndim))):  # fmt: skip
            if f"{name}_{suffix}" not in source:
                continue
            if ct_s is None:
                params.append(f"const int {name}_{suffix}")
                args.append(values)
            else:
                params.append(f"const {ct_s}* {name}_{suffix}")
                reads.append(f"  static const {ct_s} in{i}_{suffix}[] = {{{values}}};")
                args.append(f"in{i}_{suffix}")
        reads.append(
            f'  std::snprintf(path, sizeof path, "%s/in{i}", dir);\n'
            f"  auto in{i} = cs_read(path, {arr.nbytes}, {off});"
        )
    for i, (name, shape, dtype) in enumerate(outputs):
        ct = _ctype(dtype)
        size = int(np.prod(shape)) * dtype.size
        params.append(f"{ct}* {name}")
        args.append(f"reinterpret_cast<{ct}*>(out{i}.data())")
        # all bits set: NaN in every float dtype, so an element a kernel never writes shows
        reads.insert(0, f"  std::vector<char> out{i}({size}, char(0xff));")
        writes.append(
            f'  std::snprintf(path, sizeof path, "%s/out{i}", dir);\n'
            f'  {{ FILE* f = std::fopen(path, "wb"); std::fwrite(out{i}.data(), 1, {size}, f); '
            f"std::fclose(f); }}"
        )
    consts = template_lines(template, _ctype)
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
    if COPIES_LAND not in ("at wait", "at issue"):
        raise ValueError(
            f"[cuda_emulate] COPIES_LAND must be 'at wait' or 'at issue', not {COPIES_LAND!r}"
        )
    landing = "#define CS_CP_AT_ISSUE 1\n" if COPIES_LAND == "at issue" else ""
    return landing + _PRELUDE + header + "\n" + kernel + _MAIN % fields


#: Kernel inputs (by parameter name) placed one element past a 16-byte boundary, as MLX
#: passes a row-contiguous view at an odd offset to a kernel (``x[1:]`` of a flat
#: buffer, reshaped): a kernel's vector load from one stops the run (above). Empty: each
#: input at the start of its own 16-byte aligned buffer. Tests set it.
ODD_INPUTS: frozenset[str] = frozenset()

#: When a ``cp.async`` copy lands: ``"at wait"`` (the default: at its group's wait, the
#: latest PTX allows, so a read before the wait sees the old shared memory) or ``"at
#: issue"`` (at once, as before session 39: a copy issued before the barrier that ends
#: the other threads' reads of its buffer overwrites what they still read, which the
#: default hides; found by review). The fused chunk kernels' Qwen3-Next oracle cases run
#: under both (``tests/ops/test_gated_delta_fused.py``), and one multi-piece case of each
#: state-pass kernel (``tests/ops/test_gated_delta_passes.py``, since session 40); the
#: other emulated tests at the wait. Another value raises.
COPIES_LAND = "at wait"


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
    asan = ["-fsanitize=address", "-fno-omit-frame-pointer"] if _ASAN[0] else []
    return asan + _UBSAN_ALIGNMENT


_ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}
#: UndefinedBehaviorSanitizer's alignment check (g++ 4.9 and later), fatal: a float4,
#: uint4 or float2 read from an address CUDA would fault on stops the run.
_UBSAN_ALIGNMENT = ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]


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
