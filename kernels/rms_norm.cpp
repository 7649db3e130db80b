// rms_norm(x, weight, eps): Gemma-3's RMSNorm of bf16 rows as ONE call, bit for bit what the lean layers computed
// with aten's composite (issue 22).
//
// Why a kernel of our own: aten's CPU `rms_norm` is a composite of ~25 dispatched operations (to, pow, mean = sum +
// div_, add_, rsqrt, two muls, type_as and their copies and allocations), ~50-70 us a call on the 2-core machine
// for a 640-value row; a decode step of Gemma-3-270M calls it 91 times (~5 ms, an eighth of the step). This does
// the same float32 operations in the same order in one pass:
//   v = float(x); s = sum(v * v) in aten's cascade order; r = 1 / sqrt(s / n + eps); out = bf16((v * r) * w)
// aten's inner-dimension sum (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum) reads the row as
// 8-float vectors, four interleaved vector accumulators each cascaded over levels of 16 steps, the accumulators
// added in order, the tail and then the 8 lanes added one by one to a scalar. That order is reproduced below with
// plain arrays (no intrinsics, and -ffp-contract=off: a fused multiply-add would skip the rounding of v * v that
// aten's materialized pow makes). kernels/rms_norm.py checks the result equals aten's before anything uses it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;   // aten's float vector here
constexpr int64_t kIlp = 4;     // row_sum's interleaved accumulators
constexpr int64_t kLevels = 4;  // multi_row_sum's cascade levels

// Rows a thread takes at least: below this many a call runs on the calling thread (a decode step's 5 head rows cost
// ~2 us, less than waking the pool).
constexpr int64_t kGrainRows = 32;

// c10::BFloat16(f)'s bits (round to nearest even, NaN to 0x7FC0) and a bf16's float, written without branches on
// plain integers so the compiler vectorizes the loops that call them (c10's constructor kept them scalar: the q/k
// step of a 44-token prompt pass took 5 ms of its 57).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}

inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float round_bf16(float f) { return bf16_float(bf16_bits(f)); }

inline const uint16_t* bits_of(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }

struct Vec {
  float v[kLanes] = {};
  void add(const Vec& o) { for (int64_t l = 0; l < kLanes; ++l) v[l] += o.v[l]; }
};

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t y = static_cast<uint64_t>(x - 1); y; y >>= 1) ++bits;
  return bits;
}

Vec squares(const c10::BFloat16* x, int64_t vec) {
  Vec out;
  for (int64_t l = 0; l < kLanes; ++l) {
    const float f = static_cast<float>(x[vec * kLanes + l]);
    out.v[l] = f * f;
  }
  return out;
}

// aten's multi_row_sum over `rows` groups of kIlp vectors (vector k of group i is vector i * kIlp + k).
void cascade(const c10::BFloat16* x, int64_t rows, Vec (&sums)[kIlp]) {
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  Vec acc[kLevels][kIlp];
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(squares(x, i * kIlp + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k] = Vec{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(squares(x, i * kIlp + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  for (int64_t k = 0; k < kIlp; ++k) sums[k] = acc[0][k];
}

float sum_of_squares(const c10::BFloat16* x, int64_t n) {  // aten's vectorized_inner_sum of x * x
  const int64_t vecs = n / kLanes, rows = vecs / kIlp;
  Vec sums[kIlp];
  cascade(x, rows, sums);
  for (int64_t v = rows * kIlp; v < vecs; ++v) sums[0].add(squares(x, v));
  for (int64_t k = 1; k < kIlp; ++k) sums[0].add(sums[k]);
  float total = 0.0f;
  for (int64_t e = vecs * kLanes; e < n; ++e) {
    const float f = static_cast<float>(x[e]);
    total += f * f;
  }
  for (int64_t l = 0; l < kLanes; ++l) total += sums[0].v[l];
  return total;
}

// Offset of row `row` (the index over every dimension of `sizes` but the last) in a tensor of these strides.
int64_t row_offset(int64_t row, const at::IntArrayRef sizes, const std::vector<int64_t>& strides) {
  int64_t offset = 0;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    offset += (row % sizes[d]) * strides[d];
    row /= sizes[d];
  }
  return offset;
}

// The strides of `t` read as a tensor of `sizes` (aligned on the right, size-1 dimensions broadcast), as aten's
// mul broadcasts a weight row per head; without making an expanded view (a dispatched call) each time.
std::vector<int64_t> broadcast_strides(const at::Tensor& t, const at::IntArrayRef sizes) {
  const int64_t lead = static_cast<int64_t>(sizes.size()) - t.dim();
  TORCH_CHECK(lead >= 0, "rms_norm: weight has more dimensions than x");
  std::vector<int64_t> strides(sizes.size(), 0);
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.size(d) == sizes[lead + d] || t.size(d) == 1, "rms_norm: weight of shape ", t.sizes(),
                " does not broadcast to x's ", sizes);
    strides[lead + d] = t.size(d) == 1 ? 0 : t.stride(d);
  }
  return strides;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "rms_norm: weight must be float32, got ", weight.scalar_type());
  // aten sums a row in this order only when its values are adjacent (another layout takes another reduction)
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rms_norm: x's last dimension must be contiguous");
  TORCH_CHECK(weight.stride(-1) == 1, "rms_norm: weight's last dimension must be contiguous");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.size(-1) == n, "rms_norm: weight has ", weight.size(-1), " values a row, x ", n);
  const std::vector<int64_t> x_strides = x.strides().vec(), w_strides = broadcast_strides(weight, x.sizes());
  at::Tensor out = at::empty_like(x);
  const std::vector<int64_t> out_strides = out.strides().vec();
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  const auto* wp = weight.data_ptr<float>();
  auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const float feps = static_cast<float>(eps), count = static_cast<float>(n);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const c10::BFloat16* xr = xp + row_offset(row, x.sizes(), x_strides);
      const uint16_t* xb = bits_of(xr);
      const float* wr = wp + row_offset(row, x.sizes(), w_strides);
      auto* ob = reinterpret_cast<uint16_t*>(op + row_offset(row, x.sizes(), out_strides));
      const float r = 1.0f / std::sqrt(sum_of_squares(xr, n) / count + feps);
      for (int64_t e = 0; e < n; ++e) ob[e] = bf16_bits((bf16_float(xb[e]) * r) * wr[e]);
    }
  });
  return out;
}

// q and k of a Gemma-3 layer in one call: each head's row normalized (as rms_norm, its head's weight row), then
// rotated, (n * cos) + (roll(n, D/2) * signed_sin) with each bf16 product and the sum rounded to bf16 as aten's
// bf16 operations round them, and written out as contiguous query [B, heads, q, D] and key [B, G - heads, q, D].
// qk [B, q, G, D] (any strides, values of a row adjacent), weight float32 [G, 1, D], cos and signed_sin bf16
// [B or 1, 1, q, D]. The lean layer ran ~10 dispatched operations for this (transpose, norm, mul, roll, mul, add, two
// slices, two copies) 18 times a decode step.
std::vector<at::Tensor> qk_norm_rope(const at::Tensor& qk, const at::Tensor& weight, double eps, const at::Tensor& cos,
                                     const at::Tensor& signed_sin, int64_t heads) {
  TORCH_CHECK(qk.dim() == 4 && qk.scalar_type() == at::kBFloat16 && qk.stride(3) == 1,
              "qk_norm_rope: qk must be bf16 [B, q, G, D] with each row's values adjacent");
  const int64_t batch = qk.size(0), len = qk.size(1), groups = qk.size(2), n = qk.size(3);
  TORCH_CHECK(n % 2 == 0, "qk_norm_rope: head size ", n, " is odd");
  TORCH_CHECK(heads >= 0 && heads <= groups, "qk_norm_rope: ", heads, " query heads of ", groups);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == groups * n,
              "qk_norm_rope: weight must be float32 [G, 1, D], contiguous");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4 && (t->size(0) == batch || t->size(0) == 1) &&
                t->size(1) == 1 && t->size(2) == len && t->size(3) == n && t->stride(3) == 1,
                "qk_norm_rope: cos and signed_sin must be bf16 [B or 1, 1, q, D]");
  }
  at::Tensor query = at::empty({batch, heads, len, n}, qk.options());
  at::Tensor key = at::empty({batch, groups - heads, len, n}, qk.options());
  const auto* qp = reinterpret_cast<const c10::BFloat16*>(qk.data_ptr());
  const auto* cp = reinterpret_cast<const c10::BFloat16*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const c10::BFloat16*>(signed_sin.data_ptr());
  const float* wp = weight.data_ptr<float>();
  auto* outq = reinterpret_cast<c10::BFloat16*>(query.data_ptr());
  auto* outk = reinterpret_cast<c10::BFloat16*>(key.data_ptr());
  const float feps = static_cast<float>(eps), count = static_cast<float>(n);
  const int64_t half = n / 2;
  // one row = one (sequence, token, head); rows are independent, so threads take runs of them
  at::parallel_for(0, batch * len * groups, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(n);  // the normalized row, each value a bf16's
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (len * groups), s = i / groups % len, g = i % groups;
      // one table row for every sequence where the tables were made for one (broadcast, as aten's mul does)
      const uint16_t* c = bits_of(cp + (cos.size(0) == 1 ? 0 : b * cos.stride(0)) + s * cos.stride(2));
      const uint16_t* sn =
          bits_of(sp + (signed_sin.size(0) == 1 ? 0 : b * signed_sin.stride(0)) + s * signed_sin.stride(2));
      const c10::BFloat16* row = qp + b * qk.stride(0) + s * qk.stride(1) + g * qk.stride(2);
      const uint16_t* x = bits_of(row);
      const float* w = wp + g * n;
      const float r = 1.0f / std::sqrt(sum_of_squares(row, n) / count + feps);
      for (int64_t e = 0; e < n; ++e) normed[e] = round_bf16((bf16_float(x[e]) * r) * w[e]);
      auto* out = reinterpret_cast<uint16_t*>(g < heads ? outq + ((b * heads + g) * len + s) * n
                                                        : outk + ((b * (groups - heads) + g - heads) * len + s) * n);
      // roll(normed, D/2)[e] is normed[e + D/2] in the first half, normed[e - D/2] in the second
      for (int64_t e = 0; e < half; ++e)
        out[e] = bf16_bits(round_bf16(normed[e] * bf16_float(c[e])) + round_bf16(normed[e + half] * bf16_float(sn[e])));
      for (int64_t e = half; e < n; ++e)
        out[e] = bf16_bits(round_bf16(normed[e] * bf16_float(c[e])) + round_bf16(normed[e - half] * bf16_float(sn[e])));
    }
  });
  return {query, key};
}

}  // namespace

TORCH_LIBRARY(inferscale_norm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("qk_norm_rope(Tensor qk, Tensor weight, float eps, Tensor cos, Tensor signed_sin, int heads) -> Tensor[]",
        &qk_norm_rope);
}
