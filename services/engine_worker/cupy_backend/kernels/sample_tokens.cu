// Sampling on the GPU, one row of fp32 logits per block (1024 threads): the argmax for a row
// with temperature 0, else a draw from softmax(logits / T) after min-p, top-k and top-p, in that
// order and with the shared torch sampler's semantics (services/engine_worker/sampler.py):
//   w_i = exp((x_i - max) / T), so the most likely token has w = 1 and min-p keeps w_i >= min_p;
//   top-k keeps w_i >= the k-th largest w (ties kept); top-p keeps the smallest set of the
//   largest w whose mass, before each kept token, is at most top_p of the kept mass.
// Thresholds are found by bisection on the float's bits (positive floats order as their bits):
// no sort, one pass over the row per step. The draw is an inverse CDF in token order with one
// uniform from a counter-based generator keyed by (key, index): a seeded request's (seed,
// output index), so its token does not depend on the batch it sits in. Before any of it, a
// row's adjustments (penalties and logit bias, merged per token by the host) change its logits
// in place: x' = (x > 0 ? x / positive_divisor : x * negative_scale) + add. Every row's chosen token gets
// its log probability under the model's own (unadjusted) distribution, x - logsumexp(x): NaN
// when the row has a NaN or an infinity, which the runner fails the request for. A row that
// asks for its top N alternatives (N <= max_top) gets them in order, by logprob then lower id,
// one pass over the row each.
#include "common.cuh"

constexpr int kSampleThreads = 1024;

// One token's adjustment: repetition penalty as two scales, presence, frequency and bias as
// one addition (services/engine_worker/cupy_backend/device_sampling.py builds them).
struct Adjustment {
  int token;
  float positive_divisor, negative_scale, add;  // a repetition penalty p: p and p
};

// SplitMix64 of the key and index: 24 random bits as a float in [0, 1). Same in numpy
// (services/engine_worker/sampler.py counter_uniform).
__device__ __forceinline__ float counter_uniform(unsigned long long key, unsigned long long index) {
  unsigned long long z = key * 0x9E3779B97F4A7C15ull + index + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// The block's best (value, id) over the row's entries that rank after (after_value,
// after_id): larger values first, the lower id first among equal ones. Every thread gets it.
__device__ void best_after(const float* row, int vocab, float after_value, int after_id,
                           float* best_values, int* best_ids, float* value, int* id) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float best = -INFINITY;
  int best_id = 0x7fffffff;
  for (int i = tid; i < vocab; i += blockDim.x) {
    const float x = row[i];
    const bool after = x < after_value || (x == after_value && i > after_id);
    if (after && (x > best || best_id == 0x7fffffff)) {  // strided: ids only grow per thread
      best = x;
      best_id = i;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
    if (other > best || (other == best && other_id < best_id)) {
      best = other;
      best_id = other_id;
    }
  }
  __syncthreads();  // the previous call's result is read by every thread before this write
  if (lane == 0) {
    best_values[warp] = best;
    best_ids[warp] = best_id;
  }
  __syncthreads();
  best = best_values[0];
  best_id = best_ids[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
    if (best_values[w] > best || (best_values[w] == best && best_ids[w] < best_id)) {
      best = best_values[w];
      best_id = best_ids[w];
    }
  }
  *value = best;
  *id = best_id;
}

__device__ __forceinline__ float weight_of(float x, float row_max, float inv_t) {
  return __expf((x - row_max) * inv_t);
}

// Sum over the kept weights (w >= floor) of those >= threshold (count_only: how many).
__device__ float kept_mass(const float* row, int vocab, float row_max, float inv_t, float floor,
                           float threshold, bool count_only, bool strictly_above,
                           float* scratch) {
  float local = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float w = weight_of(row[i], row_max, inv_t);
    const bool counted = w >= floor && (strictly_above ? w > threshold : w >= threshold);
    if (counted) local += count_only ? 1.0f : w;
  }
  return block_reduce<false>(local, scratch);
}

extern "C" __global__ void __launch_bounds__(kSampleThreads)
    sample_tokens(float* __restrict__ logits, int vocab, const float* __restrict__ temperatures,
                  const int* __restrict__ top_ks, const float* __restrict__ top_ps,
                  const float* __restrict__ min_ps, const unsigned long long* __restrict__ keys,
                  const unsigned long long* __restrict__ indices,
                  const int* __restrict__ top_ns, const int* __restrict__ adjust_ends,
                  const Adjustment* __restrict__ adjustments, int max_top,
                  int* __restrict__ tokens, float* __restrict__ logprobs,
                  int* __restrict__ top_ids, float* __restrict__ top_logprobs) {
  __shared__ float best_values[32];
  __shared__ int best_ids[32];
  __shared__ float scratch[32];
  __shared__ float prefix[kSampleThreads];
  __shared__ int chosen;
  __shared__ float chosen_raw;
  const int r = blockIdx.x, tid = threadIdx.x;
  float* row = logits + static_cast<long long>(r) * vocab;

  // The unadjusted distribution: its maximum, log-sum-exp and top N.
  float raw_max;
  int raw_best;
  best_after(row, vocab, INFINITY, -1, best_values, best_ids, &raw_max, &raw_best);
  float local = 0.0f;
  for (int i = tid; i < vocab; i += blockDim.x) local += __expf(row[i] - raw_max);
  const float log_total = logf(block_reduce<false>(local, scratch));
  float after_value = INFINITY;
  int after_id = -1;
  const int top_n = min(top_ns[r], max_top);
  for (int j = 0; j < top_n; ++j) {
    best_after(row, vocab, after_value, after_id, best_values, best_ids, &after_value, &after_id);
    if (tid == 0) {
      top_ids[static_cast<long long>(r) * max_top + j] = after_id < vocab ? after_id : 0;
      top_logprobs[static_cast<long long>(r) * max_top + j] = after_value - raw_max - log_total;
    }
  }

  // Penalties and bias, in place; then the adjusted row's maximum.
  const int first_adjustment = r ? adjust_ends[r - 1] : 0, end_adjustment = adjust_ends[r];
  float row_max = raw_max;
  int best_id = raw_best;
  if (end_adjustment > first_adjustment) {
    __syncthreads();  // every thread is done reading the unadjusted row
    for (int a = first_adjustment + tid; a < end_adjustment; a += blockDim.x) {
      const Adjustment adjust = adjustments[a];
      const float x = row[adjust.token];
      // Each operation rounded on its own (no fused multiply-add), as torch computes them.
      const float scaled = x > 0.0f ? __fdiv_rn(x, adjust.positive_divisor)
                                    : __fmul_rn(x, adjust.negative_scale);
      row[adjust.token] = __fadd_rn(scaled, adjust.add);
    }
    __syncthreads();
    best_after(row, vocab, INFINITY, -1, best_values, best_ids, &row_max, &best_id);
  }
  if (tid == 0) chosen = best_id < vocab ? best_id : 0;  // a NaN row: token 0, NaN logprob
  __syncthreads();

  const float temperature = temperatures[r];
  if (temperature > 0.0f) {
    const float inv_t = 1.0f / temperature;
    float floor = min_ps[r];  // 0: min-p off
    const int top_k = top_ks[r];
    if (top_k > 0 && top_k < vocab &&
        kept_mass(row, vocab, row_max, inv_t, floor, floor, true, false, scratch) > top_k) {
      // The largest threshold that still keeps k: the k-th largest weight.
      unsigned lo = __float_as_uint(floor), hi = __float_as_uint(1.0f);
      while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        const float kept =
            kept_mass(row, vocab, row_max, inv_t, floor, __uint_as_float(mid), true, false, scratch);
        if (kept >= top_k) lo = mid; else hi = mid - 1;
      }
      floor = __uint_as_float(lo);
    }
    const float top_p = top_ps[r];
    if (top_p < 1.0f) {
      const float budget =
          top_p * kept_mass(row, vocab, row_max, inv_t, floor, floor, false, false, scratch);
      // The smallest threshold whose heavier tokens' mass is within the budget.
      unsigned lo = __float_as_uint(floor), hi = __float_as_uint(1.0f);
      while (lo < hi) {
        const unsigned mid = lo + (hi - lo) / 2;
        const float above =
            kept_mass(row, vocab, row_max, inv_t, floor, __uint_as_float(mid), false, true, scratch);
        if (above <= budget) hi = mid; else lo = mid + 1;
      }
      floor = __uint_as_float(lo);
    }
    // Inverse CDF in token order: each thread sums its contiguous chunk, a block-wide scan
    // places the chunks, the chunk holding the target walks to its token.
    const int chunk = (vocab + kSampleThreads - 1) / kSampleThreads;
    const int first = tid * chunk, end = min(first + chunk, vocab);
    float mine = 0.0f;
    for (int i = first; i < end; ++i) {
      const float w = weight_of(row[i], row_max, inv_t);
      if (w >= floor) mine += w;
    }
    prefix[tid] = mine;
    __syncthreads();
    for (int offset = 1; offset < kSampleThreads; offset <<= 1) {  // inclusive scan
      const float add = tid >= offset ? prefix[tid - offset] : 0.0f;
      __syncthreads();
      prefix[tid] += add;
      __syncthreads();
    }
    const float total = prefix[kSampleThreads - 1];
    const float target = counter_uniform(keys[r], indices[r]) * total;
    const float before = tid ? prefix[tid - 1] : 0.0f;
    if (mine > 0.0f && before <= target && (target < prefix[tid] || tid == kSampleThreads - 1 ||
                                            prefix[tid] >= total)) {
      float running = before;
      int last_kept = -1;
      for (int i = first; i < end; ++i) {
        const float w = weight_of(row[i], row_max, inv_t);
        if (w < floor) continue;
        last_kept = i;
        running += w;
        if (target < running) break;
      }
      chosen = last_kept;  // rounding past the end takes the chunk's last kept token
    }
    __syncthreads();
  }
  // The chosen token's unadjusted logit: undo its adjustment, if it had one.
  if (tid == 0) chosen_raw = row[chosen];
  __syncthreads();
  for (int a = first_adjustment + tid; a < end_adjustment; a += blockDim.x) {
    const Adjustment adjust = adjustments[a];
    if (adjust.token == chosen) {
      const float shifted = row[chosen] - adjust.add;  // the scales keep the sign
      chosen_raw = shifted > 0.0f ? shifted * adjust.positive_divisor
                                  : shifted / adjust.negative_scale;
    }
  }
  __syncthreads();
  if (tid == 0) {
    tokens[r] = chosen;
    logprobs[r] = chosen_raw - raw_max - log_total;
  }
}
