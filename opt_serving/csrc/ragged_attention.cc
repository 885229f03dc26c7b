#include <type_traits>

#include "common.h"

using namespace opt;

// Attention of a ragged step: N queries, query i of cache row rows[i] reading that row's entries [0, ends[i]) —
// a running row's newest token (one query), or a run of a prompt's tokens continuing its row (a chunk: query j of
// the run reads one entry more than query j - 1, so the run is causal). Every query's own k/v is in the cache
// already (the step writes them first). A row's first plen[row] entries (whole blocks of a cached prefix) are read
// from the prefix cache's pool, blocks ptab[row, :], instead of the row: rows that share a prefix then read the
// same memory, which stays in the caches for the rows after the first, where copies in each row were each read
// from memory.
//
// Each run is cut into tiles of at most kTile queries; a tile, for one head, goes over the keys a block of 16
// entries at a time: the block is read once for all of its queries, each keeping a running softmax (its max, its
// sum and its output, rescaled when the max grows). Rows of float32 or bfloat16 (as its bits in uint16) entries.
namespace {

constexpr int64_t kTile = 32;   // queries of a run that share each key block
constexpr int64_t kBlock = 16;  // keys a block (the pool's block size must be a multiple of it)
constexpr int64_t kFew = 2;     // tiles of at most this many queries skip the transpose of each key block

struct Item {
  int64_t first, count, row, end0;  // queries first.. first + count - 1 of `row`; query j reads [0, end0 + j)
};

// the runs of the step, cut into tiles
std::vector<Item> tiles(const int32_t* rows, const int32_t* ends, int64_t n, int64_t b_count, int64_t t_max) {
  std::vector<Item> out;
  int64_t i = 0;
  while (i < n) {
    const int64_t row = rows[i], end = ends[i];
    if (row < 0 || row >= b_count || end <= 0 || end > t_max) {  // padding, or a row not stepped: zeros
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < n && j - i < kTile && rows[j] == row && ends[j] == end + (j - i)) ++j;
    out.push_back({i, j - i, row, end});
    i = j;
  }
  return out;
}

template <typename KV>
struct Rows {
  const KV *k, *v;            // [B, H, T, D]
  const KV *pk, *pv;          // [H, P, bs, D]
  const int32_t *ptab, *plen;  // [B, Mp], [B]
  int64_t h_count, t_count, d, p_count, bs, mp;

  // the entries e0.. e0 + 15 of `row`, head h (contiguous: a block never straddles the prefix's end)
  const KV* keys(int64_t row, int64_t h, int64_t e0) const {
    if (e0 < plen[row]) return pk + ((h * p_count + ptab[row * mp + e0 / bs]) * bs + e0 % bs) * d;
    return k + ((row * h_count + h) * t_count + e0) * d;
  }
  const KV* values(int64_t row, int64_t h, int64_t e0) const {
    if (e0 < plen[row]) return pv + ((h * p_count + ptab[row * mp + e0 / bs]) * bs + e0 % bs) * d;
    return v + ((row * h_count + h) * t_count + e0) * d;
  }
};

inline float kv_float(float x) { return x; }
inline float kv_float(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The portable version: one query at a time, two passes over its keys.
template <typename KV>
void tile_portable(const Rows<KV>& r, const float* q, const Item& it, int64_t h, float* out) {
  const int64_t d = r.d, hs = r.h_count * d;
  std::vector<float> scores(it.end0 + it.count);
  for (int64_t j = 0; j < it.count; ++j) {
    const float* qr = q + (it.first + j) * hs + h * d;
    float* o = out + (it.first + j) * hs + h * d;
    const int64_t n = it.end0 + j;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < n; ++e) {
      const KV* kr = r.keys(it.row, h, e - e % kBlock) + (e % kBlock) * d;
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += qr[c] * kv_float(kr[c]);
      scores[e] = dot;
      best = std::max(best, dot);
    }
    float total = 0.f;
    for (int64_t c = 0; c < d; ++c) o[c] = 0.f;
    for (int64_t e = 0; e < n; ++e) {
      const float p = std::exp(scores[e] - best);
      total += p;
      const KV* vr = r.values(it.row, h, e - e % kBlock) + (e % kBlock) * d;
      for (int64_t c = 0; c < d; ++c) o[c] += p * kv_float(vr[c]);
    }
    for (int64_t c = 0; c < d; ++c) o[c] /= total;
  }
}

#if defined(__x86_64__)
#define OPT_AVX512 __attribute__((target("avx512f")))

OPT_AVX512 inline __m512 sum16(const __m512* v) {  // lane i = the sum of v[i]'s lanes
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(3, 1, 3, 1)));
}

OPT_AVX512 inline __m512 exp_nonpositive(__m512 x) {  // e^x, x <= 0: Cephes' expf polynomial, scaled by 2^n
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
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

OPT_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
OPT_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

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

// 16 rows of 16 floats -> their transpose (r[i] lane j -> r[j] lane i)
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
#endif

template <typename KV>
void attend_ragged(const Rows<KV>& r, const float* q, const std::vector<Item>& items, float* out) {
  const int64_t h_count = r.h_count, d = r.d;
#if defined(__x86_64__)
  const bool avx512 = use_avx512();
#else
  const bool avx512 = false;
#endif
  const int64_t work = static_cast<int64_t>(items.size()) * h_count;
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h; tiles later in a run have more keys)
  for (int64_t w = 0; w < work; ++w) {
    // head-major: a head's tiles one after another, so rows sharing a prefix read its blocks for that head (a
    // few hundred KB) from cache, where row-major order cycled every head's blocks through it between two rows
    const Item& it = items[w % items.size()];
    const int64_t h = w / static_cast<int64_t>(items.size());
#if defined(__x86_64__)
    const bool few = it.count <= kFew;
    if (avx512 && d == 64) {
      few ? tile_few_avx512<4>(r, q, it, h, out) : tile_avx512<4>(r, q, it, h, out);
      continue;
    }
    if (avx512 && d == 128) {
      few ? tile_few_avx512<8>(r, q, it, h, out) : tile_avx512<8>(r, q, it, h, out);
      continue;
    }
#endif
    tile_portable(r, q, it, h, out);
  }
}

}  // namespace

// q [N, H, D] float32; k, v [B, H, T, D]; rows, ends [N] int32; pool_k, pool_v [H, P, bs, D] (the cache's type;
// P may be 0); ptab [B, Mp], plen [B] int32 -> [N, H, D] float32 (zeros for a query with no row or no entries)
static ffi::Error RaggedAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> ends, ffi::AnyBuffer pool_k,
                                  ffi::AnyBuffer pool_v, ffi::Buffer<ffi::S32> ptab, ffi::Buffer<ffi::S32> plen,
                                  ffi::ResultBuffer<ffi::F32> out) {
  use_threads();
  auto qd = q.dimensions(), kd = k.dimensions(), pd = pool_k.dimensions(), td = ptab.dimensions();
  const auto kt = k.element_type();
  const bool kv_ok = (kt == ffi::DataType::F32 || kt == ffi::DataType::BF16 || kt == ffi::DataType::U16) &&
                     v.element_type() == kt && pool_k.element_type() == kt && pool_v.element_type() == kt;
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 4 || td.size() != 2 || !kv_ok || kd[1] != qd[1] ||
      kd[3] != qd[2] || v.element_count() != k.element_count() || rows.element_count() != qd[0] ||
      ends.element_count() != qd[0] || pd[0] != qd[1] || pd[3] != qd[2] || pool_v.element_count() !=
      pool_k.element_count() || td[0] != kd[0] || plen.element_count() != kd[0] || pd[2] % kBlock != 0) {
    return ffi::Error::InvalidArgument(
        "opt_ragged_attention: q [N, H, D] float32, k and v [B, H, T, D], rows and ends [N], pool k and v "
        "[H, P, bs, D] (bs a multiple of 16) of the cache's type, ptab [B, Mp] and plen [B] expected");
  }
  const int64_t n = qd[0], b_count = kd[0];
  const int32_t *rw = rows.typed_data(), *en = ends.typed_data(), *pl = plen.typed_data();
  for (int64_t b = 0; b < b_count; ++b) {
    if (pl[b] < 0 || pl[b] > td[1] * pd[2] || pl[b] % pd[2] != 0) {
      return ffi::Error::InvalidArgument("opt_ragged_attention: a row's prefix is not whole pool blocks");
    }
  }
  const std::vector<Item> items = tiles(rw, en, n, b_count, kd[2]);
  float* o = out->typed_data();
  std::fill(o, o + out->element_count(), 0.f);
  auto run = [&](auto* kp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    Rows<KV> r{static_cast<const KV*>(k.untyped_data()), static_cast<const KV*>(v.untyped_data()),
               static_cast<const KV*>(pool_k.untyped_data()), static_cast<const KV*>(pool_v.untyped_data()),
               ptab.typed_data(), pl, qd[1], kd[2], qd[2], pd[1], pd[2], td[1]};
    attend_ragged(r, q.typed_data(), items, o);
  };
  if (kt == ffi::DataType::F32) {
    run(static_cast<const float*>(nullptr));
  } else {
    run(static_cast<const uint16_t*>(nullptr));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptRaggedAttention, OnKernelThread<RaggedAttention>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
