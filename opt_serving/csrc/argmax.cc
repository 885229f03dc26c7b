#include "common.h"

using namespace opt;

// The index of each row's maximum: the first one, and a NaN (the first) wins, as jnp.argmax.
// XLA CPU's own argmax (a variadic reduce) and its TopK with k=1 both run at ~1.5 ns an
// element. One vectorised pass per row takes each chunk's maximum (and notes the first chunk
// holding a NaN); only the winning chunk is scanned again for the first index holding it.
constexpr int64_t kArgmaxChunk = 1024;

__attribute__((target_clones("avx512f", "avx2", "default")))
static int64_t row_argmax(const float* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0, nan_chunk = -1;
  for (int64_t c = 0; c * kArgmaxChunk < v && nan_chunk < 0; ++c) {
    const float* x = row + c * kArgmaxChunk;
    const int64_t n = std::min(kArgmaxChunk, v - c * kArgmaxChunk);
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
      m = x[i] > m ? x[i] : m;
      nan |= x[i] != x[i];
    }
    if (nan) nan_chunk = c;
    else if (m > best) best = m, best_chunk = c;  // strictly greater: the first chunk keeps a tie
  }
  const int64_t c = nan_chunk >= 0 ? nan_chunk : best_chunk;
  const float* x = row + c * kArgmaxChunk;
  const int64_t n = std::min(kArgmaxChunk, v - c * kArgmaxChunk);
  for (int64_t i = 0; i < n; ++i) {
    if (nan_chunk >= 0 ? x[i] != x[i] : x[i] == best) return c * kArgmaxChunk + i;
  }
  return 0;  // every entry -inf: best stays -inf and the first entry equals it, so not reached
}

static ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  use_threads();
  auto d = x.dimensions();
  if (d.size() != 2 || out->element_count() != static_cast<size_t>(d[0])) {
    return ffi::Error::InvalidArgument("opt_argmax: x must be [B, V] and out [B]");
  }
  const int64_t rows = d[0], v = d[1];
  const float* data = x.typed_data();
  int32_t* idx = out->typed_data();
#pragma omp parallel for schedule(dynamic, 1)  // (dynamic: common.h)
  for (int64_t r = 0; r < rows; ++r) idx[r] = static_cast<int32_t>(row_argmax(data + r * v, v));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptArgmax, OnKernelThread<Argmax>::call,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

