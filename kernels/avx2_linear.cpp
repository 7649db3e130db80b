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
// computes those same chains with 16 OUTPUTS a vector pair instead: the weight is packed once (avx2_pack: groups of
// 16 outputs, four chains step by step) so the chains of 16 outputs stream in order, x's element is broadcast, and
// the weight vector, converted once, serves every row of a register block. Then the same tree, lane-wise.
// Requires in-features a multiple of 64 (no tail); a last group of fewer than 16 outputs is packed with zero rows.
//
// Every output element depends only on its own row of x and of W, so a request decoded in a batch gets exactly
// what it gets alone, and a prompt's rows what they get in any split.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;   // outputs per packed group (two 8-lane vectors)
constexpr int64_t kChains = 64;  // aten's 8 accumulators x 8 lanes
constexpr int64_t kQuad = 4;     // chains interleaved step by step in the packing (chains() takes 1, 2 or 4 at once)
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

// packed[g][c / 4][s][c % 4][2 j + h] = W[16 g + 8 h + j][64 s + c] (bf16 bits; bf16x16_to_f32's interleaving): four
// chains' lines step by step, so that a one-row block, which runs four chains at once, reads its weights in one
// sequential stream (with each chain contiguous, four streams of steps x 32 bytes: 72 layer products at 20.5 GB/s
// where 72 float32 sums of the same tensors read 27).
at::Tensor avx2_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "avx2_pack: the weight must be a contiguous bf16 [out, in] tensor");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % kChains == 0, "avx2_pack: in-features a multiple of 64 expected, got ", in);
  const int64_t steps = in / kChains, groups = (out + kGroup - 1) / kGroup;
  at::Tensor packed = at::empty({groups, kChains / kQuad, steps, kQuad * kGroup}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* pk = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t c = 0; c < kChains; ++c)
        for (int64_t s = 0; s < steps; ++s)
          for (int64_t j = 0; j < kGroup; ++j)
            pk[(((g * kChains + c - c % kQuad) * steps + s * kQuad) + c % kQuad) * kGroup + 2 * (j % 8) + j / 8] =
                g * kGroup + j < out ? w[(g * kGroup + j) * in + s * kChains + c] : 0;
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
  const uint16_t* wp = group + ((c0 - c0 % kQuad) * steps + c0 % kQuad) * kGroup;
  const float* xp = xt + c0 * R;
  for (int64_t s = 0; s < steps; ++s, wp += kQuad * kGroup, xp += kChains * R) {
    for (int k = 0; k < CH; ++k) {
      __m256 w0, w1;
      bf16x16_to_f32(wp + k * kGroup, w0, w1);
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
// * in, element e of its row r at e * n + r. One pass from x's bf16 bits (a bf16 is a float's upper half: exact).
at::Tensor rows_element_major(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor xt = at::empty({rows, in}, x.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(xt.data_ptr());
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t n = std::min(kRowBlock, rows - r0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t e = 0; e < in; ++e) dst[r0 * in + e * n + r] = static_cast<uint32_t>(src[(r0 + r) * in + e]) << 16;
  }
  return xt;
}

at::Tensor avx2_linear(const at::Tensor& packed, const at::Tensor& x, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) == kChains / kQuad && packed.size(3) == kQuad * kGroup &&
              packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "avx2_linear: the weight must be packed by avx2_pack");
  const int64_t groups = packed.size(0), steps = packed.size(2), in = steps * kChains;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == at::kBFloat16,
              "avx2_linear: x must be bf16 [rows, ", in, "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t width = groups * kGroup;  // the last group's outputs past out_features are the packing's zero rows
  TORCH_CHECK(out_features <= width && out_features > width - kGroup, "avx2_linear: out_features ", out_features,
              " does not match the packed weight's ", groups, " groups of 16");
  const int64_t rows = x.size(0);
  at::Tensor xt = rows_element_major(x);
  at::Tensor out = at::empty({rows, width}, x.options());
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
        group_rows(pk + g * kChains * steps * kGroup, xp + r0 * in, n, in, steps, op + r0 * width + g * kGroup, width);
    });
  }
  return width == out_features ? out : out.narrow(1, 0, out_features).contiguous();
}


// ---- The LM head's int8 screen on AVX2 (greedy_screen.h has the method, x's int16 row and the bounds) -------------

#include "greedy_screen.h"  // screen_pack, the bounds, x's quantization and the candidates' filter

constexpr int64_t kLanes = 8;  // vocabulary rows a vector
constexpr int64_t kAvx2ScreenMaxRows = 16;

// screen_pack's int8 head as vectors of 8 rows, two in-features at a time (packed[v][pair][lane] holds q[8 v +
// lane][2 pair] in its low byte and q[8 v + lane][2 pair + 1] in its high one; zero past the vocabulary, never
// kept), so that one 16-byte load widened to int16 pairs up with x's int16 pair broadcast to every lane; and the stats.
std::vector<at::Tensor> screen_pack_avx2(const at::Tensor& weight) {
  std::vector<at::Tensor> qs = screen_pack(weight);
  const int64_t out = weight.size(0), in = weight.size(1), vectors = (out + kLanes - 1) / kLanes;
  at::Tensor rows = at::zeros({vectors * kLanes, in}, qs[0].options());
  rows.narrow(0, 0, out).copy_(qs[0]);
  at::Tensor packed = rows.view({vectors, kLanes, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return {packed.view(at::kShort).view({vectors, in / 2, kLanes}), qs[1]};
}

inline __m256i first_lanes(int64_t n) {  // all ones in lanes [0, n)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min(n, kLanes))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// ScreenSink's estimates, bounds and filter 8 vocabulary rows a vector (as bf16_linear.cpp's VectorSink does 16):
// x row r's exact sums q.p arrive as an int32 vector straight from the accumulators; its bound is the smaller of
// quantize_fine's two, with slack for float32's rounding of the estimate whatever order the compiler picks.
struct VectorSink {
  const float* st;  // [kStats, vocab]
  int64_t vocab;
  ScreenResult& result;
  const std::vector<FineBound>& rows;
  std::vector<float> best;
  std::vector<std::array<float, 3>> kept;

  VectorSink(const float* stats, int64_t vocab_rows, const std::vector<FineBound>& x_rows, ScreenResult& out)
      : st(stats), vocab(vocab_rows), result(out), rows(x_rows), best(x_rows.size(), -INFINITY) {}

  __m256 stat(Stat field, int64_t o, __m256i valid) const { return _mm256_maskload_ps(st + field * vocab + o, valid); }

  __m256 terms(Stat err, float x_norm, Stat size, float rest, int64_t o, __m256i valid) const {
    return _mm256_add_ps(_mm256_mul_ps(stat(err, o, valid), _mm256_set1_ps(x_norm)),
                         _mm256_mul_ps(stat(size, o, valid), _mm256_set1_ps(rest)));
  }

  // x row r's sums for vocabulary rows [o, o + 8), of which `valid` exist: estimates +- the bound, the row's best
  // lower bound so far, and the vocabulary rows whose upper bound reaches it less the margin.
  void lane(__m256i sums, int64_t r, int64_t o, __m256i valid) {
    const FineBound& x = rows[r];
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(x.a), _mm256_cvtepi32_ps(sums));
    const __m256 scale = stat(kScale, o, valid);
    const __m256 est = _mm256_mul_ps(scale, t);
    const __m256 size = _mm256_mul_ps(scale, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t));
    const __m256 weights = _mm256_min_ps(terms(kErr, x.x_l1, kL1, x.rest, o, valid),
                                         terms(kErr2, x.xn, kL2, x.en, o, valid));
    const __m256 all = _mm256_add_ps(weights, _mm256_mul_ps(stat(kWmax, o, valid), _mm256_set1_ps(x.g)));
    const __m256 slack = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(1e-5f), size), _mm256_set1_ps(1e-30f));
    const __m256 bound = _mm256_add_ps(_mm256_mul_ps(all, _mm256_set1_ps(1.0f + 1e-5f)), slack);
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY), in = _mm256_castsi256_ps(valid);
    const __m256 lo = _mm256_blendv_ps(neg_inf, _mm256_sub_ps(est, bound), in);
    const __m256 hi = _mm256_blendv_ps(neg_inf, _mm256_add_ps(est, bound), in);
    best[r] = std::max(best[r], lanes_max(lo));
    const __m256 reach = _mm256_cmp_ps(hi, _mm256_set1_ps(margin_floor(best[r])), _CMP_GE_OQ);
    const int hits = _mm256_movemask_ps(_mm256_and_ps(reach, in));
    if (!hits) return;
    alignas(32) float his[kLanes];
    _mm256_store_ps(his, hi);
    keep_hits(kept, r, o, static_cast<uint32_t>(hits), his);
  }

  void done() { result.merge(best, kept); }
};

// Vocabulary vectors [v, v + G) against x's rows col0 .. col0 + C - 1 (`vpmaddwd`: int8 head widened to int16, x's
// int16 pair broadcast; exact int32 sums) into total. G x C accumulators, G head vectors and a broadcast stay within
// the 16 registers (as in bf16_linear.cpp, accumulators indexed only at compile time stay in registers). `prefetch`:
// the same line of the next call's vectors into L2; off for a second pass over vectors still in L1.
template <int G, int C>
__attribute__((noinline)) void screen_sums(const int16_t* packed, int64_t pairs, const int32_t* xs, int64_t v,
                                           int64_t col0, bool prefetch, int32_t total[G][C][kLanes]) {
  __m256i acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < C; ++k) acc[g][k] = _mm256_setzero_si256();
  for (int64_t i = 0; i < pairs; ++i) {
    __m256i wv[G];
    for (int g = 0; g < G; ++g) {
      const int16_t* line = packed + ((v + g) * pairs + i) * kLanes;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(line + G * pairs * kLanes), _MM_HINT_T1);
      wv[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
    }
    for (int k = 0; k < C; ++k) {
      const __m256i xb = _mm256_set1_epi32(xs[(col0 + k) * pairs + i]);
      for (int g = 0; g < G; ++g) acc[g][k] = _mm256_add_epi32(acc[g][k], _mm256_madd_epi16(wv[g], xb));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < C; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(total[g][k]), acc[g][k]);
}

// Vocabulary vectors [v, v + G) against C columns of x from col0 (`cols` of them real rows), their sums to the sink.
template <int G, int C>
void screen_block(const int16_t* packed, int64_t pairs, const int32_t* xs, int64_t v, int64_t col0, int64_t cols,
                  VectorSink& sink) {
  alignas(32) int32_t total[G][C][kLanes];
  screen_sums<G, C>(packed, pairs, xs, v, col0, col0 == 0, total);
  for (int g = 0; g < G; ++g) {
    const int64_t o = (v + g) * kLanes;
    const __m256i valid = first_lanes(sink.vocab - o);
    for (int64_t k = 0; k < cols; ++k)
      sink.lane(_mm256_load_si256(reinterpret_cast<const __m256i*>(total[g][k])), col0 + k, o, valid);
  }
}

// `count` vectors from v against every row of x: 1, 2 or 4 columns with 4 or 2 vectors a block; from 5 rows, one
// vector against 8 columns at a time (the second pass over a vector still in L1).
template <int C>
void screen_vectors(const int16_t* packed, int64_t pairs, const int32_t* xs, int64_t v, int64_t count, int64_t rows,
                    VectorSink& sink) {
  constexpr int G = C <= 2 ? 4 : C <= 4 ? 2 : 1;
  for (int64_t g = 0; g < count; g += G) {
    for (int64_t col0 = 0; col0 < rows; col0 += C) {
      const int64_t cols = std::min<int64_t>(C, rows - col0);
      if (count - g >= G) screen_block<G, C>(packed, pairs, xs, v + g, col0, cols, sink);
      else for (int64_t h = g; h < count; ++h) screen_block<1, C>(packed, pairs, xs, v + h, col0, cols, sink);
    }
  }
}

at::Tensor greedy_screen_avx2(const at::Tensor& packed, const at::Tensor& stats, const at::Tensor& x) {
  check_screen(packed, stats, x, kLanes, at::kShort, 2, kAvx2ScreenMaxRows);
  const int64_t vocab = stats.size(1), pairs = packed.size(1), vectors = packed.size(0), in = x.size(1);
  const int64_t rows = x.size(0), columns = rows <= 2 ? rows : rows <= 4 ? 4 : (rows + 7) / 8 * 8;
  at::Tensor xq = at::zeros({columns, in}, x.options().dtype(at::kShort));  // pad columns: zero, never read out
  std::vector<FineBound> bounds;
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  const float gamma = screen_gamma(in);
  for (int64_t r = 0; r < rows; ++r)
    bounds.push_back(quantize_fine(xp + r * in, in, xq.data_ptr<int16_t>() + r * in, gamma, int16_levels(in)));
  ScreenResult result;
  result.best.assign(rows, -INFINITY);
  const auto* pk = reinterpret_cast<const int16_t*>(packed.data_ptr());
  const auto* xs = reinterpret_cast<const int32_t*>(xq.data_ptr());
  constexpr int64_t kStep = 8;  // vectors a step
  at::parallel_for(0, (vectors + kStep - 1) / kStep, 64, [&](int64_t begin, int64_t end) {
    VectorSink sink(stats.data_ptr<float>(), vocab, bounds, result);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t v = s * kStep, count = std::min(kStep, vectors - v);
      switch (columns) {
        case 1: screen_vectors<1>(pk, pairs, xs, v, count, rows, sink); break;
        case 2: screen_vectors<2>(pk, pairs, xs, v, count, rows, sink); break;
        case 4: screen_vectors<4>(pk, pairs, xs, v, count, rows, sink); break;
        default: screen_vectors<8>(pk, pairs, xs, v, count, rows, sink); break;
      }
    }
    sink.done();
  });
  return screen_candidates(result, x.options());  // [candidates, 2]: (row of x, vocabulary row)
}

int64_t greedy_screen_rows() { return kAvx2ScreenMaxRows; }

}  // namespace

TORCH_LIBRARY(inferscale_avx2, m) {
  m.def("avx2_pack(Tensor weight) -> Tensor", &avx2_pack);
  m.def("avx2_linear(Tensor packed, Tensor x, int out_features) -> Tensor", &avx2_linear);
  m.def("screen_pack(Tensor weight) -> Tensor[]", &screen_pack_avx2);
  m.def("greedy_screen(Tensor packed, Tensor stats, Tensor x) -> Tensor", &greedy_screen_avx2);
  m.def("greedy_screen_rows() -> int", &greedy_screen_rows);
}
