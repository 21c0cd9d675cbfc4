// Greedy sampling on the GPU: per row of fp32 logits, the argmax (the lowest id among equal
// maxima, as torch.argmax) and its log probability, max - logsumexp. Only these two numbers
// per row cross to the host, not the (rows, vocab) logits. Rows that sample with temperature,
// penalties, a response format or top-N logprobs go to the shared torch sampler instead: its
// seeded per-request generators make a request's tokens the same on every backend.
// Grid: one block per row, a power-of-two number of threads (1024).
#include "common.cuh"

extern "C" __global__ void greedy_sample(const float* __restrict__ logits, int vocab,
                                         int* __restrict__ tokens, float* __restrict__ logprobs) {
  __shared__ float best_values[32];
  __shared__ int best_ids[32];
  __shared__ float scratch[32];
  const float* row = logits + static_cast<long long>(blockIdx.x) * vocab;
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float value = row[i];
    if (value > best) {  // strictly greater: a thread keeps its lowest id among ties
      best = value;
      best_id = i;
    }
  }
  // Warp, then block: the larger value wins, the lower id on a tie.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
    if (other > best || (other == best && other_id < best_id)) {
      best = other;
      best_id = other_id;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    best_values[warp] = best;
    best_ids[warp] = best_id;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < warps ? best_values[lane] : -INFINITY;
    best_id = lane < warps ? best_ids[lane] : 0x7fffffff;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (other > best || (other == best && other_id < best_id)) {
        best = other;
        best_id = other_id;
      }
    }
    if (lane == 0) {
      best_values[0] = best;
      best_ids[0] = best_id;
    }
  }
  __syncthreads();
  const float row_max = best_values[0];
  float local = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) local += __expf(row[i] - row_max);
  const float total = block_reduce<false>(local, scratch);
  if (threadIdx.x == 0) {
    tokens[blockIdx.x] = best_ids[0];
    logprobs[blockIdx.x] = -logf(total);  // log softmax of the max: (max - max) - log(total)
  }
}
