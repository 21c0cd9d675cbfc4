// SwiGLU's elementwise half: out[t, i] = silu(gate[t, i]) * up[t, i], with the fused
// gate_up projection's row holding gate (first I) then up (next I). fp32 math.
// Grid: one block per token.
#include "common.cuh"

template <typename T>
__device__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inner) {
  const T* row = gate_up + static_cast<long long>(blockIdx.x) * 2 * inner;
  T* target = out + static_cast<long long>(blockIdx.x) * inner;
  for (int i = threadIdx.x; i < inner; i += blockDim.x) {
    const float gate = to_float(row[i]);
    // Rounded to T before the product, as torch computes silu(gate) * up in T.
    const float activated = to_float(from_float<T>(gate / (1.0f + __expf(-gate))));
    target[i] = from_float<T>(activated * to_float(row[inner + i]));
  }
}

#define SILU_AND_MUL(SUFFIX, T)                                                             \
  extern "C" __global__ void silu_and_mul_##SUFFIX(T* out, const T* gate_up, int inner) {   \
    silu_and_mul<T>(out, gate_up, inner);                                                   \
  }
KVMESH_INSTANTIATE(SILU_AND_MUL)
