// kvmesh::int8_dot: x (M, K) float32 times int8 rows -> (M, N) float32, as llama.cpp's Q8_0 x
// Q8_0 dot products compute: each group of 32 activations rounded to int8 by its own scale
// (quantize_row, shared with int4_dot.cpp), int8 products summed exactly in int32 by
// AVX512-VNNI, one float multiply-add per group for its scale, and the row's own scale at the end.
//
// Layout (int8_dot.py packs it): weights (N/16, K/32, 8, 64) uint8 holding w + 128 (VNNI takes
// one operand unsigned), where zmm c of a group holds in bytes 4i..4i+3 row i's inputs
// 4c..4c+3; the offset comes back out as 128 * the group's sum of int8 activations. Row scales
// (N,) float32.
//
// Row-exact like int4_dot: every (row, output) is the same instruction sequence whatever M and
// the thread count. VNNI only: without it a pair of (w + 128) * x products overflows the int16
// sums of the older instructions, so such CPUs keep fbgemm's int8 rows (int8_dot.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace kvmesh_dot {
void quantize_row(const float* x, int64_t k, int8_t* q, float* scale, float* scaled_sum);
}  // namespace kvmesh_dot

#ifdef __AVX512VNNI__
namespace {

constexpr int kGroup = 32;
constexpr int kRows = 16;  // output rows a zmm holds
constexpr int kTile = 4;   // activation rows sharing one load of a block's weights

// `T` activation rows times one block of 16 output rows.
template <int T>
void block(const int8_t* q, const float* scale, const float* scaled_sum, int64_t k,
           const uint8_t* weights, const float* row_scale, float* out, int64_t n) {
  const int64_t groups = k / kGroup;
  __m512 acc[T];
  for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512i dot[T];
    for (int t = 0; t < T; t++) dot[t] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
      const __m512i w = _mm512_loadu_si512(weights + (g * 8 + c) * 64);
      for (int t = 0; t < T; t++) {
        int32_t x;
        std::memcpy(&x, q + t * k + g * kGroup + c * 4, 4);
        dot[t] = _mm512_dpbusd_epi32(dot[t], w, _mm512_set1_epi32(x));
      }
    }
    for (int t = 0; t < T; t++) {
      const int64_t at = t * groups + g;
      const __m512 offset = _mm512_set1_ps(128.f * scaled_sum[at]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_set1_ps(scale[at]), acc[t]);
      acc[t] = _mm512_sub_ps(acc[t], offset);
    }
  }
  const __m512 rows = _mm512_loadu_ps(row_scale);
  for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * n, _mm512_mul_ps(acc[t], rows));
}

at::Tensor int8_dot(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& row_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_dot: x must be (M, K) float32");
  TORCH_CHECK(weights.dim() == 4 && weights.size(2) == 8 && weights.size(3) == 64,
              "int8_dot: weights must be (N/16, K/32, 8, 64)");
  const at::Tensor rows = x.contiguous(), scales = row_scales.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), blocks = weights.size(0), n = blocks * kRows;
  const int64_t groups = k / kGroup;
  TORCH_CHECK(weights.size(1) == groups && k % kGroup == 0, "int8_dot: K does not match");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == n,
              "int8_dot: row_scales must be (N,) float32");
  std::vector<int8_t> q(m * k);
  std::vector<float> scale(m * groups), scaled_sum(m * groups);
  const float* xp = rows.data_ptr<float>();
  for (int64_t r = 0; r < m; r++) {
    kvmesh_dot::quantize_row(xp + r * k, k, &q[r * k], &scale[r * groups], &scaled_sum[r * groups]);
  }
  at::Tensor out = at::empty({m, n}, rows.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = weights.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t block_bytes = groups * 8 * 64;
  // Blocks outside, row tiles inside: a block's weights (9 KiB for K = 576) are read from memory
  // once whatever M, where a head of 49152 rows is ~28 MiB.
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; b++) {
      const uint8_t* w = wp + b * block_bytes;
      for (int64_t r = 0; r < m; r += kTile) {
        const int64_t t = std::min<int64_t>(kTile, m - r);
        const int8_t* qr = &q[r * k];
        const float* sr = &scale[r * groups];
        const float* ur = &scaled_sum[r * groups];
        float* o = op + r * n + b * kRows;
        const float* rs = sp + b * kRows;
        switch (t) {
          case 1: block<1>(qr, sr, ur, k, w, rs, o, n); break;
          case 2: block<2>(qr, sr, ur, k, w, rs, o, n); break;
          case 3: block<3>(qr, sr, ur, k, w, rs, o, n); break;
          default: block<4>(qr, sr, ur, k, w, rs, o, n); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("int8_dot", int8_dot); }
#endif
