// goalloc_split.h, the carving of pools with an allocator of their own, over
// a stand-in Env: segments from a counter of fake addresses, every call
// recorded. It checks the layout PyTorch's allocator gives (PyTorch's
// test_cuda.py counts segments of such pools), the use_on_oom fallback, the
// no_split rule, giving segments back, and, under random operations, that
// blocks tile their segments and no two live blocks overlap.
#include "goalloc_split.h"
#include "expect.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr size_t MiB = size_t(1) << 20;

struct FakeEnv : goalloc_split::Env {
  uintptr_t next = 0x100000000;
  size_t limit = SIZE_MAX;  // bytes of segments it gives at most
  size_t held = 0;
  int allocs = 0, frees = 0, blocks_out = 0, waits = 0;
  std::map<uintptr_t, size_t> segments;

  void* segment_alloc(size_t size, void*, bool, std::string* err, bool* oom) override {
    if (held + size > limit) {
      *err = "over the limit";
      *oom = true;
      return nullptr;
    }
    uintptr_t p = next;
    next += size + (size_t(1) << 30);  // segments never touch
    segments[p] = size;
    held += size;
    allocs++;
    return reinterpret_cast<void*>(p);
  }
  void segment_free(const goalloc_split::Segment& s) override {
    if (segments.erase(s.addr) != 1) std::fprintf(stderr, "FAIL: freed an unknown segment\n"), failures++;
    held -= s.size;
    frees++;
  }
  void block_counted(const goalloc_split::Block&, void*, bool alloc) override { blocks_out += alloc ? 1 : -1; }
  void wait_for(const std::vector<void*>& streams) override { waits += static_cast<int>(streams.size()); }
};

struct Fixture {
  FakeEnv* env = new FakeEnv();
  goalloc_split::Pool pool{std::unique_ptr<goalloc_split::Env>(env)};
  Fixture() { pool.incref(); }
  void* m(size_t n, void* stream = nullptr) {
    std::string err;
    bool oom = false;
    void* p = pool.malloc(n, stream, &err, &oom);
    std::string bad = pool.check();
    EXPECT(bad.empty(), "%s", bad.c_str());
    return p;
  }
  void f(void* p) {
    EXPECT(pool.free(p), "free of %p", p);
    std::string bad = pool.check();
    EXPECT(bad.empty(), "%s", bad.c_str());
  }
};

// test_mempool_with_allocator: 1 MiB requests share 2 MiB segments.
void small_requests_share_segments() {
  Fixture x;
  void* a = x.m(MiB);
  EXPECT(x.pool.snapshot().size() == 1, "one segment");
  void* b = x.m(MiB);
  EXPECT(x.pool.snapshot().size() == 1, "still one: %zu", x.pool.snapshot().size());
  EXPECT(reinterpret_cast<uintptr_t>(b) == reinterpret_cast<uintptr_t>(a) + MiB, "packed after a");
  void* c = x.m(MiB);
  EXPECT(x.pool.snapshot().size() == 2, "a second segment for the third");
  EXPECT(x.env->allocs == 2 && x.env->held == 4 * MiB, "two 2 MiB segments: %d, %zu", x.env->allocs, x.env->held);
  for (void* p : {a, b, c}) x.f(p);
  EXPECT(x.env->blocks_out == 0, "every block counted back");
  EXPECT(x.pool.decref() == 0, "released");
  EXPECT(x.env->frees == 2 && x.env->held == 0, "released pool gives its segments back: %d", x.env->frees);
}

// Large requests: under 10 MiB a 20 MiB segment is split; 10 MiB and up
// get their own, rounded to 2 MiB; small and large never share.
void large_requests() {
  Fixture x;
  void* a = x.m(4 * MiB);
  EXPECT(x.env->held == 20 * MiB, "a 20 MiB segment: %zu", x.env->held);
  void* b = x.m(4 * MiB);
  EXPECT(x.env->allocs == 1 && b == static_cast<char*>(a) + 4 * MiB, "split from the same segment");
  void* c = x.m(13 * MiB);  // more than the 12 MiB left in the first
  EXPECT(x.env->allocs == 2 && x.env->held == 34 * MiB, "a 14 MiB segment of its own: %zu", x.env->held);
  void* d = x.m(1000);
  EXPECT(x.env->allocs == 3, "a small request takes a small segment");
  for (void* p : {a, b, c, d}) x.f(p);
  auto views = x.pool.snapshot();
  EXPECT(views.size() == 3, "segments kept until emptied");
  for (auto& v : views) EXPECT(v.blocks.size() == 1 && !v.blocks[0].allocated, "merged back whole");
  x.pool.empty();
  EXPECT(x.env->held == 0 && x.pool.holds_nothing(), "empty gives every free segment back");
}

// test_mempool_limited_memory_with_allocator: a freed 40 MiB block serves a
// 30 MiB request of someone else (use_on_oom, take), at its start; what is
// left serves at most 10 MiB; freed, it merges, and 20 MiB start there.
void take_for_use_on_oom() {
  Fixture x;
  x.env->limit = 40 * MiB;
  void* b = x.m(40 * MiB);
  EXPECT(b != nullptr, "b");
  x.f(b);
  EXPECT(x.pool.take(30 * MiB, nullptr) == b, "30 MiB at b's address");
  std::string bad = x.pool.check();
  EXPECT(bad.empty(), "%s", bad.c_str());
  EXPECT(x.pool.take(30 * MiB, nullptr) == nullptr, "only 10 MiB left");
  EXPECT(x.pool.take(30 * MiB, reinterpret_cast<void*>(0x77)) == nullptr, "other streams' blocks are not taken");
  std::string err;
  bool oom = false;
  EXPECT(x.pool.malloc(20 * MiB, nullptr, &err, &oom) == nullptr && oom && err == "over the limit",
         "a new segment over the limit: %s", err.c_str());
  x.f(b);
  EXPECT(x.m(20 * MiB) == b, "merged back: 20 MiB at the start");
  EXPECT(x.env->allocs == 1, "never a second segment");
}

// no_split: each request has a segment of its own, one block each.
void no_split() {
  Fixture x;
  x.pool.set_no_split();
  void* a = x.m(4 * MiB);
  void* b = x.m(4 * MiB);
  auto views = x.pool.snapshot();
  EXPECT(views.size() == 2, "two segments: %zu", views.size());
  for (auto& v : views) EXPECT(v.blocks.size() == 1, "one block per segment");
  x.f(a);
  x.f(b);
}

// record_stream: the free waits for the other streams first.
void recorded_streams() {
  Fixture x;
  void* a = x.m(1000);
  EXPECT(x.pool.record_stream(a, reinterpret_cast<void*>(0x9)), "recorded");
  EXPECT(x.pool.record_stream(a, reinterpret_cast<void*>(0x9)), "recorded twice, once");
  EXPECT(x.pool.record_stream(a, nullptr), "its own stream");
  EXPECT(!x.pool.record_stream(reinterpret_cast<void*>(0x5), nullptr), "not a block of the pool");
  x.f(a);
  EXPECT(x.env->waits == 1, "waited for one stream: %d", x.env->waits);
  EXPECT(!x.pool.free(a), "a second free is refused");
}

// Random operations with cookies: live blocks never overlap, each keeps
// its bytes (a fake memory map records who owns each address), and the
// invariants hold throughout.
void random_ops() {
  Fixture x;
  std::mt19937_64 rng(7);
  struct Live {
    void* p;
    size_t n;
    void* stream;
  };
  std::vector<Live> live;
  std::map<uintptr_t, std::pair<size_t, int>> owner;  // address -> (size, cookie)
  int cookie = 0;
  for (int i = 0; i < 20000; i++) {
    if (live.empty() || rng() % 3 != 0) {
      size_t n = (rng() % 4 == 0) ? (rng() % (24 * MiB)) + 1 : (rng() % (2 * MiB)) + 1;
      void* stream = reinterpret_cast<void*>(rng() % 3);
      void* p = x.m(n, stream);
      if (p == nullptr) continue;
      uintptr_t a = reinterpret_cast<uintptr_t>(p);
      auto it = owner.upper_bound(a);
      if (it != owner.begin()) {
        auto prev = std::prev(it);
        EXPECT(prev->first + prev->second.first <= a, "overlaps the block before");
      }
      if (it != owner.end()) EXPECT(a + n <= it->first, "overlaps the block after");
      owner[a] = {n, ++cookie};
      live.push_back({p, n, stream});
    } else {
      size_t k = rng() % live.size();
      owner.erase(reinterpret_cast<uintptr_t>(live[k].p));
      x.f(live[k].p);
      live[k] = live.back();
      live.pop_back();
    }
    if (i % 5000 == 4999) x.pool.empty();
  }
  for (auto& l : live) x.f(l.p);
  x.pool.empty();
  EXPECT(x.env->held == 0 && x.env->blocks_out == 0, "all back: %zu held, %d blocks", x.env->held, x.env->blocks_out);
}

}  // namespace

int main() {
  small_requests_share_segments();
  large_requests();
  take_for_use_on_oom();
  no_split();
  recorded_streams();
  random_ops();
  std::printf("split_test: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
