// The prompt tiles of the ragged attention on AMX (the tile units of Intel's Xeons from Sapphire Rapids on), for a
// bfloat16 cache. A prompt's tile multiplies its queries by every key block and the probabilities by the values:
// arithmetic that the AVX-512 tiles do with float32 FMAs, one product of 16 lanes each, where one TDPBF16PS does
// 16 x 16 x 32 of them. Per block of 32 keys and 16 queries:
//   scores [16 q, 32 keys] = Q [16, D] . K^T      the keys rearranged as B tiles: pairs of dimensions by keys
//   the running softmax of each query on AVX-512 (as tile_avx512, over 32 keys)
//   O_block [16, D] = P [16, 32] . V [32, D]      the values rearranged as B tiles: pairs of keys by dimensions
//   acc = acc * rescale + O_block                 (AVX-512)
// The products take bfloat16 on both sides and sum in float32. The cache's keys and values are bfloat16 already;
// the queries and the probabilities are float32, and each is split into bfloat16 parts that sum to it (each part the
// rounding of what the ones before left), multiplied in turn: a query in three parts (its 24 bits), a probability
// in two. The results then agree with the AVX-512 tiles' to the float32 tolerance the tests hold both to, where
// rounding each to one bfloat16 would move the scores by a few parts in a thousand; the extra products cost part of
// the gain (benchmark/README.md).
//
// Linux gives a process the tile registers only when it asks for them (arch_prctl, ARCH_REQ_XCOMP_PERM): use_amx()
// asks once. OPT_SERVING_NO_AMX (any value) keeps the AVX-512 tiles (tests compare the two).
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "avx512.h"
#include "ragged_attention.h"

namespace opt::ragged {

#if defined(__x86_64__)
namespace {

using namespace opt::avx512;

#define OPT_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tiles = (d >> 24) & 1u, bf16_tiles = (d >> 22) & 1u;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = (a >> 5) & 1u;  // the conversions to bfloat16 below
  return tiles && bf16_tiles && avx512_bf16;
}

bool tiles_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// palette 1, tiles 0-7 each 16 rows of 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// x -> parts[0..n): bfloat16 numbers summing to x to 8n bits of mantissa (each the rounding of what the ones before
// left; 16 lanes each)
template <int N>
OPT_AMX inline void split16(__m512 x, __m256i* parts) {
  for (int i = 0; i < N; ++i) {
    parts[i] = (__m256i)_mm512_cvtneps_pbh(x);
    if (i + 1 < N) x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(parts[i]), 16)));
  }
}

constexpr int64_t kKeys = 32;  // keys a block: the depth of one TDPBF16PS over key pairs
constexpr int kQParts = 3, kPParts = 2;  // bfloat16 parts of a query, of a probability

template <int NV>
OPT_AMX void tile_amx_d(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out) {
  constexpr int64_t d = 16 * NV, DC = NV / 2;  // head size; chunks of 32 dimensions (a tile row of bfloat16)
  constexpr int kSubs = kTile / 16;            // query tiles of 16 rows
  const int64_t hs = r.h_count * d;
  const int subs = static_cast<int>((it.count + 15) / 16);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) uint16_t qs[kQParts][kTile][d];         // the queries, split (zero past the tile's)
  alignas(64) uint16_t ps[kPParts][kTile][kKeys];     // a block's probabilities, split
  alignas(64) float acc[kTile][d];
  alignas(64) float s[kTile][kKeys];                        // a block's scores
  alignas(64) uint32_t kt[2][DC][16][16];  // the block's keys: [16-key half][dimension chunk][dimension pair][key]
  alignas(64) uint32_t vt[NV][16][16];     // its values: [16-dimension slice][key pair][dimension]
  alignas(64) float ob[16][64];            // a query tile's product with 4 value slices
  float best[kTile], total[kTile], scale[kTile];
  static_assert(kSubs * 16 == kTile, "whole query tiles");

  for (int64_t j = 0; j < kTile; ++j) {
    const float* src = q + (it.first + j) * hs + h * d;
    for (int c = 0; c < NV; ++c) {
      __m256i parts[kQParts] = {};
      if (j < it.count) split16<kQParts>(_mm512_loadu_ps(src + 16 * c), parts);
      for (int i = 0; i < kQParts; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(qs[i][j] + 16 * c), parts[i]);
      _mm512_store_ps(acc[j] + 16 * c, _mm512_setzero_ps());
    }
    for (int i = 0; i < kPParts; ++i) _mm512_store_si512(ps[i][j], _mm512_setzero_si512());
    best[j] = neg_inf;
    total[j] = 0.f;
  }
  // the values' B tiles interleave two keys' rows: lane 2i is key 2p's dimension i, lane 2i + 1 key 2p + 1's
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = static_cast<int16_t>((i & 1) * 32 + i / 2);
    hi_idx[i] = static_cast<int16_t>((i & 1) * 32 + 16 + i / 2);
  }
  const __m512i lo_perm = _mm512_load_si512(lo_idx), hi_perm = _mm512_load_si512(hi_idx);

  TileConfig cfg;
  _tile_loadconfig(&cfg);
  const int64_t last = it.end0 + it.count - 1;  // the last query's keys: [0, last)
  for (int64_t e0 = 0; e0 < last; e0 += kKeys) {
    const int cnt = static_cast<int>(std::min<int64_t>(kKeys, last - e0));
    // keys: a 16 x 16 transpose of dimension pairs (32-bit lanes) per half and chunk; rows past cnt zero
    for (int half = 0; half < 2; ++half) {
      const int n = std::clamp(cnt - 16 * half, 0, 16);
      const uint16_t* kb = n > 0 ? r.keys(it.row, h, e0 + 16 * half) : nullptr;
      for (int c = 0; c < DC; ++c) {
        __m512 rows[16];
        for (int i = 0; i < 16; ++i) rows[i] = i < n ? _mm512_loadu_ps(kb + i * d + 32 * c) : _mm512_setzero_ps();
        transpose16(rows);
        for (int p = 0; p < 16; ++p) _mm512_store_ps(kt[half][c][p], rows[p]);
      }
    }
    // values: key pair p's two rows interleaved, 16 dimensions a slice
    for (int p = 0; p < 16; ++p) {
      const int k0 = 2 * p, k1 = 2 * p + 1;  // keys of the pair (both in the same half)
      const uint16_t* vb = k0 < cnt ? r.values(it.row, h, e0 + 16 * (k0 / 16)) : nullptr;
      for (int c = 0; c < DC; ++c) {
        const __m512i a = k0 < cnt ? _mm512_loadu_si512(vb + (k0 % 16) * d + 32 * c) : _mm512_setzero_si512();
        const __m512i b = k1 < cnt ? _mm512_loadu_si512(vb + (k1 % 16) * d + 32 * c) : _mm512_setzero_si512();
        _mm512_store_si512(vt[2 * c][p], _mm512_permutex2var_epi16(a, lo_perm, b));
        _mm512_store_si512(vt[2 * c + 1][p], _mm512_permutex2var_epi16(a, hi_perm, b));
      }
    }
    const int64_t j0 = std::max<int64_t>(0, e0 + 1 - it.end0);  // the first query with keys in this block
    for (int sub = static_cast<int>(j0 / 16); sub < subs; ++sub) {
      // this query tile's queries with keys in the block: [j_lo, j_hi)
      const int64_t j_lo = std::max<int64_t>(16 * sub, j0), j_hi = std::min<int64_t>(16 * sub + 16, it.count);
      // scores: tiles 0 and 1 (the two halves of the keys), 4 the queries, 5 and 6 the keys
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < DC; ++c) {
        _tile_loadd(5, kt[0][c], 64);
        _tile_loadd(6, kt[1][c], 64);
        for (int i = 0; i < kQParts; ++i) {
          _tile_loadd(4, qs[i][16 * sub] + 32 * c, d * 2);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
        }
      }
      _tile_stored(0, s[16 * sub], kKeys * 4);
      _tile_stored(1, s[16 * sub] + 16, kKeys * 4);
      for (int64_t j = j_lo; j < j_hi; ++j) {
        const int64_t n = std::min<int64_t>(kKeys, it.end0 + j - e0);  // its keys in the block (at least 1)
        const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
        const __m512 s0 = _mm512_mask_blend_ps(m0, _mm512_set1_ps(neg_inf), _mm512_load_ps(s[j]));
        const __m512 s1 = _mm512_mask_blend_ps(m1, _mm512_set1_ps(neg_inf), _mm512_load_ps(s[j] + 16));
        const float top = std::max(best[j], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
        scale[j] = best[j] == top ? 1.f : (best[j] == neg_inf ? 0.f : std::exp(best[j] - top));
        const __m512 tv = _mm512_set1_ps(top);
        const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_nonpositive(_mm512_sub_ps(_mm512_mask_blend_ps(m0, tv, s0), tv)));
        const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_nonpositive(_mm512_sub_ps(_mm512_mask_blend_ps(m1, tv, s1), tv)));
        best[j] = top;
        total[j] = total[j] * scale[j] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        __m256i a[kPParts], b[kPParts];
        split16<kPParts>(p0, a);
        split16<kPParts>(p1, b);
        for (int i = 0; i < kPParts; ++i)
          _mm512_store_si512(ps[i][j], _mm512_inserti64x4(_mm512_castsi256_si512(a[i]), b[i], 1));
      }
      // probabilities by values, 4 slices of 16 dimensions a pass: tiles 0-3 the output, 4 the probabilities
      for (int pass = 0; pass < NV / 4; ++pass) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int part = 0; part < kPParts; ++part) {
          _tile_loadd(4, ps[part][16 * sub], kKeys * 2);
          _tile_loadd(5, vt[4 * pass][0], 64);
          _tile_loadd(6, vt[4 * pass + 1][0], 64);
          _tile_loadd(7, vt[4 * pass + 2][0], 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, vt[4 * pass + 3][0], 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ob[0], 256);
        _tile_stored(1, ob[0] + 16, 256);
        _tile_stored(2, ob[0] + 32, 256);
        _tile_stored(3, ob[0] + 48, 256);
        for (int64_t j = j_lo; j < j_hi; ++j) {
          const __m512 sv = _mm512_set1_ps(scale[j]);
          for (int t = 0; t < 4; ++t) {
            float* a = acc[j] + 64 * pass + 16 * t;
            _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), sv, _mm512_load_ps(ob[j - 16 * sub] + 16 * t)));
          }
        }
      }
    }
  }
  _tile_release();
  for (int64_t j = 0; j < it.count; ++j) {
    float* o = out + (it.first + j) * hs + h * d;
    const __m512 inv = _mm512_set1_ps(1.f / total[j]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * c), inv));
  }
}

}  // namespace

bool use_amx() {
  static const bool on = use_avx512() && std::getenv("OPT_SERVING_NO_AMX") == nullptr && cpu_has_amx_bf16() &&
                         tiles_permitted();
  return on;
}

bool tile_amx(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out) {
  if (it.count <= kFew) return false;  // a running row's query: a read of its entries, tile_few_avx512
  if (r.d == 64) {
    tile_amx_d<4>(r, q, it, h, out);
    return true;
  }
  if (r.d == 128) {
    tile_amx_d<8>(r, q, it, h, out);
    return true;
  }
  return false;
}
#else
bool use_amx() { return false; }
bool tile_amx(const Rows<uint16_t>&, const float*, const Item&, int64_t, float*) { return false; }
#endif

}  // namespace opt::ragged

// whether a prompt's attention over a bfloat16 cache runs the AMX tiles here (tests pick their cases by it)
extern "C" int opt_ragged_amx() { return opt::ragged::use_amx() ? 1 : 0; }
