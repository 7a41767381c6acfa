// When a thread that calls into goalloc's Go code yields to Go's scheduler.
//
// Go takes its processor away from a thread that calls Go from C once the
// processor's scheduling tick has gone 10 ms unmoved, and then a call that
// follows a stretch of C code pays for getting one back: microseconds
// where the call itself costs under a tenth of one (export/sched.go says
// why; BENCHMARKS.md has it measured). Yielding to Go's scheduler moves the
// tick, but costs a thread switch, so each thread yields at most once per
// interval (GOALLOC_CONF's yield_every; 0, the default, never), and reads
// the clock only every kCheckEvery calls.
//
// Keeper holds that rule: before_go_call() goes before every call into Go
// on the hot path (a request, a free that is not the front's, a drain of
// the front's log). Its state is per thread; the interval is the library's,
// learnt from goalloc_yield_every_ns once the library has read its
// configuration (before that, nothing yields). The clock is a parameter so
// that tests/c/sched_test.cpp can drive it.
//
// This header needs no torch and no CUDA.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace goalloc_sched {

// Calls between two reads of the clock on one thread: a read costs about as
// much as a call into Go, and at a ResNet-50 step's pace (a call every
// 10-20 us) 16 calls take well under a millisecond.
constexpr uint32_t kCheckEvery = 16;

template <class Clock = std::chrono::steady_clock>
class Keeper {
 public:
  // every_ns asks the library for its interval (goalloc_yield_every_ns:
  // -1 while unknown, 0 for never); yield is goalloc_sched_yield.
  Keeper(long long (*every_ns)(), void (*yield)()) : every_ns_(every_ns), yield_(yield) {}

  void before_go_call() {
    // Off (the default): one load of a process-wide figure, no per-thread
    // record touched, on every call into Go.
    long long every = interval_.load(std::memory_order_relaxed);
    if (every == 0) return;
    Thread& t = thread();
    if (++t.calls % kCheckEvery != 0) return;
    if (every < 0) {
      every = every_ns_();
      if (every < 0) return;  // the library has not read its configuration yet
      interval_.store(every, std::memory_order_relaxed);
      if (every == 0) return;
    }
    typename Clock::time_point now = Clock::now();
    if (t.yielded && now - t.last < std::chrono::nanoseconds(every)) return;
    t.last = now;
    t.yielded = true;
    yield_();
  }

 private:
  struct Thread {
    uint32_t calls = 0;
    bool yielded = false;  // last holds the time of this thread's last yield
    typename Clock::time_point last{};
  };
  // One record per thread and Clock: one Keeper of a Clock per process.
  static Thread& thread() {
    static thread_local Thread t;
    return t;
  }

  long long (*every_ns_)();
  void (*yield_)();
  std::atomic<long long> interval_{-1};
};

}  // namespace goalloc_sched
