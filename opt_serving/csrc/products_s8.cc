#include "products.h"

using namespace opt;

// ---------------------------------------------------------------------------------------------
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
// Where it does not run, oneDNN's int8 products take the rows quantized (rows_to_s8) and leave their row scales,
// the bias and the ReLU to s8_epilogue.
//
//   opt_s8_vnni_rows(rows)     int8 products of at least `rows` rows run s8_vnni (0: never; -1: the default, 1;
//                              below -1: left as it is); returns the setting now in force
//   opt_s8_vnni_reads(K, N)    whether s8_vnni can read a packed int8 [K, N] weight here
namespace {

std::atomic<int64_t> s8_vnni_from{-1};

// Each row -> integers in [-levels, levels] with its own symmetric scale (max |x| / levels; 1 for a zero row), plus
// `shift`, rows `ld` apart, the columns past K set to `shift` (zero). Inlined into each of its callers' CPU clones.
template <class T>
__attribute__((always_inline)) inline void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ld, int shift,
                                                         float levels, T* q, float* scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float top = 0.f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < k; ++i) top = std::max(top, std::fabs(xr[i]));
    const float s = top > 0.f ? top / levels : 1.f, inv = 1.f / s;
    scale[r] = s;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) {
      // rounded to nearest, ties to even (as std::nearbyint, which was a libm call an entry: a sixth of an int8
      // step): adding 1.5 * 2^23 leaves no bits below the units for |v| <= 2^22, so the sum is rounded there
      const float v = std::min(levels, std::max(-levels, xr[i] * inv));
      q[r * ld + i] = static_cast<T>(static_cast<int>((v + 12582912.f) - 12582912.f) + shift);
    }
    for (int64_t i = k; i < ld; ++i) q[r * ld + i] = static_cast<T>(shift);
  }
}

// rows_to_s8's numbers + 128 as uint8 (VPDPBUSD multiplies unsigned bytes), each row k64 long
__attribute__((target_clones("avx512f", "avx2", "default")))
void rows_to_u8(const float* x, int64_t m, int64_t k, int64_t k64, uint8_t* q, float* scale) {
  quantize_rows<uint8_t>(x, m, k, k64, 128, 127.f, q, scale);
}

}  // namespace

// the rows of oneDNN's int8 products (common.h, s8_rows)
__attribute__((target_clones("avx512f", "avx2", "default")))
void opt::rows_to_s8(const float* x, int64_t m, int64_t k, int8_t* q, float* scale) {
  quantize_rows<int8_t>(x, m, k, k, 0, 127.f, q, scale);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void opt::rows_to_u7(const float* x, int64_t m, int64_t k, uint8_t* q, float* scale) {
  quantize_rows<uint8_t>(x, m, k, k, kU8RowZero, 63.f, q, scale);
}

// y = y * s_row (+ bias) (relu), in place: what oneDNN's int8 products leave to us
__attribute__((target_clones("avx512f", "avx2", "default")))
void opt::s8_epilogue(float* y, int64_t m, int64_t n, const float* scale, const float* bias, bool relu) {
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

int64_t opt::s8_vnni_rows() {
  int64_t rows = s8_vnni_from.load(std::memory_order_relaxed);
  if (rows < 0) {
    rows = 1;
    s8_vnni_from.store(rows, std::memory_order_relaxed);
  }
  return rows;
}

// whether s8_vnni can read a weight packed as `packed`, on this CPU
bool opt::s8_vnni_reads(const dnnl::memory::desc& packed, int64_t k, int64_t n) {
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return false;
  using dims = dnnl::memory::dims;
  const int64_t k64 = (k + 63) / 64 * 64, n64 = (n + 63) / 64 * 64;
  return packed.get_inner_blks() == dims{16, 64, 4} && packed.get_inner_idxs() == dims{0, 1, 0} &&
         packed.get_padded_dims() == dims{k64, n64} && packed.get_strides() == dims{64 * 64, k64 * 64} &&
         packed.get_size() >= static_cast<size_t>(k64 * n64 + n * 4);
}

namespace {

// R rows x one block of 64 columns; xu [R, k64] the rows as uint8 (x + 128), rows k64 apart
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void s8_tile(const uint8_t* xu, int64_t k64, const int8_t* w, const int32_t* comp, const float* col_scale,
             const float* row_scale, const float* bias, bool relu, float* y, int64_t ldy, int64_t cols) {
  __m512i acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
  for (int64_t p = 0; p < k64 / 4; ++p, w += 256) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) prefetch_ahead(w + 64 * q);  // (products.h)
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

}  // namespace

void opt::s8_vnni(const float* x, int64_t m, int64_t k, int64_t n, const int8_t* w, const float* col_scale,
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
