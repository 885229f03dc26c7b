#include <type_traits>

#include "ragged_attention.h"

using namespace opt;
using namespace opt::ragged;

namespace {

// the runs of the step, cut into tiles
std::vector<Item> tiles(const int32_t* rows, const int32_t* ends, int64_t n, int64_t b_count, int64_t t_max) {
  std::vector<Item> out;
  int64_t i = 0;
  while (i < n) {
    const int64_t row = rows[i], end = ends[i];
    if (row < 0 || row >= b_count || end <= 0 || end > t_max) {  // padding, or a row not stepped: zeros
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < n && j - i < kTile && rows[j] == row && ends[j] == end + (j - i)) ++j;
    out.push_back({i, j - i, row, end});
    i = j;
  }
  return out;
}

// The portable version: one query at a time, two passes over its keys.
template <typename KV>
void tile_portable(const Rows<KV>& r, const float* q, const Item& it, int64_t h, float* out) {
  const int64_t d = r.d, hs = r.h_count * d;
  std::vector<float> scores(it.end0 + it.count);
  for (int64_t j = 0; j < it.count; ++j) {
    const float* qr = q + (it.first + j) * hs + h * d;
    float* o = out + (it.first + j) * hs + h * d;
    const int64_t n = it.end0 + j;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < n; ++e) {
      const KV* kr = r.keys(it.row, h, e - e % kBlock) + (e % kBlock) * d;
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += qr[c] * kv_float(kr[c]);
      scores[e] = dot;
      best = std::max(best, dot);
    }
    float total = 0.f;
    for (int64_t c = 0; c < d; ++c) o[c] = 0.f;
    for (int64_t e = 0; e < n; ++e) {
      const float p = std::exp(scores[e] - best);
      total += p;
      const KV* vr = r.values(it.row, h, e - e % kBlock) + (e % kBlock) * d;
      for (int64_t c = 0; c < d; ++c) o[c] += p * kv_float(vr[c]);
    }
    for (int64_t c = 0; c < d; ++c) o[c] /= total;
  }
}

template <typename KV>
void attend_ragged(const Rows<KV>& r, const float* q, const std::vector<Item>& items, float* out) {
  const int64_t h_count = r.h_count;
#if defined(__x86_64__)
  const bool avx512 = use_avx512();
#else
  const bool avx512 = false;
#endif
  const bool amx = use_amx();
  const int64_t work = static_cast<int64_t>(items.size()) * h_count;
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h; tiles later in a run have more keys)
  for (int64_t w = 0; w < work; ++w) {
    // head-major: a head's tiles one after another, so rows sharing a prefix read its blocks for that head (a
    // few hundred KB) from cache, where row-major order cycled every head's blocks through it between two rows
    const Item& it = items[w % items.size()];
    const int64_t h = w / static_cast<int64_t>(items.size());
    if (amx && tile_amx(r, q, it, h, out)) continue;
    if (avx512 && tile_avx512(r, q, it, h, out)) continue;
    if (!tile_loops(r, q, it, h, out)) tile_portable(r, q, it, h, out);
  }
}

}  // namespace

// q [N, H, D] float32; k, v [B, H, T, D]; rows, ends [N] int32; pool_k, pool_v [H, P, bs, D] (the cache's type;
// P may be 0); ptab [B, Mp], plen [B] int32 -> [N, H, D] float32 (zeros for a query with no row or no entries)
static ffi::Error RaggedAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> ends, ffi::AnyBuffer pool_k,
                                  ffi::AnyBuffer pool_v, ffi::Buffer<ffi::S32> ptab, ffi::Buffer<ffi::S32> plen,
                                  ffi::ResultBuffer<ffi::F32> out) {
  use_threads();
  auto qd = q.dimensions(), kd = k.dimensions(), pd = pool_k.dimensions(), td = ptab.dimensions();
  const auto kt = k.element_type();
  const bool kv_ok = (kt == ffi::DataType::F32 || kt == ffi::DataType::BF16 || kt == ffi::DataType::U16) &&
                     v.element_type() == kt && pool_k.element_type() == kt && pool_v.element_type() == kt;
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 4 || td.size() != 2 || !kv_ok || kd[1] != qd[1] ||
      kd[3] != qd[2] || v.element_count() != k.element_count() || rows.element_count() != qd[0] ||
      ends.element_count() != qd[0] || pd[0] != qd[1] || pd[3] != qd[2] || pool_v.element_count() !=
      pool_k.element_count() || td[0] != kd[0] || plen.element_count() != kd[0] || pd[2] % kBlock != 0) {
    return ffi::Error::InvalidArgument(
        "opt_ragged_attention: q [N, H, D] float32, k and v [B, H, T, D], rows and ends [N], pool k and v "
        "[H, P, bs, D] (bs a multiple of 16) of the cache's type, ptab [B, Mp] and plen [B] expected");
  }
  const int64_t n = qd[0], b_count = kd[0];
  const int32_t *rw = rows.typed_data(), *en = ends.typed_data(), *pl = plen.typed_data();
  for (int64_t b = 0; b < b_count; ++b) {
    if (pl[b] < 0 || pl[b] > td[1] * pd[2] || pl[b] % pd[2] != 0) {
      return ffi::Error::InvalidArgument("opt_ragged_attention: a row's prefix is not whole pool blocks");
    }
  }
  const std::vector<Item> items = tiles(rw, en, n, b_count, kd[2]);
  float* o = out->typed_data();
  std::fill(o, o + out->element_count(), 0.f);
  auto run = [&](auto* kp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    Rows<KV> r{static_cast<const KV*>(k.untyped_data()), static_cast<const KV*>(v.untyped_data()),
               static_cast<const KV*>(pool_k.untyped_data()), static_cast<const KV*>(pool_v.untyped_data()),
               ptab.typed_data(), pl, qd[1], kd[2], qd[2], pd[1], pd[2], td[1]};
    attend_ragged(r, q.typed_data(), items, o);
  };
  if (kt == ffi::DataType::F32) {
    run(static_cast<const float*>(nullptr));
  } else {
    run(static_cast<const uint16_t*>(nullptr));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptRaggedAttention, OnKernelThread<RaggedAttention>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
