#include <type_traits>

#include "ragged_attention.h"

namespace opt::ragged {
namespace {

// The blocked algorithm of the AVX-512 tiles below in GCC's vector types of 8 floats, built for x86-64-v3 (AVX2 with
// FMA; a plain "avx2" target has none, and its separate multiplies and adds ran prompts slower: benchmark/README.md,
// "A CPU without AVX-512") and the baseline (target_clones): what runs where AVX-512 is not. A tile of more than kFew
// queries takes each key block transposed (kt[c]: dimension c of its 16 keys) and builds 4 queries' 16 scores at a time
// by broadcast multiply-adds; a few queries take 8 keys' dot products at a time and sum their lanes together. Each
// query keeps a running softmax over the blocks, as the AVX-512 code does (its max, exponentials and sum on vectors),
// its output in registers (64 dimensions at a time) while it weighs a block's values.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }

typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));
typedef uint16_t u8h __attribute__((vector_size(16)));

// 8 entries of a key as float32 (bfloat16 bits widened)
inline v8 load8_kv(const float* p) { return load8(p); }
inline v8 load8_kv(const uint16_t* p) {
  u8h h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v8>(__builtin_convertvector(h, u8v) << 16);
}

// e^x for x <= 0 on 8 lanes (Cephes' expf polynomial, scaled by 2^n), written on vectors: the same steps written for
// one float in a loop over the block were left scalar by the compiler, a polynomial an entry
inline v8 exp_nonpositive_8(v8 x) {
  const v8 lo = v8{} - 87.3365f;
  x = x < lo ? lo : x;
  const v8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 drops the fraction
  v8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8 p = v8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  const i8v bits = (__builtin_convertvector(n, i8v) + 127) << 23;  // 2^n (n >= -126 here)
  return p * reinterpret_cast<v8>(bits);
}

// pairwise sums of neighbouring lanes of a and b: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
inline v8 hadd8(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// the sums of 8 vectors' lanes: lane i is the sum of a[i]'s (a transposed reduction: 7 adds and 14 shuffles for the
// 8 sums, where a horizontal sum each took 3 adds and 3 shuffles)
inline v8 sums8(const v8* a) {
  const v8 u0 = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3])), u1 = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// kt[c][i0 + i] = block[(i0 + i) * D + c] for 8 keys from i0 and the D dimensions: 8x8 transposes in shuffles, where
// element by element a block's transpose was a load and a store an entry
template <int D, typename KV>
__attribute__((always_inline)) inline void transpose_keys8(const KV* block, int i0, float (*kt)[kBlock]) {
  for (int c = 0; c < D; c += 8) {
    v8 r[8];
    for (int i = 0; i < 8; ++i) r[i] = load8_kv(block + (i0 + i) * D + c);
    v8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {  // interleave neighbouring keys
      t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
      t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {  // then pairs of them: 4 keys' values of a dimension in each 128-bit half
      u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
      u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int x = 0; x < 4; ++x) {  // and the halves of keys 0-3 and 4-7: dimensions c + x and c + x + 4
      store8(kt[c + x] + i0, __builtin_shufflevector(u[x], u[x + 4], 0, 1, 2, 3, 8, 9, 10, 11));
      store8(kt[c + x + 4] + i0, __builtin_shufflevector(u[x], u[x + 4], 4, 5, 6, 7, 12, 13, 14, 15));
    }
  }
}

inline float max8(v8 x) {
  float t[8];
  std::memcpy(t, &x, sizeof t);
  return std::max(std::max(std::max(t[0], t[1]), std::max(t[2], t[3])),
                  std::max(std::max(t[4], t[5]), std::max(t[6], t[7])));
}

inline float sum8(v8 x) {
  float t[8];
  std::memcpy(t, &x, sizeof t);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

template <int D, typename KV>
__attribute__((always_inline)) inline void tile_loops_body(const Rows<KV>& r, const float* q, const Item& it,
                                                           int64_t h, float* out) {
  constexpr int kQ = 4;  // queries a score pass
  const int64_t hs = r.h_count * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool few = it.count <= kFew;
  alignas(64) float qt[kTile + kQ][D], acc[kTile][D], kt[D][kBlock], vf[kBlock][D], s[kTile + kQ][kBlock], pr[kBlock];
  float best[kTile], total[kTile];
  // the tile's queries, then zeros up to the last group of kQ a score pass may read: only those rows, since filling
  // all kTile + kQ of them was most of a one-query decode tile's time over a short context
  const int64_t filled = few ? it.count : it.count + kQ - 1;  // (count <= kTile: within qt)
  for (int64_t j = 0; j < filled; ++j) {
    const float* src = q + (it.first + j) * hs + h * D;
    for (int c = 0; c < D; ++c) qt[j][c] = j < it.count ? src[c] : 0.f;
  }
  for (int64_t j = 0; j < it.count; ++j) {
    for (int c = 0; c < D; ++c) acc[j][c] = 0.f;
    best[j] = neg_inf, total[j] = 0.f;
  }
  const int64_t last = it.end0 + it.count - 1;  // the last query's keys: [0, last)
  for (int64_t e0 = 0; e0 < last; e0 += kBlock) {
    const int cnt = static_cast<int>(std::min<int64_t>(kBlock, last - e0));
    const KV* kb = r.keys(it.row, h, e0);
    const KV* vb = r.values(it.row, h, e0);
    const float* vals = vf[0];  // [cnt, D]: float32 values as they are, bfloat16 ones widened into vf
    if constexpr (std::is_same_v<KV, float>) {
      vals = vb;
    } else {
      for (int i = 0; i < cnt; ++i) {
#pragma omp simd
        for (int c = 0; c < D; ++c) vf[i][c] = kv_float(vb[i * D + c]);
      }
    }
    const int64_t j0 = std::max<int64_t>(0, e0 + 1 - it.end0);  // the first query with keys in this block
    if (few) {
      for (int i = 0; i < kBlock; ++i) prefetch_run_ahead(r, it.row, h, e0, i, last);
      for (int64_t j = j0; j < it.count; ++j) {
        int i = 0;
        for (; i + 8 <= cnt; i += 8) {  // 8 keys' dot products, then their sums at once
          v8 d[8] = {};
          for (int c = 0; c < D; c += 8) {
            const v8 qv = load8(qt[j] + c);
#pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) d[g] += qv * load8_kv(kb + (i + g) * D + c);
          }
          store8(s[j] + i, sums8(d));
        }
        for (; i < cnt; ++i) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int c = 0; c < D; ++c) dot += qt[j][c] * kv_float(kb[i * D + c]);
          s[j][i] = dot;
        }
      }
    } else {
      if (cnt == kBlock) {
        transpose_keys8<D>(kb, 0, kt), transpose_keys8<D>(kb, 8, kt);
      } else {
        for (int i = 0; i < kBlock; ++i)
          for (int c = 0; c < D; ++c) kt[c][i] = i < cnt ? kv_float(kb[i * D + c]) : 0.f;
      }
      for (int64_t jb = j0; jb < it.count; jb += kQ) {
        v8 sc[kQ][2] = {};
        for (int c = 0; c < D; ++c) {
          const v8 k0 = load8(kt[c]), k1 = load8(kt[c] + 8);
          for (int g = 0; g < kQ; ++g) {
            const float x = qt[jb + g][c];
            sc[g][0] += x * k0;
            sc[g][1] += x * k1;
          }
        }
        for (int g = 0; g < kQ; ++g) store8(s[jb + g], sc[g][0]), store8(s[jb + g] + 8, sc[g][1]);
      }
    }
    for (int64_t j = j0; j < it.count; ++j) {  // each query's running softmax, then acc = acc * scale + p @ V
      const int n = static_cast<int>(std::min<int64_t>(kBlock, it.end0 + j - e0));  // its keys in the block
      const i8v lane = {0, 1, 2, 3, 4, 5, 6, 7};
      const i8v in0 = lane < n, in1 = lane + 8 < n;  // the keys it reads (a block's others may hold anything)
      const v8 s0 = load8(s[j]), s1 = load8(s[j] + 8), none = v8{} + neg_inf;
      const v8 m0 = in0 ? s0 : none, m1 = in1 ? s1 : none;
      const float top = std::max(best[j], max8(m0 > m1 ? m0 : m1));
      const float scale = best[j] == top ? 1.f : (best[j] == neg_inf ? 0.f : std::exp(best[j] - top));
      const v8 p0 = in0 ? exp_nonpositive_8(s0 - top) : v8{}, p1 = in1 ? exp_nonpositive_8(s1 - top) : v8{};
      store8(pr, p0), store8(pr + 8, p1);
      const float sum = sum8(p0 + p1);
      best[j] = top;
      total[j] = total[j] * scale + sum;
      for (int c0 = 0; c0 < D; c0 += 64) {
        v8 a[8];
        for (int c = 0; c < 8; ++c) a[c] = load8(acc[j] + c0 + 8 * c) * scale;
        for (int i = 0; i < n; ++i) {
          const float w = pr[i];
          for (int c = 0; c < 8; ++c) a[c] += w * load8(vals + i * D + c0 + 8 * c);
        }
        for (int c = 0; c < 8; ++c) store8(acc[j] + c0 + 8 * c, a[c]);
      }
    }
  }
  for (int64_t j = 0; j < it.count; ++j) {
    float* o = out + (it.first + j) * hs + h * D;
    const float inv = 1.f / total[j];
#pragma omp simd
    for (int c = 0; c < D; ++c) o[c] = acc[j][c] * inv;
  }
}

// one clone set per head size and cache type (target_clones does not take templates)
#define OPT_TILE_LOOPS(NAME, D, KV)                                                                  \
  __attribute__((target_clones("arch=x86-64-v3", "default"))) void NAME(const Rows<KV>& r, const float* q, \
                                                               const Item& it, int64_t h, float* out) { \
    tile_loops_body<D, KV>(r, q, it, h, out);                                                        \
  }
OPT_TILE_LOOPS(tile_loops_64_f32, 64, float)
OPT_TILE_LOOPS(tile_loops_64_bf16, 64, uint16_t)
OPT_TILE_LOOPS(tile_loops_128_f32, 128, float)
OPT_TILE_LOOPS(tile_loops_128_bf16, 128, uint16_t)
#undef OPT_TILE_LOOPS

}  // namespace

bool tile_loops(const Rows<float>& r, const float* q, const Item& it, int64_t h, float* out) {
  if (r.d != 64 && r.d != 128) return false;
  r.d == 64 ? tile_loops_64_f32(r, q, it, h, out) : tile_loops_128_f32(r, q, it, h, out);
  return true;
}

bool tile_loops(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out) {
  if (r.d != 64 && r.d != 128) return false;
  r.d == 64 ? tile_loops_64_bf16(r, q, it, h, out) : tile_loops_128_bf16(r, q, it, h, out);
  return true;
}

}  // namespace opt::ragged
