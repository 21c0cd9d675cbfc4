// RMSNorm fused with what comes before it in a decoder:
//   add_rms_norm:   residual[r] += delta[r] (when delta is given; rounded to T, as torch adds)
//   embed_rms_norm: residual[r] = table[ids[r]] * scale (the embedding gather of the first
//                   layer; Gemma scales it by sqrt(hidden), rounded to T, else scale is 1)
// then out[r] = weight * (T)(residual[r] * rsqrt(mean(residual[r]^2) + eps)).
//   head_rms_norm:  the same over each of a fused QKV row's first `heads` heads, in place,
//                   head h with weight row h (Qwen3's q_norm and k_norm before the rotary).
// `rows` (optional) works on residual row rows[r] instead of r: the last layer's add and the
// final norm over only the rows that sample. fp32 accumulation. Grid: one block per output row.
#include "common.cuh"

template <typename T>
__device__ void normalize_row(T* __restrict__ target, const T* __restrict__ row,
                              const T* __restrict__ weight, int hidden, float sum_squares,
                              float eps) {
  __shared__ float scratch[32];
  const float inv_rms = rsqrtf(block_reduce<false>(sum_squares, scratch) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T normed = from_float<T>(to_float(row[i]) * inv_rms);
    target[i] = from_float<T>(to_float(normed) * to_float(weight[i]));
  }
}

template <typename T>
__device__ void add_rms_norm(T* __restrict__ out, T* __restrict__ residual,
                             const T* __restrict__ delta, const T* __restrict__ weight,
                             const int* __restrict__ rows, int hidden, float eps) {
  const long long source = static_cast<long long>(rows ? rows[blockIdx.x] : blockIdx.x) * hidden;
  T* row = residual + source;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float value;
    if (delta != nullptr) {
      const T added = from_float<T>(to_float(row[i]) + to_float(delta[source + i]));
      row[i] = added;
      value = to_float(added);
    } else {
      value = to_float(row[i]);
    }
    sum_squares += value * value;
  }
  normalize_row(out + static_cast<long long>(blockIdx.x) * hidden, row, weight, hidden,
                sum_squares, eps);
}

template <typename T>
__device__ void embed_rms_norm(T* __restrict__ out, T* __restrict__ residual,
                               const T* __restrict__ table, const int* __restrict__ ids,
                               const T* __restrict__ weight, int hidden, float eps,
                               float scale) {
  const T* embedded = table + static_cast<long long>(ids[blockIdx.x]) * hidden;
  T* row = residual + static_cast<long long>(blockIdx.x) * hidden;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T value = from_float<T>(to_float(embedded[i]) * scale);
    row[i] = value;
    sum_squares += to_float(value) * to_float(value);
  }
  normalize_row(out + static_cast<long long>(blockIdx.x) * hidden, row, weight, hidden,
                sum_squares, eps);
}

template <typename T>
__device__ void head_rms_norm(T* __restrict__ qkv, const T* __restrict__ weight, int heads,
                              int dim, int row_width, float eps) {
  const long long token = blockIdx.x / heads;
  const int head = blockIdx.x % heads;
  T* x = qkv + token * row_width + static_cast<long long>(head) * dim;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float value = to_float(x[i]);
    sum_squares += value * value;
  }
  // In place: each thread writes only the values it read.
  normalize_row(x, x, weight + static_cast<long long>(head) * dim, dim, sum_squares, eps);
}

#define RMS_NORM(SUFFIX, T)                                                                \
  extern "C" __global__ void add_rms_norm_##SUFFIX(T* out, T* residual, const T* delta,    \
                                                   const T* weight, const int* rows,       \
                                                   int hidden, float eps) {                \
    add_rms_norm<T>(out, residual, delta, weight, rows, hidden, eps);                      \
  }                                                                                        \
  extern "C" __global__ void embed_rms_norm_##SUFFIX(T* out, T* residual, const T* table,  \
                                                     const int* ids, const T* weight,      \
                                                     int hidden, float eps, float scale) { \
    embed_rms_norm<T>(out, residual, table, ids, weight, hidden, eps, scale);              \
  }                                                                                        \
  extern "C" __global__ void head_rms_norm_##SUFFIX(T* qkv, const T* weight, int heads,    \
                                                    int dim, int row_width, float eps) {   \
    head_rms_norm<T>(qkv, weight, heads, dim, row_width, eps);                             \
  }
KVMESH_INSTANTIATE(RMS_NORM)
