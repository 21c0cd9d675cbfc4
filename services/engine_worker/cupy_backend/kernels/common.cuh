// Shared by every kernel: the 16-bit types, conversions through fp32, and reductions.
// Every kernel is instantiated per storage type as extern "C" <name>_<f32|f16|bf16>, so the
// Python launchers look kernels up by name without C++ name mangling.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC compiles without the C math headers
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Sum (or max) over the whole thread block; every thread gets the result. `scratch` holds one
// float per warp. blockDim.x must be a multiple of 32.
template <bool kMax>
__device__ float block_reduce(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  value = kMax ? warp_max(value) : warp_sum(value);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
  return kMax ? warp_max(value) : warp_sum(value);
}

#define KVMESH_INSTANTIATE(MACRO) \
  MACRO(f32, float)               \
  MACRO(f16, __half)              \
  MACRO(bf16, __nv_bfloat16)
