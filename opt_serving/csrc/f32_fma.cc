// float32 products of a few dozen rows over oneDNN's packed float32 weights, with float32 FMAs.
//
// Why: a decode step of 8-128 rows multiplies them by every weight of the model, and a model's weights do not fit
// any cache, so each product streams its weight from memory once. oneDNN's kernels there first wait for a block of
// the weight, then compute on it: reading and arithmetic take turns (a product of 32 rows ran at 136-174 GFLOP/s
// with its weight in memory, 250-320 with it in cache; benchmark/README.md). This kernel computes on one block of
// 64 columns while the block it takes next is prefetched into L2, so that reading overlaps arithmetic.
//
// Layout BA16a64b (what oneDNN packs float32 [K, N] weights in here): per block of 64 columns, K_padded rows of 64
// contiguous floats: entry (k, n) at (n / 64) * K16 * 64 + k * 64 + n % 64, K16 = K rounded up to 16.
//
// Blocks are shared out as contiguous runs, one per thread, each taken from its front through an atomic cursor, so
// a thread knows the block it takes next and prefetches it; a thread done with its own run takes blocks from the
// others' (served, the host's threads take a core from one of the two threads now and then: common.h).
#include "common.h"

namespace opt {

namespace {

constexpr int kRows = 6;  // rows per tile: 24 accumulators, 4 weight vectors, a broadcast: 29 of 32 registers
constexpr int kLine = 64;  // bytes per cache line; a block's row of 64 floats is 4 lines

// R rows x one block of 64 columns. While it runs, lines [pf_first, pf_first + pf_count) of each of the next
// block's rows are prefetched into L2 (`pf` null: none), so the tiles of one block together fetch all of the next.
template <int R>
__attribute__((target("avx512f")))
void f32_tile(const float* x, int64_t k, const float* w, const float* bias, bool relu, float* y, int64_t ldy,
              int64_t cols, const char* pf, int pf_first, int pf_count) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk, w += 64) {
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                 w3 = _mm512_loadu_ps(w + 48);
    if (pf) {
      for (int l = pf_first; l < pf_first + pf_count; ++l) _mm_prefetch(pf + kk * 4 * kLine + l * kLine, _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k + kk]);
      acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(b, w3, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // (unrolled: a runtime index into acc keeps it in memory)
    const int64_t left = cols - 16 * q;
    if (left <= 0) continue;  // the last block's columns past N are not written
    const __mmask16 mask = left >= 16 ? 0xffff : (1u << left) - 1;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * q) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_add_ps(acc[r][q], b);
      if (relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(y + r * ldy + 16 * q, mask, v);
    }
  }
}

// All m rows by block nb, in groups of at most kRows rows as even as the tile allows (32 rows: 6, 6, 5, 5, 5, 5),
// prefetching block `next` (-1: none) across the groups.
void f32_block(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
               float* y, int64_t nb, int64_t next) {
  const int64_t k16 = (k + 15) / 16 * 16, groups = (m + kRows - 1) / kRows;
  const int64_t n0 = nb * 64, cols = std::min<int64_t>(64, n - n0);
  const float* wb = w + nb * k16 * 64;
  const float* bb = bias ? bias + n0 : nullptr;
  const char* pf = next >= 0 ? reinterpret_cast<const char*>(w + next * k16 * 64) : nullptr;
  const int per_group = static_cast<int>((4 + groups - 1) / groups);  // lines of each row each group prefetches
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t rows = m / groups + (g < m % groups);
    const int first = static_cast<int>(std::min<int64_t>(4, g * per_group));
    const int count = std::min(4 - first, per_group);
    const float* xt = x + r * k;
    float* yt = y + r * n + n0;
    const char* p = count > 0 ? pf : nullptr;
    switch (rows) {
      case 1: f32_tile<1>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
      case 2: f32_tile<2>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
      case 3: f32_tile<3>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
      case 4: f32_tile<4>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
      case 5: f32_tile<5>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
      default: f32_tile<kRows>(xt, k, wb, bb, relu, yt, n, cols, p, first, count); break;
    }
    r += rows;
  }
}

struct alignas(64) Cursor {
  std::atomic<int64_t> next;
  int64_t end;
};

std::atomic<int64_t> f32_fma_from{-1}, f32_fma_to{-1};  // rows [from, to) run f32_fma; -1: not decided yet

}  // namespace

bool f32_fma_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  return packed == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a64b) && __builtin_cpu_supports("avx512f");
}

bool f32_fma_takes(int64_t m, int64_t k) {
  // (a block of a longer K no longer fits L2 twice over, and oneDNN's kernels were as fast there)
  if (k > 1024) return false;
  int64_t from = f32_fma_from.load(std::memory_order_relaxed), to = f32_fma_to.load(std::memory_order_relaxed);
  if (from < 0) from = 5;
  if (to < 0) to = 256;
  return from > 0 && m >= from && m < to;
}

void f32_fma(const float* x, int64_t m, int64_t k, int64_t n, const float* w, const float* bias, bool relu,
             float* y) {
  const int64_t blocks = (n + 63) / 64;
  static std::vector<Cursor> cursors;  // one run of blocks per thread (on the kernel thread only)
#pragma omp parallel
  {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
#pragma omp single
    {
      cursors = std::vector<Cursor>(threads);
      for (int t = 0; t < threads; ++t) {
        cursors[t].next.store(blocks * t / threads, std::memory_order_relaxed);
        cursors[t].end = blocks * (t + 1) / threads;
      }
    }  // (the single's barrier: every cursor is set before any is taken from)
    for (int i = 0; i < threads; ++i) {
      Cursor& c = cursors[(me + i) % threads];  // my own run first, then the others'
      for (int64_t nb; (nb = c.next.fetch_add(1, std::memory_order_relaxed)) < c.end;) {
        const int64_t next = i == 0 && nb + 1 < c.end ? nb + 1 : -1;
        f32_block(x, m, k, n, w, bias, relu, y, nb, next);
      }
    }
  }
}

}  // namespace opt

// float32 products of rows in [from, to) run f32_fma (from 0: never; -1: the default; below -1: left as it is);
// returns the setting now in force as from * 65536 + to
extern "C" int64_t opt_f32_fma_rows(int64_t from, int64_t to) {
  if (from >= -1) opt::f32_fma_from.store(from, std::memory_order_relaxed);
  if (to >= -1) opt::f32_fma_to.store(to, std::memory_order_relaxed);
  int64_t lo = opt::f32_fma_from.load(), hi = opt::f32_fma_to.load();
  return (lo < 0 ? 5 : lo) * 65536 + (hi < 0 ? 256 : hi);
}

// Whether f32_fma can read a packed float32 [K, N] weight here (its layout, AVX-512)
extern "C" int opt_f32_fma_reads(int64_t k, int64_t n) {
  try {
    return opt::f32_fma_reads(opt::packed_desc(k, n), k, n);
  } catch (...) {
    return 0;
  }
}
