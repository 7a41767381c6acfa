// goalloc's C++ allocator class (python/goalloc/csrc/goalloc_torch.cpp)
// without PyTorch's runtime or a GPU: the class alone, compiled against
// torch's headers and linked to c10 only, on the simulated device. It checks
// what the GPU tests cannot see piece by piece: the statistics copied into
// c10's DeviceStats, the snapshot parsed from goalloc's JSON, the exception
// types, the pool windows and their filters, and pool checkpoints.
//
//   make cxxtest TORCH=/path/to/site-packages/torch CUDA_INCLUDE=/path/to/cuda/include
//
// (TORCH is a torch installation or unpacked wheel: its include/ and lib/
// libc10*.so; CUDA_INCLUDE the CUDA runtime headers; libcudart is found
// next to them, in ../lib, or on the loader's path.)
#define GOALLOC_TORCH_NO_MODULE
#include "../../python/goalloc/csrc/goalloc_torch.cpp"

#include <cstdio>

using namespace goalloc_torch;

static int failures = 0;

#define EXPECT(cond, ...)                                              \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                               \
      std::fprintf(stderr, "\n");                                      \
      failures++;                                                      \
    }                                                                  \
  } while (0)

template <typename E, typename F>
static std::string throws(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("WRONG TYPE: ") + e.what();
  }
  return "NO EXCEPTION";
}

static cudaStream_t stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// FakeSource stands in for the allocator of a torch.cuda.MemPool(allocator=...)
// (torch's CUDAPluggableAllocator over ncclMemAlloc, say): fake addresses,
// every call counted, live segments kept.
struct FakeSource : GoallocAllocator {
  uintptr_t next = 0x700000000000;
  int allocs = 0, frees = 0;
  std::set<void*> live;
  void* raw_alloc_with_stream(size_t n, cudaStream_t) override {
    void* p = reinterpret_cast<void*>(next);
    next += n + (size_t(1) << 30);
    allocs++;
    live.insert(p);
    return p;
  }
  void raw_delete(void* p) override {
    frees++;
    live.erase(p);
  }
};

// Pools with an allocator of their own: carved as PyTorch carves them from
// that allocator's segments, counted by goalloc in its statistics and
// snapshot and under its cap; use_on_oom; released with live tensors.
static void own_allocator_pools(GoallocAllocator& a) {
  const cudaStream_t S = stream(0x10);
  const int all = 0, large = 2;
  const size_t MiB = size_t(1) << 20;
  auto src = std::make_shared<FakeSource>();
  const c10::MempoolId_t id{0, 4242};
  a.emptyCache({0, 0});
  DeviceStats before = a.getDeviceStats(1);
  a.createOrIncrefPool(1, id, src);  // MemPool(allocator=src)
  EXPECT(a.getPoolUseCount(1, id) == 1, "one user");
  a.beginAllocateToPool(1, id, [](cudaStream_t) { return true; });  // use_mem_pool
  EXPECT(a.getPoolUseCount(1, id) == 2, "the window is a user");
  void* x = a.malloc(MiB, 1, S);
  void* y = a.malloc(MiB, 1, S);
  void* z = a.malloc(MiB, 1, S);
  a.endAllocateToPool(1, id);
  a.releasePool(1, id);
  EXPECT(src->allocs == 2 && y == static_cast<char*>(x) + MiB, "1 MiB blocks packed in 2 MiB segments: %d", src->allocs);
  CCA::SnapshotInfo snap = a.snapshot(id, false);
  EXPECT(snap.segments.size() == 2, "two segments in the pool's snapshot: %zu", snap.segments.size());
  for (auto& s : snap.segments) EXPECT(s.owner_private_pool_id == id && s.device == 1, "the pool's");
  DeviceStats st = a.getDeviceStats(1);
  EXPECT(st.reserved_bytes[all].current - before.reserved_bytes[all].current == int64_t(4 * MiB),
         "memory_reserved counts the segments: %lld", (long long)(st.reserved_bytes[all].current - before.reserved_bytes[all].current));
  EXPECT(st.allocated_bytes[all].current - before.allocated_bytes[all].current == int64_t(3 * MiB), "and the blocks");

  // Released with tensors alive (test_tensor_delete_after_allocator_delete):
  // the pool keeps its allocator until they die, then gives everything back.
  a.releasePool(1, id);  // ~MemPool
  EXPECT(a.getPoolUseCount(1, id) == 0 && src->frees == 0, "released, tensors alive");
  raw_delete_fn(x);
  raw_delete_fn(y);
  EXPECT(src->frees == 1, "a wholly free segment of a released pool goes back: %d", src->frees);
  raw_delete_fn(z);
  EXPECT(src->frees == 2 && src->live.empty(), "all back");
  EXPECT(a.getDeviceStats(1).reserved_bytes[all].current == before.reserved_bytes[all].current, "uncounted");

  // use_on_oom under a cap (test_mempool_limited_memory_with_allocator): a
  // request goalloc refuses takes the pool's free block, at its start.
  auto src2 = std::make_shared<FakeSource>();
  const c10::MempoolId_t id2{0, 4243};
  a.setMemoryFraction(double(41 * MiB) / double(8ull << 30), 1);
  a.createOrIncrefPool(1, id2, src2);
  a.setUseOnOOM(1, id2, true);
  a.beginAllocateToPool(1, id2, [](cudaStream_t) { return true; });
  void* b = a.malloc(40 * MiB, 1, S);
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(40 * MiB, 1, S); }).find("CUDA out of memory") == 0,
         "a second 40 MiB segment is over the cap");
  a.endAllocateToPool(1, id2);
  a.releasePool(1, id2);
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(30 * MiB, 1, S); }).find("CUDA out of memory") == 0,
         "goalloc's own request is over the cap too");
  raw_delete_fn(b);
  void* c = a.malloc(30 * MiB, 1, S);
  EXPECT(c == b, "use_on_oom: the pool's free block at its start: %p, %p", c, b);
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(30 * MiB, 1, S); }).find("CUDA out of memory") == 0,
         "10 MiB left in the pool");
  raw_delete_fn(c);
  EXPECT(a.getDeviceStats(1).allocated_bytes[large].current == before.allocated_bytes[large].current, "freed");
  a.releasePool(1, id2);  // ~MemPool
  a.emptyCache(id2);
  EXPECT(src2->live.empty() && src2->allocs == 1, "one segment, given back: %d", src2->allocs);
  EXPECT(a.getPoolUseCount(1, id2) == 0, "gone");
  a.setMemoryFraction(1.0, 1);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s path/to/libgoalloc.so\n", argv[0]);
    return 2;
  }
  open_library(argv[1]);
  GoallocAllocator a;
  a.init(2);
  EXPECT(a.initialized(), "init");
  EXPECT(a.name() == "goalloc", "%s", a.name().c_str());
  const cudaStream_t S = stream(0x10), T = stream(0x20);

  // Statistics in c10's DeviceStats.
  void* p = a.malloc(3000000, 0, S);
  EXPECT(p != nullptr, "malloc");
  DeviceStats st = a.getDeviceStats(0);
  using c10::CachingAllocator::StatType;
  auto all = static_cast<size_t>(StatType::AGGREGATE), large = static_cast<size_t>(StatType::LARGE_POOL);
  EXPECT(st.allocated_bytes[all].current == 3000320, "%lld", (long long)st.allocated_bytes[all].current);
  EXPECT(st.allocated_bytes[large].current == 3000320, "large pool");
  EXPECT(st.requested_bytes[all].current == 3000000, "%lld", (long long)st.requested_bytes[all].current);
  EXPECT(st.allocation[all].current == 1 && st.segment[all].current == 1, "counts");
  EXPECT(st.reserved_bytes[all].current >= 3000320, "reserved");
  EXPECT(st.max_split_size == -1, "max_split_size");
  raw_delete_fn(p);
  st = a.getDeviceStats(0);
  EXPECT(st.allocated_bytes[all].current == 0 && st.allocated_bytes[all].peak == 3000320, "after free");
  a.resetPeakStats(0);
  EXPECT(a.getDeviceStats(0).allocated_bytes[all].peak == 0, "peak reset");
  a.resetAccumulatedStats(0);
  EXPECT(a.getDeviceStats(0).allocation[all].allocated == 0, "accumulated reset");
  EXPECT(throws<c10::Error>([&] { a.getDeviceStats(7); }).find("device 7 does not exist") != std::string::npos,
         "bad device");

  // cacheInfo: the freed block is cached.
  size_t largest = 0;
  a.cacheInfo(0, &largest);
  EXPECT(largest >= 3000320, "cacheInfo %zu", largest);

  // Refusals: out-of-memory as c10::OutOfMemoryError, the rest as c10::Error.
  std::string oom = throws<c10::OutOfMemoryError>([&] { a.malloc(size_t(1) << 40, 0, S); });
  EXPECT(oom.find("CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which") == 0,
         "%s", oom.c_str());
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(size_t(1) << 62, 0, S); })
                 .find("CUDA out of memory. Tried to allocate more than 1EB memory.") == 0,
         "beyond 1 EiB: PyTorch's words");
  std::string bad = throws<c10::Error>([&] { a.malloc(size_t(1) << 63, 0, S); });
  EXPECT(bad.find("a negative size?") != std::string::npos, "%s", bad.c_str());
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(size_t(1) << 63, 0, S); }).find("WRONG TYPE") == 0,
         "bad input is not an out-of-memory");
  EXPECT(a.getDeviceStats(0).num_ooms == 2, "num_ooms");
  int observed = 0;
  a.attachOutOfMemoryObserver([&](int64_t dev, size_t size, size_t, size_t) { observed += dev == 0 && size == (size_t(1) << 40); });
  throws<c10::OutOfMemoryError>([&] { a.malloc(size_t(1) << 40, 0, S); });
  EXPECT(observed == 1, "OOM observer called %d times", observed);

  // The front: a freed block goes to the log and comes back to the next
  // request of its stream and size; torch's figures count a free and an
  // allocation, and no current figure or peak moves. Off while history is
  // recorded.
  {
    auto* log = static_cast<const goalloc_front::Log*>(lib.front_log(0));
    EXPECT(log != nullptr && log->size == sizeof(goalloc_front::Log), "the device's log");
    static const goalloc_front::Log none{};
    if (log == nullptr) log = &none;  // failed above; the checks below fail too
    void* f1 = a.malloc(2 << 20, 0, T);
    DeviceStats before = a.getDeviceStats(0);
    raw_delete_fn(f1);
    EXPECT(log->n == 1, "the free waits in the log: %u", log->n);
    void* f2 = a.malloc(2 << 20, 0, T);
    EXPECT(f2 == f1, "served again: %p, freed %p", f2, f1);
    DeviceStats after = a.getDeviceStats(0);
    EXPECT(log->n == 0, "drained by the statistics: %u", log->n);
    EXPECT(after.allocation[all].current == before.allocation[all].current &&
               after.allocation[all].allocated == before.allocation[all].allocated + 1 &&
               after.allocation[all].freed == before.allocation[all].freed + 1,
           "allocations %lld/%lld/%lld", (long long)after.allocation[all].current,
           (long long)after.allocation[all].allocated, (long long)after.allocation[all].freed);
    EXPECT(after.allocated_bytes[all].current == before.allocated_bytes[all].current &&
               after.allocated_bytes[all].peak == before.allocated_bytes[all].peak,
           "allocated bytes unmoved");
    a.recordHistory(true, nullptr, 100, CCA::RecordContext::ALL, false, {});
    raw_delete_fn(f2);
    EXPECT(log->n == 0, "history on: the free went to Go");
    a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, false, {});
  }

  // Memory fraction: every value PyTorch takes, [0, 1]; 0 refuses everything
  // (test_get_per_process_memory_fraction sets 1.0, 0.0 and random values).
  EXPECT(a.getMemoryFraction(1) == 1.0, "default fraction");
  a.setMemoryFraction(0.5, 1);
  EXPECT(a.getMemoryFraction(1) == 0.5, "fraction");
  a.setMemoryFraction(1.0, 1);
  EXPECT(a.getMemoryFraction(1) == 1.0, "fraction 1");
  a.setMemoryFraction(0.0, 1);
  EXPECT(a.getMemoryFraction(1) == 0.0, "fraction 0");
  EXPECT(throws<c10::OutOfMemoryError>([&] { a.malloc(512, 1, S); }).find("out of memory") != std::string::npos,
         "fraction 0 refuses everything");
  a.setMemoryFraction(0.123456789, 1);
  EXPECT(a.getMemoryFraction(1) == 0.123456789, "fraction read back exactly");
  a.setMemoryFraction(1.0, 1);
  EXPECT(throws<c10::Error>([&] { a.setMemoryFraction(1.5, 1); }).find("outside [0, 1]") != std::string::npos, "bad fraction");
  EXPECT(a.getMemoryFraction(1) == 1.0, "a refused fraction changes nothing");

  // History and snapshot through c10's structs.
  a.recordHistory(true, nullptr, SIZE_MAX, CCA::RecordContext::ALL, false, {});  // torch's default: sys.maxsize
  EXPECT(a.isHistoryEnabled(), "history on, as long as the library allows");
  a.recordHistory(true, nullptr, 100, CCA::RecordContext::ALL, false, {});
  EXPECT(a.isHistoryEnabled(), "history on");
  void* q = a.malloc(1000, 0, S);
  void* r = a.malloc(5 << 20, 0, S);
  raw_delete_fn(q);
  CCA::SnapshotInfo snap = a.snapshot({0, 0}, true);
  EXPECT(snap.device_traces.size() == 2, "one trace per device: %zu", snap.device_traces.size());
  bool alloc_seen = false, free_seen = false;
  for (const auto& te : snap.device_traces[0]) {
    alloc_seen |= te.action_ == TraceEntry::ALLOC && te.addr_ == reinterpret_cast<uintptr_t>(q);
    free_seen |= te.action_ == TraceEntry::FREE_COMPLETED && te.addr_ == reinterpret_cast<uintptr_t>(q);
  }
  EXPECT(alloc_seen && free_seen, "trace of q");
  bool r_live = false;
  for (const auto& seg : snap.segments) {
    size_t addr = seg.address, sum = 0;
    for (const auto& b : seg.blocks) {
      r_live |= b.allocated && addr == reinterpret_cast<uintptr_t>(r) && b.requested_size == (5 << 20);
      addr += b.size;
      sum += b.size;
    }
    EXPECT(sum == seg.total_size, "blocks cover the segment at %zx", seg.address);
    EXPECT(seg.device == 0 && seg.owner_private_pool_id == (c10::MempoolId_t{0, 0}), "general segments");
  }
  EXPECT(r_live, "r in the snapshot");
  EXPECT(a.snapshot({0, 0}, false).device_traces[0].empty(), "no traces asked");
  a.recordHistory(false, nullptr, 0, CCA::RecordContext::NEVER, false, {});
  EXPECT(!a.isHistoryEnabled(), "history off");

  // A MemPool: made, used on one stream (the filter), released.
  const c10::MempoolId_t pool{0, 5};
  a.createOrIncrefPool(0, pool, nullptr);
  EXPECT(a.getPoolUseCount(0, pool) == 1, "made");
  a.beginAllocateToPool(0, pool, [T](cudaStream_t s) { return s == T; });
  EXPECT(a.getPoolUseCount(0, pool) == 2, "window");
  EXPECT(throws<c10::Error>([&] { a.beginAllocateToPool(0, pool, [](cudaStream_t) { return true; }); })
                 .find("already allocating") != std::string::npos,
         "a second window on one pool");
  void* in = a.malloc(8 << 20, 0, T);
  void* out = a.malloc(8 << 20, 0, S);
  a.endAllocateToPool(0, pool);
  a.releasePool(0, pool);
  EXPECT(a.getPoolUseCount(0, pool) == 1, "window closed");
  EXPECT(throws<c10::Error>([&] { a.endAllocateToPool(0, pool); }).find("not allocating") != std::string::npos,
         "no window");
  CCA::SnapshotInfo ps = a.snapshot(pool, false);
  EXPECT(ps.segments.size() == 1 && ps.segments[0].address == reinterpret_cast<uintptr_t>(in) &&
             ps.segments[0].owner_private_pool_id == pool,
         "the pool's snapshot holds its block only");
  EXPECT(a.checkPoolLiveAllocations(0, pool, {in}), "live: in");
  EXPECT(!a.checkPoolLiveAllocations(0, pool, {out}), "not live: out");
  EXPECT(!a.checkPoolLiveAllocations(0, pool, {}), "in is live");

  // A checkpoint, later work, and the pool set back to the checkpoint.
  auto state = a.getCheckpointState(0, pool);
  a.beginAllocateToPool(0, pool, [T](cudaStream_t s) { return s == T; });
  raw_delete_fn(in);
  void* later = a.malloc(2 << 20, 0, T);
  a.endAllocateToPool(0, pool);
  a.releasePool(0, pool);
  EXPECT(a.checkPoolLiveAllocations(0, pool, {later}), "later is live");
  {
    CCA::CheckpointDelta d = a.setCheckpointPoolState(0, state);
    EXPECT(d.ptrs_freed.size() == 1 && d.ptrs_freed[0] == later, "later freed");
    EXPECT(d.dataptrs_allocd.size() == 1 && d.dataptrs_allocd[0].get() == in, "in allocated again");
    EXPECT(d.dataptrs_allocd[0].get_deleter() == a.raw_deleter(), "torch compares the deleters");
    EXPECT(a.checkPoolLiveAllocations(0, pool, {in}), "back to the checkpoint");
  }  // the DataPtr's deleter frees in, as a storage's would
  EXPECT(a.checkPoolLiveAllocations(0, pool, {}), "in freed by its DataPtr");

  EXPECT(throws<c10::Error>([&] { a.setUseOnOOM(0, pool, true); }).find("use_on_oom") != std::string::npos,
         "use_on_oom on goalloc's own pool");
  a.releasePool(0, pool);  // ~MemPool
  EXPECT(a.getPoolUseCount(0, pool) == 0, "released");
  a.emptyCache(pool);
  raw_delete_fn(out);
  raw_delete_fn(r);
  EXPECT(a.getDeviceStats(0).allocated_bytes[all].current == 0, "all freed");
  EXPECT(throws<c10::Error>([&] { a.raw_delete(reinterpret_cast<void*>(0xdead000)); }).find("did not allocate") !=
             std::string::npos,
         "raw_delete of a stranger");
  a.emptyCache({0, 0});
  own_allocator_pools(a);

  std::printf("cxx_class_test: %d failures\n", failures);
  return failures ? 1 : 0;
}
