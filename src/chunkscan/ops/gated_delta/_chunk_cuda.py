"""The chunk-parallel parts of Gated DeltaNet as fused CUDA kernels (scalar gates).

:mod:`.chunk` computes everything that is not sequential as batched MLX ops per group
of chunks: dozens of ops per group, each tens of microseconds on MLX's CUDA backend,
and float32 intermediates of ``[C, C]`` or ``[C, D]`` per chunk and head written to
memory between them. Here each of those stages is ONE CUDA kernel launch
per group, one thread block per (chunk, lane) (a lane is one value head of one batch
row; ``output`` and ``state_grads``: per slice of ``TV`` columns of ``Dv`` too;
``input_grads``: per key head, its ``G`` value heads in turn), with the chunk's
intermediates in shared memory. The math is :mod:`.chunk`'s, line for line
(``docs/gated_delta.md``); inputs of any float dtype are read and converted on load.
The arithmetic is float32, with products of one of two kinds (``_HEADER_TC``):

- float32 products (FMA loops; but for ``prepare``'s and ``input_grads``' products with
  q and k: tensor cores, exact products for bf16 / fp16 inputs and 3xTF32 otherwise,
  ``CHUNKSCAN_GDN_TC``), where :func:`chunkscan._backend.tf32_products` does not hold;
- TF32 products where it does (``CS_TF32``; by default on CUDA unless
  ``MLX_ENABLE_TF32=0``, as MLX's own float32 matmuls): every product of ``prepare``
  (but its inverse's), ``output``, ``state_grads`` and ``input_grads`` on the tensor
  cores, each operand rounded to tf32, float32 sums
  (``csg::TcMM``: PTX ``mma.sync.m16n8k8``, each lane reading its fragments' elements
  itself, ``_pass_cuda.MMA_TF32``; the 3xTF32 products of the float32 form stay on
  ``wmma``).

Per group, forward: :func:`prepare` -> state pass (:mod:`._passes`) -> :func:`outputs`.
Backward: :func:`prepare` (recompute) -> :func:`state_gradient_input` -> reverse state
pass -> :func:`state_gradients` -> :func:`input_gradients`. What each returns:

- ``prepare``: ``decay [L, n]``, ``w``, ``kt`` ``[L, n, C, Dk]``, ``u [L, n, C, Dv]``,
  ``a`` (the UT inverse ``(I + L)^-1``) and ``p`` (``scale * qk * gam``, causal)
  ``[L, n, C, C]``;
- ``outputs``: ``o [B, n, C, Hv, Dv]`` in the output dtype (NaN where ``o_bad``);
- ``state_gradient_input``: ``h = d_o^T (qg - p w)`` ``[L, n, Dv, Dk]``;
- ``state_gradients``: given the entering states and the cotangents of the leaving
  states, ``d_vnew [L, n, C, Dv]`` and, per slice of ``Dv`` (``NV`` partial sums), the
  parts of ``d_w``, ``d_qg``, ``d_kt`` ``[C, Dk]``, ``d_p``, ``d_vnew v^T`` ``[C, C]``
  and ``d_decay``;
- ``input_gradients``: ``dq, dk, dv, dg, dbeta`` in the chunk layout and dtypes of the
  inputs (what :func:`.chunk._input_layout` returns).

Shapes handled (:func:`supports`): ``C`` 32 or 64, ``Dk`` and ``Dv`` multiples of 32 up
to 128, at most 65535 lanes. The block products (``csg::Tile``) give each of the ``NT``
threads (256 or 512, per kernel: :func:`threads`) a ``TM x TN`` block of outputs (2 x 2
to 8 x 8; 4 x 4 or 4 x 8 for most products at C = 64), each warp a 4 x 8 piece of the
thread grid, and read shared-memory operands four values of ``k`` at a time: 16-byte
reads along ``k`` where a row holds the operand that way (row strides ``D + 4``), else
along runs of 4 output rows or columns (the ``RB`` / ``CB`` layouts). For 64
multiply-adds (a 4 x 4 block, four ``k``) a thread reads 8 times 16 bytes, where the
layout before (8 x 2 outputs, each warp one row of 32 threads) read 40 single values.
Every output still sums over ``k`` in order with ``fmaf``, as before (measured on the
H200: the op's time within 2% of the layout before; runs 20-22,
``docs/history/benchmarks-sessions-3-29.md``).
``prepare`` inverts ``I + L`` in blocks (16-row diagonal blocks by forward substitution,
each thread a column in registers, then doubling), not row by row; ``state_grads``
stages ``w``, ``kt``, ``S`` and ``dS`` through shared memory ``KS`` columns of ``Dk`` at
a time (``S`` and ``dS`` twice; :func:`piece_columns`: 64 in a block of all 128 columns
of ``Dv``, 219 KiB at the Qwen3-Next shape, one block per multiprocessor; 32 in blocks
of 64 columns, 104 KiB, two blocks). Phase clocks for
tuning: ``CHUNKSCAN_GDN_PROFILE=1`` (``bench/gdn_fused_kernels.py --profile``).

Tested (``tests/ops/test_gated_delta_fused.py``) by running these sources on the CPU
through ``tools/cuda_emulate.py`` (``_backend.RUNNER``) on every machine with ``g++``, and
compiled on a CUDA device (outputs in ``bench/results/h200/tests_h200_fused_*.txt`` and
``tests_h200_cuda_*.txt``).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from types import SimpleNamespace

import mlx.core as mx

from ... import _backend
from ..._backend import (
    UNUSED,
    compute_capability,
    cuda_kernel,
    cuda_limits,
    env_int,
    env_switch,
    tf32_products,
)
from ._pass_cuda import CP_ASYNC, MMA_TF32, TF32_FRAGMENTS

F32 = mx.float32
# Threads per block (256 or 512: a multiple of C; every Tile's rows a multiple of
# NT / 32): 512 for input_grads, for state_grads where a block takes all 128 columns of
# Dv (WIDE_TV below) and for output where a block's step does (OUT_TH below), 256
# otherwise (what ran fastest on the H200 at the Qwen3-Next shape:
# bench/results/h200/tune_e0a0f1c/ and run 61). For tuning, CHUNKSCAN_GDN_NT sets every
# kernel's (read at each call).
NT = 256
_NT_512 = {("input_grads", 32), ("input_grads", 64)}
_NT_512_WIDE = ("output", "state_grads")  # at TV = WIDE_TV (output: at TH = WIDE_TV)
# Columns of Dv per block of state_gradients (NV = Dv / TV partial sums) and of output:
# at C = 64, all of a Dv of 128 in one block (WIDE_TV) where it fits the device's shared
# memory (state_grads: 219 KiB with pieces of 64 columns of Dk, 187 with 32; 512
# threads: run 61, Nsight Compute at T = 16384, the five kernels 12.6 ms against 13.3
# with 64 columns, input_grads reading one partial sum instead of two); else 64 where
# it divides Dv (fewer partial sums to write and add than 32; faster on the H200 at both
# chunk sizes, and with TF32 products 26.9-27.6 ms against 23.5-24.2 for the op at
# T = 16384, run 38), else 32. For tuning, CHUNKSCAN_GDN_TV (32, 64 or 128).
TV = 64
WIDE_TV = 128
_WIDE_C = (64,)  # C = 32 keeps 64 columns (not measured wide)
MAX_GRID_Y = 65535  # blocks in a CUDA grid's y dimension (the lanes here)
CHUNK_SIZES = (32, 64)  # the chunk sizes these kernels take (supports)
# Columns of Dk per piece of w, kt, S and dS in state_grads (its template constant KS;
# rows of KS + 4 floats in shared memory, smem_bytes): 32, but 64 in a block that takes
# WIDE_TV columns of Dv (piece_columns), so that each of pass 2's products (C x KS
# outputs, 16 x 16 tiles) has a tile for each of the block's 16 warps.
KS = 32
WIDE_KS = 64
# Columns of Dv per step of an output block (its template constant TH; the block's TV
# columns in TV / TH steps): 64, so that a block of 128 columns takes 101 KiB of shared
# memory at C = 64, Dk = 128 and two blocks share a multiprocessor (the whole 128 columns
# at once took 150 KiB, one block of 512 threads). For tuning, CHUNKSCAN_GDN_OUT_TH (32,
# 64 or 128; at most TV).
OUT_TH = 64

_HEADER = (
    CP_ASYNC
    + r"""
#ifndef CS_EMULATE
#define CS_DYN_SMEM(name) \
  extern __shared__ float4 name##_4[]; \
  float* name = reinterpret_cast<float*>(name##_4)
#define CS_NAN __int_as_float(0x7fc00000)
#define CS_INF __int_as_float(0x7f800000)
#else
#define CS_NAN std::nanf("")
#define CS_INF HUGE_VALF
#endif
// The thread's index in its block (threadIdx.x). Where CS_FRESH_TID is defined
// (input_grads: a loop over the value heads of a key head), every use reads it afresh
// (a volatile read the compiler cannot hoist), so that the offsets each phase derives
// from it are worked out where they are used, not once ahead of the loop and kept in
// registers across it: 244 registers a thread at the Qwen3-Next shape with them hoisted,
// where 512 threads allow 128 (tools/cuda_compile_check.py).
#if defined(CS_FRESH_TID) && !defined(CS_EMULATE)
__device__ __forceinline__ unsigned cs_tid() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
#else
#define cs_tid() threadIdx.x
#endif
// A value written to shared memory only as a tensor-core operand: with CS_TF32 rounded
// to tf32 there, once, so that tc_run<.., RA / RB = false> reads it as it is (the same
// value that rounding at each read gives: rounding is idempotent); else unchanged.
#ifdef CS_TF32
#define CS_OPERAND(x) cs_tf32(x)
#else
#define CS_OPERAND(x) (x)
#endif
#if defined(CS_PROFILE) && !defined(CS_EMULATE)
// Phase clocks (CHUNKSCAN_GDN_PROFILE=1, bench/gdn_fused_kernels.py --profile): thread 0
// of four blocks prints the cycles from each CS_MARK to the next, up to 14 phases.
#define CS_PROF_BEGIN long long cs_t0 = clock64(), cs_d[14] = {0}; int cs_n = 0
#define CS_MARK()                                                   \
  do {                                                              \
    const long long t_ = clock64();                                 \
    if (cs_n < 14) cs_d[cs_n++] = t_ - cs_t0;                       \
    cs_t0 = t_;                                                     \
  } while (0)
#define CS_PROF_END(kname)                                                              \
  do {                                                                                  \
    CS_MARK();                                                                          \
    if (cs_tid() == 0 && blockIdx.z == 0 &&                                          \
        (blockIdx.x == 0 || blockIdx.x == gridDim.x / 2) &&                             \
        (blockIdx.y == 0 || blockIdx.y == gridDim.y / 2))                               \
      printf("CSPROF %s %d %d %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld "  \
             "%lld %lld %lld\n", kname, int(blockIdx.x), int(blockIdx.y), cs_d[0],      \
             cs_d[1], cs_d[2], cs_d[3], cs_d[4], cs_d[5], cs_d[6], cs_d[7], cs_d[8],    \
             cs_d[9], cs_d[10], cs_d[11], cs_d[12], cs_d[13]);                         \
  } while (0)
#else
#define CS_PROF_BEGIN
#define CS_MARK()
#define CS_PROF_END(kname)
#endif
namespace csg {
template <typename T> __device__ __forceinline__ float f(T x) { return static_cast<float>(x); }
// The float with these bits (the template constant SCALE_BITS: the scale is compiled in,
// not read from global memory at each block's start).
__device__ __forceinline__ float bits_float(int b) {
#ifdef CS_EMULATE
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#else
  return __int_as_float(b);
#endif
}
// Non-finite inputs read as zero (the wrapper puts NaN back where the loop has it).
__device__ __forceinline__ float fin(float x) { return isfinite(x) ? x : 0.f; }
// Whether the input *x is finite, given its shared-memory copy *c (where non-finite
// inputs read as zero): with copy, a non-zero *c answers and x is not read.
template <class T>
__device__ __forceinline__ bool finite_input(bool copy, const float* c, const T* x) {
  return (copy && *c != 0.f) || isfinite(f(*x));
}
// Gates: NaN and +inf read as zero; -inf (a reset) is kept.
__device__ __forceinline__ bool gate_ok(float x) { return !(isnan(x) || x == CS_INF); }
__device__ __forceinline__ float gate(float x) { return gate_ok(x) ? x : 0.f; }

// 16-byte shared-memory load (p 16-byte aligned: row strides and offsets multiples of 4).
__device__ __forceinline__ float4 ld4(const float* p) {
#ifdef CS_EMULATE
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    std::fprintf(stderr, "csg::ld4: misaligned shared-memory load\n");
    std::abort();
  }
#endif
  return *reinterpret_cast<const float4*>(p);
}
// 16-byte global store (p 16-byte aligned).
__device__ __forceinline__ void st4(float* p, float4 x) {
#ifdef CS_EMULATE
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    std::fprintf(stderr, "csg::st4: misaligned store\n");
    std::abort();
  }
#endif
  *reinterpret_cast<float4*>(p) = x;
}
__device__ __forceinline__ void put4(float (&d)[4], float4 x) {
  d[0] = x.x; d[1] = x.y; d[2] = x.z; d[3] = x.w;
}
// p[0], p[1] = x, y in one 8-byte store (p 8-byte aligned). In PTX: NVRTC split the same
// store written as a float2 into two 4-byte ones (csg::TcMM::store_out's, to global memory).
__device__ __forceinline__ void st2(float* p, float x, float y) {
#ifdef CS_EMULATE
  if (reinterpret_cast<uintptr_t>(p) % 8) {
    std::fprintf(stderr, "csg::st2: misaligned store\n");
    std::abort();
  }
  p[0] = x;
  p[1] = y;
#else
  asm volatile("st.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#endif
}
// *p = x in p's type; whether p is a float* (then 8- and 16-byte stores are possible).
template <class T> __device__ __forceinline__ void put(T* p, float x) { *p = static_cast<T>(x); }
template <class P> struct is_float_ptr { static constexpr bool value = false; };
template <> struct is_float_ptr<float*> { static constexpr bool value = true; };

// Global loads, many in flight per thread. A loop that converts and stores each value
// as it arrives waits one memory latency per step: 20-38k cycles of a block for a
// chunk's q and k (the phase clocks of runs 14 and 20). load_tile first issues up to
// LU loads of 16 bytes per thread (VW = 16 / sizeof(T) consecutive columns each), then
// converts them and hands on every value: put(r, c, x), x = float(src[r * ld + c]),
// r < ROWS, c < COLS; with NS > 1, x = 0 + y_0 + .. + y_{NS-1} in that order, y_z the
// value zs elements further on (the NV partial sums of state_gradients). 16-byte
// loads need src, ld and zs at 16-byte multiples; otherwise (an input given as a view
// at an odd offset) each element is read alone, one piece of VW columns at a time in
// flight, with the same values and the same sums. The raw bits are kept until the values
// are handed on (4 registers per 16-byte load, whatever T): converting first took
// prepare from 118 registers to 168 (NVRTC, sm_90), too many for two blocks per SM.
// CS_SCALAR_LOADS (CHUNKSCAN_GDN_SCALAR_LOADS=1) takes that path everywhere (tests).
__device__ __forceinline__ unsigned word(const uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ __forceinline__ float unpack(const float*, const uint4& r, int q) {
  return __int_as_float(int(word(r, q)));
}
__device__ __forceinline__ unsigned half_bits(const uint4& r, int q) {
  const unsigned w = word(r, q / 2);
  return q % 2 ? w >> 16 : w & 0xffffu;
}
__device__ __forceinline__ float unpack(const __nv_bfloat16*, const uint4& r, int q) {
  return __int_as_float(int(half_bits(r, q) << 16));  // bf16 -> float: exact
}
__device__ __forceinline__ float unpack(const __half*, const uint4& r, int q) {
#ifdef CS_EMULATE
  const unsigned short b = static_cast<unsigned short>(half_bits(r, q));
  __half x;
  std::memcpy(&x, &b, 2);
  return static_cast<float>(x);
#else
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half_bits(r, q))));
#endif
}
// One round of 16-byte loads (load_tile's and TileLoad's): issue16 starts this thread's
// loads of the LU pieces e0, e0 + NT, .. (those below ITEMS; PR pieces a row, NS summands
// each, zs elements apart) into r, the raw bits; land16 converts them and hands every
// value on, x = 0 + y_0 + .. + y_{NS-1} in that order where NS > 1.
template <int PR, int ITEMS, int NT, int LU, int NS, class T>
__device__ __forceinline__ void issue16(uint4 (&r)[LU][NS], const T* src, size_t ld, int e0,
                                        size_t zs) {
  constexpr int VW = 16 / sizeof(T);
#pragma unroll
  for (int u = 0; u < LU; ++u) {
    const int e = e0 + u * NT;
#pragma unroll
    for (int z = 0; z < NS; ++z)
      if (e < ITEMS)
        r[u][z] = *reinterpret_cast<const uint4*>(src + size_t(e / PR) * ld + (e % PR) * VW +
                                                  z * zs);
  }
}
template <int PR, int ITEMS, int NT, int LU, int NS, class T, class F>
__device__ __forceinline__ void land16(const uint4 (&r)[LU][NS], const T* src, int e0, F put) {
  constexpr int VW = 16 / sizeof(T);
#pragma unroll
  for (int u = 0; u < LU; ++u) {
    const int e = e0 + u * NT;
    if (e < ITEMS) {
#pragma unroll
      for (int q = 0; q < VW; ++q) {
        float s = unpack(src, r[u][0], q);
        if (NS > 1) {
          s = 0.f + s;
#pragma unroll
          for (int z = 1; z < NS; ++z) s += unpack(src, r[u][z], q);
        }
        put(e / PR, (e % PR) * VW + q, s);
      }
    }
  }
}
template <int ROWS, int COLS, int NT, int NS = 1, class T, class F>
__device__ __forceinline__ void load_tile(const T* src, size_t ld, F put, size_t zs = 0) {
  constexpr int VW = 16 / sizeof(T), PR = COLS / VW, ITEMS = ROWS * PR, LU = 4;
  static_assert(COLS % VW == 0, "load_tile: rows of whole 16-byte pieces");
#ifdef CS_SCALAR_LOADS
  const bool vec = false;
#else
  const bool vec =
      ((reinterpret_cast<unsigned long long>(src) | (ld * sizeof(T)) | (zs * sizeof(T))) & 15) == 0;
#endif
  if (vec) {
#pragma unroll 1
    for (int e0 = cs_tid(); e0 < ITEMS; e0 += LU * NT) {
      uint4 r[LU][NS];  // the raw bits: 4 registers per load, whatever T
      issue16<PR, ITEMS, NT>(r, src, ld, e0, zs);
      land16<PR, ITEMS, NT>(r, src, e0, put);
    }
  } else {  // one piece at a time: its VW x NS loads in flight
    for (int e = cs_tid(); e < ITEMS; e += NT) {
      const T* p = src + size_t(e / PR) * ld + (e % PR) * VW;
      float x[NS][VW];
#pragma unroll
      for (int z = 0; z < NS; ++z)
#pragma unroll
        for (int q = 0; q < VW; ++q) x[z][q] = f(p[z * zs + q]);
#pragma unroll
      for (int q = 0; q < VW; ++q) {
        float s = x[0][q];
        if (NS > 1) {
          s = 0.f + s;
#pragma unroll
          for (int z = 1; z < NS; ++z) s += x[z][q];
        }
        put(e / PR, (e % PR) * VW + q, s);
      }
    }
  }
}

// load_tile in two steps, for a tile of at most four 16-byte loads per thread (ROWS COLS
// <= 4 VW NT): issue(src, ld) starts this thread's loads into registers, land(put) then
// converts them and hands every value on as load_tile does (the same values: one round of
// its issue16 / land16), so that work in between hides the loads' latency. Where they
// would not be 16-byte loads (or the tile is larger, or with CS_SCALAR_LOADS), issue()
// only notes src and land() is load_tile. T: the element type (csg::elem_t of the
// pointer).
template <class P> struct elem;
template <class T> struct elem<const T*> { using type = T; };
template <class P> using elem_t = typename elem<P>::type;
template <int ROWS, int COLS, int NT, class T> struct TileLoad {
  static constexpr int VW = 16 / sizeof(T), PR = COLS / VW, ITEMS = ROWS * PR;
  static constexpr int LU = (ITEMS + NT - 1) / NT;
  static constexpr bool SPLIT = LU <= 4;
  static_assert(COLS % VW == 0, "TileLoad: rows of whole 16-byte pieces");
  const T* src = nullptr;
  size_t ld = 0;
  bool vec = false;
  uint4 r[SPLIT ? LU : 1][1];
  __device__ __forceinline__ void issue(const T* s, size_t l) {
    src = s;
    ld = l;
#ifdef CS_SCALAR_LOADS
    vec = false;
#else
    vec = SPLIT && ((reinterpret_cast<unsigned long long>(s) | (l * sizeof(T))) & 15) == 0;
#endif
    if (vec) issue16<PR, ITEMS, NT>(r, s, l, cs_tid(), 0);
  }
  template <class F> __device__ __forceinline__ void land(F put) const {
    if (!vec) {
      load_tile<ROWS, COLS, NT>(src, ld, put);
      return;
    }
    land16<PR, ITEMS, NT>(r, src, cs_tid(), put);
  }
};

// A float32 tile of global memory into shared memory (dst row stride ldd, a multiple of
// 4) with 16-byte cp.async copies: no registers held, so every copy of a phase is in
// flight at once (load_tile holds up to four 16-byte loads per thread and stores them
// before the next; Nsight Compute charged a third of output's stall samples to those
// loads, run 42). copies_land() (commit, then wait for the thread's own copies) and a
// barrier before any thread reads dst. Where src or ld is not a 16-byte multiple, or
// with CS_SCALAR_LOADS, it is load_tile (the same values, now in place).
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void copy_tile(float* dst, int ldd, const float* src, size_t ld) {
  static_assert(COLS % 4 == 0, "copy_tile: rows of whole 16-byte pieces");
#ifdef CS_SCALAR_LOADS
  const bool vec = false;
#else
  const bool vec = ((reinterpret_cast<unsigned long long>(src) | (ld * sizeof(float))) & 15) == 0;
#endif
  if (vec) {
    constexpr int PR = COLS / 4;
    for (int e = cs_tid(); e < ROWS * PR; e += NT) {
      const int r = e / PR, c = 4 * (e % PR);
      cs_cp_async16(dst + r * ldd + c, src + size_t(r) * ld + c);
    }
  } else {
    load_tile<ROWS, COLS, NT>(src, ld, [&](int r, int c, float x) { dst[r * ldd + c] = x; });
  }
}
__device__ __forceinline__ void copies_land() {
  cs_cp_async_commit();
  cs_cp_async_wait_all();
}

// The value as it is (Tile::store's val).
struct Same {
  __device__ __forceinline__ float operator()(int, int, float x, int, int) const { return x; }
};

// Rows per thread TM of an [M, N] product on NT threads (TN = M N / NT / TM columns):
// the most square TM x TN, both at most 8, that lets each warp own a 4 x 8 piece of
// the (M / TM) x (N / TN) thread grid; 0 where none does (then: one warp per grid row).
template <int M, int N, int NT> __host__ __device__ constexpr int tile_rows() {
  constexpr int P = M * N / NT;
  int best = 0, gap = 1 << 20;
  for (int tm = 1; tm <= 8; tm *= 2) {
    if (P % tm) continue;
    const int tn = P / tm;
    if (tn > 8 || M % tm || N % tn || (M / tm) % 4 || (N / tn) % 8) continue;
    if (NT % 32 || (M / tm) * (N / tn) != NT) continue;
    const int g = tm > tn ? tm - tn : tn - tm;
    if (g < gap) { gap = g; best = tm; }
  }
  return best;
}

// Operands of Tile::mm4, in shared memory. KC (k-contiguous): A(i, k) = p[i ld + k],
// B(k, j) = p[j ld + k]; else A(i, k) = p[k ld + i], B(k, j) = p[k ld + j].
template <bool KC> struct Op { const float* p; int ld; };
template <bool KC> __device__ __forceinline__ Op<KC> op(const float* p, int ld) { return {p, ld}; }

// out[x][q] = X.p[(k + q) X.ld + idx(x)], x < N, q < 4: an operand not contiguous along
// k (Tile::load_a / load_b), 16 bytes at a time where idx runs in 4s (BLK), else a value
// at a time.
template <int N, bool BLK, class I>
__device__ __forceinline__ void gather_k(Op<false> X, int k, I idx, float (&out)[N][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float* r = X.p + (k + q) * X.ld;
    if constexpr (BLK) {
#pragma unroll
      for (int x = 0; x < N; x += 4) {
        const float4 v = ld4(r + idx(x));
        out[x][q] = v.x; out[x + 1][q] = v.y; out[x + 2][q] = v.z; out[x + 3][q] = v.w;
      }
    } else {
#pragma unroll
      for (int x = 0; x < N; ++x) out[x][q] = r[idx(x)];
    }
  }
}

// An [M, N] block product in registers, NT threads. Thread t owns TM x TN outputs: rows
// row(a), columns col(b). The threads form a (M / TM) x (N / TN) grid, each warp a 4 x 8
// piece of it (conflict-free reads with odd or 4-mod-32 row strides); rows and columns
// interleave (row(a) = tr + (M / TM) a), or, with RB / CB, come in runs of 4 (row(a) =
// 4 (tr + (M / TM) (a / 4)) + a % 4) so that an operand contiguous along them is read 16
// bytes at a time. Where no such grid exists (tile_rows == 0) each warp is one grid row
// of 32 threads (rows ty + W a, columns tx + 32 b). Every product accumulates over k in
// order with fmaf, whatever the layout.
template <int M, int N, int NT, bool RB = false, bool CB = false> struct Tile {
  static constexpr int TM0 = tile_rows<M, N, NT>();
  static constexpr bool WIDE = TM0 == 0;  // one warp per grid row
  static constexpr int RA = WIDE ? M / (NT / 32) : TM0;
  static constexpr int RBN = M * N / NT / RA;
  static constexpr int TR = M / RA, TC = N / RBN;  // the thread grid
  static constexpr int WR = WIDE ? 1 : 4, WC = WIDE ? 32 : 8;  // a warp's piece
  static constexpr bool RB4 = RB && RA % 4 == 0, CB4 = CB && RBN % 4 == 0;
  static_assert(M * N % NT == 0 && M % RA == 0 && N % RBN == 0, "Tile: shape");
  static_assert(TR * TC == NT && TR % WR == 0 && TC % WC == 0, "Tile: thread grid");
  float v[RA][RBN];
  int tr, tc;
  __device__ __forceinline__ Tile() {
    const int lane = cs_tid() & 31, w = cs_tid() >> 5, wpr = TC / WC;
    tr = (w / wpr) * WR + lane / WC;
    tc = (w % wpr) * WC + lane % WC;
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
      for (int b = 0; b < RBN; ++b) v[a][b] = 0.f;
  }
  __device__ __forceinline__ int row(int a) const {
    return RB4 ? 4 * (tr + TR * (a / 4)) + a % 4 : tr + TR * a;
  }
  __device__ __forceinline__ int col(int b) const {
    return CB4 ? 4 * (tc + TC * (b / 4)) + b % 4 : tc + TC * b;
  }
  // v += A B, four k at a time (K a multiple of 4). Each operand is an Op in shared
  // memory, read 16 bytes at a time along k (KC) or along runs of 4 rows / columns
  // (RB4 / CB4), else one value at a time; or a functor fa(i, k) / fb(k, j).
  template <int K, class TA, class TB> __device__ __forceinline__ void mm4(TA A, TB B) {
    static_assert(K % 4 == 0, "Tile::mm4: K % 4 == 0");
#pragma unroll 2
    for (int k = 0; k < K; k += 4) {
      float av[RA][4], bv[RBN][4];
      load_a(A, av, k);
      load_b(B, bv, k);
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int a = 0; a < RA; ++a)
#pragma unroll
          for (int b = 0; b < RBN; ++b) v[a][b] = fmaf(av[a][q], bv[b][q], v[a][b]);
    }
  }
  template <class F>
  __device__ __forceinline__ void load_a(const F& fa, float (&av)[RA][4], int k) const {
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int a = 0; a < RA; ++a) av[a][q] = fa(row(a), k + q);
  }
  __device__ __forceinline__ void load_a(Op<true> A, float (&av)[RA][4], int k) const {
#pragma unroll
    for (int a = 0; a < RA; ++a) put4(av[a], ld4(A.p + row(a) * A.ld + k));
  }
  __device__ __forceinline__ void load_a(Op<false> A, float (&av)[RA][4], int k) const {
    gather_k<RA, RB4>(A, k, [&](int a) { return row(a); }, av);
  }
  template <class F>
  __device__ __forceinline__ void load_b(const F& fb, float (&bv)[RBN][4], int k) const {
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int b = 0; b < RBN; ++b) bv[b][q] = fb(k + q, col(b));
  }
  __device__ __forceinline__ void load_b(Op<true> B, float (&bv)[RBN][4], int k) const {
#pragma unroll
    for (int b = 0; b < RBN; ++b) put4(bv[b], ld4(B.p + col(b) * B.ld + k));
  }
  __device__ __forceinline__ void load_b(Op<false> B, float (&bv)[RBN][4], int k) const {
    gather_k<RBN, CB4>(B, k, [&](int b) { return col(b); }, bv);
  }
  // *ptr(row, col) = val(row, col, value, a, b) (converted to ptr's type) for every owned
  // output; with CB4 and a float* ptr, 16 bytes at a time along each run of 4 columns
  // (ptr 16-byte aligned at a run's start), so that a warp writes whole 32-byte sectors,
  // as it does without CB. Every val first, then the stores: a load in val (of an input
  // the compiler cannot tell from the output) would otherwise wait for the store before
  // it, one memory latency per output.
  template <class P, class V> __device__ __forceinline__ void store(P ptr, V val) const {
    float out[RA][RBN];
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
      for (int b = 0; b < RBN; ++b) out[a][b] = val(row(a), col(b), v[a][b], a, b);
#pragma unroll
    for (int a = 0; a < RA; ++a) {
      const int i = row(a);
      if constexpr (CB4 && is_float_ptr<decltype(ptr(0, 0))>::value) {
#pragma unroll
        for (int b = 0; b < RBN; b += 4)
          st4(ptr(i, col(b)), make_float4(out[a][b], out[a][b + 1], out[a][b + 2], out[a][b + 3]));
      } else {
#pragma unroll
        for (int b = 0; b < RBN; ++b) put(ptr(i, col(b)), out[a][b]);
      }
    }
  }
  // fn(row, column, value, a, b) for every owned output.
  template <class F> __device__ __forceinline__ void each(F fn) const {
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
      for (int b = 0; b < RBN; ++b) fn(row(a), col(b), v[a][b], a, b);
  }
  // The interface that csg::Prod shares with the tensor-core TcMM (CS_TF32): zero(),
  // each_out(fn) (= each), store_out(ptr, val) (= store) and at(a, b), the owned output
  // that each_out names (a, b).
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
      for (int b = 0; b < RBN; ++b) v[a][b] = 0.f;
  }
  template <class F> __device__ __forceinline__ void each_out(F fn) const { each(fn); }
  template <class P, class V> __device__ __forceinline__ void store_out(P ptr, V val) const {
    store(ptr, val);
  }
  __device__ __forceinline__ float at(int a, int b) const { return v[a][b]; }
  // Every owned output x = fn(row, column, x, a, b).
  template <class F> __device__ __forceinline__ void apply(F fn) {
#pragma unroll
    for (int a = 0; a < RA; ++a)
#pragma unroll
      for (int b = 0; b < RBN; ++b) v[a][b] = fn(row(a), col(b), v[a][b], a, b);
  }
};
#ifndef CS_TF32
// A product of M x N outputs on NT threads, the same code for both kinds (input_grads):
// Prod<..> x; x.zero(); prod<K, KA, KB>(x, A, lda, B, ldb) (TcMM's operand rules); then
// x.each_out / store_out / at. Here the FMA Tile (RB / CB: its layouts); with CS_TF32 a
// TcMM, one tf32 product per tile (_HEADER_TC).
template <int M, int N, int NT, bool RB = false, bool CB = false, bool SR = false, bool SC = false>
using Prod = Tile<M, N, NT, RB, CB>;  // (SR, SC: TcMM's)
template <int K, bool KA, bool KB, bool RA = true, bool RB = true, class MM>
__device__ __forceinline__ void prod(MM& mm, const float* A, int lda, const float* B, int ldb) {
  mm.template mm4<K>(op<KA>(A, lda), op<KB>(B, ldb));  // RA, RB: tc_run's (none here)
}
#endif

// Log-decays of one chunk from its gates gf[C]: gma[i] = exp(g_0 + .. + g_i) on warp 0,
// ten[i] = exp(g_{i+1} + .. + g_{C-1}) on warp 1, each by a scan across its lanes over
// runs of 32 gates (warp 1 from the chunk's end), a run's total carried to the next.
// Every sum is the same on every call and in every kernel; the order of its additions is
// the scan's (a lane per row summing its span in order took one shared-memory read and
// one dependent add per gate: up to C, while the block's other warps waited at the
// barrier after, 5-6% of output's warp-stall samples, run 75).
template <int C, int NT>
__device__ __forceinline__ void chunk_gates(const float* gf, float* gma, float* ten) {
  static_assert(NT >= 64 && C % 16 == 0 && C <= 128, "chunk_gates: two warps, runs of 32");
  const int w = cs_tid() / 32, lane = cs_tid() % 32;
  if (w >= 2) return;
  float carry = 0.f;  // the sum of the runs before
#pragma unroll
  for (int r0 = 0; r0 < C; r0 += 32) {
    const int e = r0 + lane;                    // the e-th gate from this warp's end
    const int i = w == 0 ? e : C - 1 - e;       // its row
    float x = e < C ? gf[i] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;
    carry = __shfl_sync(0xffffffffu, x, 31);
    if (e < C) {
      if (w == 0) gma[i] = expf(x);                 // g_0 + .. + g_i
      else if (i > 0) ten[i - 1] = expf(x);         // g_i + .. + g_{C-1}
    }
  }
  if (w == 1 && lane == 0) ten[C - 1] = 1.f;  // the empty sum
}
// gam[i][j] = exp(g_{j+1} + .. + g_i) for j <= i, else 0 (row stride LD). Each column is
// cut into S = NT / C runs of R = C / S rows, one thread each (thread tid: column
// tid % C, rows R (tid / C) ..): a thread sums the gates from j + 1 up to its first row,
// then walks its rows with a running sum. So every entry is the same sum, in the same
// order, as summing its span afresh (bitwise equal), and a thread does at most C - R
// additions and R exponentials (one thread per column before: up to C - 1 of each, while
// the block's other warps waited at the barrier after).
template <int C, int LD, int NT>
__device__ __forceinline__ void fill_gam(const float* gf, float* gam) {
  static_assert(NT >= C && NT % C == 0, "fill_gam: threads a multiple of the columns");
  constexpr int S = NT / C < C ? NT / C : C;
  constexpr int R = C / S;
  static_assert(C % S == 0, "fill_gam: runs of equal length");
  const int tid = cs_tid();
  if (tid < C * S) {
    const int j = tid % C, i0 = (tid / C) * R;
    float s = 0.f;
    int t = j + 1;
    for (; t + 4 <= i0; t += 4) {  // four reads in flight, then their adds in order
      const float a = gf[t], b = gf[t + 1], c = gf[t + 2], d = gf[t + 3];
      s += a;
      s += b;
      s += c;
      s += d;
    }
    for (; t < i0; ++t) s += gf[t];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int i = i0 + q;
      float x = i == j ? 1.f : 0.f;
      if (i > j) {
        s += gf[i];
        x = expf(s);
      }
      gam[i * LD + j] = x;
    }
  }
}
// One doubling level of prepare's inverse A = (I + L)^-1 (row stride LD, L strictly
// lower, A's diagonal blocks of S rows done): each pair of diagonal blocks
// [[A11, 0], [L21, A22]] (rows and columns b0 .. b0 + 2 S) gets its block below the
// diagonal X21 = -A22 (L21 A11), through T = L21 A11 in L's block above the pair's
// diagonal (rows b0 .., columns b0 + S ..: L is strictly lower, so that block is free and
// no level reads it again). A thread owns R rows i of one column m of a pair's S x S
// block, so each value of A11 (of T) it reads serves R sums, and its R sums run side by
// side. Every sum runs over the whole k range in order, from zero: the terms outside the
// triangles multiply an exact zero (A11 and A22 above their diagonals, cleared before)
// and add +-0 to a zero sum or nothing to a non-zero one, so each entry is bitwise the
// sum over the triangle alone (for finite L).
template <int S, int C, int LD, int NT>
__device__ __forceinline__ void inverse_level(float* Ls, float* As) {
  constexpr int PAIRS = C / (2 * S), OUT = PAIRS * S * S;
  constexpr int R = OUT >= 4 * NT ? 4 : OUT >= 2 * NT ? 2 : 1;
  constexpr int UNITS = OUT / R, PER_PAIR = S * S / R;
  static_assert(S % R == 0, "inverse_level: rows per thread divide the block");
  // D = sg X Y over the pair's S x S blocks, given by their (row, column) block offsets
  // from the pair's corner b0: D[d0 + i][d1 + m] = sg sum_t X[x0 + i][x1 + t] Y[y0 + t][y1
  // + m] (sg = +-1: exact); then a barrier.
  auto product = [&](const float* X, int x0, int x1, const float* Y, int y0, int y1,
                     float* D, int d0, int d1, float sg) {
    for (int u = cs_tid(); u < UNITS; u += NT) {
      const int b0 = (u / PER_PAIR) * 2 * S, i0 = ((u % PER_PAIR) / S) * R, m = u % S;
      float acc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.f;
      const float* xr = X + (b0 + x0 + i0) * LD + b0 + x1;  // X [i0 + r][t]
      const float* yc = Y + (b0 + y0) * LD + b0 + y1 + m;   // Y [t][m]
#pragma unroll
      for (int t = 0; t < S; ++t) {
        const float y = yc[t * LD];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(xr[r * LD + t], y, acc[r]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) D[(b0 + d0 + i0 + r) * LD + b0 + d1 + m] = sg * acc[r];
    }
    __syncthreads();
  };
  product(Ls, S, 0, As, 0, 0, Ls, 0, S, 1.f);    // T = L21 A11, above the diagonal
  product(As, S, S, Ls, 0, S, As, S, 0, -1.f);   // X21 = -A22 T
}
}  // namespace csg
"""
)

# prepare's and input_grads' products with q and k (kk, qk; input_grads' m1 = d_w k^T) on
# the tensor cores (CS_TC, prepended by _launch where tc_products() holds). bf16 / fp16
# inputs are exact in tf32 (8 / 11 significant bits of tf32's 11), so kk and qk of such
# inputs take one tensor-core product per tile and their products are exact: only the
# sums differ from the FMA loop's (the tensor cores truncate each step's sum, _pass_cuda and
# bench/tc_probe.py). Other operands are split, 3xTF32, the small products in their own
# accumulators. The same values in float32 (an upcast of bf16 inputs) have zero small
# parts and give the same results bit for bit. On the H200 (run 35) the phase with these
# products took 23k cycles of a block against 39k (the kernel 127k against 155k); the same
# in prepare (kk, qk) gained nothing then (27k against 26k: its stores and barriers, not
# its products, set that phase). Since run 51 prepare stages both results through shared
# memory and combines them in two passes; with w and u on TF32 too its time went from
# 3264 to 2812 us per fwd+bwd at T = 16384 (3013 with kk, qk on the FMA loops).
_HEADER_TC = (
    "\n#define CS_TC 1"
    + TF32_FRAGMENTS
    + MMA_TF32
    + r"""namespace csg {
namespace wm = nvcuda::wmma;
#ifdef CS_TF32
// TF32 builds: the products on mma.sync (m16n8k8, _pass_cuda.MMA_TF32), a 16 x 16 tile
// as two 8-column halves in mma's C layout: x[4 h + c] is row g + 8 (c / 2), column
// 8 h + 2 t + c % 2 (g = lane / 4, t = lane % 4); each lane reads its operands' elements
// itself (wmma's loads cost a 64-bit address computation per element).
struct TcAcc {
  static constexpr int num_elements = 8;
  float x[8];
};
__device__ __forceinline__ void fill(TcAcc& f, float v) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f.x[e] = v;
}
// Where the rows (or columns) of 16-row tile x lie, x = 0, 1, .. along a dimension: lane
// position p (0..7: a fragment's row g = lane / 4, or 2 t for an accumulator's column
// pair) is row tile_pos(x, p), and row + 8 the same for p's second fragment row.
// - Plain (S false): rows 16 x .. 16 x + 15.
// - Spread (S): tiles in pairs over blocks of 32 rows, tile x taking the runs of four
//   4 (x % 2) + {0, 8, 16, 24} of its block (p % 4 within a run, p / 4 picking the run
//   16 apart). A spread dimension is a multiple of 32.
// Why: a product whose operand is read down its columns (!KA / !KB, row stride = 4 mod
// 32) has lane (g, t) read row k + t, column tile_pos(x, g), bank 4 t + tile_pos(x, g):
// plain tiles put the 32 lanes on 20 banks (12 of them twice), spread ones on 32. The
// accumulator's column pairs stay side by side (2 t -> 2 (t % 2) + 16 (t / 2)), and
// their 8-byte accesses at that row stride are conflict-free spread, 2-way plain. (In
// Nsight Compute's source counters, runs 71-72, such conflicts were 30% of state_grads'
// and input_grads' shared-memory wavefronts; spread, the two took 2072 and 2116 us
// against 2233 and 2283, run 80.) The cost: a row's 32-byte stretch of 8 columns is
// half this tile's and half its partner's, so stores to global memory take twice the
// requests. prepare's w and u (an operand read by ldmatrix, one down its columns, the
// results straight to global memory) ran slower spread, 1671 us for its two launches
// against 1547 (run 79), and are not.
template <bool S> __device__ __forceinline__ int tile_pos(int x, int p) {
  return S ? 32 * (x / 2) + 4 * (x % 2) + p % 4 + 16 * (p / 4) : 16 * x + p;
}
#else
using TcAcc = wm::fragment<wm::accumulator, 16, 16, 8, float>;
__device__ __forceinline__ void fill(TcAcc& f, float v) { wm::fill_fragment(f, v); }
#endif
using TcA = wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32, wm::row_major>;
using TcB = wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32, wm::col_major>;
template <bool B, class T, class F> struct pick { using type = T; };
template <class T, class F> struct pick<false, T, F> { using type = F; };
// D += A B ([M, K] times [K, N]) on the tensor cores, the accumulators in the warps'
// fragments: zero(), then tc_run<K, KA, KB>() once or more, then each() or store(). Warp w
// owns tiles w, w + NW, .. of the (M / 16) x (N / 16) grid. Operands in memory (shared or
// global): KA, A(i, k) = A[i lda + k], else A[k lda + i]; KB, B(k, j) = B[j ldb + k], else
// B[k ldb + j]. EA / EB: that operand is exact in tf32 (one product per tile; otherwise
// it is split, 3xTF32, the small products in their own accumulators). With CS_TF32 every
// operand is taken as exact: one tf32 product per tile, each operand rounded to tf32
// (MLX's own float32 matmul precision on CUDA by default; CHUNKSCAN_GDN_TF32). Pointers
// 32-byte aligned at every tile's corner, lda / ldb / ldd multiples of 4 (wmma's rules);
// with CS_TF32 a KA / KB operand in shared memory (read by ldmatrix). SR0 / SC0 (TF32
// builds): the rows / columns of the tiles spread (tile_pos), for products whose every
// A / B operand is read down its columns (!KA / !KB); then M / N a multiple of 32.
template <int M, int N, int NW, bool EA0, bool EB0, bool SR0 = false, bool SC0 = false>
struct TcMM {
  static_assert(M % 16 == 0 && N % 16 == 0, "TcMM: tiles of 16 x 16");
#ifdef CS_TF32
  static constexpr bool EA = true, EB = true, SR = SR0, SC = SC0;
  static_assert((!SR || M % 32 == 0) && (!SC || N % 32 == 0), "TcMM: spread in blocks of 32");
#else
  static constexpr bool EA = EA0, EB = EB0, SR = false, SC = false;
#endif
  static constexpr int NWARPS = NW, TN = N / 16, TILES = (M / 16) * TN;
  static constexpr int PER = (TILES + NW - 1) / NW;
  static constexpr bool EVEN = TILES % NW == 0;  // every warp PER tiles (NW = NT / 32)
  static constexpr bool SMALL = !(EA && EB);
  TcAcc big[PER], small[SMALL ? PER : 1];
  __device__ __forceinline__ int tile(int p) const { return cs_tid() / 32 + p * NW; }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      fill(big[p], 0.f);
      if (SMALL) fill(small[p], 0.f);
    }
  }
  // Once, after the last tc_run(): fn(tl, D) for each owned tile tl, D = big + small (a
  // rounded float32 add) as a fragment that fn may change, and load() or store_tile() the
  // tile's place in a matrix.
  template <class F> __device__ __forceinline__ void each(F fn) {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int t = tile(p);
      if (t >= TILES) break;
      if (SMALL) {
#pragma unroll
        for (int e = 0; e < big[p].num_elements; ++e) big[p].x[e] += small[p].x[e];
      }
      fn(t, big[p]);
    }
  }
#ifdef CS_TF32
  // The lane's first row and column of tile tl (tile_pos): TcAcc's element e lies at row
  // row0 + 8 ((e / 2) % 2), column col0 + 8 (e / 4) + e % 2.
  __device__ __forceinline__ int row0(int tl) const {
    return tile_pos<SR>(tl / TN, (cs_tid() % 32) / 4);
  }
  __device__ __forceinline__ int col0(int tl) const {
    return tile_pos<SC>(tl % TN, 2 * (cs_tid() % 4));
  }
  // f = tile tl's place in the row-major matrix D (row stride ld), or store f there: each
  // column pair 8 bytes at a time
  __device__ __forceinline__ void load(TcAcc& f, int tl, const float* D, size_t ld) const {
    const float* p = D + row0(tl) * ld + col0(tl);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const float2 v = *reinterpret_cast<const float2*>(p + 8 * ((e / 2) % 2) * ld + 8 * (e / 4));
      f.x[e] = v.x;
      f.x[e + 1] = v.y;
    }
  }
  __device__ __forceinline__ void store_tile(float* D, size_t ld, int tl, const TcAcc& f) const {
    float* p = D + row0(tl) * ld + col0(tl);
#pragma unroll
    for (int e = 0; e < 8; e += 2)
      *reinterpret_cast<float2*>(p + 8 * ((e / 2) % 2) * ld + 8 * (e / 4)) =
          make_float2(f.x[e], f.x[e + 1]);
  }
#else
  __device__ __forceinline__ void load(TcAcc& f, int tl, const float* D, size_t ld) const {
    wm::load_matrix_sync(f, D + (tl / TN) * 16 * ld + (tl % TN) * 16, unsigned(ld),
                         wm::mem_row_major);
  }
  __device__ __forceinline__ void store_tile(float* D, size_t ld, int tl, const TcAcc& f) const {
    wm::store_matrix_sync(D + (tl / TN) * 16 * ld + (tl % TN) * 16, f, unsigned(ld),
                          wm::mem_row_major);
  }
#endif
  // Once, after the last tc_run(): D (row-major, shared or global memory) = the product,
  // or (neg) minus it.
  __device__ __forceinline__ void store(float* D, size_t ldd, bool neg = false) {
    each([&](int tl, TcAcc& d) {
      if (neg) {
#pragma unroll
        for (int e = 0; e < d.num_elements; ++e) d.x[e] = -d.x[e];
      }
      store_tile(D, ldd, tl, d);
    });
  }
#ifdef CS_TF32
  // csg::Prod's interface (Tile's each / store / v under other names): each_out(fn) calls
  // fn(row, column, value, a, b) for every output the lane holds, a = the tile (p), b =
  // its element (TcAcc's layout); RA x RBN names them all (at(a, b)). After the last
  // tc_run() and without each() (whose small parts it does not add: none with CS_TF32).
  static constexpr int RA = PER, RBN = 8;
  template <class F> __device__ __forceinline__ void each_out(F fn) const {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int tl = tile(p);
      if (tl >= TILES) break;  // the same for the whole warp
      const int r0 = row0(tl), c0 = col0(tl);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        fn(r0 + 8 * ((e / 2) % 2), c0 + 8 * (e / 4) + e % 2, big[p].x[e], p, e);
    }
  }
  // *ptr(i, j) = val(i, j, x, a, b) (converted to ptr's type) for every output the lane
  // holds, a tile at a time: its 8 vals first, then their stores (as Tile::store; all
  // tiles' vals at once took input_grads at heads of 96 past 128 registers); the lane's
  // two neighbouring columns (j even) in one 8-byte store where ptr gives a float*
  // (8-byte aligned at even j: Tile::store writes 16 bytes at a time there).
  template <class P, class V> __device__ __forceinline__ void store_out(P ptr, V val) const {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int tl = tile(p);
      if (tl >= TILES) break;  // the same for the whole warp
      const int r0 = row0(tl), c0 = col0(tl);
      float out[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        out[e] = val(r0 + 8 * ((e / 2) % 2), c0 + 8 * (e / 4) + e % 2, big[p].x[e], p, e);
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const int i = r0 + 8 * ((e / 2) % 2), j = c0 + 8 * (e / 4);
        if constexpr (is_float_ptr<decltype(ptr(i, j))>::value) {
          st2(ptr(i, j), out[e], out[e + 1]);
        } else {
          put(ptr(i, j), out[e]);
          put(ptr(i, j + 1), out[e + 1]);
        }
      }
    }
  }
  __device__ __forceinline__ float at(int a, int b) const { return big[a].x[b]; }
  // Every output the lane holds x = fn(row, column, x, a, b) (as each_out names them);
  // between tc_run()s too: the next run adds to the new values.
  template <class F> __device__ __forceinline__ void apply(F fn) {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int tl = tile(p);
      if (tl >= TILES) break;  // the same for the whole warp
      const int r0 = row0(tl), c0 = col0(tl);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        big[p].x[e] = fn(r0 + 8 * ((e / 2) % 2), c0 + 8 * (e / 4) + e % 2, big[p].x[e], p, e);
    }
  }
#endif
};
// mm += A B over K (TcMM's operand rules). The k steps are the outer loop and the warp's
// tiles the inner one, so that a warp keeps PER independent accumulator chains in flight;
// each tile's own sum still runs over k in order, so the values are those of one tile
// after another. Where NW is a multiple of the tiles per row (N / 16; every kernel at
// heads of 32, 64 or 128), all of a warp's tiles lie in one column of tiles and share
// one B fragment per k step; otherwise (a head of 96: 6 tiles per row) each tile loads
// its own. (Three products sharing B in one run, input_grads' kk, qk and d_w k^T, took
// its float32 variants past 128 registers, which 512 threads cannot launch: run 41.)
// RA / RB (TF32 builds): round that operand's values to tf32 as they are read; false
// where every value already is one (raw bf16 / fp16 inputs, or written with
// CS_OPERAND), which the emulator checks (cs_mma8).
template <int K, bool KA, bool KB, bool RA = true, bool RB = true, class MM>
__device__ __forceinline__ void tc_run(MM& mm, const float* A, int lda, const float* B, int ldb) {
  static_assert(K % 8 == 0, "TcMM: k in steps of 8");
#ifdef CS_TF32
  // mma.sync: per k step of 8 and tile, A's fragment [16, 8] and B's two [8, 8] (the
  // tile's column halves), each element rounded to tf32 (RA, RB), as cs_round rounds
  // wmma's. An operand whose k runs along its rows in memory (KA, KB: both in shared
  // memory then, rows 16-byte aligned) comes by one ldmatrix per fragment set (cs_ldsm4:
  // A's four values, or B's two halves' four), the others a 4-byte read per value.
  constexpr bool SHARED_B = MM::NWARPS % MM::TN == 0;
  if (mm.tile(0) >= MM::TILES) return;  // a warp without tiles (the same for the warp)
  const int lane = cs_tid() % 32, g = lane / 4, t = lane % 4;
  // Each lane's first element of every fragment (row or column g, k = t), or with KA /
  // KB its row for ldmatrix, as a pointer, once; the k steps fully unrolled, so that
  // every load is that pointer plus a constant (lda and ldb are constants where the
  // kernels call this).
  // (rows and columns where tile_pos puts them: MM::SR, MM::SC)
  auto a_ptr = [&](int tl) {
    const int x = tl / MM::TN;
    return KA ? A + (tile_pos<MM::SR>(x, lane % 8) + 8 * ((lane / 8) % 2)) * lda + 4 * (lane / 16)
              : A + t * lda + tile_pos<MM::SR>(x, g);
  };
  auto b_ptr = [&](int tl) {
    const int x = tl % MM::TN;
    return KB ? B + (tile_pos<MM::SC>(x, lane % 8) + 8 * (lane / 16)) * ldb + 4 * ((lane / 8) % 2)
              : B + t * ldb + tile_pos<MM::SC>(x, g);
  };
  // element (row + di, k + dk) of A and (k + dk, column + dj) of B from those pointers
  // (!KA, !KB)
  auto a_at = [&](const float* pa, int di, int dk) {
    const float x = pa[dk * lda + di];
    return RA ? cs_tf32(x) : x;
  };
  auto b_at = [&](const float* pb, int dk, int dj) {
    const float x = pb[dk * ldb + dj];
    return RB ? cs_tf32(x) : x;
  };
  auto ldsm = [](const float* row, float (&x)[4], bool round) {
    cs_ldsm4(row, x);
    if (round) {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = cs_tf32(x[e]);
    }
  };
  auto b_frags = [&](const float* pb, int k, float (&b)[2][2]) {  // both halves, a k step
    if constexpr (KB) {
      float x[4];
      ldsm(pb + k, x, RB);
      b[0][0] = x[0], b[0][1] = x[1], b[1][0] = x[2], b[1][1] = x[3];
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        b[h][0] = b_at(pb, k, 8 * h);
        b[h][1] = b_at(pb, k + 4, 8 * h);
      }
    }
  };
  const float* pa[MM::PER];
  const float* pb[SHARED_B ? 1 : MM::PER];
#pragma unroll
  for (int p = 0; p < MM::PER; ++p) {
    pa[p] = a_ptr(mm.tile(p));
    if (!SHARED_B || p == 0) pb[p] = b_ptr(mm.tile(p));
  }
  // (two k steps at a time where each tile loads its own B: input_grads at heads of 96
  // took 131 registers with its phase clocks, unrolled in full)
  constexpr int UNROLL = SHARED_B ? K / 8 : 2;
#pragma unroll UNROLL
  for (int k = 0; k < K; k += 8) {
    float b[2][2];
    if constexpr (SHARED_B) b_frags(pb[0], k, b);
#pragma unroll
    for (int p = 0; p < MM::PER; ++p) {
      if (!MM::EVEN && mm.tile(p) >= MM::TILES) break;  // the same for the whole warp
      if constexpr (!SHARED_B) b_frags(pb[p], k, b);
      float a[4];
      if constexpr (KA) {
        ldsm(pa[p] + k, a, RA);
      } else {
        a[0] = a_at(pa[p], 0, k), a[1] = a_at(pa[p], 8, k);
        a[2] = a_at(pa[p], 0, k + 4), a[3] = a_at(pa[p], 8, k + 4);
      }
      cs_mma8(mm.big[p].x, a, b[0]);
      cs_mma8(mm.big[p].x + 4, a, b[1]);
    }
  }
#else
  constexpr bool SHARED_B = MM::NWARPS % MM::TN == 0;
  using FA = wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32,
                          typename pick<KA, wm::row_major, wm::col_major>::type>;
  using FB = wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32,
                          typename pick<KB, wm::col_major, wm::row_major>::type>;
  if (mm.tile(0) >= MM::TILES) return;  // a warp without tiles (the same for the warp)
  const int c0 = (mm.tile(0) % MM::TN) * 16;  // the warp's column of tiles (SHARED_B)
#pragma unroll 2
  for (int k = 0; k < K; k += 8) {
    FB b, bs;
    if constexpr (SHARED_B) {
      wm::load_matrix_sync(b, KB ? B + c0 * ldb + k : B + k * ldb + c0, ldb);
      if (MM::EB) cs_round(b); else cs_split(b, bs);
    }
#pragma unroll
    for (int p = 0; p < MM::PER; ++p) {
      const int t = mm.tile(p);
      if (t >= MM::TILES) break;  // the same for the whole warp
      if constexpr (!SHARED_B) {
        const int c = (t % MM::TN) * 16;
        wm::load_matrix_sync(b, KB ? B + c * ldb + k : B + k * ldb + c, ldb);
        if (MM::EB) cs_round(b); else cs_split(b, bs);
      }
      const int r0 = (t / MM::TN) * 16;
      FA a, as;
      wm::load_matrix_sync(a, KA ? A + r0 * lda + k : A + k * lda + r0, lda);
      if (MM::EA) cs_round(a); else cs_split(a, as);
      if (!MM::EA) wm::mma_sync(mm.small[p], as, b, mm.small[p]);
      if (!MM::EB) wm::mma_sync(mm.small[p], a, bs, mm.small[p]);
      wm::mma_sync(mm.big[p], a, b, mm.big[p]);
    }
  }
#endif
}
#ifdef CS_TF32
// Prod (see Tile): with CS_TF32 a TcMM, the product on the tensor cores (NT / 32 warps).
template <int M, int N, int NT, bool RB = false, bool CB = false, bool SR = false, bool SC = false>
using Prod = TcMM<M, N, NT / 32, true, true, SR, SC>;
template <int K, bool KA, bool KB, bool RA = true, bool RB = true, class MM>
__device__ __forceinline__ void prod(MM& mm, const float* A, int lda, const float* B, int ldb) {
  tc_run<K, KA, KB, RA, RB>(mm, A, lda, B, ldb);
}
#endif
}  // namespace csg
"""
)

# Every kernel: grid (n * NT, L, Z): blockIdx.x = chunk j of the group, blockIdx.y =
# lane l = b * HV + h (value head h, key head h / G); input_grads' blockIdx.y is a key
# lane b * HK + hk instead (_KEY_LANES). Raw inputs in the chunk layout [B, n, C, H, D]
# (token tok + i of chunk j: tok = (b * n + j) * C).
_VALUE_LANE = r"""
  const int tid = threadIdx.x, j = blockIdx.x, l = blockIdx.y, n = gridDim.x;
  const int b = l / HV, h = l % HV, hk = h / G;
  const size_t cl = size_t(l) * n + j;         // (lane, chunk)
"""
_KEY_LANE = r"""
  const int j = blockIdx.x, n = gridDim.x;  // (tid: read in the loop, see cs_tid)
  const int b = blockIdx.y / HK, hk = blockIdx.y % HK;
"""
_COMMON = r"""
  const size_t tok = (size_t(b) * n + j) * C;  // first token of the chunk
  constexpr int LDC = C + 1;  // prepare's L and A (read a value at a time)
  constexpr int LDC4 = C + 4, LDK4 = DK + 4, LDV4 = DV + 4;  // rows read 16 B at a time
  const float scale = csg::bits_float(SCALE_BITS);
  CS_PROF_BEGIN;
"""

# prepare: a, p, w, u, kt, decay.
_PREPARE = r"""
  constexpr int DM = DK > DV ? DK : DV, LDM = DM + 4;
  CS_DYN_SMEM(sm);
  float* Ks = sm;             // [C][LDK4] k
  float* Xs = Ks + C * LDK4;  // [C][LDM] q, then k beta gamma, then v beta
  // L's and A's row stride: C + 4 in TF32 builds, whose products read A's rows 16 bytes
  // at a time (ldmatrix: no copy of A at that stride before w and u), else C + 1 (the
  // FMA tiles read A a value at a time down its columns). (The forward substitution and
  // the doubling levels are free of bank conflicts at either stride.)
#ifdef CS_TF32
  constexpr int LDL = LDC4;
#else
  constexpr int LDL = LDC;
#endif
  // Ls and As hold [C][LDL] matrices, their regions [C][LDC4] (the tensor-core products'
  // results and operands in between, CS_TC / CS_TF32: wmma needs row strides of 4s).
  float* Ls = Xs + C * LDM;   // [C][LDL] gam, then L = beta_i gam kk (strict)
  float* As = Ls + C * LDC4;  // [C][LDL] (I + L)^-1
  float* gf = As + C * LDC4;
  float* bt = gf + C;
  float* gma = bt + C;
  float* ten = gma + C;
  // k's and q's loads all in flight at once (one memory latency, not two), then the gates'
  const size_t qk0 = tok * HK * DK + hk * DK;  // the chunk's q, k rows: stride HK DK
  csg::TileLoad<C, DK, NT, csg::elem_t<decltype(k)>> kl;
  csg::TileLoad<C, DK, NT, csg::elem_t<decltype(q)>> ql;
  kl.issue(k + qk0, HK * DK);
  ql.issue(q + qk0, HK * DK);
  for (int i = tid; i < C; i += NT) {
    gf[i] = csg::gate(csg::f(g[(tok + i) * HV + h]));
    bt[i] = csg::fin(csg::f(beta[(tok + i) * HV + h]));
  }
  kl.land([&](int i, int d, float x) { Ks[i * LDK4 + d] = csg::fin(x); });
  ql.land([&](int i, int d, float x) { Xs[i * LDM + d] = csg::fin(x); });
  __syncthreads();
  CS_MARK();  // 0: loads
  csg::chunk_gates<C, NT>(gf, gma, ten);
  csg::fill_gam<C, LDL, NT>(gf, Ls);
  __syncthreads();
  CS_MARK();  // 1: gates
#ifdef CS_TC
  {
    // On the tensor cores (exact products for bf16 / fp16 inputs, 3xTF32 otherwise, as
    // input_grads' kk and qk; one tf32 product each with CS_TF32), each result stored in
    // As' region ([C][LDC4]) and combined with gam from there: qk into p, then kk into L.
    constexpr bool EX = sizeof(*q) == 2 && sizeof(*k) == 2;
    float* St = As;
    {
      csg::TcMM<C, C, NT / 32, EX, EX> qk;
      qk.zero();
      csg::tc_run<DK, true, true, !EX, !EX>(qk, Xs, LDM, Ks, LDK4);
      qk.store(St, LDC4);
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += NT) {
      const int i = e / C, t = e % C;
      P[cl * C * C + e] = t <= i ? scale * St[i * LDC4 + t] * Ls[i * LDL + t] : 0.f;
    }
    __syncthreads();
    {
      csg::TcMM<C, C, NT / 32, EX, EX> kk;
      kk.zero();
      csg::tc_run<DK, true, true, !EX, !EX>(kk, Ks, LDK4, Ks, LDK4);
      kk.store(St, LDC4);
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += NT) {  // gam read, then replaced by L, in place
      const int i = e / C, t = e % C;
      Ls[i * LDL + t] = t < i ? bt[i] * Ls[i * LDL + t] * St[i * LDC4 + t] : 0.f;
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += NT) As[(e / C) * LDL + e % C] = 0.f;
  }
#else
  for (int e = tid; e < C * C; e += NT) As[(e / C) * LDL + e % C] = 0.f;
  {
    csg::Tile<C, C, NT> kk, qk;
    kk.mm4<DK>(csg::op<true>(Ks, LDK4), csg::op<true>(Ks, LDK4));
    qk.mm4<DK>(csg::op<true>(Xs, LDM), csg::op<true>(Ks, LDK4));
    // Both tiles own the same (i, t): gam is read, then replaced by L, by one thread.
    kk.each([&](int i, int t, float x, int a, int b) {
      const float gm = Ls[i * LDL + t];
      P[cl * C * C + i * C + t] = t <= i ? scale * qk.v[a][b] * gm : 0.f;
      Ls[i * LDL + t] = t < i ? bt[i] * gm * x : 0.f;
    });
  }
#endif
  __syncthreads();
  CS_MARK();  // 2: kk, qk
  // A = (I + L)^-1 (L strictly lower) in blocks: the diagonal blocks of B0 = 16 rows by
  // forward substitution, all of them at once (inside a block, A[i][m] = [i == m] -
  // sum_{m <= t < i} L[i][t] A[t][m]); then by doubling (csg::inverse_level), for s =
  // 16, 32, ..: X21 = -A22 (L21 A11). The blocks above the diagonal stay zero (As was
  // cleared with the kk, qk phase).
  {
    constexpr int B0 = 16;
    if (tid < C) {  // thread (block q0, column m) owns column m of its block: no barriers
      const int q0 = (tid / B0) * B0, m = tid % B0;
      float col[B0];  // A[q0 + t][q0 + m], t < B0; stored once all are known, so that
                      // no store stands between L's loads
#pragma unroll
      for (int r = 0; r < B0; ++r) {
        float val = m == r ? 1.f : 0.f;
        if (m < r) {
          float s = 0.f;
#pragma unroll
          for (int t = 0; t < r; ++t)
            if (t >= m) s = fmaf(Ls[(q0 + r) * LDL + q0 + t], col[t], s);
          val = -s;
        }
        col[r] = val;
      }
#pragma unroll
      for (int r = 0; r < B0; ++r) As[(q0 + r) * LDL + q0 + m] = col[r];
    } else {  // the other warps meanwhile: k beta gamma into Xs (q is no longer needed), K~;
              // four values of a row at a time
      static_assert(NT > C, "prepare: warps beside the forward substitution");
      static_assert(DK % 4 == 0, "prepare: rows of K~ in runs of four");
      for (int e = tid - C; e < C * DK / 4; e += NT - C) {
        const int i = e / (DK / 4), d = 4 * (e % (DK / 4));
        const float4 kv = csg::ld4(Ks + i * LDK4 + d);
        const float kb = bt[i] * gma[i], te = ten[i];
        *reinterpret_cast<float4*>(Xs + i * LDM + d) =
            make_float4(CS_OPERAND(kv.x * kb), CS_OPERAND(kv.y * kb), CS_OPERAND(kv.z * kb),
                        CS_OPERAND(kv.w * kb));
        csg::st4(KT + (cl * C + i) * DK + d,
                 make_float4(kv.x * te, kv.y * te, kv.z * te, kv.w * te));
      }
    }
    __syncthreads();
    constexpr int LEVELS = (C >= 2 * B0) + (C >= 4 * B0);
    static_assert((B0 << LEVELS) == C, "prepare: C is 16, 32 or 64");
    if constexpr (LEVELS >= 1) csg::inverse_level<B0, C, LDL, NT>(Ls, As);
    if constexpr (LEVELS >= 2) csg::inverse_level<2 * B0, C, LDL, NT>(Ls, As);
  }
  if (WRITE_A)  // the backward's (the forward needs no A)
    for (int e = tid; e < C * C; e += NT) A[cl * C * C + e] = As[(e / C) * LDL + e % C];
  if (tid == 0) DECAY[cl] = gma[C - 1];
  __syncthreads();
  CS_MARK();  // 3: the inverse, stores
  // v's loads start now and land after w's product, which hides their latency
  csg::TileLoad<C, DV, NT, csg::elem_t<decltype(v)>> vl;
  vl.issue(v + tok * HV * DV + h * DV, HV * DV);
#ifdef CS_TF32
  // w and u on the tensor cores, one tf32 product per tile, a's values rounded to tf32
  // as they are read
  {
    csg::TcMM<C, DK, NT / 32, true, true> w;  // (not spread: see tile_pos)
    w.zero();
    csg::tc_run<C, true, false, true, false>(w, As, LDL, Xs, LDM);
    w.store(W + cl * C * DK, DK);
  }
#else
  {
    csg::Tile<C, DK, NT, false, true> w;
    w.mm4<C>([&](int i, int t) { return As[i * LDL + t]; }, csg::op<false>(Xs, LDM));
    w.store([&](int i, int d) { return W + (cl * C + i) * DK + d; }, csg::Same());
  }
#endif
  __syncthreads();
  vl.land([&](int i, int c, float x) { Xs[i * LDM + c] = CS_OPERAND(csg::fin(x) * bt[i]); });
  __syncthreads();
#ifdef CS_TF32
  {
    csg::TcMM<C, DV, NT / 32, true, true> u;
    u.zero();
    csg::tc_run<C, true, false, true, false>(u, As, LDL, Xs, LDM);
    u.store(U + cl * C * DV, DV);
  }
#else
  {
    csg::Tile<C, DV, NT, false, true> u;
    u.mm4<C>([&](int i, int t) { return As[i * LDL + t]; }, csg::op<false>(Xs, LDM));
    u.store([&](int i, int c) { return U + (cl * C + i) * DV + c; }, csg::Same());
  }
#endif
  CS_PROF_END("prepare");  // 4: w, v loads, u
"""

# outputs (MODE_H false): o = X S^T + p u with X = qg - p w;
# state_gradient_input (MODE_H true): h = d_o^T X.
_OUTPUT = r"""
  // Each block: TV columns of o (rows of S and of h) from e0 on, blockIdx.z = e0 / TV, in
  // steps of TH of them (e1): S's rows, u's and d_o's columns pass through shared memory
  // a step at a time, so that at TH = 64 a block of all 128 columns takes 101 KiB and two
  // share a multiprocessor (each step's loads overlap the other block's products), while
  // X = qg - p w is made once for all of them.
  static_assert(TV % TH == 0, "output: whole steps of TH columns");
  constexpr int LDT = TH + 4;
  constexpr int BIG0 = (TH * LDK4 > C * LDT ? TH * LDK4 : C * LDT);
  constexpr int BIG = (BIG0 > C * LDK4 ? BIG0 : C * LDK4);
  const int e0 = blockIdx.z * TV;
  CS_DYN_SMEM(sm);
  float* Xs = sm;             // [C][LDK4] q, then X = qg - p w
  float* Ps = Xs + C * LDK4;  // [C][LDC4] p
  float* Bs = Ps + C * LDC4;  // [C][LDK4] w, then a step's [TH][LDK4] S or [C][LDT] d_o; o
  float* Us = Bs + BIG;       // [C][LDT] a step's u columns (outputs only)
  float* gf = Us + (MODE_H ? 0 : C * LDT);
  float* gma = gf + C;
  float* ten = gma + C;
  float* bad = ten + C;  // o_bad of the chunk's rows (1 or 0), read once per block
  // w, p (and u's first step) copied in the background while q comes through registers
  csg::copy_tile<C, DK, NT>(Bs, LDK4, W + cl * C * DK, DK);
  csg::copy_tile<C, C, NT>(Ps, LDC4, P + cl * C * C, C);
  if (!MODE_H) csg::copy_tile<C, TH, NT>(Us, LDT, U + cl * C * DV + e0, DV);
  for (int i = tid; i < C; i += NT) {
    gf[i] = csg::gate(csg::f(g[(tok + i) * HV + h]));
    bad[i] = obad[(tok + i) * HV + h] ? 1.f : 0.f;
  }
  csg::load_tile<C, DK, NT>(q + tok * HK * DK + hk * DK, HK * DK,
                            [&](int i, int d, float x) { Xs[i * LDK4 + d] = csg::fin(x); });
  csg::copies_land();
  __syncthreads();
  CS_MARK();  // 0: loads
  csg::chunk_gates<C, NT>(gf, gma, ten);
  __syncthreads();
#ifdef CS_TF32
  for (int e = tid; e < C * DK; e += NT) {  // scale gamma q, then minus p w by tile
    const int i = e / DK, x = i * LDK4 + e % DK;
    Xs[x] = scale * gma[i] * Xs[x];
  }
  __syncthreads();
  {
    csg::TcMM<C, DK, NT / 32, true, true, false, true> x;  // w read down its columns
    x.zero();
    csg::tc_run<C, true, false>(x, Ps, LDC4, Bs, LDK4);
    x.each([&](int tl, csg::TcAcc& val) {  // each tile read and written by its warp
      csg::TcAcc qg;
      x.load(qg, tl, Xs, LDK4);
      for (int e = 0; e < val.num_elements; ++e) val.x[e] = CS_OPERAND(qg.x[e] - val.x[e]);
      x.store_tile(Xs, LDK4, tl, val);
    });
  }
#else
  {
    csg::Tile<C, DK, NT, false, true> x;
    x.mm4<C>(csg::op<true>(Ps, LDC4), csg::op<false>(Bs, LDK4));
    x.each([&](int i, int d, float val, int, int) {
      Xs[i * LDK4 + d] = scale * gma[i] * Xs[i * LDK4 + d] - val;
    });
  }
#endif
  CS_MARK();  // 1: gates, X
  for (int e1 = e0; e1 < e0 + TV; e1 += TH) {
    __syncthreads();  // X written; Bs (w, or the step before's o) and Us free
    if (MODE_H) {
      csg::load_tile<C, TH, NT>(dout + (tok * HV + h) * DV + e1, HV * DV,
                                [&](int i, int c, float x) {
                                  Bs[i * LDT + c] = bad[i] != 0.f ? 0.f : x;
                                });
    } else {
      csg::copy_tile<TH, DK, NT>(Bs, LDK4, S + (cl * DV + e1) * DK, DK);
      if (e1 != e0) csg::copy_tile<C, TH, NT>(Us, LDT, U + cl * C * DV + e1, DV);
      csg::copies_land();
    }
    __syncthreads();
    CS_MARK();  // 2, 4, ..: a step's S or d_o loads
#ifdef CS_TF32
    if (MODE_H) {
      csg::TcMM<TH, DK, NT / 32, true, true, true, true> hm;  // both read down their columns
      hm.zero();
      constexpr bool EXO = sizeof(*dout) == 2;  // bf16 / fp16 d_o: exact in tf32
      csg::tc_run<C, false, false, !EXO, false>(hm, Bs, LDT, Xs, LDK4);
      hm.store(Hm + (cl * DV + e1) * DK, DK);
    } else {
      csg::TcMM<C, TH, NT / 32, true, true> o;
      o.zero();
      csg::tc_run<DK, true, true, false, true>(o, Xs, LDK4, Bs, LDK4);
      csg::tc_run<C, true, false>(o, Ps, LDC4, Us, LDT);
      __syncthreads();  // every warp done with S: o through shared memory, then out
      o.store(Bs, LDT);
      __syncthreads();
      for (int e = tid; e < C * TH; e += NT) {
        const int i = e / TH, c = e % TH;
        const size_t r = (tok + i) * HV + h;
        out[r * DV + e1 + c] = static_cast<TO>(bad[i] != 0.f ? CS_NAN : Bs[i * LDT + c]);
      }
    }
#else
    if (MODE_H) {
      csg::Tile<TH, DK, NT, true, true> hm;
      hm.mm4<C>(csg::op<false>(Bs, LDT), csg::op<false>(Xs, LDK4));
      hm.store([&](int c, int d) { return Hm + (cl * DV + e1 + c) * DK + d; }, csg::Same());
    } else {
      csg::Tile<C, TH, NT> o;
      o.mm4<DK>(csg::op<true>(Xs, LDK4), csg::op<true>(Bs, LDK4));
      o.mm4<C>(csg::op<true>(Ps, LDC4), csg::op<false>(Us, LDT));
      o.each([&](int i, int c, float val, int, int) {
        const size_t r = (tok + i) * HV + h;
        out[r * DV + e1 + c] = static_cast<TO>(bad[i] != 0.f ? CS_NAN : val);
      });
    }
#endif
    if (e1 + TH < e0 + TV) CS_MARK();  // 3, 5, ..: a step's h or o (the last one's below)
  }
  CS_PROF_END(MODE_H ? "output_h" : "output");
"""

# state_gradients: grid z = slice of TV columns of Dv (NV slices, partial sums).
_STATE_GRADS = r"""
  constexpr int LDT = TV + 4, LDS = KS + 4;  // KS: the template constant (Python's KS)
  static_assert(DK % KS == 0, "state_grads: Dk in whole pieces of KS columns");
  CS_DYN_SMEM(sm);
  // S and dS pass through shared memory KS columns of Dk at a time, twice (the products
  // that sum over Dk, then those that give Dk's columns): about 104 KiB at C = 64, TV = 64
  // and Dk = 128, so two blocks share a multiprocessor (the whole slices took 152 KiB, one).
  float* Ps = sm;             // [C][LDC4] p
  float* Do = Ps + C * LDC4;  // [C][LDT] d_o slice (0 where o_bad)
  float* Vn = Do + C * LDT;   // [C][LDT] v_new = u - w S^T
  float* DVn = Vn + C * LDT;  // [C][LDT] d_vnew = p^T d_o + kt dS^T
  float* Vt = DVn + C * LDT;  // [C][LDT] v
  float* Sk = Vt + C * LDT;   // [TV][LDS] S, KS columns
  float* DSk = Sk + TV * LDS; // [TV][LDS] dS, the same columns
  float* red = DSk + TV * LDS;  // [NT]
  float* bad = red + NT;      // [C] o_bad of the chunk's rows (1 or 0)
  // w and kt, KS columns at a time, over v_new and d_vnew (written only after the last
  // of them is read).
  static_assert(LDS <= LDT, "w, kt slices fit over v_new, d_vnew");
  float* Wk = Vn;             // [C][LDS] w
  float* Kk = DVn;            // [C][LDS] kt
  const int z = blockIdx.z, e0 = z * TV;
  const size_t pz = size_t(z) * (size_t(gridDim.y) * n) + cl;  // partial-sum index
  const size_t s0 = (cl * DV + e0) * DK;  // the slice of S and dS
  // p is copied in the background; the o_bad flags go to shared memory before d_o's
  // loads, each of which reads its row's flag there.
  static_assert(NT >= C, "state_grads: a thread per row's flag");
  csg::copy_tile<C, C, NT>(Ps, LDC4, P + cl * C * C, C);  // in the background from here on
  // d_o's and v's loads in flight together (one memory latency, not two) while the flags
  // come in
  const size_t o0 = tok * HV * DV + h * DV + e0;  // the chunk's d_o, v rows: stride HV DV
  csg::TileLoad<C, TV, NT, csg::elem_t<decltype(dout)>> dol;
  csg::TileLoad<C, TV, NT, csg::elem_t<decltype(v)>> vl;
  dol.issue(dout + o0, HV * DV);
  vl.issue(v + o0, HV * DV);
  if (tid < C) bad[tid] = obad[(tok + tid) * HV + h] ? 1.f : 0.f;
  __syncthreads();
  dol.land([&](int i, int r, float x) { Do[i * LDT + r] = bad[i] != 0.f ? 0.f : x; });
  vl.land([&](int i, int r, float x) { Vt[i * LDT + r] = csg::fin(x); });
  csg::copies_land();
  __syncthreads();
  CS_MARK();  // 0: p, d_o, v loads
  // The KS columns from k0 of S and w (group A: v_new's operands), of dS and kt (group
  // B: d_vnew's), each one cp.async group, so that a piece's loads run behind the
  // products of the piece before: A(k0 + KS) behind d_vnew's product of k0, B(k0 + KS)
  // behind v_new's of k0 + KS, A(0) and B(0) behind p^T d_o (before session 39 each
  // piece's four tiles landed before its products began).
  auto load_a = [&](int k0) {
    csg::copy_tile<TV, KS, NT>(Sk, LDS, S + s0 + k0, DK);
    csg::copy_tile<C, KS, NT>(Wk, LDS, W + cl * C * DK + k0, DK);
    cs_cp_async_commit();
  };
  auto load_b = [&](int k0) {
    csg::copy_tile<TV, KS, NT>(DSk, LDS, DS + s0 + k0, DK);
    csg::copy_tile<C, KS, NT>(Kk, LDS, KT + cl * C * DK + k0, DK);
    cs_cp_async_commit();
  };
  // Pass 2's S and dS pieces, one group each (S's behind d_kt's product of the piece
  // before, dS's behind d_w's and d_qg's of its own).
  auto load_s2 = [&](int k0) {
    csg::copy_tile<TV, KS, NT>(Sk, LDS, S + s0 + k0, DK);
    cs_cp_async_commit();
  };
  auto load_ds2 = [&](int k0) {
    csg::copy_tile<TV, KS, NT>(DSk, LDS, DS + s0 + k0, DK);
    cs_cp_async_commit();
  };
  // This thread's part of sum(S * dS) over one piece (a fixed order: piece by piece).
  float dec = 0.f;
  auto dot_s = [&]() {
    for (int e = tid; e < TV * KS; e += NT) {
      const int x = (e / KS) * LDS + e % KS;
      dec = fmaf(Sk[x], DSk[x], dec);
    }
  };
  constexpr int LAST = DK - KS;  // pass 2 starts from the piece pass 1 left in place
  // bf16 / fp16 d_o and v are exact in tf32: their tiles (Do, Vt) go to the tensor cores
  // unrounded, as v_new and d_vnew (Vn, DVn: written rounded, CS_OPERAND).
  constexpr bool EXO = sizeof(*dout) == 2, EXV = sizeof(*v) == 2;
  // Pass 1, the order of one piece k0 (A(k0) and B(k0) in flight on entry):
  //   wait for A, barrier; v_new += w S^T; wait for B, barrier; the S . dS dot; barrier
  //   (S and w read by all); issue A(k0 + KS); d_vnew += kt dS^T; barrier (dS and kt
  //   read); issue B(k0 + KS).
  // A barrier follows the last piece: v_new and d_vnew are written over w and kt.
  load_a(0);
  load_b(0);
#ifdef CS_TF32
  // The products on the tensor cores, one tf32 product per tile (CS_TF32), the results
  // stored from the fragments.
  {
    csg::TcMM<C, TV, NT / 32, true, true> vn, dvn;
    vn.zero();
    dvn.zero();
    csg::tc_run<C, false, false, true, !EXO>(dvn, Ps, LDC4, Do, LDT);  // p^T d_o
    for (int k0 = 0; k0 < DK; k0 += KS) {  // pass 1: sums over Dk
      cs_cp_async_wait_one();  // A(k0)
      __syncthreads();
      csg::tc_run<KS, true, true>(vn, Wk, LDS, Sk, LDS);
      cs_cp_async_wait_all();  // B(k0)
      __syncthreads();
      dot_s();
      __syncthreads();
      if (k0 != LAST) load_a(k0 + KS);
      csg::tc_run<KS, true, true>(dvn, Kk, LDS, DSk, LDS);
      __syncthreads();
      if (k0 != LAST) load_b(k0 + KS);
    }
    vn.each([&](int tl, csg::TcAcc& x) {  // v_new = u - w S^T
      csg::TcAcc u;
      vn.load(u, tl, U + cl * C * DV + e0, DV);
      for (int e = 0; e < x.num_elements; ++e) x.x[e] = CS_OPERAND(u.x[e] - x.x[e]);
      vn.store_tile(Vn, LDT, tl, x);
    });
    dvn.each([&](int tl, csg::TcAcc& x) {
      dvn.store_tile(DVN + cl * C * DV + e0, DV, tl, x);
      for (int e = 0; e < x.num_elements; ++e) x.x[e] = CS_OPERAND(x.x[e]);
      dvn.store_tile(DVn, LDT, tl, x);
    });
  }
#else
  {
    csg::Tile<C, TV, NT> vn, dvn;
    dvn.mm4<C>(csg::op<false>(Ps, LDC4), csg::op<false>(Do, LDT));
    for (int k0 = 0; k0 < DK; k0 += KS) {  // pass 1: sums over Dk
      cs_cp_async_wait_one();  // A(k0)
      __syncthreads();
      vn.mm4<KS>(csg::op<true>(Wk, LDS), csg::op<true>(Sk, LDS));
      cs_cp_async_wait_all();  // B(k0)
      __syncthreads();
      dot_s();
      __syncthreads();
      if (k0 != LAST) load_a(k0 + KS);
      dvn.mm4<KS>(csg::op<true>(Kk, LDS), csg::op<true>(DSk, LDS));
      __syncthreads();
      if (k0 != LAST) load_b(k0 + KS);
    }
    vn.each([&](int i, int r, float x, int, int) {
      Vn[i * LDT + r] = U[(cl * C + i) * DV + e0 + r] - x;
    });
    dvn.each([&](int i, int r, float x, int, int) {
      DVn[i * LDT + r] = x;
      DVN[(cl * C + i) * DV + e0 + r] = x;
    });
  }
#endif
  red[tid] = dec;
  __syncthreads();
  CS_MARK();  // 1: v_new, d_vnew, S . dS
  for (int w = NT / 2; w > 0; w /= 2) {  // tree sum of red[] (fixed order)
    if (tid < w) red[tid] += red[tid + w];
    __syncthreads();
  }
  if (tid == 0) DDECp[pz] = red[0];
  CS_MARK();  // 2: d_decay
  // Pass 2 (d_w, d_qg, d_kt, KS columns each, from the piece pass 1 left in place down):
  // d_w and d_qg of k0 from S; barrier; issue S(k0 - KS); wait for dS(k0) (in place at
  // LAST), barrier; d_kt of k0 from dS; barrier; issue dS(k0 - KS), wait for S(k0 - KS),
  // barrier. (The barrier after pass 1's pieces, above, ends its reads of Sk and DSk' last
  // piece before the tree sum; v_new's and d_vnew's tiles are in place.)
  for (int k0 = LAST; k0 >= 0; k0 -= KS) {
    const size_t d0 = pz * C * DK + k0;
#ifdef CS_TF32
    csg::TcMM<C, KS, NT / 32, true, true, false, true> dw, dqg, dkt;  // S, dS down columns
    dw.zero();
    csg::tc_run<TV, true, false, false, true>(dw, DVn, LDT, Sk, LDS);
    dw.store(DWp + d0, DK, true);
    dqg.zero();
    csg::tc_run<TV, true, false, !EXO, true>(dqg, Do, LDT, Sk, LDS);
    dqg.store(DQGp + d0, DK);
#else
    csg::Tile<C, KS, NT, false, true> dw, dqg, dkt;
    dw.mm4<TV>(csg::op<true>(DVn, LDT), csg::op<false>(Sk, LDS));
    dqg.mm4<TV>(csg::op<true>(Do, LDT), csg::op<false>(Sk, LDS));
    dw.store([&](int i, int d) { return DWp + d0 + i * DK + d; },
             [](int, int, float x, int, int) { return -x; });
    dqg.store([&](int i, int d) { return DQGp + d0 + i * DK + d; }, csg::Same());
#endif
    __syncthreads();  // every thread is done with S's piece
    if (k0 != 0) load_s2(k0 - KS);
    if (k0 != LAST) {  // dS(k0), issued the piece before
      if (k0 != 0) cs_cp_async_wait_one(); else cs_cp_async_wait_all();
      __syncthreads();
    }
#ifdef CS_TF32
    dkt.zero();
    csg::tc_run<TV, true, false, false, true>(dkt, Vn, LDT, DSk, LDS);
    dkt.store(DKTp + d0, DK);
#else
    dkt.mm4<TV>(csg::op<true>(Vn, LDT), csg::op<false>(DSk, LDS));
    dkt.store([&](int i, int d) { return DKTp + d0 + i * DK + d; }, csg::Same());
#endif
    if (k0 != 0) {
      __syncthreads();  // every thread is done with dS's piece
      load_ds2(k0 - KS);
      cs_cp_async_wait_one();  // S(k0 - KS)
      __syncthreads();
    }
  }
  CS_MARK();  // 3: d_w, d_qg, d_kt
#ifdef CS_TF32
  {
    // d_p in full (input_grads keeps its causal part), m2
    csg::TcMM<C, C, NT / 32, true, true> dp, m2;
    dp.zero();
    csg::tc_run<TV, true, true, !EXO, false>(dp, Do, LDT, Vn, LDT);
    dp.store(DPp + pz * C * C, C);
    m2.zero();
    csg::tc_run<TV, true, true, false, !EXV>(m2, DVn, LDT, Vt, LDT);
    m2.store(M2p + pz * C * C, C);
  }
#else
  {
    csg::Tile<C, C, NT> dp, m2;
    dp.mm4<TV>(csg::op<true>(Do, LDT), csg::op<true>(Vn, LDT));
    m2.mm4<TV>(csg::op<true>(DVn, LDT), csg::op<true>(Vt, LDT));
    dp.each([&](int i, int t, float x, int, int) {
      DPp[(pz * C + i) * C + t] = t <= i ? x : 0.f;
    });
    m2.each([&](int i, int t, float x, int, int) { M2p[(pz * C + i) * C + t] = x; });
  }
#endif
  CS_PROF_END("state_grads");  // 4: d_p, m2
"""

# input_gradients: back through the preparation, one block per (chunk, key lane): the G
# value heads of the key head one after another, each head's dv, dg and dbeta written as
# it ends, dq and dk summed over the heads in the block's registers and written once, in
# the inputs' dtypes (zero where q or k is non-finite). q, k and their products kk, qk
# are the key head's: loaded and formed once for its G heads. (Before session 38, a block
# per value lane wrote float32 dq, dk per value head, summed by a kernel of their own:
# 32 KiB per token more at the Qwen3-Next shape, and kk, qk formed G times.)
_INPUT_GRADS = r"""
  CS_DYN_SMEM(sm);
  float* As = sm;             // [C][LDC4] a
  float* KKs = As + C * LDC4; // [C][LDC4] kk (the key head's, kept for all its heads)
  float* QKs = KKs + C * LDC4;  // [C][LDC4] qk (the same)
  float* DPs = QKs + C * LDC4;  // [C][LDC4] d_p, then d_qk = scale d_p gam
  float* M2s = DPs + C * LDC4;  // [C][LDC4] d_vnew v^T, then d_a, then d_l, then d_kk
  float* Gs = M2s + C * LDC4; // [C][LDC4] gam
  float* M1s = Gs + C * LDC4;  // [C][LDC4] d_w k^T, then T1 = d_a a^T, then d_gam gam
  float* Ks = M1s + C * LDC4; // [C][LDK4] k (the key head's)
  float* Qs = Ks + C * LDK4;  // [C][LDK4] q (the key head's)
  float* Ws = Qs + C * LDK4;  // [C][LDK4] d_w (the NV partial sums added)
  float* red = Ws + C * LDK4; // [2][NT] row-dot partial sums
  float* gf = red + 2 * NT;
  float* bt = gf + C;
  float* gma = bt + C;
  float* ten = gma + C;
  float* kdkb = ten + C;
  float* dvbv = kdkb + C;
  float* vg = dvbv + C;       // d_gamma gamma
  float* vt = vg + C;         // d_to_end to_end
  float* vb = vt + C;         // d_beta
  const size_t LN = size_t(gridDim.y) * G * n;  // (value lanes) x chunks: NV's stride
  const size_t qk0 = tok * HK * DK + hk * DK;  // the chunk's q, k rows: stride HK DK
  auto qk_at = [&](int i, int d) { return qk0 + i * HK * DK + d; };  // q's, k's (i, d)
  // bf16 / fp16 q and k: exact in tf32 (one product per tile; Qs and Ks go to the tensor
  // cores unrounded)
  constexpr bool EXQK = sizeof(*q) == 2 && sizeof(*k) == 2;
  {
    csg::TileLoad<C, DK, NT, csg::elem_t<decltype(k)>> kl;
    csg::TileLoad<C, DK, NT, csg::elem_t<decltype(q)>> ql;
    kl.issue(k + qk0, HK * DK);
    ql.issue(q + qk0, HK * DK);
    kl.land([&](int i, int d, float x) { Ks[i * LDK4 + d] = csg::fin(x); });
    ql.land([&](int i, int d, float x) { Qs[i * LDK4 + d] = csg::fin(x); });
  }
  __syncthreads();
#ifdef CS_TC
  {
    csg::TcMM<C, C, NT / 32, EXQK, EXQK> kk, qk;
    kk.zero();
    csg::tc_run<DK, true, true, !EXQK, !EXQK>(kk, Ks, LDK4, Ks, LDK4);
    kk.store(KKs, LDC4);
    qk.zero();
    csg::tc_run<DK, true, true, !EXQK, !EXQK>(qk, Qs, LDK4, Ks, LDK4);
    qk.store(QKs, LDC4);
  }
#else
  {
    csg::Tile<C, C, NT> kk, qk;
    kk.mm4<DK>(csg::op<true>(Ks, LDK4), csg::op<true>(Ks, LDK4));
    qk.mm4<DK>(csg::op<true>(Qs, LDK4), csg::op<true>(Ks, LDK4));
    kk.each([&](int i, int t, float x, int, int) { KKs[i * LDC4 + t] = x; });
    qk.each([&](int i, int t, float x, int, int) { QKs[i * LDC4 + t] = x; });
  }
#endif
  // Phase clocks (CS_PROFILE): this mark, three per value head, one at the end: the
  // 14 slots hold G <= 4 (at larger G the last phases are not recorded).
  CS_MARK();  // 0: q, k, kk, qk (once per key head)
  // A q or k that reads as non-zero in Qs / Ks is finite (non-finite ones read as zero
  // there): only for a zero one is the input read again. (Read for every output after
  // the products, q, k and v took 10% of the kernel's stall samples, run 71.)
  // dq and dk, summed over the key head's G value heads: each head's products accumulate
  // into them and its epilogue terms are added as the head ends.
  csg::Prod<C, DK, NT, false, true, false, true> dq;  // k read down its columns
  csg::Prod<C, DK, NT, true, true, true, true> dk;    // (one layout with t2 below)
  dq.zero();
  dk.zero();
#pragma unroll 1
  for (int gi = 0; gi < G; ++gi) {
    const int tid = cs_tid();                   // (read here: see cs_tid)
    const int h = hk * G + gi, l = b * HV + h;  // the value head, its lane
    const size_t cl = size_t(l) * n + j;        // (lane, chunk)
    auto part = [&](const float* X, int cols, int i, int c) {  // the NV partial sums
      float s = 0.f;
#pragma unroll
      for (int z = 0; z < NV; ++z) s += X[((z * LN + cl) * C + i) * cols + c];
      return s;
    };
    // The head's loads in flight together: a, and with one slice (NV = 1) d_w, d_p and m2,
    // copied in the background; then (NV > 1) the partial sums added as they come. d_p is
    // read in full (state_grads' tensor-core form writes it so); only its causal part is
    // used (below, where it is read).
    csg::copy_tile<C, C, NT>(As, LDC4, A + cl * C * C, C);
    if constexpr (NV == 1) {
      csg::copy_tile<C, DK, NT>(Ws, LDK4, DWp + cl * C * DK, DK);
      csg::copy_tile<C, C, NT>(DPs, LDC4, DPp + cl * C * C, C);
      csg::copy_tile<C, C, NT>(M2s, LDC4, M2p + cl * C * C, C);
    }
    for (int i = tid; i < C; i += NT) {
      gf[i] = csg::gate(csg::f(g[(tok + i) * HV + h]));
      bt[i] = csg::fin(csg::f(beta[(tok + i) * HV + h]));
    }
    if constexpr (NV > 1) {  // the NV partial sums, added
      csg::load_tile<C, DK, NT, NV>(
          DWp + cl * C * DK, DK, [&](int i, int d, float x) { Ws[i * LDK4 + d] = x; }, LN * C * DK);
      csg::load_tile<C, C, NT, NV>(
          DPp + cl * C * C, C, [&](int i, int t, float x) { DPs[i * LDC4 + t] = x; }, LN * C * C);
      csg::load_tile<C, C, NT, NV>(
          M2p + cl * C * C, C, [&](int i, int t, float x) { M2s[i * LDC4 + t] = x; }, LN * C * C);
    }
    csg::copies_land();
    __syncthreads();
    csg::chunk_gates<C, NT>(gf, gma, ten);
    csg::fill_gam<C, LDC4, NT>(gf, Gs);
#ifdef CS_TC
    {
      csg::TcMM<C, C, NT / 32, false, EXQK> m1;  // d_w: partial sums, not exact
      m1.zero();
      csg::tc_run<DK, true, true, true, !EXQK>(m1, Ws, LDK4, Ks, LDK4);
      m1.store(M1s, LDC4);
    }
#else
    {
      csg::Tile<C, C, NT> m1;
      m1.mm4<DK>(csg::op<true>(Ws, LDK4), csg::op<true>(Ks, LDK4));
      m1.each([&](int i, int t, float x, int, int) { M1s[i * LDC4 + t] = x; });
    }
#endif
    __syncthreads();
    CS_MARK();  // 1 (per head): loads, gates, m1
    // kdkb_i = sum_d (a^T d_w)[i, d] k[i, d]; dvbv_i = sum_c (a^T d_vnew)[i, c] v[i, c].
    if (tid < C) {
      const int i = tid;
      float s1 = 0.f, s2 = 0.f;
      for (int t = i; t < C; ++t) {
        s1 = fmaf(As[t * LDC4 + i], M1s[t * LDC4 + i], s1);
        s2 = fmaf(As[t * LDC4 + i], M2s[t * LDC4 + i], s2);
      }
      kdkb[i] = s1;
      dvbv[i] = s2;
    }
    __syncthreads();
    // d_a = d_w kb^T + d_vnew vb^T (kb = k beta gamma, vb = v beta).
    for (int e = tid; e < C * C; e += NT) {
      const int i = e / C, t = e % C;
      M2s[i * LDC4 + t] = (M1s[i * LDC4 + t] * gma[t] + M2s[i * LDC4 + t]) * bt[t];
    }
    __syncthreads();
    // The products from here on: csg::Prod, FMA loops or (CS_TF32) the tensor cores.
    {
      csg::Prod<C, C, NT> t1;  // d_a a^T
      t1.zero();
      csg::prod<C, true, true>(t1, M2s, LDC4, As, LDC4);
      t1.each_out([&](int i, int m, float x, int, int) { M1s[i * LDC4 + m] = x; });
    }
    __syncthreads();
    {
      csg::Prod<C, C, NT, true, true, true, true> dl;  // d_l = -(a^T d_a a^T), strictly lower
      dl.zero();
      csg::prod<C, false, false>(dl, As, LDC4, M1s, LDC4);
      dl.each_out([&](int i, int m, float x, int, int) { M2s[i * LDC4 + m] = m < i ? -x : 0.f; });
    }
    __syncthreads();
    {
      // Row dots d_qg . q and d_kt . k and the row sums of d_l gam kk (strict): NS threads
      // per row, each a fixed slice of columns, then summed in order (deterministic). Eight
      // steps' loads of partial sums in flight at once (all of them took a head of 96 past
      // 128 registers). M1s (d_a a^T, read no more) holds the third sums' parts.
      constexpr int NS = NT / C;
      static_assert(DK % NS == 0 && C % NS == 0, "input_grads: whole slices per row");
      const int i = tid / NS, sl = tid % NS;
      float s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll 8
      for (int j = 0; j < DK / NS; ++j) {
        const int d = sl + j * NS;
        s1 = fmaf(part(DQGp, DK, i, d), Qs[i * LDK4 + d], s1);
        s2 = fmaf(part(DKTp, DK, i, d), Ks[i * LDK4 + d], s2);
      }
      for (int t = sl; t < i; t += NS)
        s3 += M2s[i * LDC4 + t] * Gs[i * LDC4 + t] * KKs[i * LDC4 + t];
      red[tid] = s1;
      red[NT + tid] = s2;
      M1s[i * LDC4 + sl] = s3;
    }
    __syncthreads();
    if (tid < C) {
      constexpr int NS = NT / C;
      const int i = tid;
      float dls = 0.f, dqgq = 0.f, dto = 0.f;
      for (int sl = 0; sl < NS; ++sl) {
        dqgq += red[i * NS + sl];
        dto += red[NT + i * NS + sl];
        dls += M1s[i * LDC4 + sl];
      }
      vb[i] = dvbv[i] + gma[i] * kdkb[i] + dls;
      vg[i] = (scale * dqgq + bt[i] * kdkb[i]) * gma[i];
      vt[i] = dto * ten[i];
    }
    __syncthreads();
    // d_gam gam (strict) -> M1s; d_qk = scale d_p gam -> DPs; d_kk = d_l beta_i gam -> M2s.
    for (int e = tid; e < C * C; e += NT) {
      const int i = e / C, t = e % C;
      const int x = i * LDC4 + t;
      const float gm = Gs[x], dl = M2s[x], dp = t <= i ? DPs[x] : 0.f;  // d_p's causal part
      M1s[x] = t < i ? (scale * dp * QKs[x] + dl * bt[i] * KKs[x]) * gm : 0.f;
      DPs[x] = scale * dp * gm;
      M2s[x] = dl * bt[i] * gm;
    }
    __syncthreads();
    // d_kk, strictly lower, made symmetric: d_kk + d_kk^T, the operand of dk's product (each
    // entry one of the two, the other a zero, so the sum is exact).
    for (int e = tid; e < C * C; e += NT) {
      const int i = e / C, t = e % C;
      if (t > i) M2s[i * LDC4 + t] = M2s[t * LDC4 + i];
    }
    __syncthreads();
    {
      // Row prefix sums, in place: M1s[i][m] = sum_{t < m} d_gam gam [i][t]. NS threads per
      // row, each a segment of C / NS columns: its own running sum, then the totals of the
      // segments before it added.
      constexpr int NS = NT / C, SEG = C / NS;
      const int i = tid / NS, sl = tid % NS;
      float* row = M1s + i * LDC4 + sl * SEG;
      float r = 0.f;
#pragma unroll
      for (int t = 0; t < SEG; ++t) {
        const float x = row[t];
        row[t] = r;
        r += x;
      }
      red[tid] = r;
      __syncthreads();
      float before = 0.f;
      for (int z = 0; z < sl; ++z) before += red[i * NS + z];
#pragma unroll
      for (int t = 0; t < SEG; ++t) row[t] += before;
      // d_g[m]: every span that covers gate m (t < m <= i). NS threads per gate, each the
      // rows i = m + sl, m + sl + NS, .. and the gates t = sl, sl + NS, .. < m; the parts
      // then summed in order.
      __syncthreads();
      const int m = i;
      float s = 0.f;
      for (int r2 = m + sl; r2 < C; r2 += NS) s += M1s[r2 * LDC4 + m] + vg[r2];
      for (int t = sl; t < m; t += NS) s += vt[t];
      red[NT + tid] = s;
    }
    __syncthreads();
    if (tid < C) {
      constexpr int NS = NT / C;
      const int m = tid;
      float s = 0.f;
      for (int sl = 0; sl < NS; ++sl) s += red[NT + m * NS + sl];
      float dd = 0.f;
#pragma unroll
      for (int z = 0; z < NV; ++z) dd += DDECp[z * LN + cl];
      s += dd * gma[C - 1];
      const size_t r = (tok + m) * HV + h;
      dg[r] = static_cast<TG>(csg::gate_ok(csg::f(g[r])) ? s : 0.f);
      dbeta[r] = static_cast<TB>(isfinite(csg::f(beta[r])) ? vb[m] : 0.f);
    }
    CS_MARK();  // 2 (per head): kdkb, d_a, t1, d_l, row dots, d_gam, prefix sums, d_g, d_beta
    // The partial sums that dq's and dk's epilogues add (d_qg's, then d_kt's) are copied
    // into gam's and m1's space (read no more) while the products run, where they fit
    // and come from one slice (STAGE: NV = 1 and Dk + 4 <= 2 (C + 4): every Dk at
    // C = 64, up to 64 at C = 32); else the epilogues read them. No
    // registers hold them across the products (read into registers ahead of them, as
    // before session 38, they took the kernel past the 128 registers of 512 threads).
    constexpr bool STAGE = NV == 1 && C * LDK4 <= 2 * C * LDC4;
    float* Ps = Gs;  // [C][LDK4] over gam and m1 (STAGE)
    auto summed = [&](const float* X, int i, int d) {
      return STAGE ? Ps[i * LDK4 + d] : part(X, DK, i, d);
    };
    if constexpr (STAGE) csg::copy_tile<C, DK, NT>(Ps, LDK4, DQGp + cl * C * DK, DK);
    csg::prod<C, true, false, true, !EXQK>(dq, DPs, LDC4, Ks, LDK4);
    if constexpr (STAGE) {
      csg::copies_land();
      __syncthreads();
    }
    dq.apply([&](int i, int d, float x, int, int) {
      return x + scale * gma[i] * summed(DQGp, i, d);
    });
    if constexpr (STAGE) {
      __syncthreads();  // d_qg's read before d_kt's land over them
      csg::copy_tile<C, DK, NT>(Ps, LDK4, DKTp + cl * C * DK, DK);
    }
    {
      csg::Prod<C, DK, NT, true, true, true, true> t2;  // a^T d_w, this head's
      t2.zero();
      csg::prod<C, false, false, true, !EXQK>(dk, DPs, LDC4, Qs, LDK4);
      // d_kk + d_kk^T: symmetric, so read down its columns as the other operands (spread)
      csg::prod<C, false, false, true, !EXQK>(dk, M2s, LDC4, Ks, LDK4);
      csg::prod<C, false, false>(t2, As, LDC4, Ws, LDK4);
      if constexpr (STAGE) {
        csg::copies_land();
        __syncthreads();
      }
      dk.apply([&](int i, int d, float x, int a, int bb) {
        return x + t2.at(a, bb) * bt[i] * gma[i] + summed(DKTp, i, d) * ten[i];
      });
    }
    csg::TileLoad<C, DV, NT, float> dvl;
    dvl.issue(DVN + cl * C * DV, DV);
    csg::Prod<C, DV, NT, true, true, true, true> tv;
    tv.zero();
    __syncthreads();
    float* DVs = DPs;           // [C][LDV4] d_vnew, over d_p .. m1 (none read any more)
    static_assert(DV + 4 <= 4 * (C + 4), "d_vnew fits over d_p .. m1");
    dvl.land([&](int i, int c, float x) { DVs[i * LDV4 + c] = x; });
    __syncthreads();
    {
      csg::prod<C, false, false>(tv, As, LDC4, DVs, LDV4);
      tv.store_out([&](int i, int c) { return dv + ((tok + i) * HV + h) * DV + c; },
                   [&](int i, int c, float x, int, int) {  // none for a non-finite v
                     return isfinite(csg::f(v[((tok + i) * HV + h) * DV + c])) ? x * bt[i] : 0.f;
                   });
    }
    __syncthreads();  // a, d_vnew read before the next head's loads
    CS_MARK();  // 3 (per head): dq's and dk's products, dv
  }
  // dq, dk: none for a non-finite q or k
  dq.store_out([&](int i, int d) { return DQ + (tok + i) * HK * DK + hk * DK + d; },
               [&](int i, int d, float x, int, int) {
                 return csg::finite_input(true, Qs + i * LDK4 + d, q + qk_at(i, d)) ? x : 0.f;
               });
  dk.store_out([&](int i, int d) { return DKm + (tok + i) * HK * DK + hk * DK + d; },
               [&](int i, int d, float x, int, int) {
                 return csg::finite_input(true, Ks + i * LDK4 + d, k + qk_at(i, d)) ? x : 0.f;
               });
  CS_PROF_END("input_grads");  // 4 (last): dq, dk
"""

_KEY_LANES = ("input_grads",)  # a block per key lane (b, hk), not per value lane
_KERNELS = {
    "prepare": (["q", "k", "v", "g", "beta"], ["A", "P", "W", "U", "KT", "DECAY"],
                _PREPARE),
    "output": (["q", "g", "P", "W", "U", "S", "dout", "obad"], ["out", "Hm"],
               _OUTPUT),
    "state_grads": (["P", "W", "U", "KT", "S", "DS", "dout", "obad", "v"],
                    ["DVN", "DWp", "DQGp", "DKTp", "DPp", "M2p", "DDECp"], _STATE_GRADS),
    "input_grads": (["q", "k", "v", "g", "beta", "A", "DVN", "DWp", "DQGp", "DKTp", "DPp",
                     "M2p", "DDECp"], ["DQ", "DKm", "dv", "dg", "dbeta"],
                    _INPUT_GRADS),
}  # fmt: skip


def _plan_key() -> tuple:
    """What a launch's plan depends on beyond its shapes: the variables of
    :data:`_PLAN_ENV`, the device's limits, capability and kind (as
    :func:`chunkscan._backend.tf32_products` asks it); read once per call of the op."""
    return _backend.once_per_block("<gated_delta plan>", _read_plan_key)


def _read_plan_key() -> tuple:
    env = tuple([_backend.getenv(var) for var in _PLAN_ENV])
    # The limits as a plain tuple: the key is hashed at every launch's plan lookup, and
    # a dataclass hashes in Python.
    limits = dataclasses.astuple(cuda_limits())
    return env, limits, compute_capability(), _backend.cuda_device()


@functools.lru_cache(maxsize=4096)
def _kept_result(fn, args: tuple, kwargs: tuple, key: tuple):
    return fn(*args, **dict(kwargs))


def _planned(fn):
    """``fn``, a function of shapes and of the settings in :func:`_plan_key`, with its
    results kept per arguments and settings: an eager fwd+bwd asked the layout functions
    below about seventy times, each working its answer out again
    (``bench/graph_build.py``). A setting's change takes effect at the next call, as
    before; an invalid setting raises at every call (exceptions are not kept)."""

    @functools.wraps(fn)
    def planned(*args, **kwargs):
        return _kept_result(fn, args, tuple(kwargs.items()), _plan_key())

    return planned


@_planned
def threads(
    which: str, C: int, Dk: int | None = None, Dv: int | None = None, tv: int | None = None
) -> int:
    """Threads per block of kernel ``which`` at chunk size ``C`` (see :data:`NT`; for
    ``output`` and ``state_grads`` given ``tv``, their columns of ``Dv`` per block, or
    ``Dk`` and ``Dv`` to work it out; 256 where, given ``Dk`` and ``Dv``, 512 would not
    fit the device's shared memory, and for ``input_grads`` where its loop over the value
    heads would not fit 128 registers a thread, :func:`_loop_fits_512`), or
    ``CHUNKSCAN_GDN_NT`` where set (256 or 512; ``input_grads``, given ``Dk`` and ``Dv``,
    keeps 256 where its loop does not fit 512: the launch would fail)."""
    env = env_int("CHUNKSCAN_GDN_NT", "gated_delta_rule", "256 or 512", allowed=(256, 512))
    if env is not None:
        if env == 512 and which in _KEY_LANES and Dk is not None and Dv is not None:
            return env if _loop_fits_512(which, C, Dk, Dv) else NT
        return env
    if which in _NT_512_WIDE:
        if tv is None and Dv is not None:
            tv = slice_columns(Dv, C, Dk)
        wide = output_step_columns(tv) if which == "output" and tv is not None else tv
        return 512 if wide == WIDE_TV else NT
    nt = 512 if (which, C) in _NT_512 else NT
    if nt == 512 and which in _KEY_LANES and not _loop_fits_512(which, C, Dk, Dv):
        nt = NT
    if nt == 512 and Dk is not None and Dv is not None:
        tv = slice_columns(Dv, C, Dk)
        if smem_bytes(which, C, Dk, Dv, 512, tv) > cuda_limits().smem_per_block:
            nt = NT
    return nt


def _loop_fits_512(which: str, C: int, Dk: int | None, Dv: int | None) -> bool:
    """Whether ``input_grads``' loop over the value heads fits 128 registers a thread
    (512 threads): with TF32 products and one slice of ``Dv`` (``NV = 1``, its partial
    sums staged through shared memory) it took 56 to 108 at every ``Dk``, ``Dv`` and
    dtype; with ``NV`` > 1 (each epilogue reading the slices' sums from global memory)
    164 to 250, with float32 products up to 136 (tools/cuda_compile_check.py; a
    review's sweep, session 38). Elsewhere, and where ``Dk`` or ``Dv`` is not given, the
    kernel takes 256 threads, which allow 255 registers."""
    if Dk is None or Dv is None or not tf32_build(which):
        return False
    return slice_columns(Dv, C, Dk) == Dv


@_planned
def slice_columns(Dv: int, C: int | None = None, Dk: int | None = None) -> int:
    """Columns of ``Dv`` per block of ``output`` and ``state_grads``: :data:`WIDE_TV`
    (one slice, no partial sums) for a ``Dv`` of 128 at ``C`` = 64, else :data:`TV`, or
    ``CHUNKSCAN_GDN_TV`` where set (32, 64 or 128); 32 where that does not divide ``Dv``.
    Without ``C`` and ``Dk``, :data:`TV`; given them, the widest default whose blocks
    (:func:`threads`) fit the device's shared memory."""
    env = _forced_slice_columns()
    if env is not None:
        return 32 if Dv % env else env
    return _default_slice_columns(Dv, C, Dk)


def _forced_slice_columns() -> int | None:
    """``CHUNKSCAN_GDN_TV`` (32, 64 or 128), ``None`` where unset."""
    # (a number out of the three named neither the environment nor the fix, unlike the
    # others, until env_int took the allowed values; found by probing)
    return env_int("CHUNKSCAN_GDN_TV", "gated_delta_rule", "32, 64 or 128",
                   allowed=(32, 64, WIDE_TV))  # fmt: skip


def _default_slice_columns(Dv: int, C: int | None, Dk: int | None) -> int:
    """:func:`slice_columns` with ``CHUNKSCAN_GDN_TV`` unset."""
    if C is None or Dk is None:
        return TV if Dv % TV == 0 else 32
    wide = (WIDE_TV,) if C in _WIDE_C and Dv == WIDE_TV else ()
    limit = cuda_limits().smem_per_block
    for tv in wide + (TV,):
        if Dv % tv == 0 and all(
            smem_bytes(w, C, Dk, Dv, threads(w, C, tv=tv), tv) <= limit for w in _NT_512_WIDE
        ):
            return tv
    return 32


@_planned
def output_step_columns(tv: int) -> int:
    """Columns of ``Dv`` per step of an ``output`` block of ``tv`` columns (its ``TH``, a
    divisor of ``tv``): :data:`OUT_TH`, or ``CHUNKSCAN_GDN_OUT_TH`` where set (32, 64 or
    128); ``tv`` where that is narrower or not a multiple."""
    env = env_int("CHUNKSCAN_GDN_OUT_TH", "gated_delta_rule", "32, 64 or 128",
                  allowed=(32, 64, WIDE_TV))  # fmt: skip
    th = OUT_TH if env is None else env
    return th if th <= tv and tv % th == 0 else tv


@_planned
def piece_columns(C: int, Dk: int, Dv: int, tv: int, nt: int) -> int:
    """Columns of ``Dk`` per piece of ``state_grads`` (its ``KS``, a divisor of ``Dk``):
    :data:`WIDE_KS` in a block of :data:`WIDE_TV` columns where that fits the device's
    shared memory (219.25 KiB at the Qwen3-Next shape, against 187.25 with 32), else
    :data:`KS`."""
    if tv == WIDE_TV and Dk % WIDE_KS == 0:
        if smem_bytes("state_grads", C, Dk, Dv, nt, tv, WIDE_KS) <= cuda_limits().smem_per_block:
            return WIDE_KS
    return KS


@_planned
def smem_bytes(
    which: str, C: int, Dk: int, Dv: int, nt: int | None = None, tv: int | None = None,
    ks: int | None = None,
) -> int:  # fmt: skip
    """Dynamic shared memory of one block, in bytes (``nt`` threads, ``tv`` columns per
    ``output`` and ``state_grads`` block, ``ks`` columns of ``Dk`` per piece of
    ``state_grads``; default :func:`threads`, :func:`slice_columns`,
    :func:`piece_columns`; ``output`` passes :func:`output_step_columns` of them at a
    time)."""
    tv = slice_columns(Dv, C, Dk) if tv is None else tv
    nt = threads(which, C, Dk, Dv, tv) if nt is None else nt
    # Row strides: C + 1 for prepare's L and A (read a value at a time; each in a region
    # of C + 4 for the tensor cores' operands), else D + 4 (rows read 16 bytes at a time;
    # see the kernels' comments).
    c4, k4 = C + 4, Dk + 4
    if which == "prepare":
        floats = C * k4 + C * (max(Dk, Dv) + 4) + 2 * C * c4 + 4 * C
    elif which == "output":
        th = output_step_columns(tv)
        t4 = th + 4
        floats = C * k4 + C * c4 + max(th * k4, C * t4, C * k4) + C * t4 + 4 * C
    elif which == "state_grads":  # S and dS KS columns of Dk at a time
        ks = piece_columns(C, Dk, Dv, tv, nt) if ks is None else ks
        floats = 2 * tv * (ks + 4) + C * c4 + 4 * C * (tv + 4) + nt + C
    else:
        floats = 7 * C * c4 + 3 * C * k4 + 2 * nt + 9 * C
    return 4 * floats


def scratch_floats(C: int, Dk: int, Dv: int, tv: int | None = None) -> int:
    """Float32 values per chunk and lane that one group's kernels write (forward and
    backward): ``a``, ``p``; ``w``, ``kt``, ``u``; ``h`` and the state cotangents;
    ``d_vnew``; the ``NV`` partial sums."""
    nv = Dv // (slice_columns(Dv, C, Dk) if tv is None else tv)
    per_slice = 3 * C * Dk + 2 * C * C
    return 2 * C * C + C * (2 * Dk + Dv) + 2 * Dv * Dk + C * Dv + nv * per_slice


@_planned
def supports(C: int, Dk: int, Dv: int, channel: bool, lanes: int = 1, strict: bool = False) -> bool:
    """Whether these kernels handle a call (scalar gates, C 32 or 64, Dk and Dv
    multiples of 32 up to 128, at most 65535 lanes ``B * Hv``: a CUDA grid's second
    dimension; every kernel's shared memory within the device's opt-in maximum per
    block, :func:`chunkscan._backend.cuda_limits`: 227 KiB on an H100 / H200, 163 on an
    A100, 99 on consumer GPUs). ``strict``: the chunk size a call asks for (or the
    default's): a ``CHUNKSCAN_GDN_TV`` that alone keeps the kernels from it raises;
    where other sizes are only looked at (a warning's better size), it does not (it
    raised for sizes no call used; found by review)."""
    if channel or C not in CHUNK_SIZES or lanes > MAX_GRID_Y:
        return False
    if Dk % 32 or Dv % 32 or not 32 <= Dk <= 128 or not 32 <= Dv <= 128:
        return False
    limit = cuda_limits().smem_per_block

    def fits(tv: int) -> bool:
        return all(smem_bytes(w, C, Dk, Dv, threads(w, C, Dk, Dv, tv), tv) <= limit
                   for w in _KERNELS)  # fmt: skip

    tv = slice_columns(Dv, C, Dk)
    if fits(tv):
        return True
    forced = strict and _forced_slice_columns() is not None
    if forced and fits(_default_slice_columns(Dv, C, Dk)):
        # A forced width whose blocks do not fit the device turned the fused kernels
        # off, and moved the default chunk size, without a word (found by probing).
        raise ValueError(
            f"[gated_delta_rule] CHUNKSCAN_GDN_TV={tv} gives blocks of more shared memory "
            f"than the device's {limit} bytes per block at chunks of {C}, Dk = {Dk}, "
            f"Dv = {Dv}, so the fused CUDA kernels could not run. Use a narrower width, "
            f"or unset it for the default ({_default_slice_columns(Dv, C, Dk)} here)."
        )
    return False


# Compile-time switches of the kernels, for tuning and tests (read at each call): the
# phase clocks, and one element per global load everywhere (csg::load_tile).
_TC_KERNELS = ("prepare", "input_grads")  # the kernels with CS_TC products (q, k)
# The kernels whose products go to the tensor cores in one tf32 product each where
# tf32_products() holds (CS_TF32; prepare's inverse keeps its float32 FMA loops).
_TF32_KERNELS = ("prepare", "output", "state_grads", "input_grads")
_SWITCHES = (
    ("CHUNKSCAN_GDN_PROFILE", "CS_PROFILE"),
    ("CHUNKSCAN_GDN_SCALAR_LOADS", "CS_SCALAR_LOADS"),
)


def _switch_on(var: str) -> bool:
    """A tuning or test switch of :data:`_SWITCHES`: ``1`` on; ``0``, ``auto`` or unset
    off; anything else raises (``yes`` or `` 1`` read as off, silently; found by
    probing)."""
    return bool(
        _backend.env_switch(var, "gated_delta_rule", "1 (on) or 0 / auto (off, the default)")
    )


def check_settings() -> None:
    """Read, and so check, the chunk kernels' settings at shapes that need no device
    (``chunk._check_fused_settings`` calls this on every path): ``CHUNKSCAN_GDN_NT``,
    ``_TV``, ``_OUT_TH``, ``_TC`` and the switches."""
    threads("prepare", 64)
    slice_columns(128)
    output_step_columns(128)
    _tc_switch()  # (not tc_products: no need to ask the device)
    for var, _ in _SWITCHES:
        _switch_on(var)


def _tc_switch() -> bool | None:
    """``CHUNKSCAN_GDN_TC``: ``True`` / ``False`` where forced, ``None`` for auto."""
    return env_switch(
        "CHUNKSCAN_GDN_TC", "gated_delta_rule",
        "auto (tensor cores where the GPU has them, the default), 1 (always) or 0 (the FMA "
        "loops)",
    )  # fmt: skip


def tc_products() -> bool:
    """Whether ``prepare`` and ``input_grads`` run their q / k products on the tensor
    cores (``_HEADER_TC``): ``CHUNKSCAN_GDN_TC`` (read at each call) ``1`` yes, ``0`` no,
    ``auto`` or unset: yes unless the device reports a compute capability below 8.0
    (tf32 ``wmma`` needs sm_80)."""
    forced = _tc_switch()
    if forced is not None:
        return forced
    cc = compute_capability()
    return cc is None or cc >= (8, 0)


def tf32_build(which: str, cores: bool | None = None) -> bool:
    """Whether kernel ``which`` is built with ``CS_TF32`` (every product on the tensor
    cores in TF32): one of :data:`_TF32_KERNELS`, with :func:`tc_products` (or ``cores``,
    where the caller asked it) and :func:`chunkscan._backend.tf32_products`."""
    if which not in _TF32_KERNELS:
        return False
    return (tc_products() if cores is None else cores) and tf32_products("gated_delta_rule")


def _launch(which: str, inputs, template, L: int, n: int, z: int, outputs, C, Dk, Dv, tv=None):
    names, outs, _ = _KERNELS[which]
    # The launch's plan depends on the shapes, the variables below (read at each call),
    # the device's limits, capability and kind only (the kind as tf32_products() asks
    # it): worked out once per combination (every group of every call launches).
    name, source, header, nt, smem = _kept_plan(which, C, Dk, Dv, tv, *_plan_key())
    kernel = cuda_kernel("gated_delta_rule", name, names, outs, source, header, smem)
    return kernel(
        inputs=inputs, template=[("NT", nt)] + list(template), grid=(n * nt, L, z),
        threadgroup=(nt, 1, 1), output_shapes=[s for s, _ in outputs],
        output_dtypes=[d for _, d in outputs],
    )  # fmt: skip


# What a launch's plan reads from the environment (see _launch).
_PLAN_ENV = tuple(var for var, _ in _SWITCHES) + (
    "CHUNKSCAN_GDN_NT", "CHUNKSCAN_GDN_TV", "CHUNKSCAN_GDN_OUT_TH", "CHUNKSCAN_GDN_TC",
    "CHUNKSCAN_GDN_TF32", "MLX_ENABLE_TF32",
)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _kept_plan(which, C, Dk, Dv, tv, env, limits, capability, cuda) -> tuple:
    """:func:`_plan`, kept per shape and per value of what it reads (``env``: the
    variables of ``_PLAN_ENV``; the device's limits, capability and kind)."""
    return _plan(which, C, Dk, Dv, tv)


def _plan(which: str, C: int, Dk: int, Dv: int, tv: int | None) -> tuple[str, str, str, int, int]:
    """``(name, source, header, threads, shared memory)`` of a launch of ``which``."""
    nt = threads(which, C, Dk, Dv, tv)
    smem = smem_bytes(which, C, Dk, Dv, nt, tv)
    on = [macro for var, macro in _SWITCHES if _switch_on(var)]
    header = "".join(f"#define {macro} 1\n" for macro in on) + _HEADER
    cores = (which in _TC_KERNELS or which in _TF32_KERNELS) and tc_products()  # asked once
    tc = cores and which in _TC_KERNELS
    if cores and tf32_build(which, cores):
        on.append("CS_TF32")
        header = "#define CS_TF32 1\n" + header
        tc = True
    if tc:
        on.append("CS_TC")
        header += _HEADER_TC
    # The switches in the name too: MLX's own kernel cache (CHUNKSCAN_CUDA_PRECOMPILE=0)
    # knows a kernel by its name.
    name = "_".join([f"chunkscan_gdn_{which}"] + [m[3:].lower() for m in on])
    return name, kernel_source(which), kernel_defines(which) + header, nt, smem


def kernel_defines(which: str) -> str:
    """What kernel ``which`` defines ahead of its header: ``CS_FRESH_TID`` for a key
    lane's loop over its value heads (``cs_tid`` in :data:`_HEADER`)."""
    return "#define CS_FRESH_TID 1\n" if which in _KEY_LANES else ""


def kernel_source(which: str) -> str:
    """The body of kernel ``which`` as MLX takes it: its lane's names (``b``, ``hk``,
    ``tok``, and for a value lane ``l``, ``h``, ``cl``), then its own code."""
    lane = _KEY_LANE if which in _KEY_LANES else _VALUE_LANE
    return lane + _COMMON + _KERNELS[which][2]


def _dims(q: mx.array, v: mx.array) -> tuple[int, int, int, int, int, int, int]:
    B, n, C, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    return B, n, C, Hk, Hv, Dk, Dv


def _base(C, Dk, Dv, Hk, Hv, scale: float) -> list[tuple[str, object]]:
    return [("C", C), ("DK", Dk), ("DV", Dv), ("G", Hv // Hk), ("HK", Hk), ("HV", Hv),
            ("SCALE_BITS", scale_bits(scale))]  # fmt: skip


def scale_bits(scale: float) -> int:
    """The bits of ``scale`` as a float32, as a signed 32-bit int: the template constant
    ``SCALE_BITS`` that the kernels turn back into their scale (compiled in, so that no
    block waits for a global load of it before its first loads; one kernel per scale)."""
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def prepare(q, k, v, g, beta, scale: float, with_a: bool = True) -> SimpleNamespace:
    """Raw group inputs in the chunk layout (``[B, n, C, H, D]``, ``[B, n, C, Hv]``) ->
    ``a, p, w, u, kt, decay`` in lane layout (see the module docstring). ``with_a=False``
    (the forward, which needs no ``a``): ``a`` is ``None``, neither written nor kept."""
    B, n, C, Hk, Hv, Dk, Dv = _dims(q, v)
    L = B * Hv
    a_shape = (L, n, C, C) if with_a else (1,)
    outs = [(a_shape, F32), ((L, n, C, C), F32), ((L, n, C, Dk), F32), ((L, n, C, Dv), F32),
            ((L, n, C, Dk), F32), ((L, n), F32)]  # fmt: skip
    tmpl = _base(C, Dk, Dv, Hk, Hv, scale) + [("WRITE_A", with_a)]
    a, p, w, u, kt, decay = _launch("prepare", [q, k, v, g, beta], tmpl, L, n, 1, outs, C, Dk, Dv)
    return SimpleNamespace(a=a if with_a else None, p=p, w=w, u=u, kt=kt, decay=decay,
                           scale=scale)  # fmt: skip


def outputs(q, g, p: SimpleNamespace, entering, o_bad, dtype: mx.Dtype) -> mx.array:
    """``o [B, n, C, Hv, Dv]`` in ``dtype`` given the states entering the chunks
    (``[L, n, Dv, Dk]``) and ``o_bad [B, n, C, Hv]`` (bool)."""
    B, n, C, Hk, Dk = q.shape
    L, Dv = entering.shape[0], entering.shape[2]
    Hv = L // B
    tv = slice_columns(Dv, C, Dk)
    steps = [("TV", tv), ("TH", output_step_columns(tv))]
    tmpl = _base(C, Dk, Dv, Hk, Hv, p.scale) + [("MODE_H", False), ("TO", dtype)] + steps
    outs = [((B, n, C, Hv, Dv), dtype), ((1,), F32)]
    o, _ = _launch(
        "output", [q, g, p.p, p.w, p.u, entering, UNUSED, o_bad], tmpl,
        L, n, Dv // tv, outs, C, Dk, Dv, tv,
    )  # fmt: skip
    return o


def state_gradient_input(q, g, p: SimpleNamespace, d_o, o_bad) -> mx.array:
    """``h = d_o^T (qg - p w)`` ``[L, n, Dv, Dk]`` from the raw output cotangent
    ``d_o [B, n, C, Hv, Dv]`` (zero where ``o_bad``)."""
    B, n, C, Hk, Dk = q.shape
    Hv, Dv = d_o.shape[-2:]
    L = B * Hv
    tv = slice_columns(Dv, C, Dk)
    steps = [("TV", tv), ("TH", output_step_columns(tv))]
    tmpl = _base(C, Dk, Dv, Hk, Hv, p.scale) + [("MODE_H", True), ("TO", F32)] + steps
    outs = [((1,), F32), ((L, n, Dv, Dk), F32)]
    _, hm = _launch(
        "output", [q, g, p.p, p.w, UNUSED, UNUSED, d_o, o_bad], tmpl,
        L, n, Dv // tv, outs, C, Dk, Dv, tv,
    )  # fmt: skip
    return hm


def state_gradients(p: SimpleNamespace, s, d_s, d_o, o_bad, v) -> SimpleNamespace:
    """The state-dependent gradients of a group (see the module docstring): ``s`` the
    states entering its chunks, ``d_s`` the cotangents of the states leaving them
    (both ``[L, n, Dv, Dk]``), raw ``d_o`` and ``v`` ``[B, n, C, Hv, Dv]``."""
    B, n, C, Hv, Dv = v.shape
    L, Dk = s.shape[0], s.shape[-1]
    tv = slice_columns(Dv, C, Dk)
    nv = Dv // tv
    # No use of the scale here: 0 whatever it is, so one kernel serves every scale.
    ks = piece_columns(C, Dk, Dv, tv, threads("state_grads", C, Dk, Dv, tv))
    tmpl = _base(C, Dk, Dv, Hv, Hv, 0.0) + [("TV", tv), ("KS", ks)]
    outs = [((L, n, C, Dv), F32)] + [((nv, L, n, C, Dk), F32)] * 3
    outs += [((nv, L, n, C, C), F32)] * 2 + [((nv, L, n), F32)]
    dvn, dw, dqg, dkt, dp, m2, ddec = _launch(
        "state_grads", [p.p, p.w, p.u, p.kt, s, d_s, d_o, o_bad, v], tmpl,
        L, n, nv, outs, C, Dk, Dv, tv,
    )  # fmt: skip
    return SimpleNamespace(dvn=dvn, dw=dw, dqg=dqg, dkt=dkt, dp=dp, m2=m2, ddec=ddec, nv=nv)


def input_gradients(xs, p: SimpleNamespace, sg: SimpleNamespace) -> list[mx.array]:
    """``[dq, dk, dv, dg, dbeta]`` of a group in the chunk layout and dtypes of the raw
    inputs ``xs = (q, k, v, g, beta)``; inputs read as zero (non-finite) get none. One
    block per chunk and key lane: ``dq`` and ``dk`` summed over the key head's value
    heads in the kernel."""
    q, k, v, g, beta = xs
    B, n, C, Hk, Hv, Dk, Dv = _dims(q, v)
    tmpl = _base(C, Dk, Dv, Hk, Hv, p.scale) + [
        ("NV", sg.nv), ("TG", g.dtype), ("TB", beta.dtype),
    ]  # fmt: skip
    outs = [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (g.shape, g.dtype),
            (beta.shape, beta.dtype)]  # fmt: skip
    return list(_launch(
        "input_grads",
        [q, k, v, g, beta, p.a, sg.dvn, sg.dw, sg.dqg, sg.dkt, sg.dp, sg.m2, sg.ddec],
        tmpl, B * Hk, n, 1, outs, C, Dk, Dv,
    ))  # fmt: skip
