// rotate_place: a kv request's memory blocks (and the shared prefix) written straight into its slot of the slot cache,
// each block's keys rotated from the positions it was encoded at to the ones it now occupies, in one pass over the
// bytes (issue 22: the torch path, a cat per layer group, keys to float32, a multiply, two addcmul_, a cast back and
// a copy into the slot, took ~7.7 ms of a k=20 request's question pass on the 2-core Zen 3 machine).
//
// Its numbers are the torch path's (rope.rope_shift): k' = k * cos rounded to float32, then k'[:h] += -k[h:] * sin[:h]
// and k'[h:] += k[:h] * sin[h:] as aten's addcmul_ computes them, one fused multiply-add each (measured: its vector
// loop is contracted), the result rounded to bf16 to nearest even. Built with -ffp-contract=off so that k * cos stays
// a rounded product of its own. rotate_place.py checks that on this machine before
// anything uses it. Values, and sources before `rotated_from` (the prefix, which never moves), are copied as they are.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float as_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t as_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even, NaN to 0x7FC0

// One key row of `dim` values rotated by the (cos, sin) row of its block.
void rotate_row(const uint16_t* k, const float* cos, const float* sin, int64_t dim, uint16_t* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float lo = as_float(k[i]), hi = as_float(k[i + half]);
    out[i] = as_bf16(std::fma(-hi, sin[i], lo * cos[i]));
    out[i + half] = as_bf16(std::fma(lo, sin[i + half], hi * cos[i + half]));
  }
}

// dst_keys[j], dst_values[j]: layer layers[j]'s slot tensors [slots, H, capacity, D] (bf16, contiguous). sources[s]:
// [L, 2, H, T_s, D] bf16 (each token's D values adjacent); its tokens skips[s].. land, in order after the sources
// before it, at positions start.. of `slot`. Sources from rotated_from on have their keys rotated by row
// s - rotated_from of cos and sin ([sources - rotated_from, D] float32).
void rotate_place(at::TensorList dst_keys, at::TensorList dst_values, int64_t slot, int64_t start,
                  at::TensorList sources, at::IntArrayRef skips, at::IntArrayRef layers, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t rotated_from) {
  const int64_t n_layers = static_cast<int64_t>(layers.size()), n_src = static_cast<int64_t>(sources.size());
  TORCH_CHECK(static_cast<int64_t>(dst_keys.size()) == n_layers && static_cast<int64_t>(dst_values.size()) == n_layers,
              "rotate_place: one keys and one values tensor per layer");
  TORCH_CHECK(static_cast<int64_t>(skips.size()) == n_src && rotated_from >= 0 && rotated_from <= n_src,
              "rotate_place: one skip per source, rotated_from within the sources");
  TORCH_CHECK(n_layers > 0 && n_src > 0, "rotate_place: nothing to place");
  const at::Tensor& first = dst_keys[0];
  TORCH_CHECK(first.dim() == 4, "rotate_place: slot tensors must be [slots, H, capacity, D]");
  const int64_t slots = first.size(0), heads = first.size(1), capacity = first.size(2), dim = first.size(3);
  TORCH_CHECK(dim % 2 == 0 && slot >= 0 && slot < slots && start >= 0, "rotate_place: bad slot, start or D");
  for (int64_t j = 0; j < n_layers; ++j)
    for (const at::Tensor& t : {dst_keys[j], dst_values[j]})
      TORCH_CHECK(t.sizes() == first.sizes() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
                  "rotate_place: slot tensors must be contiguous bf16 of one shape");
  std::vector<int64_t> offset(n_src + 1, start);  // source s's first position
  for (int64_t s = 0; s < n_src; ++s) {
    const at::Tensor& t = sources[s];
    TORCH_CHECK(t.dim() == 5 && t.size(1) == 2 && t.size(2) == heads && t.size(4) == dim &&
                t.scalar_type() == at::kBFloat16 && t.stride(4) == 1,
                "rotate_place: sources must be bf16 [L, 2, H, T, D] of the slots' H and D, D contiguous");
    TORCH_CHECK(skips[s] >= 0 && skips[s] <= t.size(3), "rotate_place: skip past a source's tokens");
    for (int64_t l : layers) TORCH_CHECK(l >= 0 && l < t.size(0), "rotate_place: layer ", l, " not in a source");
    offset[s + 1] = offset[s] + t.size(3) - skips[s];
  }
  TORCH_CHECK(offset[n_src] <= capacity, "rotate_place: ", offset[n_src], " positions past the capacity ", capacity);
  const int64_t rotated = n_src - rotated_from;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == rotated &&
              cos.size(1) == dim, "rotate_place: cos and sin must be float32 [rotated sources, D]");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n_layers * n_src, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task / n_src, s = task % n_src;
      const at::Tensor& t = sources[s];
      const auto* src = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
      auto* keys = reinterpret_cast<uint16_t*>(dst_keys[j].data_ptr<at::BFloat16>());
      auto* values = reinterpret_cast<uint16_t*>(dst_values[j].data_ptr<at::BFloat16>());
      const int64_t tokens = t.size(3) - skips[s];
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* k = src + layers[j] * t.stride(0) + h * t.stride(2) + skips[s] * t.stride(3);
        const uint16_t* v = k + t.stride(1);
        const int64_t row = ((slot * heads + h) * capacity + offset[s]) * dim;
        for (int64_t i = 0; i < tokens; ++i) {
          uint16_t* ko = keys + row + i * dim;
          if (s >= rotated_from) {
            const int64_t r = (s - rotated_from) * dim;
            rotate_row(k + i * t.stride(3), cp + r, sp + r, dim, ko);
          } else {
            std::memcpy(ko, k + i * t.stride(3), dim * sizeof(uint16_t));
          }
          std::memcpy(values + row + i * dim, v + i * t.stride(3), dim * sizeof(uint16_t));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(inferscale_inject, m) {
  m.def("rotate_place(Tensor(a!)[] dst_keys, Tensor(b!)[] dst_values, int slot, int start, Tensor[] sources, "
        "int[] skips, int[] layers, Tensor cos, Tensor sin, int rotated_from) -> ()", &rotate_place);
}
