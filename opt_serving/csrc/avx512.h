// AVX-512 helpers the attention kernels share (attention.cc, ragged_attention_avx512.cc): callers check use_avx512().
#pragma once

#include "common.h"

#if defined(__x86_64__)
namespace opt::avx512 {

#define OPT_AVX512 __attribute__((target("avx512f")))

// 16 vectors -> one vector of their sums (lane i = the sum of v[i]'s lanes)
OPT_AVX512 inline __m512 sum16(const __m512* v) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for the pair (a, b)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: one partial sum for each of 4 vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // add the four 128-bit lanes, vectors 4i..4i+3 landing in lane i
  const __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for x <= 0 (a score minus the row's maximum): Cephes' expf polynomial, scaled by 2^n
OPT_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 rows of 16 floats (or any 32-bit lanes) -> their transpose (r[i] lane j -> r[j] lane i)
OPT_AVX512 inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, 4 + i, 8 + i, 12 + i
    t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], _MM_SHUFFLE(3, 1, 3, 1));
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// 16 cache entries -> float32 lanes
OPT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
OPT_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

}  // namespace opt::avx512
#endif
