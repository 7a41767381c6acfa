// What the C++ tests of the class's headers share (sched_test.cpp):
// EXPECT, which counts a failure and goes on, and a clock
// that moves only when the test moves it.
#pragma once

#include <chrono>
#include <cstdio>

static int failures = 0;
#define EXPECT(cond)                                                   \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "%s:%d: FAILED %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                      \
    }                                                                  \
  } while (0)

struct FakeClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<FakeClock>;
  static constexpr bool is_steady = true;
  static inline time_point t{};
  static time_point now() { return t; }
};
