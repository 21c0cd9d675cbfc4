// Rotary embedding in place on the Q and K heads of the fused QKV rows (rotate_half / NeoX
// convention, as transformers' Llama): for i < D/2,
//   x[i]       = x[i] * cos - x[i + D/2] * sin
//   x[i + D/2] = x[i + D/2] * cos + x[i] * sin
// cos/sin: fp32 tables (max_positions, D/2) from the model's inverse frequencies, so default,
// linear and llama3 scaling are all in the table. Grid: one block per token.
#include "common.cuh"

template <typename T>
__device__ void rotary(T* __restrict__ qkv, const int* __restrict__ positions,
                       const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                       int row_stride, int num_rotated_heads, int head_dim) {
  const int half = head_dim / 2;
  const long long table_row = static_cast<long long>(positions[blockIdx.x]) * half;
  T* row = qkv + static_cast<long long>(blockIdx.x) * row_stride;
  for (int item = threadIdx.x; item < num_rotated_heads * half; item += blockDim.x) {
    const int head = item / half, i = item % half;
    T* x = row + head * head_dim;
    const float c = cos_table[table_row + i], s = sin_table[table_row + i];
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}

#define ROTARY(SUFFIX, T)                                                                  \
  extern "C" __global__ void rotary_##SUFFIX(T* qkv, const int* positions,                 \
                                             const float* cos_table, const float* sin_table, \
                                             int row_stride, int num_rotated_heads,        \
                                             int head_dim) {                               \
    rotary<T>(qkv, positions, cos_table, sin_table, row_stride, num_rotated_heads, head_dim); \
  }
KVMESH_INSTANTIATE(ROTARY)
