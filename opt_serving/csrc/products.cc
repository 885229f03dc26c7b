// Matrix products against weights packed once at load, for every weight format the CPU backend has:
//
//   float32   y = x @ W on float32 weights (oneDNN; a plain stream over the weights for 1-8 rows)
//   bfloat16  the rows rounded to bfloat16, bfloat16 weights, float32 accumulation (AVX512_BF16/AMX; from
//             opt_bf16_fma_rows rows up, float32 FMAs on the weights widened in registers: bf16_fma below)
//   int8      each row quantized to int8 with its own scale (max |x| / 127), int8 weights with a
//             scale per output column (symmetric), int32 accumulation (VNNI), y = acc * s_row * s_col
//
// Why packed: XLA CPU's GEMMs take the weights as a plain [K, N] runtime argument and re-pack them
// on every call; a decode step multiplies a few rows by every weight of the model, so that packing
// was most of its memory traffic. oneDNN's matmul reads weights already in its blocked layout.
//
//   opt_onednn_packed_bytes_as(K, N, type)                  size of a packed [K, N] weight (type: 0 f32, 1 bf16, 2 s8)
//   opt_onednn_pack_as(w, K, N, transposed, type, out)      w row-major [K, N] ([N, K] when transposed):
//                                                           float32 for f32/bf16, int8 for s8
//   opt_onednn_unpack_as(packed, K, N, type, w)             the reverse ([K, N]; bfloat16 comes back as float32)
//   OptOnednnMatmul (FFI)      y[M, N] = x[M, K] @ W (+ bias[N]) (relu), float32 weights
//   OptOnednnMatmulLowp (FFI)  the same for bfloat16 (weights=1) or int8 (weights=2, with scales[N]) weights
//   opt_bf16_fma_rows(rows)    bfloat16 products of at least `rows` rows run bf16_fma (0: never; -1: the CPU's
//                              default; below -1: left as it is); returns the setting now in force
//   opt_bf16_fma_reads(K, N)   whether bf16_fma can read a packed bfloat16 [K, N] weight here
//   opt_f32_tile_rows(rows)    float32 products of 9 to `rows` rows run f32_tiles, our kernel (0: never; -1: the
//                              CPU's default, 96 with AVX-512; below -1: left as it is); returns the setting in force
//   opt_s8_vnni_rows(rows)     int8 products of at least `rows` rows run s8_vnni, our VNNI kernel (0: never;
//                              -1: the default, 1; below -1: left as it is); returns the setting now in force
//   opt_s8_vnni_reads(K, N)    whether s8_vnni can read a packed int8 [K, N] weight here
#include "common.h"

using namespace opt;

namespace {

enum WeightType : int { kF32 = 0, kBF16 = 1, kS8 = 2 };

dt packed_type(int type) { return type == kS8 ? dt::s8 : type == kBF16 ? dt::bf16 : dt::f32; }

// A few rows (a decode step at batch 1-8, a speculative check of a few drafts) over the BA16a64b layout oneDNN
// packs these weights in: oneDNN's kernels take ~15% longer than XLA's matrix-vector products at 1-4 rows and
// read the weights at half the memory's speed at 5-8, and such a product is a plain stream over the weights. In
// that layout the 64 columns of block nb are contiguous [K_padded, 64] rows: entry (k, n) sits at
// (n / 64) * K_padded * 64 + k * 64 + n % 64. Rows go four at a time over each block, so a block is read from
// memory once and from cache for the next four.
constexpr int64_t kSmallRows = 8;

bool streams_as_rows(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a64b);
}

// M rows by one block; M is a template argument so the accumulators stay in registers.
template <int M>
__attribute__((target_clones("avx512f", "avx2", "default")))
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

// The same with AVX-512 intrinsics, M rows by 16 * V columns of a block (V = 4: the whole block; V = 2: half of
// it, so that 5-8 rows fit 16 accumulators and each line of the weights is still read once): the accumulators in
// registers and the block's rows prefetched 16 rows (4 KB) ahead (the plain loop above read the weights at
// 12-15 GB/s for 2-8 rows, where one row read them at 20-23).
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
      _mm_prefetch(reinterpret_cast<const char*>(row + 64 * 16 + 16 * q), _MM_HINT_T0);
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

void small_rows(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias,
                bool relu, float* y) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  const int64_t k_padded = (k + 15) / 16 * 16, blocks = (n + 63) / 64;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const float* block = w + nb * k_padded * 64;
    if (avx512 && m > 4) {  // all the rows in one pass over each half of the block
      for (int64_t n0 = nb * 64; n0 < std::min(n, nb * 64 + 64); n0 += 32) {
        const float* half = block + (n0 - nb * 64);
        switch (m) {
          case 5: rows_by_tile<5, 2>(x, k, n, half, n0, bias, relu, y); break;
          case 6: rows_by_tile<6, 2>(x, k, n, half, n0, bias, relu, y); break;
          case 7: rows_by_tile<7, 2>(x, k, n, half, n0, bias, relu, y); break;
          default: rows_by_tile<8, 2>(x, k, n, half, n0, bias, relu, y); break;
        }
      }
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

// A product's M rows in tiles of at most `most` rows, as even as the tile allows (32 rows by 6: 6, 6, 5, 5, 5, 5,
// not five of 6 and one of 2), and each group's share of `next` cache lines to prefetch while the groups compute a
// slice (spread over them, so the reads spread over the slice's arithmetic). f32_tiles, bf16_fma and s8_vnni.
struct RowGroups {
  int64_t m, count;
  RowGroups(int64_t m, int64_t most) : m(m), count((m + most - 1) / most) {}
  int64_t rows(int64_t g) const { return m / count + (g < m % count); }
  int64_t first(int64_t g) const { return g * (m / count) + std::min(g, m % count); }
  int64_t share_from(int64_t next, int64_t g) const { return next * g / count; }
  int64_t share(int64_t next, int64_t g) const { return next * (g + 1) / count - next * g / count; }
};

// Float32 products of 9 to f32_tile_rows() rows over the same BA16a64b blocks: oneDNN's kernels ran these at 55-65%
// of the product peak (a decode step's 16-64 rows: neither the weights' reading nor the arithmetic at its bound).
// Here each block of 64 columns is one task (the team taking them as it frees up, as s8_vnni), its rows in groups
// of at most six as even as the tile allows: 24 accumulators, the block's four vectors a k, a broadcast. The block
// goes a slice of kSlice k at a time through every group (the partial sums kept in y, in cache), the first group
// prefetching the next slice into L2: the weights stream from memory while the groups compute, where a block read
// whole by the first group and then from cache by the others left the memory idle for most of the product.
constexpr int64_t kSlice = 128;
std::atomic<int64_t> f32_tiles_upto{-1};  // products of 9 to this many rows run f32_tiles; 0 never; -1 not decided

int64_t f32_tile_rows() {
  int64_t rows = f32_tiles_upto.load(std::memory_order_relaxed);
  if (rows < 0) {
    // 96: from about there oneDNN's kernels, blocked for cache, ran as fast (benchmark/README.md)
    rows = __builtin_cpu_supports("avx512f") ? 96 : 0;
    f32_tiles_upto.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

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

void f32_tiles(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
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
std::atomic<int64_t> bf16_fma_from{-1};  // rows from which bf16_fma runs; 0 never; -1 not decided yet

int64_t default_bf16_fma_rows() {
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  const bool has_amx = (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & amx) == amx;
  // 8 rows: below that a product is bound by reading the weights, which oneDNN's kernels do as well
  return __builtin_cpu_is("intel") && !has_amx ? 8 : 0;
}

int64_t bf16_fma_rows() {
  int64_t rows = bf16_fma_from.load(std::memory_order_relaxed);
  if (rows < 0) {
    rows = default_bf16_fma_rows();
    bf16_fma_from.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

// whether bf16_fma can read a weight packed as `packed` (its layout), on this CPU (AVX512BW)
bool fma_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::bf16, tag::BA16a64b2a) && __builtin_cpu_supports("avx512bw");
}

// round to nearest even, NaN stays NaN: a row's value as the bfloat16 products take it
inline uint16_t bf16_of(float v) { return v != v ? 0x7fc0 : to_bf16(v); }

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

void bf16_fma(const float* x, int64_t m, int64_t k, int64_t n, const uint16_t* w, const float* bias, bool relu,
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

// Rows -> bfloat16 (round to nearest even; NaN stays NaN).
__attribute__((target_clones("avx512f", "avx2", "default")))
void rows_to_bf16(const float* x, int64_t count, uint16_t* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = bf16_of(x[i]);
}

// Each row -> integers with its own symmetric scale (max |x| / 127; 1 for a zero row), plus `shift`, rows `ld`
// apart, the columns past K set to `shift` (zero). Inlined into each of its callers' CPU clones.
template <class T>
__attribute__((always_inline)) inline void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ld, int shift,
                                                         T* q, float* scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float top = 0.f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < k; ++i) top = std::max(top, std::fabs(xr[i]));
    const float s = top > 0.f ? top / 127.f : 1.f, inv = 1.f / s;
    scale[r] = s;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      // rounded to nearest, ties to even (as std::nearbyint, which was a libm call an entry: a sixth of an int8
      // step): adding 1.5 * 2^23 leaves no bits below the units for |v| <= 2^22, so the sum is rounded there
      const float v = std::min(127.f, std::max(-127.f, xr[i] * inv));
      q[r * ld + i] = static_cast<T>(static_cast<int>((v + 12582912.f) - 12582912.f) + shift);
    }
    for (int64_t i = k; i < ld; ++i) q[r * ld + i] = static_cast<T>(shift);
  }
}

// int8 rows for oneDNN's int8 products
__attribute__((target_clones("avx512f", "avx2", "default")))
void rows_to_s8(const float* x, int64_t m, int64_t k, int8_t* q, float* scale) {
  quantize_rows<int8_t>(x, m, k, k, 0, q, scale);
}

// rows_to_s8's numbers + 128 as uint8 (VPDPBUSD multiplies unsigned bytes), each row k64 long
__attribute__((target_clones("avx512f", "avx2", "default")))
void rows_to_u8(const float* x, int64_t m, int64_t k, int64_t k64, uint8_t* q, float* scale) {
  quantize_rows<uint8_t>(x, m, k, k64, 128, q, scale);
}

// y = y * s_row (+ bias) (relu), in place
__attribute__((target_clones("avx512f", "avx2", "default")))
void epilogue(float* y, int64_t m, int64_t n, const float* scale, const float* bias, bool relu) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    float* yr = y + r * n;
    const float s = scale[r];
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = yr[j] * s + bias[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] *= s;
    }
    if (relu) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = yr[j] < 0.f ? 0.f : yr[j];
    }
  }
}

// int8 products with AVX512_VNNI over oneDNN's packed int8 weights, the team taking a block of 64 columns at a
// time as it frees up (a dynamic schedule). Why not oneDNN's kernel: it splits a product evenly between the
// threads up front and they meet at its end, so where something else takes a core from one of them for a moment
// (served: the HTTP threads, the engine, a load generator on the same cores) the other waits; beside a process
// burning 8% of the machine in short bursts, offline int8 lost 17-33% of its rate that way (benchmark/README.md).
// The numbers are oneDNN's: rows quantized to int8 (rows_to_s8), shifted to uint8 (VPDPBUSD multiplies unsigned
// by signed bytes) and the shift taken back by the compensation oneDNN stores after the weights
// (-128 * the column's sum), y = float(acc) * s_col * s_row (+ bias) (relu).
// Layout BA16a64b4a (blocks of 64 k by 64 columns), K padded to 64: per block of 64 columns, for each group of 4 k
// a row of 256 bytes, column j's four k adjacent: entry (k, n) at (n / 64) * K64 * 64 + (k / 4) * 256 + (n % 64) * 4
// + k % 4; then an int32 compensation per column.
// Runs for products of at least s8_vnni_from rows (0: never; -1: not decided yet), by default every one: a product
// of a few rows is bound by reading the weights, and this kernel read them faster than oneDNN's there too (its
// blocks handed out as the threads free up; benchmark/probes/bench_int8_stream.py).
std::atomic<int64_t> s8_vnni_from{-1};

int64_t s8_vnni_rows() {
  int64_t rows = s8_vnni_from.load(std::memory_order_relaxed);
  if (rows < 0) {
    rows = 1;
    s8_vnni_from.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

// whether s8_vnni can read a weight packed as `packed`, on this CPU
bool s8_vnni_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return false;
  using dims = dnnl::memory::dims;
  const int64_t k64 = (k + 63) / 64 * 64, n64 = (n + 63) / 64 * 64;
  return packed.get_inner_blks() == dims{16, 64, 4} && packed.get_inner_idxs() == dims{0, 1, 0} &&
         packed.get_padded_dims() == dims{k64, n64} && packed.get_strides() == dims{64 * 64, k64 * 64} &&
         packed.get_size() >= static_cast<size_t>(k64 * n64 + n * 4);
}

// R rows x one block of 64 columns; xu [R, k64] the rows as uint8 (x + 128), rows k64 apart
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void s8_tile(const uint8_t* xu, int64_t k64, const int8_t* w, const int32_t* comp, const float* col_scale,
             const float* row_scale, const float* bias, bool relu, float* y, int64_t ldy, int64_t cols) {
  __m512i acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
  for (int64_t p = 0; p < k64 / 4; ++p, w += 256) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128),
                  w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;  // (memcpy: the row's bytes read as an int32 without breaking aliasing rules)
      std::memcpy(&four, xu + r * k64 + 4 * p, 4);
      const __m512i b = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], b, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], b, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], b, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], b, w3);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // (unrolled: a runtime index into acc keeps it in memory, every step stored)
    const int64_t left = cols - 16 * q;
    if (left <= 0) continue;  // the last block's columns past N are not written
    const __mmask16 mask = left >= 16 ? 0xffff : (1u << left) - 1;
    const __m512i c = _mm512_maskz_loadu_epi32(mask, comp + 16 * q);
    const __m512 sc = _mm512_maskz_loadu_ps(mask, col_scale + 16 * q);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * q) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[r][q], c)), sc);
      v = _mm512_fmadd_ps(v, _mm512_set1_ps(row_scale[r]), b);
      if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(y + r * ldy + 16 * q, mask, v);
    }
  }
}

void s8_vnni(const float* x, int64_t m, int64_t k, int64_t n, const int8_t* w, const float* col_scale,
             const float* bias, bool relu, float* y) {
  static std::vector<uint8_t> xu;  // the rows as uint8, K padded to 64 (on the kernel thread only)
  static std::vector<float> row_scale;
  const int64_t k64 = (k + 63) / 64 * 64, blocks = (n + 63) / 64;
  row_scale.resize(m);
  xu.resize(m * k64);
  rows_to_u8(x, m, k, k64, xu.data(), row_scale.data());
  const int32_t* comp = reinterpret_cast<const int32_t*>(w + k64 * blocks * 64);
  constexpr int kRows = 6;  // 24 accumulators, 4 weight vectors, a broadcast: 29 of 32 registers
  const RowGroups groups(m, kRows);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t nb = 0; nb < blocks; ++nb) {
    const int64_t n0 = nb * 64, cols = std::min<int64_t>(64, n - n0);
    const int8_t* wb = w + nb * k64 * 64;
    const float* bb = bias ? bias + n0 : nullptr;
    for (int64_t g = 0; g < groups.count; ++g) {
      const int64_t rows = groups.rows(g), r = groups.first(g);
      const uint8_t* xt = &xu[r * k64];
      const float *ct = col_scale + n0, *rs = &row_scale[r];
      const int32_t* cp = comp + n0;
      float* yt = y + r * n + n0;
      switch (rows) {
        case 1: s8_tile<1>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
        case 2: s8_tile<2>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
        case 3: s8_tile<3>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
        case 4: s8_tile<4>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
        case 5: s8_tile<5>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
        default: s8_tile<kRows>(xt, k64, wb, cp, ct, rs, bb, relu, yt, n, cols); break;
      }
    }
  }
}

ffi::Error check_shapes(const char* name, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& packed, ffi::Buffer<ffi::F32>& bias,
                        ffi::ResultBuffer<ffi::F32>& y, dt type, int64_t* m, int64_t* k, int64_t* n) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x must be [M, K] and y [M, N]");
  }
  *m = xd[0], *k = xd[1], *n = yd[1];
  if (bias.element_count() > 0 && static_cast<int64_t>(bias.element_count()) != *n) {
    return ffi::Error::InvalidArgument(std::string(name) + ": bias must have N entries");
  }
  const dnnl::memory::desc& wd = packed_desc(*k, *n, type);
  if (packed.size_bytes() != wd.get_size()) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": the packed weight has " + std::to_string(packed.size_bytes()) + " bytes, a packed [" +
        std::to_string(*k) + ", " + std::to_string(*n) + "] weight " + std::to_string(wd.get_size()));
  }
  return ffi::Error::Success();
}

void run(dnnl::matmul& prim, std::unordered_map<int, dnnl::memory>& args) {
  dnnl::stream stream(cpu_engine());
  prim.execute(stream, args);
  stream.wait();
}

}  // namespace

extern "C" int64_t opt_onednn_packed_bytes_as(int64_t k, int64_t n, int type) {
  try {
    return static_cast<int64_t>(packed_desc(k, n, packed_type(type)).get_size());
  } catch (...) {
    return -1;
  }
}

extern "C" int opt_onednn_pack_as(const void* w, int64_t k, int64_t n, int transposed, int type, void* out) {
  return reorder_plain(k, n, transposed, w, out, true, packed_type(type), type == kS8 ? dt::s8 : dt::f32);
}

extern "C" int opt_onednn_unpack_as(const void* packed, int64_t k, int64_t n, int type, void* w) {
  return reorder_plain(k, n, 0, packed, w, false, packed_type(type), type == kS8 ? dt::s8 : dt::f32);
}

static ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> bias,
                         ffi::ResultBuffer<ffi::F32> y, bool relu) {
  use_threads();
  int64_t m, k, n;
  try {
    ffi::Error bad = check_shapes("opt_onednn_matmul", x, packed, bias, y, dt::f32, &m, &k, &n);
    if (bad.failure() || m == 0) return bad;
    const bool has_bias = bias.element_count() > 0;
    const dnnl::memory::desc& wd = packed_desc(k, n);
    if (m <= kSmallRows && streams_as_rows(wd, k, n)) {
      small_rows(x.typed_data(), m, k, n, static_cast<const float*>(packed.untyped_data()),
                 has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
    if (m <= f32_tile_rows() && streams_as_rows(wd, k, n)) {
      f32_tiles(x.typed_data(), m, k, n, static_cast<const float*>(packed.untyped_data()),
                has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
    dnnl::matmul prim = matmul_for(m, k, n, has_bias, relu);
    dnnl::engine& eng = cpu_engine();
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory({{m, k}, dt::f32, tag::ab}, eng, x.typed_data())},
        {DNNL_ARG_WEIGHTS, dnnl::memory(wd, eng, packed.untyped_data())},
        {DNNL_ARG_DST, dnnl::memory({{m, n}, dt::f32, tag::ab}, eng, y->typed_data())}};
    if (has_bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory({{1, n}, dt::f32, tag::ab}, eng, bias.typed_data()));
    run(prim, args);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_onednn_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

// weights: 1 bfloat16, 2 int8 (with `scales`, one per column)
static ffi::Error MatmulLowp(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> scales,
                             ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y, bool relu, int32_t weights) {
  use_threads();
  if (weights != kBF16 && weights != kS8) {
    return ffi::Error::InvalidArgument("opt_onednn_matmul_lowp: weights must be 1 (bfloat16) or 2 (int8)");
  }
  const dt type = packed_type(weights);
  int64_t m, k, n;
  try {
    ffi::Error bad = check_shapes("opt_onednn_matmul_lowp", x, packed, bias, y, type, &m, &k, &n);
    if (bad.failure() || m == 0) return bad;
    if (type == dt::s8 && static_cast<int64_t>(scales.element_count()) != n) {
      return ffi::Error::InvalidArgument("opt_onednn_matmul_lowp: int8 weights need N scales");
    }
    const bool has_bias = bias.element_count() > 0;
    const dnnl::memory::desc& wd = packed_desc(k, n, type);
    const int64_t fma_rows = type == dt::bf16 ? bf16_fma_rows() : 0;
    if (fma_rows > 0 && m >= fma_rows && fma_reads(wd, k, n)) {
      bf16_fma(x.typed_data(), m, k, n, static_cast<const uint16_t*>(packed.untyped_data()),
               has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
    const int64_t vnni_rows = type == dt::s8 ? s8_vnni_rows() : 0;
    if (vnni_rows > 0 && m >= vnni_rows && s8_vnni_reads(wd, k, n)) {
      s8_vnni(x.typed_data(), m, k, n, static_cast<const int8_t*>(packed.untyped_data()), scales.typed_data(),
              has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
    dnnl::matmul prim = matmul_for(m, k, n, has_bias, relu, type);
    dnnl::engine& eng = cpu_engine();
    // kept between calls (one kernel runs at a time, on the kernel thread): fresh buffers each step are page faults
    static std::vector<int8_t> xq;
    static std::vector<uint16_t> xb;
    static std::vector<float> row_scale;
    void* src_data;
    if (type == dt::s8) {
      xq.resize(m * k);
      row_scale.resize(m);
      rows_to_s8(x.typed_data(), m, k, xq.data(), row_scale.data());
      src_data = xq.data();
    } else {
      xb.resize(m * k);
      rows_to_bf16(x.typed_data(), m * k, xb.data());
      src_data = xb.data();
    }
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory({{m, k}, type, tag::ab}, eng, src_data)},
        {DNNL_ARG_WEIGHTS, dnnl::memory(wd, eng, packed.untyped_data())},
        {DNNL_ARG_DST, dnnl::memory({{m, n}, dt::f32, tag::ab}, eng, y->typed_data())}};
    if (type == dt::s8) {
      args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS,
                   dnnl::memory({{n}, dt::f32, tag::a}, eng, const_cast<float*>(scales.typed_data())));
    } else if (has_bias) {
      args.emplace(DNNL_ARG_BIAS, dnnl::memory({{1, n}, dt::f32, tag::ab}, eng, bias.typed_data()));
    }
    run(prim, args);
    if (type == dt::s8) {
      epilogue(y->typed_data(), m, n, row_scale.data(), has_bias ? bias.typed_data() : nullptr, relu);
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_onednn_matmul_lowp: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptOnednnMatmul, OnKernelThread<Matmul>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("relu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptOnednnMatmulLowp, OnKernelThread<MatmulLowp>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("relu")
                                  .Attr<int32_t>("weights"));

// Whether a bfloat16 [K, N] weight is packed in the layout bf16_fma reads, on a CPU that runs it
extern "C" int opt_bf16_fma_reads(int64_t k, int64_t n) {
  try {
    return fma_reads(packed_desc(k, n, dt::bf16), k, n);
  } catch (...) {
    return 0;
  }
}

// Whether an int8 [K, N] weight is packed in the layout s8_vnni reads, on a CPU that runs it
extern "C" int opt_s8_vnni_reads(int64_t k, int64_t n) {
  try {
    return s8_vnni_reads(packed_desc(k, n, dt::s8), k, n);
  } catch (...) {
    return 0;
  }
}

// int8 products of at least `rows` rows run s8_vnni (0: never; -1: the default; below -1: left as it is); returns
// the setting now in force
extern "C" int64_t opt_s8_vnni_rows(int64_t rows) {
  if (rows >= -1) s8_vnni_from.store(rows, std::memory_order_relaxed);
  return s8_vnni_rows();
}

// float32 products of 9 to `rows` rows run f32_tiles (0: never; -1: the CPU's default; below -1: left as it is);
// returns the setting now in force
extern "C" int64_t opt_f32_tile_rows(int64_t rows) {
  if (rows >= -1) f32_tiles_upto.store(rows, std::memory_order_relaxed);
  return f32_tile_rows();
}

extern "C" int64_t opt_bf16_fma_rows(int64_t rows) {
  if (rows >= -1) bf16_fma_from.store(rows, std::memory_order_relaxed);  // (-1: decided again from the CPU)
  return bf16_fma_rows();
}

// The float32 names the Python side has always used
extern "C" int64_t opt_onednn_packed_bytes(int64_t k, int64_t n) { return opt_onednn_packed_bytes_as(k, n, kF32); }

extern "C" int opt_onednn_pack(const float* w, int64_t k, int64_t n, int transposed, void* out) {
  return reorder_plain(k, n, transposed, w, out, true);
}

extern "C" int opt_onednn_unpack(const void* packed, int64_t k, int64_t n, int transposed, float* w) {
  return reorder_plain(k, n, transposed, packed, w, false);
}
