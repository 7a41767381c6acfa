// goalloc_sched.h's Keeper, with a clock the test moves, and the library's
// two functions behind it (goalloc_yield_every_ns, goalloc_sched_yield) on
// the simulated device. `make ctest` runs it:
//
//   c++ -O2 -std=c++17 -I python/goalloc/csrc tests/c/sched_test.cpp -o build/sched_test -ldl -lpthread
//   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/sched_test build/libgoalloc.so
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "goalloc_sched.h"
#include "fake_clock.h"
#include "open_library.h"

static long long interval = -1;  // what the fake library answers
static int asked = 0, yields = 0;
static long long fake_every_ns() {
  asked++;
  return interval;
}
static void fake_yield() { yields++; }

// calls makes n calls on this thread.
template <class K>
static void calls(K& k, int n) {
  for (int i = 0; i < n; i++) k.before_go_call();
}

static void test_rule() {
  using goalloc_sched::kCheckEvery;
  goalloc_sched::Keeper<FakeClock> k(&fake_every_ns, &fake_yield);
  // Before the library has read its configuration: no yield, and the
  // library is asked again at every check.
  calls(k, 3 * kCheckEvery);
  EXPECT(yields == 0);
  EXPECT(asked == 3);
  // Known: the thread's first check yields, and asks no more.
  interval = 8'000'000;
  calls(k, kCheckEvery - 1);
  EXPECT(yields == 0);  // not a check yet
  calls(k, 1);
  EXPECT(yields == 1);
  EXPECT(asked == 4);
  // Within the interval: checks, no yield.
  FakeClock::t += std::chrono::milliseconds(7);
  calls(k, 10 * kCheckEvery);
  EXPECT(yields == 1);
  // The interval passed: the next check yields, once.
  FakeClock::t += std::chrono::milliseconds(1);
  calls(k, kCheckEvery);
  EXPECT(yields == 2);
  calls(k, 10 * kCheckEvery);
  EXPECT(yields == 2);
  // Another thread keeps its own time: its first check yields at once.
  std::thread other([&] {
    calls(k, kCheckEvery);
    EXPECT(yields == 3);
    calls(k, kCheckEvery);
    EXPECT(yields == 3);
  });
  other.join();
  EXPECT(asked == 4);
}

static void test_never() {
  // A keeper over another clock type: its own per-thread records.
  struct Clock2 : FakeClock {
    using time_point = std::chrono::time_point<Clock2>;
    static time_point now() { return time_point(FakeClock::t.time_since_epoch()); }
  };
  interval = 0;
  yields = 0;
  asked = 0;
  goalloc_sched::Keeper<Clock2> k(&fake_every_ns, &fake_yield);
  calls(k, 100 * goalloc_sched::kCheckEvery);
  EXPECT(yields == 0);
  EXPECT(asked == 1);  // 0 is an answer: never asked again
}

// The library's side: -1 before the configuration is read, then
// GOALLOC_CONF's yield_every (here set with goalloc_configure); yielding
// from a thread Go did not make returns, and calls still work after it.
static void test_library(void* lib) {
  auto every_ns = GOALLOC_SYMBOL(lib, goalloc_yield_every_ns);
  auto yield = GOALLOC_SYMBOL(lib, goalloc_sched_yield);
  auto configure = GOALLOC_SYMBOL(lib, goalloc_configure);
  auto malloc = GOALLOC_SYMBOL(lib, goalloc_malloc);
  auto free = GOALLOC_SYMBOL(lib, my_free);
  EXPECT(every_ns && yield && configure && malloc && free);
  if (!(every_ns && yield && configure && malloc && free)) return;
  EXPECT(every_ns() == -1);
  EXPECT(configure("yield_every:3ms") == 0);
  EXPECT(every_ns() == -1);  // read, not yet applied: no device was used
  void* p = malloc(1 << 20, 0, nullptr);
  EXPECT(p != nullptr);
  EXPECT(every_ns() == 3'000'000);
  goalloc_sched::Keeper<> k(every_ns, yield);
  std::thread t([&] {
    for (int i = 0; i < 1000; i++) {
      k.before_go_call();
      void* q = malloc(4096, 0, nullptr);
      EXPECT(q != nullptr);
      free(q, 4096, 0, nullptr);
    }
  });
  t.join();
  free(p, 1 << 20, 0, nullptr);
}

int main(int argc, char** argv) {
  void* lib = open_library(argc, argv);
  test_rule();
  test_never();
  test_library(lib);
  std::printf("sched_test: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
