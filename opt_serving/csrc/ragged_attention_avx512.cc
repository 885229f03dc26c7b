#include "avx512.h"
#include "ragged_attention.h"

namespace opt::ragged {

#if defined(__x86_64__)
namespace {

using namespace opt::avx512;

// A few queries for head h (a running row's newest token): each takes a key block's 16 dot products as 16 partial
// vectors summed together by shuffles (sum16), with no transpose of the block to pay for one query.
template <int NV, typename KV>
OPT_AVX512 void tile_few_avx512(const Rows<KV>& r, const float* q, const Item& it, int64_t h, float* out) {
  constexpr int64_t d = 16 * NV;
  const int64_t hs = r.h_count * d;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float p[kBlock];
  for (int64_t j = 0; j < it.count; ++j) {
    const float* qr = q + (it.first + j) * hs + h * d;
    const int64_t n_all = it.end0 + j;
    __m512 qv[NV], a[NV];
    for (int c = 0; c < NV; ++c) {
      qv[c] = _mm512_loadu_ps(qr + 16 * c);
      a[c] = _mm512_setzero_ps();
    }
    float best = neg_inf, total = 0.f;
    for (int64_t e0 = 0; e0 < n_all; e0 += kBlock) {
      const KV* kb = r.keys(it.row, h, e0);
      const KV* vb = r.values(it.row, h, e0);
      const int n = static_cast<int>(std::min<int64_t>(kBlock, n_all - e0));
      __m512 part[kBlock];
      for (int i = 0; i < kBlock; ++i) {
        part[i] = _mm512_setzero_ps();
        if (j == 0) prefetch_run_ahead(r, it.row, h, e0, i, n_all);  // (a second query finds the run in cache)
        if (i >= n) continue;
        for (int c = 0; c < NV; ++c) part[i] = _mm512_fmadd_ps(qv[c], load16(kb + i * d + 16 * c), part[i]);
      }
      const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(neg_inf), sum16(part));
      const float top = std::max(best, _mm512_reduce_max_ps(s));
      const float scale = best == top ? 1.f : (best == neg_inf ? 0.f : std::exp(best - top));
      const __m512 pv = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(
          _mm512_mask_blend_ps(live, _mm512_set1_ps(top), s), _mm512_set1_ps(top))));
      best = top;
      total = total * scale + _mm512_reduce_add_ps(pv);
      _mm512_store_ps(p, pv);
      if (scale != 1.f) {
        for (int c = 0; c < NV; ++c) a[c] = _mm512_mul_ps(a[c], _mm512_set1_ps(scale));
      }
      for (int i = 0; i < n; ++i) {
        const __m512 w = _mm512_set1_ps(p[i]);
        for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(w, load16(vb + i * d + 16 * c), a[c]);
      }
    }
    float* o = out + (it.first + j) * hs + h * d;
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(a[c], inv));
  }
}

// One tile's queries for head h, head_dim 16 * NV. Each key block is transposed once (kt[c]: dimension c of its
// 16 keys), so a query's 16 scores are one vector built by d broadcast FMAs, 8 queries at a time (8 chains keep
// both FMA units busy); the probabilities then weigh the block's values, 4 (or 2) queries at a time, their
// outputs in registers across the block.
template <int NV, typename KV>
OPT_AVX512 void tile_avx512(const Rows<KV>& r, const float* q, const Item& it, int64_t h, float* out) {
  constexpr int64_t d = 16 * NV;
  constexpr int kQ = 8, kG = NV <= 4 ? 4 : 2;  // queries a score pass, queries a value pass
  const int64_t hs = r.h_count * d;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float qt[kTile + kQ][d];   // the tile's queries (zero past them: the passes run whole groups)
  alignas(64) float acc[kTile + kQ][d];
  alignas(64) float pr[kTile + kQ][kBlock];
  alignas(64) float kt[d][kBlock];
  float best[kTile + kQ], total[kTile + kQ], scale[kTile + kQ];
  for (int64_t j = 0; j < kTile + kQ; ++j) {
    const float* src = q + (it.first + j) * hs + h * d;
    for (int c = 0; c < NV; ++c) {
      const __m512 x = j < it.count ? _mm512_loadu_ps(src + 16 * c) : _mm512_setzero_ps();
      _mm512_store_ps(qt[j] + 16 * c, x);
      _mm512_store_ps(acc[j] + 16 * c, _mm512_setzero_ps());
    }
    best[j] = neg_inf;
    total[j] = 0.f;
  }
  const int64_t last = it.end0 + it.count - 1;  // the last query's keys: [0, last)
  for (int64_t e0 = 0; e0 < last; e0 += kBlock) {
    const int cnt = static_cast<int>(std::min<int64_t>(kBlock, last - e0));
    const KV* kb = r.keys(it.row, h, e0);
    const KV* vb = r.values(it.row, h, e0);
    for (int c = 0; c < NV; ++c) {  // kt = the block's keys transposed, dimensions 16c.. at a time
      __m512 rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = i < cnt ? load16(kb + i * d + 16 * c) : _mm512_setzero_ps();
      transpose16(rows);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(kt[16 * c + i], rows[i]);
    }
    const int64_t j0 = std::max<int64_t>(0, e0 + 1 - it.end0);  // the first query with keys in this block
    for (int64_t jb = j0; jb < it.count; jb += kQ) {
      __m512 sc[kQ];
      for (int i = 0; i < kQ; ++i) sc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; ++c) {
        const __m512 kc = _mm512_load_ps(kt[c]);
        for (int i = 0; i < kQ; ++i) sc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qt[jb + i][c]), kc, sc[i]);
      }
      for (int i = 0; i < kQ && jb + i < it.count; ++i) {  // each query's running softmax
        const int64_t j = jb + i;
        const int64_t n = std::min<int64_t>(kBlock, it.end0 + j - e0);  // its keys in the block
        const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
        const __m512 sv = _mm512_mask_blend_ps(live, _mm512_set1_ps(neg_inf), sc[i]);
        const float top = std::max(best[j], _mm512_reduce_max_ps(sv));
        scale[j] = best[j] == top ? 1.f : (best[j] == neg_inf ? 0.f : std::exp(best[j] - top));
        const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(
            _mm512_mask_blend_ps(live, _mm512_set1_ps(top), sv), _mm512_set1_ps(top))));
        best[j] = top;
        total[j] = total[j] * scale[j] + _mm512_reduce_add_ps(p);
        _mm512_store_ps(pr[j], p);
      }
    }
    for (int64_t jb = j0; jb < it.count; jb += kG) {  // acc = acc * scale + p @ V
      __m512 a[kG][NV];
      for (int g = 0; g < kG; ++g) {
        const bool in = jb + g < it.count;
        const __m512 sv = _mm512_set1_ps(in ? scale[jb + g] : 0.f);
        for (int c = 0; c < NV; ++c) a[g][c] = _mm512_mul_ps(_mm512_load_ps(acc[jb + g] + 16 * c), sv);
        if (!in) _mm512_store_ps(pr[jb + g], _mm512_setzero_ps());
      }
      for (int i = 0; i < cnt; ++i) {
        __m512 vr[NV];
        for (int c = 0; c < NV; ++c) vr[c] = load16(vb + i * d + 16 * c);
        for (int g = 0; g < kG; ++g) {
          const __m512 w = _mm512_set1_ps(pr[jb + g][i]);
          for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(w, vr[c], a[g][c]);
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int c = 0; c < NV; ++c) _mm512_store_ps(acc[jb + g] + 16 * c, a[g][c]);
    }
  }
  for (int64_t j = 0; j < it.count; ++j) {
    float* o = out + (it.first + j) * hs + h * d;
    const __m512 inv = _mm512_set1_ps(1.f / total[j]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * c), inv));
  }
}

template <typename KV>
bool tile_any(const Rows<KV>& r, const float* q, const Item& it, int64_t h, float* out) {
  const bool few = it.count <= kFew;
  if (r.d == 64) {
    few ? tile_few_avx512<4>(r, q, it, h, out) : tile_avx512<4>(r, q, it, h, out);
    return true;
  }
  if (r.d == 128) {
    few ? tile_few_avx512<8>(r, q, it, h, out) : tile_avx512<8>(r, q, it, h, out);
    return true;
  }
  return false;
}

}  // namespace

bool tile_avx512(const Rows<float>& r, const float* q, const Item& it, int64_t h, float* out) {
  return tile_any(r, q, it, h, out);
}
bool tile_avx512(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out) {
  return tile_any(r, q, it, h, out);
}
#else
bool tile_avx512(const Rows<float>&, const float*, const Item&, int64_t, float*) { return false; }
bool tile_avx512(const Rows<uint16_t>&, const float*, const Item&, int64_t, float*) { return false; }
#endif

}  // namespace opt::ragged
