// Embedding gather: out[t, :] = table[ids[t], :]. Grid: one block per token.
#include "common.cuh"

template <typename T>
__device__ void embedding(T* __restrict__ out, const T* __restrict__ table,
                          const int* __restrict__ ids, int hidden) {
  const long long row = static_cast<long long>(ids[blockIdx.x]) * hidden;
  T* target = out + static_cast<long long>(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) target[i] = table[row + i];
}

#define EMBEDDING(SUFFIX, T)                                                        \
  extern "C" __global__ void embedding_##SUFFIX(T* out, const T* table, const int* ids, \
                                                int hidden) {                      \
    embedding<T>(out, table, ids, hidden);                                          \
  }
KVMESH_INSTANTIATE(EMBEDDING)
