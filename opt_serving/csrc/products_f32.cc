#include "products.h"

using namespace opt;

// ---------------------------------------------------------------------------------------------
// Float32 products of a few rows on our own kernels, over the BA16a64b layout oneDNN packs float32 weights in
// (products.cc picks them: small_rows for 1-8 rows, f32_tiles for 9 to f32_tile_rows() rows, oneDNN's kernel past
// that). A decode step multiplies a few rows by every weight of the model, where oneDNN's kernels neither read the
// weights at the memory's speed nor compute at the product peak.
//
//   opt_f32_tile_rows(rows)    float32 products of 9 to `rows` rows run f32_tiles (0: never; -1: the CPU's
//                              default with AVX-512, 48 on AMD, 96 elsewhere; below -1: left as it is); returns
//                              the setting in force (0 without AVX-512: f32_panels, at the end, runs there)

// A few rows (a decode step at batch 1-8, a speculative check of a few drafts) over the BA16a64b layout oneDNN
// packs these weights in: oneDNN's kernels take ~15% longer than XLA's matrix-vector products at 1-4 rows and
// read the weights at half the memory's speed at 5-8, and such a product is a plain stream over the weights. In
// that layout the 64 columns of block nb are contiguous [K_padded, 64] rows: entry (k, n) sits at
// (n / 64) * K_padded * 64 + k * 64 + n % 64. Rows go four at a time over each block, so a block is read from
// memory once and from cache for the next four.
bool opt::streams_as_rows(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a64b);
}

namespace {

// M rows by one block; M is a template argument so the accumulators stay in registers.
template <int M>
__attribute__((target_clones("avx512f", "default")))
void rows_by_block(const float* x, int64_t k, int64_t n, const float* block, int64_t n0, const float* bias,
                   bool relu, float* y) {
  float acc[M][64] = {};
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = block + kk * 64;
    for (int r = 0; r < M; ++r) {
      const float xv = x[r * k + kk];
#pragma omp simd
      for (int j = 0; j < 64; ++j) acc[r][j] += xv * row[j];
    }
  }
  const int64_t cols = std::min<int64_t>(64, n - n0);
  for (int r = 0; r < M; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float v = acc[r][j] + (bias ? bias[n0 + j] : 0.f);
      y[r * n + n0 + j] = relu && v < 0.f ? 0.f : v;
    }
  }
}

// The same with AVX-512 intrinsics, M rows by 16 * V columns of a block (V = 4: the whole block): the accumulators
// in registers (up to 6 x 4 of the 32) and the block's rows prefetched 48 rows ahead into L2 and 8 into L1
// (prefetch_ahead; the plain loop above read the weights at 12-15 GB/s for 2-8 rows, where one row read them at
// 20-23). 5-8 rows once ran as two passes
// over the block's halves (V = 2), which read half of each 256-byte row at a time and the weights at 19 GB/s where
// 1-4 rows read them at 31: 5-6 rows now take the whole block in one pass, 7-8 four rows at a time (26 GB/s).
template <int M, int V>
__attribute__((target("avx512f")))
void rows_by_tile(const float* x, int64_t k, int64_t n, const float* tile, int64_t n0, const float* bias, bool relu,
                  float* y) {
  __m512 acc[M][V];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
#pragma GCC unroll 4
    for (int q = 0; q < V; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = tile + kk * 64;
    __m512 w[V];
#pragma GCC unroll 4
    for (int q = 0; q < V; ++q) {
      prefetch_ahead(row + 16 * q);
      w[q] = _mm512_loadu_ps(row + 16 * q);
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k + kk]);
#pragma GCC unroll 4
      for (int q = 0; q < V; ++q) acc[r][q] = _mm512_fmadd_ps(b, w[q], acc[r][q]);
    }
  }
  const int64_t cols = std::min<int64_t>(16 * V, n - n0);
#pragma GCC unroll 4
  for (int q = 0; q < V; ++q) {
    const int64_t left = cols - 16 * q;
    if (left <= 0) continue;  // the last block's columns past N are not written
    const __mmask16 mask = left >= 16 ? 0xffff : (1u << left) - 1;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * q) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      __m512 v = _mm512_add_ps(acc[r][q], bv);
      if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(y + r * n + n0 + 16 * q, mask, v);
    }
  }
}

// Rows [r, r + R) by one block, R <= 4: the AVX-512 tile, or the plain loop for one row (measured at the memory's
// speed) and on CPUs without AVX-512
template <int R>
void four_rows_by_block(bool avx512, const float* x, int64_t k, int64_t n, const float* block, int64_t n0,
                        const float* bias, bool relu, float* y) {
  if (avx512 && R > 1) return rows_by_tile<R, 4>(x, k, n, block, n0, bias, relu, y);
  rows_by_block<R>(x, k, n, block, n0, bias, relu, y);
}

}  // namespace

void opt::small_rows(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                     float* y) {
  const bool avx512 = use_avx512();  // (without: a CPU other than x86's, f32_everywhere's strips elsewhere)
  const int64_t k_padded = (k + 15) / 16 * 16, blocks = (n + 63) / 64;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const float* block = w + nb * k_padded * 64;
    if (avx512 && (m == 5 || m == 6)) {  // every row in one pass over the whole block: 20-24 accumulators
      if (m == 5) rows_by_tile<5, 4>(x, k, n, block, nb * 64, bias, relu, y);
      else rows_by_tile<6, 4>(x, k, n, block, nb * 64, bias, relu, y);
      continue;
    }
    for (int64_t r = 0; r < m; r += 4) {  // four rows at a time: the block from memory once, then from cache
      const float *xr = x + r * k;
      float* yr = y + r * n;
      switch (std::min<int64_t>(4, m - r)) {
        case 1: four_rows_by_block<1>(avx512, xr, k, n, block, nb * 64, bias, relu, yr); break;
        case 2: four_rows_by_block<2>(avx512, xr, k, n, block, nb * 64, bias, relu, yr); break;
        case 3: four_rows_by_block<3>(avx512, xr, k, n, block, nb * 64, bias, relu, yr); break;
        default: four_rows_by_block<4>(avx512, xr, k, n, block, nb * 64, bias, relu, yr); break;
      }
    }
  }
}

// Float32 products of 9 to f32_tile_rows() rows over the same BA16a64b blocks: oneDNN's kernels ran these at 55-65%
// of the product peak (a decode step's 16-64 rows: neither the weights' reading nor the arithmetic at its bound).
// Here each block of 64 columns is one task (the team taking them as it frees up, as s8_vnni), its rows in groups
// of at most six as even as the tile allows: 24 accumulators, the block's four vectors a k, a broadcast. The block
// goes a slice of kSlice k at a time through every group (the partial sums kept in y, in cache), the first group
// prefetching the next slice into L2: the weights stream from memory while the groups compute, where a block read
// whole by the first group and then from cache by the others left the memory idle for most of the product.
namespace {

constexpr int64_t kSlice = 128;
std::atomic<int64_t> f32_tiles_upto{-1};  // products of 9 to this many rows run f32_tiles; 0 never; -1 not decided

// R rows by one block over k in [k0, k1): the slice's sums, added to y's (but on the first slice), end in y,
// finished with the bias and relu (last); `ahead`: `lines` cache lines of the next slice to prefetch, one a k
template <int R>
__attribute__((target("avx512f")))
void f32_tile(const float* x, int64_t k, int64_t k0, int64_t k1, const float* block, const float* ahead,
              int64_t lines, bool first, bool last, const float* bias, bool relu, float* y, int64_t n, int64_t cols) {
  __m512 acc[R][4];
  const __mmask16 masks[4] = {
      static_cast<__mmask16>(cols >= 16 ? 0xffff : cols <= 0 ? 0 : (1u << cols) - 1),
      static_cast<__mmask16>(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1),
      static_cast<__mmask16>(cols >= 48 ? 0xffff : cols <= 32 ? 0 : (1u << (cols - 32)) - 1),
      static_cast<__mmask16>(cols >= 64 ? 0xffff : cols <= 48 ? 0 : (1u << (cols - 48)) - 1)};
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  for (int64_t kk = k0; kk < k1; ++kk) {
    const float* row = block + kk * 64;
    if (kk - k0 < lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + (kk - k0) * 16), _MM_HINT_T1);
    __m512 w[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) w[q] = _mm512_loadu_ps(row + 16 * q);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k + kk]);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fmadd_ps(b, w[q], acc[r][q]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // (unrolled: a runtime index into acc keeps it in memory)
    if (!masks[q]) continue;  // the last block's columns past N are not written
    const __m512 bv = last && bias ? _mm512_maskz_loadu_ps(masks[q], bias + 16 * q) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // the slice's sum added to the slices' before it: sums of kSlice terms, added up, round as oneDNN's do
      __m512 v = first ? acc[r][q] : _mm512_add_ps(acc[r][q], _mm512_maskz_loadu_ps(masks[q], y + r * n + 16 * q));
      if (last) v = _mm512_add_ps(v, bv);
      if (last && relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(y + r * n + 16 * q, masks[q], v);
    }
  }
}

}  // namespace

int64_t opt::f32_tile_rows() {
  int64_t rows = f32_tiles_upto.load(std::memory_order_relaxed);
  if (rows < 0) {
    // from about there oneDNN's kernels, blocked for cache, ran as fast (benchmark/README.md): 96 rows on the
    // Intel Xeons measured; on AMD's Zen 4 EPYC they ran 12-19% faster than these tiles already at 52-80 rows
    rows = !use_avx512() ? 0 : __builtin_cpu_is("amd") ? 48 : 96;
    f32_tiles_upto.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

void opt::f32_tiles(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                    float* y) {
  constexpr int kRows = 6;
  const int64_t k_padded = (k + 15) / 16 * 16, blocks = (n + 63) / 64;
  const RowGroups groups(m, kRows);
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const int64_t n0 = nb * 64, cols = std::min<int64_t>(64, n - n0);
    const float* block = w + nb * k_padded * 64;
    const float* bb = bias ? bias + n0 : nullptr;
    for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
      const int64_t k1 = std::min(k, k0 + kSlice);
      const bool first = k0 == 0, last = k1 == k;
      const int64_t next = last ? 0 : (std::min(k, k1 + kSlice) - k1) * 4;  // the next slice's lines
      for (int64_t g = 0; g < groups.count; ++g) {
        const int64_t rows = groups.rows(g), r = groups.first(g), lines = groups.share(next, g);
        const float* ahead = block + k1 * 64 + groups.share_from(next, g) * 16;
        const float* xt = x + r * k;
        float* yt = y + r * n + n0;
        switch (rows) {
          case 1: f32_tile<1>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
          case 2: f32_tile<2>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
          case 3: f32_tile<3>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
          case 4: f32_tile<4>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
          case 5: f32_tile<5>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
          default: f32_tile<kRows>(xt, k, k0, k1, block, ahead, lines, first, last, bb, relu, yt, n, cols); break;
        }
      }
    }
  }
}

// float32 products of 9 to `rows` rows run f32_tiles (0: never; -1: the CPU's default; below -1: left as it is);
// returns the setting now in force, always 0 where AVX-512 is not used (the tiles' only code)
extern "C" int64_t opt_f32_tile_rows(int64_t rows) {
  if (rows >= -1) f32_tiles_upto.store(use_avx512() || rows == -1 ? rows : 0, std::memory_order_relaxed);
  return f32_tile_rows();
}

// ---------------------------------------------------------------------------------------------
// Every float32 product on a CPU without AVX-512 (f32_everywhere), over weights packed_desc lays out there itself
// as strips of 16 columns (BA16a16b: a strip is [K_padded, 16], 64 contiguous bytes a k). oneDNN picks a plain
// layout for its AVX2 kernels, which ran 8-32 rows at a sixth to a half of the memory's speed, and whose sums for a
// row changed with the rows beside it (a request's tokens then depended on the load). Here each entry is a sum over
// k in order, finished with the bias: a row's numbers are the same whatever the rows beside it, 1 row or 64. A
// strip is one task, its rows in groups of at most 6: 12 accumulators in registers, two loads and six broadcasts a
// k; the first group reads the strip from memory as one stream (prefetched ahead), the others from L2. The strips
// replaced BA16a64b blocks read 16 columns at a time, a 64-byte line every 256 bytes, which neither the memory nor
// the prefetchers served at speed (benchmark/README.md, "A CPU without AVX-512").
bool opt::streams_as_strips(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a16b);
}

namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int kPanelRows = 6;  // rows a group: 12 accumulators of the 16 registers
constexpr int64_t kPanelAhead = 32;  // k the first group prefetches its strip ahead (2 KB, into L2)

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// R rows by a strip's 16 columns (w: the strip, 16 floats a k), into y's first `cols`; `ahead`: floats of the strip
// to prefetch ahead (0: none)
template <int R>
__attribute__((always_inline)) inline void rows_by_16(const float* x, int64_t k, const float* w, int64_t ahead,
                                                      const float* bias, bool relu, float* y, int64_t n,
                                                      int64_t cols) {
  v8 acc[R][2] = {};
  for (int64_t kk = 0; kk < k; ++kk, w += 16) {
    if (ahead) __builtin_prefetch(w + ahead, 0, 2);
    const v8 w0 = load8(w), w1 = load8(w + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float b = x[r * k + kk];
      acc[r][0] += b * w0;
      acc[r][1] += b * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[16];
    std::memcpy(out, acc[r], sizeof out);
    for (int64_t j = 0; j < cols; ++j) {
      const float v = out[j] + (bias ? bias[j] : 0.f);
      y[r * n + j] = relu && v < 0.f ? 0.f : v;
    }
  }
}

// (the parallel loop in the clones themselves, not in a function they inline: its outlined body then has their
// target, where a loop inlined from elsewhere ran at a thirtieth of the speed)
__attribute__((target_clones("arch=x86-64-v3", "default")))
void panels(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu, float* y) {
  const int64_t k_padded = (k + 15) / 16 * 16, strips = (n + 15) / 16;
  const RowGroups groups(m, kPanelRows);
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h)
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t n0 = s * 16, cols = std::min<int64_t>(16, n - n0);
    const float* ws = w + s * k_padded * 16;
    const float* bs = bias ? bias + n0 : nullptr;
    for (int64_t g = 0; g < groups.count; ++g) {
      const float* xg = x + groups.first(g) * k;
      float* yg = y + groups.first(g) * n + n0;
      const int64_t ahead = g == 0 ? kPanelAhead * 16 : 0;  // (the others read the strip from L2)
      switch (groups.rows(g)) {
        case 1: rows_by_16<1>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
        case 2: rows_by_16<2>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
        case 3: rows_by_16<3>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
        case 4: rows_by_16<4>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
        case 5: rows_by_16<5>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
        default: rows_by_16<kPanelRows>(xg, k, ws, ahead, bs, relu, yg, n, cols); break;
      }
    }
  }
}

}  // namespace

void opt::f32_panels(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                     float* y) {
  panels(x, m, k, n, w, bias, relu, y);
}
