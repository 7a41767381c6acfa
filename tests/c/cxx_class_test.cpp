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
#include "expect.h"

#include <unistd.h>

#include <cstdio>

using namespace goalloc_torch;

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

// A stand-in for torch's profiler with profile_memory=True: what the
// allocator reports.
struct MemoryReports : c10::MemoryReportingInfoBase {
  std::vector<std::pair<void*, int64_t>> seen;
  int64_t last_allocated = -1;
  void reportMemoryUsage(void* p, int64_t size, size_t allocated, size_t, c10::Device) override {
    seen.emplace_back(p, size);
    last_allocated = static_cast<int64_t>(allocated);
  }
  bool memoryProfilingEnabled() const override { return true; }
};

// Allocations and frees made while torch's profiler records memory are
// reported to it, each with its size and the device's figures
// (test_memory_profiler_viz builds its plot from them); none outside.
static void profiler_reports(GoallocAllocator& a) {
  const cudaStream_t S = stream(0x10);
  auto reports = std::make_shared<MemoryReports>();
  void* before = a.malloc(4096, 0, S);
  void *p = nullptr, *q = nullptr;
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, reports);
    p = a.malloc(1 << 20, 0, S);
    q = a.malloc(1000, 0, S);
    raw_delete_fn(p);
    raw_delete_fn(before);  // allocated before the profiler: not reported
  }
  raw_delete_fn(q);  // the profiler is gone: nobody to tell
  bool ok = reports->seen.size() == 3 && reports->seen[0] == std::make_pair(p, int64_t(1 << 20)) &&
            reports->seen[1] == std::make_pair(q, int64_t(1000)) && reports->seen[2] == std::make_pair(p, -int64_t(1 << 20));
  EXPECT(ok, "reports: %zu", reports->seen.size());
  EXPECT(reports->last_allocated >= 0, "with the device's allocated figure");
}

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

// A context recorder, as torch's gathers a Python traceback: each context
// says where the test was when it was gathered.
struct TestContext : c10::GatheredContext {
  std::string where;
};
static std::string g_where;
static int g_gathered = 0;
static std::shared_ptr<c10::GatheredContext> gather_test_context() {
  g_gathered++;
  auto c = std::make_shared<TestContext>();
  c->where = g_where;
  return c;
}
static std::string where(const std::shared_ptr<c10::GatheredContext>& c) {
  if (c == nullptr) return "-";
  auto t = std::dynamic_pointer_cast<TestContext>(c);
  return t != nullptr ? t->where : "?";
}

// The trace entries of device 0 as "action where" for the address p (0:
// the entries without one, empty_cache's), and the block at p's context.
static std::vector<std::string> entries_of(const CCA::SnapshotInfo& s, const void* p) {
  std::vector<std::string> out;
  for (const auto& te : s.device_traces.at(0))
    if (te.addr_ == reinterpret_cast<uintptr_t>(p) || (p == nullptr && te.action_ == TraceEntry::SNAPSHOT))
      out.push_back(std::string(te.action_ == TraceEntry::ALLOC            ? "alloc"
                                : te.action_ == TraceEntry::FREE_REQUESTED ? "free_requested"
                                : te.action_ == TraceEntry::FREE_COMPLETED ? "free_completed"
                                : te.action_ == TraceEntry::SEGMENT_ALLOC  ? "segment_alloc"
                                : te.action_ == TraceEntry::SEGMENT_FREE   ? "segment_free"
                                : te.action_ == TraceEntry::SNAPSHOT       ? "snapshot"
                                                                           : "other") +
                    " " + where(te.context_));
  return out;
}
static std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : ", ") + x;
  return out;
}
// block_where is the context of the active block at p, and of its segment.
static std::string block_where(const CCA::SnapshotInfo& s, const void* p) {
  for (const auto& seg : s.segments) {
    size_t addr = seg.address;
    for (const auto& b : seg.blocks) {
      if (b.active && addr == reinterpret_cast<uintptr_t>(p))
        return where(b.context_when_allocated) + "/" + where(seg.context_when_allocated);
      addr += b.size;
    }
  }
  return "not live";
}

static std::string g_library;

// deferred_frees is device 0's goalloc.deferred_frees (goalloc_stats_json).
static int64_t deferred_frees() {
  using StatsJson = char* (*)(int);
  void* h = dlopen(g_library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  auto stats = h ? reinterpret_cast<StatsJson>(dlsym(h, "goalloc_stats_json")) : nullptr;
  if (stats == nullptr) return -1;
  char* js = stats(0);
  std::string text(js ? js : "");
  lib.string_free(js);
  size_t at = text.find("\"goalloc.deferred_frees\":");
  return at == std::string::npos ? -1 : std::strtoll(text.c_str() + at + 25, nullptr, 10);
}

// CUDA IPC: shareIpcHandle writes torch's expandable-segment string of
// the block (goalloc_ipc.h reads it back: this process, its handles, the
// block's offset), the same string each time (receivers cache by it), and
// leaves no share held (under torch the block's free already waits for the
// receivers), so the free is made at once. getIpcDevPtr refuses a string
// torch would not write before it touches CUDA. Opening a string needs a
// GPU: tests/gpu/test_ipc_gpu.py.
// Nested use_mem_pool (test_nested_mempool): the innermost open window
// whose filter takes the stream gets the allocation, as PyTorch's caching
// allocator searches its windows last opened first; closing it hands the
// thread back to the window around it.
static void nested_pools(GoallocAllocator& a) {
  const cudaStream_t S = stream(0x10);
  const c10::MempoolId_t outer{0, 7001}, inner{0, 7002};
  a.createOrIncrefPool(0, outer, nullptr);
  a.createOrIncrefPool(0, inner, nullptr);
  a.beginAllocateToPool(0, outer, [](cudaStream_t) { return true; });
  void* x = a.malloc(4 << 20, 0, S);
  a.beginAllocateToPool(0, inner, [](cudaStream_t) { return true; });
  void* y = a.malloc(4 << 20, 0, S);
  a.endAllocateToPool(0, inner);
  void* z = a.malloc(4 << 20, 0, S);
  a.endAllocateToPool(0, outer);
  EXPECT(a.checkPoolLiveAllocations(0, outer, {x, z}), "outer holds the allocations outside the inner window");
  EXPECT(a.checkPoolLiveAllocations(0, inner, {y}), "inner holds the one made while it was open");
  EXPECT(a.snapshot(inner, false).segments.size() == 1, "inner's snapshot: %zu segments",
         a.snapshot(inner, false).segments.size());
  for (void* p : {x, y, z}) raw_delete_fn(p);
  for (const auto& id : {outer, inner}) {
    a.releasePool(0, id);  // the window
    a.releasePool(0, id);  // ~MemPool
    a.emptyCache(id);
  }
}

static void ipc_share(GoallocAllocator& a) {
  const cudaStream_t S = stream(0x10);
  const size_t MiB = size_t(1) << 20;
  void* p = a.malloc(5 * MiB + 512, 0, S);
  int64_t allocated = a.getDeviceStats(0).allocated_bytes[0].current;
  CCA::ShareableHandle h = a.shareIpcHandle(p);
  goalloc_ipc::Parsed got;
  std::string err;
  EXPECT(goalloc_ipc::parse(h.handle, &got, &err), "parse: %s", err.c_str());
  EXPECT(got.type == 'e' && got.range.pid == getpid() && !got.range.fds.empty(), "type %c", got.type);
  EXPECT(h.offset >= 0 && uint64_t(h.offset) < got.range.segment_size, "offset %td", h.offset);
  EXPECT(got.range.fds.size() * got.range.segment_size >= uint64_t(h.offset) + 5 * MiB, "the handles cover the block");
  EXPECT(a.shareIpcHandle(p).handle == h.handle, "the same string again");
  raw_delete_fn(p);
  EXPECT(a.getDeviceStats(0).allocated_bytes[0].current == allocated - int64_t(5 * MiB + 512), "freed at once");
  // record_stream on a shared storage (torch's CudaIPCSentData DataPtr,
  // another deleter over goalloc's block): recorded, so the block's free
  // waits for the other stream (goalloc.deferred_frees counts it).
  void* q = a.malloc(2 * MiB, 0, S);
  c10::DataPtr wrapped(q, q, [](void*) {}, c10::Device(c10::DeviceType::CUDA, 0));
  int64_t deferred = deferred_frees();
  a.recordStream(wrapped, c10::cuda::getStreamFromExternal(stream(0x30), 0));
  raw_delete_fn(q);
  EXPECT(deferred_frees() == deferred + 1, "the free waited for the recorded stream");
  c10::DataPtr foreign(reinterpret_cast<void*>(0xbad000), nullptr, [](void*) {}, c10::Device(c10::DeviceType::CUDA, 0));
  a.recordStream(foreign, c10::cuda::getStreamFromExternal(stream(0x30), 0));  // ignored, no warning
  EXPECT(throws<c10::Error>([&] { a.getIpcDevPtr(std::string("\x02" "x", 2)); }).find("unknown type") != std::string::npos,
         "an unknown type is refused");
  EXPECT(throws<c10::Error>([&] { a.getIpcDevPtr(std::string("\x09" "e", 2)); }).find("version 9") != std::string::npos,
         "a later version is refused");
  EXPECT(throws<c10::Error>([&] { a.shareIpcHandle(reinterpret_cast<void*>(0xdead000)); }).find("did not allocate") !=
             std::string::npos,
         "a pointer goalloc did not allocate");
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s path/to/libgoalloc.so\n", argv[0]);
    return 2;
  }
  open_library(argv[1]);
  g_library = argv[1];
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
    a.recordHistory(true, nullptr, 100, CCA::RecordContext::NEVER, false, {});
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
  a.recordHistory(true, nullptr, SIZE_MAX, CCA::RecordContext::NEVER, false, {});  // torch's default: sys.maxsize
  EXPECT(a.isHistoryEnabled(), "history on, as long as the library allows");
  a.recordHistory(true, nullptr, 100, CCA::RecordContext::NEVER, false, {});
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
  nested_pools(a);
  profiler_reports(a);

  // roundup_power2_divisions, set at run time as
  // torch.cuda.memory._set_allocator_settings does: an 84 MiB request is
  // a 96 MiB block with 4 divisions (test_allocator_settings), its request
  // still 84 MiB; a power of two stays; settings without it round no more.
  {
    const size_t MiB = size_t(1) << 20;
    c10::CachingAllocator::setAllocatorSettings("roundup_power2_divisions:4");
    DeviceStats s0 = a.getDeviceStats(1);
    void* r84 = a.malloc(84 * MiB, 1, S);
    void* r64 = a.malloc(64 * MiB, 1, S);
    DeviceStats s1 = a.getDeviceStats(1);
    EXPECT(s1.active_bytes[all].allocated - s0.active_bytes[all].allocated == int64_t(160 * MiB),
           "96 + 64 MiB active: %lld", (long long)(s1.active_bytes[all].allocated - s0.active_bytes[all].allocated));
    EXPECT(s1.requested_bytes[all].allocated - s0.requested_bytes[all].allocated == int64_t(148 * MiB),
           "84 + 64 MiB requested");
    raw_delete_fn(r84);
    raw_delete_fn(r64);
    c10::CachingAllocator::setAllocatorSettings("garbage_collection_threshold:0.5");
    DeviceStats s2 = a.getDeviceStats(1);
    void* r = a.malloc(84 * MiB, 1, S);
    DeviceStats s3 = a.getDeviceStats(1);
    EXPECT(s3.active_bytes[all].allocated - s2.active_bytes[all].allocated == int64_t(84 * MiB), "no rounding any more");
    raw_delete_fn(r);
    c10::CachingAllocator::setAllocatorSettings("");
  }

  // Stack traces, as torch's _record_memory_history records them: at
  // every level from STATE the live blocks (and the segments they took from
  // the pool) keep their allocation's context; from ALLOC the trace
  // entries show it too, a free's entries the allocation's; at ALL a free
  // and an empty_cache gather their own.
  for (auto when : {CCA::RecordContext::STATE, CCA::RecordContext::ALLOC, CCA::RecordContext::ALL}) {
    const int level = static_cast<int>(when);
    a.emptyCache({0, 0});  // the blocks below are new segments
    a.recordHistory(true, &gather_test_context, 100, when, true, {});
    g_gathered = 0;
    g_where = "alloc";
    void* p = a.malloc(1000, 0, S);
    void* q = a.malloc(5 << 20, 0, S);
    CCA::SnapshotInfo s1 = a.snapshot({0, 0}, true);
    EXPECT(block_where(s1, p) == "alloc/alloc" && block_where(s1, q) == "alloc/alloc", "level %d: %s %s", level,
           block_where(s1, p).c_str(), block_where(s1, q).c_str());
    std::string shown = when == CCA::RecordContext::STATE ? "-" : "alloc";
    EXPECT(join(entries_of(s1, p)) == "segment_alloc " + shown + ", alloc " + shown, "level %d: %s", level,
           join(entries_of(s1, p)).c_str());
    g_where = "free";
    raw_delete_fn(p);
    g_where = "empty";
    a.emptyCache({0, 0});
    CCA::SnapshotInfo s2 = a.snapshot({0, 0}, true);
    std::string freed = when == CCA::RecordContext::ALL ? "free" : shown;
    std::string emptied = when == CCA::RecordContext::ALL ? "empty" : shown;  // else the segment's own
    EXPECT(join(entries_of(s2, p)) == "segment_alloc " + shown + ", alloc " + shown + ", free_requested " + freed +
                                          ", free_completed " + freed + ", segment_free " + emptied,
           "level %d: %s", level, join(entries_of(s2, p)).c_str());
    std::string marker = when == CCA::RecordContext::ALL ? "empty" : "-";
    EXPECT(join(entries_of(s2, nullptr)) == "snapshot " + marker, "level %d: %s", level,
           join(entries_of(s2, nullptr)).c_str());
    EXPECT(block_where(s2, q) == "alloc/alloc", "level %d: q keeps its context: %s", level, block_where(s2, q).c_str());
    EXPECT(g_gathered == (when == CCA::RecordContext::ALL ? 4 : 2), "level %d: gathered %d", level, g_gathered);
    raw_delete_fn(q);
    EXPECT(contexts.live() == 0, "level %d: a freed block's context goes: %zu", level, contexts.live());
  }
  {
    // NEVER: nothing is gathered; the history is recorded all the same.
    a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::NEVER, true, {});
    g_gathered = 0;
    void* p = a.malloc(1000, 0, S);
    raw_delete_fn(p);
    CCA::SnapshotInfo s = a.snapshot({0, 0}, true);
    EXPECT(join(entries_of(s, p)) == "segment_alloc -, alloc -, free_requested -, free_completed -", "never: %s",
           join(entries_of(s, p)).c_str());
    EXPECT(g_gathered == 0 && contexts.live() == 0, "never gathers");
    // A block's context outlives recording, as in PyTorch; its free ends it.
    a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::STATE, true, {});
    g_where = "kept";
    p = a.malloc(1000, 0, S);
    a.recordHistory(false, &gather_test_context, 100, CCA::RecordContext::STATE, false, {});
    EXPECT(block_where(a.snapshot({0, 0}, true), p) == "kept/-", "kept after recording stops: %s",
           block_where(a.snapshot({0, 0}, true), p).c_str());  // its segment was made at NEVER
    raw_delete_fn(p);
    EXPECT(contexts.live() == 0, "freed after recording stopped, when the front takes frees again");
  }

  // The trace entry's size is the request, as PyTorch's
  // (test_cpp_memory_snapshot_pickle), labelled with the compile context
  // and user metadata in force.
  {
    a.recordHistory(true, &gather_test_context, 10, CCA::RecordContext::ALLOC, true, {});
    a.set_user_metadata(0, "metadata test");
    EXPECT(a.user_metadata(0) == "metadata test", "%s", a.user_metadata(0).c_str());
    a.push_compile_context(0, "Torch-Compiled Region: 0/0");
    void* p = a.malloc(311 * 411 * 4, 0, S);
    a.pop_compile_context(0);
    a.pop_compile_context(0);  // one too many: ignored
    a.set_user_metadata(0, "");
    void* q = a.malloc(1000, 0, S);
    CCA::SnapshotInfo s = a.snapshot({0, 0}, true);
    const TraceEntry* last = s.device_traces[0].empty() ? nullptr : &s.device_traces[0].back();
    EXPECT(last != nullptr && last->action_ == TraceEntry::ALLOC && last->addr_ == reinterpret_cast<uintptr_t>(q) &&
               last->size_ == 1000 && last->compile_context_ == "N/A" && last->user_metadata_.empty(),
           "the last entry: q's alloc, no labels");
    bool found = false;
    for (const auto& te : s.device_traces[0]) {
      if (te.action_ != TraceEntry::ALLOC || te.addr_ != reinterpret_cast<uintptr_t>(p)) continue;
      found = true;
      EXPECT(te.size_ == 311 * 411 * 4, "requested size %zu", te.size_);
      EXPECT(te.compile_context_ == "Torch-Compiled Region: 0/0" && te.user_metadata_ == "metadata test",
             "labels %s / %s", te.compile_context_.c_str(), te.user_metadata_.c_str());
    }
    EXPECT(found, "p's alloc");
    raw_delete_fn(p);
    raw_delete_fn(q);
    EXPECT(throws<c10::Error>([&] { a.set_user_metadata(70, "x"); }).find("device 70 is outside") != std::string::npos,
           "a bad device");
  }

  // skip_actions: not recorded, and their contexts not kept; a name torch
  // does not know is torch's error; stacks need a recorder.
  {
    a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::ALL, true, {"alloc", "segment_alloc"});
    g_where = "skip";
    void* p = a.malloc(1000, 0, S);
    EXPECT(contexts.traced(0) == 0, "an alloc not recorded keeps no trace context: %zu", contexts.traced(0));
    raw_delete_fn(p);
    CCA::SnapshotInfo s = a.snapshot({0, 0}, true);
    EXPECT(join(entries_of(s, p)) == "free_requested skip, free_completed skip", "skipped: %s",
           join(entries_of(s, p)).c_str());
    EXPECT(contexts.traced(0) == 1, "the free's: %zu", contexts.traced(0));
    EXPECT(throws<c10::Error>([&] {
             a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::ALL, false, {"free"});
           }).find("Unknown TraceEntry action: free") != std::string::npos,
           "unknown action");
    EXPECT(throws<c10::Error>([&] { a.recordHistory(true, nullptr, 100, CCA::RecordContext::ALLOC, false, {}); })
                   .find("needs a context recorder") != std::string::npos,
           "no recorder");
    EXPECT(a.snapshot({0, 0}, true).device_traces[0].size() == 2, "refused calls change nothing");

    // clear_history: on again keeps the history and its contexts, unless
    // cleared; off drops them.
    a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::ALL, false, {});
    s = a.snapshot({0, 0}, true);
    EXPECT(join(entries_of(s, p)) == "free_requested skip, free_completed skip", "kept: %s",
           join(entries_of(s, p)).c_str());
    a.recordHistory(true, &gather_test_context, 100, CCA::RecordContext::ALL, true, {});
    EXPECT(a.snapshot({0, 0}, true).device_traces[0].empty() && contexts.traced(0) == 0, "cleared");
  }

  // The ring: as many trace contexts per device as the history's entries,
  // and every entry Go still has finds its context.
  {
    a.recordHistory(true, &gather_test_context, 10, CCA::RecordContext::ALL, true, {});
    g_where = "keep";
    void* keep = a.malloc(1000, 1, S);  // device 1's ring is its own
    for (int i = 0; i < 50; i++) {
      g_where = "pair " + std::to_string(i);
      raw_delete_fn(a.malloc(1000, 0, S));
    }
    EXPECT(contexts.traced(0) == 10, "ring of device 0: %zu", contexts.traced(0));
    EXPECT(contexts.traced(1) == 1, "ring of device 1: %zu", contexts.traced(1));
    CCA::SnapshotInfo s = a.snapshot({0, 0}, true);
    EXPECT(s.device_traces[0].size() == 10, "entries %zu", s.device_traces[0].size());
    int with = 0;
    for (const auto& te : s.device_traces[0]) with += where(te.context_).rfind("pair 4", 0) == 0;
    EXPECT(with == 10, "all of the last entries have their pair's context: %d", with);
    EXPECT(block_where(s, keep).rfind("keep/", 0) == 0, "device 1's block: %s", block_where(s, keep).c_str());
    EXPECT(!s.device_traces.at(1).empty() && where(s.device_traces[1].back().context_) == "keep",
           "device 1's entries find their context in its ring");
    raw_delete_fn(keep);
    EXPECT(contexts.traced(1) == 2, "the free on device 1 went to its ring: %zu", contexts.traced(1));
    EXPECT(contexts.live() == 0, "no live contexts left");

    // Annotations: kept while recording, in the same bound.
    a.record_annotation(0, {{"name", "step 1"}});
    s = a.snapshot({0, 0}, true);
    EXPECT(s.external_annotations.size() == 1 && s.external_annotations[0].metadata_.at("name") == "step 1",
           "annotation");
    for (int i = 0; i < 20; i++) a.record_annotation(0, {{"name", "n"}});
    EXPECT(a.snapshot({0, 0}, true).external_annotations.size() == 10, "annotations bounded");
    EXPECT(a.snapshot({0, 0}, false).external_annotations.empty(), "no traces asked");
    a.recordHistory(false, &gather_test_context, 0, CCA::RecordContext::ALL, false, {});
    a.recordAnnotation({{"name", "off"}});  // not recorded: asks for no device
    EXPECT(a.snapshot({0, 0}, true).external_annotations.empty(), "off drops the annotations");
    a.pushCompileContext(g_where);  // off: ignored, asks for no device
    a.popCompileContext();
  }

  ipc_share(a);

  std::printf("cxx_class_test: %d failures\n", failures);
  return failures ? 1 : 0;
}
