""":func:`chunkscan.attention` as CUDA kernel launches: one forward, two backward.

CUDA only; chosen automatically by :mod:`.blocked` where :func:`supports` holds, and
switched off with ``kernels=False`` or ``CHUNKSCAN_CUDA_KERNELS=0``. The math is the
blocked backward's (FlashAttention-2): with ``p = softmax(scale * q k^T)`` (masked),
``delta = rowsum(do * o)``, ``ds = p * (do v^T - delta)``::

    dq = scale * ds k        dk = scale * ds^T q        dv = p^T do

Kernels (tensor cores through ``nvcuda::wmma``, 16x16x16 bfloat16/float16 tiles with
float32 accumulation, though :func:`supports` takes bfloat16 only; 256 threads = 8
warps per block; tiles of 64 queries x 64 keys):

- ``chunkscan_attn_fwd``: one block per (64 query rows, query head, batch row): the
  forward with the online softmax described next (``o = sum p~ v / l``). MLX's fused
  forward (``force_fused=True``) is not used on this path: on the H200 at T=8192 it
  took 13.3 ms (MLX's default call 6.6 ms) and held ~160 KiB/token
  (``bench/attention.py --phase fwd``, bench/results/h200/attention_fwd_h200.json).
- ``chunkscan_attn_dq``: one block per (64 query rows, query head, batch row). Computes
  ``delta`` from its ``do`` and ``o`` rows, then walks the keys the rows see ONCE with
  an online softmax: ``p~ = exp2(scale log2(e) s - m)`` against a per-row reference
  ``m`` that moves only when a tile's maximum exceeds it by more than 8 (so
  ``p~ <= 256``; moving it rescales the ``dq`` accumulator and the row sum ``l``), and
  accumulates ``p~ (dp - delta) k`` in registers; ``dq = scale * acc / l``. Writes
  ``dq``, ``delta`` and the log-sum-exp (base 2, ``m + log2(l)``).
- ``chunkscan_attn_dkdv``: one block per (64 keys, key/value head, batch row). Walks the
  ``G`` query heads that share the key head and the query tiles that see the keys,
  accumulating ``dk`` and ``dv`` in registers (no atomics, no repeat of k and v).

``p`` and ``ds`` are rounded to the input dtype before their matrix products, as in the
blocked path. With ``mask="causal"`` tiles that no query sees are never visited. Memory:
the gradients, the float32 log-sum-exp and ``delta`` (``[B, Hq, T]`` each): no scratch
grows with ``T``.
"""

from __future__ import annotations

import mlx.core as mx

from ..._backend import cuda_kernel, cuda_limits, param
from .._checks import F32_MAX
from ._checks import Spec

F32 = mx.float32
BR = 64  # query rows per tile
BC = 64  # keys per tile
NT = 256  # threads per block
_SMEM_LIMIT = 227 * 1024  # opt-in maximum per block on sm_90: what every size fits

_HEADER = r"""
#include <mma.h>

namespace cs_attn {
using namespace nvcuda;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// load_tile's path for a src that is not 16-byte aligned: one element at a time, out of
// line (inlined, it took the kernels' registers from 140 to 174 at heads of 256: NVRTC)
template <typename DT, int ROWS, int COLS, int LD, int NTH>
__device__ __noinline__ void load_tile_elements(DT* dst, const DT* src, int valid, int tid) {
  for (int e = tid; e < ROWS * COLS; e += NTH) {
    const int r = e / COLS, c = e % COLS;
    dst[r * LD + c] = r < valid ? src[static_cast<size_t>(r) * COLS + c] : DT(0.f);
  }
}

// dst[r][c] (row stride LD) = src[r][c] (rows of COLS contiguous elements), r < ROWS;
// rows >= valid are zero. 16-byte copies; where src is not 16-byte aligned (an input given
// as a view at an odd offset, which MLX passes as it is: a 16-byte load from there faults)
// one element at a time (uniform over the grid: no divergence).
template <typename DT, int ROWS, int COLS, int LD, int NTH>
__device__ __forceinline__ void load_tile(DT* dst, const DT* src, int valid, int tid) {
  constexpr int V = COLS / 8;
  if ((reinterpret_cast<unsigned long long>(src) & 15) != 0) {
    load_tile_elements<DT, ROWS, COLS, LD, NTH>(dst, src, valid, tid);
    return;
  }
  for (int e = tid; e < ROWS * V; e += NTH) {
    const int r = e / V;
    const int c = (e % V) * 8;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (r < valid) x = *reinterpret_cast<const uint4*>(src + static_cast<size_t>(r) * COLS + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = x;
  }
}

// C[64][64] (float, row stride LDC) = A[64][K] B[64][K]^T; warp w computes rows
// 16 (w / 2) .. + 16, columns 32 (w % 2) .. + 32 (one a fragment, two b fragments).
template <typename DT, int K, int LDA, int LDB, int LDC>
__device__ __forceinline__ void mm_abt(float* C, const DT* A, const DT* B, int warp) {
  const int rt = warp >> 1;
  const int ct = (warp & 1) * 2;
  Acc c0, c1;
  wmma::fill_fragment(c0, 0.f);
  wmma::fill_fragment(c1, 0.f);
#pragma unroll 4
  for (int kk = 0; kk < K; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, DT, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, DT, wmma::col_major> b0, b1;
    wmma::load_matrix_sync(a, A + rt * 16 * LDA + kk, LDA);
    wmma::load_matrix_sync(b0, B + ct * 16 * LDB + kk, LDB);
    wmma::load_matrix_sync(b1, B + (ct + 1) * 16 * LDB + kk, LDB);
    wmma::mma_sync(c0, a, b0, c0);
    wmma::mma_sync(c1, a, b1, c1);
  }
  wmma::store_matrix_sync(C + rt * 16 * LDC + ct * 16, c0, LDC, wmma::mem_row_major);
  wmma::store_matrix_sync(C + rt * 16 * LDC + (ct + 1) * 16, c1, LDC, wmma::mem_row_major);
}

// The [64][64 NC] accumulators of a block: warp w holds rows 32 (w / 4) .. + 32 and
// columns 16 NC (w % 4) .. + 16 NC as acc[0..NC) (first 16 rows) and acc[NC..2 NC).
template <typename FA, typename DT, int LDB, int NC>
__device__ __forceinline__ void acc_rows(Acc (&acc)[2 * NC], const FA& a0, const FA& a1,
                                         const DT* Bm, int kk, int c0) {
#pragma unroll
  for (int ct = 0; ct < NC; ++ct) {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, DT, wmma::row_major> b;
    wmma::load_matrix_sync(b, Bm + kk * LDB + c0 + ct * 16, LDB);
    wmma::mma_sync(acc[ct], a0, b, acc[ct]);
    wmma::mma_sync(acc[NC + ct], a1, b, acc[NC + ct]);
  }
}

// acc += A[64][64] Bm[64][64 NC] (this warp's part, see acc_rows), A stored row-major
// (TA = false) or as its transpose (TA = true: A(m, k) = Am[k][m]); Bm row-major.
template <typename DT, bool TA, int LDA, int LDB, int NC>
__device__ __forceinline__ void mm_acc(Acc (&acc)[2 * NC], const DT* Am, const DT* Bm,
                                       int warp) {
  const int r0 = (warp >> 2) * 32;
  const int c0 = (warp & 3) * NC * 16;
#pragma unroll
  for (int kk = 0; kk < 64; kk += 16) {
    if constexpr (TA) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, DT, wmma::col_major> a0, a1;
      wmma::load_matrix_sync(a0, Am + kk * LDA + r0, LDA);
      wmma::load_matrix_sync(a1, Am + kk * LDA + r0 + 16, LDA);
      acc_rows<decltype(a0), DT, LDB, NC>(acc, a0, a1, Bm, kk, c0);
    } else {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, DT, wmma::row_major> a0, a1;
      wmma::load_matrix_sync(a0, Am + r0 * LDA + kk, LDA);
      wmma::load_matrix_sync(a1, Am + (r0 + 16) * LDA + kk, LDA);
      acc_rows<decltype(a0), DT, LDB, NC>(acc, a0, a1, Bm, kk, c0);
    }
  }
}

// Multiply row r of this warp's accumulators by f[r] (f: 64 floats in shared memory),
// through buf, the warp's own 16 x 16 floats of shared memory.
template <int NC>
__device__ __forceinline__ void scale_rows(Acc (&acc)[2 * NC], const float* f, float* buf,
                                           int warp, int lane) {
  const int r0 = (warp >> 2) * 32;
#pragma unroll
  for (int i = 0; i < 2 * NC; ++i) {
    const int rows = r0 + (i < NC ? 0 : 16);
    wmma::store_matrix_sync(buf, acc[i], 16, wmma::mem_row_major);
    __syncwarp();
#pragma unroll
    for (int e = lane; e < 256; e += 32) buf[e] *= f[rows + e / 16];
    __syncwarp();
    wmma::load_matrix_sync(acc[i], buf, 16, wmma::mem_row_major);
    __syncwarp();
  }
}

// out[r][c] = DT(f * rowf[r] * acc) for rows r < rows (rowf: 64 floats, or nullptr for
// 1), staged through stage[64][64 NC + 4] floats. Ends with a barrier.
template <typename DT, int NC, int NTH>
__device__ __forceinline__ void store_acc(DT* out, Acc (&acc)[2 * NC], float f,
                                          const float* rowf, float* stage, int rows, int warp,
                                          int tid) {
  constexpr int COLS = 64 * NC;
  constexpr int LD = COLS + 4;
  const int r0 = (warp >> 2) * 32;
  const int c0 = (warp & 3) * NC * 16;
#pragma unroll
  for (int ct = 0; ct < NC; ++ct) {
    wmma::store_matrix_sync(stage + r0 * LD + c0 + ct * 16, acc[ct], LD, wmma::mem_row_major);
    wmma::store_matrix_sync(stage + (r0 + 16) * LD + c0 + ct * 16, acc[NC + ct], LD,
                            wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = tid; e < rows * COLS; e += NTH) {
    const int r = e / COLS;
    const int c = e % COLS;
    const float g = rowf ? f * rowf[r] : f;
    out[static_cast<size_t>(r) * COLS + c] = static_cast<DT>(g * stage[r * LD + c]);
  }
  __syncthreads();
}
// One query row's 16 scores of a key tile (threads 4r..4r+3 hold the row), base 2
// and masked (-inf), and the online reference: mref moves to the tile's row maximum
// when that exceeds it by more than 8; f is then the factor for what was accumulated
// against the old reference (0 for the first), else 1. Returns whether an earlier
// reference moved (something accumulated needs rescaling).
template <bool CAUSAL, int NK, int OFF, int LDS>
__device__ __forceinline__ bool tile_row(float (&sv)[16], const float* Ss, int r, int cq,
                                         int k0, int tq, float c2, float& mref, float& f) {
  float mt = neg_inf();
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const int kc = k0 + cq + c;
    const bool ok = kc < NK && (!CAUSAL || kc <= tq + OFF);
    sv[c] = ok ? Ss[r * LDS + cq + c] * c2 : neg_inf();
    mt = fmaxf(mt, sv[c]);
  }
  mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
  mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
  f = 1.f;
  bool moved = false;
  if (mt > mref + 8.f) {
    moved = mref != neg_inf();
    f = moved ? exp2f(mref - mt) : 0.f;
    mref = mt;
  }
  return moved;
}

}  // namespace cs_attn
"""

# Template constants: DT (dtype), D, DV, NQ (T), NK (S), HQ, HKV (ints), CAUSAL (bool).
_COMMON = r"""
  using namespace cs_attn;
  constexpr int BR = 64, BC = 64, NTH = 256;
  constexpr int LDQ = D + 8, LDV = DV + 8, LDS = BC + 4, LDP = BC + 8;
  constexpr int G = HQ / HKV;
  constexpr int OFF = NK - NQ;  // causal: query t sees keys j <= t + OFF
  constexpr float LOG2E = 1.4426950408889634f;
  static_assert(D % 64 == 0 && DV % 64 == 0 && D <= 256 && DV <= 256, "head sizes");
  extern __shared__ float4 cs_smem4[];
  char* sm = reinterpret_cast<char*>(cs_smem4);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const float sc = params[0];
  const float c2 = sc * LOG2E;
  // Elementwise phases: thread -> query row r of the tile, 16 keys from cq.
  const int r = tid >> 2;
  const int cq = (tid & 3) * 16;
"""

_QUERY_TILE = r"""
  // This block's query tile: rows [t0, t0 + rows) of head h, batch row b; the keys
  // [0, kend) they see, in nkb tiles; tq, the row of this thread's elementwise work.
  const int nqb = (NQ + BR - 1) / BR;
  const int qb = nqb - 1 - static_cast<int>(blockIdx.x);  // most keys first (causal)
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = h / G;
  const int t0 = qb * BR;
  const int rows = min(BR, NQ - t0);
  const size_t row0 = static_cast<size_t>(b * HQ + h) * NQ + t0;
  const DT* kp = k + static_cast<size_t>(b * HKV + hk) * NK * D;
  const DT* vp = v + static_cast<size_t>(b * HKV + hk) * NK * DV;
  const int kend = CAUSAL ? min(NK, t0 + rows + OFF) : NK;
  const int nkb = (kend + BC - 1) / BC;
  const int tq = t0 + r;
"""

_DQ_SOURCE = (
    _COMMON
    + r"""
  DT* Qs = reinterpret_cast<DT*>(sm);                    // [BR][LDQ]
  DT* dOs = Qs + BR * LDQ;                               // [BR][LDV]
  DT* Ks = dOs + BR * LDV;                               // [BC][LDQ]
  DT* Vs = Ks + BC * LDQ;                                // [BC][LDV] (first: the o tile)
  float* Ss = reinterpret_cast<float*>(Vs + BC * LDV);   // [BR][LDS] scores
  float* Ps = Ss + BR * LDS;                             // [BR][LDS] do v^T
  DT* DSs = reinterpret_cast<DT*>(Ps + BR * LDS);        // [BR][LDP]
  float* rowv = reinterpret_cast<float*>(DSs + BR * LDP);  // delta[BR], factor[BR]
  float* wbuf = rowv + 2 * BR;                           // [8 warps][16 x 16]
  const int lane = tid & 31;

"""
    + _QUERY_TILE
    + r"""

  load_tile<DT, BR, D, LDQ, NTH>(Qs, q + row0 * D, rows, tid);
  load_tile<DT, BR, DV, LDV, NTH>(dOs, dout + row0 * DV, rows, tid);
  load_tile<DT, BR, DV, LDV, NTH>(Vs, o + row0 * DV, rows, tid);
  __syncthreads();
  {  // delta = rowsum(do * o), float32
    float s = 0.f;
    const int c0 = (tid & 3) * (DV / 4);
    for (int c = c0; c < c0 + DV / 4; ++c)
      s += static_cast<float>(dOs[r * LDV + c]) * static_cast<float>(Vs[r * LDV + c]);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if ((tid & 3) == 0) {
      rowv[r] = s;
      if (tq < NQ) delta_out[row0 + r] = s;
    }
  }

  // One pass over the key tiles, softmax online: p~ = exp2(c2 s - mref) against a
  // per-row reference mref that moves (and rescales acc and l) only when a tile's
  // maximum exceeds it by more than 8, so p~ <= 256; dq = scale * acc / l at the end.
  Acc acc[2 * (D / 64)];
#pragma unroll
  for (int i = 0; i < 2 * (D / 64); ++i) wmma::fill_fragment(acc[i], 0.f);
  float mref = neg_inf(), l = 0.f;
  for (int j = 0; j < nkb; ++j) {
    const int k0 = j * BC;
    const int kv = min(BC, NK - k0);
    __syncthreads();  // the previous tile (and the delta phase) is done with Ks, Vs, DSs
    load_tile<DT, BC, D, LDQ, NTH>(Ks, kp + static_cast<size_t>(k0) * D, kv, tid);
    load_tile<DT, BC, DV, LDV, NTH>(Vs, vp + static_cast<size_t>(k0) * DV, kv, tid);
    __syncthreads();
    mm_abt<DT, D, LDQ, LDQ, LDS>(Ss, Qs, Ks, warp);
    mm_abt<DT, DV, LDV, LDV, LDS>(Ps, dOs, Vs, warp);
    __syncthreads();
    float sv[16];
    float f;
    const bool moved = tile_row<CAUSAL, NK, OFF, LDS>(sv, Ss, r, cq, k0, tq, c2, mref, f);
    const float dl = rowv[r];
    float ls = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const float p = sv[c] == neg_inf() ? 0.f : exp2f(sv[c] - mref);
      ls += p;
      DSs[r * LDP + cq + c] = static_cast<DT>(p * (Ps[r * LDS + cq + c] - dl));
    }
    ls += __shfl_xor_sync(0xffffffffu, ls, 1);
    ls += __shfl_xor_sync(0xffffffffu, ls, 2);
    l = l * f + ls;
    if ((tid & 3) == 0) rowv[BR + r] = f;
    if (__syncthreads_or(moved)) scale_rows<D / 64>(acc, rowv + BR, wbuf + warp * 256, warp, lane);
    mm_acc<DT, false, LDP, LDQ, D / 64>(acc, DSs, Ks, warp);
  }
  __syncthreads();
  if ((tid & 3) == 0) {
    if (tq < NQ) lse[row0 + r] = mref + log2f(l);
    rowv[BR + r] = 1.f / l;
  }
  __syncthreads();
  store_acc<DT, D / 64, NTH>(dq + row0 * D, acc, sc, rowv + BR, reinterpret_cast<float*>(sm),
                             rows, warp, tid);
"""
)

_FWD_SOURCE = (
    _COMMON
    + r"""
  DT* Qs = reinterpret_cast<DT*>(sm);                    // [BR][LDQ]
  DT* Ks = Qs + BR * LDQ;                                // [BC][LDQ]
  DT* Vs = Ks + BC * LDQ;                                // [BC][LDV]
  float* Ss = reinterpret_cast<float*>(Vs + BC * LDV);   // [BR][LDS] scores
  DT* PBs = reinterpret_cast<DT*>(Ss + BR * LDS);        // [BR][LDP] p~
  float* rowv = reinterpret_cast<float*>(PBs + BR * LDP);  // factor[BR]
  float* wbuf = rowv + BR;                               // [8 warps][16 x 16]
  const int lane = tid & 31;

"""
    + _QUERY_TILE
    + r"""
  load_tile<DT, BR, D, LDQ, NTH>(Qs, q + row0 * D, rows, tid);

  // o = sum over key tiles of p~ v / l, with the online reference of the dq kernel.
  Acc acc[2 * (DV / 64)];
#pragma unroll
  for (int i = 0; i < 2 * (DV / 64); ++i) wmma::fill_fragment(acc[i], 0.f);
  float mref = neg_inf(), l = 0.f;
  for (int j = 0; j < nkb; ++j) {
    const int k0 = j * BC;
    const int kv = min(BC, NK - k0);
    __syncthreads();  // the previous tile is done with Ks, Vs, PBs
    load_tile<DT, BC, D, LDQ, NTH>(Ks, kp + static_cast<size_t>(k0) * D, kv, tid);
    load_tile<DT, BC, DV, LDV, NTH>(Vs, vp + static_cast<size_t>(k0) * DV, kv, tid);
    __syncthreads();
    mm_abt<DT, D, LDQ, LDQ, LDS>(Ss, Qs, Ks, warp);
    __syncthreads();
    float sv[16];
    float f;
    const bool moved = tile_row<CAUSAL, NK, OFF, LDS>(sv, Ss, r, cq, k0, tq, c2, mref, f);
    float ls = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const float p = sv[c] == neg_inf() ? 0.f : exp2f(sv[c] - mref);
      ls += p;
      PBs[r * LDP + cq + c] = static_cast<DT>(p);
    }
    ls += __shfl_xor_sync(0xffffffffu, ls, 1);
    ls += __shfl_xor_sync(0xffffffffu, ls, 2);
    l = l * f + ls;
    if ((tid & 3) == 0) rowv[r] = f;
    if (__syncthreads_or(moved)) scale_rows<DV / 64>(acc, rowv, wbuf + warp * 256, warp, lane);
    mm_acc<DT, false, LDP, LDV, DV / 64>(acc, PBs, Vs, warp);
  }
  __syncthreads();
  if ((tid & 3) == 0) {
    if (tq < NQ) lse[row0 + r] = mref + log2f(l);
    rowv[r] = 1.f / l;
  }
  __syncthreads();
  store_acc<DT, DV / 64, NTH>(out + row0 * DV, acc, 1.f, rowv, reinterpret_cast<float*>(sm),
                              rows, warp, tid);
"""
)

_DKDV_SOURCE = (
    _COMMON
    + r"""
  DT* Ks = reinterpret_cast<DT*>(sm);                    // [BC][LDQ]
  DT* Vs = Ks + BC * LDQ;                                // [BC][LDV]
  DT* Qs = Vs + BC * LDV;                                // [BR][LDQ]
  DT* dOs = Qs + BR * LDQ;                               // [BR][LDV]
  float* Ss = reinterpret_cast<float*>(dOs + BR * LDV);  // [BR][LDS] scores (q x k)
  float* Ps = Ss + BR * LDS;                             // [BR][LDS] do v^T
  DT* PBs = reinterpret_cast<DT*>(Ps + BR * LDS);        // [BR][LDP] p
  DT* DSs = PBs + BR * LDP;                              // [BR][LDP] ds
  float* rowv = reinterpret_cast<float*>(DSs + BR * LDP);  // lse2[BR], delta[BR]

  const int kb = blockIdx.x;  // the first key tiles are seen by the most queries
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int k0 = kb * BC;
  const int kv = min(BC, NK - k0);
  const size_t key0 = static_cast<size_t>(b * HKV + hk) * NK + k0;
  load_tile<DT, BC, D, LDQ, NTH>(Ks, k + key0 * D, kv, tid);
  load_tile<DT, BC, DV, LDV, NTH>(Vs, v + key0 * DV, kv, tid);

  Acc acc_k[2 * (D / 64)];
  Acc acc_v[2 * (DV / 64)];
#pragma unroll
  for (int i = 0; i < 2 * (D / 64); ++i) wmma::fill_fragment(acc_k[i], 0.f);
#pragma unroll
  for (int i = 0; i < 2 * (DV / 64); ++i) wmma::fill_fragment(acc_v[i], 0.f);

  const int nqb = (NQ + BR - 1) / BR;
  const int qb0 = CAUSAL ? max(0, k0 - OFF) / BR : 0;  // first query tile that sees k0
  for (int g = 0; g < G; ++g) {
    const int h = hk * G + g;
    for (int qb = qb0; qb < nqb; ++qb) {
      const int t0 = qb * BR;
      const int rows = min(BR, NQ - t0);
      const size_t row0 = static_cast<size_t>(b * HQ + h) * NQ + t0;
      __syncthreads();  // the previous tile is done with Qs, dOs, rowv, PBs, DSs
      load_tile<DT, BR, D, LDQ, NTH>(Qs, q + row0 * D, rows, tid);
      load_tile<DT, BR, DV, LDV, NTH>(dOs, dout + row0 * DV, rows, tid);
      if (tid < BR) {
        rowv[tid] = tid < rows ? lse[row0 + tid] : 0.f;
        rowv[BR + tid] = tid < rows ? delta[row0 + tid] : 0.f;
      }
      __syncthreads();
      mm_abt<DT, D, LDQ, LDQ, LDS>(Ss, Qs, Ks, warp);
      mm_abt<DT, DV, LDV, LDV, LDS>(Ps, dOs, Vs, warp);
      __syncthreads();
      const int tq = t0 + r;
      const float lse2 = rowv[r];
      const float dl = rowv[BR + r];
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const int kc = k0 + cq + c;
        const bool ok = tq < NQ && kc < NK && (!CAUSAL || kc <= tq + OFF);
        const float p = ok ? exp2f(Ss[r * LDS + cq + c] * c2 - lse2) : 0.f;
        PBs[r * LDP + cq + c] = static_cast<DT>(p);
        DSs[r * LDP + cq + c] = static_cast<DT>(p * (Ps[r * LDS + cq + c] - dl));
      }
      __syncthreads();
      mm_acc<DT, true, LDP, LDV, DV / 64>(acc_v, PBs, dOs, warp);  // dv += p^T do
      mm_acc<DT, true, LDP, LDQ, D / 64>(acc_k, DSs, Qs, warp);    // dk += ds^T q
    }
  }
  __syncthreads();
  float* stage = reinterpret_cast<float*>(Qs);  // Qs onwards is free now
  store_acc<DT, D / 64, NTH>(dk + key0 * D, acc_k, sc, nullptr, stage, kv, warp, tid);
  store_acc<DT, DV / 64, NTH>(dv + key0 * DV, acc_v, 1.f, nullptr, stage, kv, warp, tid);
"""
)


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    return rows * cols * itemsize


def smem_bytes(D: int, Dv: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel (mirrors the layouts in the sources)."""
    ldq, ldv, lds, ldp = D + 8, Dv + 8, BC + 4, BC + 8
    tiles = 2 * (_tile_bytes(BR, ldq, 2) + _tile_bytes(BR, ldv, 2))  # Q, dO, K, V
    scores = 2 * _tile_bytes(BR, lds, 4)
    rowv = 2 * BR * 4
    warp_bufs = (NT // 32) * 16 * 16 * 4
    dq = tiles + scores + _tile_bytes(BR, ldp, 2) + rowv + warp_bufs
    dkdv = tiles + scores + 2 * _tile_bytes(BR, ldp, 2) + rowv
    # forward: Q, K, V, the scores, p~, a factor per row, the warp buffers
    fwd_stageable = 2 * _tile_bytes(BR, ldq, 2) + _tile_bytes(BC, ldv, 2)
    fwd_stageable += _tile_bytes(BR, lds, 4) + _tile_bytes(BR, ldp, 2)
    fwd = fwd_stageable + BR * 4 + warp_bufs
    # The output staging [64][cols + 4] floats reuses the tiles (dq: from Q; dkdv: from
    # Q on, i.e. everything after K and V).
    staged_dq = _tile_bytes(BR, D + 4, 4)
    staged_dkdv = _tile_bytes(BC, max(D, Dv) + 4, 4)
    after_kv = dkdv - _tile_bytes(BC, ldq, 2) - _tile_bytes(BC, ldv, 2)
    staged_fwd = _tile_bytes(BR, Dv + 4, 4)
    if staged_dq > dq or staged_dkdv > after_kv or staged_fwd > fwd_stageable:
        raise AssertionError("attention kernel staging does not fit its shared memory")
    return {"fwd": fwd, "dq": dq, "dkdv": dkdv}


_LOG2E = 1.4426950408889634  # as the kernels' LOG2E


def supports(spec: Spec, dtype: mx.Dtype) -> bool:
    """Whether the kernels take this call: bfloat16, head sizes 64, 128, 192 or 256 whose
    kernels fit the device's shared memory (:func:`chunkscan._backend.cuda_limits`; on
    an A100 D = 256 does not, on consumer GPUs only D = 64 does), no mask or
    ``"causal"`` with ``T <= S`` (every query sees a key).

    float16 stays on the blocked ops: the ``dq`` kernel rounds ``p~ (dp - delta)``
    with ``p~`` up to 256 (its lazily moved reference) to the input dtype, which for
    float16 overflows at a 256x smaller ``|dp - delta|`` than the blocked path's
    ``p (dp - delta)`` (``p <= 1``). The kernels compile and pass the H200 tests for
    float16 too (run 4); a float16 variant whose reference always moves is the fix.

    A scale whose product with log2(e) overflows float32 (above about 2.36e38) stays
    on the blocked ops too: the kernels take their scores in base 2 (``c2 = scale *
    LOG2E``), and every output was NaN there (found by the emulator probe)."""
    if dtype != mx.bfloat16:
        return False
    if not abs(spec.scale) * _LOG2E <= F32_MAX:
        return False
    if spec.D % 64 or spec.Dv % 64 or not (64 <= spec.D <= 256 and 64 <= spec.Dv <= 256):
        return False
    if max(smem_bytes(spec.D, spec.Dv).values()) > cuda_limits().smem_per_block:
        return False
    if spec.mask_kind == "none":
        return True
    return spec.mask_kind == "causal" and spec.T <= spec.S


_KERNEL_ARGS = {
    "fwd": (["q", "k", "v", "params"], ["out", "lse"]),
    "dq": (["q", "k", "v", "dout", "o", "params"], ["dq", "lse", "delta_out"]),
    "dkdv": (["q", "k", "v", "dout", "delta", "lse", "params"], ["dk", "dv"]),
}


_SOURCES = {"fwd": _FWD_SOURCE, "dq": _DQ_SOURCE, "dkdv": _DKDV_SOURCE}


def _kernel(which: str, smem: int):
    """The kernel object ``which`` ("fwd", "dq", "dkdv") for a shared-memory size."""
    ins, outs = _KERNEL_ARGS[which]
    src = _SOURCES[which]
    return cuda_kernel("attention", f"chunkscan_attn_{which}", ins, outs, src, _HEADER, smem)


def template(spec: Spec, dtype: mx.Dtype) -> list[tuple[str, object]]:
    """The template arguments of both kernels (also used by the compile check)."""
    return [
        ("DT", dtype),
        ("D", spec.D),
        ("DV", spec.Dv),
        ("NQ", spec.T),
        ("NK", spec.S),
        ("HQ", spec.Hq),
        ("HKV", spec.Hkv),
        ("CAUSAL", spec.mask_kind == "causal"),
    ]


def forward(spec: Spec, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    """``o = attention(q, k, v)`` ``[B, Hq, T, Dv]`` in the input dtype (the float32
    statistics stay inside); requires :func:`supports`."""
    B, Hq, T = spec.B, spec.Hq, spec.T
    o, _ = _kernel("fwd", smem_bytes(spec.D, spec.Dv)["fwd"])(
        inputs=[q, k, v, param(spec.scale)],
        template=template(spec, q.dtype),
        grid=(-(-T // BR) * NT, Hq, B),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hq, T, spec.Dv), (B, Hq, T)],
        output_dtypes=[q.dtype, F32],
    )
    return o


def dq_pass(
    spec: Spec, q: mx.array, k: mx.array, v: mx.array, do: mx.array, o: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The ``dq`` kernel: ``(dq, lse, delta)`` (``lse`` base 2, ``[B, Hq, T]`` float32
    both); ``do`` and ``o`` in the input dtype."""
    B, Hq, T = spec.B, spec.Hq, spec.T
    return _kernel("dq", smem_bytes(spec.D, spec.Dv)["dq"])(
        inputs=[q, k, v, do, o, param(spec.scale)],
        template=template(spec, q.dtype),
        grid=(-(-T // BR) * NT, Hq, B),
        threadgroup=(NT, 1, 1),
        output_shapes=[q.shape, (B, Hq, T), (B, Hq, T)],
        output_dtypes=[q.dtype, F32, F32],
    )


def dkdv_pass(
    spec: Spec,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    do: mx.array,
    delta: mx.array,
    lse: mx.array,
) -> tuple[mx.array, mx.array]:
    """The ``dk``/``dv`` kernel, given :func:`dq_pass`'s ``delta`` and ``lse``."""
    return _kernel("dkdv", smem_bytes(spec.D, spec.Dv)["dkdv"])(
        inputs=[q, k, v, do, delta, lse, param(spec.scale)],
        template=template(spec, q.dtype),
        grid=(-(-spec.S // BC) * NT, spec.Hkv, spec.B),
        threadgroup=(NT, 1, 1),
        output_shapes=[k.shape, v.shape],
        output_dtypes=[q.dtype, q.dtype],
    )


def backward(
    spec: Spec, q: mx.array, k: mx.array, v: mx.array, o: mx.array, do: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """``(dq, dk, dv)`` of ``o = attention(q, k, v)`` for the cotangent ``do``, in the
    input dtype; requires :func:`supports`."""
    do = do.astype(q.dtype)
    dq, lse, delta = dq_pass(spec, q, k, v, do, o.astype(q.dtype))
    dk, dv = dkdv_pass(spec, q, k, v, do, delta, lse)
    return dq, dk, dv
