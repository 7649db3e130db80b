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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTileRows = 16;  // weight rows (outputs) per tile
constexpr int64_t kBlock = 32;     // in-features per tile step (16 bf16 pairs)
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

// x [rows, in] as B tiles, 16 activation rows (zero-padded) a group: for group g and in-features block b, the
// 32-bit pair p of row c sits at packed32[((g * blocks + b) * 16 + p) * 16 + c].
void pack_x(const uint32_t* x32, int64_t rows, int64_t in, uint32_t* packed32) {
  const int64_t pairs = in / 2, blocks = in / kBlock, groups = (rows + kCols - 1) / kCols;
  at::parallel_for(0, groups * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t gb = begin; gb < end; ++gb) {
      const int64_t g = gb / blocks, b = gb % blocks;
      uint32_t* dst = packed32 + gb * kCols * (kBlock / 2);
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t row = g * kCols + c;
        for (int64_t p = 0; p < kBlock / 2; ++p)
          dst[p * kCols + c] = row < rows ? x32[row * pairs + b * (kBlock / 2) + p] : 0u;
      }
    }
  });
}

struct Product {
  const c10::BFloat16* w;
  int64_t in, out_features, rows;
  const uint32_t* packed;  // pack_x's layout
  c10::BFloat16* out;      // [rows, out_features]
};

void configure(int64_t tile_rows) {
  TileConfig cfg;
  const auto r = static_cast<uint8_t>(tile_rows);
  cfg.rows[0] = r; cfg.colsb[0] = kCols * 4;          // C0: outputs x activation rows of one group
  cfg.rows[1] = r; cfg.colsb[1] = kCols * 4;          // C1: outputs x the next group's rows
  cfg.rows[2] = r; cfg.colsb[2] = kBlock * 2;         // A: weight rows x one in-features block
  cfg.rows[3] = kBlock / 2; cfg.colsb[3] = kCols * 4; // B0
  cfg.rows[4] = kBlock / 2; cfg.colsb[4] = kCols * 4; // B1
  _tile_loadconfig(&cfg);
}

void store(const float* c, const Product& p, int64_t o, int64_t tile_rows, int64_t group) {
  // Row by activation row: that row's outputs o .. o + tile_rows are contiguous in out.
  for (int64_t col = 0; col < kCols && group * kCols + col < p.rows; ++col) {
    c10::BFloat16* dst = p.out + (group * kCols + col) * p.out_features + o;
    for (int64_t r = 0; r < tile_rows; ++r) dst[r] = c10::BFloat16(c[r * kCols + col]);
  }
}

// Output rows [o, o + tile_rows) for every activation row, two groups of 16 at a time (the weight tile comes
// from memory for the first pair, from L1 for the others); the tiles are configured for tile_rows.
void tile_product(const Product& p, int64_t o, int64_t tile_rows, bool prefetch) {
  const int64_t blocks = p.in / kBlock, groups = (p.rows + kCols - 1) / kCols;
  const int64_t stride = p.in * 2, group_words = blocks * kCols * (kBlock / 2);
  const char* w = reinterpret_cast<const char*>(p.w + o * p.in);
  alignas(64) float c0[kTileRows * kCols], c1[kTileRows * kCols];
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    const uint32_t* b0 = p.packed + g * group_words;
    const uint32_t* b1 = b0 + group_words;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t b = 0; b < blocks; ++b) {
      if (prefetch && g == 0) {
        const char* ahead = w + kAhead * kTileRows * stride + b * kBlock * 2;
        for (int64_t r = 0; r < kTileRows; ++r) _mm_prefetch(ahead + r * stride, _MM_HINT_T0);
      }
      _tile_loadd(2, w + b * kBlock * 2, stride);
      _tile_loadd(3, b0 + b * kCols * (kBlock / 2), kCols * 4);
      _tile_dpbf16ps(0, 2, 3);
      if (pair) {
        _tile_loadd(4, b1 + b * kCols * (kBlock / 2), kCols * 4);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, c0, kCols * 4);
    store(c0, p, o, tile_rows, g);
    if (pair) {
      _tile_stored(1, c1, kCols * 4);
      store(c1, p, o, tile_rows, g + 1);
    }
  }
}

at::Tensor amx_linear(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(amx_permitted(), "amx_linear: the kernel refused AMX tile state");
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2, "amx_linear: weight [out, in] and x [rows, in] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "amx_linear: bf16 only");
  TORCH_CHECK(weight.is_contiguous() && x.is_contiguous(), "amx_linear: contiguous operands only");
  TORCH_CHECK(weight.size(1) == x.size(1), "amx_linear: in-features differ: ", weight.size(1), " vs ", x.size(1));
  TORCH_CHECK(weight.size(1) % kBlock == 0, "amx_linear: in-features must be a multiple of ", kBlock);
  TORCH_CHECK(x.size(0) >= 1, "amx_linear: no rows");
  const int64_t out_features = weight.size(0), in = weight.size(1), rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const int64_t groups = (rows + kCols - 1) / kCols;
  at::Tensor packed = at::empty({groups * kCols * in}, x.options());
  auto* pk = reinterpret_cast<uint32_t*>(packed.data_ptr());
  pack_x(reinterpret_cast<const uint32_t*>(x.data_ptr()), rows, in, pk);
  const Product p{reinterpret_cast<const c10::BFloat16*>(weight.data_ptr()), in, out_features, rows, pk,
                  reinterpret_cast<c10::BFloat16*>(out.data_ptr())};
  const int64_t tiles = out_features / kTileRows;
  // At least ~64 KB of weights per task: a small layer is split once per thread, not into many hand-offs.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kTileRows * in * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    configure(kTileRows);
    for (int64_t t = begin; t < end; ++t) tile_product(p, t * kTileRows, kTileRows, true);
    _tile_release();
  });
  if (const int64_t tail = out_features - tiles * kTileRows) {  // the rows past the last full tile
    configure(tail);
    tile_product(p, tiles * kTileRows, tail, false);
    _tile_release();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_cpu, m) { m.def("amx_linear(Tensor weight, Tensor x) -> Tensor", &amx_linear); }
