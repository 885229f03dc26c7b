#include "common.h"

#include <thread>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

namespace opt {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

std::mutex mu;

namespace {

std::atomic<int> threads{0};

// The job slot between callers and the kernel thread: `posted` counts jobs handed over, `finished`
// jobs done, each waited on with a futex (std::atomic::wait). Neither side spins: with two cores, a
// spinning kernel thread or caller takes the core the team's worker or XLA's next op needs
// (a 20000-round spin on either side made a decode step several times slower).
struct KernelThread {
  std::mutex callers;  // one job at a time
  const std::function<void()>* job = nullptr;
  std::exception_ptr error;
  std::atomic<uint32_t> posted{0}, finished{0};
  std::thread::id id;
  pid_t pid = getpid();

  KernelThread() {
    std::thread t([this] { loop(); });
    id = t.get_id();
    t.detach();  // lives as long as the process (handlers may run until exit)
  }

  void loop() {
    uint32_t seen = 0;
    for (;;) {
      posted.wait(seen, std::memory_order_acquire);
      seen = posted.load(std::memory_order_acquire);
      try {
        (*job)();
      } catch (...) {
        error = std::current_exception();
      }
      finished.store(seen, std::memory_order_release);
      finished.notify_one();
    }
  }

  void run(const std::function<void()>& f) {
    std::lock_guard<std::mutex> lock(callers);
    job = &f;
    error = nullptr;
    const uint32_t ticket = posted.load(std::memory_order_relaxed) + 1;
    posted.store(ticket, std::memory_order_release);
    posted.notify_one();
    for (uint32_t now; (now = finished.load(std::memory_order_acquire)) != ticket;) {
      finished.wait(now, std::memory_order_acquire);
    }
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace

void on_kernel_thread(const std::function<void()>& f) {
  static std::mutex start;
  static KernelThread* kernel = nullptr;
  KernelThread* k;
  {
    std::lock_guard<std::mutex> lock(start);
    // a forked child has no kernel thread: start its own (the parent's is left as it was)
    if (kernel == nullptr || kernel->pid != getpid()) kernel = new KernelThread();
    k = kernel;
  }
  if (std::this_thread::get_id() == k->id) return f();  // already there (a kernel calling another)
  k->run(f);
}

// The team's threads each held to a CPU of its own (the i-th of those the process may run on). Left to the
// scheduler, the kernel thread and the team's worker now and then shared one CPU (each is woken from the other
// side, and a woken thread is placed beside its waker), where the worker spinning at the end of a region and
// the thread still computing took turns in 0.75 ms time slices: every kernel call of a decode step then cost
// ~0.8 ms more, a third of the steps ran ~1.5x their time. Only a team no larger than the CPUs is pinned;
// OPT_SERVING_PIN_THREADS=0 leaves placement to the scheduler.
void pin_team(int n) {
  static std::vector<int> cpus = [] {
    std::vector<int> out;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &allowed)) out.push_back(c);
      }
    }
    return out;
  }();
  static const bool enabled = [] {
    const char* env = std::getenv("OPT_SERVING_PIN_THREADS");
    return !(env && std::string(env) == "0");
  }();
  static int pinned = 0;  // the team size last pinned (only the kernel thread gets here)
  if (!enabled || n == pinned || n < 2 || n > static_cast<int>(cpus.size())) return;
  pinned = n;
#pragma omp parallel num_threads(n)
  {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[omp_get_thread_num()], &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
  }
}

void use_threads() {
  const int n = threads.load(std::memory_order_relaxed);
  if (n > 0 && omp_get_max_threads() != n) omp_set_num_threads(n);
  pin_team(omp_get_max_threads());
}

bool native_products(dt type, std::initializer_list<const char*> marks) {
  try {
    dnnl::memory::desc src({kPackRows, 64}, type, tag::ab), w({64, 1024}, type, tag::any),
        dst({kPackRows, 1024}, dt::f32, tag::ab);
    dnnl::primitive_attr attr;
    if (type == dt::s8) attr.set_scales_mask(DNNL_ARG_WEIGHTS, 1 << 1);
    const std::string impl = dnnl::matmul::primitive_desc(cpu_engine(), src, w, dst, attr).impl_info_str();
    for (const char* mark : marks) {
      if (impl.find(mark) != std::string::npos) return true;
    }
    return false;
  } catch (...) {
    return false;
  }
}

bool s8_rows() {
  static const bool exact = native_products(dt::s8, {"vnni", "amx"});
  return exact;
}

namespace {

// the rows' type and attributes of an int8 (or other `in`) product: per-column weight scales, the 7-bit rows'
// zero point
dt rows_type(dt in) { return in == dt::s8 && !s8_rows() ? dt::u8 : in; }

void int8_attr(dnnl::primitive_attr& attr, dt in) {
  if (in != dt::s8) return;
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, 1 << 1);
  if (!s8_rows()) attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
}

}  // namespace

const dnnl::memory::desc& packed_desc(int64_t k, int64_t n, dt in) {
  static std::map<std::tuple<int64_t, int64_t, dt>, dnnl::memory::desc> descs;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(k, n, in);
  auto it = descs.find(key);
  if (it == descs.end()) {
    if (in == dt::f32 && f32_everywhere()) {
      it = descs.emplace(key, dnnl::memory::desc({k, n}, in, tag::BA16a16b)).first;
      return it->second;
    }
    dnnl::memory::desc src({kPackRows, k}, rows_type(in), tag::ab);
    dnnl::memory::desc w({k, n}, in, tag::any);
    dnnl::memory::desc dst({kPackRows, n}, dt::f32, tag::ab);
    dnnl::primitive_attr attr;
    int8_attr(attr, in);
    dnnl::matmul::primitive_desc pd(cpu_engine(), src, w, dst, attr);
    it = descs.emplace(key, pd.weights_desc()).first;
  }
  return it->second;
}

// int8 products leave the bias and ReLU to the caller: they come after the row scale, which oneDNN (3.2) cannot
// apply per row without falling back to its reference kernel.
dnnl::matmul matmul_for(int64_t m, int64_t k, int64_t n, bool bias, bool relu, dt in) {
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, dt>;  // m, k, n, bias, relu, weight type
  const dnnl::memory::desc& w = packed_desc(k, n, in);
  static std::map<Key, dnnl::matmul> prims;
  std::lock_guard<std::mutex> lock(mu);
  Key key{m, k, n, bias, relu, in};
  auto it = prims.find(key);
  if (it == prims.end()) {
    dnnl::primitive_attr attr;
    if (in == dt::s8) {
      int8_attr(attr, in);
    } else if (relu) {
      dnnl::post_ops ops;
      ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
      attr.set_post_ops(ops);
    }
    dnnl::memory::desc src({m, k}, rows_type(in), tag::ab);
    dnnl::memory::desc dst({m, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd =
        bias && in != dt::s8
            ? dnnl::matmul::primitive_desc(cpu_engine(), src, w, dnnl::memory::desc({1, n}, dt::f32, tag::ab), dst, attr)
            : dnnl::matmul::primitive_desc(cpu_engine(), src, w, dst, attr);
    it = prims.emplace(key, dnnl::matmul(pd)).first;
  }
  return it->second;
}

static int reorder_on_this_thread(int64_t k, int64_t n, int transposed, const void* from, void* to, bool pack,
                                  dt packed_type, dt plain_type);

int reorder_plain(int64_t k, int64_t n, int transposed, const void* from, void* to, bool pack, dt packed_type,
                  dt plain_type) {
  int status = 1;
  on_kernel_thread([&] { status = reorder_on_this_thread(k, n, transposed, from, to, pack, packed_type, plain_type); });
  return status;
}

static int reorder_on_this_thread(int64_t k, int64_t n, int transposed, const void* from, void* to, bool pack,
                                  dt packed_type, dt plain_type) {
  try {
    dnnl::memory::desc plain({k, n}, plain_type, transposed ? tag::ba : tag::ab);
    const dnnl::memory::desc& packed = packed_desc(k, n, packed_type);
    dnnl::memory src(pack ? plain : packed, cpu_engine(), const_cast<void*>(from));
    dnnl::memory dst(pack ? packed : plain, cpu_engine(), to);
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
    return 0;
  } catch (...) {
    return 1;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
double dot_exact(const float* x, const float* w, int64_t k) {
  double s = 0.0;  // each float product is exact in double; the sum's order does not matter at this precision
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += static_cast<double>(x[i]) * w[i];
  return s;
}

}  // namespace opt

extern "C" void opt_cpu_kernels_set_threads(int n) { opt::threads.store(n); }

// The size of the team a kernel called from this thread runs with (for tests).
extern "C" int opt_cpu_kernels_team_size() {
  int size = 0;
  opt::on_kernel_thread([&] {
    opt::use_threads();
#pragma omp parallel
    {
#pragma omp single
      size = omp_get_num_threads();
    }
  });
  return size;
}
