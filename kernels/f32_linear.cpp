// out = x @ W.T + bias for a few float32 rows x [rows, in] (a query's tokens through the retrieval embedder) and a
// float32 weight W [out, in] packed once, on AVX2 and FMA CPUs (issue 22: aten's float32 linear runs through MKL,
// which on the 2-core AMD Zen 3 machine does MiniLM's linears for a 23-token query at 27-40 G multiply-adds/s of
// the ~100 the two cores can do: 7.5 of the query embedding's 12-13 ms).
//
// The classic register tile: 6 rows of x by 16 outputs, 12 float32 accumulators, each step one broadcast of x per
// row and two loads of the packed weight (16 outputs of one in-feature, adjacent). Each output sums its in-features
// in blocks (tile), then + bias: its own numbers, not MKL's (f32_linear.py checks the error against float64).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kCols = 16;  // outputs per packed panel (two 8-lane vectors)
constexpr int64_t kRows = 6;   // rows of x per register tile
constexpr int64_t kBlock = 128; // in-features a chain sums before its block's sum is added

// packed[p][i][j] = W[16 p + j][i] (zero past out): panel p's 16 outputs of in-feature i adjacent.
at::Tensor f32_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "f32_pack: a float32 [out, in] weight expected");
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), panels = (out + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({panels, in, kCols}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) dst[((o / kCols) * in + i) * kCols + o % kCols] = src[o * in + i];
  return packed;
}

// R rows' sums for in-features [i0, i1) of one panel, added to sums [R][16]. noinline, and the loop a do-while
// (i1 > i0): otherwise GCC kept the accumulators on the stack, a store of each per in-feature (28 vs 65-84 G
// multiply-adds/s).
template <int R>
__attribute__((noinline)) void panel_sums(const float* x, int64_t in, const float* panel, int64_t i0, int64_t i1,
                                          float* sums) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t i = i0;
  do {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kCols), w1 = _mm256_loadu_ps(panel + i * kCols + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * in + i);
      acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
    }
  } while (++i < i1);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * kCols, _mm256_add_ps(_mm256_loadu_ps(sums + r * kCols), acc[r][0]));
    _mm256_storeu_ps(sums + r * kCols + 8, _mm256_add_ps(_mm256_loadu_ps(sums + r * kCols + 8), acc[r][1]));
  }
}

// Each output: one chain a block of kBlock in-features, the blocks' sums added in order, then the bias (a single
// chain over 1,536 in-features erred 5x aten's; blocked, as BLAS sums, about as much).
template <int R>
void tile(const float* x, int64_t in, const float* panel, const float* bias, int64_t cols, float* out,
          int64_t out_stride) {
  float sums[R * kCols] = {};
  for (int64_t i0 = 0; i0 < in; i0 += kBlock) panel_sums<R>(x, in, panel, i0, std::min(in, i0 + kBlock), sums);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * out_stride + j] = bias ? sums[r * kCols + j] + bias[j] : sums[r * kCols + j];
}

at::Tensor f32_linear(const at::Tensor& packed, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kFloat &&
              packed.is_contiguous(), "f32_linear: the weight must be packed by f32_pack");
  const int64_t panels = packed.size(0), in = packed.size(1);
  TORCH_CHECK(out_features > (panels - 1) * kCols && out_features <= panels * kCols,
              "f32_linear: out_features ", out_features, " does not match the packed weight's ", panels, " panels");
  TORCH_CHECK(in > 0, "f32_linear: no in-features");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in && x.scalar_type() == at::kFloat,
              "f32_linear: x must be float32 [rows, ", in, "], got ", x.scalar_type(), " ", x.sizes());
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out_features && b.scalar_type() == at::kFloat,
                "f32_linear: bias must be float32 [", out_features, "]");
    bp = b.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0);
  at::Tensor out = at::empty({rows, out_features}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* pk = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // OpenMP itself, not at::parallel_for: this runs on the server's side threads, each pinned to one OpenMP thread
  // (engine/threads.py), and at::parallel_for's first call in a thread from this library reset that thread's count
  // to torch's global one, giving it a pool of its own (a third OpenMP thread on two cores: a single stream's decode
  // step 22-26 -> 32-39 ms through the server). The pragma reads the calling thread's own count.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t c0 = p * kCols, cols = std::min(kCols, out_features - c0);
    const float* panel = pk + p * in * kCols;
    const float* pb = bp ? bp + c0 : nullptr;
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      tile<kRows>(xp + r * in, in, panel, pb, cols, op + r * out_features + c0, out_features);
    const float* xr = xp + r * in;
    float* o = op + r * out_features + c0;
    switch (rows - r) {
      case 1: tile<1>(xr, in, panel, pb, cols, o, out_features); break;
      case 2: tile<2>(xr, in, panel, pb, cols, o, out_features); break;
      case 3: tile<3>(xr, in, panel, pb, cols, o, out_features); break;
      case 4: tile<4>(xr, in, panel, pb, cols, o, out_features); break;
      case 5: tile<5>(xr, in, panel, pb, cols, o, out_features); break;
      default: break;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_f32, m) {
  m.def("f32_pack(Tensor weight) -> Tensor", &f32_pack);
  m.def("f32_linear(Tensor packed, Tensor x, Tensor? bias, int out_features) -> Tensor", &f32_linear);
}
