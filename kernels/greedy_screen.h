// The LM head's int8 screen for greedy decoding, shared by the AMX kernel (amx_linear.cpp), the AVX512 one
// (bf16_linear.cpp) and the AVX2 one (avx2_linear.cpp): the int8 copy of the head with its per-row bounds, x's int8
// (or int16) rows, the sink that turns a tile of exact int32 products into kept candidates, and the final filter.
// Each kernel reads the int8 head its own way; the AMX one hands ScreenSink 16 vocabulary rows x 16 columns of int32
// sums (column 2r: x row r's p1, 2r + 1: its p2), the AVX512 one computes the same bounds 16 vocabulary rows a vector
// (its VectorSink), the AVX2 one 8 (x as one int16 row, quantize_fine).
// Included inside each kernel's anonymous namespace.
#pragma once

constexpr int64_t kScreenRows = 16;   // vocabulary rows per tile
constexpr int64_t kScreenCols = 16;   // int32 columns per tile: two per row of x
constexpr int64_t kScreenBlock = 64;  // the in-features must be a multiple of this

// ---- The LM head's int8 screen (greedy decoding): which vocabulary rows can hold the argmax ------------------
//
// A greedy step needs only the argmax of the bf16 logits W @ x. screen_pack stores W once as int8 rows q with a
// scale each (w ~ s q) and, per row, rigorous bounds: the largest |w - s q|, the L1 norm of s q and the largest |w|
// (float32, rounded up). A step quantizes x into two int8 rows (x ~ a p1 + b p2, the second the first's residual),
// reads the int8 head once (half the bytes of the bf16 head; AMX `tdpbssd` in amx_linear.cpp, AVX512-VNNI
// `vpdpbusd` in bf16_linear.cpp, both exact int32 sums), and estimates each
// logit as s (a q.p1 + b q.p2) with a bound on |estimate - the kernel's fp32 logit|:
//   max|w - s q| * |x|_1  +  |s q|_1 * max|x - a p1 - b p2|  +  max|w| * |x|_1 * D * 2^-23  (fp32 summation, gamma_D)
// Every row whose estimate + bound reaches the best estimate - bound (less a margin of two bf16 steps there, so a
// row left out cannot even round to a tie) is a candidate; the caller computes those rows exactly with the head's kernel
// and takes their first maximum: the full head's argmax, bit for bit.

// screen_pack's per-row numbers, as float32 rows [kStats, out] (one vector load per field in the screen's loops):
// the scale, max|w - s q|, |s q|_1, max|w|, and for the wide screen (bf16_linear.cpp) the L2 norms |w - s q|_2 and
// |s q|_2
enum Stat { kScale = 0, kErr = 1, kL1 = 2, kWmax = 3, kErr2 = 4, kL2 = 5, kStats = 6 };

float round_up(double v) {
  float f = static_cast<float>(v);
  return static_cast<double>(f) < v ? std::nextafter(f, INFINITY) : f;
}

std::vector<at::Tensor> screen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "screen_pack: a contiguous bf16 [out, in] weight expected");
  TORCH_CHECK(weight.size(1) % kScreenBlock == 0, "screen_pack: in-features must be a multiple of ", kScreenBlock);
  const int64_t out = weight.size(0), in = weight.size(1);
  at::Tensor q = at::empty({out, in}, weight.options().dtype(at::kChar));
  at::Tensor stats = at::empty({kStats, out}, weight.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const c10::BFloat16*>(weight.data_ptr());
  auto* qp = q.data_ptr<int8_t>();
  float* st = stats.data_ptr<float>();
  at::parallel_for(0, out, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* row = w + r * in;
      double wmax = 0.0;
      for (int64_t i = 0; i < in; ++i) wmax = std::max(wmax, std::fabs(static_cast<double>(float(row[i]))));
      const float scale = wmax > 0.0 ? static_cast<float>(wmax / 127.0) : 1.0f;
      double err = 0.0, l1 = 0.0, err2 = 0.0, l2 = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        const double v = static_cast<double>(float(row[i]));
        const double qi = std::clamp(std::nearbyint(v / scale), -127.0, 127.0);
        qp[r * in + i] = static_cast<int8_t>(qi);
        const double d = v - scale * qi;  // exact in double: bf16 v, float scale, |qi| <= 127
        err = std::max(err, std::fabs(d));
        l1 += std::fabs(scale * qi);
        err2 += d * d;
        l2 += scale * qi * scale * qi;
      }
      st[kScale * out + r] = scale;
      st[kErr * out + r] = round_up(err);
      st[kL1 * out + r] = round_up(l1 * (1.0 + 1e-12));
      st[kWmax * out + r] = round_up(wmax);
      st[kErr2 * out + r] = round_up(std::sqrt(err2) * (1.0 + 1e-12));  // the sums' and sqrt's rounding, generously
      st[kL2 * out + r] = round_up(std::sqrt(l2) * (1.0 + 1e-12));
    }
  });
  return {q, stats};
}

struct Quantized {  // one row of x as a p1 + b p2 (int8 rows), with the bound's ingredients
  double a = 1.0, b = 1.0, rest = 0.0, l1 = 0.0;
};

// v ~ a p, p a row of integers in [-levels, levels]: a = max|v| / levels (1 where v is all zero), p = v / a rounded
// to nearest even and clamped. The rule for every row of x, in every screen. Returns a.
template <typename T>
double integer_row(const std::vector<double>& v, T* p, double levels) {
  double top = 0.0;
  for (const double e : v) top = std::max(top, std::fabs(e));
  const double a = top > 0.0 ? top / levels : 1.0;
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<T>(std::clamp(std::nearbyint(v[i] / a), -levels, levels));
  return a;
}

double int8_row(const std::vector<double>& v, int8_t* p) { return integer_row(v, p, 127.0); }

std::vector<double> row_values(const c10::BFloat16* x, int64_t in) {
  std::vector<double> v(in);
  for (int64_t i = 0; i < in; ++i) v[i] = float(x[i]);
  return v;
}

Quantized quantize(const c10::BFloat16* x, int64_t in, int8_t* p1, int8_t* p2) {
  Quantized z;
  std::vector<double> residual = row_values(x, in);
  for (const double v : residual) z.l1 += std::fabs(v);
  z.a = int8_row(residual, p1);
  for (int64_t i = 0; i < in; ++i) residual[i] -= z.a * p1[i];
  z.b = int8_row(residual, p2);
  for (int64_t i = 0; i < in; ++i) z.rest = std::max(z.rest, std::fabs(residual[i] - z.b * p2[i]));
  z.l1 *= 1.0 + 1e-12;    // double rounding of the sums above, generously
  z.rest *= 1.0 + 1e-12;
  return z;
}

// What every task of the screen adds to: the best lower bound per row of x and the vocabulary rows kept so far.
struct ScreenResult {
  std::mutex lock;
  std::vector<float> best;          // per row of x
  std::vector<std::array<float, 3>> kept;  // (row of x, vocabulary row, upper bound), as floats for the sort below
  // Per row of x, the best lower bound any task has found so far (start; the VNNI sink shares its own, bf16_linear.cpp,
  // the AMX and AVX2 ones keep theirs). A task filters with the highest one known (share):
  // alone, the task that starts in the head's second half, where few rows are likely tokens, kept ~11x the rows the
  // final filter leaves (83,000 a thread for 16 real Gemma hidden rows, ~15,000 in the end), and keeping them cost
  // more than the arithmetic of all its bounds. Any task's lower bound bounds the row's maximum, so the final
  // candidates are the same.
  std::unique_ptr<std::atomic<float>[]> running;

  void start(int64_t rows) {
    best.assign(rows, -INFINITY);
    running = std::make_unique<std::atomic<float>[]>(rows);
    for (int64_t r = 0; r < rows; ++r) running[r].store(-INFINITY, std::memory_order_relaxed);
  }

  // The highest best lower bound of row r any task has shared, `lb` (this task's) included.
  float share(int64_t r, float lb) {
    float seen = running[r].load(std::memory_order_relaxed);
    while (lb > seen && !running[r].compare_exchange_weak(seen, lb, std::memory_order_relaxed)) {
    }
    return std::max(seen, lb);
  }

  void merge(const std::vector<float>& task_best, const std::vector<std::array<float, 3>>& task_kept) {  // a task's
    std::lock_guard<std::mutex> guard(lock);
    for (size_t r = 0; r < task_best.size(); ++r) best[r] = std::max(best[r], task_best[r]);
    kept.insert(kept.end(), task_kept.begin(), task_kept.end());
  }
};

// One row of x's float32 factors of the bound: a and b (x ~ a p1 + b p2), |x|_1 and max|x - a p1 - b p2| rounded up,
// and |x|_1 times the summation's gamma.
struct RowBound {
  float a, b, x_l1, rest, g;
};

RowBound row_bound(const Quantized& z, float gamma) {
  const float x_l1 = static_cast<float>(z.l1) * (1.0f + 1e-6f);
  return {static_cast<float>(z.a), static_cast<float>(z.b), x_l1, static_cast<float>(z.rest) * (1.0f + 1e-6f),
          x_l1 * gamma};
}

// A vector sink's kept rows: vocabulary row o + i for each set bit i of `hits`, with its upper bound his[i], for
// x row r.
void keep_hits(std::vector<std::array<float, 3>>& kept, int64_t r, int64_t o, uint32_t hits, const float* his) {
  for (; hits; hits &= hits - 1) {
    const int i = __builtin_ctz(hits);
    kept.push_back({static_cast<float>(r), static_cast<float>(o + i), his[i]});
  }
}

float margin_floor(float lb) { return lb - (std::fabs(lb) * 0.03125f + 1e-30f); }  // two bf16 steps: 2^-5 |lb|

// A task's sink: each tile's int32 accumulators (columns 2r and 2r + 1 are row r's p1 and p2) become estimates and
// bounds in float32 (the slack covers float32's own rounding here a hundred times over); a vocabulary row is kept
// while its upper bound reaches the task's running best lower bound less the margin (the final best is at least
// as high, so nothing the final filter keeps is dropped), and no int32 logits are written anywhere.
struct ScreenSink {
  const float* st;  // [4, vocab]
  int64_t vocab;
  const std::vector<Quantized>& z;
  float gamma;      // fp32 summation over the in-features: D * 2^-23
  ScreenResult& result;
  std::vector<float> best;
  std::vector<std::array<float, 3>> kept;

  void tile(const int32_t* c, int64_t o, int64_t tile_rows, int64_t group) {
    const int64_t rows = static_cast<int64_t>(z.size());
    for (int64_t col = 0; col + 1 < kScreenCols; col += 2) {
      const int64_t r = (group * kScreenCols + col) / 2;
      if (r >= rows) break;
      const auto [a, b, x_l1, rest, g] = row_bound(z[r], gamma);
      float lo[kScreenRows], hi[kScreenRows], lb = best[r];
      for (int64_t i = 0; i < tile_rows; ++i) {
        const int64_t v = o + i;
        const float t1 = a * static_cast<float>(c[i * kScreenCols + col]), t2 = b * static_cast<float>(c[i * kScreenCols + col + 1]);
        const float scale = st[kScale * vocab + v];
        const float est = scale * (t1 + t2);
        const float slack = 1e-5f * scale * (std::fabs(t1) + std::fabs(t2)) + 1e-30f;
        const float bound = (st[kErr * vocab + v] * x_l1 + st[kL1 * vocab + v] * rest + st[kWmax * vocab + v] * g) *
                            (1.0f + 1e-5f) + slack;
        lo[i] = est - bound;
        hi[i] = est + bound;
        lb = std::max(lb, lo[i]);
      }
      best[r] = lb;
      const float floor = margin_floor(lb);
      for (int64_t i = 0; i < tile_rows; ++i)
        if (hi[i] >= floor) kept.push_back({static_cast<float>(r), static_cast<float>(o + i), hi[i]});
    }
  }

  void done() { result.merge(best, kept); }
};

// x's rows quantized (screen_pack's layout: rows 2r and 2r + 1 of xq are row r's p1 and p2).
std::vector<Quantized> quantize_rows(const at::Tensor& x, at::Tensor& xq) {
  const int64_t rows = x.size(0), in = x.size(1);
  std::vector<Quantized> z(rows);
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  auto* xqp = xq.data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r) z[r] = quantize(xp + r * in, in, xqp + 2 * r * in, xqp + (2 * r + 1) * in);
  return z;
}

// The candidates every task kept that still reach their row's final best: [n, 2] (row of x, vocabulary row), by
// row, then vocabulary order.
at::Tensor screen_candidates(const ScreenResult& result, const at::TensorOptions& options) {
  std::vector<std::array<float, 3>> hits;
  for (const auto& k : result.kept)
    if (k[2] >= margin_floor(result.best[static_cast<int64_t>(k[0])])) hits.push_back(k);
  std::sort(hits.begin(), hits.end(), [](const auto& p, const auto& q) {
    return p[0] != q[0] ? p[0] < q[0] : p[1] < q[1];
  });
  at::Tensor out = at::empty({static_cast<int64_t>(hits.size()), 2}, options.dtype(at::kLong));
  auto* op = out.data_ptr<int64_t>();
  for (const auto& h : hits) {
    *op++ = static_cast<int64_t>(h[0]);
    *op++ = static_cast<int64_t>(h[1]);
  }
  return out;
}

float screen_gamma(int64_t in) { return static_cast<float>(static_cast<double>(in) * std::ldexp(1.0, -23)); }

// Checks a vector screen's arguments: screen_pack's head packed as [vectors, words, lanes] (`word` elements of
// `per_word` in-features each, `lanes` vocabulary rows a vector), its stats [kStats, vocab], and contiguous bf16 rows
// x [rows, in], at most max_rows of them.
void check_screen(const at::Tensor& packed, const at::Tensor& stats, const at::Tensor& x, int64_t lanes,
                  at::ScalarType word, int64_t per_word, int64_t max_rows) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == word && packed.size(2) == lanes && packed.is_contiguous(),
              "greedy_screen: screen_pack's packed int8 weight expected");
  const int64_t vocab = stats.dim() == 2 ? stats.size(1) : 0, words = packed.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 24), "greedy_screen: more vocabulary rows than float32 counts exactly");
  TORCH_CHECK(packed.size(0) == (vocab + lanes - 1) / lanes, "greedy_screen: screen_pack's stats expected");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == kStats && stats.size(1) == vocab &&
              stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "greedy_screen: screen_pack's stats expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(0) >= 1,
              "greedy_screen: contiguous bf16 rows x [rows, in] expected");
  TORCH_CHECK(x.size(1) == per_word * words, "greedy_screen: in-features differ: ", x.size(1), " vs ",
              per_word * words);
  TORCH_CHECK(x.size(0) <= max_rows, "greedy_screen: at most ", max_rows, " rows of x");
}

// ---- x as one int16 row (the AVX2 screen) ------------------------------------------------------------------------
//
// AVX2 has no int8 dot product into int32 (VNNI's `vpdpbusd`), and `vpmaddubsw`'s int16 pair sums saturate unless x
// loses a bit; `vpmaddwd` multiplies int16 pairs into exact int32 sums at the same rate per multiply-add. So there x
// is one int16 row in int16_levels(in) levels (26,413 for 640 in-features, where the sum of in products of int8
// weights cannot leave int32) and the head's int8 rows are widened to int16 as they load: x's quantization error is
// ~200x below one int8 row's, so one row does what the two-row screen's two int8 rows do, for half the products.
// Both rigorous bounds are at hand (screen_pack's stats); each vocabulary row takes the smaller:
//   L1:  max|w - s q| |x|_1 + |s q|_1 max|x - a p|        (the two-row screen's, with b = 0)
//   L2:  |w - s q|_2 |x|_2 + |s q|_2 |x - a p|_2           (the wide screen's)
// each plus the float32 summation's max|w| |x|_1 D 2^-23.
double int16_levels(int64_t in) {
  return std::min(32767.0, std::floor(2147483647.0 / (127.0 * static_cast<double>(in))));
}

struct FineBound {
  float a, x_l1, rest, xn, en, g;  // x ~ a p; |x|_1, max|x - a p|, |x|_2, |x - a p|_2 rounded up; |x|_1 gamma
};

// One row of x as a p (p in [-levels, levels]) with both bounds' factors: AVX2's int16 row (int16_levels(in)) and
// the VNNI wide screen's int8 row (127 levels, its L2 bound alone).
template <typename T>
FineBound quantize_fine(const c10::BFloat16* x, int64_t in, T* p, float gamma, double levels) {
  const std::vector<double> v = row_values(x, in);
  const double a = integer_row(v, p, levels);
  double l1 = 0.0, rest = 0.0, xx = 0.0, ee = 0.0;
  for (int64_t i = 0; i < in; ++i) {
    const double e = v[i] - a * p[i];
    l1 += std::fabs(v[i]);
    rest = std::max(rest, std::fabs(e));
    xx += v[i] * v[i];
    ee += e * e;
  }
  const float x_l1 = round_up(l1 * (1.0 + 1e-12)) * (1.0f + 1e-6f);
  return {static_cast<float>(a), x_l1, round_up(rest * (1.0 + 1e-12)), round_up(std::sqrt(xx) * (1.0 + 1e-12)),
          round_up(std::sqrt(ee) * (1.0 + 1e-12)), x_l1 * gamma};
}
