#include <type_traits>

#include "ragged_attention.h"

namespace opt::ragged {
namespace {

// e^x for x <= 0 (Cephes' expf polynomial, scaled by 2^n), in plain arithmetic a loop over a block vectorizes
inline float exp_nonpositive_1(float x) {
  x = std::max(x, -87.3365f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (common.h's trick)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;  // 2^n (n >= -126 here)
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// The blocked algorithm of the AVX-512 tiles below in GCC's vector types of 8 floats, built for x86-64-v3 (AVX2 with
// FMA; a plain "avx2" target has none, and its separate multiplies and adds ran prompts slower: benchmark/README.md,
// "A CPU without AVX-512") and the baseline (target_clones): what runs where AVX-512 is not. A tile of more than kFew
// queries takes each key block transposed (kt[c]: dimension c of its 16 keys) and builds 4 queries' 16 scores at a time
// by broadcast multiply-adds; a few queries take each key's score as a dot product. Each query keeps a running softmax
// over the blocks, as the AVX-512 code does, its output in registers (64 dimensions at a time) while it weighs a
// block's values.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }

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
        for (int i = 0; i < cnt; ++i) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int c = 0; c < D; ++c) dot += qt[j][c] * kv_float(kb[i * D + c]);
          s[j][i] = dot;
        }
      }
    } else {
      for (int i = 0; i < kBlock; ++i)
        for (int c = 0; c < D; ++c) kt[c][i] = i < cnt ? kv_float(kb[i * D + c]) : 0.f;
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
      float top = best[j];
      for (int i = 0; i < n; ++i) top = std::max(top, s[j][i]);
      const float scale = best[j] == top ? 1.f : (best[j] == neg_inf ? 0.f : std::exp(best[j] - top));
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < kBlock; ++i) {
        pr[i] = i < n ? exp_nonpositive_1(s[j][i] - top) : 0.f;
        sum += pr[i];
      }
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
