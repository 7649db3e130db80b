// out = x @ W.T for rows x [rows, in] and a bf16 weight W [out, in] on AVX2 CPUs without AVX512-BF16 (AMD Zen 2/3,
// Intel before Cooper Lake): there aten runs a bf16 linear as one dot product per output (cpublas, its AVX2 build),
// which reads a layer's weights at ~18 GB/s for one row but at under 1 GB/s for 16 rows (a Gemma-3-270M decode step
// of 16 rows ~330 ms, each weight row re-read and re-converted per row of x).
//
// aten's arithmetic there (ReducedPrecisionFloatGemvFastPathKernel, dot_with_fp32_arith, CPU_CAPABILITY_AVX2):
// eight float32 accumulators of 8 lanes; in-features e of each 64-element step feed accumulator e / 8, lane e % 8,
// by fused multiply-add, in order of the steps; then the accumulators are added as a tree (a[i] += a[i + 4], then
// +2, then +1) and the 8 lanes of the result likewise (lanes l and l + 4, then l + 2, then l + 1: vec_reduce_all's
// shuffles), a trailing + 0.0f (the empty tail's sum), and the float rounded to bf16 (nearest even).
// So each output is 64 independent chains (element c, c + 64, c + 128, ...) reduced by a fixed tree. This kernel
// computes those same chains with 16 OUTPUTS a vector pair instead: the weight is packed once (avx2_pack:
// packed[group][chain][step][16 outputs]) so a chain of 16 outputs streams contiguously, x's element is broadcast,
// and the weight vector, converted once, serves every row of a register block. Then the same tree, lane-wise.
// Requires in-features a multiple of 64 (no tail) and out-features a multiple of 16.
//
// Every output element depends only on its own row of x and of W, so a request decoded in a batch gets exactly
// what it gets alone, and a prompt's rows what they get in any split.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 16;   // outputs per packed group (two 8-lane vectors)
constexpr int64_t kChains = 64;  // aten's 8 accumulators x 8 lanes
constexpr int64_t kRowBlock = 6; // rows of x per register block (12 accumulators)
constexpr int64_t kRowChunk = 48; // rows of x whose float copy a task reads (L2), before the next chunk

// A packed line of 16 bf16 outputs holds output j in the low half of word j and output j + 8 in its high half, so
// each half becomes 8 floats in one instruction (a shift, a mask).
inline void bf16x16_to_f32(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// torch's float -> bf16 for 16 floats: round to nearest even, NaN to the quiet NaN 0x7FC0.
inline void store_bf16x16(__m256 lo, __m256 hi, uint16_t* out) {
  auto round = [](__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  };
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round(lo), round(hi)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

// packed[g][c][s][2 j + h] = W[16 g + 8 h + j][64 s + c] (bf16 bits; bf16x16_to_f32's interleaving).
at::Tensor avx2_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "avx2_pack: the weight must be a contiguous bf16 [out, in] tensor");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(out % kGroup == 0, "avx2_pack: out-features a multiple of 16 expected, got ", out);
  TORCH_CHECK(in % kChains == 0, "avx2_pack: in-features a multiple of 64 expected, got ", in);
  const int64_t steps = in / kChains, groups = out / kGroup;
  at::Tensor packed = at::empty({groups, kChains, steps, kGroup}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* pk = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < kChains; ++c)
        for (int64_t s = 0; s < steps; ++s)
          for (int64_t j = 0; j < kGroup; ++j)
            pk[((g * kChains + c) * steps + s) * kGroup + 2 * (j % 8) + j / 8] =
                w[(g * kGroup + j) * in + s * kChains + c];
  });
  return packed;
}

// Chains [c0, c0 + CH) of one 16-output group for R rows: sums[r][c][16], each chain from zero, steps in order.
// xt holds the R rows element-major (xt[e][r]), so each broadcast is at a fixed offset from one pointer.
template <int R, int CH>
inline void chains(const uint16_t* group, const float* xt, int64_t steps, int64_t c0, float* sums) {
  __m256 acc[R][CH][2];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < CH; ++k) acc[r][k][0] = acc[r][k][1] = _mm256_setzero_ps();
  const uint16_t* wp = group + c0 * steps * kGroup;
  const float* xp = xt + c0 * R;
  for (int64_t s = 0; s < steps; ++s, wp += kGroup, xp += kChains * R) {
    for (int k = 0; k < CH; ++k) {
      __m256 w0, w1;
      bf16x16_to_f32(wp + k * steps * kGroup, w0, w1);
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(xp + k * R + r);
        acc[r][k][0] = _mm256_fmadd_ps(b, w0, acc[r][k][0]);
        acc[r][k][1] = _mm256_fmadd_ps(b, w1, acc[r][k][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < CH; ++k) {
      _mm256_storeu_ps(sums + (r * kChains + c0 + k) * kGroup, acc[r][k][0]);
      _mm256_storeu_ps(sums + (r * kChains + c0 + k) * kGroup + 8, acc[r][k][1]);
    }
}

// aten's reduction of the 64 chains (accumulator a = c / 8, lane l = c % 8), half h (8 outputs) of the group.
inline __m256 tree(const float* sums, int h) {
  auto chain = [&](int a, int l) { return _mm256_loadu_ps(sums + (a * 8 + l) * kGroup + 8 * h); };
  __m256 lane[8];
  for (int l = 0; l < 8; ++l) {
    const __m256 t0 = _mm256_add_ps(chain(0, l), chain(4, l)), t1 = _mm256_add_ps(chain(1, l), chain(5, l));
    const __m256 t2 = _mm256_add_ps(chain(2, l), chain(6, l)), t3 = _mm256_add_ps(chain(3, l), chain(7, l));
    lane[l] = _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
  }
  const __m256 v0 = _mm256_add_ps(lane[0], lane[4]), v1 = _mm256_add_ps(lane[1], lane[5]);
  const __m256 v2 = _mm256_add_ps(lane[2], lane[6]), v3 = _mm256_add_ps(lane[3], lane[7]);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(v0, v2), _mm256_add_ps(v1, v3));
  return _mm256_add_ps(sum, _mm256_setzero_ps());  // aten adds the (empty) tail's sum
}

template <int R, int CH>
void block(const uint16_t* group, const float* xt, int64_t steps, uint16_t* out, int64_t out_stride) {
  alignas(32) float sums[R * kChains * kGroup];
  for (int64_t c0 = 0; c0 < kChains; c0 += CH) chains<R, CH>(group, xt, steps, c0, sums);
  for (int r = 0; r < R; ++r)
    store_bf16x16(tree(sums + r * kChains * kGroup, 0), tree(sums + r * kChains * kGroup, 1), out + r * out_stride);
}

// Rows [0, n) of one group, n <= kRowChunk, from xt (rows_element_major's layout): blocks of kRowBlock rows, then
// the rest with more chains a block (fewer rows, so more independent accumulators to hide the multiply-add latency).
void group_rows(const uint16_t* group, const float* xt, int64_t n, int64_t in, int64_t steps, uint16_t* out,
                int64_t out_stride) {
  int64_t r = 0;
  for (; r + kRowBlock <= n; r += kRowBlock) block<6, 1>(group, xt + r * in, steps, out + r * out_stride, out_stride);
  const float* x = xt + r * in;
  uint16_t* o = out + r * out_stride;
  switch (n - r) {
    case 1: block<1, 4>(group, x, steps, o, out_stride); break;
    case 2: block<2, 2>(group, x, steps, o, out_stride); break;
    case 3: block<3, 2>(group, x, steps, o, out_stride); break;
    case 4: block<4, 1>(group, x, steps, o, out_stride); break;
    case 5: block<5, 1>(group, x, steps, o, out_stride); break;
    default: break;
  }
}

// x as float, each block of kRowBlock rows (the last one shorter) element-major: block b's n rows at b * kRowBlock
// * in, element e of its row r at e * n + r.
at::Tensor rows_element_major(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor xf = x.contiguous().to(at::kFloat);  // exact
  at::Tensor xt = at::empty({rows, in}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = xt.data_ptr<float>();
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t n = std::min(kRowBlock, rows - r0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t e = 0; e < in; ++e) dst[r0 * in + e * n + r] = src[(r0 + r) * in + e];
  }
  return xt;
}

at::Tensor avx2_linear(const at::Tensor& packed, const at::Tensor& x, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == kChains && packed.size(3) == kGroup &&
              packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "avx2_linear: the weight must be packed by avx2_pack");
  const int64_t groups = packed.size(0), steps = packed.size(2), in = steps * kChains;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == at::kBFloat16,
              "avx2_linear: x must be bf16 [rows, ", in, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(out_features == groups * kGroup, "avx2_linear: out_features ", out_features,
              " does not match the packed weight's ", groups * kGroup);
  const int64_t rows = x.size(0);
  at::Tensor xt = rows_element_major(x);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const auto* pk = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* xp = xt.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Tasks are (row chunk, group); a chunk's groups run before the next chunk's, so a thread's x chunk stays in
  // its cache while the weight streams (decode: one chunk, every group once).
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, groups / (4 * at::get_num_threads())));
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t r0 = ch * kRowChunk, n = std::min(kRowChunk, rows - r0);
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        group_rows(pk + g * kChains * steps * kGroup, xp + r0 * in, n, in, steps, op + r0 * out_features + g * kGroup,
                   out_features);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_avx2, m) {
  m.def("avx2_pack(Tensor weight) -> Tensor", &avx2_pack);
  m.def("avx2_linear(Tensor packed, Tensor x, int out_features) -> Tensor", &avx2_linear);
}
