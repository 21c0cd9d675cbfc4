// Paged attention for decode rows (one query per sequence): flash-decoding with an online
// softmax, K and V streamed in one pass with 16-byte loads.
//
// Grid (max_splits, num_seqs, kv_heads), 128 threads. A CTA serves one KV head of one
// sequence and every query head of its GQA group, so each K/V byte is read once per step.
// The split count is decided here per sequence, from its context: one split per
// `min_partition` positions, at most gridDim.x (sized by the launcher from the SM count and
// fixed, so a captured graph stays valid); CTAs past a sequence's splits exit at once. A
// sequence with one split writes its output directly; with more, each split writes its
// unnormalized output, max and sum, and the split that finishes last merges them (a ticket per
// sequence and KV head, reset by the merger): no second launch.
//
// Inside a CTA each warp takes whole KV blocks in turn (one block-table read per block). A
// lane holds one 16-byte chunk of one position's K and V: kLanesPerPos lanes share a
// position, 32 / kLanesPerPos positions per pass, up to four passes of loads in flight.
// Each lane keeps its own running max, sum and output chunk per query head; lanes, then warps
// merge them.
//
// Fused mode (cos_table non-null, a decode-only step): the query heads get the QKV bias and
// the rotary embedding here, and the split that holds the last position first writes the new
// token's K (biased, rotated) and V (biased) into the cache at its slot (-1: a padded row of
// a captured graph, nothing written): no rotary or KV-write launch. Unfused mode reads
// queries that rotary_and_cache.cu already rotated.
// A sliding layer (window > 0) reads the last `window` positions only: its splits cover the
// blocks from the window's first, and the positions before it in that block are skipped.
// K/V cache layout: (num_blocks, kv_heads, BLOCK, D). fp32 math throughout.
#include "common.cuh"

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 8;  // query heads per KV head; the launcher checks
// Three CTAs an SM: ptxas may use up to 168 registers a thread (it spilled at 128, its own
// pick, once the sliding window's bounds were added).
constexpr int kMinCtasPerSm = 3;

// A 16-byte vector of T as floats.
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[4], float) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __half) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    out[2 * i] = pair.x;
    out[2 * i + 1] = pair.y;
  }
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __nv_bfloat16) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// x + bias, rounded to T as a separate bias add would store it.
template <typename T>
__device__ __forceinline__ float biased(const T* row, const T* bias, int column) {
  const float x = to_float(row[column]);
  return bias == nullptr ? x : to_float(from_float<T>(x + to_float(bias[column])));
}

// exp(m - target), 0 for an empty state (m = -inf), never NaN.
__device__ __forceinline__ float rescale(float m, float target) {
  return m == -INFINITY ? 0.0f : __expf(m - target);
}

template <typename T, int D, int BLOCK>
__device__ void paged_decode_attention(
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_stats,
    int* __restrict__ tickets, const T* __restrict__ qkv, int row_stride,
    const T* __restrict__ qkv_bias, const float* __restrict__ cos_table,
    const float* __restrict__ sin_table, const int* __restrict__ positions,
    const long long* __restrict__ slots, T* key_cache, T* value_cache,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ context_lens,
    int num_heads, int kv_heads, int min_partition, float scale, int window) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanesPerPos = D / kVec;
  constexpr int kPosPerPass = 32 / kLanesPerPos;
  constexpr int kPasses = BLOCK / kPosPerPass;
  constexpr int kInFlight = kPasses < 4 ? kPasses : 4;
  constexpr int kHalf = D / 2;
  static_assert(32 % kLanesPerPos == 0 && BLOCK % kPosPerPass == 0, "unsupported D or BLOCK");
  static_assert(kPasses % kInFlight == 0, "passes must split into rounds");

  __shared__ __align__(16) float q_shared[kMaxGroup * D];  // scaled queries
  __shared__ __align__(16) float warp_out[kWarps][kMaxGroup * D];
  __shared__ float warp_stats[kWarps][kMaxGroup][2];  // max, sum
  __shared__ bool merges;

  const int split = blockIdx.x, seq = blockIdx.y, kv_head = blockIdx.z;
  const int group = num_heads / kv_heads, first_head = kv_head * group;
  const int context = context_lens[seq];
  const int start = window > 0 ? max(0, context - window) : 0;  // the first position read
  const int start_block = start / BLOCK;
  const int context_blocks = (context + BLOCK - 1) / BLOCK;
  const int span_blocks = context_blocks - start_block;
  const int wanted = max(1, (context - start_block * BLOCK + min_partition - 1) / min_partition);
  const int blocks_per_split = (span_blocks + min(wanted, (int)gridDim.x) - 1) /
                               min(wanted, (int)gridDim.x);
  const int splits = (span_blocks + blocks_per_split - 1) / blocks_per_split;  // none empty
  if (split >= splits) return;
  const int first_block = start_block + split * blocks_per_split;
  const int end_block = min(first_block + blocks_per_split, context_blocks);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* row = qkv + static_cast<long long>(seq) * row_stride;
  const bool fused = cos_table != nullptr;
  const long long angle_row = fused ? static_cast<long long>(positions[seq]) * kHalf : 0;

  for (int i = tid; i < group * kHalf; i += kThreads) {
    const int g = i / kHalf, j = i % kHalf, column = (first_head + g) * D + j;
    float x1 = to_float(row[column]), x2 = to_float(row[column + kHalf]);
    if (fused) {  // as rotary_and_cache stores them: biased, rotated, rounded to T
      x1 = biased(row, qkv_bias, column);
      x2 = biased(row, qkv_bias, column + kHalf);
      const float c = cos_table[angle_row + j], s = sin_table[angle_row + j];
      const float r1 = to_float(from_float<T>(x1 * c - x2 * s));
      x2 = to_float(from_float<T>(x2 * c + x1 * s));
      x1 = r1;
    }
    q_shared[g * D + j] = x1 * scale;
    q_shared[g * D + j + kHalf] = x2 * scale;
  }
  if (fused && split == splits - 1 && slots[seq] >= 0) {  // the new token's K and V
    const long long slot = slots[seq];
    const long long at = ((slot / BLOCK * kv_heads + kv_head) * BLOCK + slot % BLOCK) * D;
    const int k_column = (num_heads + kv_head) * D, v_column = (num_heads + kv_heads + kv_head) * D;
    for (int j = tid; j < kHalf; j += kThreads) {
      const float x1 = biased(row, qkv_bias, k_column + j);
      const float x2 = biased(row, qkv_bias, k_column + j + kHalf);
      const float c = cos_table[angle_row + j], s = sin_table[angle_row + j];
      key_cache[at + j] = from_float<T>(x1 * c - x2 * s);
      key_cache[at + j + kHalf] = from_float<T>(x2 * c + x1 * s);
    }
    for (int j = tid; j < D; j += kThreads)
      value_cache[at + j] = from_float<T>(biased(row, qkv_bias, v_column + j));
  }
  __syncthreads();  // queries in shared memory; this CTA's K/V write visible to its reads

  const int slot_in_pass = lane / kLanesPerPos, chunk = lane % kLanesPerPos;
  float run_max[kMaxGroup], run_sum[kMaxGroup], acc[kMaxGroup][kVec];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    run_max[g] = -INFINITY;
    run_sum[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
  }
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
  const long long head_stride = static_cast<long long>(BLOCK) * D;
  int physical = first_block + warp < end_block ? table[first_block + warp] : 0;
  for (int b = first_block + warp; b < end_block; b += kWarps) {
    const long long base = (static_cast<long long>(physical) * kv_heads + kv_head) * head_stride;
    if (b + kWarps < end_block) physical = table[b + kWarps];  // the next block's, early
    const int valid = min(BLOCK, context - b * BLOCK);
#pragma unroll
    for (int round = 0; round < kPasses; round += kInFlight) {
      uint4 k_raw[kInFlight], v_raw[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const long long at = base + ((round + i) * kPosPerPass + slot_in_pass) * D;
        k_raw[i] = reinterpret_cast<const uint4*>(key_cache + at)[chunk];
        v_raw[i] = reinterpret_cast<const uint4*>(value_cache + at)[chunk];
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int in_block = (round + i) * kPosPerPass + slot_in_pass;
        const bool live = in_block < valid && b * BLOCK + in_block >= start;
        float k[kVec], v[kVec];
        unpack(k_raw[i], k, T());
        unpack(v_raw[i], v, T());
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= group) break;  // uniform across the CTA: the shuffles stay convergent
          const float4* q = reinterpret_cast<const float4*>(q_shared + g * D + chunk * kVec);
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kVec / 4; ++e) {
            const float4 q4 = q[e];
            dot += q4.x * k[4 * e] + q4.y * k[4 * e + 1] + q4.z * k[4 * e + 2] +
                   q4.w * k[4 * e + 3];
          }
#pragma unroll
          for (int offset = 1; offset < kLanesPerPos; offset <<= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, offset);
          if (live) {
            const float new_max = fmaxf(run_max[g], dot);
            const float keep = rescale(run_max[g], new_max), p = __expf(dot - new_max);
            run_sum[g] = run_sum[g] * keep + p;
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[g][e] = acc[g][e] * keep + p * v[e];
            run_max[g] = new_max;
          }
        }
      }
    }
  }

  // Lanes of one chunk (one per position slot) merge, then the warps in shared memory.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
#pragma unroll
    for (int offset = kLanesPerPos; offset < 32; offset <<= 1) {
      const float other_max = __shfl_xor_sync(0xffffffffu, run_max[g], offset);
      const float other_sum = __shfl_xor_sync(0xffffffffu, run_sum[g], offset);
      const float new_max = fmaxf(run_max[g], other_max);
      const float mine = rescale(run_max[g], new_max), theirs = rescale(other_max, new_max);
      run_sum[g] = run_sum[g] * mine + other_sum * theirs;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        acc[g][e] = acc[g][e] * mine + __shfl_xor_sync(0xffffffffu, acc[g][e], offset) * theirs;
      run_max[g] = new_max;
    }
    if (slot_in_pass == 0) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) warp_out[warp][g * D + chunk * kVec + e] = acc[g][e];
      if (chunk == 0) {
        warp_stats[warp][g][0] = run_max[g];
        warp_stats[warp][g][1] = run_sum[g];
      }
    }
  }
  __syncthreads();

  const long long seq_head = static_cast<long long>(seq) * num_heads + first_head;
  for (int i = tid; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, warp_stats[w][g][0]);
    float total = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = rescale(warp_stats[w][g][0], top);
      total += warp_stats[w][g][1] * weight;
      value += warp_out[w][i] * weight;
    }
    if (splits == 1) {
      out[(seq_head + g) * D + d] = from_float<T>(value / total);
    } else {
      const long long at = (seq_head + g) * gridDim.x + split;
      partial_out[at * D + d] = value;
      if (d == 0) {
        partial_stats[2 * at] = top;
        partial_stats[2 * at + 1] = total;
      }
    }
  }
  if (splits == 1) return;

  // The last split of this sequence and KV head to finish merges every split's partials.
  __threadfence();  // this CTA's partials before its ticket
  __syncthreads();
  if (tid == 0) {
    const int ticket = atomicAdd(&tickets[seq * kv_heads + kv_head], 1);
    merges = ticket == splits - 1;
  }
  __syncthreads();
  if (!merges) return;
  __threadfence();
  for (int i = tid; i < group * D; i += kThreads) {
    const int g = i / D, d = i % D;
    const long long first = (seq_head + g) * gridDim.x;
    float top = -INFINITY;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, __ldcg(partial_stats + 2 * (first + s)));
    float total = 0.0f, value = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float weight = __expf(__ldcg(partial_stats + 2 * (first + s)) - top);
      total += __ldcg(partial_stats + 2 * (first + s) + 1) * weight;
      value += __ldcg(partial_out + (first + s) * D + d) * weight;
    }
    out[(seq_head + g) * D + d] = from_float<T>(value / total);
  }
  if (tid == 0) tickets[seq * kv_heads + kv_head] = 0;  // ready for the next launch
}

// A lane's 16-byte chunk must divide a position's K row among at most 32 lanes: head_dim 256
// (Gemma 3) in 16-bit types only. The float32 instantiation is a stub the launcher never
// calls (check_shape refuses it), so one module still holds every storage type.
template <typename T, int D>
constexpr bool kLaidOut = D / (16 / sizeof(T)) <= 32;

template <typename T, int D, int BLOCK>
__device__ void decode_entry(
    T* out, float* partial_out, float* partial_stats, int* tickets, const T* qkv, int row_stride,
    const T* qkv_bias, const float* cos_table, const float* sin_table, const int* positions,
    const long long* slots, T* key_cache, T* value_cache, const int* block_tables,
    int max_blocks, const int* context_lens, int num_heads, int kv_heads, int min_partition,
    float scale, int window) {
  if constexpr (kLaidOut<T, D>) {
    paged_decode_attention<T, D, BLOCK>(
        out, partial_out, partial_stats, tickets, qkv, row_stride, qkv_bias, cos_table,
        sin_table, positions, slots, key_cache, value_cache, block_tables, max_blocks,
        context_lens, num_heads, kv_heads, min_partition, scale, window);
  } else {
    __trap();
  }
}

// DECODE_FOR expands its arguments (KVMESH_HEAD_DIM...) before DECODE_NAMED pastes them.
#define DECODE_FOR(SUFFIX, T, D, BLOCK) DECODE_NAMED(SUFFIX, T, D, BLOCK)
#define DECODE_NAMED(SUFFIX, T, D, BLOCK)                                                   \
  extern "C" __global__ void __launch_bounds__(kThreads, kMinCtasPerSm)                     \
      paged_decode_attention_##SUFFIX##_d##D##_b##BLOCK(                                    \
          T* out, float* partial_out, float* partial_stats, int* tickets, const T* qkv,     \
          int row_stride, const T* qkv_bias, const float* cos_table, const float* sin_table, \
          const int* positions, const long long* slots, T* key_cache, T* value_cache,       \
          const int* block_tables, int max_blocks, const int* context_lens, int num_heads,  \
          int kv_heads, int min_partition, float scale, int window) {                       \
    decode_entry<T, D, BLOCK>(                                                              \
        out, partial_out, partial_stats, tickets, qkv, row_stride, qkv_bias, cos_table,     \
        sin_table, positions, slots, key_cache, value_cache, block_tables, max_blocks,      \
        context_lens, num_heads, kv_heads, min_partition, scale, window);                   \
  }
// Every head size and block size (the compile check), or only KVMESH_HEAD_DIM and
// KVMESH_BLOCK_SIZE when the launcher defines them: NVRTC then compiles 3 kernels, not 36.
#if defined(KVMESH_HEAD_DIM) && defined(KVMESH_BLOCK_SIZE)
#define DECODE(SUFFIX, T) DECODE_FOR(SUFFIX, T, KVMESH_HEAD_DIM, KVMESH_BLOCK_SIZE)
#else
#define DECODE_FOR_DIM(SUFFIX, T, D) \
  DECODE_FOR(SUFFIX, T, D, 8)        \
  DECODE_FOR(SUFFIX, T, D, 16)       \
  DECODE_FOR(SUFFIX, T, D, 32)
#define DECODE(SUFFIX, T)        \
  DECODE_FOR_DIM(SUFFIX, T, 32)  \
  DECODE_FOR_DIM(SUFFIX, T, 64)  \
  DECODE_FOR_DIM(SUFFIX, T, 128) \
  DECODE_FOR_DIM(SUFFIX, T, 256)
#endif
KVMESH_INSTANTIATE(DECODE)
