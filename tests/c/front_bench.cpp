// A cache-hit alloc+free pair as goalloc's C++ class makes it, on the
// simulated device, with and without the class's front
// (python/goalloc/csrc/goalloc_front.h): through the front a pair reuses the
// block it freed without calling into Go; without it, each half is a call
// into Go (goalloc_pool_malloc, goalloc_free_ptr). A benchmark, not a test:
// it prints ns per pair, the best of 5 runs. `make bench` runs it.
//
//   c++ -O2 -std=c++17 -I python/goalloc/csrc tests/c/front_bench.cpp -o build/front_bench -ldl
//   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/front_bench build/libgoalloc.so
#include <dlfcn.h>

#include <chrono>
#include <cstdio>

#include "goalloc_front.h"
#include "open_library.h"


static GOALLOC_FN(goalloc_pool_malloc) pool_malloc;
static GOALLOC_FN(goalloc_free_ptr) free_ptr;

static double best_ns_per_pair(long pairs, void (*pair)(goalloc_front::Front*, size_t), goalloc_front::Front* front,
                               size_t size) {
  double best = 1e30;
  for (int run = 0; run < 5; run++) {
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < pairs; i++) pair(front, size);
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(pairs);
    if (ns < best) best = ns;
  }
  return best;
}

// The class's malloc and free with its front.
static void front_pair(goalloc_front::Front* front, size_t size) {
  void* p = front->take(0, 0, size);
  if (p == nullptr) {
    int oom = 0;
    p = pool_malloc(size, 0, nullptr, 0, 0, &oom, nullptr);
    front->track(p, 0, 0, size);
  }
  if (!front->give(p)) free_ptr(p);
}

// The same without it: both halves call into Go.
static void go_pair(goalloc_front::Front*, size_t size) {
  int oom = 0;
  void* p = pool_malloc(size, 0, nullptr, 0, 0, &oom, nullptr);
  free_ptr(p);
}

int main(int argc, char** argv) {
  void* lib = open_library(argc, argv);
  pool_malloc = GOALLOC_SYMBOL(lib, goalloc_pool_malloc);
  free_ptr = GOALLOC_SYMBOL(lib, goalloc_free_ptr);
  auto log_of = GOALLOC_SYMBOL(lib, goalloc_front_log);
  auto drain = GOALLOC_SYMBOL(lib, goalloc_front_drain);
  if (!pool_malloc || !free_ptr || !log_of || !drain) {
    std::fprintf(stderr, "libgoalloc.so lacks a symbol\n");
    return 1;
  }
  goalloc_front::Front front(log_of, drain);
  const long pairs = 1000000;
  std::printf("%-10s %14s %14s   (ns per cache-hit alloc+free pair, best of 5 runs of %ld)\n", "size",
              "with front", "into Go", pairs);
  for (size_t size : {size_t(4) << 10, size_t(1) << 20, size_t(64) << 20}) {
    double with = best_ns_per_pair(pairs, front_pair, &front, size);
    double without = best_ns_per_pair(pairs, go_pair, &front, size);
    std::printf("%-10zu %14.1f %14.1f\n", size, with, without);
  }
  return 0;
}
