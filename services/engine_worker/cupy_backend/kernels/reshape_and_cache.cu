// KV write into the paged cache: each new token's K and V heads, read from the fused QKV row,
// go to its slot (block * block_size + offset). Cache layout per layer, K and V alike:
// (num_blocks, kv_heads, block_size, head_dim), so a block's positions of one head are
// contiguous rows for the attention kernels. A slot of -1 (a padded row of a captured CUDA
// graph) writes nothing. Grid: one block per token.
#include "common.cuh"

template <typename T>
__device__ void reshape_and_cache(T* __restrict__ key_cache, T* __restrict__ value_cache,
                                  const T* __restrict__ qkv, const long long* __restrict__ slots,
                                  int row_stride, int key_offset, int value_offset,
                                  int kv_heads, int head_dim, int block_size) {
  const long long slot = slots[blockIdx.x];
  if (slot < 0) return;
  const long long block = slot / block_size, position = slot % block_size;
  const T* row = qkv + static_cast<long long>(blockIdx.x) * row_stride;
  for (int item = threadIdx.x; item < kv_heads * head_dim; item += blockDim.x) {
    const int head = item / head_dim, d = item % head_dim;
    const long long target = ((block * kv_heads + head) * block_size + position) * head_dim + d;
    key_cache[target] = row[key_offset + item];
    value_cache[target] = row[value_offset + item];
  }
}

#define RESHAPE_AND_CACHE(SUFFIX, T)                                                        \
  extern "C" __global__ void reshape_and_cache_##SUFFIX(                                     \
      T* key_cache, T* value_cache, const T* qkv, const long long* slots, int row_stride,    \
      int key_offset, int value_offset, int kv_heads, int head_dim, int block_size) {        \
    reshape_and_cache<T>(key_cache, value_cache, qkv, slots, row_stride, key_offset,         \
                         value_offset, kv_heads, head_dim, block_size);                      \
  }
KVMESH_INSTANTIATE(RESHAPE_AND_CACHE)
