// The call clock: how long the C++ class's calls into Go take where the
// class makes them, a diagnostic that is off unless asked for.
//
// A call from C into Go costs a few tenths of a microsecond when calls
// follow each other in a loop. A training step makes its calls between
// stretches of other host work (kernel launches, cuDNN's own code), where a
// call may find its caches cold or its Go processor taken away
// (goalloc_sched.h), and what it costs there cannot be learnt from a loop.
// The clock times each call where it happens, by kind, as a count, a total
// and a histogram over powers of two of nanoseconds.
//
// In probe mode every timed call is preceded by a call into Go that does
// nothing (the probe, timed apart): the price of crossing into Go alone,
// paid at the same place in the step, against the price of the call that
// does the work.
//
// Off (the default), a call pays one relaxed load of the mode. The clock
// is a parameter so that tests/c/clock_test.cpp can drive it.
//
// This header needs no torch and no CUDA.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace goalloc_clock {

// What a timed call was.
enum Kind : int {
  kMalloc = 0,  // goalloc_pool_malloc: a request the front did not serve
  kFree = 1,    // goalloc_free_ptr: a free the front did not take
  kDrain = 2,   // goalloc_front_drain: the front's log handed to Go
  kProbe = 3,   // the probe: a call into Go that does nothing
  kKinds = 4,
};

// The clock's modes.
enum Mode : int { kOff = 0, kOn = 1, kProbing = 2 };

// Histogram buckets: bucket b counts calls of [2^b, 2^(b+1)) ns (bucket 0
// also counts 0 ns); the last one counts everything longer.
constexpr int kBuckets = 40;

inline int bucket(uint64_t ns) {
  if (ns < 2) return 0;
  int b = 63 - __builtin_clzll(ns);
  return b < kBuckets ? b : kBuckets - 1;
}

// What the clock holds of one kind.
struct Reading {
  uint64_t calls = 0;
  uint64_t ns = 0;
  uint64_t hist[kBuckets] = {};
};

template <class Clock = std::chrono::steady_clock>
class CallClock {
 public:
  // probe is the call into Go that does nothing.
  explicit CallClock(void (*probe)()) : probe_(probe) {}

  // set_mode starts (kOn, kProbing) or stops (kOff) the clock; starting it
  // clears what it held. Calls in flight on other threads may land on
  // either side of a change.
  void set_mode(int mode) {
    if (mode != kOff) clear();
    mode_.store(mode, std::memory_order_relaxed);
  }

  int mode() const { return mode_.load(std::memory_order_relaxed); }

  // time makes the call f under the clock's mode: as it is when off; timed
  // as kind when on; and preceded by the timed probe when probing.
  template <class F>
  auto time(Kind kind, F&& f) -> decltype(f()) {
    int mode = mode_.load(std::memory_order_relaxed);
    if (mode == kOff) return f();
    if (mode == kProbing) {
      typename Clock::time_point p0 = Clock::now();
      probe_();
      record(kProbe, Clock::now() - p0);
    }
    typename Clock::time_point t0 = Clock::now();
    auto result = f();
    record(kind, Clock::now() - t0);
    return result;
  }

  Reading read(Kind kind) const {
    const Tally& t = tallies_[kind];
    Reading r;
    r.calls = t.calls.load(std::memory_order_relaxed);
    r.ns = t.ns.load(std::memory_order_relaxed);
    for (int b = 0; b < kBuckets; b++) r.hist[b] = t.hist[b].load(std::memory_order_relaxed);
    return r;
  }

 private:
  struct Tally {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> ns{0};
    std::atomic<uint64_t> hist[kBuckets] = {};
  };

  void record(Kind kind, typename Clock::duration d) {
    long long ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    uint64_t u = ns > 0 ? static_cast<uint64_t>(ns) : 0;
    Tally& t = tallies_[kind];
    t.calls.fetch_add(1, std::memory_order_relaxed);
    t.ns.fetch_add(u, std::memory_order_relaxed);
    t.hist[bucket(u)].fetch_add(1, std::memory_order_relaxed);
  }

  void clear() {
    for (Tally& t : tallies_) {
      t.calls.store(0, std::memory_order_relaxed);
      t.ns.store(0, std::memory_order_relaxed);
      for (auto& h : t.hist) h.store(0, std::memory_order_relaxed);
    }
  }

  void (*probe_)();
  std::atomic<int> mode_{kOff};
  Tally tallies_[kKinds];
};

}  // namespace goalloc_clock
