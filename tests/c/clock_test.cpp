// goalloc_clock.h's CallClock, with a clock that each timed call moves by
// a length the test chose, and a fake probe. `make ctest` runs it:
//
//   c++ -O2 -std=c++17 -I python/goalloc/csrc tests/c/clock_test.cpp -o build/clock_test -lpthread
//   build/clock_test
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "goalloc_clock.h"
#include "fake_clock.h"

static void advance(long long ns) { FakeClock::t += std::chrono::nanoseconds(ns); }

static int probes = 0;
static void fake_probe() {
  probes++;
  advance(100);
}

using Clock = goalloc_clock::CallClock<FakeClock>;
using goalloc_clock::Reading;

static void test_buckets() {
  EXPECT(goalloc_clock::bucket(0) == 0);
  EXPECT(goalloc_clock::bucket(1) == 0);
  EXPECT(goalloc_clock::bucket(2) == 1);
  EXPECT(goalloc_clock::bucket(3) == 1);
  EXPECT(goalloc_clock::bucket(1023) == 9);
  EXPECT(goalloc_clock::bucket(1024) == 10);
  EXPECT(goalloc_clock::bucket(~0ull) == goalloc_clock::kBuckets - 1);
}

// Off: the call is made and returns its value; nothing is counted, no probe.
static void test_off() {
  Clock c(&fake_probe);
  probes = 0;
  int made = 0;
  int v = c.time(goalloc_clock::kMalloc, [&] { made++; advance(500); return 7; });
  EXPECT(v == 7 && made == 1);
  EXPECT(c.read(goalloc_clock::kMalloc).calls == 0);
  EXPECT(probes == 0);
}

// On: each call timed under its kind, into its bucket; no probe.
static void test_on() {
  Clock c(&fake_probe);
  probes = 0;
  c.set_mode(goalloc_clock::kOn);
  EXPECT(c.mode() == goalloc_clock::kOn);
  for (long long ns : {300, 700, 5000}) c.time(goalloc_clock::kMalloc, [&] { advance(ns); return 0; });
  c.time(goalloc_clock::kFree, [&] { advance(64); return 0; });
  Reading m = c.read(goalloc_clock::kMalloc);
  EXPECT(m.calls == 3 && m.ns == 6000);
  EXPECT(m.hist[8] == 1 && m.hist[9] == 1 && m.hist[12] == 1);
  Reading f = c.read(goalloc_clock::kFree);
  EXPECT(f.calls == 1 && f.ns == 64 && f.hist[6] == 1);
  EXPECT(c.read(goalloc_clock::kProbe).calls == 0 && probes == 0);
  // Stopping keeps the figures; starting again clears them.
  c.set_mode(goalloc_clock::kOff);
  c.time(goalloc_clock::kMalloc, [&] { advance(1); return 0; });
  EXPECT(c.read(goalloc_clock::kMalloc).calls == 3);
  c.set_mode(goalloc_clock::kOn);
  EXPECT(c.read(goalloc_clock::kMalloc).calls == 0 && c.read(goalloc_clock::kMalloc).hist[12] == 0);
}

// Probing: the probe before each timed call, timed apart from it.
static void test_probing() {
  Clock c(&fake_probe);
  probes = 0;
  c.set_mode(goalloc_clock::kProbing);
  for (int i = 0; i < 4; i++) c.time(goalloc_clock::kDrain, [&] { advance(2000); return 0; });
  EXPECT(probes == 4);
  Reading p = c.read(goalloc_clock::kProbe);
  EXPECT(p.calls == 4 && p.ns == 400 && p.hist[6] == 4);
  Reading d = c.read(goalloc_clock::kDrain);
  EXPECT(d.calls == 4 && d.ns == 8000 && d.hist[10] == 4);
}

// Threads timing at once lose no call (the real clock: only counts checked).
static void test_threads() {
  goalloc_clock::CallClock<> c(&fake_probe);
  c.set_mode(goalloc_clock::kOn);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; t++)
    ts.emplace_back([&] {
      for (int i = 0; i < 10000; i++) c.time(goalloc_clock::kMalloc, [] { return 0; });
    });
  for (auto& t : ts) t.join();
  Reading m = c.read(goalloc_clock::kMalloc);
  uint64_t sum = 0;
  for (uint64_t h : m.hist) sum += h;
  EXPECT(m.calls == 40000 && sum == 40000);
}

int main() {
  test_buckets();
  test_off();
  test_on();
  test_probing();
  test_threads();
  if (failures != 0) {
    std::fprintf(stderr, "clock_test: %d failures\n", failures);
    return 1;
  }
  std::printf("clock_test: ok\n");
  return 0;
}
