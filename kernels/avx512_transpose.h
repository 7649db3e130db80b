// A 16 x 16 transpose of 32-bit words in AVX512 registers (bf16_linear.cpp packs weights into vectors of 16 outputs
// with it). Included inside the kernel's anonymous namespace.
#pragma once

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
    const __m512i w = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v, w, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v, w, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v2, w2, 0xDD);
  }
}
