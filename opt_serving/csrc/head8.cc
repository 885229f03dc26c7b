#include "head.h"

using namespace opt;

// ---------------------------------------------------------------------------------------------
// The same screen in int8, where oneDNN's int8 products run on VNNI or AMX (int32 sums that never saturate): the
// head read at a quarter of float32's bytes, half of bfloat16's.
//
// The bound. Row j of the head is e_j ~ s_j q_j (q_j int8, s_j = max_i |e_ij| / 127, so each d_ij = e_ij - s_j q_ij
// has |d_ij| <= s_j / 2), the input x ~ t p (t = max_i |x_i| / 127, |f_i| = |x_i - t p_i| <= t / 2). As
// x_i e_ij - t p_i s_j q_ij = t p_i d_ij + f_i s_j q_ij + f_i d_ij,
//   |x . e_j - t s_j p . q_j| <= s_j/2 (||x||_1 + K t/2) + t/2 (||e_j||_1 + K s_j/2) + K t s_j / 4
//                              = s_j (||x||_1 / 2 + 3 K t / 4) + t ||e_j||_1 / 2.
// p . q_j is exact in int32; making it float32, then the products by s_j and by t, round three times: at most
// 4 2^-24 t s_j sum_i |p_i||q_ij| <= 4 2^-24 127 s_j (||x||_1 + K t / 2). As in the bfloat16 screen, g_K ||x|| ||e_j||
// more covers the float32 logit a plain product would compute, (1 + 2^-12) the screen's own float32 arithmetic
// (here r_j >= s_j ||x||_1 / 2 >= |a_j| / 254, so a_j -/+ r_j rounds by under 2^-16 of r_j), 1e-30 flushed
// denormals. ||e_j||_1 and ||e_j|| are computed at packing time (rounded up).
//
//   opt_head8_supported()                                1 when oneDNN's int8 products here are VNNI or AMX
//   opt_head8_pack(e, K, N, out, scales, l1, norms)      e row-major [N, K] float32 -> the packed int8 [K, N] head
//                                                        (its size: opt_onednn_packed_bytes_as(K, N, 2)), s_j, norms
//   OptGreedyHead8 (FFI handler)                         tok[M] as OptGreedyHead (`allowed` too), from that head
namespace {

// x [k] -> p (int8) with t = max |x_i| / 127 (1 for a zero row), each p_i the nearest integer to x_i / t
float quantize_row(const float* x, int64_t k, int8_t* p) {
  float top = 0.f;
  for (int64_t i = 0; i < k; ++i) top = std::max(top, std::fabs(x[i]));
  const float t = top > 0.f ? top / 127.f : 1.f;
  for (int64_t i = 0; i < k; ++i) {
    p[i] = static_cast<int8_t>(std::max(-127.0, std::min(127.0, std::nearbyint(static_cast<double>(x[i]) / t))));
  }
  return t;
}

}  // namespace

extern "C" int opt_head8_supported() { return native_products(dt::s8, {"vnni", "amx"}); }

// e: the float32 embedding, row-major [N, K]. Writes the packed int8 [K, N] head, each row's scale s_j and its
// L1 and L2 norms (rounded up). Returns 2 when e holds a non-finite number (no bound then).
extern "C" int opt_head8_pack(const float* e, int64_t k, int64_t n, void* out, float* scales, float* l1,
                              float* norms) {
  std::vector<int8_t> q(static_cast<size_t>(k * n));
  for (int64_t j = 0; j < n; ++j) {
    const float* row = e + j * k;
    double s1 = 0.0, s2 = 0.0;
    float top = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      s1 += std::fabs(static_cast<double>(row[i]));
      s2 += static_cast<double>(row[i]) * row[i];
      top = std::max(top, std::fabs(row[i]));
    }
    if (!std::isfinite(s1) || !std::isfinite(s2)) return 2;
    const float s = top > 0.f ? top / 127.f : 1.f;
    scales[j] = s;
    for (int64_t i = 0; i < k; ++i) {
      q[j * k + i] = static_cast<int8_t>(std::max(-127.0, std::min(127.0, std::nearbyint(row[i] / static_cast<double>(s)))));
    }
    const float inf = std::numeric_limits<float>::infinity();
    l1[j] = std::nextafter(static_cast<float>(s1 * (1 + 1e-7)), inf);
    norms[j] = std::nextafter(static_cast<float>(std::sqrt(s2) * (1 + 1e-7)), inf);
  }
  return reorder_plain(k, n, /*transposed=*/1, q.data(), out, /*pack=*/true, dt::s8, dt::s8);
}

static ffi::Error GreedyHead8(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer packed, ffi::Buffer<ffi::F32> embedding,
                              ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> l1, ffi::Buffer<ffi::F32> norms,
                              ffi::Buffer<ffi::S32> exclude, ffi::Buffer<ffi::S32> allowed,
                              ffi::ResultBuffer<ffi::S32> out) {
  use_threads();
  auto xd = x.dimensions(), ed = embedding.dimensions();
  const size_t nv = ed.size() == 2 ? static_cast<size_t>(ed[0]) : 0;
  if (xd.size() != 2 || ed.size() != 2 || xd[1] != ed[1] || norms.element_count() != nv ||
      scales.element_count() != nv || l1.element_count() != nv ||
      out->element_count() != static_cast<size_t>(xd[0]) || exclude.element_count() != static_cast<size_t>(xd[0])) {
    return ffi::Error::InvalidArgument(
        "opt_greedy_head8: x must be [M, K], embedding [N, K], scales, l1 and norms [N], exclude and out [M]");
  }
  const int64_t m = xd[0], k = xd[1], n = ed[0], words = mask_words(allowed, xd[0], ed[0]);
  if (n > (1 << 20)) return ffi::Error::InvalidArgument("opt_greedy_head8: a vocabulary over 2^20 tokens");
  if (words < 0) return ffi::Error::InvalidArgument("opt_greedy_head8: allowed must be [M, 0] or [M, ceil(N / 32)]");
  if (m == 0) return ffi::Error::Success();
  try {
    const dnnl::memory::desc& wd = packed_desc(k, n, dt::s8);
    if (packed.size_bytes() != wd.get_size()) {
      return ffi::Error::InvalidArgument("opt_greedy_head8: the packed head has " + std::to_string(packed.size_bytes()) +
                                         " bytes, a packed int8 [" + std::to_string(k) + ", " + std::to_string(n) +
                                         "] head " + std::to_string(wd.get_size()));
    }
    static std::vector<int8_t> xq;
    static std::vector<float> approx;
    xq.resize(m * k);
    approx.resize(m * n);
    const float* xs = x.typed_data();
    std::vector<float> t(m);
    std::vector<Radius> rads(m);
    std::vector<char> all(m);
    const double g = k * std::ldexp(1.0, -24) / (1.0 - k * std::ldexp(1.0, -24));
    const double safety = (1 + std::ldexp(1.0, -12)) * (1 + 1e-6);  // the screen's float32 arithmetic, rounded up
    const float max_norm = largest(norms.typed_data(), n);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = xs + r * k;
      double x1 = 0.0;
      for (int64_t i = 0; i < k; ++i) x1 += std::fabs(static_cast<double>(xr[i]));
      const double xn = std::sqrt(dot_exact(xr, xr, k));
      all[r] = scored_exactly(xn, max_norm);
      t[r] = all[r] ? 1.f : quantize_row(xr, k, xq.data() + r * k);
      if (all[r]) std::fill(xq.begin() + r * k, xq.begin() + (r + 1) * k, 0);
      const double tr = t[r];
      rads[r] = Radius{{scales.typed_data(), l1.typed_data(), norms.typed_data()},
                       {static_cast<float>((x1 / 2 + 3 * k * tr / 4 + 508 * std::ldexp(1.0, -24) * (x1 + k * tr / 2)) * safety),
                        static_cast<float>(tr / 2 * safety), static_cast<float>(g * xn * safety)}};
    }
    dnnl::matmul prim = matmul_for(m, k, n, false, false, dt::s8);
    dnnl::engine& eng = cpu_engine();
    dnnl::memory src({{m, k}, dt::s8, tag::ab}, eng, xq.data());
    dnnl::memory wts(wd, eng, packed.untyped_data());
    dnnl::memory dst({{m, n}, dt::f32, tag::ab}, eng, approx.data());
    dnnl::memory sc({{n}, dt::f32, tag::a}, eng, const_cast<float*>(scales.typed_data()));
    dnnl::stream stream(eng);
    prim.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wts}, {DNNL_ARG_DST, dst},
                          {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, sc}});
    stream.wait();
    decide_rows(xs, approx.data(), embedding.typed_data(), m, k, n, rads, all, exclude.typed_data(),
                allowed.typed_data(), words, t.data(), out->typed_data());
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("opt_greedy_head8: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptGreedyHead8, OnKernelThread<GreedyHead8>::call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
