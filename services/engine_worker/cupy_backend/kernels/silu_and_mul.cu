// SwiGLU's elementwise half: out[t, i] = silu(gate[t, i]) * up[t, i], with the fused
// gate_up projection's row holding gate (first I) then up (next I); GeGLU's (Gemma) with
// gelu's tanh approximation in place of silu. fp32 math. Grid: one block per token.
#include "common.cuh"

struct Silu {
  __device__ float operator()(float x) const { return x / (1.0f + __expf(-x)); }
};
struct GeluTanh {  // 0.7978845608 = sqrt(2 / pi)
  __device__ float operator()(float x) const {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  }
};

template <typename T, typename Activation>
__device__ void activate_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int inner) {
  const T* row = gate_up + static_cast<long long>(blockIdx.x) * 2 * inner;
  T* target = out + static_cast<long long>(blockIdx.x) * inner;
  for (int i = threadIdx.x; i < inner; i += blockDim.x) {
    // Rounded to T before the product, as torch computes act(gate) * up in T.
    const float activated = to_float(from_float<T>(Activation()(to_float(row[i]))));
    target[i] = from_float<T>(activated * to_float(row[inner + i]));
  }
}

#define GATED(SUFFIX, T)                                                                      \
  extern "C" __global__ void silu_and_mul_##SUFFIX(T* out, const T* gate_up, int inner) {     \
    activate_and_mul<T, Silu>(out, gate_up, inner);                                           \
  }                                                                                           \
  extern "C" __global__ void gelu_tanh_and_mul_##SUFFIX(T* out, const T* gate_up, int inner) { \
    activate_and_mul<T, GeluTanh>(out, gate_up, inner);                                       \
  }
KVMESH_INSTANTIATE(GATED)
