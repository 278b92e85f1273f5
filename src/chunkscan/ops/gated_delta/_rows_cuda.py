"""Small CUDA kernels around the fused ones, each one launch where MLX ops took many.

- :func:`non_finite_rows`: which tokens have a non-finite ``q``, or a non-finite ``k``,
  ``v``, ``beta`` or gate (the rows :func:`.chunk._non_finite_reach` counts). As MLX
  ops that is a subtract, a row sum and a compare per input, plus the comparisons,
  ``logical_or`` s and the transposing copy that join them: about fifteen launches,
  0.59 ms of kernel time per fwd+bwd at T = 16384 on the H200 (run 58's Nsight
  profile: the bf16 row sums alone 0.32 ms). Here one launch reads each input once.
- :func:`non_finite_reach`: from those rows, where the recurrence has NaN: every output
  from a sequence's first flagged row on (or with a flagged ``q``) and the final state
  of such a sequence. As MLX ops: a cumulative sum, two compares, a ``logical_or`` and
  a slice (packed sequences: a concatenate, two gathers and a subtract more), four
  kernels of 52 us per call at T = 16384 (an H100's Nsight profile, run 101: the compare
  of the transposed count alone 30 us) besides each op's launch; here one of 29 us
  (run 104, an H100; a first form, a span of tokens per thread, took 42 us on the H200
  in run 103).

Both are chosen with the other CUDA kernels (``kernels`` / ``CHUNKSCAN_CUDA_KERNELS``)
and give what the MLX ops give, bit for bit. Tested against those ops through the CPU
emulator (``tests/ops/test_gated_delta_rows.py``) and on a CUDA device. (A third,
``sum_value_heads``, summed ``dq`` and ``dk`` over the value heads of a key head until
session 38, when ``input_grads`` took a key head's value heads in one block.)
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..._backend import cuda_kernel

_HEADER = r"""
namespace csr {
template <typename T> __device__ __forceinline__ bool bad(T x) {
  return !isfinite(static_cast<float>(x));
}
// A gate is read as given when finite or -inf (a reset): NaN and +inf are bad.
template <typename T> __device__ __forceinline__ bool bad_gate(T x) {
  const float y = static_cast<float>(x);
  return !(isfinite(y) || y < 0.f);
}
}  // namespace csr
"""

# One block per token (b, t); one warp per key head: its q and k rows and its G value
# heads' v rows, gates and betas. Bits of a warp's flags: 1 q, 2 k, 4 << i value head i.
_ROWS = r"""
  const int t = blockIdx.x, b = blockIdx.y, T = gridDim.x;
  const int hk = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t bt = size_t(b) * T + t;
  bool qb = false, kb = false;
  for (int d = lane; d < DK; d += 32) {
    qb |= csr::bad(q[(bt * HK + hk) * DK + d]);  // |=, not ||: every load issued at once
    kb |= csr::bad(k[(bt * HK + hk) * DK + d]);
  }
  unsigned bits = (qb ? 1u : 0u) | (kb ? 2u : 0u);
  for (int i = 0; i < G; ++i) {
    const size_t r = bt * (HK * G) + hk * G + i;
    bool bad = lane == 0 && csr::bad(beta[r]);
    for (int d = lane; d < DV; d += 32) bad |= csr::bad(v[r * DV + d]);
    for (int d = lane; d < DG; d += 32) bad |= csr::bad_gate(g[r * DG + d]);
    bits |= bad ? (4u << i) : 0u;
  }
  for (int o = 16; o > 0; o /= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
  if (lane < G) {  // lane i writes value head hk * G + i
    const int h = hk * G + lane;
    q_bad[bt * (HK * G) + h] = (bits & 1u) != 0;
    state_bad[(size_t(b) * (HK * G) + h) * T + t] = (bits & (2u | (4u << lane))) ? 1 : 0;
  }
"""

# One block per (value head h, batch row b): a segmented OR scan along T of the rows'
# flags, restarting at each sequence's first token, a tile of blockDim tokens at a time
# (a token per thread: coalesced reads; the next tile's read issued before this tile's
# scan). A token's state: bit 0 a flag since the last restart, bit 1 a restart. Warps
# scan with shuffles, warp 0 the warps' totals, and the tiles carry the flag on.
_REACH = r"""
  const int h = blockIdx.x, b = blockIdx.y, HV = gridDim.x, T = state_bad_shape[2];
  const int NT = blockDim.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int* row = state_bad + (size_t(b) * HV + h) * T;
  // y after x: y's flag alone where y restarts, else either's
  auto join = [](int x, int y) { return (y & 2) ? (y | (x & 2)) : (x | y); };
  auto state = [&](int t, int flagged) {
    const bool starts = t == 0 || (PACKED && seq_of[t] != seq_of[t - 1]);
    return (flagged != 0 ? 1 : 0) | (starts ? 2 : 0);
  };
  extern __shared__ int totals[];  // [NT / 32]: each warp's inclusive total
  int carry = 0;                   // the flag entering the tile
  int next = tid < T ? row[tid] : 0;
  for (int base = 0; base < T; base += NT) {
    const int t = base + tid;
    int x = t < T ? state(t, next) : 0;
    if (t + NT < T) next = row[t + NT];
    for (int off = 1; off < 32; off *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x = join(y, x);
    }
    if (lane == 31) totals[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = lane < NT / 32 ? totals[lane] : 0;
      for (int off = 1; off < 32; off *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w = join(y, w);
      }
      if (lane < NT / 32) totals[lane] = w;
    }
    __syncthreads();
    const int before = warp > 0 ? join(carry, totals[warp - 1]) : carry;
    const bool reach = (join(before, x) & 1) != 0;
    if (t < T) {
      const size_t r = (size_t(b) * T + t) * HV + h;
      o_bad[r] = reach || q_bad[r];
      if (t == T - 1 || (PACKED && seq_of[t + 1] != seq_of[t])) {
        seq_bad[(PACKED ? seq_of[t] : b) * HV + h] = reach;
      }
    }
    carry = join(carry, totals[NT / 32 - 1]) & 1;
    __syncthreads();  // totals read before the next tile writes them
  }
"""

MAX_KEY_HEADS = 32  # one warp each in a block of at most 1024 threads
MAX_GROUP = 30  # value heads per key head: bits 2 .. 31 of a warp's flags
MAX_BATCH = 65535  # batch rows: the grid's second dimension
REACH_THREADS = 1024


def rows_supported(B: int, Hk: int, G: int) -> bool:
    """Whether :func:`non_finite_rows` takes ``B`` rows of ``Hk`` key heads of ``G``
    value heads."""
    return B <= MAX_BATCH and Hk <= MAX_KEY_HEADS and G <= MAX_GROUP


def non_finite_rows(q, k, v, g, beta) -> tuple[mx.array, mx.array]:
    """``(state_bad [B, Hv, T] int32, q_bad [B, T, Hv] bool)`` from raw inputs ``q``,
    ``k`` ``[B, T, Hk, Dk]``, ``v`` ``[B, T, Hv, Dv]``, ``g`` ``[B, T, Hv]`` or
    ``[B, T, Hv, Dk]``, ``beta`` ``[B, T, Hv]`` (any float dtypes; no gradient flows
    through). ``state_bad``: 1 where the value head's ``k`` (of its key head), ``v``
    or ``beta`` holds a NaN or infinity or its gate a NaN or ``+inf``, laid out for a
    cumulative sum along ``T``; ``q_bad``: the key head's ``q`` is non-finite.
    Requires :func:`rows_supported`."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    G = Hv // Hk
    DG = g.shape[-1] if g.ndim == 4 else 1
    kernel = cuda_kernel(
        "gated_delta_rule", "chunkscan_gdn_non_finite_rows", ["q", "k", "v", "g", "beta"],
        ["state_bad", "q_bad"], _ROWS, _HEADER, 0,
    )  # fmt: skip
    state_bad, q_bad = kernel(
        inputs=[q, k, v, g, beta],
        template=[("HK", Hk), ("G", G), ("DK", Dk), ("DV", Dv), ("DG", DG)],
        grid=(T * 32 * Hk, B, 1), threadgroup=(32 * Hk, 1, 1),
        output_shapes=[(B, Hv, T), (B, T, Hv)], output_dtypes=[mx.int32, mx.bool_],
    )  # fmt: skip
    return state_bad, q_bad


def non_finite_reach(
    state_bad: mx.array, q_bad: mx.array, seqs: tuple[tuple[int, int], ...] | None
) -> tuple[mx.array, mx.array]:
    """``(o_bad [B, T, Hv], seq_bad [n_seq, Hv])``, both bool, from
    :func:`non_finite_rows`' ``state_bad [B, Hv, T]`` and ``q_bad [B, T, Hv]``:
    ``o_bad`` where a row of the token's sequence at or before it is flagged in
    ``state_bad``, or its ``q_bad``; ``seq_bad`` where any row of the sequence is (the
    sequences: ``seqs``' ``(start, end)`` of the one batch row, else the ``B`` rows).
    Requires :func:`rows_supported`."""
    B, Hv, T = state_bad.shape
    packed = seqs is not None
    kernel = cuda_kernel(
        "gated_delta_rule", "chunkscan_gdn_non_finite_reach", ["state_bad", "q_bad", "seq_of"],
        ["o_bad", "seq_bad"], _REACH, "", REACH_THREADS // 32 * 4,
    )  # fmt: skip
    return kernel(
        inputs=[state_bad, q_bad, _sequence_of_tokens(seqs)],
        template=[("PACKED", packed)],
        grid=(Hv * REACH_THREADS, B, 1), threadgroup=(REACH_THREADS, 1, 1),
        output_shapes=[(B, T, Hv), (len(seqs) if packed else B, Hv)],
        output_dtypes=[mx.bool_, mx.bool_],
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _sequence_of_tokens(seqs: tuple[tuple[int, int], ...] | None) -> mx.array:
    """``[T]`` int32: each token's packed sequence (``[1]`` zeros without ``seqs``,
    not read); an array with data and no graph (usable from any thread:
    :data:`chunkscan._backend.UNUSED`), made once per layout."""
    if seqs is None:
        return mx.array([0], dtype=mx.int32)
    return mx.array([i for i, (lo, hi) in enumerate(seqs) for _ in range(hi - lo)], dtype=mx.int32)
