#include "products.h"

using namespace opt;

// ---------------------------------------------------------------------------------------------
// bfloat16 products with float32 FMAs. Where bfloat16 dot products (VDPBF16PS) do no more multiply-adds a cycle
// than float32 FMAs (Intel CPUs without AMX; benchmark/README.md has the measurements), oneDNN's bfloat16 kernels
// lose to its float32 ones once a product has rows enough to be bound by arithmetic rather than by reading the
// weights.
// This kernel reads the same packed bfloat16 weights (half float32's bytes), widens them in registers (a
// bfloat16 is the top half of a float32) and multiplies with float32 FMAs: the same numbers (rows rounded to
// bfloat16, exact products, float32 sums; only the order of the sums differs), float32's arithmetic rate.
// Layout BA16a64b2a: per block of 64 columns, for each pair of k a row of 128 values, column j's two k
// adjacent: entry (k, n) at (n / 64) * K32 * 64 + (k / 2) * 128 + (n % 64) * 2 + k % 2, K32 = K padded to 32
// (oneDNN zero-fills the padding). A 32-bit lane of that row holds column j's pair: even k in its low half.
// Where it does not run, oneDNN's bfloat16 products take the rows rounded to bfloat16 (rows_to_bf16).
//
//   opt_bf16_fma_rows(rows)    bfloat16 products of at least `rows` rows run bf16_fma (0: never; -1: the CPU's
//                              default; below -1: left as it is); returns the setting now in force
//   opt_bf16_fma_reads(K, N)   whether bf16_fma can read a packed bfloat16 [K, N] weight here
namespace {

std::atomic<int64_t> bf16_fma_from{-1};  // rows from which bf16_fma runs; 0 never; -1 not decided yet

int64_t default_bf16_fma_rows() {
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  const bool has_amx = (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & amx) == amx;
  // 8 rows: below that a product is bound by reading the weights, which oneDNN's kernels do as well
  return __builtin_cpu_is("intel") && !has_amx ? 8 : 0;
}

// round to nearest even, NaN stays NaN: a row's value as the bfloat16 products take it
inline uint16_t bf16_of(float v) { return v != v ? 0x7fc0 : to_bf16(v); }

}  // namespace

int64_t opt::bf16_fma_rows() {
  int64_t rows = bf16_fma_from.load(std::memory_order_relaxed);
  if (rows < 0) {
    rows = default_bf16_fma_rows();
    bf16_fma_from.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

// whether bf16_fma can read a weight packed as `packed` (its layout), on this CPU (AVX512BW)
bool opt::bf16_fma_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::bf16, tag::BA16a64b2a) && __builtin_cpu_supports("avx512bw");
}

namespace {

// R rows x 32 columns (half a block) over the k pairs [p0, p1): x [R, kx] rounded to bfloat16 (kx = k rounded up
// to even, zero-padded). As f32_tile: the slice's sums, added to y's (but on the first slice), end in y, finished
// with the bias and relu (last); `next`: the next slice, whose half's lines from..from + lines - 1 (two a pair) to
// prefetch, one a pair.
template <int R>
__attribute__((target("avx512f,avx512bw")))
void bf16_fma_tile(const float* x, int64_t kx, int64_t p0, int64_t p1, const uint16_t* w, const uint16_t* next,
                   int64_t from, int64_t lines, bool first, bool last, int64_t cols, const float* bias, bool relu, float* y,
                   int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  w += p0 * 128;
  for (int64_t p = p0; p < p1; ++p, w += 128) {
    if (p - p0 < lines) {
      const int64_t i = from + (p - p0);
      _mm_prefetch(reinterpret_cast<const char*>(next + (i / 2) * 128 + (i % 2) * 32), _MM_HINT_T1);
    }
    const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 32);  // columns 0-15, 16-31
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * kx + 2 * p]), xo = _mm512_set1_ps(x[r * kx + 2 * p + 1]);
      acc[r][0] = _mm512_fmadd_ps(xo, odd0, _mm512_fmadd_ps(xe, even0, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(xo, odd1, _mm512_fmadd_ps(xe, even1, acc[r][1]));
    }
  }
  // the last block's columns past N are not written
  const __mmask16 m0 = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 b0 = last && bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = last && bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    __m512 v0 = acc[r][0], v1 = acc[r][1];
    if (!first) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, y + r * n));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, y + r * n + 16));
    }
    if (last) {
      v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
      if (relu) {
        v0 = _mm512_max_ps(v0, _mm512_setzero_ps());
        v1 = _mm512_max_ps(v1, _mm512_setzero_ps());
      }
    }
    _mm512_mask_storeu_ps(y + r * n, m0, v0);
    _mm512_mask_storeu_ps(y + r * n + 16, m1, v1);
  }
}

}  // namespace

void opt::bf16_fma(const float* x, int64_t m, int64_t k, int64_t n, const uint16_t* w, const float* bias, bool relu,
                   float* y) {
  static std::vector<float> xr;  // the rows rounded to bfloat16, k padded to even (on the kernel thread only)
  const int64_t kx = (k + 1) / 2 * 2, k32 = (k + 31) / 32 * 32, halves = (n + 63) / 64 * 2, pairs = kx / 2;
  xr.resize(m * kx);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      const float v = x[r * k + i];
      const uint32_t b = static_cast<uint32_t>(bf16_of(v)) << 16;
      std::memcpy(&xr[r * kx + i], &b, 4);
    }
    if (kx > k) xr[r * kx + k] = 0.f;
  }
  constexpr int kRows = 12;  // 24 accumulators, 4 widened weight vectors, 2 broadcasts: 30 of 32 registers
  // a slice of 128 k at a time, as f32_tiles, where the product is short of rows (bound by reading the weights);
  // with more rows the whole k at once: a slice's partial sums and strided reads of the rows then cost more (an
  // [2048, 2048] x [2048, 8192] product ran at 161 GFLOP/s sliced, 257-266 whole)
  const int64_t slice = m <= 96 ? 64 : pairs;
  const RowGroups groups(m, kRows);
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h)
  for (int64_t t = 0; t < halves; ++t) {
    const int64_t n0 = t * 32, cols = std::min<int64_t>(32, n - n0);
    if (cols <= 0) continue;  // the last block's padding
    const uint16_t* wt = w + (t / 2) * k32 * 64 + (t % 2) * 64;
    const float* bt = bias ? bias + n0 : nullptr;
    for (int64_t p0 = 0; p0 < pairs; p0 += slice) {
      const int64_t p1 = std::min(pairs, p0 + slice);
      const bool first = p0 == 0, last = p1 == pairs;
      // the next slice's lines, a half's two a pair (each group prefetches its share)
      const int64_t next = (std::min(pairs, p1 + slice) - p1) * 2;
      for (int64_t g = 0; g < groups.count; ++g) {
        const int64_t rows = groups.rows(g), r = groups.first(g), from = groups.share_from(next, g),
                      lines = groups.share(next, g);
        const float* xt = &xr[r * kx];
        float* yt = y + r * n + n0;
        switch (rows) {
#define OPT_BF16_TILE(R) \
  case R: bf16_fma_tile<R>(xt, kx, p0, p1, wt, wt + p1 * 128, from, lines, first, last, cols, bt, relu, yt, n); break;
          OPT_BF16_TILE(1) OPT_BF16_TILE(2) OPT_BF16_TILE(3) OPT_BF16_TILE(4) OPT_BF16_TILE(5) OPT_BF16_TILE(6)
          OPT_BF16_TILE(7) OPT_BF16_TILE(8) OPT_BF16_TILE(9) OPT_BF16_TILE(10) OPT_BF16_TILE(11)
          default: bf16_fma_tile<kRows>(xt, kx, p0, p1, wt, wt + p1 * 128, from, lines, first, last, cols, bt, relu, yt, n);
#undef OPT_BF16_TILE
        }
      }
    }
  }
}

// Rows -> bfloat16 (round to nearest even; NaN stays NaN), as oneDNN's bfloat16 products take them
__attribute__((target_clones("avx512f", "avx2", "default")))
void opt::rows_to_bf16(const float* x, int64_t count, uint16_t* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = bf16_of(x[i]);
}

// Whether a bfloat16 [K, N] weight is packed in the layout bf16_fma reads, on a CPU that runs it
extern "C" int opt_bf16_fma_reads(int64_t k, int64_t n) {
  try {
    return bf16_fma_reads(packed_desc(k, n, dt::bf16), k, n);
  } catch (...) {
    return 0;
  }
}

extern "C" int64_t opt_bf16_fma_rows(int64_t rows) {
  if (rows >= -1) bf16_fma_from.store(rows, std::memory_order_relaxed);  // (-1: decided again from the CPU)
  return bf16_fma_rows();
}
