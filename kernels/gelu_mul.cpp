// gelu_tanh_mul(gate_up, inter): Gemma-3's MLP activation, gelu(gate, approximate="tanh") * up, of the fused
// gate/up product's bf16 rows [.., 2 * inter] (gate first) in ONE call, bit for bit what aten's two calls give.
//
// Why: a 16-row decode step of Gemma-3-270M spent ~0.9 ms in aten's gelu and ~0.3 ms in the mul after it (18 layers,
// each a dispatch, an allocation and a pass over a strided half of the product), where the values need one pass.
// The numbers are aten's by construction: aten's bf16 gelu is a function of the gate's 16 bits alone (each lane
// widened to float32 exactly, Sleef's tanh, rounded to bf16: ATen/native/cpu/Gelu.h), so its 65,536 values are
// computed once by aten's own vectorized gelu and looked up (Sleef's tanh cost ~9 cycles a value: a 16-row decode
// step's 18 calls 0.92 ms on two threads); the product is aten's bf16 vector product (through float32, rounded
// once). Both are the functions aten's kernels run for these dtypes at its AVX512 capability, compiled here at the
// same one (gelu_mul.py sets it and checks the equality on this machine before anything uses the operator).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float, which Gelu.h calls
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Gelu.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "parallel_stealing.h"

namespace {

using Vec = at::vec::Vectorized<c10::BFloat16>;

// inter must be a multiple of this in both builds (gelu_mul.fits): whole vectors of the AVX512 build (32 values) and
// of the AVX2 one (16), so aten never takes its scalar path (std::tanh) for a tail here either.
constexpr int64_t kInterMultiple = 32;
static_assert(kInterMultiple % Vec::size() == 0);

// aten's gelu of every bf16 bit pattern, by aten's own vectorized gelu (elementwise: a lane's result depends on its
// bits alone), built once on first use.
const c10::BFloat16* gelu_table() {
  static const std::vector<c10::BFloat16> table = [] {
    std::vector<c10::BFloat16> t(size_t{1} << 16);
    alignas(64) uint16_t bits[Vec::size()];
    for (uint32_t first = 0; first < (uint32_t{1} << 16); first += Vec::size()) {
      for (int j = 0; j < Vec::size(); ++j) bits[j] = static_cast<uint16_t>(first + j);
      at::native::vectorized_gelu_approximated_with_tanh(Vec::loadu(bits)).store(t.data() + first);
    }
    return t;
  }();
  return table.data();
}

// Values a grain holds: a decode step's 16 rows x 2048 are 16 grains over both threads (one preempted by the server's
// event loop or a client leaves its grains to the other: parallel_stealing.h), one row inline.
constexpr int64_t kGrain = 2048;

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, int64_t inter) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "gelu_tanh_mul: gate_up must be bfloat16");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) == 2 * inter && inter % kInterMultiple == 0,
              "gelu_tanh_mul: gate_up's last dimension must be 2 * inter, inter a multiple of ", kInterMultiple);
  const at::Tensor rows = gate_up.reshape({-1, 2 * inter});
  TORCH_CHECK(rows.stride(1) == 1, "gelu_tanh_mul: gate_up's rows must be contiguous");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  const auto* in = rows.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t n = rows.size(0), stride = rows.stride(0), vectors = inter / Vec::size();
  const c10::BFloat16* table = gelu_table();
  parallel_stealing(0, n * vectors, kGrain / Vec::size(), [&](int64_t begin, int64_t end) {
    alignas(64) c10::BFloat16 gelu[Vec::size()];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / vectors, c = (i % vectors) * Vec::size();
      const c10::BFloat16* gate = in + r * stride + c;
      for (int j = 0; j < Vec::size(); ++j) gelu[j] = table[gate[j].x];
      (Vec::loadu(gelu) * Vec::loadu(in + r * stride + inter + c)).store(o + r * inter + c);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inferscale_gelu, m) {
  m.def("gelu_tanh_mul(Tensor gate_up, int inter) -> Tensor", &gelu_tanh_mul);
}
