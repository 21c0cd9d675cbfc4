// Rotary embedding and the KV write in one pass over each token's fused QKV row: the QKV bias
// (optional) is added, Q and K heads are rotated in place (rotate_half / NeoX convention, as
// transformers' Llama), V is biased in place, and the token's K and V go to its cache slot
// (block * block_size + offset; -1 writes nothing). For i < D/2:
//   x[i]       = x[i] * cos - x[i + D/2] * sin
//   x[i + D/2] = x[i + D/2] * cos + x[i] * sin
// cos/sin: fp32 tables (max_positions, D/2) from the model's inverse frequencies, so default,
// linear and llama3 scaling are all in the table. Each value is rounded to T after the bias add
// and after the rotation, as separate bias, rotary and copy kernels would store it.
// K/V cache layout: (num_blocks, kv_heads, block_size, D). Grid: one block per token.
// Decode-only steps skip this kernel: decode attention does the same for its rows.
#include "common.cuh"

template <typename T>
__device__ void rotary_and_cache(T* __restrict__ qkv, const T* __restrict__ bias,
                                 const int* __restrict__ positions,
                                 const float* __restrict__ cos_table,
                                 const float* __restrict__ sin_table,
                                 const long long* __restrict__ slots, T* __restrict__ key_cache,
                                 T* __restrict__ value_cache, int row_stride, int num_heads,
                                 int kv_heads, int head_dim, int block_size) {
  const int half = head_dim / 2;
  const long long angle_row = static_cast<long long>(positions[blockIdx.x]) * half;
  const long long slot = slots[blockIdx.x];
  const long long cache_row =
      slot < 0 ? -1 : (slot / block_size * kv_heads) * block_size + slot % block_size;
  T* row = qkv + static_cast<long long>(blockIdx.x) * row_stride;
  for (int item = threadIdx.x; item < (num_heads + kv_heads) * half; item += blockDim.x) {
    const int head = item / half, i = item % half, column = head * head_dim + i;
    float x1 = to_float(row[column]), x2 = to_float(row[column + half]);
    if (bias != nullptr) {
      x1 = to_float(from_float<T>(x1 + to_float(bias[column])));
      x2 = to_float(from_float<T>(x2 + to_float(bias[column + half])));
    }
    const float c = cos_table[angle_row + i], s = sin_table[angle_row + i];
    const T r1 = from_float<T>(x1 * c - x2 * s), r2 = from_float<T>(x2 * c + x1 * s);
    row[column] = r1;
    row[column + half] = r2;
    if (head >= num_heads && cache_row >= 0) {
      const long long at =
          (cache_row + static_cast<long long>(head - num_heads) * block_size) * head_dim + i;
      key_cache[at] = r1;
      key_cache[at + half] = r2;
    }
  }
  const int v_start = (num_heads + kv_heads) * head_dim;
  for (int item = threadIdx.x; item < kv_heads * head_dim; item += blockDim.x) {
    const int column = v_start + item;
    T value = row[column];
    if (bias != nullptr) {
      value = from_float<T>(to_float(value) + to_float(bias[column]));
      row[column] = value;
    }
    if (cache_row >= 0) {
      const int head = item / head_dim, d = item % head_dim;
      value_cache[(cache_row + static_cast<long long>(head) * block_size) * head_dim + d] = value;
    }
  }
}

#define ROTARY_AND_CACHE(SUFFIX, T)                                                           \
  extern "C" __global__ void rotary_and_cache_##SUFFIX(                                       \
      T* qkv, const T* bias, const int* positions, const float* cos_table,                    \
      const float* sin_table, const long long* slots, T* key_cache, T* value_cache,           \
      int row_stride, int num_heads, int kv_heads, int head_dim, int block_size) {            \
    rotary_and_cache<T>(qkv, bias, positions, cos_table, sin_table, slots, key_cache,         \
                        value_cache, row_stride, num_heads, kv_heads, head_dim, block_size); \
  }
KVMESH_INSTANTIATE(ROTARY_AND_CACHE)
