// out = x @ W.T for rows x [rows, in] and a bf16 weight W [out, in]: decode's few-row products (issue 22).
//
// Why a kernel of our own: a decode step reads every weight once, and oneDNN's matmul for these shapes (W as the
// source, read in place) runs each product on ONE thread and reads the layer weights at ~10-12 GB/s where a plain
// reduction reads ~21 GB/s here. This is the same arithmetic -- AMX `tdpbf16ps` with W's rows as the tile rows,
// each output one fp32 accumulator fed the in-features pair by pair in order, rounded to bf16 once -- with the
// output rows split over torch's own thread pool (at::parallel_for, the same OpenMP runtime) and the weight tiles
// two ahead prefetched. The loader uses it only where its outputs are bit for bit F.linear's (checked at load).
//
// Every output element depends only on its own row of x and of W, so a request decoded in a batch gets exactly
// what it gets alone. Any row count works; past ~64 rows oneDNN's blocked matmul is faster (measured on the 2-core
// machine: the 72 layer products at 1 / 16 / 32 / 64 / 128 rows 12 / 15 / 18 / 30 / 41 ms, F.linear 29 / 27 / 30 /
// 37 / 38 ms), so weightmajor gives it decode batches and short prompt chunks only.
//
// The same tiles in int8 (`tdpbssd`, exact int32 sums) read an int8 copy of the LM head for greedy decoding: see
// greedy_screen below and inferscale/models/greedyhead.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTileRows = 16;  // weight rows (outputs) per tile
constexpr int64_t kBlockBytes = 64;  // in-features bytes per tile step (32 bf16 = 16 pairs, 64 int8 = 16 quads)
constexpr int64_t kCols = 16;      // activation rows per column tile
constexpr int64_t kAhead = 2;      // weight tiles prefetched ahead of the one being read

struct TileConfig {  // the layout `ldtilecfg` reads (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// x [rows, row_bytes] as B tiles, 16 activation rows (zero-padded) a group: for group g and 64-byte in-features
// block b, the 32-bit word p (a bf16 pair or an int8 quad) of row c sits at packed32[((g * blocks + b) * 16 + p)
// * 16 + c].
void pack_x(const uint32_t* x32, int64_t rows, int64_t row_bytes, uint32_t* packed32) {
  const int64_t pairs = row_bytes / 4, blocks = row_bytes / kBlockBytes, groups = (rows + kCols - 1) / kCols;
  at::parallel_for(0, groups * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t gb = begin; gb < end; ++gb) {
      const int64_t g = gb / blocks, b = gb % blocks;
      uint32_t* dst = packed32 + gb * kCols * (kBlockBytes / 4);
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t row = g * kCols + c;
        for (int64_t p = 0; p < kBlockBytes / 4; ++p)
          dst[p * kCols + c] = row < rows ? x32[row * pairs + b * (kBlockBytes / 4) + p] : 0u;
      }
    }
  });
}

// One product: bf16 W and x to bf16 outputs (`tdpbf16ps`), or int8 W and x to int32 outputs (`tdpbssd`). Both
// lay a tile row out as 64 bytes of in-features (32 bf16 pairs or 64 int8 quads, as 16 32-bit words), so packing
// and tiling are shared; only the instruction and the stored type differ.
struct Product {
  const char* w;              // [out_features, in] elements of `elem` bytes
  int64_t row_bytes, out_features, rows;
  const uint32_t* packed;  // pack_x's layout
  void* out;               // [rows, out_features]: bf16 or int32
};

// Where a finished tile's accumulators go: each task (a run of weight tiles on one thread) makes its own sink.
// StoreSink writes them to out, as bf16 (rounded once) or int32.
template <bool kInt8>
struct StoreSink {
  const Product& p;
  void tile(const int32_t* c, int64_t o, int64_t tile_rows, int64_t group) {
    // Row by activation row: that row's outputs o .. o + tile_rows are contiguous in out.
    for (int64_t col = 0; col < kCols && group * kCols + col < p.rows; ++col) {
      const int64_t at = (group * kCols + col) * p.out_features + o;
      if constexpr (kInt8) {
        int32_t* dst = static_cast<int32_t*>(p.out) + at;
        for (int64_t r = 0; r < tile_rows; ++r) dst[r] = c[r * kCols + col];
      } else {
        const auto* cf = reinterpret_cast<const float*>(c);
        c10::BFloat16* dst = static_cast<c10::BFloat16*>(p.out) + at;
        for (int64_t r = 0; r < tile_rows; ++r) dst[r] = c10::BFloat16(cf[r * kCols + col]);
      }
    }
  }
  void done() {}
};

void configure(int64_t tile_rows) {
  TileConfig cfg;
  const auto r = static_cast<uint8_t>(tile_rows);
  cfg.rows[0] = r; cfg.colsb[0] = kCols * 4;          // C0: outputs x activation rows of one group
  cfg.rows[1] = r; cfg.colsb[1] = kCols * 4;          // C1: outputs x the next group's rows
  cfg.rows[2] = r; cfg.colsb[2] = kBlockBytes;        // A: weight rows x one in-features block
  cfg.rows[3] = kBlockBytes / 4; cfg.colsb[3] = kCols * 4; // B0
  cfg.rows[4] = kBlockBytes / 4; cfg.colsb[4] = kCols * 4; // B1
  _tile_loadconfig(&cfg);
}

// Output rows [o, o + tile_rows) for every activation row, two groups of 16 at a time (the weight tile comes
// from memory for the first pair, from L1 for the others); the tiles are configured for tile_rows.
template <bool kInt8, typename Sink>
void tile_product(const Product& p, int64_t o, int64_t tile_rows, bool prefetch, Sink& sink) {
  const int64_t blocks = p.row_bytes / kBlockBytes, groups = (p.rows + kCols - 1) / kCols;
  const int64_t stride = p.row_bytes, group_words = blocks * kCols * (kBlockBytes / 4);
  const char* w = p.w + o * p.row_bytes;
  alignas(64) int32_t c0[kTileRows * kCols], c1[kTileRows * kCols];  // fp32 or int32 accumulators, as stored
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    const uint32_t* b0 = p.packed + g * group_words;
    const uint32_t* b1 = b0 + group_words;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t b = 0; b < blocks; ++b) {
      if (prefetch && g == 0) {
        const char* ahead = w + kAhead * kTileRows * stride + b * kBlockBytes;
        for (int64_t r = 0; r < kTileRows; ++r) _mm_prefetch(ahead + r * stride, _MM_HINT_T0);
      }
      _tile_loadd(2, w + b * kBlockBytes, stride);
      _tile_loadd(3, b0 + b * kCols * (kBlockBytes / 4), kCols * 4);
      if constexpr (kInt8) _tile_dpbssd(0, 2, 3); else _tile_dpbf16ps(0, 2, 3);
      if (pair) {
        _tile_loadd(4, b1 + b * kCols * (kBlockBytes / 4), kCols * 4);
        if constexpr (kInt8) _tile_dpbssd(1, 2, 4); else _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, c0, kCols * 4);
    sink.tile(c0, o, tile_rows, g);
    if (pair) {
      _tile_stored(1, c1, kCols * 4);
      sink.tile(c1, o, tile_rows, g + 1);
    }
  }
}

// x @ W.T [rows, out_features] into each task's sink (make_sink()): each thread a run of 16-row weight tiles, then
// the rows past the last one.
template <bool kInt8, typename MakeSink>
void product(const Product& p, MakeSink make_sink) {
  const int64_t tiles = p.out_features / kTileRows;
  // At least ~64 KB of weights per task: a small layer is split once per thread, not into many hand-offs.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kTileRows * p.row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    auto sink = make_sink();
    configure(kTileRows);
    for (int64_t t = begin; t < end; ++t) tile_product<kInt8>(p, t * kTileRows, kTileRows, true, sink);
    _tile_release();
    sink.done();
  });
  if (const int64_t tail = p.out_features - tiles * kTileRows) {
    auto sink = make_sink();
    configure(tail);
    tile_product<kInt8>(p, tiles * kTileRows, tail, false, sink);
    _tile_release();
    sink.done();
  }
}

// The product of weight [out, in] and x [rows, in] (contiguous, checked by the caller) into the sinks make_sink
// makes from the Product; `out`, when defined, is where a StoreSink writes.
template <bool kInt8, typename MakeSink>
void run(const at::Tensor& weight, const at::Tensor& x, at::Tensor out, MakeSink make_sink) {
  const int64_t rows = x.size(0), row_bytes = weight.size(1) * weight.element_size();
  const int64_t groups = (rows + kCols - 1) / kCols;
  at::Tensor packed = at::empty({groups * kCols * row_bytes / 4}, x.options().dtype(at::kInt));
  auto* pk = reinterpret_cast<uint32_t*>(packed.data_ptr());
  pack_x(reinterpret_cast<const uint32_t*>(x.data_ptr()), rows, row_bytes, pk);
  const Product p{static_cast<const char*>(weight.data_ptr()), row_bytes, weight.size(0), rows, pk,
                  out.defined() ? out.data_ptr() : nullptr};
  product<kInt8>(p, [&] { return make_sink(p); });
}

template <bool kInt8>
at::Tensor stored(const at::Tensor& weight, const at::Tensor& x, at::ScalarType out_type) {
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(out_type));
  run<kInt8>(weight, x, out, [](const Product& p) { return StoreSink<kInt8>{p}; });
  return out;
}

at::Tensor amx_linear(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(amx_permitted(), "amx_linear: the kernel refused AMX tile state");
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2, "amx_linear: weight [out, in] and x [rows, in] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "amx_linear: bf16 only");
  TORCH_CHECK(weight.is_contiguous() && x.is_contiguous(), "amx_linear: contiguous operands only");
  TORCH_CHECK(weight.size(1) == x.size(1), "amx_linear: in-features differ: ", weight.size(1), " vs ", x.size(1));
  TORCH_CHECK(weight.size(1) % (kBlockBytes / 2) == 0, "amx_linear: in-features must be a multiple of ",
              kBlockBytes / 2);
  TORCH_CHECK(x.size(0) >= 1, "amx_linear: no rows");
  return stored<false>(weight, x, at::kBFloat16);
}


at::Tensor amx_linear_int8(const at::Tensor& qweight, const at::Tensor& xq) {  // int32 [rows, out], exact
  TORCH_CHECK(amx_permitted(), "amx_linear_int8: the kernel refused AMX tile state");
  TORCH_CHECK(qweight.dim() == 2 && xq.dim() == 2, "amx_linear_int8: weight [out, in] and x [rows, in] expected");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && xq.scalar_type() == at::kChar, "amx_linear_int8: int8 only");
  TORCH_CHECK(qweight.is_contiguous() && xq.is_contiguous(), "amx_linear_int8: contiguous operands only");
  TORCH_CHECK(qweight.size(1) == xq.size(1), "amx_linear_int8: in-features differ: ", qweight.size(1), " vs ",
              xq.size(1));
  TORCH_CHECK(qweight.size(1) % kBlockBytes == 0, "amx_linear_int8: in-features must be a multiple of ", kBlockBytes);
  TORCH_CHECK(xq.size(0) >= 1, "amx_linear_int8: no rows");
  return stored<true>(qweight, xq, at::kInt);
}

#include "greedy_screen.h"  // screen_pack, the bounds and the candidates' filter

at::Tensor greedy_screen(const at::Tensor& qweight, const at::Tensor& stats, const at::Tensor& x) {
  TORCH_CHECK(amx_permitted(), "greedy_screen: the kernel refused AMX tile state");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "greedy_screen: screen_pack's int8 weight expected");
  TORCH_CHECK(qweight.size(0) < (int64_t{1} << 24), "greedy_screen: more vocabulary rows than float32 counts exactly");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == kStats && stats.size(1) == qweight.size(0) &&
              stats.scalar_type() == at::kFloat && stats.is_contiguous(), "greedy_screen: screen_pack's stats expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(0) >= 1,
              "greedy_screen: contiguous bf16 rows x [rows, in] expected");
  TORCH_CHECK(x.size(1) == qweight.size(1), "greedy_screen: in-features differ: ", x.size(1), " vs ", qweight.size(1));
  const int64_t rows = x.size(0), in = x.size(1), vocab = qweight.size(0);
  at::Tensor xq = at::empty({2 * rows, in}, x.options().dtype(at::kChar));
  const std::vector<Quantized> z = quantize_rows(x, xq);
  ScreenResult result;
  result.best.assign(rows, -INFINITY);
  const float gamma = screen_gamma(in);
  const float* st = stats.data_ptr<float>();
  run<true>(qweight, xq, at::Tensor(), [&](const Product&) {
    return ScreenSink{st, vocab, z, gamma, result, std::vector<float>(rows, -INFINITY), {}};
  });
  return screen_candidates(result, x.options());  // [candidates, 2]: (row of x, vocabulary row)
}

}  // namespace

TORCH_LIBRARY(inferscale_cpu, m) {
  m.def("amx_linear(Tensor weight, Tensor x) -> Tensor", &amx_linear);
  m.def("amx_linear_int8(Tensor qweight, Tensor xq) -> Tensor", &amx_linear_int8);
  m.def("screen_pack(Tensor weight) -> Tensor[]", &screen_pack);
  m.def("greedy_screen(Tensor qweight, Tensor stats, Tensor x) -> Tensor", &greedy_screen);
}
