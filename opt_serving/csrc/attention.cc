#include "avx512.h"

using namespace opt;

// One decode step's attention over the first `read_len` entries of a [B, H, T, D] cache:
// out[b, h] = softmax_t(q[b, h] . k[b, h, t]) @ v[b, h, t] over t < read_len where mask[b, t].
// XLA's dots read the cache's whole static window; this reads only the entries written so
// far (one contiguous [read_len, D] run per row and head), so generate() keeps one
// full-size cache and a step still reads only what it needs. Rows with no valid entry
// (never the case in generate()) get zeros. q may have C rows a cache row (a speculative check's C queries of
// one sequence, each a decode step of its own): q row b reads cache row b / C, with mask row b, where repeating
// the cache C times cost a copy of it per layer. The cache is float32 or bfloat16 (`KV`: float or uint16_t, the
// bfloat16 bits): a bfloat16 cache is half the bytes a step reads, and a step's attention is a read of them.
static inline float kv_float(float x) { return x; }
static inline float kv_float(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Where row-head bh's run of `run` (T x D) values starts in the cache: cache row (bh / h_count) / per, its head
static inline int64_t cache_run(int64_t bh, int64_t h_count, int64_t per, int64_t run) {
  return (bh / h_count / per * h_count + bh % h_count) * run;
}

template <typename KV>
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attend_rows(const float* q, const KV* k, const KV* v, const bool* mask, int64_t b_count,
                        int64_t h_count, int64_t t_count, int64_t d, const int64_t* ends, int64_t per, float* out) {
#pragma omp parallel for schedule(dynamic, 4)  // (dynamic: common.h)
  for (int64_t bh = 0; bh < b_count * h_count; ++bh) {
    const int64_t b = bh / h_count, n = ends[b];
    const int64_t n_next = bh + 1 < b_count * h_count ? ends[(bh + 1) / h_count] : 0;
    const float* qr = q + bh * d;
    const int64_t at = cache_run(bh, h_count, per, t_count * d);
    const KV* kr = k + at;
    const KV* vr = v + at;
    const bool* m = mask + b * t_count;
    float* o = out + bh * d;
    // The next row-head's runs are fetched while this one computes: a run is only n x D floats,
    // short for the hardware prefetcher (OPT-125m shape, 64 rows, 40 entries, from memory: 10-14
    // GB/s without, 11-16 GB/s with, in six interleaved pairs).
    const bool has_next = bh + 1 < b_count * h_count;
    const int64_t at_next = has_next ? cache_run(bh + 1, h_count, per, t_count * d) : at;
    const KV* kn = k + at_next;
    const KV* vn = v + at_next;
    float scores[4096];
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      if (has_next && t < n_next) {
        for (int64_t j = 0; j < d; j += 16) __builtin_prefetch(kn + t * d + j);
      }
      if (!m[t]) continue;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qr[j] * kv_float(kr[t * d + j]);
      scores[t] = dot;
      best = dot > best ? dot : best;
    }
    for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
    if (best == -std::numeric_limits<float>::infinity()) continue;
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      if (has_next && t < n_next) {
        for (int64_t j = 0; j < d; j += 16) __builtin_prefetch(vn + t * d + j);
      }
      if (!m[t]) continue;
      const float p = std::exp(scores[t] - best);
      total += p;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] += p * kv_float(vr[t * d + j]);
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < d; ++j) o[j] *= inv;
  }
}

#if defined(__x86_64__)
// The same for head_dim 16 * NV on AVX-512, vectorised across keys as well as within them: each
// key's q.k is a 16-lane partial sum, and 16 keys' partials are reduced together by transposing
// shuffles (one horizontal sum per key was most of the work); the exponentials are vectorised
// too. From memory at 64 rows x 12 heads x 40 entries it took ~10% less time than the code above
// (it is memory-bound there); with the cache in L2, 2.7x less.
using namespace opt::avx512;

template <int NV, typename KV>
OPT_AVX512 static void attend_rows_avx512(const float* q, const KV* k, const KV* v, const bool* mask,
                                          int64_t b_count, int64_t h_count, int64_t t_count, const int64_t* ends,
                                          int64_t per, float* out) {
  constexpr int64_t d = 16 * NV;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(dynamic, 4)  // (dynamic: common.h)
  for (int64_t bh = 0; bh < b_count * h_count; ++bh) {
    const int64_t b = bh / h_count, n = ends[b];
    const int64_t n_next = bh + 1 < b_count * h_count ? ends[(bh + 1) / h_count] : 0;
    const int64_t at = cache_run(bh, h_count, per, t_count * d);
    const KV* kr = k + at;
    const KV* vr = v + at;
    const bool* m = mask + b * t_count;
    float* o = out + bh * d;
    const bool has_next = bh + 1 < b_count * h_count;  // prefetched as in attend_rows
    const int64_t at_next = has_next ? cache_run(bh + 1, h_count, per, t_count * d) : at;
    const KV* kn = k + at_next;
    const KV* vn = v + at_next;
    alignas(64) float scores[4096];
    __m512 qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + bh * d + 16 * i);
    __m512 best = _mm512_set1_ps(neg_inf);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - t0));
      __m512 part[16];
      __mmask16 valid = 0;
      for (int i = 0; i < 16; ++i) {
        part[i] = _mm512_setzero_ps();
        if (i >= count) continue;
        const KV* kt = kr + (t0 + i) * d;
        if (has_next && t0 + i < n_next) {
          for (int j = 0; j < NV; ++j) __builtin_prefetch(kn + (t0 + i) * d + 16 * j);
        }
        for (int j = 0; j < NV; ++j) part[i] = _mm512_fmadd_ps(qv[j], load16(kt + 16 * j), part[i]);
        valid |= static_cast<__mmask16>(m[t0 + i] ? 1u << i : 0u);
      }
      const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(neg_inf), sum16(part));
      _mm512_store_ps(scores + t0, s);
      best = _mm512_max_ps(best, s);
    }
    const float top = _mm512_reduce_max_ps(best);
    if (top == neg_inf) {  // nothing valid to attend to
      for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
      continue;
    }
    const __m512 top_v = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  // probabilities, 0 for masked keys
      const __mmask16 live = n - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t0)) - 1);
      const __m512 s = _mm512_load_ps(scores + t0);
      const __mmask16 ok = _mm512_cmp_ps_mask(s, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ) & live;
      const __m512 p = _mm512_maskz_mov_ps(ok, exp_nonpositive(_mm512_sub_ps(_mm512_mask_blend_ps(ok, top_v, s), top_v)));
      _mm512_store_ps(scores + t0, p);
      total = _mm512_add_ps(total, p);
    }
    __m512 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (has_next && t < n_next) {
        for (int j = 0; j < NV; ++j) __builtin_prefetch(vn + t * d + 16 * j);
      }
      if (scores[t] == 0.f) continue;  // masked (its v may be anything) or underflowed
      const __m512 p = _mm512_set1_ps(scores[t]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(p, load16(vr + t * d + 16 * j), acc[j]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], inv));
  }
}
#endif

template <typename KV>
static void attend(const float* q, const KV* k, const KV* v, const bool* mask, int64_t b_count, int64_t h_count,
                   int64_t t_count, int64_t d, const int64_t* ends, int64_t per, float* out) {
#if defined(__x86_64__)
  const bool avx512 = use_avx512();
  if (avx512 && d == 64) return attend_rows_avx512<4>(q, k, v, mask, b_count, h_count, t_count, ends, per, out);
  if (avx512 && d == 128) return attend_rows_avx512<8>(q, k, v, mask, b_count, h_count, t_count, ends, per, out);
#endif
  attend_rows(q, k, v, mask, b_count, h_count, t_count, d, ends, per, out);
}

// k and v: float32 or bfloat16 (as such or as its bits in uint16: the model's bfloat16 cache), both the same
static ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> read_len,
                                  ffi::ResultBuffer<ffi::F32> out) {
  use_threads();
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  const auto kt = k.element_type();
  if (qd.size() != 3 || kd.size() != 4 || md.size() != 2 || kd[0] < 1 || qd[0] % kd[0] != 0 || kd[1] != qd[1] ||
      kd[3] != qd[2] || md[0] != qd[0] || md[1] != kd[2] || v.element_count() != k.element_count() ||
      v.element_type() != kt ||
      (kt != ffi::DataType::F32 && kt != ffi::DataType::BF16 && kt != ffi::DataType::U16)) {
    return ffi::Error::InvalidArgument(
        "opt_decode_attention: q [B * C, H, D] float32, k and v [B, H, T, D] both float32 or both bfloat16, "
        "mask [B * C, T] expected");
  }
  const int64_t t_count = kd[2];
  if (t_count > 4096) return ffi::Error::InvalidArgument("opt_decode_attention: at most 4096 entries");
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(read_len.typed_data()[0], t_count));
  // Each row reads up to its own last valid entry: rows of a step hold contexts of different lengths (a
  // long prompt beside short ones), and reading all of them to the longest one's end read up to twice the
  // bytes. The mask is B x n bools, read once here.
  std::vector<int64_t> ends(qd[0]);
  const bool* mk = mask.typed_data();
  for (int64_t b = 0; b < qd[0]; ++b) {
    int64_t e = n;
    while (e > 0 && !mk[b * t_count + e - 1]) --e;
    ends[b] = e;
  }
  const void *kp = k.untyped_data(), *vp = v.untyped_data();
  if (kt != ffi::DataType::F32) {
    attend(q.typed_data(), static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp), mk, qd[0], qd[1],
           t_count, qd[2], ends.data(), qd[0] / kd[0], out->typed_data());
  } else {
    attend(q.typed_data(), static_cast<const float*>(kp), static_cast<const float*>(vp), mk, qd[0], qd[1], t_count,
           qd[2], ends.data(), qd[0] / kd[0], out->typed_data());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptDecodeAttention, OnKernelThread<DecodeAttention>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
