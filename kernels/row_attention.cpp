// row_attention(q, k, v, mask, scale): attention of a few new tokens per row (a decode step's one, a question's few
// dozen, a prompt chunk's up to 128), each over the keys its own row of the mask shows, on AVX512-BF16 or AVX2 CPUs
// (issue 22: a 16-row decode step of Gemma-3-270M spent ~16 of its ~49 ms in torch's CPU flash attention, which read
// the rows' K/V at ~15 GB/s of the ~40 the machine reads; a kv request's 28-43-token question pass spent ~19 ms
// there).
//
// What it computes, per row b, new token t and query head g of key head h (GQA: the G query heads of a key head read
// its keys together): s_j = (q . k_j) * scale + mask_j over the keys the mask shows (b, t), softmax, sum of p_j * v_j;
// in float32, each p_j rounded to bf16 before it multiplies v_j (as torch's flash kernel does for bf16), the result
// rounded to bf16 once. Not torch's bits: its dot products and sums run in another order, so outputs differ from
// SDPA's in the last bf16 place now and then (row_attention.py checks its error against float64 is no larger than
// SDPA's before anything uses it).
//
// Why it is faster and batch-invariant: a query reads only the keys its mask shows (from the first visible key to the
// last), not the batch's longest row padded and masked; those keys are split in chunks of kChunk counted from that
// first visible key, each chunk's (max, sum, p.V) computed on its own and the chunks combined in order. The work for a
// query, and every rounding in it, depends on its own q, keys and mask values alone: a request gets the same bits
// alone or in any batch (torch's kernel reduces a block's tail in an order that depends on the padded length, so
// there a row's output depended on the batch's longest row). Chunks are tasks on torch's threads (one done with its
// own takes the others'), so one long row uses both cores too.
//
// A mask value at or below kHidden (the dtype's lowest, which the model's masks use, or -inf) hides its key; other
// values are added to the score. Bool masks: true shows the key. A query with no visible key gets zeros.
//
// Two builds of this source (row_attention.py picks the flags): with AVX512-BF16 scores and p.V are vdpbf16ps
// products, the keys read in place and the values paired key by key (in registers for a decode step, once per chunk
// for a question's many queries); with AVX2 and FMA only (AMD Zen 3) both are read in place and converted to float32
// as they are used, a block of queries sharing each load (its own summation order, checked the same way). Everything
// else (masks, chunks, the combination in key order) is the same code.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel_stealing.h"

namespace {

constexpr int64_t kChunk = 64;       // keys per task, at absolute key indices c * kChunk ..: a row alone or padded
                                     // in a batch splits its keys the same way
constexpr int64_t kMaxGroup = 8;     // query heads per key head
constexpr int64_t kMaxDim = 512;     // head size
constexpr int64_t kMaxQueries = 512; // new tokens x query heads per key head, per row
constexpr int64_t kMaxTokens = 128;  // new tokens per row
constexpr int64_t kBlock = 4;        // queries per register block
constexpr float kHidden = -3.0e38f;  // bf16's and float32's lowest are -3.39e38 and -3.40e38
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// e^x for x <= 0 (both builds): 2^n * e^r with n = round(x log2 e), r = x - n ln2 (ln2 in two parts), e^r by its
// degree-6 Taylor polynomial in Horner order (relative error < 2e-7); 0 below kExpFloor, where float32 would go
// subnormal.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kExpFloor = -87.0f;
constexpr float kExpTaylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The mask's value of key j for one (row, new token) as a score addend: kNegInf where it hides the key.
struct MaskRow {
  const void* data = nullptr;
  int kind = 0;  // 0: none, 1: bf16, 2: float32, 3: bool
  float at(int64_t j) const {
    switch (kind) {
      case 1: { const float f = bf16_float(static_cast<const uint16_t*>(data)[j]); return f <= kHidden ? kNegInf : f; }
      case 2: { const float f = static_cast<const float*>(data)[j]; return f <= kHidden ? kNegInf : f; }
      case 3: return static_cast<const bool*>(data)[j] ? 0.0f : kNegInf;
      default: return 0.0f;
    }
  }
};

struct Shape {
  int64_t group, dim, tokens, queries;  // queries = tokens * group: a key head's, per row
  int64_t q_b, q_h, q_t;  // q strides (elements) of batch, head and token
  int64_t k_b, k_h, k_t;  // k strides of batch, head and token
  int64_t v_b, v_h, v_t;
  float scale;
};

struct Unit {  // one task: one row's keys first..last-1 (within one kChunk) for one key head, all its queries
  int64_t row, head, first, last;
};

// Every query of unit u (s.queries: new tokens x the key head's group) in blocks of kBlock, both builds: each query's
// row of q (as Query words) and mask row (add: kChunk addends a token), a tail block padded with `pad` queries and
// `pad_add` rows; block(qs, adds, m, l, acc) computes one block's kBlock results, which a tail block writes to scratch
// (pad_acc) and only its real queries' are copied out.
template <typename Query, typename Block>
void query_blocks(const Shape& s, const uint16_t* q, const Unit& u, const float* add, const Query* pad,
                  const float* pad_add, float* m_out, float* l_out, float* acc, float* pad_acc, Block&& block) {
  for (int64_t r0 = 0; r0 < s.queries; r0 += kBlock) {
    const Query* qs[kBlock];
    const float* adds[kBlock];
    for (int i = 0; i < kBlock; ++i) {
      const int64_t r = r0 + i, t = r / s.group, g = r % s.group;
      const bool real = r < s.queries;
      qs[i] = real ? reinterpret_cast<const Query*>(q + u.row * s.q_b + t * s.q_t + (u.head * s.group + g) * s.q_h)
                   : pad;
      adds[i] = real ? add + t * kChunk : pad_add;
    }
    float pm[kBlock], pl[kBlock];
    const bool whole = r0 + kBlock <= s.queries;
    block(qs, adds, whole ? m_out + r0 : pm, whole ? l_out + r0 : pl, whole ? acc + r0 * s.dim : pad_acc);
    if (!whole) {
      for (int64_t r = r0; r < s.queries; ++r) {
        m_out[r] = pm[r - r0];
        l_out[r] = pl[r - r0];
        std::memcpy(acc + r * s.dim, pad_acc + (r - r0) * s.dim, s.dim * sizeof(float));
      }
    }
  }
}

#if defined(__AVX512BF16__)  // ---- AVX512-BF16: vdpbf16ps products, keys read in place ----

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// e^x for x <= 0 (scores minus their maximum), kExpTaylor's rule; 0 for -inf.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// A task's scratch: the chunk's values as pairs of keys per dim (vt, a question's), and the mask's addends of each new
// token.
struct Scratch {
  alignas(64) uint32_t vt[kChunk / 2 * kMaxDim];
  alignas(64) float add[kMaxTokens * kChunk];
};

// The next task's K and V lines into L2 while this task computes: a decode step's rows read their K/V from DRAM
// (each layer's own, 16 rows x ~600 keys ~ 9 MB). With the hardware prefetcher alone a 16-row step's attention read
// them at ~10 GB/s (18 layers 14-16 ms); prefetching the next task's lines all at once while this task rearranged
// its own, at ~23 GB/s (10-12 ms): memory worked while the rearranging ran and sat idle through the products.
// `step` issues a few lines every 4 keys of the scores and every kPrefetchEvery key pairs of p.V instead, so the
// next chunk streams in while this one computes (row_attention.py has the numbers).
constexpr int64_t kPrefetchEvery = 8;  // key pairs of p.V one burst of the next task's lines covers

class LinePrefetcher {
 public:
  LinePrefetcher() = default;
  LinePrefetcher(const uint16_t* k, int64_t k_t, const uint16_t* v, int64_t v_t, int64_t n, int64_t dim,
                 int64_t iterations)
      : row_(k), v_(v), stride_(k_t), v_t_(v_t), keys_(n), per_key_(dim / 32),
        per_step_((2 * n * (dim / 32) + iterations - 1) / std::max<int64_t>(1, iterations)) {}
  // inlined: a call inside the products' loops would spill their vector accumulators (caller-saved) every time
  __attribute__((always_inline)) void step() {
    for (int64_t i = 0; i < per_step_ && row_; ++i) next();
  }
  void finish() {
    while (row_) next();
  }

 private:
  // one line: along a key's row, then the next key; K's rows first, then V's
  __attribute__((always_inline)) void next() {
    _mm_prefetch(reinterpret_cast<const char*>(row_ + 32 * part_), _MM_HINT_T1);
    if (++part_ < per_key_) return;
    part_ = 0;
    row_ += stride_;
    if (++key_ < keys_) return;
    key_ = 0;
    row_ = v_;
    v_ = nullptr;
    stride_ = v_t_;
  }
  const uint16_t *row_ = nullptr, *v_ = nullptr;  // the key row now prefetched; V's first (null once it is V's turn)
  int64_t stride_ = 0, v_t_ = 0, keys_ = 0, per_key_ = 1, per_step_ = 0, key_ = 0, part_ = 0;
};

// Values of keys j = 0..n-1 -> vt[(j / 2) * dim + ...]: for each 32 dims, 16 words (v_2i[d], v_2i+1[d]) of the dims
// unpacklo_epi16 takes (d = 8L + e, e < 4, per 128-bit lane L) then 16 of those unpackhi takes (e >= 4); zero past n.
// `next_k` and `next_v`, where set, are the next task's first key and value: the same lines of its keys and values
// go to L2 while these are rearranged (a question's tasks, whose K/V were just written and sit in the cache: there
// this beats spreading them over the products, as a decode step does).
void values_by_pair(const uint16_t* v, int64_t v_t, int64_t n, int64_t dim, uint32_t* vt, const uint16_t* next_k,
                    int64_t k_t, const uint16_t* next_v) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 2) {
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      if (next_v) {
        for (int64_t x = j; x < j + 2; ++x) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + x * k_t + d0), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + x * v_t + d0), _MM_HINT_T1);
        }
      }
      const __m512i a = _mm512_loadu_si512(v + j * v_t + d0);
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * v_t + d0) : zero;
      _mm512_store_si512(vt + (j / 2) * dim + d0, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(vt + (j / 2) * dim + d0 + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// Scores of a block of kBlock queries against n keys (16 to a vector, [query][key / 16]) -> each query's max score m,
// sum of e^(s - m) l and bf16(e^(s - m)) of key pairs 2i, 2i + 1; scaled first, keys past n and keys the mask hides
// scoring -inf.
void softmax_pairs(const Shape& s, __m512 score[kBlock][kChunk / 16], const float* const add[kBlock], int64_t n,
                   float* m_out, float* l_out, uint32_t pairs[kBlock][kChunk / 2]) {
  const int64_t blocks16 = (n + 15) / 16;
  for (int i = 0; i < kBlock; ++i) {
    __m512 top = _mm512_set1_ps(kNegInf);
    for (int64_t c = 0; c < blocks16; ++c) {
      const __m512 a = _mm512_maskz_loadu_ps(first_lanes(n - 16 * c), add[i] + 16 * c);
      const __m512 hidden = _mm512_set1_ps(kNegInf);
      score[i][c] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, hidden, _CMP_EQ_OQ) | ~first_lanes(n - 16 * c),
                                         _mm512_fmadd_ps(score[i][c], _mm512_set1_ps(s.scale), a), hidden);
      top = _mm512_max_ps(top, score[i][c]);
    }
    const float m = _mm512_reduce_max_ps(top);
    m_out[i] = m;
    if (m == kNegInf) {  // the mask hides every key of the chunk from this query
      l_out[i] = 0.0f;
      std::memset(pairs[i], 0, sizeof pairs[i]);
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < kChunk / 16; c += 2) {
      const __m512 mv = _mm512_set1_ps(m), none = _mm512_setzero_ps();
      const __m512 e0 = c < blocks16 ? exp_nonpositive(_mm512_sub_ps(score[i][c], mv)) : none;
      const __m512 e1 = c + 1 < blocks16 ? exp_nonpositive(_mm512_sub_ps(score[i][c + 1], mv)) : none;
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      _mm512_store_si512(pairs[i] + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // RNE, as a bf16 store rounds
    }
    l_out[i] = _mm512_reduce_add_ps(sum);
  }
}

// acc [kBlock, dim] = sum over key pairs jp of pairs[i][jp] . (values of keys 2jp, 2jp + 1), vdpbf16ps products;
// values(jp, d0, vv) puts key pair jp's dims d0..d0 + 63 in vv[4] in values_by_pair's order. kSpread: next->step()
// every kPrefetchEvery pairs.
template <bool kSpread, typename Values>
void weighted_values(const Shape& s, const uint32_t pairs[kBlock][kChunk / 2], int64_t n, float* acc, Values&& values,
                     LinePrefetcher* next) {
  // the permutation back from values_by_pair's order: dims 0-15 and 16-31 of a 32-dim block
  const __m512i back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int64_t key_pairs = (n + 1) / 2;
  for (int64_t d0 = 0; d0 < s.dim; d0 += 64) {
    __m512 a[kBlock][4];
    for (int i = 0; i < kBlock; ++i)
      for (int x = 0; x < 4; ++x) a[i][x] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < key_pairs; ++jp) {
      if constexpr (kSpread) if (jp % kPrefetchEvery == 0) next->step();
      __m512i vv[4];
      values(jp, d0, vv);
      for (int i = 0; i < kBlock; ++i) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(pairs[i][jp]));
        for (int x = 0; x < 4; ++x) a[i][x] = _mm512_dpbf16_ps(a[i][x], (__m512bh)pp, (__m512bh)vv[x]);
      }
    }
    for (int i = 0; i < kBlock; ++i) {
      for (int x = 0; x < 4; x += 2) {
        float* out = acc + i * s.dim + d0 + 16 * x;
        _mm512_storeu_ps(out, _mm512_permutex2var_ps(a[i][x], back0, a[i][x + 1]));
        _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(a[i][x], back1, a[i][x + 1]));
      }
    }
  }
}

// out lane j = the sum of v[j]'s 16 lanes: halves, then quarters, of 128-bit lanes added pairwise (lane L, element e
// of the last sum is key L + 4e, permuted back at the end).
inline __m512 lane_sums16(const float v[16][16]) {
  __m512 w[8], z[4], r[2];
  for (int m = 0; m < 8; ++m) {
    const __m512 a = _mm512_load_ps(v[2 * m]), b = _mm512_load_ps(v[2 * m + 1]);
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int m = 0; m < 4; ++m)  // 128-bit lane L: key 4m + L
    z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // lane L: elements 0-1 key 8m + L, 2-3 key 8m + 4 + L
    r[m] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0x88),
                         _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

// The scores (q . k, not yet scaled) of a block of kBlock queries (q rows of `dim` bf16 as pairs; a pad query: zeros)
// against the chunk's n keys, read in place: 4 keys x kBlock queries in registers, each a vector of lane partial
// sums over the key's row, added across lanes 16 keys at a time. Every pass computes a score this one way, so a
// token gets the same bits in a decode step, a question's pass or a prompt chunk. (Decode steps used to rearrange
// each chunk's keys into one vector per pair of dims first: that cost about as much as 4 queries' products with
// them.) next->step() every 4 keys.
void scores(const Shape& s, const uint32_t* const q[kBlock], const uint16_t* k, int64_t n,
            __m512 score[kBlock][kChunk / 16], LinePrefetcher* next) {
  const int64_t vectors = s.dim / 32;  // a key's row in 512-bit vectors
  alignas(64) float part[kBlock][16][16];  // a query's 16 keys' vectors of lane partial sums
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    for (int64_t j1 = j0; j1 < j0 + 16; j1 += 4) {
      if (j1 >= n) {  // past the chunk's last key: lanes the softmax hides
        for (int i = 0; i < kBlock; ++i) std::memset(part[i][j1 - j0], 0, 4 * sizeof part[i][0]);
        continue;
      }
      next->step();
      const uint16_t* key[4];
      for (int x = 0; x < 4; ++x) key[x] = k + std::min(j1 + x, n - 1) * s.k_t;
      __m512 a[4][kBlock];
      for (int x = 0; x < 4; ++x)
        for (int i = 0; i < kBlock; ++i) a[x][i] = _mm512_setzero_ps();
      for (int64_t w = 0; w < vectors; ++w) {
        __m512i qv[kBlock];
        for (int i = 0; i < kBlock; ++i) qv[i] = _mm512_loadu_si512(q[i] + 16 * w);
        for (int x = 0; x < 4; ++x) {
          const __m512i kv = _mm512_loadu_si512(key[x] + 32 * w);
          for (int i = 0; i < kBlock; ++i) a[x][i] = _mm512_dpbf16_ps(a[x][i], (__m512bh)qv[i], (__m512bh)kv);
        }
      }
      for (int x = 0; x < 4; ++x)
        for (int i = 0; i < kBlock; ++i) _mm512_store_ps(part[i][j1 - j0 + x], a[x][i]);
    }
    for (int i = 0; i < kBlock; ++i) score[i][j0 / 16] = lane_sums16(part[i]);
  }
}

// One block of kBlock queries against the chunk's n keys: each query's max score m, sum of e^(s - m) l and sum over
// keys of bf16(e^(s - m)) v, written to m_out, l_out, acc [kBlock, dim]. Values: a question's, as values_by_pair
// rearranged them (w.vt, shared by its many blocks); a decode step's one block (kInPlace) pairs them in registers, the
// same words. kInPlace also spreads the next task's lines over the products (`next`).
template <bool kInPlace>
void block(const Shape& s, const uint32_t* const q[kBlock], const float* const add[kBlock], const uint16_t* k,
           const uint16_t* v, const Scratch& w, int64_t n, float* m_out, float* l_out, float* acc,
           LinePrefetcher* next) {
  __m512 score[kBlock][kChunk / 16];
  scores(s, q, k, n, score, next);
  alignas(64) uint32_t pairs[kBlock][kChunk / 2];
  softmax_pairs(s, score, add, n, m_out, l_out, pairs);
  if constexpr (kInPlace) {
    alignas(64) static const uint16_t zeros[kMaxDim] = {};
    weighted_values<true>(s, pairs, n, acc, [&](int64_t jp, int64_t d0, __m512i vv[4]) {
      const uint16_t* a = v + 2 * jp * s.v_t + d0;
      const uint16_t* b = 2 * jp + 1 < n ? a + s.v_t : zeros + d0;
      for (int x = 0; x < 4; x += 2) {
        const __m512i va = _mm512_loadu_si512(a + 16 * x), vb = _mm512_loadu_si512(b + 16 * x);
        vv[x] = _mm512_unpacklo_epi16(va, vb);
        vv[x + 1] = _mm512_unpackhi_epi16(va, vb);
      }
    }, next);
  } else {
    weighted_values<false>(s, pairs, n, acc, [&](int64_t jp, int64_t d0, __m512i vv[4]) {
      for (int x = 0; x < 4; ++x) vv[x] = _mm512_load_si512(w.vt + jp * s.dim + d0 + 16 * x);
    }, next);
  }
}

// One task: every query of the row and key head against the chunk. A decode step's one block reads the chunk in
// place, the next task's lines spread over its products; a question's many share its values rearranged once, the
// next task's lines fetched meanwhile.
void chunk(const Shape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v, const MaskRow* masks,
           const Unit& u, const Unit* next, float* m_out, float* l_out, float* acc) {
  thread_local Scratch w;
  const int64_t n = u.last - u.first;
  const auto at_k = [&](const Unit& x) { return k + x.row * s.k_b + x.head * s.k_h + x.first * s.k_t; };
  const auto at_v = [&](const Unit& x) { return v + x.row * s.v_b + x.head * s.v_h + x.first * s.v_t; };
  const bool decode = s.queries <= kBlock;
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < n; ++j) w.add[t * kChunk + j] = masks[t].at(u.first + j);
  LinePrefetcher prefetch = next && decode
      ? LinePrefetcher(at_k(*next), s.k_t, at_v(*next), s.v_t, next->last - next->first, s.dim,
                       (n + 3) / 4 + s.dim / 64 * (((n + 1) / 2 + kPrefetchEvery - 1) / kPrefetchEvery))
      : LinePrefetcher();
  if (!decode)
    values_by_pair(at_v(u), s.v_t, n, s.dim, w.vt, next ? at_k(*next) : nullptr, s.k_t,
                   next ? at_v(*next) : nullptr);
  alignas(64) static const uint32_t pad_query[kMaxDim / 2] = {};
  alignas(64) static const float pad_add[kChunk] = {};
  alignas(64) float pad_acc[kBlock * kMaxDim];
  query_blocks(s, q, u, w.add, pad_query, pad_add, m_out, l_out, acc, pad_acc,
               [&](const uint32_t* const* qs, const float* const* adds, float* m, float* l, float* a) {
                 if (decode) block<true>(s, qs, adds, at_k(u), at_v(u), w, n, m, l, a, &prefetch);
                 else block<false>(s, qs, adds, at_k(u), at_v(u), w, n, m, l, a, &prefetch);
               });
  prefetch.finish();
}

#else  // ---- AVX2 and FMA: the same computation in 8-lane float32 vectors, K and V read in place ----

// 8 bf16 -> float32 (exact).
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// e^x for x <= 0, kExpTaylor's rule as the AVX512 build computes it; 0 for -inf.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  // 2^n as float bits ((n + 127) << 23): n >= -126 here, a normal number
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), live);
}

// float32 -> the nearest bf16, back as float32 (round to nearest even; the scores' e^x are finite and >= 0).
inline __m256 round_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

struct Scratch {  // a task's mask addends of each new token, the queries in float32, scores and bf16-rounded e^(s - m)
  alignas(32) float add[kMaxTokens * kChunk];
  alignas(32) float q[kBlock][kMaxDim];
  alignas(32) float p[kBlock][kChunk];
};

// One block of kBlock queries (q rows of `dim` bf16; null: a pad query) against the chunk's n keys (k, v at stride
// k_t, v_t): each query's max score m, sum of e^(s - m) l and sum over keys of bf16(e^(s - m)) v. A query's every
// operation is its own (the block shares only the loads), so its result does not depend on its block.
void block(const Shape& s, const uint16_t* const q[kBlock], const float* const add[kBlock], const uint16_t* k,
           const uint16_t* v, int64_t n, Scratch& w, float* m_out, float* l_out, float* acc) {
  const int64_t dim = s.dim;
  for (int i = 0; i < kBlock; ++i)
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_store_ps(w.q[i] + d, q[i] ? bf16x8(q[i] + d) : _mm256_setzero_ps());
  alignas(32) float score[kBlock][kChunk];
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* kj = k + j * s.k_t;
    __m256 a[kBlock][2];
    for (int i = 0; i < kBlock; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m256 k0 = bf16x8(kj + d), k1 = bf16x8(kj + d + 8);
      for (int i = 0; i < kBlock; ++i) {
        a[i][0] = _mm256_fmadd_ps(_mm256_load_ps(w.q[i] + d), k0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(_mm256_load_ps(w.q[i] + d + 8), k1, a[i][1]);
      }
    }
    for (int i = 0; i < kBlock; ++i) score[i][j] = hsum(_mm256_add_ps(a[i][0], a[i][1]));
  }
  for (int i = 0; i < kBlock; ++i) {
    float top = kNegInf;
    for (int64_t j = 0; j < kChunk; ++j) {
      const float a = j < n ? add[i][j] : kNegInf;  // keys past n, and keys the mask hides, score -inf
      score[i][j] = a == kNegInf ? kNegInf : std::fma(score[i][j], s.scale, a);
      top = std::max(top, score[i][j]);
    }
    m_out[i] = top;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kChunk; j += 8) {
      const __m256 shifted = _mm256_sub_ps(_mm256_load_ps(score[i] + j), _mm256_set1_ps(top));
      const __m256 e = top == kNegInf ? _mm256_setzero_ps() : exp_nonpositive(shifted);
      sum = _mm256_add_ps(sum, e);
      _mm256_store_ps(w.p[i] + j, round_bf16(e));
    }
    l_out[i] = top == kNegInf ? 0.0f : hsum(sum);
  }
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m256 a[kBlock][2];
    for (int i = 0; i < kBlock; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vj = v + j * s.v_t + d0;
      const __m256 v0 = bf16x8(vj), v1 = bf16x8(vj + 8);
      for (int i = 0; i < kBlock; ++i) {
        const __m256 pj = _mm256_broadcast_ss(w.p[i] + j);
        a[i][0] = _mm256_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pj, v1, a[i][1]);
      }
    }
    for (int i = 0; i < kBlock; ++i) {
      _mm256_storeu_ps(acc + i * dim + d0, a[i][0]);
      _mm256_storeu_ps(acc + i * dim + d0 + 8, a[i][1]);
    }
  }
}

// The next task's K/V lines into L2 (a decode step's rows read their K/V from DRAM, each layer its own).
void prefetch_rows(const uint16_t* x, int64_t stride, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < dim; d += 32) _mm_prefetch(reinterpret_cast<const char*>(x + j * stride + d), _MM_HINT_T1);
}

// One task: every query of the row and key head against the chunk's keys, read in place.
void chunk(const Shape& s, const uint16_t* q, const uint16_t* k, const uint16_t* v, const MaskRow* masks,
           const Unit& u, const Unit* next, float* m_out, float* l_out, float* acc) {
  thread_local Scratch w;
  const int64_t n = u.last - u.first;
  const auto at_k = [&](const Unit& x) { return k + x.row * s.k_b + x.head * s.k_h + x.first * s.k_t; };
  const auto at_v = [&](const Unit& x) { return v + x.row * s.v_b + x.head * s.v_h + x.first * s.v_t; };
  if (next) {
    prefetch_rows(at_k(*next), s.k_t, next->last - next->first, s.dim);
    prefetch_rows(at_v(*next), s.v_t, next->last - next->first, s.dim);
  }
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < n; ++j) w.add[t * kChunk + j] = masks[t].at(u.first + j);
  alignas(32) float pad_acc[kBlock * kMaxDim];
  const uint16_t* const keys = at_k(u);
  const uint16_t* const values = at_v(u);
  query_blocks<uint16_t>(s, q, u, w.add, nullptr, w.add, m_out, l_out, acc, pad_acc,
                         [&](const uint16_t* const* qs, const float* const* adds, float* m, float* l, float* a) {
                           block(s, qs, adds, keys, values, n, w, m, l, a);
                         });
}

#endif

// The first and one past the last key the mask shows (first == last: none).
std::pair<int64_t, int64_t> visible(const MaskRow& mask, int64_t keys) {
  if (mask.kind == 0) return {0, keys};
  int64_t first = 0, last = keys;
  while (first < keys && mask.at(first) == kNegInf) ++first;
  while (last > first && mask.at(last - 1) == kNegInf) --last;
  return {first, last};
}

MaskRow mask_row(const c10::optional<at::Tensor>& mask, int64_t row, int64_t token) {
  MaskRow r;
  if (!mask.has_value()) return r;
  const at::Tensor& m = *mask;
  const int64_t offset = (m.size(0) == 1 ? 0 : row) * m.stride(0) + (m.size(2) == 1 ? 0 : token) * m.stride(2);
  if (m.scalar_type() == at::kBFloat16) {
    r.kind = 1;
    r.data = reinterpret_cast<const uint16_t*>(m.data_ptr<at::BFloat16>()) + offset;
  } else if (m.scalar_type() == at::kFloat) {
    r.kind = 2;
    r.data = m.data_ptr<float>() + offset;
  } else {
    r.kind = 3;
    r.data = m.data_ptr<bool>() + offset;
  }
  return r;
}

// q [B, H, T, D], k and v [B, H_kv, K, D] (each token's D values adjacent; rows, heads and tokens at any stride), mask
// [B or 1, 1, T or 1, K] (bf16 or float32 added to the scores, or bool) or None. Returns [B, T, H, D] bf16, the layout
// transformers' attention hands its output projection.
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "row_attention: q, k and v must be [B, H, T, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "row_attention: q, k and v must be bfloat16");
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), dim = q.size(3), kv_heads = k.size(1),
                keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == kv_heads && v.size(2) == keys &&
              k.size(3) == dim && v.size(3) == dim, "row_attention: k and v must be [B, H_kv, K, D] of q's B and D");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "row_attention: query heads must be 1..", kMaxGroup, " times the key heads");
  TORCH_CHECK(dim % 64 == 0 && dim <= kMaxDim, "row_attention: head size must be a multiple of 64 up to ", kMaxDim,
              ", got ", dim);
  TORCH_CHECK(tokens >= 1 && tokens <= kMaxTokens && tokens * (heads / kv_heads) <= kMaxQueries,
              "row_attention: takes 1..", kMaxTokens, " new tokens a row (and at most ", kMaxQueries,
              " per key head with its query heads), got ", tokens);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "row_attention: D must be contiguous");
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == batch || m.size(0) == 1) && m.size(1) == 1 &&
                (m.size(2) == tokens || m.size(2) == 1) && m.size(3) == keys && m.stride(3) == 1,
                "row_attention: mask must be [B or 1, 1, T or 1, K]");
    TORCH_CHECK(m.scalar_type() == at::kBFloat16 || m.scalar_type() == at::kFloat || m.scalar_type() == at::kBool,
                "row_attention: mask must be bfloat16, float32 or bool");
  }
  const int64_t group = heads / kv_heads, queries = tokens * group;
  const Shape s{group, dim, tokens, queries, q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                static_cast<float>(scale)};
  std::vector<MaskRow> masks(batch * tokens);
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(batch * kv_heads + 1);  // a (row, key head)'s tasks, in key order
  for (int64_t b = 0; b < batch; ++b) {
    int64_t lo = keys, hi = 0;  // the keys any new token of the row sees
    for (int64_t t = 0; t < tokens; ++t) {
      masks[b * tokens + t] = mask_row(mask, b, t);
      const auto [first, last] = visible(masks[b * tokens + t], keys);
      if (first < last) lo = std::min(lo, first), hi = std::max(hi, last);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      first_unit[b * kv_heads + h] = static_cast<int64_t>(units.size());
      for (int64_t c = lo / kChunk * kChunk; c < hi; c += kChunk)
        units.push_back({b, h, c, std::min(hi, c + kChunk)});  // from c, not lo: keys pair up the same way in any pass
    }
  }
  first_unit[batch * kv_heads] = static_cast<int64_t>(units.size());
  const int64_t n_units = static_cast<int64_t>(units.size());
  // the tasks' partial results, uninitialized (each task writes all of its own; a zeroed vector cost a page-faulting
  // memset of up to a few MB per call)
  const at::Tensor partial = at::empty({n_units * queries * (dim + 2)}, q.options().dtype(at::kFloat));
  float* const m = partial.data_ptr<float>();
  float* const l = m + n_units * queries;
  float* const acc = l + n_units * queries;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  // a thread done with its own tasks takes the others' from their far end (one preempted by the server's event loop or
  // a client no longer holds up the step); its next task, whose K/V are prefetched, is the following one, a thief's
  // guess
  parallel_stealing(0, n_units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Unit& u = units[i];
      const Unit* next = i + 1 < n_units ? &units[i + 1] : nullptr;
      chunk(s, qp, kp, vp, &masks[u.row * tokens], u, next, m + i * queries, l + i * queries, acc + i * queries * dim);
    }
  });
  at::Tensor out = at::empty({batch, tokens, heads, dim}, q.options());
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, batch * kv_heads * queries, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t qi = begin; qi < end; ++qi) {
      const int64_t bh = qi / queries, r = qi % queries, b = bh / kv_heads, h = bh % kv_heads;
      const int64_t u0 = first_unit[bh], u1 = first_unit[bh + 1], t = r / group, g = r % group;
      float top = kNegInf;
      for (int64_t u = u0; u < u1; ++u) top = std::max(top, m[u * queries + r]);
      at::BFloat16* o = op + ((b * tokens + t) * heads + h * group + g) * dim;
      if (top == kNegInf) {
        std::fill(o, o + dim, at::BFloat16(0.0f));
        continue;
      }
      std::fill(sum.begin(), sum.end(), 0.0f);
      float total = 0.0f;
      for (int64_t u = u0; u < u1; ++u) {  // the chunks in key order, each scaled to the common maximum
        const float mu = m[u * queries + r];
        if (mu == kNegInf) continue;
        const float w = std::exp(mu - top);
        total += l[u * queries + r] * w;
        const float* a = acc + (u * queries + r) * dim;
        for (int64_t d = 0; d < dim; ++d) sum[d] += a[d] * w;
      }
      for (int64_t d = 0; d < dim; ++d) o[d] = at::BFloat16(sum[d] / total);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_attention, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor", &row_attention);
}
