// Paged attention for decode rows (one query per sequence), flash-decoding style.
//
// Pass 1, paged_decode_attention_<T>_d<D>: grid (num_splits, num_seqs, kv_heads), 128 threads.
// Each block takes one partition of `partition_size` positions of one sequence's context for
// one KV head and all `group` query heads sharing it (GQA: K and V are read once per group).
// It writes, per query head and split, the partition's max score, its sum of exp(score - max)
// and its unnormalized output. Splits past the context write max = -inf and sum = 0.
// Pass 2, paged_decode_reduce_<T>: grid (num_seqs, num_heads), head_dim threads, merges the
// splits. Long contexts thus spread over many blocks while short ones cost one split.
// K/V cache layout: (num_blocks, kv_heads, block_size, D). fp32 math throughout.
#include "common.cuh"

constexpr int kMaxGroup = 8;  // query heads per KV head; the launcher checks

template <typename T, int D>
__device__ void paged_decode_attention(
    float* __restrict__ partial_out, float* __restrict__ partial_max,
    float* __restrict__ partial_sum, const T* __restrict__ qkv, int row_stride,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ context_lens,
    int num_heads, int kv_heads, int block_size, int partition_size, float scale) {
  extern __shared__ float shared[];
  const int split = blockIdx.x, seq = blockIdx.y, kv_head = blockIdx.z;
  const int num_splits = gridDim.x, group = num_heads / kv_heads;
  const int first_head = kv_head * group;
  const int context = context_lens[seq];
  const int start = split * partition_size;
  const int end = min(start + partition_size, context);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  if (start >= context) {
    for (int i = tid; i < group * D; i += blockDim.x) {
      const long long head_split = (static_cast<long long>(seq) * num_heads + first_head + i / D) *
                                   num_splits + split;
      partial_out[head_split * D + i % D] = 0.0f;
      if (i % D == 0) {
        partial_max[head_split] = -INFINITY;
        partial_sum[head_split] = 0.0f;
      }
    }
    return;
  }
  float* q_shared = shared;                             // group * D: scaled queries
  float* scores = q_shared + group * D;                 // group * partition_size
  float* scratch = scores + group * partition_size;     // 32: block reductions
  const T* q_row = qkv + static_cast<long long>(seq) * row_stride + first_head * D;
  for (int i = tid; i < group * D; i += blockDim.x) q_shared[i] = to_float(q_row[i]) * scale;
  __syncthreads();

  // Q.K: a warp per position; each lane holds D / 32 of the key.
  constexpr int kPerLane = D / 32;
  const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
  for (int t = start + warp; t < end; t += warps) {
    const long long block = table[t / block_size];
    const T* key = key_cache + ((block * kv_heads + kv_head) * block_size + t % block_size) * D;
    float k[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) k[j] = to_float(key[lane + 32 * j]);
    for (int g = 0; g < group; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dot += q_shared[g * D + lane + 32 * j] * k[j];
      dot = warp_sum(dot);
      if (lane == 0) scores[g * partition_size + (t - start)] = dot;
    }
  }
  __syncthreads();

  // Softmax statistics of this partition, per query head; scores become exp(score - max).
  const int length = end - start;
  for (int g = 0; g < group; ++g) {
    float* row = scores + g * partition_size;
    float local_max = -INFINITY;
    for (int i = tid; i < length; i += blockDim.x) local_max = fmaxf(local_max, row[i]);
    const float row_max = block_reduce<true>(local_max, scratch);
    float local_sum = 0.0f;
    for (int i = tid; i < length; i += blockDim.x) {
      const float p = __expf(row[i] - row_max);
      row[i] = p;
      local_sum += p;
    }
    const float row_sum = block_reduce<false>(local_sum, scratch);
    if (tid == 0) {
      const long long head_split =
          (static_cast<long long>(seq) * num_heads + first_head + g) * num_splits + split;
      partial_max[head_split] = row_max;
      partial_sum[head_split] = row_sum;
    }
  }
  __syncthreads();

  // P.V: each thread owns one dimension for a strided share of the positions, all heads of
  // the group in registers; the shares meet in shared memory (q_shared is free again).
  const int d = tid % D, share = tid / D, shares = blockDim.x / D;
  float acc[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) acc[g] = 0.0f;
  for (int t = start + share; t < end; t += shares) {
    const long long block = table[t / block_size];
    const float v = to_float(
        value_cache[((block * kv_heads + kv_head) * block_size + t % block_size) * D + d]);
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g)
      if (g < group) acc[g] += scores[g * partition_size + (t - start)] * v;
  }
  for (int i = tid; i < group * D; i += blockDim.x) q_shared[i] = 0.0f;
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
    if (g < group) atomicAdd(&q_shared[g * D + d], acc[g]);
  __syncthreads();
  for (int i = tid; i < group * D; i += blockDim.x) {
    const long long head_split =
        (static_cast<long long>(seq) * num_heads + first_head + i / D) * num_splits + split;
    partial_out[head_split * D + i % D] = q_shared[i];
  }
}

template <typename T>
__device__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ partial_out,
                                    const float* __restrict__ partial_max,
                                    const float* __restrict__ partial_sum, int num_splits,
                                    int head_dim) {
  const int seq = blockIdx.x, head = blockIdx.y, num_heads = gridDim.y, d = threadIdx.x;
  const long long base = (static_cast<long long>(seq) * num_heads + head) * num_splits;
  float global_max = -INFINITY;
  for (int s = 0; s < num_splits; ++s) global_max = fmaxf(global_max, partial_max[base + s]);
  float denominator = 0.0f, value = 0.0f;
  for (int s = 0; s < num_splits; ++s) {
    const float weight = __expf(partial_max[base + s] - global_max);  // 0 for empty splits
    denominator += weight * partial_sum[base + s];
    value += weight * partial_out[(base + s) * head_dim + d];
  }
  out[(static_cast<long long>(seq) * num_heads + head) * head_dim + d] =
      from_float<T>(value / denominator);
}

#define DECODE_FOR_DIM(SUFFIX, T, D)                                                        \
  extern "C" __global__ void paged_decode_attention_##SUFFIX##_d##D(                        \
      float* partial_out, float* partial_max, float* partial_sum, const T* qkv,             \
      int row_stride, const T* key_cache, const T* value_cache, const int* block_tables,     \
      int max_blocks, const int* context_lens, int num_heads, int kv_heads, int block_size, \
      int partition_size, float scale) {                                                    \
    paged_decode_attention<T, D>(partial_out, partial_max, partial_sum, qkv, row_stride,    \
                                 key_cache, value_cache, block_tables, max_blocks,          \
                                 context_lens, num_heads, kv_heads, block_size,             \
                                 partition_size, scale);                                    \
  }
#define DECODE(SUFFIX, T)                                                                   \
  DECODE_FOR_DIM(SUFFIX, T, 32)                                                             \
  DECODE_FOR_DIM(SUFFIX, T, 64)                                                             \
  DECODE_FOR_DIM(SUFFIX, T, 128)                                                            \
  extern "C" __global__ void paged_decode_reduce_##SUFFIX(                                  \
      T* out, const float* partial_out, const float* partial_max, const float* partial_sum, \
      int num_splits, int head_dim) {                                                       \
    paged_decode_reduce<T>(out, partial_out, partial_max, partial_sum, num_splits, head_dim); \
  }
KVMESH_INSTANTIATE(DECODE)
