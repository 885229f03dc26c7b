// What the matrix products' files share. products.cc holds oneDNN's calls: packing the weights, and the FFI
// handlers, which pick a kernel for each product; our own kernels over oneDNN's packed weights are in a file per
// weight type: products_f32.cc, products_bf16.cc, products_s8.cc. Each computes y[M, N] = x[M, K] @ W (+ bias[N])
// (relu) into float32, W a [K, N] weight packed as packed_desc(K, N, type) lays it out on this CPU; the layout each
// reads, and why it beats oneDNN's kernel where it runs, are in its file.
#pragma once

#include "common.h"

namespace opt {

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

// A packed weight's block streamed by a kernel of a few rows: the 64-byte line at `line` prefetched into L2 12 KB
// ahead and from there into L1 2 KB ahead. With a few rows' work between two reads of a block's row the hardware's
// prefetcher alone fell behind the memory, and one prefetch into L1 4 KB ahead kept 5 rows 11-15% slower than two
// levels: L1's few outstanding misses were the limit, which L2's deeper queue lifts (benchmark/README.md,
// speculative decoding).
__attribute__((always_inline)) inline void prefetch_ahead(const void* line) {
  const char* p = static_cast<const char*>(line);
  _mm_prefetch(p + 12 * 1024, _MM_HINT_T1);
  _mm_prefetch(p + 2 * 1024, _MM_HINT_T0);
}

// ---- float32 (products_f32.cc) ----

// Products of 1 to kSmallRows rows stream the weights once (small_rows), where the weight is packed as it reads it
// (streams_as_rows: the BA16a64b layout); products of kSmallRows + 1 to f32_tile_rows() rows run f32_tiles over
// that layout.
constexpr int64_t kSmallRows = 8;
bool streams_as_rows(const dnnl::memory::desc& packed, int64_t k, int64_t n);
bool streams_as_strips(const dnnl::memory::desc& packed, int64_t k, int64_t n);
void small_rows(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                float* y);
int64_t f32_tile_rows();
void f32_tiles(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
               float* y);
// Where every float32 product runs our kernels (common.h, f32_everywhere): f32_panels past kSmallRows rows.
void f32_panels(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
                float* y);

// ---- bfloat16 (products_bf16.cc) ----

// Products of at least bf16_fma_rows() rows (0: never) run bf16_fma where it reads the packed weight here
// (bf16_fma_reads); w the packed bfloat16 bits.
int64_t bf16_fma_rows();
bool bf16_fma_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n);
void bf16_fma(const float* x, int64_t m, int64_t k, int64_t n, const uint16_t* w, const float* bias, bool relu,
              float* y);
// x [count] -> bfloat16 bits (round to nearest even; NaN stays NaN): the rows oneDNN's bfloat16 products take
void rows_to_bf16(const float* x, int64_t count, uint16_t* out);

// ---- int8 (products_s8.cc) ----

// Products of at least s8_vnni_rows() rows (0: never) run s8_vnni where it reads the packed weight here
// (s8_vnni_reads); col_scale [N] the weight's scales.
int64_t s8_vnni_rows();
bool s8_vnni_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n);
void s8_vnni(const float* x, int64_t m, int64_t k, int64_t n, const int8_t* w, const float* col_scale,
             const float* bias, bool relu, float* y);
// oneDNN's int8 products: x [M, K] -> q [M, K] int8, each row with its own scale[M] (max |x| / 127) where
// s8_rows() (common.h), else 7-bit rows shifted to uint8 (max |x| / 63, plus kU8RowZero) ...
void rows_to_s8(const float* x, int64_t m, int64_t k, int8_t* q, float* scale);
void rows_to_u7(const float* x, int64_t m, int64_t k, uint8_t* q, float* scale);
// ... and after the product (which applied the columns' scales), y [M, N] = y * scale[row] (+ bias) (relu), in place
void s8_epilogue(float* y, int64_t m, int64_t n, const float* scale, const float* bias, bool relu);

}  // namespace opt
