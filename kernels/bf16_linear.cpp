// out = x @ W.T for rows x [rows, in] and a bf16 weight W [out, in] on AVX512-BF16 CPUs without AMX (AMD Zen 4 and
// later): decode's few-row products, where oneDNN reads the weights at ~10 GB/s on one thread (issue 22; the LM
// head alone 30-35 ms of a 68 ms step against 34 GB/s the machine reads).
//
// oneDNN's arithmetic here (avx512_core_bf16, found by probing F.linear with cancelling +-2^24 weights): each output
// is fed the in-features pair by pair in order by `vdpbf16ps` (the odd element of a pair first, each sum rounded to
// fp32), in chains of `chain` in-features that start from zero (512 for most shapes; bf16_linear.py finds the
// length per in-features and row count), the chains added in order, the sum rounded to bf16 once.
// This kernel does exactly that, with 16 outputs a vector: W's rows are transposed 16 x 16 words at a time (a word is
// one in-features pair) so that a vector holds one pair of 16 outputs, and x's pair is broadcast. The output rows
// are split over torch's own thread pool (at::parallel_for) and the next unit's weights prefetched. The loader uses
// it only for a weight shape where its outputs are bit for bit F.linear's (checked at load: oneDNN splits the
// in-features differently for some shapes and row counts).
//
// Every output element depends only on its own row of x and of W, so a request decoded in a batch gets exactly
// what it gets alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;       // outputs per vector
constexpr int64_t kUnit = 64;        // outputs per task step (4 vectors)
constexpr int64_t kMaxRows = 8;      // activation rows per register block

// Rows r[0..15] of 16 words -> out[p] holding word p of every row (lane j = row j).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + e], 128-bit lane L: rows 4i..4i+3, word 4L + e
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v2 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i w = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), w2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v, w, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v, w, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v2, w2, 0xDD);
  }
}

struct Product {
  const uint32_t* w;  // [out_features, pairs] bf16 pairs
  const uint32_t* x;  // [rows, pairs]
  c10::BFloat16* out;  // [rows, out_features]
  int64_t pairs, out_features, rows;
  int64_t chain_pairs;  // in-features pairs per chain
};

// Outputs [o, o + kUnit) as [pairs][kUnit] words in tw (rows past out_features read as zero), prefetching the
// next unit's weights as it goes.
void transpose_unit(const Product& p, int64_t o, uint32_t* tw) {
  const uint32_t zero[kLanes] = {};
  const int64_t next = o + kUnit;
  for (int64_t g = 0; g < kUnit / kLanes; ++g) {
    for (int64_t c = 0; c < p.pairs; c += kLanes) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t row = o + g * kLanes + j;
        r[j] = _mm512_loadu_si512(row < p.out_features ? p.w + row * p.pairs + c : zero);
        const int64_t ahead = next + g * kLanes + j;
        if (ahead < p.out_features) _mm_prefetch(reinterpret_cast<const char*>(p.w + ahead * p.pairs + c), _MM_HINT_T0);
      }
      transpose16(r);
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(tw + (c + q) * kUnit + g * kLanes, r[q]);
    }
  }
}

// G vectors of outputs (starting at vector v0 of the unit) for R activation rows starting at row r0.
template <int G, int R>
void block(const Product& p, const uint32_t* tw, int64_t o, int64_t v0, int64_t r0) {
  __m512 sum[G][R], chain[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) sum[g][r] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < p.pairs; c0 += p.chain_pairs) {
    const int64_t c1 = std::min(p.pairs, c0 + p.chain_pairs);
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) chain[g][r] = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; ++c) {
      __m512bh xb[R];
      for (int r = 0; r < R; ++r) xb[r] = (__m512bh)_mm512_set1_epi32(p.x[(r0 + r) * p.pairs + c]);
      for (int g = 0; g < G; ++g) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(tw + c * kUnit + (v0 + g) * kLanes);
        for (int r = 0; r < R; ++r) chain[g][r] = _mm512_dpbf16_ps(chain[g][r], wv, xb[r]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) sum[g][r] = _mm512_add_ps(sum[g][r], chain[g][r]);
  }
  for (int g = 0; g < G; ++g) {
    const int64_t first = o + (v0 + g) * kLanes;
    if (first >= p.out_features) break;
    const __mmask16 keep = static_cast<__mmask16>(
        p.out_features - first >= kLanes ? 0xFFFF : (1u << (p.out_features - first)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(sum[g][r]);  // round to nearest even, as oneDNN stores
      _mm256_mask_storeu_epi16(p.out + (r0 + r) * p.out_features + first, keep, b);
    }
  }
}

// Every activation row for the unit's outputs: few rows take several vectors at once (independent chains keep
// the dpbf16 pipeline busy), more rows one vector at a time.
template <int R>
void rows_block(const Product& p, const uint32_t* tw, int64_t o, int64_t r0) {
  constexpr int G = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  for (int64_t v = 0; v < kUnit / kLanes; v += G) block<G, R>(p, tw, o, v, r0);
}

void unit_product(const Product& p, const uint32_t* tw, int64_t o) {
  for (int64_t r0 = 0; r0 < p.rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.rows - r0)) {
      case 1: rows_block<1>(p, tw, o, r0); break;
      case 2: rows_block<2>(p, tw, o, r0); break;
      case 3: rows_block<3>(p, tw, o, r0); break;
      case 4: rows_block<4>(p, tw, o, r0); break;
      case 5: rows_block<5>(p, tw, o, r0); break;
      case 6: rows_block<6>(p, tw, o, r0); break;
      case 7: rows_block<7>(p, tw, o, r0); break;
      default: rows_block<8>(p, tw, o, r0); break;
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& weight, const at::Tensor& x, int64_t chain) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2, "bf16_linear: weight [out, in] and x [rows, in] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(weight.is_contiguous() && x.is_contiguous(), "bf16_linear: contiguous operands only");
  TORCH_CHECK(weight.size(1) == x.size(1), "bf16_linear: in-features differ: ", weight.size(1), " vs ", x.size(1));
  TORCH_CHECK(weight.size(1) % 32 == 0, "bf16_linear: in-features must be a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1, "bf16_linear: no rows");
  TORCH_CHECK(chain >= 2 && chain % 2 == 0, "bf16_linear: chain must be a positive even number of in-features");
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  const Product p{reinterpret_cast<const uint32_t*>(weight.data_ptr()), reinterpret_cast<const uint32_t*>(x.data_ptr()),
                  out.data_ptr<c10::BFloat16>(), weight.size(1) / 2, weight.size(0), x.size(0), chain / 2};
  const int64_t units = (p.out_features + kUnit - 1) / kUnit;
  // At least ~64 KB of weights per task: a small layer is split once per thread, not into many hand-offs.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kUnit * p.pairs * 4));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> tw(static_cast<size_t>(p.pairs * kUnit));
    for (int64_t u = begin; u < end; ++u) {
      transpose_unit(p, u * kUnit, tw.data());
      unit_product(p, tw.data(), u * kUnit);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_bf16, m) {
  m.def("bf16_linear(Tensor weight, Tensor x, int chain) -> Tensor", &bf16_linear);
}
