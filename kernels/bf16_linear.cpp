// out = x @ W.T for rows x [rows, in] and a bf16 weight W [out, in] on AVX512-BF16 CPUs without AMX (AMD Zen 4 and
// later): decode's few-row products, where oneDNN reads the weights at ~10 GB/s on one thread (issue 22; the LM
// head alone 30-35 ms of a 68 ms step against 34 GB/s the machine reads).
//
// oneDNN's arithmetic here (avx512_core_bf16, found by probing F.linear with cancelling +-2^24 weights): each output
// is fed the in-features pair by pair in order by `vdpbf16ps` (the odd element of a pair first, each sum rounded to
// fp32), in chains of `chain` in-features that start from zero (512 for most shapes; bf16_linear.py finds the
// length per in-features and row count), the chains added in order, the sum rounded to bf16 once.
// This kernel does exactly that, with 16 outputs a vector: the weight is packed once (bf16_pack: W's rows transposed
// 16 x 16 words at a time, a word being one in-features pair) so that a vector holds one pair of 16 outputs, and
// x's pair is broadcast. The packed copy costs the weight's bytes again, once; transposing on the fly instead held
// one core to ~10 GB/s (shuffles and a round trip through L2), under a third of what it reads. The output rows are
// split over torch's own thread pool (parallel_stealing.h: at::parallel_for's parts, taken over by a thread done
// with its own). The loader uses
// it only for a weight shape where its outputs are bit for bit F.linear's (checked at load: oneDNN splits the
// in-features differently for some shapes and row counts).
//
// Every output element depends only on its own row of x and of W, so a request decoded in a batch gets exactly
// what it gets alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/bitwise_xor.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "parallel_stealing.h"

namespace {

#include "avx512_transpose.h"

constexpr int64_t kLanes = 16;       // outputs per vector
constexpr int64_t kUnit = 64;        // outputs per task step (4 vectors)
constexpr int64_t kMaxRows = 8;      // activation rows per register block

// The first min(n, 16) lanes of a vector (n >= 1): where a row's end falls inside it.
inline __mmask16 first_lanes(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Rows [rows, words] of 32-bit words (a bf16 pair, or four int8) as `vectors` vectors of 16 rows, word by word:
// packed[v][word][lane] is word `word` of row 16 v + lane, zero past the rows. Words must be a multiple of 16.
at::Tensor pack_vectors(const at::Tensor& rows_of_words, int64_t rows, int64_t words, int64_t vectors) {
  at::Tensor packed = at::empty({vectors, words, kLanes}, rows_of_words.options().dtype(at::kInt));
  const auto* w = reinterpret_cast<const uint32_t*>(rows_of_words.data_ptr());
  auto* pk = reinterpret_cast<uint32_t*>(packed.data_ptr());
  const uint32_t zero[kLanes] = {};
  at::parallel_for(0, vectors, 16, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      for (int64_t c = 0; c < words; c += kLanes) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) {
          const int64_t row = v * kLanes + j;
          r[j] = _mm512_loadu_si512(row < rows ? w + row * words + c : zero);
        }
        transpose16(r);
        for (int q = 0; q < 16; ++q) _mm512_storeu_si512(pk + (v * words + c + q) * kLanes, r[q]);
      }
    }
  });
  return packed;
}

// W [out, in] as vectors of 16 outputs, pair by pair (pack_vectors), the number of vectors rounded up to
// kUnit / kLanes.
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_pack: a contiguous bf16 weight [out, in] expected");
  TORCH_CHECK(weight.size(1) % 32 == 0, "bf16_pack: in-features must be a multiple of 32");
  const int64_t out_features = weight.size(0);
  return pack_vectors(weight, out_features, weight.size(1) / 2, (out_features + kUnit - 1) / kUnit * (kUnit / kLanes));
}

struct Product {
  const uint32_t* packed;  // bf16_pack's layout
  const uint32_t* x;       // [rows, pairs]
  c10::BFloat16* out;      // [rows, out_features]
  int64_t pairs, out_features, rows;
  int64_t chain_pairs;  // in-features pairs per chain
};

// G vectors of outputs from vector v for R activation rows from row r0: a chain per (vector, row) in registers,
// the chains' running sums on the stack (touched once a chain).
template <int G, int R>
void block(const Product& p, int64_t v, int64_t r0) {
  alignas(64) float sum[G][R][kLanes] = {};
  const uint32_t* w = p.packed + v * p.pairs * kLanes;
  for (int64_t c0 = 0; c0 < p.pairs; c0 += p.chain_pairs) {
    const int64_t c1 = std::min(p.pairs, c0 + p.chain_pairs);
    __m512 chain[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) chain[g][r] = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; ++c) {
      __m512bh xb[R];
      for (int r = 0; r < R; ++r) xb[r] = (__m512bh)_mm512_set1_epi32(p.x[(r0 + r) * p.pairs + c]);
      for (int g = 0; g < G; ++g) {
        // the next block's line into L2, as the screen does: a one-row decode step 17.5 -> 16.3 ms at 34 GB/s
        _mm_prefetch(reinterpret_cast<const char*>(w + ((g + G) * p.pairs + c) * kLanes), _MM_HINT_T1);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (g * p.pairs + c) * kLanes);
        for (int r = 0; r < R; ++r) chain[g][r] = _mm512_dpbf16_ps(chain[g][r], wv, xb[r]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(sum[g][r], _mm512_add_ps(_mm512_load_ps(sum[g][r]), chain[g][r]));
  }
  for (int g = 0; g < G; ++g) {
    const int64_t first = (v + g) * kLanes;
    if (first >= p.out_features) break;
    const __mmask16 keep = first_lanes(p.out_features - first);
    for (int r = 0; r < R; ++r) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sum[g][r]));  // nearest even, as oneDNN stores
      _mm256_mask_storeu_epi16(p.out + (r0 + r) * p.out_features + first, keep, b);
    }
  }
}

// Every activation row for the unit of kUnit outputs from vector v: up to 4 rows four vectors at once (independent
// chains keep the dpbf16 pipeline busy), more rows two vectors at once, 8 rows a block (9-16 rows: unit_product).
template <int R>
void rows_block(const Product& p, int64_t v, int64_t r0) {
  constexpr int G = R <= 4 ? 4 : 2;
  for (int64_t g = 0; g < kUnit / kLanes; g += G) block<G, R>(p, v + g, r0);
}

// 9-12 rows (a decode step's): one vector at a time against every row, so each weight vector is read once for all
// of them. Two blocks of 8 rows read the unit from memory with half the products to hide it, then again from L2:
// 126 Gemma-3-270M products at 9 rows 5.79 -> 5.01 ms, and at 16 rows 6.26 -> 5.51 on that host (Zen 4, 2026-12-05,
// medians of 9 interleaved; the same bits, as each output's chain is its own either way; 13-16 rows: below).
template <int R>
void all_rows_block(const Product& p, int64_t v) {
  for (int64_t g = 0; g < kUnit / kLanes; ++g) block<1, R>(p, v + g, 0);
}

// 13-16 rows: the first kFirstRows two vectors at a time (the unit from memory, with 20 chains of products to hide
// it), then the other 3-6 all four vectors at once from L2. One vector against 13-16 rows takes a broadcast of x per
// product, and its 16 chains with their 16 broadcasts outgrow the 32 registers. On a later 2-core Zen 4 host whose
// two cores run float32 GEMM 1.6x one, 72 Gemma-3-270M products (18 layers' distinct weights, 2026-12-05, medians
// of 11 interleaved): 16 rows 10.9-11.9 -> 8.7-9.7 ms, 15 rows 10.6-10.9 -> 9.1, 14 rows 9.6 -> 8.2, 13 rows 8.7 ->
// 8.1, and a real 16-row decode step 33.8 -> 31.9 and 34.9 -> 32.9 ms (~195 steady steps each, the two alternating
// step by step). Two blocks of 8 rows took 9.8-11.1 ms at 16 rows; 12 then 4 rows 9.6; 14 then 2 spilled (13.5).
constexpr int kFirstRows = 10;

template <int R>
void first_rows_then_rest(const Product& p, int64_t v) {
  rows_block<kFirstRows>(p, v, 0);
  block<4, R - kFirstRows>(p, v, kFirstRows);  // four vectors at once for 5-6 rows too (rows_block takes two there)
}

void unit_product(const Product& p, int64_t v) {
  switch (p.rows) {
    case 9: return all_rows_block<9>(p, v);
    case 10: return all_rows_block<10>(p, v);
    case 11: return all_rows_block<11>(p, v);
    case 12: return all_rows_block<12>(p, v);
    case 13: return first_rows_then_rest<13>(p, v);
    case 14: return first_rows_then_rest<14>(p, v);
    case 15: return first_rows_then_rest<15>(p, v);
    case 16: return first_rows_then_rest<16>(p, v);
    default: break;
  }
  for (int64_t r0 = 0; r0 < p.rows; r0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.rows - r0)) {
      case 1: rows_block<1>(p, v, r0); break;
      case 2: rows_block<2>(p, v, r0); break;
      case 3: rows_block<3>(p, v, r0); break;
      case 4: rows_block<4>(p, v, r0); break;
      case 5: rows_block<5>(p, v, r0); break;
      case 6: rows_block<6>(p, v, r0); break;
      case 7: rows_block<7>(p, v, r0); break;
      default: rows_block<8>(p, v, r0); break;
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& packed, const at::Tensor& x, int64_t chain, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kLanes &&
              packed.size(0) % (kUnit / kLanes) == 0 && packed.is_contiguous(),
              "bf16_linear: a weight packed by bf16_pack expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear: contiguous bf16 x [rows, in] expected");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "bf16_linear: in-features differ: ", packed.size(1) * 2, " vs ",
              x.size(1));
  TORCH_CHECK(out_features > packed.size(0) * kLanes - kUnit && out_features <= packed.size(0) * kLanes,
              "bf16_linear: out_features ", out_features, " does not match the packed weight");
  TORCH_CHECK(x.size(0) >= 1, "bf16_linear: no rows");
  TORCH_CHECK(chain >= 2 && chain % 2 == 0, "bf16_linear: chain must be a positive even number of in-features");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const Product p{reinterpret_cast<const uint32_t*>(packed.data_ptr()), reinterpret_cast<const uint32_t*>(x.data_ptr()),
                  out.data_ptr<c10::BFloat16>(), x.size(1) / 2, out_features, x.size(0), chain / 2};
  const int64_t units = packed.size(0) / (kUnit / kLanes);
  // At least ~64 KB of weights a grain: a small layer is not cut into many hand-offs (parallel_stealing.h).
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kUnit * p.pairs * 4));
  parallel_stealing(0, units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) unit_product(p, u * (kUnit / kLanes));
  });
  return out;
}


// The screened candidates' exact logits (models/greedyhead.py): for each (row of x, vocabulary row) of `candidates`
// [n, 2] (int64, a row's candidates together), x[row] . weight[vocab] with bf16_linear's arithmetic above (pairs in
// order, each the odd element first, chains of `chain` in-features from zero added in order, rounded to bf16 once),
// so each is the full head's logit there bit for bit, read straight from the bf16 head. Before, the candidates' rows
// were gathered, packed and multiplied by every row of x (16 rows x every row's candidates): on the 2-core Zen 4
// machine, 62 real 16-row steps (a median of 1,922 candidates, max 23,872), 0.75 ms a step past the screen, 2.05 in
// the six with the most; this way 0.39 and 0.62. Here 16 candidates of one row share a vector: their weight rows, 16
// pairs at a time, transposed in registers (as bf16_pack transposes them once), x's pair broadcast.
at::Tensor bf16_rescore(const at::Tensor& weight, const at::Tensor& x, const at::Tensor& candidates, int64_t chain) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
              weight.size(1) % 32 == 0, "bf16_rescore: a contiguous bf16 weight [vocab, in], in a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == weight.size(1),
              "bf16_rescore: contiguous bf16 x [rows, in] of the weight's in-features expected");
  TORCH_CHECK(candidates.dim() == 2 && candidates.size(1) == 2 && candidates.scalar_type() == at::kLong &&
              candidates.is_contiguous(), "bf16_rescore: contiguous int64 candidates [n, 2] expected");
  TORCH_CHECK(chain >= 2 && chain % 2 == 0, "bf16_rescore: chain must be a positive even number of in-features");
  const int64_t n = candidates.size(0), pairs = weight.size(1) / 2, chain_pairs = chain / 2;
  const int64_t* cand = candidates.data_ptr<int64_t>();
  std::vector<int64_t> starts;  // runs of up to 16 candidates of one row: a vector each
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(cand[2 * i] >= 0 && cand[2 * i] < x.size(0) && cand[2 * i + 1] >= 0 &&
                cand[2 * i + 1] < weight.size(0), "bf16_rescore: candidate ", i, " is outside x or the weight");
    if (i == 0 || cand[2 * i] != cand[2 * i - 2] || i - starts.back() == kLanes) starts.push_back(i);
  }
  starts.push_back(n);
  at::Tensor out = at::empty({n}, x.options());
  const auto* w = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(starts.size()) - 1, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = starts[g], count = starts[g + 1] - first;
      const uint32_t* rows[kLanes];
      for (int64_t l = 0; l < kLanes; ++l)  // lanes past the run read its first row; their sums are not stored
        rows[l] = w + cand[2 * (first + (l < count ? l : 0)) + 1] * pairs;
      const uint32_t* xr = xp + cand[2 * first] * pairs;
      __m512 sum = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
      for (int64_t c0 = 0; c0 < pairs; c0 += kLanes) {
        __m512i r[kLanes];
        for (int l = 0; l < kLanes; ++l) r[l] = _mm512_loadu_si512(rows[l] + c0);
        transpose16(r);  // r[q]: pair c0 + q of the 16 rows
        for (int q = 0; q < kLanes; ++q) {
          const int64_t c = c0 + q;
          if (c > 0 && c % chain_pairs == 0) {  // a chain ends: added to the sum, the next starts from zero
            sum = _mm512_add_ps(sum, acc);
            acc = _mm512_setzero_ps();
          }
          acc = _mm512_dpbf16_ps(acc, (__m512bh)r[q], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[c])));
        }
      }
      sum = _mm512_add_ps(sum, acc);
      _mm256_mask_storeu_epi16(op + first, first_lanes(count), (__m256i)_mm512_cvtneps_pbh(sum));
    }
  });
  return out;
}

// ---- The LM head's int8 screen on AVX512-VNNI (greedy_screen.h has the method and its bounds) ------------------

#include "greedy_screen.h"  // screen_pack, the bounds and the candidates' filter

// screen_pack's int8 head as vectors of 16 rows, quad by quad (packed[v][quad][lane]: in-features 4 quad .. 4 quad
// + 3 of row 16 v + lane; zero rows past the vocabulary), as unsigned bytes q + 128, and its stats. `vpdpbusd`
// multiplies unsigned by signed bytes: the head goes in unsigned and x's int8 rows signed, so that x is the operand
// the instruction broadcasts from memory (no register a column), and 128 times each row of x's sum comes off.
std::vector<at::Tensor> screen_pack_vnni(const at::Tensor& weight) {
  std::vector<at::Tensor> qs = screen_pack(weight);
  const at::Tensor unsigned_q = at::bitwise_xor(qs[0], -128);  // the bits of q + 128 as a byte
  const int64_t out = unsigned_q.size(0), in = unsigned_q.size(1);
  return {pack_vectors(unsigned_q, out, in / 4, (out + kLanes - 1) / kLanes), qs[1]};
}

// The wide screen's row of x (5-16 rows a step, where two int8 rows each cost as many products as the bf16 head):
// one int8 row, x ~ a p1, and a Cauchy-Schwarz bound, |w.x - s q.(a p1)| = |(w - s q).x + s q.(x - a p1)| <=
// |w - s q|_2 |x|_2 + |s q|_2 |x - a p1|_2 (screen_pack's kErr2 and kL2): on real Gemma-3-270M final hidden rows it
// leaves a median of ~150 of the 262,144 vocabulary rows (p90 ~860), where the L1 x max bound of the two-row screen
// with one int8 row would leave ~450 (p90 ~2,400). Its factors are greedy_screen.h's quantize_fine with 127 levels.
// ScreenSink's estimates, bounds and filter with 16 vocabulary rows a vector: the sums of one row of x arrive as
// int32 vectors (p1, p2; the wide screen's p1 alone) straight from the accumulators, so a vocabulary row costs a few
// vector lanes instead of a transposed store and a scalar pass (the scalar sink was a quarter of the screen's time on
// Zen 4). The two-row bound is ScreenSink::tile's, term for term; the slack covers float32's rounding whatever order
// the compiler picks.
struct VectorSink {
  const float* st;  // [kStats, vocab]
  int64_t vocab;
  ScreenResult& result;
  std::vector<RowBound> rows;   // the two-row screen's
  std::vector<FineBound> wide;  // the wide screen's (its L2 bound)
  std::vector<float> best;
  std::vector<__m512> best_lanes;  // per row of x: the lanes' best lower bounds since the last refresh()
  std::vector<std::array<float, 3>> kept;

  VectorSink(const float* stats, int64_t vocab_rows, int64_t x_rows, ScreenResult& out)
      : st(stats), vocab(vocab_rows), result(out), best(x_rows, -INFINITY),
        best_lanes(x_rows, _mm512_set1_ps(-INFINITY)) {}

  __m512 stat(Stat field, int64_t o, __mmask16 valid) const {
    return _mm512_maskz_loadu_ps(valid, st + field * vocab + o);
  }

  // A bound's terms for vocabulary rows [o, o + 16): weight error x one norm of x, |s q| x the same norm of x's
  // quantization error, and the float32 summation's max|w| |x|_1 gamma (g); from the rows' stats as vectors.
  static __m512 bound_terms(__m512 err, float x_norm, __m512 size, float rest, __m512 wmax, float g) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(err, _mm512_set1_ps(x_norm)),
                                       _mm512_mul_ps(size, _mm512_set1_ps(rest))),
                         _mm512_mul_ps(wmax, _mm512_set1_ps(g)));
  }

  __m512 terms(Stat err, float x_norm, Stat size, float rest, float g, int64_t o, __mmask16 valid) const {
    return bound_terms(stat(err, o, valid), x_norm, stat(size, o, valid), rest, stat(kWmax, o, valid), g);
  }

  // x row r's exact sums q.p1 (s1) and q.p2 (s2) for vocabulary rows [o, o + 16), of which `valid` exist.
  void lanes(__m512i s1, __m512i s2, int64_t r, int64_t o, __mmask16 valid) {
    const RowBound& x = rows[r];
    const __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(x.a), _mm512_cvtepi32_ps(s1));
    const __m512 t2 = _mm512_mul_ps(_mm512_set1_ps(x.b), _mm512_cvtepi32_ps(s2));
    const __m512 scale = stat(kScale, o, valid);
    keep(_mm512_mul_ps(scale, _mm512_add_ps(t1, t2)), terms(kErr, x.x_l1, kL1, x.rest, x.g, o, valid),
         _mm512_mul_ps(scale, _mm512_add_ps(_mm512_abs_ps(t1), _mm512_abs_ps(t2))), r, o, valid);
  }

  // The wide screen's stats of vocabulary rows [o, o + 16), read once for all its rows of x.
  struct WideStats {
    __m512 scale, err2, l2, wmax;
  };
  WideStats wide_stats(int64_t o, __mmask16 valid) const {
    return {stat(kScale, o, valid), stat(kErr2, o, valid), stat(kL2, o, valid), stat(kWmax, o, valid)};
  }

  // The wide screen's: x row r's exact sums q.p1 (s1).
  void lane(__m512i s1, int64_t r, const WideStats& w, int64_t o, __mmask16 valid) {
    const FineBound& x = wide[r];
    const __m512 t1 = _mm512_mul_ps(_mm512_set1_ps(x.a), _mm512_cvtepi32_ps(s1));
    keep(_mm512_mul_ps(w.scale, t1), bound_terms(w.err2, x.xn, w.l2, x.en, w.wmax, x.g),
         _mm512_mul_ps(w.scale, _mm512_abs_ps(t1)), r, o, valid);
  }

  // Estimates est +- the bound (terms, with slack for float32's rounding of est, of magnitude `size`): the row's best
  // lower bound so far, and the vocabulary rows whose upper bound reaches it less the margin.
  void keep(__m512 est, __m512 terms, __m512 size, int64_t r, int64_t o, __mmask16 valid) {
    const __m512 slack = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(1e-5f), size), _mm512_set1_ps(1e-30f));
    const __m512 bound = _mm512_add_ps(_mm512_mul_ps(terms, _mm512_set1_ps(1.0f + 1e-5f)), slack);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512 lo = _mm512_mask_sub_ps(neg_inf, valid, est, bound);
    const __m512 hi = _mm512_mask_add_ps(neg_inf, valid, est, bound);
    best_lanes[r] = _mm512_max_ps(best_lanes[r], lo);  // reduced to best[r] by refresh(): a filter a few vectors
                                                       // behind keeps a few more rows, which the final filter drops
    const __mmask16 hits = _mm512_mask_cmp_ps_mask(valid, hi, _mm512_set1_ps(margin_floor(best[r])), _CMP_GE_OQ);
    if (!hits) return;
    alignas(64) float his[kLanes];
    _mm512_store_ps(his, hi);
    keep_hits(kept, r, o, hits, his);
  }

  // Each row's best lower bound from its lanes: a horizontal max a row once per step of vectors, not per vector.
  // With the wide screen's stats read once a vector (WideStats): 16 real Gemma hidden rows 9.93-10.00 -> 9.41-9.49
  // ms a screen (Zen 4, 2026-12-06, alternating builds, medians of 55 calls; the same candidates), in a noisier hour
  // 9.72-11.43 -> 9.48-9.87 (minima 9.43-10.22 -> 9.21-9.31; 150 calls): 2-5 %. 1-8 rows no slower.
  // Then shared with the other tasks (ScreenResult::share): the thread that starts in the head's second half kept
  // ~83,000 rows of 16 hidden rows' ~15,000 candidates, and keeping them was ~2.7 of the screen's ~9.3 ms (the sums
  // alone 6.2-6.5). Shared, with the interleaved x below, 16 rows 9.55-10.68 -> 8.58-8.82 ms, 8 rows 7.26-7.97 ->
  // 6.68-6.87, 1-4 rows within their noise (memory's speed; Zen 4, 2026-12-06, builds alternated, medians of 60).
  void refresh() {
    for (size_t r = 0; r < best.size(); ++r)
      best[r] = result.share(r, std::max(best[r], _mm512_reduce_max_ps(best_lanes[r])));
  }

  void done() {
    refresh();
    result.merge(best, kept);
  }
};

// The screen's exact int32 sums for vocabulary vector v against C columns of x (int8 quads; unsigned head bytes by
// signed x; 128 * the column's sum still in them), read in address order: U accumulators a column take U consecutive
// quads (integer sums: exact in any order), each indexed only at compile time so that it stays in a register (indexed
// at run time, the compiler kept them on the stack: a third of vpdpbusd's rate), and each line is prefetched
// kScreenAhead lines before it is read, so the head streams as one run of lines. Four vectors taken quad by
// quad (four runs 10 KB apart, each line's successor a block ahead prefetched into L2) read the head at 60-80 % of a
// plain sum's speed. Gemma-3-270M's head, 2-core Zen 4, 2026-12-05, the same candidates, 8 interleaved pairs each:
// with memory slow (a sum of the 168 MB 2.9-3.5 ms) one row 3.83 -> 3.26 ms, 1-8 rows 0.74-0.87x the time; with it
// quick (1.7-1.9 ms) 8-16 rows 0.93-0.97x, 4-5 rows 1.09-1.10x (their extra broadcasts, where memory is not the bound).
// x's columns are interleaved quad by quad, so that one register addresses a quad's C of them: with C = 16 columns
// of C separate rows GCC ran out of registers and reloaded their addresses from the stack every quad. With that and
// vpdpbusd's own broadcast, 16 rows' sums alone take 90-94 % of one vpdpbusd a cycle a core at 3.6 GHz (6.2-6.5 ms; the
// whole screen 9.2-9.3 ms against 9.5-9.8 before; the sink's share of it: refresh()).
constexpr int64_t kScreenAhead = 64;

template <int U, int C>
void screen_sums_in_order(const uint32_t* packed, int64_t quads, const uint32_t* xs, int64_t v,
                          int32_t total[C][kLanes]) {
  __m512i acc[U][C];
  for (int u = 0; u < U; ++u)
    for (int k = 0; k < C; ++k) acc[u][k] = _mm512_setzero_si512();
  const uint32_t* vector = packed + v * quads * kLanes;
  for (int64_t q = 0; q < quads; q += U) {
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(vector + (q + u + kScreenAhead) * kLanes), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(vector + (q + u) * kLanes);
      const uint32_t* x = xs + (q + u) * C;  // the quad's C columns, adjacent (greedy_screen_vnni's `interleaved`)
      for (int k = 0; k < C; ++k) {
        if constexpr (C == 16)  // the broadcast inside vpdpbusd: GCC emits a vpbroadcastd of its own before each
          __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc[u][k]) : [w] "v"(wv), [x] "m"(x[k]));
        else  // the intrinsic: with the asm GCC kept U = 2's accumulators on the stack
          acc[u][k] = _mm512_dpbusd_epi32(acc[u][k], wv, _mm512_set1_epi32(static_cast<int>(x[k])));
      }
    }
  }
  for (int k = 0; k < C; ++k) {
    __m512i sum = acc[0][k];
    for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[u][k]);
    _mm512_store_si512(total[k], sum);
  }
}

// The screen over `count` vectors from v, one at a time (U x C <= 16 chains keep vpdpbusd busy; quads: a multiple of
// 16, as pack_vectors packs words); each vector's sums, less the columns' offsets, go to the sink. The two-row
// screen's columns are p1 and p2 of each row of x; the wide screen's are its 8 (up to 8 rows) or 16 columns, one a row
// of x, `rows` of them real and the rest zero, so each vector is read once for every row (5-16 rows in the pairs
// above). Two passes of 8 columns over each pair of vectors (the second from L1) had taken 6.61 ms against 5.91 for
// 30 real 16-row steps' hidden rows: the first pass waited on memory with half the products to hide it.
template <int C, bool Wide>
void screen_vectors(const uint32_t* packed, int64_t quads, const uint32_t* xs, const int32_t* bias, int64_t v,
                    int64_t count, int64_t rows, VectorSink& sink) {
  constexpr int U = C <= 4 ? 4 : C <= 8 ? 2 : 1;
  for (int64_t g = v; g < v + count; ++g) {
    alignas(64) int32_t total[C][kLanes];
    screen_sums_in_order<U, C>(packed, quads, xs, g, total);
    const int64_t o = g * kLanes;
    const __mmask16 valid = first_lanes(sink.vocab - o);
    const auto column = [&](int k) {  // column k's sums, less its offset
      return _mm512_sub_epi32(_mm512_load_si512(total[k]), _mm512_set1_epi32(bias[k]));
    };
    if constexpr (Wide) {
      const typename VectorSink::WideStats w = sink.wide_stats(o, valid);
      for (int k = 0; k < rows; ++k) sink.lane(column(k), k, w, o, valid);
    } else {
      for (int k = 0; k + 1 < C; k += 2) sink.lanes(column(k), column(k + 1), k / 2, o, valid);
    }
  }
  sink.refresh();
}

// The most rows of x the VNNI screen takes: up to kVnniPairRows the two-row screen (screen_vectors has a template for
// 2, 4, 6 and 8 columns; AMX's tiles take kScreenCols / 2 rows), then the wide one (8 or 16 columns). GreedyHead asks
// ``greedy_screen_rows`` (models/greedyhead.py).
constexpr int64_t kVnniPairRows = 4;
constexpr int64_t kVnniScreenMaxRows = 16;

at::Tensor greedy_screen_vnni(const at::Tensor& packed, const at::Tensor& stats, const at::Tensor& x) {
  check_screen(packed, stats, x, kLanes, at::kInt, 4, kVnniScreenMaxRows);
  const int64_t vocab = stats.size(1), quads = packed.size(1);
  const int64_t rows = x.size(0), in = x.size(1);
  const bool wide = rows > kVnniPairRows;
  const int64_t columns = wide ? (rows <= 8 ? 8 : 16) : 2 * rows;
  ScreenResult result;
  result.start(rows);
  const float gamma = screen_gamma(in);
  at::Tensor xq = at::zeros({columns, in}, x.options().dtype(at::kChar));  // pad columns: zero, unread by the sink
  std::vector<Quantized> z;
  std::vector<FineBound> zw;
  if (wide) {
    const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
    int8_t* xq8 = xq.data_ptr<int8_t>();
    for (int64_t r = 0; r < rows; ++r) zw.push_back(quantize_fine(xp + r * in, in, xq8 + r * in, gamma, 127.0));
  } else {
    z = quantize_rows(x, xq);
  }
  const int8_t* xqp = xq.data_ptr<int8_t>();
  std::vector<int32_t> bias(columns, 0);  // 128 * each column's sum: what the head's + 128 adds to its products
  for (int64_t k = 0; k < columns; ++k)
    for (int64_t i = 0; i < in; ++i) bias[k] += 128 * xqp[k * in + i];
  const float* st = stats.data_ptr<float>();
  const auto* pk = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  std::vector<uint32_t> interleaved(columns * quads);  // [quads][columns]: a quad's columns adjacent
  const auto* xc = reinterpret_cast<const uint32_t*>(xqp);
  for (int64_t k = 0; k < columns; ++k)
    for (int64_t q = 0; q < quads; ++q) interleaved[q * columns + k] = xc[k * quads + q];
  const uint32_t* xw = interleaved.data();
  const int32_t* sp = bias.data();
  constexpr int64_t kStep = 4;  // vectors a step
  const int64_t steps = (packed.size(0) + kStep - 1) / kStep;
  std::vector<RowBound> bounds;
  for (const Quantized& q : z) bounds.push_back(row_bound(q, gamma));
  // One sink per thread, kept across its grains (a thirty-second of the head each, at least 64 steps; handed over
  // between threads as parallel_stealing.h does), so that its running best filters the whole of what it screens.
  std::vector<std::unique_ptr<VectorSink>> sinks(omp_get_max_threads() + omp_get_thread_num() + 1);
  parallel_stealing(0, steps, std::max<int64_t>(64, steps / 32), [&](int64_t begin, int64_t end) {
    std::unique_ptr<VectorSink>& sink = sinks[omp_get_thread_num()];
    if (!sink) {
      sink = std::make_unique<VectorSink>(st, vocab, rows, result);
      sink->rows = bounds;
      sink->wide = zw;
    }
    for (int64_t s = begin; s < end; ++s) {
      const int64_t v = s * kStep, count = std::min(kStep, packed.size(0) - v);
      if (wide) {
        if (rows > 8) screen_vectors<16, true>(pk, quads, xw, sp, v, count, rows, *sink);
        else screen_vectors<8, true>(pk, quads, xw, sp, v, count, rows, *sink);
        continue;
      }
      switch (columns) {
        case 2: screen_vectors<2, false>(pk, quads, xw, sp, v, count, rows, *sink); break;
        case 4: screen_vectors<4, false>(pk, quads, xw, sp, v, count, rows, *sink); break;
        case 6: screen_vectors<6, false>(pk, quads, xw, sp, v, count, rows, *sink); break;
        case 8: screen_vectors<8, false>(pk, quads, xw, sp, v, count, rows, *sink); break;
        default: TORCH_CHECK(false, "greedy_screen: no screen for ", rows, " rows");
      }
    }
  });
  for (const std::unique_ptr<VectorSink>& sink : sinks)
    if (sink) sink->done();
  return screen_candidates(result, x.options());  // [candidates, 2]: (row of x, vocabulary row)
}

int64_t greedy_screen_rows() { return kVnniScreenMaxRows; }

// ---- Each row's argmax over bf16 logits, as aten's max(dim=-1).indices gives it ------------------------------
//
// The first maximum of the row; where the row holds a NaN, its first NaN (aten's max propagates NaN). aten reduces
// a bf16 row element by element (16 rows x 262k logits: 3.6 ms on this 2-core Zen 4 against ~0.3 ms to read them):
// here 16 lanes keep each the first maximum of their own elements (strictly greater replaces, so ties keep the
// earliest), then the lanes' maxima meet and the lowest index among the equal ones wins.
int64_t row_argmax(const c10::BFloat16* row, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 best = neg_inf;
  __m512i best_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i at = best_at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = first_lanes(n - j);
    const __m256i bits = _mm256_maskz_loadu_epi16(valid, row + j);
    const __m512 v = _mm512_mask_mov_ps(neg_inf, valid,
                                        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 higher = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, higher, v);
    best_at = _mm512_mask_mov_epi32(best_at, higher, at);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(static_cast<float>(row[j]))) return j;
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 tied = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const __m512i big = _mm512_set1_epi32(INT32_MAX);
  return _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(big, tied, best_at));
}

at::Tensor rows_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 && logits.is_contiguous() &&
              logits.size(1) >= 1 && logits.size(1) < (int64_t{1} << 31),
              "rows_argmax: contiguous bf16 logits [rows, n] expected, 1 <= n < 2^31");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const auto* p = reinterpret_cast<const c10::BFloat16*>(logits.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(p + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_bf16, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor", &bf16_pack);
  m.def("bf16_linear(Tensor packed, Tensor x, int chain, int out_features) -> Tensor", &bf16_linear);
  m.def("screen_pack(Tensor weight) -> Tensor[]", &screen_pack_vnni);
  m.def("greedy_screen(Tensor packed, Tensor stats, Tensor x) -> Tensor", &greedy_screen_vnni);
  m.def("greedy_screen_rows() -> int", &greedy_screen_rows);
  m.def("rows_argmax(Tensor logits) -> Tensor", &rows_argmax);
  m.def("bf16_rescore(Tensor weight, Tensor x, Tensor candidates, int chain) -> Tensor", &bf16_rescore);
}
