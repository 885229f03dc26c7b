#include "head.h"

using namespace opt;

// ---------------------------------------------------------------------------------------------
// Greedy tokens from the tied LM head, screened in bfloat16 and decided in float32.
//
// A greedy step needs only each row's argmax over the vocabulary, not its logits. At batch 64 on
// OPT-125m the float32 logits product is ~25 ms of a ~104 ms step; on a CPU with AVX512_BF16
// oneDNN runs the same product on bfloat16 copies at twice the rate. Every approximate logit
// a_j lies within r_j of the exact x . w_j, with a bound proven below; only the tokens whose
// interval [a_j - r_j, a_j + r_j] reaches the highest lower bound can be the argmax, and those
// few candidates are scored again exactly (in double), so the token is the float32 argmax's.
//
// The bound. Rounding x and w to bfloat16 (round to nearest, unit roundoff u = 2^-8) moves each
// product x_i w_i by at most (2u + u^2)|x_i w_i|; the float32 sum of K terms (any order, products
// exact in float32) adds at most g_K sum |.|, g_K = K 2^-24 / (1 - K 2^-24). So
// |a_j - x . w_j| <= c_K sum_i |x_i||w_ij| <= c_K ||x|| ||w_j|| (Cauchy-Schwarz), with
// c_K = (2u + u^2)(1 + g_K) + g_K. One more g_K covers the float32 logit a plain product would
// compute (the argmax we stand in for), a factor (1 + 2^-12) the float32 arithmetic of the
// screen itself, and an absolute 1e-30 the flushed denormals. ||w_j|| is computed at packing time (rounded up).
//
//   opt_head_supported()                        1 when oneDNN runs bfloat16 products natively here
//   opt_head_packed_bytes(K, N)                 size of the packed bfloat16 [K, N] head
//   opt_head_pack(e, K, N, out, norms)          e row-major [N, K] float32 (the embedding) -> packed, row norms
//   OptGreedyHead (FFI handler)                 tok[M] = argmax_{j != exclude[M], j allowed} x[M, K] . e[j]
// (`exclude`: a token held back, e.g. EOS before min_new_tokens; -1 for none. `allowed` [M, W] int32, W = 0 or
// ceil(N / 32): structured output's token masks, token j allowed where bit j % 32 of word j / 32 is set; W = 0: every
// token. A row's disallowed tokens are left out as `exclude` is: the token is the float32 argmax over its allowed ones)
namespace {

const dnnl::memory::desc& head_packed_desc(int64_t k, int64_t n) { return packed_desc(k, n, dt::bf16); }

double head_bound_factor(int64_t k) {
  const double u = std::ldexp(1.0, -8), g = k * std::ldexp(1.0, -24) / (1.0 - k * std::ldexp(1.0, -24));
  // the last factor: float32 rounding in the screen's own a_j -/+ r_j (at most ~2^-15 of r_j)
  return ((2 * u + u * u) * (1 + g) + 2 * g) * (1 + std::ldexp(1.0, -12));
}

bool is_allowed(const uint32_t* allowed, int64_t j) { return allowed == nullptr || (allowed[j >> 5] >> (j & 31)) & 1u; }

// The screen's two passes over the vocabulary (bounds_of_block, candidates_of_block) are written out for AVX-512:
// GCC leaves the portable loops' max reductions scalar, and these passes were then most of a screened step's time
// after its product.
#if defined(__x86_64__)
// the lanes of tokens j.. j1 - 1 among the 16 from j
inline __mmask16 lanes(int64_t j, int64_t j1) {
  return j1 - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (j1 - j)) - 1);
}

// rad_j of the 16 tokens from j (those in m; the others 0), summed in Radius's order
__attribute__((target("avx512f"))) inline __m512 radius16(const Radius& rad, int64_t j, __mmask16 m) {
  __m512 r = _mm512_add_ps(_mm512_set1_ps(1e-30f),
                           _mm512_mul_ps(_mm512_set1_ps(rad.w[0]), _mm512_maskz_loadu_ps(m, rad.u[0] + j)));
  r = _mm512_add_ps(r, _mm512_mul_ps(_mm512_set1_ps(rad.w[1]), _mm512_maskz_loadu_ps(m, rad.u[1] + j)));
  return _mm512_add_ps(r, _mm512_mul_ps(_mm512_set1_ps(rad.w[2]), _mm512_maskz_loadu_ps(m, rad.u[2] + j)));
}

// The highest lower bound a_j - rad_j and the highest upper bound a_j + rad_j of tokens j0..j1 - 1.
__attribute__((target("avx512f"))) void bounds_of_block_avx512(const float* a, const Radius& rad, int64_t j0,
                                                                int64_t j1, float* lo_max, float* up_max) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 lo = _mm512_set1_ps(neg_inf), up = lo;
  for (int64_t j = j0; j < j1; j += 16) {
    const __mmask16 m = lanes(j, j1);
    const __m512 r = radius16(rad, j, m);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), m, a + j);
    lo = _mm512_max_ps(lo, _mm512_sub_ps(v, r));
    up = _mm512_max_ps(up, _mm512_add_ps(v, r));
  }
  *lo_max = _mm512_reduce_max_ps(lo);
  *up_max = _mm512_reduce_max_ps(up);
}
#endif

void bounds_of_block(const float* a, const Radius& rad, int64_t j0, int64_t j1, float* lo_max, float* up_max) {
#if defined(__x86_64__)
  if (use_avx512()) return bounds_of_block_avx512(a, rad, j0, j1, lo_max, up_max);
#endif
  float lo = -std::numeric_limits<float>::infinity(), up = lo;
  for (int64_t j = j0; j < j1; ++j) {
    const float r = rad(j);
    lo = std::max(lo, a[j] - r);
    up = std::max(up, a[j] + r);
  }
  *lo_max = lo, *up_max = up;
}

// Appends the tokens j0..j1 - 1 whose upper bound a_j + rad_j reaches `lower`, in order.
#if defined(__x86_64__)
__attribute__((target("avx512f"))) void candidates_of_block_avx512(const float* a, const Radius& rad, int64_t j0,
                                                                    int64_t j1, float lower,
                                                                    std::vector<int64_t>& cand) {
  const __m512 low = _mm512_set1_ps(lower);
  for (int64_t j = j0; j < j1; j += 16) {
    const __mmask16 m = lanes(j, j1);
    const __m512 r = radius16(rad, j, m);
    const __m512 up = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + j), r);
    for (uint32_t hits = _mm512_mask_cmp_ps_mask(m, up, low, _CMP_GE_OQ); hits != 0; hits &= hits - 1) {
      cand.push_back(j + __builtin_ctz(hits));
    }
  }
}
#endif

void candidates_of_block(const float* a, const Radius& rad, int64_t j0, int64_t j1, float lower,
                         std::vector<int64_t>& cand) {
#if defined(__x86_64__)
  if (use_avx512()) return candidates_of_block_avx512(a, rad, j0, j1, lower, cand);
#endif
  for (int64_t j = j0; j < j1; ++j) {
    if (a[j] + rad(j) >= lower) cand.push_back(j);
  }
}

// The row's float32 argmax (the first maximum; a NaN wins, as jnp.argmax) over every token but
// `exclude`, from its screened logits `a` (times `scale`) (ours: the excluded one is set to -inf); `all` scores
// every token exactly (an input the bound does not cover).
__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t head_row(const float* x, float* a, const float* e, int64_t k, int64_t n, const Radius& rad, bool all,
                 int64_t exclude, const uint32_t* allowed, float scale, std::vector<int64_t>& cand) {
  cand.clear();
  if (scale != 1.f) {  // the int8 screen's logits times the row's scale (a no-op multiply skipped)
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) a[j] *= scale;
  }
  if (all) {
    for (int64_t j = 0; j < n; ++j) {
      if (j != exclude && is_allowed(allowed, j)) cand.push_back(j);
    }
  } else {
    if (exclude >= 0 && exclude < n) a[exclude] = -std::numeric_limits<float>::infinity();
    if (allowed != nullptr) {  // a masked row: its disallowed tokens can be no candidate (a word at a time)
      for (int64_t w = 0; w * 32 < n; ++w) {
        if (allowed[w] == 0xFFFFFFFFu) continue;
        for (int64_t j = w * 32, j1 = std::min(n, j + 32); j < j1; ++j) {
          if (!((allowed[w] >> (j & 31)) & 1u)) a[j] = -std::numeric_limits<float>::infinity();
        }
      }
    }
    // pass 1: the highest lower bound, and each block's highest upper bound; pass 2 looks for
    // candidates only in the blocks that reach it (a few of ~200)
    constexpr int64_t kBlock = 256;
    float lower = -std::numeric_limits<float>::infinity();
    float upper_of[(1 << 20) / kBlock];  // V up to 2^20
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
      float lo_max, up_max;
      bounds_of_block(a, rad, j0, j1, &lo_max, &up_max);
      lower = lo_max > lower ? lo_max : lower;
      upper_of[b] = up_max;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      if (!(upper_of[b] >= lower)) continue;
      const int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
      candidates_of_block(a, rad, j0, j1, lower, cand);
    }
  }
  int64_t best = cand.empty() ? 0 : cand[0];
  double best_v = -std::numeric_limits<double>::infinity();
  // the candidates' embedding rows are scattered over the table (where the screen leaves many, as on a random
  // model): the rows a few candidates ahead are prefetched, so their reads overlap the dot products before them
  constexpr size_t kAhead = 4;
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(float));
  for (size_t c = 0; c < cand.size(); ++c) {
    const int64_t j = cand[c];
    if (c + kAhead < cand.size()) {
      const char* ahead = reinterpret_cast<const char*>(e + cand[c + kAhead] * k);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off);
    }
    const double v = dot_exact(x, e + j * k, k);
    if (v != v) return j;  // the first NaN (only reachable through `all`)
    if (v > best_v) best_v = v, best = j;
  }
  return best;
}

}  // namespace

extern "C" int opt_head_supported() { return native_products(dt::bf16, {"bf16", "amx"}); }

extern "C" int64_t opt_head_packed_bytes(int64_t k, int64_t n) {
  try {
    return static_cast<int64_t>(head_packed_desc(k, n).get_size());
  } catch (...) {
    return -1;
  }
}

// e: the float32 embedding, row-major [N, K]. Writes the packed bfloat16 [K, N] head and every
// row's Euclidean norm, rounded up. Returns 2 when e holds a non-finite number (no bound then).
extern "C" int opt_head_pack(const float* e, int64_t k, int64_t n, void* out, float* norms) {
  for (int64_t j = 0; j < n; ++j) {
    const double s = dot_exact(e + j * k, e + j * k, k);
    if (!std::isfinite(s)) return 2;
    norms[j] = std::nextafter(static_cast<float>(std::sqrt(s) * (1 + 1e-7)), std::numeric_limits<float>::infinity());
  }
  return reorder_plain(k, n, /*transposed=*/1, e, out, /*pack=*/true, dt::bf16);
}

int64_t opt::mask_words(const ffi::Buffer<ffi::S32>& allowed, int64_t m, int64_t n) {
  auto d = allowed.dimensions();
  if (d.size() != 2 || d[0] != m) return -1;
  return d[1] == 0 || d[1] == (n + 31) / 32 ? d[1] : -1;
}

static ffi::Error GreedyHead(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> embedding,
                             ffi::Buffer<ffi::F32> norms, ffi::Buffer<ffi::S32> exclude, ffi::Buffer<ffi::S32> allowed,
                             ffi::ResultBuffer<ffi::S32> out) {
  use_threads();
  auto xd = x.dimensions(), ed = embedding.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || xd[1] != ed[1] || norms.element_count() != static_cast<size_t>(ed[0]) ||
      out->element_count() != static_cast<size_t>(xd[0]) || exclude.element_count() != static_cast<size_t>(xd[0])) {
    return ffi::Error::InvalidArgument(
        "opt_greedy_head: x must be [M, K], embedding [N, K], norms [N], exclude and out [M]");
  }
  const int64_t m = xd[0], k = xd[1], n = ed[0], words = mask_words(allowed, xd[0], ed[0]);
  if (n > (1 << 20)) return ffi::Error::InvalidArgument("opt_greedy_head: a vocabulary over 2^20 tokens");
  if (words < 0) return ffi::Error::InvalidArgument("opt_greedy_head: allowed must be [M, 0] or [M, ceil(N / 32)]");
  if (m == 0) return ffi::Error::Success();
  try {
    const dnnl::memory::desc& wd = head_packed_desc(k, n);
    if (packed.size_bytes() != wd.get_size()) {
      return ffi::Error::InvalidArgument("opt_greedy_head: the packed head has " + std::to_string(packed.size_bytes()) +
                                         " bytes, a packed bfloat16 [" + std::to_string(k) + ", " +
                                         std::to_string(n) + "] head " + std::to_string(wd.get_size()));
    }
    dnnl::matmul prim = matmul_for(m, k, n, false, false, dt::bf16);
    // kept between calls: a fresh [M, N] float32 buffer each step is page faults on every step
    static std::vector<uint16_t> xb;
    static std::vector<float> approx;
    xb.resize(m * k);
    approx.resize(m * n);
    const float* xs = x.typed_data();
    std::vector<Radius> rads(m);
    std::vector<char> all(m);
    const double c = head_bound_factor(k);
    const float max_norm = largest(norms.typed_data(), n);
    for (int64_t r = 0; r < m; ++r) {
      const double xn = std::sqrt(dot_exact(xs + r * k, xs + r * k, k));
      all[r] = scored_exactly(xn, max_norm);
      // rounded up past float32's rounding
      rads[r] = Radius{{norms.typed_data(), norms.typed_data(), norms.typed_data()},
                       {static_cast<float>(c * xn * (1 + 1e-6)), 0.f, 0.f}};
      for (int64_t i = 0; i < k; ++i) xb[r * k + i] = all[r] ? 0 : to_bf16(xs[r * k + i]);
    }
    dnnl::engine& eng = cpu_engine();
    dnnl::memory src({{m, k}, dt::bf16, tag::ab}, eng, xb.data());
    dnnl::memory wts(wd, eng, packed.untyped_data());
    dnnl::memory dst({{m, n}, dt::f32, tag::ab}, eng, approx.data());
    dnnl::stream stream(eng);
    prim.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wts}, {DNNL_ARG_DST, dst}});
    stream.wait();
    decide_rows(xs, approx.data(), embedding.typed_data(), m, k, n, rads, all, exclude.typed_data(),
                allowed.typed_data(), words, nullptr, out->typed_data());
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_greedy_head: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptGreedyHead, OnKernelThread<GreedyHead>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// ---------------------------------------------------------------------------------------------
// What both screens share (head.h)

void opt::decide_rows(const float* xs, float* approx, const float* e, int64_t m, int64_t k, int64_t n,
                      const std::vector<Radius>& rads, const std::vector<char>& all, const int32_t* exclude,
                      const int32_t* allowed, int64_t words, const float* row_scale, int32_t* tok) {
#pragma omp parallel
  {
    std::vector<int64_t> cand;
#pragma omp for schedule(dynamic, 1)  // (dynamic: common.h)
    for (int64_t r = 0; r < m; ++r) {
      float* a = approx + r * n;
      const uint32_t* mask = words ? reinterpret_cast<const uint32_t*>(allowed) + r * words : nullptr;
      tok[r] = static_cast<int32_t>(head_row(xs + r * k, a, e, k, n, rads[r], all[r], exclude[r], mask,
                                             row_scale ? row_scale[r] : 1.f, cand));
    }
  }
}

float opt::largest(const float* v, int64_t n) {
  float top = 0.f;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, v[j]);
  return top;
}

bool opt::scored_exactly(double x_norm, float max_norm) { return !std::isfinite(x_norm) || x_norm * max_norm > 1e37; }
