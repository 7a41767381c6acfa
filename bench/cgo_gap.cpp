// A call into Go after a stretch in C: what a cache-hit malloc+free pair
// through the C++ class's entry points (goalloc_pool_malloc,
// goalloc_free_ptr; no front) costs when the calling thread spent GAP
// microseconds in C code before it, with and without the class's yields to
// Go's scheduler (python/goalloc/csrc/goalloc_sched.h; export/sched.go says
// why they matter). On the simulated device; a benchmark, not a test:
//
//   c++ -O2 -std=c++17 -I python/goalloc/csrc -I tests/c bench/cgo_gap.cpp -o build/cgo_gap -ldl -lpthread
//   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/cgo_gap build/libgoalloc.so
//
// For each gap it runs the two ways in turn, ROUNDS times, about 0.3 s
// each, on one thread that is not Go's; it prints, per way, the medians over
// the rounds of the mean, p50 and p99 of a pair (the pair alone, not the
// gap), and the yields made.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "goalloc_sched.h"
#include "open_library.h"

using ull = unsigned long long;
using Clock = std::chrono::steady_clock;

static void* (*pool_malloc)(size_t, int, void*, ull, ull, int*, char**);
static int (*free_ptr)(void*);
static long long (*every_ns)();
static void (*go_yield)();
static long yields = 0;
static void counted_yield() {
  yields++;
  go_yield();
}

constexpr int kRounds = 5;
constexpr double kRoundSeconds = 0.3;

struct Figures {
  double mean, p50, p99;
};

static void spin(double us) {
  auto end = Clock::now() + std::chrono::nanoseconds(static_cast<long long>(us * 1000));
  while (Clock::now() < end) {
  }
}

static Figures run(double gap_us, goalloc_sched::Keeper<>* keeper) {
  long pairs = static_cast<long>(kRoundSeconds * 1e6 / (gap_us + 1.0));
  std::vector<double> ns;
  ns.reserve(pairs);
  for (long i = 0; i < pairs; i++) {
    spin(gap_us);
    auto t0 = Clock::now();
    if (keeper != nullptr) keeper->before_go_call();
    int oom = 0;
    char* err = nullptr;
    void* p = pool_malloc(1 << 20, 0, nullptr, 0, 0, &oom, &err);
    if (p == nullptr) {
      std::fprintf(stderr, "cgo_gap: goalloc_pool_malloc failed: %s\n", err != nullptr ? err : "(no message)");
      std::exit(1);
    }
    if (keeper != nullptr) keeper->before_go_call();
    if (free_ptr(p) != 0) {
      std::fprintf(stderr, "cgo_gap: goalloc_free_ptr failed\n");
      std::exit(1);
    }
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  double sum = 0;
  for (double v : ns) sum += v;
  std::sort(ns.begin(), ns.end());
  return {sum / ns.size(), ns[ns.size() / 2], ns[ns.size() * 99 / 100]};
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  void* lib = open_library(argc, argv);
  pool_malloc = reinterpret_cast<decltype(pool_malloc)>(dlsym(lib, "goalloc_pool_malloc"));
  free_ptr = reinterpret_cast<decltype(free_ptr)>(dlsym(lib, "goalloc_free_ptr"));
  every_ns = reinterpret_cast<decltype(every_ns)>(dlsym(lib, "goalloc_yield_every_ns"));
  go_yield = reinterpret_cast<decltype(go_yield)>(dlsym(lib, "goalloc_sched_yield"));
  if (!pool_malloc || !free_ptr || !every_ns || !go_yield) {
    std::fprintf(stderr, "cgo_gap: the library lacks a function; rebuild it (make lib)\n");
    return 1;
  }
  std::thread t([] {
    goalloc_sched::Keeper<> keeper(every_ns, &counted_yield);
    std::printf("%8s  %28s  %36s\n", "", "without yields (ns a pair)", "with yields (ns a pair)");
    std::printf("%8s  %8s %8s %10s  %8s %8s %10s %7s\n", "gap us", "mean", "p50", "p99", "mean", "p50", "p99",
                "yields");
    for (double gap : {0.0, 5.0, 20.0, 60.0, 200.0}) {
      std::vector<double> m[2], p50[2], p99[2];
      long y0 = yields;
      for (int r = 0; r < kRounds; r++) {
        for (int way = 0; way < 2; way++) {
          Figures f = run(gap, way == 0 ? nullptr : &keeper);
          m[way].push_back(f.mean);
          p50[way].push_back(f.p50);
          p99[way].push_back(f.p99);
        }
      }
      std::printf("%8.0f  %8.0f %8.0f %10.0f  %8.0f %8.0f %10.0f %7ld\n", gap, median(m[0]), median(p50[0]),
                  median(p99[0]), median(m[1]), median(p50[1]), median(p99[1]), yields - y0);
    }
  });
  t.join();
  return 0;
}
