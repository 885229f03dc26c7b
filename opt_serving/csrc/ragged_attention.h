// The ragged step's attention (ragged_attention.cc) and the tiles it runs: a prompt's on AMX for a bfloat16 cache
// (ragged_attention_amx.cc), the AVX-512 ones (ragged_attention_avx512.cc), the vector loops built for AVX2 with FMA
// (ragged_attention_loops.cc), the portable one.
#pragma once

#include "common.h"

namespace opt::ragged {

// Attention of a ragged step: N queries, query i of cache row rows[i] reading that row's entries [0, ends[i]) —
// a running row's newest token (one query), or a run of a prompt's tokens continuing its row (a chunk: query j of
// the run reads one entry more than query j - 1, so the run is causal). Every query's own k/v is in the cache
// already (the step writes them first). A row's first plen[row] entries (whole blocks of a cached prefix) are read
// from the prefix cache's pool, blocks ptab[row, :], instead of the row: rows that share a prefix then read the
// same memory, which stays in the caches for the rows after the first, where copies in each row were each read
// from memory.
//
// Each run is cut into tiles of at most kTile queries; a tile, for one head, goes over the keys a block of 16
// entries at a time: the block is read once for all of its queries, each keeping a running softmax (its max, its
// sum and its output, rescaled when the max grows). Rows of float32 or bfloat16 (as its bits in uint16) entries.

constexpr int64_t kTile = 32;   // queries of a run that share each key block
constexpr int64_t kBlock = 16;  // keys a block (the pool's block size must be a multiple of it)
constexpr int64_t kFew = 2;     // tiles of at most this many queries skip the transpose of each key block

struct Item {
  int64_t first, count, row, end0;  // queries first.. first + count - 1 of `row`; query j reads [0, end0 + j)
};

template <typename KV>
struct Rows {
  const KV *k, *v;            // [B, H, T, D]
  const KV *pk, *pv;          // [H, P, bs, D]
  const int32_t *ptab, *plen;  // [B, Mp], [B]
  int64_t h_count, t_count, d, p_count, bs, mp;

  // the entries e0.. e0 + 15 of `row`, head h (contiguous: a block never straddles the prefix's end)
  const KV* keys(int64_t row, int64_t h, int64_t e0) const {
    if (e0 < plen[row]) return pk + ((h * p_count + ptab[row * mp + e0 / bs]) * bs + e0 % bs) * d;
    return k + ((row * h_count + h) * t_count + e0) * d;
  }
  const KV* values(int64_t row, int64_t h, int64_t e0) const {
    if (e0 < plen[row]) return pv + ((h * p_count + ptab[row * mp + e0 / bs]) * bs + e0 % bs) * d;
    return v + ((row * h_count + h) * t_count + e0) * d;
  }
};

inline float kv_float(float x) { return x; }
inline float kv_float(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A running row's query reads its head's entries once, in short runs (a few 4 KB pages a row and head) that the
// hardware's prefetcher alone followed poorly, so the tiles of a few queries ask for the block kAhead blocks on:
// key i's k and v as they compute key i of this block (the addresses through keys()/values(): a prefix's pool
// blocks are not contiguous). A prompt's tile does enough arithmetic on each block to gain nothing from it.
constexpr int64_t kAhead = 2;

template <typename KV>
__attribute__((always_inline)) inline void prefetch_run_ahead(const Rows<KV>& r, int64_t row, int64_t h,
                                                              int64_t e0, int i, int64_t end) {
  const int64_t ahead = e0 + kAhead * kBlock;
  if (ahead + i >= end) return;
  const char* k = reinterpret_cast<const char*>(r.keys(row, h, ahead) + i * r.d);
  const char* v = reinterpret_cast<const char*>(r.values(row, h, ahead) + i * r.d);
  for (int64_t b = 0; b < r.d * static_cast<int64_t>(sizeof(KV)); b += 64) {
#if defined(__x86_64__)
    _mm_prefetch(k + b, _MM_HINT_T0);
    _mm_prefetch(v + b, _MM_HINT_T0);
#else
    __builtin_prefetch(k + b, 0, 3);
    __builtin_prefetch(v + b, 0, 3);
#endif
  }
}

// One tile's queries for head h (q [N, H, D] -> out [N, H, D]), or false where the code does not take head size
// r.d: the AVX-512 tiles (64 and 128; the CPU's AVX-512 is the caller's to check) and the vector loops (64, 128).
bool tile_avx512(const Rows<float>& r, const float* q, const Item& it, int64_t h, float* out);
bool tile_avx512(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out);
bool tile_loops(const Rows<float>& r, const float* q, const Item& it, int64_t h, float* out);
bool tile_loops(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out);

// A prompt's tile (more than kFew queries) on AMX, for a bfloat16 cache and head size 64 or 128, or false. The
// caller checks use_amx(): the CPU has AMX with bfloat16, Linux lets this process use it, and neither
// OPT_SERVING_NO_AMX nor OPT_SERVING_NO_AVX512 is set. Read once.
bool use_amx();
bool tile_amx(const Rows<uint16_t>& r, const float* q, const Item& it, int64_t h, float* out);
inline bool tile_amx(const Rows<float>&, const float*, const Item&, int64_t, float*) { return false; }

}  // namespace opt::ragged
