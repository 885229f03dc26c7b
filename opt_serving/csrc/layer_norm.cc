#include "common.h"

using namespace opt;

// Layer norm over the last axis, y = (x - mean) / sqrt(var + eps) * scale + bias, each row computed alone by the
// same code: a row's numbers do not depend on how many rows the call has. XLA's own reductions are vectorised by
// the shape of the whole array, so a row normalised in a step of one row (a decode step) and in a step of five (a
// speculative check of the same position) differed in the last bits; products of int8 weights quantize each row
// to 127 steps of its largest value, where such a bit moves a value by a step, and a check then refused a draft that
// plain decoding would have chosen. Two passes (the mean, then the squares about it), as torch's layer norm.
// 16 floats as one value (GCC's vector extension): lane-wise arithmetic, whatever the instructions that carry it.
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A row's sum of term(x_j) in one fixed order: 16 running sums (element j into sum j % 16), then those in turn,
// written out rather than left to `omp simd reduction`, whose order is the compiler's. `term` takes 16 lanes or one.
template <class Term>
static inline __attribute__((always_inline)) float row_sum(const float* x, int64_t d, Term term) {
  const int64_t whole = d / 16 * 16;
  v16 acc = {};
  for (int64_t j = 0; j < whole; j += 16) acc += term(load16(x + j));
  float part[16];
  std::memcpy(part, &acc, sizeof part);
  for (int64_t j = whole; j < d; ++j) part[j & 15] += term(x[j]);
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += part[i];
  return sum;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
static void norm_row(const float* x, const float* scale, const float* bias, int64_t d, float eps, float* y) {
  const int64_t whole = d / 16 * 16;
  const float mean = row_sum(x, d, [](auto v) { return v; }) / static_cast<float>(d);
  const float squares = row_sum(x, d, [mean](auto v) {
    const auto c = v - mean;
    return c * c;
  });
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < whole; j += 16) {
    const v16 out = (load16(x + j) - mean) * inv * load16(scale + j) + load16(bias + j);
    std::memcpy(y + j, &out, sizeof out);
  }
  for (int64_t j = whole; j < d; ++j) y[j] = (x[j] - mean) * inv * scale[j] + bias[j];
}

// A call of few rows runs here, on XLA's thread: handing it to the kernel thread cost more than the rows (a decode
// step's norms are a few microseconds each); a prompt's chunk runs across the kernels' team.
static ffi::Error LayerNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                            ffi::ResultBuffer<ffi::F32> out, float eps) {
  auto dims = x.dimensions();
  if (dims.size() != 2 || scale.element_count() != static_cast<size_t>(dims[1]) ||
      bias.element_count() != static_cast<size_t>(dims[1]) || out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("opt_layer_norm: x must be [M, D], scale and bias [D], out [M, D]");
  }
  const int64_t rows = dims[0], d = dims[1];
  const float *xs = x.typed_data(), *s = scale.typed_data(), *b = bias.typed_data();
  float* ys = out->typed_data();
  if (rows * d < (1 << 18)) {
    for (int64_t r = 0; r < rows; ++r) norm_row(xs + r * d, s, b, d, eps, ys + r * d);
    return ffi::Error::Success();
  }
  on_kernel_thread([&] {
    use_threads();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) norm_row(xs + r * d, s, b, d, eps, ys + r * d);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptLayerNorm, LayerNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
