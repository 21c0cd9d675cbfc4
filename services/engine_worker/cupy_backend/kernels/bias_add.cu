// out[t, j] += bias[j] (Qwen2's q/k/v biases; cuBLAS writes the product, this adds the bias).
// Grid: one block per row.
#include "common.cuh"

template <typename T>
__device__ void bias_add(T* __restrict__ out, const T* __restrict__ bias, int columns) {
  T* row = out + static_cast<long long>(blockIdx.x) * columns;
  for (int j = threadIdx.x; j < columns; j += blockDim.x)
    row[j] = from_float<T>(to_float(row[j]) + to_float(bias[j]));
}

#define BIAS_ADD(SUFFIX, T)                                                               \
  extern "C" __global__ void bias_add_##SUFFIX(T* out, const T* bias, int columns) {      \
    bias_add<T>(out, bias, columns);                                                      \
  }
KVMESH_INSTANTIATE(BIAS_ADD)
