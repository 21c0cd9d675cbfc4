// Paged attention for ragged prefill chunks, causal, over cached prefixes.
//
// A sequence's chunk has num_q = query_starts[s + 1] - query_starts[s] new tokens at the end of
// its context of context_lens[s] tokens (cached prefix + chunk): query i sits at position
// context - num_q + i and sees keys 0..that position, read through the block table (the
// chunk's own K/V are written to the cache first). Grid: (ceil(max_num_q / 4), num_seqs,
// num_heads), 128 threads: a warp per query, online softmax over chunks of 32 keys (a key per
// lane for Q.K, then each lane owns D / 32 output dimensions for P.V). A sliding layer
// (window > 0) starts each query's keys `window - 1` positions back. fp32 math.
#include "common.cuh"

constexpr int kQueriesPerBlock = 4;

template <typename T, int D>
__device__ void paged_prefill_attention(
    T* __restrict__ out, int out_stride, const T* __restrict__ qkv, int row_stride,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ query_starts,
    const int* __restrict__ context_lens, int num_heads, int kv_heads, int block_size,
    float scale, int window) {
  __shared__ float q_shared[kQueriesPerBlock][D];
  const int seq = blockIdx.y, head = blockIdx.z, kv_head = head / (num_heads / kv_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first_row = query_starts[seq], num_q = query_starts[seq + 1] - first_row;
  const int query = blockIdx.x * kQueriesPerBlock + warp;
  if (query >= num_q) return;  // whole warps only: nothing below syncs the block
  const long long row = first_row + query;
  const int position = context_lens[seq] - num_q + query;
  constexpr int kPerLane = D / 32;
  const T* q = qkv + row * row_stride + head * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) q_shared[warp][lane + 32 * j] = to_float(q[lane + 32 * j]) * scale;
  __syncwarp();

  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
  float running_max = -INFINITY, running_sum = 0.0f, acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = 0.0f;
  const int start = window > 0 ? max(0, position - window + 1) : 0;
  for (int chunk = start; chunk <= position; chunk += 32) {
    const int key_position = chunk + lane;
    float score = -INFINITY;
    if (key_position <= position) {
      const long long block = table[key_position / block_size];
      const T* key = key_cache +
          ((block * kv_heads + kv_head) * block_size + key_position % block_size) * D;
      score = 0.0f;
      for (int d = 0; d < D; ++d) score += q_shared[warp][d] * to_float(key[d]);
    }
    const float new_max = fmaxf(running_max, warp_max(score));  // finite: lane 0 is in range
    const float p = key_position <= position ? __expf(score - new_max) : 0.0f;
    const float correction = __expf(running_max - new_max);
    running_sum = running_sum * correction + warp_sum(p);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] *= correction;
    const int last = min(31, position - chunk);  // the same for every lane
    for (int source = 0; source <= last; ++source) {
      const float weight = __shfl_sync(0xffffffffu, p, source);
      const int value_position = chunk + source;
      const long long block = table[value_position / block_size];
      const T* value = value_cache +
          ((block * kv_heads + kv_head) * block_size + value_position % block_size) * D;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) acc[j] += weight * to_float(value[lane + 32 * j]);
    }
    running_max = new_max;
  }
  T* target = out + row * out_stride + head * D;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) target[lane + 32 * j] = from_float<T>(acc[j] / running_sum);
}

#define PREFILL_FOR_DIM(SUFFIX, T, D)                                                        \
  extern "C" __global__ void paged_prefill_attention_##SUFFIX##_d##D(                        \
      T* out, int out_stride, const T* qkv, int row_stride, const T* key_cache,              \
      const T* value_cache, const int* block_tables, int max_blocks, const int* query_starts, \
      const int* context_lens, int num_heads, int kv_heads, int block_size, float scale,     \
      int window) {                                                                          \
    paged_prefill_attention<T, D>(out, out_stride, qkv, row_stride, key_cache, value_cache,  \
                                  block_tables, max_blocks, query_starts, context_lens,      \
                                  num_heads, kv_heads, block_size, scale, window);           \
  }
#define PREFILL(SUFFIX, T)         \
  PREFILL_FOR_DIM(SUFFIX, T, 32)   \
  PREFILL_FOR_DIM(SUFFIX, T, 64)   \
  PREFILL_FOR_DIM(SUFFIX, T, 128)  \
  PREFILL_FOR_DIM(SUFFIX, T, 256)
KVMESH_INSTANTIATE(PREFILL)
