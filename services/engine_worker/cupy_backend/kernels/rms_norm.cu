// RMSNorm fused with the residual add, as each decoder layer uses it twice:
//   residual[r] += delta[r]            (when delta is given; rounded to T, as torch adds)
//   out[r] = weight * (T)(residual[r] * rsqrt(mean(residual[r]^2) + eps))
// `rows` (optional) works on residual row rows[r] instead of r: the last layer's add and the
// final norm over only the rows that sample. fp32 accumulation. Grid: one block per output row.
#include "common.cuh"

template <typename T>
__device__ void add_rms_norm(T* __restrict__ out, T* __restrict__ residual,
                             const T* __restrict__ delta, const T* __restrict__ weight,
                             const int* __restrict__ rows, int hidden, float eps) {
  __shared__ float scratch[32];
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
  const float inv_rms = rsqrtf(block_reduce<false>(sum_squares, scratch) / hidden + eps);
  T* target = out + static_cast<long long>(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T normed = from_float<T>(to_float(row[i]) * inv_rms);
    target[i] = from_float<T>(to_float(normed) * to_float(weight[i]));
  }
}

#define RMS_NORM(SUFFIX, T)                                                              \
  extern "C" __global__ void add_rms_norm_##SUFFIX(T* out, T* residual, const T* delta,  \
                                                   const T* weight, const int* rows,     \
                                                   int hidden, float eps) {              \
    add_rms_norm<T>(out, residual, delta, weight, rows, hidden, eps);                    \
  }
KVMESH_INSTANTIATE(RMS_NORM)
