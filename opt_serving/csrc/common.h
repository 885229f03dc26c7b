// Shared by the CPU kernels (XLA FFI custom calls, built into opt_serving/_cpu_kernels.so by
// build.sh; loaded by opt_serving/backend/cpu/_lib.py). One file per kind of kernel:
//   products.cc   oneDNN matrix products on weights packed once at load (float32, bfloat16, int8), and the
//                 handlers that pick a kernel of ours where it beats oneDNN's (products.h):
//                 products_f32.cc (a few float32 rows), products_bf16.cc (float32 FMAs), products_s8.cc (VNNI)
//   argmax.cc     jnp.argmax over a row at memory speed
//   attention.cc  a decode step's attention over the cache entries written so far
//   head.cc       greedy tokens from the LM head, screened in int8 or bfloat16 and decided exactly
// A packed buffer's layout is the one oneDNN's matmul picks on this CPU with this oneDNN, so it
// is only valid in the process that made it: nothing packed is ever written to disk.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <optional>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

namespace opt {

constexpr int64_t kPackRows = 32;  // the rows the weight layout is chosen for (the same BA16a64b for 16-128 here)

dnnl::engine& cpu_engine();

extern std::mutex mu;  // guards the primitive and layout caches (sizes are asked for from Python's threads too)

// Threads for every parallel region we start or oneDNN starts for us (0: OpenMP's default). Set
// from Python: XLA's own pool ignores OMP_NUM_THREADS, and a Ray worker has it set to its CPU
// reservation (1 for a Serve replica), which would leave our kernels on one core while XLA uses
// all. OpenMP keeps the count per thread: each kernel sets it on the kernel thread (below).
void use_threads();

// The loops of ours that carry a step's work (products, attention, the greedy head's rows, argmax) are scheduled
// dynamically, the team taking a piece at a time as it frees up, not split evenly up front: served, the host's
// threads and the load generator take a core from one of the two threads for moments at a time, and with an even
// split the other then waits at the loop's end (benchmark/README.md, "An int8 kernel whose blocks the team takes").

// Runs `f` on the kernel thread, the one thread that starts every parallel region of ours and of
// oneDNN's, and returns when it is done (rethrowing what it threw). libgomp keeps a team of workers
// per thread that starts a parallel region, and XLA runs custom calls on whichever of its pool threads
// is free: each of those grew a team of its own, libgomp then counted more threads than cores and
// put its workers to sleep between regions, and every product, attention and argmax paid a futex
// wake-up. With one starting thread there is one team, whose workers stay awake between the calls of a step.
void on_kernel_thread(const std::function<void()>& f);

// An FFI handler run on the kernel thread: XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, OnKernelThread<Body>::call, ...)
template <auto Body>
struct OnKernelThread;
template <class... Args, ffi::Error (*Body)(Args...)>
struct OnKernelThread<Body> {
  static ffi::Error call(Args... args) {
    std::optional<ffi::Error> result;
    on_kernel_thread([&] { result.emplace(Body(std::move(args)...)); });
    return std::move(*result);
  }
};

// Does oneDNN's matmul of `type` rows by `type` weights run on an implementation whose name has one of `marks`?
bool native_products(dt type, std::initializer_list<const char*> marks);

// How oneDNN's int8 products take their rows here. With VNNI or AMX they sum int8 products in int32 exactly, and
// take int8 rows (s8_rows: 127 levels a side). Without (AVX2, AVX-512 before VNNI) they multiply uint8 by int8
// bytes and add pairs of products in int16 (VPMADDUBSW), which saturates past 32767: an int8 row, shifted by 128
// to uint8, gave sums off by a tenth. There the rows are quantized to 7 bits (63 levels a side) and shifted by 64
// to uint8 in [1, 127], a zero point oneDNN takes back: a pair then sums to at most 2 * 127 * 127 = 32258, exact
// (PyTorch's fbgemm does the same there, its reduce_range).
bool s8_rows();
inline int s8_row_levels() { return s8_rows() ? 127 : 63; }
constexpr int32_t kU8RowZero = 64;  // the zero point of the 7-bit rows

// The layout oneDNN's matmul picks for a [K, N] weight of type `in` (float32 results either way;
// int8 weights are multiplied by int8 rows (or 7-bit ones, above) with per-column weight scales).
const dnnl::memory::desc& packed_desc(int64_t k, int64_t n, dt in = dt::f32);

// The matmul (cached) of [M, K] rows of type `in` by a packed [K, N] weight of that type (packed_desc) into float32
// [M, N]: with a bias [1, N] and a fused ReLU for float32 and bfloat16; int8 takes a scale per column instead
// (DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS) and leaves bias and ReLU to the caller; without s8_rows() its rows are
// uint8 with the zero point kU8RowZero (DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC).
dnnl::matmul matmul_for(int64_t m, int64_t k, int64_t n, bool bias, bool relu, dt in = dt::f32);

// Copy between a plain row-major [K, N] (or [N, K], transposed) weight of type `plain_type` and
// the packed one of type `packed_type` (oneDNN rounds to nearest even going to bfloat16). 0 on success.
int reorder_plain(int64_t k, int64_t n, int transposed, const void* from, void* to, bool pack,
                  dt packed_type = dt::f32, dt plain_type = dt::f32);

// round to nearest even; finite inputs only (the caller checks). Inline: the row conversions call it per
// element, and a call the compiler cannot see into keeps those loops scalar.
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

double dot_exact(const float* x, const float* w, int64_t k);

#if defined(__x86_64__)
// Whether our kernels take their AVX-512 code (attention.cc, ragged_attention.cc, head.cc): the CPU has it and
// OPT_SERVING_NO_AVX512 (any value) is not set, which selects the portable code (tests compare the two). Read once.
inline bool use_avx512() {
  static const bool on = __builtin_cpu_supports("avx512f") && std::getenv("OPT_SERVING_NO_AVX512") == nullptr;
  return on;
}
#endif

// Whether every float32 product runs our kernel (products_f32.cc: f32_panels, any row count), over weights
// packed_desc lays out as it reads them (BA16a16b strips): where AVX-512 is not used (above). There oneDNN's kernels
// read a few rows' weights at a fraction of the memory's speed and sum a row differently with the rows beside it.
inline bool f32_everywhere() {
#if defined(__x86_64__)
  return !use_avx512();
#else
  return false;
#endif
}

}  // namespace opt
