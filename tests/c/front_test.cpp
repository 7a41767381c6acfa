// The front of goalloc's C++ allocator class (python/goalloc/csrc/goalloc_front.h)
// against libgoalloc.so on the simulated device, without torch: a freed
// block handed out again and counted by Go as a free and a hit; frees
// waiting in the log seen by every statistic; a full log, untracked and
// forgotten blocks, history turning the front off; threads through the
// front and straight into Go at once; the table of live blocks against a
// reference; a log of another layout refused.
//
//   c++ -O2 -std=c++17 -I python/goalloc/csrc tests/c/front_test.cpp -o build/front_test -ldl -lpthread
//   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/front_test build/libgoalloc.so
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "goalloc_front.h"
#include "open_library.h"
#include "expect.h"

using goalloc_front::Front;

static GOALLOC_FN(goalloc_pool_malloc) pool_malloc;
static GOALLOC_FN(goalloc_free_ptr) free_ptr;
static GOALLOC_FN(goalloc_torch_device_stats) device_stats;
static GOALLOC_FN(goalloc_stat) stat;
static GOALLOC_FN(goalloc_check_invariants) check_invariants;
static GOALLOC_FN(goalloc_record_history) record_history;
static GOALLOC_FN(goalloc_front_log) front_log;
static GOALLOC_FN(goalloc_front_drain) front_drain;
static GOALLOC_FN(goalloc_last_error) last_error;
static GOALLOC_FN(goalloc_string_free) string_free;

constexpr int kFigures = GOALLOC_TORCH_STAT_FIGURES;
// Offsets in DeviceStats's figures: allocation and allocated_bytes, "all".
constexpr int kAllocation = STAT_FIGURE(allocation), kAllocatedBytes = STAT_FIGURE(allocated_bytes);

struct Figures {
  long long f[kFigures];
  long long at(int stat, int what) const { return f[stat + what]; }  // what: 0 current, 1 peak, 2 allocated, 3 freed
};

static Figures stats() {
  Figures s{};
  EXPECT(device_stats(0, s.f, kFigures) == 0, "device stats");
  return s;
}

static void* go_malloc(size_t size, uint64_t stream) {
  int oom = 0;
  char* err = nullptr;
  void* p = pool_malloc(size, 0, reinterpret_cast<void*>(stream), 0, 0, &oom, &err);
  EXPECT(p != nullptr, "malloc(%zu): %s", size, err ? err : "");
  return p;
}

// An allocation as the class makes it: the front first, then Go.
static void* alloc(Front& front, size_t size, uint64_t stream) {
  if (void* p = front.take(0, stream, size)) return p;
  void* p = go_malloc(size, stream);
  front.track(p, 0, stream, size);
  return p;
}

static void release(Front& front, void* p) {
  if (!front.give(p)) EXPECT(free_ptr(p) == 0, "free %p", p);
}

static void table_against_reference() {
  goalloc_front::BlockTable t;
  std::unordered_map<uintptr_t, uint64_t> ref;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; i++) {
    uintptr_t p = (1 + rng() % 5000) << 9;  // few addresses: many hits, long probe runs
    if (rng() % 3 == 0) {
      goalloc_front::Block* b = t.find(p);
      EXPECT((b != nullptr) == (ref.count(p) == 1), "find %#zx at op %d", static_cast<size_t>(p), i);
      if (b != nullptr) {
        EXPECT(b->requested == ref[p], "value of %#zx", static_cast<size_t>(p));
        t.erase(b);
        ref.erase(p);
      }
    } else {
      uint64_t v = rng();
      t.put(goalloc_front::Block{p, 0, v, 0});
      ref[p] = v;
    }
    EXPECT(t.size() == ref.size(), "size %zu, reference %zu", t.size(), ref.size());
    if (failures > 10) return;
  }
  for (const auto& kv : ref) {
    goalloc_front::Block* b = t.find(kv.first);
    EXPECT(b != nullptr && b->requested == kv.second, "lost %#zx", static_cast<size_t>(kv.first));
  }
}

int main(int argc, char** argv) {
  void* lib = open_library(argc, argv);
  pool_malloc = GOALLOC_SYMBOL(lib, goalloc_pool_malloc);
  free_ptr = GOALLOC_SYMBOL(lib, goalloc_free_ptr);
  device_stats = GOALLOC_SYMBOL(lib, goalloc_torch_device_stats);
  stat = GOALLOC_SYMBOL(lib, goalloc_stat);
  check_invariants = GOALLOC_SYMBOL(lib, goalloc_check_invariants);
  record_history = GOALLOC_SYMBOL(lib, goalloc_record_history);
  front_log = GOALLOC_SYMBOL(lib, goalloc_front_log);
  front_drain = GOALLOC_SYMBOL(lib, goalloc_front_drain);
  last_error = GOALLOC_SYMBOL(lib, goalloc_last_error);
  string_free = GOALLOC_SYMBOL(lib, goalloc_string_free);
  if (!pool_malloc || !free_ptr || !device_stats || !stat || !check_invariants || !record_history || !front_log ||
      !front_drain || !last_error || !string_free) {
    std::fprintf(stderr, "libgoalloc.so lacks a symbol\n");
    return 1;
  }
  Front front(front_log, front_drain);
  // Device 0's log, for the checks below to read (asking for it again
  // would take the allocator's mutex, which drains it).
  const auto* log0 = static_cast<const goalloc_front::Log*>(front_log(0));
  if (log0 == nullptr) {
    std::fprintf(stderr, "no front log for device 0\n");
    return 1;
  }

  // A freed block served again: same pointer, no Go call; at the drain Go
  // counts a free and an allocation, the current figures unmoved.
  {
    void* p = alloc(front, 1 << 20, 0x10);
    EXPECT(front.tracked() == 1, "tracked %zu", front.tracked());
    EXPECT(front.give(p), "the free goes into the log");
    void* q = front.take(0, 0x10, 1 << 20);
    EXPECT(q == p, "handed out again: %p, freed %p", q, p);
    EXPECT(front.take(0, 0x10, 1 << 20) == nullptr, "a pending free is handed out once");
    Figures s = stats();
    EXPECT(s.at(kAllocation, 0) == 1 && s.at(kAllocation, 2) == 2 && s.at(kAllocation, 3) == 1,
           "allocations: current %lld, allocated %lld, freed %lld", s.at(kAllocation, 0), s.at(kAllocation, 2),
           s.at(kAllocation, 3));
    EXPECT(s.at(kAllocatedBytes, 0) == 1 << 20 && s.at(kAllocatedBytes, 1) == 1 << 20,
           "allocated bytes: current %lld, peak %lld", s.at(kAllocatedBytes, 0), s.at(kAllocatedBytes, 1));
    // Another stream or size is not served from it.
    EXPECT(front.give(q), "free again");
    EXPECT(front.take(0, 0x20, 1 << 20) == nullptr, "another stream");
    EXPECT(front.take(0, 0x10, (1 << 20) - 512) == nullptr, "another requested size");
    // The lock-free figure counts the pending free.
    EXPECT(stat(0, 0) == 0, "memory_allocated with a free pending: %lld", stat(0, 0));
    EXPECT(check_invariants(0) == 0, "invariants");
    EXPECT(front.tracked() == 0, "tracked %zu", front.tracked());
  }

  // A full log is drained by Go, and the free goes into it: a burst of 65
  // frees leaves one pending, which the burst asked for again finds once.
  {
    std::vector<void*> held;
    auto size_of = [](int i) { return static_cast<size_t>(4096 + 512 * (i % 7)); };
    for (int i = 0; i < goalloc_front::kLogCap + 1; i++) held.push_back(alloc(front, size_of(i), 0x30));
    for (void* p : held) EXPECT(front.give(p), "free %p", p);
    EXPECT(log0->n == 1, "%u entries after the drain", log0->n);
    int served = 0;
    for (int i = 0; i < goalloc_front::kLogCap + 1; i++) {
      void* p = front.take(0, 0x30, size_of(i));
      if (p != nullptr) {
        EXPECT(p == held.back(), "served %p, pending %p", p, held.back());
        served++;
      }
    }
    EXPECT(served == 1, "%d served", served);
    EXPECT(front.give(held.back()), "free");
    Figures s = stats();
    EXPECT(s.at(kAllocation, 0) == 0, "allocations left: %lld", s.at(kAllocation, 0));
    EXPECT(check_invariants(0) == 0, "invariants");
  }

  // Untracked and forgotten blocks go to Go.
  {
    int dummy;
    EXPECT(!front.give(&dummy), "an address the front never saw");
    void* p = alloc(front, 8192, 0x10);
    front.forget(p);  // record_stream
    EXPECT(!front.give(p), "a forgotten block");
    EXPECT(free_ptr(p) == 0, "free");
  }

  // History on: the front is off (each event is timed as it happens).
  {
    void* p = alloc(front, 1 << 20, 0x10);
    EXPECT(record_history(100) == 0, "record_history");
    EXPECT(!front.give(p), "the front is off while history is recorded");
    EXPECT(free_ptr(p) == 0, "free");
    EXPECT(record_history(0) == 0, "record_history off");
    p = alloc(front, 1 << 20, 0x10);
    EXPECT(front.give(p), "on again");
  }

  // Threads through the front and into Go at once: nothing lost.
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; t++) {
      threads.emplace_back([&front, t] {
        std::mt19937_64 rng(t);
        const size_t sizes[] = {512, 4096, 1 << 20, 3 << 20, 7 << 20};
        std::vector<void*> held;
        uint64_t stream = 0x100 * (t % 2);  // two threads share each stream
        for (int i = 0; i < 20000; i++) {
          held.push_back(alloc(front, sizes[rng() % 5], stream));
          if (held.size() > 8 || rng() % 2 == 0) {
            size_t k = rng() % held.size();
            release(front, held[k]);
            held.erase(held.begin() + static_cast<long>(k));
          }
          if (i % 1000 == 0) (void)stat(0, 0);
        }
        for (void* p : held) release(front, p);
      });
    }
    for (auto& th : threads) th.join();
    Figures s = stats();
    EXPECT(s.at(kAllocation, 0) == 0 && s.at(kAllocatedBytes, 0) == 0, "left: %lld blocks, %lld bytes",
           s.at(kAllocation, 0), s.at(kAllocatedBytes, 0));
    EXPECT(s.at(kAllocation, 2) == s.at(kAllocation, 3), "allocated %lld, freed %lld", s.at(kAllocation, 2),
           s.at(kAllocation, 3));
    EXPECT(check_invariants(0) == 0, "invariants");
    EXPECT(front.tracked() == 0, "tracked %zu", front.tracked());
  }

  table_against_reference();

  // Bad devices: no log, a drain refused with goalloc's message, and the
  // device that exists goes on working. Their warning is queued and
  // checked, not printed.
  {
    auto capture = reinterpret_cast<int (*)(int)>(dlsym(lib, "goalloc_warnings_capture"));
    auto take = reinterpret_cast<char* (*)()>(dlsym(lib, "goalloc_warnings_take"));
    EXPECT(capture != nullptr && take != nullptr && capture(1) == 0, "goalloc_warnings_capture");
    EXPECT(front_log(99) == nullptr && front_log(-1) == nullptr, "a log for a device that does not exist");
    EXPECT(front_drain(99) == -1 && front_drain(-1) == -1, "a drain of a device that does not exist");
    char* warned = take != nullptr ? take() : nullptr;
    EXPECT(warned != nullptr && std::strstr(warned, "\"kind\":\"bad_device\"") != nullptr, "no bad_device warning: %s",
           warned != nullptr ? warned : "(none)");
    if (warned != nullptr) string_free(warned);
    if (capture != nullptr) capture(0);
    char* msg = last_error();
    EXPECT(msg != nullptr && std::strstr(msg, "device -1 does not exist") != nullptr, "last error: %s", msg ? msg : "");
    if (msg != nullptr) string_free(msg);
    EXPECT(front_drain(0) == 0, "drain of device 0");
    void* p = alloc(front, 4096, 0x10);
    release(front, p);
    EXPECT(check_invariants(0) == 0, "invariants");
  }

  // A log of another layout (a library of another version) is not used.
  {
    static goalloc_front::Log other{};
    other.size = 1;
    other.enabled = 1;
    Front stale([](int) -> void* { return &other; }, [](int) { return 0; });
    int x;
    stale.track(&x, 0, 0, 512);
    EXPECT(stale.tracked() == 0 && !stale.give(&x), "a foreign log was used");
    Front none([](int) -> void* { return nullptr; }, [](int) { return 0; });
    none.track(&x, 0, 0, 512);
    EXPECT(none.tracked() == 0 && none.take(0, 0, 512) == nullptr, "no log, no front");
  }

  if (failures != 0) {
    std::fprintf(stderr, "front_test: %d failures\n", failures);
    return 1;
  }
  std::printf("front_test: ok\n");
  return 0;
}
