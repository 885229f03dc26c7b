// CPU kernels as XLA FFI custom calls: oneDNN matrix products with pre-packed weights,
// a fast argmax and a decode attention. Built by build.sh; opt_serving/model/cpu_kernels.py loads it.
//
// Why: XLA CPU's GEMMs take the weights as a plain [K, N] runtime argument and
// re-pack them on every call. A decode step multiplies a few rows by every weight
// of the model, so that packing is most of its memory traffic. oneDNN's matmul
// reads weights already in its blocked layout; we pack them once at load time
// (opt_onednn_pack) and every step streams them as they lie.
//
// Exposed:
//   opt_onednn_packed_bytes(K, N)             size of a packed [K, N] float32 weight
//   opt_onednn_pack(w, K, N, transposed, out)  w row-major [K, N] (or [N, K] when transposed)
//   opt_onednn_unpack(packed, K, N, transposed, w)  the reverse
//   OptOnednnMatmul (FFI handler)             y[M, N] = x[M, K] @ W (+ bias[N]) (relu)
//   OptArgmax (FFI handler)                   jnp.argmax(x[B, V], -1) as int32, at memory speed
//   OptDecodeAttention (FFI handler)          a decode step's attention over a cache's first entries
//   OptGreedyHead (FFI handler)               greedy tokens from the LM head, screened in bfloat16 (below)
// The packed layout is the one oneDNN's matmul picks for kPackRows rows; it is worked
// out the same way on both sides, so a packed buffer is only valid in the process
// (same oneDNN, same CPU) that made it. Nothing packed is ever written to disk.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

namespace {

constexpr int64_t kPackRows = 32;  // the rows the weight layout is chosen for (the same BA16a64b for 16-128 here)

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

std::mutex mu;  // guards the two caches below (XLA may call from several threads)
// One product at a time: each already uses every core (OpenMP), and XLA may start
// independent ones together from its own threads.
std::mutex run_mu;

// Threads for every parallel region we start or oneDNN starts for us (0: OpenMP's default). Set
// from Python (cpu_kernels.threads()): XLA's own pool ignores OMP_NUM_THREADS, and a Ray worker
// has it set to its CPU reservation (1 for a Serve replica), which would leave our kernels on one
// core while XLA uses all. OpenMP keeps the count per calling thread, so each handler sets it for
// the XLA thread that calls it.
std::atomic<int> threads{0};

void use_threads() {
  const int n = threads.load(std::memory_order_relaxed);
  if (n > 0 && omp_get_max_threads() != n) omp_set_num_threads(n);
}

// The layout oneDNN's matmul picks for a [K, N] weight of type `in` (float32 products, or the
// greedy head's bfloat16 ones; float32 results either way).
const dnnl::memory::desc& packed_desc(int64_t k, int64_t n, dt in = dt::f32) {
  static std::map<std::tuple<int64_t, int64_t, dt>, dnnl::memory::desc> descs;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(k, n, in);
  auto it = descs.find(key);
  if (it == descs.end()) {
    dnnl::memory::desc src({kPackRows, k}, in, tag::ab);
    dnnl::memory::desc w({k, n}, in, tag::any);
    dnnl::memory::desc dst({kPackRows, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(cpu_engine(), src, w, dst);
    it = descs.emplace(key, pd.weights_desc()).first;
  }
  return it->second;
}

using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool>;  // m, k, n, bias, relu

dnnl::matmul matmul_for(int64_t m, int64_t k, int64_t n, bool bias, bool relu) {
  const dnnl::memory::desc& w = packed_desc(k, n);
  static std::map<Key, dnnl::matmul> prims;
  std::lock_guard<std::mutex> lock(mu);
  Key key{m, k, n, bias, relu};
  auto it = prims.find(key);
  if (it == prims.end()) {
    dnnl::primitive_attr attr;
    if (relu) {
      dnnl::post_ops ops;
      ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
      attr.set_post_ops(ops);
    }
    dnnl::memory::desc src({m, k}, dt::f32, tag::ab);
    dnnl::memory::desc dst({m, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd =
        bias ? dnnl::matmul::primitive_desc(cpu_engine(), src, w,
                                            dnnl::memory::desc({1, n}, dt::f32, tag::ab), dst, attr)
             : dnnl::matmul::primitive_desc(cpu_engine(), src, w, dst, attr);
    it = prims.emplace(key, dnnl::matmul(pd)).first;
  }
  return it->second;
}

// A few rows (a decode step at batch 1-4) over the BA16a64b layout oneDNN packs these weights
// in: oneDNN's kernels take ~15% longer than XLA's matrix-vector products there, and such a
// step is a plain stream over the weights. In that layout the 64 columns of block nb are
// contiguous [K_padded, 64] rows: entry (k, n) sits at (n / 64) * K_padded * 64 + k * 64 + n % 64.
constexpr int64_t kSmallRows = 4;

bool streams_as_rows(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a64b);
}

// M is a template argument so the accumulators stay in registers.
template <int M>
__attribute__((target_clones("avx512f", "avx2", "default")))
void small_rows(const float* x, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                float* y) {
  const int64_t k_padded = (k + 15) / 16 * 16, blocks = (n + 63) / 64;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    float acc[M][64] = {};
    const float* block = w + nb * k_padded * 64;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* row = block + kk * 64;
      for (int r = 0; r < M; ++r) {
        const float xv = x[r * k + kk];
#pragma omp simd
        for (int j = 0; j < 64; ++j) acc[r][j] += xv * row[j];
      }
    }
    const int64_t n0 = nb * 64, cols = std::min<int64_t>(64, n - n0);
    for (int r = 0; r < M; ++r) {
      for (int64_t j = 0; j < cols; ++j) {
        float v = acc[r][j] + (bias ? bias[n0 + j] : 0.f);
        y[r * n + n0 + j] = relu && v < 0.f ? 0.f : v;
      }
    }
  }
}

void small_rows(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias,
                bool relu, float* y) {
  switch (m) {
    case 1: return small_rows<1>(x, k, n, w, bias, relu, y);
    case 2: return small_rows<2>(x, k, n, w, bias, relu, y);
    case 3: return small_rows<3>(x, k, n, w, bias, relu, y);
    default: return small_rows<4>(x, k, n, w, bias, relu, y);
  }
}

}  // namespace

extern "C" void opt_cpu_kernels_set_threads(int n) { threads.store(n); }

// The size of the team a kernel called from this thread runs with (for tests).
extern "C" int opt_cpu_kernels_team_size() {
  use_threads();
  int size = 0;
#pragma omp parallel
  {
#pragma omp single
    size = omp_get_num_threads();
  }
  return size;
}

extern "C" int64_t opt_onednn_packed_bytes(int64_t k, int64_t n) {
  try {
    return static_cast<int64_t>(packed_desc(k, n).get_size());
  } catch (...) {
    return -1;
  }
}

// Copy between the plain row-major float32 [K, N] (or [N, K], transposed) layout and the packed one
// (of type `packed_type`: oneDNN rounds to nearest even going to bfloat16).
static int reorder_plain(int64_t k, int64_t n, int transposed, const void* from, void* to, bool pack,
                         dt packed_type = dt::f32) {
  try {
    dnnl::memory::desc plain({k, n}, dt::f32, transposed ? tag::ba : tag::ab);
    const dnnl::memory::desc& packed = packed_desc(k, n, packed_type);
    dnnl::memory src(pack ? plain : packed, cpu_engine(), const_cast<void*>(from));
    dnnl::memory dst(pack ? packed : plain, cpu_engine(), to);
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
    return 0;
  } catch (...) {
    return 1;
  }
}

extern "C" int opt_onednn_pack(const float* w, int64_t k, int64_t n, int transposed, void* out) {
  return reorder_plain(k, n, transposed, w, out, true);
}

extern "C" int opt_onednn_unpack(const void* packed, int64_t k, int64_t n, int transposed, float* w) {
  return reorder_plain(k, n, transposed, packed, w, false);
}

static ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> bias,
                         ffi::ResultBuffer<ffi::F32> y, bool relu) {
  use_threads();
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) {
    return ffi::Error::InvalidArgument("opt_onednn_matmul: x must be [M, K] and y [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  const bool has_bias = bias.element_count() > 0;
  if (has_bias && static_cast<int64_t>(bias.element_count()) != n) {
    return ffi::Error::InvalidArgument("opt_onednn_matmul: bias must have N entries");
  }
  if (m == 0) return ffi::Error::Success();
  try {
    const dnnl::memory::desc& wd = packed_desc(k, n);
    if (packed.size_bytes() != wd.get_size()) {
      return ffi::Error::InvalidArgument(
          "opt_onednn_matmul: the packed weight has " + std::to_string(packed.size_bytes()) +
          " bytes, a packed [" + std::to_string(k) + ", " + std::to_string(n) + "] weight " +
          std::to_string(wd.get_size()));
    }
    if (m <= kSmallRows && streams_as_rows(wd, k, n)) {
      std::lock_guard<std::mutex> lock(run_mu);
      small_rows(x.typed_data(), m, k, n, static_cast<const float*>(packed.untyped_data()),
                 has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
    dnnl::matmul prim = matmul_for(m, k, n, has_bias, relu);
    dnnl::engine& eng = cpu_engine();
    dnnl::memory src({{m, k}, dt::f32, tag::ab}, eng, x.typed_data());
    dnnl::memory wts(wd, eng, packed.untyped_data());
    dnnl::memory dst({{m, n}, dt::f32, tag::ab}, eng, y->typed_data());
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wts}, {DNNL_ARG_DST, dst}};
    if (has_bias) {
      args.emplace(DNNL_ARG_BIAS, dnnl::memory({{1, n}, dt::f32, tag::ab}, eng, bias.typed_data()));
    }
    std::lock_guard<std::mutex> lock(run_mu);
    dnnl::stream stream(eng);
    prim.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_onednn_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

// The index of each row's maximum: the first one, and a NaN (the first) wins, as jnp.argmax.
// XLA CPU's own argmax (a variadic reduce) and its TopK with k=1 both run at ~1.5 ns an
// element. One vectorised pass per row takes each chunk's maximum (and notes the first chunk
// holding a NaN); only the winning chunk is scanned again for the first index holding it.
constexpr int64_t kArgmaxChunk = 1024;

__attribute__((target_clones("avx512f", "avx2", "default")))
static int64_t row_argmax(const float* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0, nan_chunk = -1;
  for (int64_t c = 0; c * kArgmaxChunk < v && nan_chunk < 0; ++c) {
    const float* x = row + c * kArgmaxChunk;
    const int64_t n = std::min(kArgmaxChunk, v - c * kArgmaxChunk);
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
      m = x[i] > m ? x[i] : m;
      nan |= x[i] != x[i];
    }
    if (nan) nan_chunk = c;
    else if (m > best) best = m, best_chunk = c;  // strictly greater: the first chunk keeps a tie
  }
  const int64_t c = nan_chunk >= 0 ? nan_chunk : best_chunk;
  const float* x = row + c * kArgmaxChunk;
  const int64_t n = std::min(kArgmaxChunk, v - c * kArgmaxChunk);
  for (int64_t i = 0; i < n; ++i) {
    if (nan_chunk >= 0 ? x[i] != x[i] : x[i] == best) return c * kArgmaxChunk + i;
  }
  return 0;  // every entry -inf: best stays -inf and the first entry equals it, so not reached
}

static ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  use_threads();
  auto d = x.dimensions();
  if (d.size() != 2 || out->element_count() != static_cast<size_t>(d[0])) {
    return ffi::Error::InvalidArgument("opt_argmax: x must be [B, V] and out [B]");
  }
  const int64_t rows = d[0], v = d[1];
  const float* data = x.typed_data();
  int32_t* idx = out->typed_data();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) idx[r] = static_cast<int32_t>(row_argmax(data + r * v, v));
  return ffi::Error::Success();
}

// One decode step's attention over the first `read_len` entries of a [B, H, T, D] cache:
// out[b, h] = softmax_t(q[b, h] . k[b, h, t]) @ v[b, h, t] over t < read_len where mask[b, t].
// XLA's dots read the cache's whole static window; this reads only the entries written so
// far (one contiguous [read_len, D] run per row and head), so generate() keeps one
// full-size cache and a step still reads only what it needs. Rows with no valid entry
// (never the case in generate()) get zeros.
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attend_rows(const float* q, const float* k, const float* v, const bool* mask, int64_t b_count,
                        int64_t h_count, int64_t t_count, int64_t d, int64_t n, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < b_count * h_count; ++bh) {
    const int64_t b = bh / h_count;
    const float* qr = q + bh * d;
    const float* kr = k + bh * t_count * d;
    const float* vr = v + bh * t_count * d;
    const bool* m = mask + b * t_count;
    float* o = out + bh * d;
    // The next row-head's runs are fetched while this one computes: a run is only n x D floats,
    // short for the hardware prefetcher (OPT-125m shape, 64 rows, 40 entries, from memory: 10-14
    // GB/s without, 11-16 GB/s with, in six interleaved pairs).
    const bool has_next = bh + 1 < b_count * h_count;
    const float* kn = kr + t_count * d;
    const float* vn = vr + t_count * d;
    float scores[4096];
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      if (has_next) {
        for (int64_t j = 0; j < d; j += 16) __builtin_prefetch(kn + t * d + j);
      }
      if (!m[t]) continue;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < d; ++j) dot += qr[j] * kr[t * d + j];
      scores[t] = dot;
      best = dot > best ? dot : best;
    }
    for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
    if (best == -std::numeric_limits<float>::infinity()) continue;
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      if (has_next) {
        for (int64_t j = 0; j < d; j += 16) __builtin_prefetch(vn + t * d + j);
      }
      if (!m[t]) continue;
      const float p = std::exp(scores[t] - best);
      total += p;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] += p * vr[t * d + j];
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
#define OPT_AVX512 __attribute__((target("avx512f")))

// 16 vectors -> one vector of their sums (lane i = the sum of v[i]'s lanes)
OPT_AVX512 static inline __m512 sum16(const __m512* v) {
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
OPT_AVX512 static inline __m512 exp_nonpositive(__m512 x) {
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

template <int NV>
OPT_AVX512 static void attend_rows_avx512(const float* q, const float* k, const float* v, const bool* mask,
                                          int64_t b_count, int64_t h_count, int64_t t_count, int64_t n, float* out) {
  constexpr int64_t d = 16 * NV;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < b_count * h_count; ++bh) {
    const int64_t b = bh / h_count;
    const float* kr = k + bh * t_count * d;
    const float* vr = v + bh * t_count * d;
    const bool* m = mask + b * t_count;
    float* o = out + bh * d;
    const bool has_next = bh + 1 < b_count * h_count;  // prefetched as in attend_rows
    const float* kn = kr + t_count * d;
    const float* vn = vr + t_count * d;
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
        const float* kt = kr + (t0 + i) * d;
        if (has_next) {
          for (int j = 0; j < NV; ++j) __builtin_prefetch(kn + (t0 + i) * d + 16 * j);
        }
        for (int j = 0; j < NV; ++j) part[i] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kt + 16 * j), part[i]);
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
      if (has_next) {
        for (int j = 0; j < NV; ++j) __builtin_prefetch(vn + t * d + 16 * j);
      }
      if (scores[t] == 0.f) continue;  // masked (its v may be anything) or underflowed
      const __m512 p = _mm512_set1_ps(scores[t]);
      for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + t * d + 16 * j), acc[j]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], inv));
  }
}
#endif

static ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                  ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> read_len,
                                  ffi::ResultBuffer<ffi::F32> out) {
  use_threads();
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || md.size() != 2 || kd[0] != qd[0] || kd[1] != qd[1] ||
      kd[3] != qd[2] || md[0] != qd[0] || md[1] != kd[2] || v.element_count() != k.element_count()) {
    return ffi::Error::InvalidArgument(
        "opt_decode_attention: q [B, H, D], k and v [B, H, T, D], mask [B, T] expected");
  }
  const int64_t t_count = kd[2];
  if (t_count > 4096) return ffi::Error::InvalidArgument("opt_decode_attention: at most 4096 entries");
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(read_len.typed_data()[0], t_count));
  std::lock_guard<std::mutex> lock(run_mu);
#if defined(__x86_64__)
  // OPT_SERVING_NO_AVX512 (any value): the portable code (tests compare the two)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && std::getenv("OPT_SERVING_NO_AVX512") == nullptr;
  if (avx512 && qd[2] == 64) {
    attend_rows_avx512<4>(q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(), qd[0], qd[1], t_count,
                          n, out->typed_data());
    return ffi::Error::Success();
  }
  if (avx512 && qd[2] == 128) {
    attend_rows_avx512<8>(q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(), qd[0], qd[1], t_count,
                          n, out->typed_data());
    return ffi::Error::Success();
  }
#endif
  attend_rows(q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(), qd[0], qd[1], t_count,
              qd[2], n, out->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptArgmax, Argmax,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("relu"));

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
//   OptGreedyHead (FFI handler)                 tok[M] = argmax_{j != exclude[M]} x[M, K] . e[j]
// (`exclude`: a token held back, e.g. EOS before min_new_tokens; -1 for none)
namespace {

const dnnl::memory::desc& head_packed_desc(int64_t k, int64_t n) { return packed_desc(k, n, dt::bf16); }

dnnl::matmul head_matmul_for(int64_t m, int64_t k, int64_t n) {
  const dnnl::memory::desc& w = head_packed_desc(k, n);
  static std::map<std::tuple<int64_t, int64_t, int64_t>, dnnl::matmul> prims;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(m, k, n);
  auto it = prims.find(key);
  if (it == prims.end()) {
    dnnl::memory::desc src({m, k}, dt::bf16, tag::ab), dst({m, n}, dt::f32, tag::ab);
    it = prims.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(cpu_engine(), src, w, dst))).first;
  }
  return it->second;
}

double head_bound_factor(int64_t k) {
  const double u = std::ldexp(1.0, -8), g = k * std::ldexp(1.0, -24) / (1.0 - k * std::ldexp(1.0, -24));
  // the last factor: float32 rounding in the screen's own a_j -/+ r_j (at most ~2^-15 of r_j)
  return ((2 * u + u * u) * (1 + g) + 2 * g) * (1 + std::ldexp(1.0, -12));
}

uint16_t to_bf16(float f) {  // round to nearest even; finite inputs only (the caller checks)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
double dot_exact(const float* x, const float* w, int64_t k) {
  double s = 0.0;  // each float product is exact in double; the sum's order does not matter at this precision
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += static_cast<double>(x[i]) * w[i];
  return s;
}

// The row's float32 argmax (the first maximum; a NaN wins, as jnp.argmax) over every token but
// `exclude`, from its screened logits `a` (ours: the excluded one is set to -inf); `all` scores
// every token exactly (an input the bound does not cover).
__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t head_row(const float* x, float* a, const float* e, const float* norms, int64_t k, int64_t n,
                 float r, bool all, int64_t exclude, std::vector<int64_t>& cand) {
  cand.clear();
  if (all) {
    for (int64_t j = 0; j < n; ++j) {
      if (j != exclude) cand.push_back(j);
    }
  } else {
    if (exclude >= 0 && exclude < n) a[exclude] = -std::numeric_limits<float>::infinity();
    // pass 1: the highest lower bound, and each block's highest upper bound; pass 2 looks for
    // candidates only in the blocks that reach it (a few of ~200)
    constexpr int64_t kBlock = 256;
    float lower = -std::numeric_limits<float>::infinity();
    float upper_of[(1 << 20) / kBlock];  // V up to 2^20
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j0 = b * kBlock, j1 = std::min(n, j0 + kBlock);
      float lo_max = -std::numeric_limits<float>::infinity(), up_max = lo_max;
#pragma omp simd reduction(max : lo_max, up_max)
      for (int64_t j = j0; j < j1; ++j) {
        const float rad = r * norms[j] + 1e-30f;
        const float lo = a[j] - rad, up = a[j] + rad;
        lo_max = lo > lo_max ? lo : lo_max;
        up_max = up > up_max ? up : up_max;
      }
      lower = lo_max > lower ? lo_max : lower;
      upper_of[b] = up_max;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      if (!(upper_of[b] >= lower)) continue;
      for (int64_t j = b * kBlock, j1 = std::min(n, j + kBlock); j < j1; ++j) {
        if (a[j] + (r * norms[j] + 1e-30f) >= lower) cand.push_back(j);
      }
    }
  }
  int64_t best = cand.empty() ? 0 : cand[0];
  double best_v = -std::numeric_limits<double>::infinity();
  for (int64_t j : cand) {
    const double v = dot_exact(x, e + j * k, k);
    if (v != v) return j;  // the first NaN (only reachable through `all`)
    if (v > best_v) best_v = v, best = j;
  }
  return best;
}

}  // namespace

extern "C" int opt_head_supported() {
  try {
    dnnl::memory::desc src({kPackRows, 64}, dt::bf16, tag::ab), w({64, 1024}, dt::bf16, tag::any),
        dst({kPackRows, 1024}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(cpu_engine(), src, w, dst);
    const std::string impl = pd.impl_info_str();
    return impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos;
  } catch (...) {
    return 0;
  }
}

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

static ffi::Error GreedyHead(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> embedding,
                             ffi::Buffer<ffi::F32> norms, ffi::Buffer<ffi::S32> exclude, ffi::ResultBuffer<ffi::S32> out) {
  use_threads();
  auto xd = x.dimensions(), ed = embedding.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || xd[1] != ed[1] || norms.element_count() != static_cast<size_t>(ed[0]) ||
      out->element_count() != static_cast<size_t>(xd[0]) || exclude.element_count() != static_cast<size_t>(xd[0])) {
    return ffi::Error::InvalidArgument(
        "opt_greedy_head: x must be [M, K], embedding [N, K], norms [N], exclude and out [M]");
  }
  const int64_t m = xd[0], k = xd[1], n = ed[0];
  if (n > (1 << 20)) return ffi::Error::InvalidArgument("opt_greedy_head: a vocabulary over 2^20 tokens");
  if (m == 0) return ffi::Error::Success();
  try {
    const dnnl::memory::desc& wd = head_packed_desc(k, n);
    if (packed.size_bytes() != wd.get_size()) {
      return ffi::Error::InvalidArgument("opt_greedy_head: the packed head has " + std::to_string(packed.size_bytes()) +
                                         " bytes, a packed bfloat16 [" + std::to_string(k) + ", " +
                                         std::to_string(n) + "] head " + std::to_string(wd.get_size()));
    }
    dnnl::matmul prim = head_matmul_for(m, k, n);
    std::lock_guard<std::mutex> lock(run_mu);
    // kept between calls: a fresh [M, N] float32 buffer each step is page faults on every step
    static std::vector<uint16_t> xb;
    static std::vector<float> approx;
    xb.resize(m * k);
    approx.resize(m * n);
    const float* xs = x.typed_data();
    std::vector<float> radius(m);
    std::vector<char> all(m);
    const double c = head_bound_factor(k);
    float max_norm = 0.f;
    for (int64_t j = 0; j < n; ++j) max_norm = std::max(max_norm, norms.typed_data()[j]);
    for (int64_t r = 0; r < m; ++r) {
      const double xn = std::sqrt(dot_exact(xs + r * k, xs + r * k, k));
      // a non-finite input, or one whose logits could overflow float32, is scored exactly
      all[r] = !std::isfinite(xn) || xn * max_norm > 1e37;
      radius[r] = static_cast<float>(c * xn * (1 + 1e-6));  // rounded up past float32's rounding
      for (int64_t i = 0; i < k; ++i) xb[r * k + i] = all[r] ? 0 : to_bf16(xs[r * k + i]);
    }
    dnnl::engine& eng = cpu_engine();
    dnnl::memory src({{m, k}, dt::bf16, tag::ab}, eng, xb.data());
    dnnl::memory wts(wd, eng, packed.untyped_data());
    dnnl::memory dst({{m, n}, dt::f32, tag::ab}, eng, approx.data());
    dnnl::stream stream(eng);
    prim.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wts}, {DNNL_ARG_DST, dst}});
    stream.wait();
    int32_t* tok = out->typed_data();
#pragma omp parallel
    {
      std::vector<int64_t> cand;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) {
        tok[r] = static_cast<int32_t>(head_row(xs + r * k, approx.data() + r * n, embedding.typed_data(),
                                               norms.typed_data(), k, n, radius[r], all[r],
                                               exclude.typed_data()[r], cand));
      }
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_greedy_head: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptGreedyHead, GreedyHead,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
