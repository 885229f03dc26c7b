// Matrix products against weights packed once at load, for every weight format the CPU backend has:
//
//   float32   y = x @ W on float32 weights (oneDNN; a plain stream over the weights for 1-8 rows)
//   bfloat16  the rows rounded to bfloat16, bfloat16 weights, float32 accumulation (AVX512_BF16/AMX; from
//             opt_bf16_fma_rows rows up, float32 FMAs on the weights widened in registers: bf16_fma)
//   int8      each row quantized to int8 with its own scale (max |x| / 127), int8 weights with a
//             scale per output column (symmetric), int32 accumulation (VNNI), y = acc * s_row * s_col; on a CPU
//             without VNNI or AMX the rows get 7 bits (max |x| / 63), which its int16 pair sums hold (common.h)
//
// Why packed: XLA CPU's GEMMs take the weights as a plain [K, N] runtime argument and re-pack them
// on every call; a decode step multiplies a few rows by every weight of the model, so that packing
// was most of its memory traffic. oneDNN's matmul reads weights already in its blocked layout.
//
// This file packs the weights and runs oneDNN's products on them. Where our own kernel beats oneDNN's for a
// product's rows on this CPU, the handlers run it over the same packed weight instead (products.h): float32
// products of a few rows (products_f32.cc), bfloat16 ones with float32 FMAs (products_bf16.cc), int8 ones with
// VNNI (products_s8.cc), each file with the switch that sets from or up to how many rows its kernel runs.
//
//   opt_onednn_packed_bytes_as(K, N, type)                  size of a packed [K, N] weight (type: 0 f32, 1 bf16, 2 s8)
//   opt_onednn_pack_as(w, K, N, transposed, type, out)      w row-major [K, N] ([N, K] when transposed):
//                                                           float32 for f32/bf16, int8 for s8
//   opt_onednn_unpack_as(packed, K, N, type, w)             the reverse ([K, N]; bfloat16 comes back as float32)
//   OptOnednnMatmul (FFI)      y[M, N] = x[M, K] @ W (+ bias[N]) (relu), float32 weights
//   OptOnednnMatmulLowp (FFI)  the same for bfloat16 (weights=1) or int8 (weights=2, with scales[N]) weights
//   opt_s8_row_levels()        the levels a side of an int8 product's rows here: 127, or 63 (common.h, s8_rows)
#include "products.h"

using namespace opt;

namespace {

enum WeightType : int { kF32 = 0, kBF16 = 1, kS8 = 2 };

dt packed_type(int type) { return type == kS8 ? dt::s8 : type == kBF16 ? dt::bf16 : dt::f32; }

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

extern "C" int opt_s8_row_levels() { return s8_row_levels(); }

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
    if (streams_as_strips(wd, k, n)) {
      f32_panels(x.typed_data(), m, k, n, static_cast<const float*>(packed.untyped_data()),
                 has_bias ? bias.typed_data() : nullptr, relu, y->typed_data());
      return ffi::Error::Success();
    }
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
    if (fma_rows > 0 && m >= fma_rows && bf16_fma_reads(wd, k, n)) {
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
    const bool u7 = type == dt::s8 && !s8_rows();
    if (type == dt::s8) {
      xq.resize(m * k);
      row_scale.resize(m);
      if (u7) {
        rows_to_u7(x.typed_data(), m, k, reinterpret_cast<uint8_t*>(xq.data()), row_scale.data());
      } else {
        rows_to_s8(x.typed_data(), m, k, xq.data(), row_scale.data());
      }
      src_data = xq.data();
    } else {
      xb.resize(m * k);
      rows_to_bf16(x.typed_data(), m * k, xb.data());
      src_data = xb.data();
    }
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory({{m, k}, u7 ? dt::u8 : type, tag::ab}, eng, src_data)},
        {DNNL_ARG_WEIGHTS, dnnl::memory(wd, eng, packed.untyped_data())},
        {DNNL_ARG_DST, dnnl::memory({{m, n}, dt::f32, tag::ab}, eng, y->typed_data())}};
    if (type == dt::s8) {
      args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS,
                   dnnl::memory({{n}, dt::f32, tag::a}, eng, const_cast<float*>(scales.typed_data())));
      static int32_t zero = kU8RowZero;
      if (u7) args.emplace(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, dnnl::memory({{1}, dt::s32, tag::a}, eng, &zero));
    } else if (has_bias) {
      args.emplace(DNNL_ARG_BIAS, dnnl::memory({{1, n}, dt::f32, tag::ab}, eng, bias.typed_data()));
    }
    run(prim, args);
    if (type == dt::s8) {
      s8_epilogue(y->typed_data(), m, n, row_scale.data(), has_bias ? bias.typed_data() : nullptr, relu);
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

// The float32 names the Python side has always used
extern "C" int64_t opt_onednn_packed_bytes(int64_t k, int64_t n) { return opt_onednn_packed_bytes_as(k, n, kF32); }

extern "C" int opt_onednn_pack(const float* w, int64_t k, int64_t n, int transposed, void* out) {
  return reorder_plain(k, n, transposed, w, out, true);
}

extern "C" int opt_onednn_unpack(const void* packed, int64_t k, int64_t n, int transposed, float* w) {
  return reorder_plain(k, n, transposed, packed, w, false);
}
