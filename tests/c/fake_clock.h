// A clock that moves only when the test moves it, for the C++ tests of the
// class's headers (sched_test.cpp), with expect.h's EXPECT.
#pragma once

#include <chrono>
#include <cstdio>
#include "expect.h"

struct FakeClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<FakeClock>;
  static constexpr bool is_steady = true;
  static inline time_point t{};
  static time_point now() { return t; }
};
