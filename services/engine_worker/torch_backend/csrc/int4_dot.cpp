// kvmesh::int4_dot: x (M, K) float32 times 4-bit groups of 32 -> (M, N) float32, as llama.cpp's
// Q4_1 x Q8_1 dot products compute: each group of 32 activations rounded to int8 by its own
// scale (max |x| -> 127), nibbles times int8 summed exactly in int32 (AVX512-VNNI), then one
// float multiply-add per group for its scales. Weights are laid out for 16 output rows per zmm
// lane set, so a group's 32 inputs for 16 rows are 8 VNNI instructions and no horizontal sums.
//
// Layout (int4_dot.py packs it): nibbles (N/16, K/32, 4, 64) uint8, where zmm c of a group holds
// in bytes 4i..4i+3 row i's inputs 8c..8c+3 (low nibbles) and 8c+4..8c+7 (high nibbles);
// scales and mins (N/16, K/32, 16) float16: w = scale * q + min.
//
// A row's result never depends on the other rows of its call: every (row, output) is the same
// instruction sequence in the same order, whatever M and the thread count. Built without the
// AVX-512 flags (an AVX2 CPU), the same layout runs 8 rows to a ymm, with the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kGroup = 32;
constexpr int kRows = 16;   // output rows a zmm holds
constexpr int kTile = 4;    // activation rows sharing one pass over the weights

#ifdef __AVX512F__
// u8 x s8 products, four to an int32 lane, added to acc: one VNNI instruction; without VNNI
// (Skylake-class AVX-512) pairs summed to int16, then to int32. Both are exact: a pair is at most
// 2 * 15 * 127 = 3810, so the two give the same bits.
inline __m512i dot_add(__m512i acc, __m512i nibbles, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, nibbles, x);
#else
  const __m512i pairs = _mm512_maddubs_epi16(nibbles, x);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
#else
// AVX2 (built without AVX-512 flags): the same exact sums, 8 output rows to a ymm.
inline __m256i dot_add(__m256i acc, __m256i nibbles, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(nibbles, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float largest_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

}  // namespace

namespace kvmesh_dot {

// One row: int8 per group, the group's scale, and scale * sum of its int8 values (the mins' term).
// A NaN or infinity in a group makes its scale non-finite, so the row's outputs are NaN, as a
// float GEMM's would be (the sampler fails such a row alone). int8_dot.cpp rounds rows with it too.
#ifdef __AVX512F__
void quantize_row(const float* x, int64_t k, int8_t* q, float* scale, float* scaled_sum) {
  for (int64_t g = 0; g < k / kGroup; g++) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroup);
    const __m512 b = _mm512_loadu_ps(x + g * kGroup + 16);
    const bool nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float top = nan ? std::numeric_limits<float>::quiet_NaN() : largest;
    const __m512 inverse = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // nearest, ties even
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    scale[g] = top / 127.f;
    scaled_sum[g] = scale[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}
#else
void quantize_row(const float* x, int64_t k, int8_t* q, float* scale, float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < k / kGroup; g++) {
    __m256 v[4];
    __m256 top4 = _mm256_setzero_ps();
    int unordered = 0;
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + g * kGroup + 8 * i);
      unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      top4 = _mm256_max_ps(top4, _mm256_andnot_ps(sign, v[i]));
    }
    const float top = unordered ? std::numeric_limits<float>::quiet_NaN() : largest_of(top4);
    const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i total = _mm256_setzero_si256();
    alignas(32) int32_t rounded[kGroup];
    for (int i = 0; i < 4; i++) {
      const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // nearest, ties even
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + 8 * i), r);
      total = _mm256_add_epi32(total, r);
    }
    for (int i = 0; i < kGroup; i++) q[g * kGroup + i] = static_cast<int8_t>(rounded[i]);
    scale[g] = top / 127.f;
    scaled_sum[g] = scale[g] * static_cast<float>(sum_of(total));
  }
}
#endif

}  // namespace kvmesh_dot

namespace {

using kvmesh_dot::quantize_row;

#ifdef __AVX512F__
// `T` activation rows times one block of 16 output rows.
template <int T>
void block(const int8_t* q, const float* scale, const float* scaled_sum, int64_t k,
           const uint8_t* nibbles, const uint16_t* scales, const uint16_t* mins, float* out,
           int64_t n) {
  const int64_t groups = k / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512i dot[T];
    for (int t = 0; t < T; t++) dot[t] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
      const __m512i packed = _mm512_loadu_si512(nibbles + (g * 4 + c) * 64);
      const __m512i lo = _mm512_and_si512(packed, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      for (int t = 0; t < T; t++) {
        const int8_t* x = q + t * k + g * kGroup + c * 8;
        int32_t first, second;
        std::memcpy(&first, x, 4);
        std::memcpy(&second, x + 4, 4);
        dot[t] = dot_add(dot[t], lo, _mm512_set1_epi32(first));
        dot[t] = dot_add(dot[t], hi, _mm512_set1_epi32(second));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kRows)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * kRows)));
    for (int t = 0; t < T; t++) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(scale[t * groups + g]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), ds, acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(scaled_sum[t * groups + g]), acc[t]);
    }
  }
  for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * n, acc[t]);
}
#else
// AVX2: each half of a block (8 output rows, 32 bytes of each 64-byte chunk) in turn; the float
// operations per output are the AVX-512 path's, so a row's bits are the same on both.
template <int T>
void block(const int8_t* q, const float* scale, const float* scaled_sum, int64_t k,
           const uint8_t* nibbles, const uint16_t* scales, const uint16_t* mins, float* out,
           int64_t n) {
  const int64_t groups = k / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; h++) {
    __m256 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m256i dot[T];
      for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
      for (int c = 0; c < 4; c++) {
        const __m256i packed =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + (g * 4 + c) * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(packed, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int t = 0; t < T; t++) {
          const int8_t* x = q + t * k + g * kGroup + c * 8;
          int32_t first, second;
          std::memcpy(&first, x, 4);
          std::memcpy(&second, x + 4, 4);
          dot[t] = dot_add(dot[t], lo, _mm256_set1_epi32(first));
          dot[t] = dot_add(dot[t], hi, _mm256_set1_epi32(second));
        }
      }
      const auto* at = reinterpret_cast<const __m128i*>(scales + g * kRows + h * 8);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(at));
      const __m256 m = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kRows + h * 8)));
      for (int t = 0; t < T; t++) {
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(scale[t * groups + g]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), ds, acc[t]);
        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(scaled_sum[t * groups + g]), acc[t]);
      }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + t * n + h * 8, acc[t]);
  }
}
#endif

at::Tensor int4_dot(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                    const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_dot: x must be (M, K) float32");
  TORCH_CHECK(nibbles.dim() == 4 && nibbles.size(2) == 4 && nibbles.size(3) == 64,
              "int4_dot: nibbles must be (N/16, K/32, 4, 64)");
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), blocks = nibbles.size(0), n = blocks * kRows;
  const int64_t groups = k / kGroup;
  TORCH_CHECK(nibbles.size(1) == groups && k % kGroup == 0, "int4_dot: K does not match");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              "int4_dot: scales and mins must be float16");
  std::vector<int8_t> q(m * k);
  std::vector<float> scale(m * groups), scaled_sum(m * groups);
  const float* xp = rows.data_ptr<float>();
  for (int64_t r = 0; r < m; r++) {
    quantize_row(xp + r * k, k, &q[r * k], &scale[r * groups], &scaled_sum[r * groups]);
  }
  at::Tensor out = at::empty({m, n}, rows.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = nibbles.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr());
  const int64_t block_bytes = groups * 4 * 64, block_pairs = groups * kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = 0; r < m; r += kTile) {
      const int64_t t = std::min<int64_t>(kTile, m - r);
      const int8_t* qr = &q[r * k];
      const float* sr = &scale[r * groups];
      const float* ur = &scaled_sum[r * groups];
      for (int64_t b = first; b < last; b++) {
        const uint8_t* w = wp + b * block_bytes;
        const uint16_t* s = sp + b * block_pairs;
        const uint16_t* z = mp + b * block_pairs;
        float* o = op + r * n + b * kRows;
        switch (t) {
          case 1: block<1>(qr, sr, ur, k, w, s, z, o, n); break;
          case 2: block<2>(qr, sr, ur, k, w, s, z, o, n); break;
          case 3: block<3>(qr, sr, ur, k, w, s, z, o, n); break;
          default: block<4>(qr, sr, ur, k, w, s, z, o, n); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("int4_dot", int4_dot); }
