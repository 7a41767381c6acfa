// goalloc as PyTorch's CUDA allocator: a C++ class implementing
// c10::cuda::CUDACachingAllocator::CUDAAllocator over libgoalloc.so.
//
// torch.cuda.memory.CUDAPluggableAllocator takes only malloc and free (plus
// a few hooks) and refuses the rest of the allocator interface: statistics,
// snapshots, history, cacheInfo (cudnn.benchmark), MemPool, and the pool
// checkpoints of torch.compile's CUDA graph trees. This class answers all
// of them from goalloc, so that torch's own functions (memory_stats,
// memory_allocated, _snapshot, _record_memory_history, ...) work unchanged.
//
// It derives from CUDAAllocator, not from CUDAPluggableAllocator: it would
// override every method of the pluggable class but copy_data, and the
// pluggable class's allocation path keeps a map of every live pointer under
// a mutex (std::unordered_map, a node allocated per tensor). goalloc finds a
// block from its address; the class's own table (goalloc_front.h) holds
// only what its front needs, in one open-addressed array.
//
// The front: frees reach Go in batches, and a tensor freed and then a
// tensor of the same size asked for on the same stream, before any other
// request went to Go, are served here without calling into Go, through a log Go
// shares (goalloc_front.h; caching/front.go). Every figure stays exact: Go
// applies the log before anything else touches the device.
//
// libgoalloc.so is opened with dlopen from the path the Python package
// gives, so that this extension is built once per torch version, wherever
// the library lives, and shares the one Go runtime the package has loaded.
// Every C++ exception is thrown here, after the Go call has returned: an
// exception must never unwind through Go frames.
#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#ifndef GOALLOC_TORCH_NO_MODULE  // tests/c/cxx_class_test.cpp: the class alone, on c10
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>
#endif

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "goalloc.h"
#include "goalloc_contexts.h"
#include "goalloc_front.h"
#include "goalloc_ipc.h"
#include "goalloc_sched.h"
#include "goalloc_split.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace goalloc_torch {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::CachingDeviceAllocator::AnnotationEntry;

// --- libgoalloc.so -----------------------------------------------------------

using ull = unsigned long long;

// The functions of libgoalloc.so this class calls, as (field of Library,
// function of goalloc.h): each field has the type of its function's
// declaration there.
#define GOALLOC_LIBRARY_FUNCTIONS(X)                     \
  X(pool_malloc, goalloc_pool_malloc_ctx)                \
  X(free_ptr, goalloc_free_ptr_ctx)                      \
  X(init, goalloc_init)                                  \
  X(empty_cache, goalloc_empty_cache_ctx)                \
  X(set_fraction, goalloc_set_fraction)                  \
  X(record_stream, goalloc_record_stream)                \
  X(begin_pool, goalloc_begin_allocate_to_pool)          \
  X(end_pool, goalloc_end_allocate_to_pool)              \
  X(release_pool, goalloc_release_pool)                  \
  X(incref_pool, goalloc_create_or_incref_pool)          \
  X(pool_use_count, goalloc_pool_use_count)              \
  X(pool_live_blocks, goalloc_pool_live_blocks)          \
  X(restore_pool, goalloc_restore_pool)                  \
  X(device_stats, goalloc_torch_device_stats)            \
  X(largest_cached, goalloc_largest_cached_block)        \
  X(reset_peak, goalloc_reset_peak_stats)                \
  X(reset_accumulated, goalloc_reset_accumulated_stats)  \
  X(snapshot_json, goalloc_snapshot_json)                \
  X(config_json, goalloc_config_json)                    \
  X(record_history, goalloc_record_history_opts)         \
  X(set_trace_labels, goalloc_set_trace_labels)          \
  X(last_error, goalloc_last_error)                      \
  X(string_free, goalloc_string_free)                    \
  X(front_log, goalloc_front_log)                        \
  X(front_drain, goalloc_front_drain)                    \
  X(sched_yield, goalloc_sched_yield)                    \
  X(yield_every_ns, goalloc_yield_every_ns)              \
  X(stat, goalloc_stat)                                  \
  X(complete_recorded_free, goalloc_complete_recorded_free) \
  X(external_claim, goalloc_external_claim)              \
  X(external_unclaim, goalloc_external_unclaim)          \
  X(external_segment, goalloc_external_segment)          \
  X(external_block, goalloc_external_block)              \
  X(ipc_export, goalloc_ipc_export)                      \
  X(ipc_release, goalloc_ipc_release)                    \
  X(ipc_import, goalloc_ipc_import)                      \
  X(ipc_close, goalloc_ipc_close)                        \
  X(record_stream_held, goalloc_record_stream_held)

struct Library {
#define GOALLOC_FIELD(field, fn) decltype(&::fn) field = nullptr;
  GOALLOC_LIBRARY_FUNCTIONS(GOALLOC_FIELD)
#undef GOALLOC_FIELD
};

Library lib;
std::once_flag lib_once;

// The figures goalloc_torch_device_stats writes (goalloc.h's table).
constexpr int kStatFigures = GOALLOC_TORCH_STAT_FIGURES;
static_assert(GOALLOC_STAT_COUNT(GOALLOC_STAT_POOLS) ==
                  static_cast<int>(c10::CachingAllocator::StatType::NUM_TYPES),
              "goalloc.h's pool types are c10's StatTypes, in their order");

void open_library(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(h != nullptr, "goalloc: cannot open ", path, ": ", dlerror());
  std::string missing;
  auto sym = [&](const char* name) {
    void* f = dlsym(h, name);
    if (f == nullptr) missing += std::string(" ") + name;
    return f;
  };
#define GOALLOC_SYM(field, fn) lib.field = reinterpret_cast<decltype(lib.field)>(sym(#fn));
  GOALLOC_LIBRARY_FUNCTIONS(GOALLOC_SYM)
#undef GOALLOC_SYM
  TORCH_CHECK(missing.empty(), "goalloc: ", path, " lacks", missing,
              "; it is older than this allocator class: rebuild it (make lib)");
}

// A string libgoalloc.so malloc'd, freed with goalloc_string_free.
struct GoString {
  char* s;
  explicit GoString(char* p) : s(p) {}
  ~GoString() {
    if (s != nullptr) lib.string_free(s);
  }
  GoString(const GoString&) = delete;
  GoString& operator=(const GoString&) = delete;
};

// Messages reach TORCH_CHECK and TORCH_WARN as strings alone: a number is
// written with std::to_string first, never to the stream they build the
// message on. Where the compiler links its own copy of libstdc++ into this
// module, an integer written to that stream can crash the process (ostream's
// integer insertion) where the check was to raise; tests/test_cxx.py holds
// the rule.
std::string pool_name(c10::MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

std::string last_error() {
  GoString e(lib.last_error());
  return e.s != nullptr && *e.s != '\0' ? std::string(e.s) : std::string("goalloc: the call failed");
}

// check throws goalloc's own message when a control call returned -1.
void check(int status) {
  TORCH_CHECK(status == 0, last_error());
}

// --- a small JSON reader for goalloc's snapshot and pool answers --------------

struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0;
  ull u = 0;  // integers exactly: addresses do not fit a double
  bool neg = false;
  std::string str;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json& operator[](const char* key) const {
    static const Json null;
    for (const auto& f : fields)
      if (f.first == key) return f.second;
    return null;
  }
  ull uint() const { return kind == Number && !neg ? u : 0; }
  long long sint() const { return kind != Number ? 0 : neg ? -static_cast<long long>(u) : static_cast<long long>(u); }
};

struct JsonParser {
  const char* p;
  const char* end;

  void ws() {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')) p++;
  }
  void expect(char c) {
    ws();
    TORCH_CHECK(p < end && *p == c, "goalloc: unexpected JSON from the library (wanted '", std::string(1, c), "')");
    p++;
  }
  Json value() {
    ws();
    TORCH_CHECK(p < end, "goalloc: truncated JSON from the library");
    Json v;
    char c = *p;
    if (c == '{') {
      v.kind = Json::Object;
      p++;
      ws();
      if (p < end && *p == '}') { p++; return v; }
      for (;;) {
        Json k = value();
        TORCH_CHECK(k.kind == Json::String, "goalloc: bad JSON object key from the library");
        expect(':');
        v.fields.emplace_back(k.str, value());
        ws();
        if (p < end && *p == ',') { p++; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Array;
      p++;
      ws();
      if (p < end && *p == ']') { p++; return v; }
      for (;;) {
        v.items.push_back(value());
        ws();
        if (p < end && *p == ',') { p++; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::String;
      p++;
      while (p < end && *p != '"') {
        if (*p == '\\' && p + 1 < end) {
          p++;
          switch (*p) {
            case 'n': v.str += '\n'; break;
            case 't': v.str += '\t'; break;
            case 'u': v.str += '?'; p += 4; break;  // goalloc's strings are ASCII
            default: v.str += *p;
          }
          p++;
        } else {
          v.str += *p++;
        }
      }
      expect('"');
      return v;
    }
    if (std::strncmp(p, "true", 4) == 0) { v.kind = Json::Bool; v.b = true; p += 4; return v; }
    if (std::strncmp(p, "false", 5) == 0) { v.kind = Json::Bool; p += 5; return v; }
    if (std::strncmp(p, "null", 4) == 0) { p += 4; return v; }
    v.kind = Json::Number;
    const char* start = p;
    if (*p == '-') { v.neg = true; p++; }
    while (p < end && *p >= '0' && *p <= '9') v.u = v.u * 10 + static_cast<ull>(*p++ - '0');
    while (p < end && (*p == '.' || *p == 'e' || *p == 'E' || *p == '+' || *p == '-' || (*p >= '0' && *p <= '9'))) p++;
    v.num = std::strtod(std::string(start, p).c_str(), nullptr);
    TORCH_CHECK(p > start, "goalloc: unexpected JSON from the library");
    return v;
  }
};

// parse takes a string from libgoalloc.so (NULL: the call failed) and frees it.
Json parse(char* s) {
  TORCH_CHECK(s != nullptr, last_error());
  GoString owned(s);
  JsonParser jp{s, s + std::strlen(s)};
  return jp.value();
}

// --- the allocator ------------------------------------------------------------

void raw_delete_fn(void* ptr);

// With GOALLOC_CONF's yield_every, each thread yields to Go's scheduler now
// and then, before a call into Go, so that its calls keep their Go
// processor (goalloc_sched.h). Never destroyed, like the front below.
void sched_yield() { lib.sched_yield(); }
long long yield_every_ns() { return lib.yield_every_ns(); }
goalloc_sched::Keeper<>& keeper = *new goalloc_sched::Keeper<>(&yield_every_ns, &sched_yield);

// The front (goalloc_front.h): a freed block served again to the next
// request of its stream and size, and frees handed to Go in batches.
void* front_log_of(int device) { return lib.front_log(device); }
int front_drain(int device) {
  keeper.before_go_call();
  return lib.front_drain(device);
}
// Never destroyed: torch frees tensors it keeps in its own statics (cuBLAS
// workspaces) while the process exits, after this library's statics would
// have gone, and each of those frees asks the front first.
goalloc_front::Front& front = *new goalloc_front::Front(&front_log_of, &front_drain);

// Uncached memory: while torch.cuda.caching_allocator_enable(False) is in
// force, allocations bypass goalloc altogether, as they bypass PyTorch's
// cache: cudaMalloc and cudaFree, counted nowhere. Such a pointer is freed
// the same way whatever the flag says by then, so it is remembered here.
// uncached_count lets every other free skip the set with one load.
struct Uncached {
  std::mutex mu;
  std::unordered_set<void*> ptrs;
  std::atomic<size_t> count{0};

  void* alloc(size_t size) {
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, size));
    std::lock_guard<std::mutex> g(mu);
    ptrs.insert(p);
    count.store(ptrs.size(), std::memory_order_release);
    return p;
  }

  // free cudaFrees ptr if it is uncached memory, and says whether it was.
  bool free(void* ptr) {
    if (count.load(std::memory_order_acquire) == 0) return false;
    {
      std::lock_guard<std::mutex> g(mu);
      if (ptrs.erase(ptr) == 0) return false;
      count.store(ptrs.size(), std::memory_order_release);
    }
    cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) (void)cudaGetLastError();  // a deleter must not throw
    return true;
  }
};
Uncached& uncached = *new Uncached();  // never destroyed, like the front

// --- pools with an allocator of their own (goalloc_split.h) -------------------

// OnDevice makes device current for its lifetime, as the pool's allocator
// takes the current device; where the runtime cannot say which is current
// (no GPU: goalloc's simulated device in tests) it changes nothing.
struct OnDevice {
  int prev = -1;
  explicit OnDevice(int device) {
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (cur != device && cudaSetDevice(device) == cudaSuccess) prev = cur;
  }
  ~OnDevice() {
    if (prev >= 0) (void)cudaSetDevice(prev);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
};

// OwnAllocatorEnv gives a pool the segments of its allocator (torch's
// CUDAAllocator behind MemPool(allocator=...)), counted by goalloc under
// its cap (caching/external.go). The pool keeps its allocator alive until
// the pool goes, as PyTorch's private pools do.
struct OwnAllocatorEnv : goalloc_split::Env {
  std::shared_ptr<CCA::CUDAAllocator> source;
  c10::DeviceIndex device;

  OwnAllocatorEnv(std::shared_ptr<CCA::CUDAAllocator> s, c10::DeviceIndex d) : source(std::move(s)), device(d) {}

  void* segment_alloc(size_t size, void* stream, bool large, std::string* err, bool* oom) override {
    char* e = nullptr;
    if (lib.external_claim(device, size, &e) != 0) {
      *err = e != nullptr ? std::string(e) : last_error();
      if (e != nullptr) lib.string_free(e);
      *oom = true;
      return nullptr;
    }
    void* p = nullptr;
    try {
      OnDevice on(device);
      p = source->raw_alloc_with_stream(size, static_cast<cudaStream_t>(stream));
    } catch (const std::exception& ex) {
      *err = ex.what();
    }
    if (p == nullptr) {
      lib.external_unclaim(device, size);
      if (err->empty()) *err = "goalloc: the pool's allocator gave no memory for a segment of " + std::to_string(size) + " bytes";
      *oom = true;
      return nullptr;
    }
    lib.external_segment(device, 1, p, size, large, static_cast<cudaStream_t>(stream));
    return p;
  }

  void segment_free(const goalloc_split::Segment& s) override {
    void* p = reinterpret_cast<void*>(s.addr);
    try {
      OnDevice on(device);
      source->raw_delete(p);
    } catch (const std::exception& ex) {
      // A free must not throw (it runs in deleters): the memory is the
      // pool's allocator's to lose, and the warning says so.
      TORCH_WARN("goalloc: the pool's allocator failed to free a segment: ", ex.what());
    }
    lib.external_segment(device, 0, p, s.size, s.large, static_cast<cudaStream_t>(s.stream));
  }

  void block_counted(const goalloc_split::Block& b, void* stream, bool alloc) override {
    lib.external_block(device, alloc, reinterpret_cast<void*>(b.addr), b.size, b.requested, b.seg->large,
                       static_cast<cudaStream_t>(stream));
  }

  // A block that record_stream named other streams for is reused only
  // after they are done; the pool waits for them at the free (a rare path:
  // PyTorch's allocator polls events instead).
  void wait_for(const std::vector<void*>& streams) override {
    for (void* s : streams)
      if (cudaStreamSynchronize(static_cast<cudaStream_t>(s)) != cudaSuccess) (void)cudaGetLastError();
  }
};

// OwnAllocatorPools holds the pools with an allocator of their own, by
// device and id, and the use_on_oom ones among them. Never destroyed, like
// the front: frees reach it while the process exits. Its lock is never held
// while a pool calls out (a pool's allocator may call back into torch's).
class OwnAllocatorPools {
 public:
  using Key = std::tuple<int, ull, ull>;

  std::shared_ptr<goalloc_split::Pool> find(c10::DeviceIndex device, c10::MempoolId_t id) {
    if (count_.load(std::memory_order_acquire) == 0) return nullptr;
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(Key{device, id.first, id.second});
    return it == pools_.end() ? nullptr : it->second.pool;
  }

  // create_or_incref makes the pool of id over allocator, or adds a user.
  void create_or_incref(c10::DeviceIndex device, c10::MempoolId_t id, std::shared_ptr<CCA::CUDAAllocator> allocator) {
    std::shared_ptr<goalloc_split::Pool> p;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& e = pools_[Key{device, id.first, id.second}];
      if (e.pool == nullptr) {
        e.pool = std::make_shared<goalloc_split::Pool>(std::make_unique<OwnAllocatorEnv>(std::move(allocator), device));
        count_.fetch_add(1, std::memory_order_release);
      }
      p = e.pool;
    }
    p->incref();
  }

  // release drops a user; a released pool that holds nothing goes.
  int release(c10::DeviceIndex device, c10::MempoolId_t id) {
    auto p = find(device, id);
    if (p == nullptr) return -1;
    int left = p->decref();
    if (left == 0) drop_if_done(device, id, p);
    return left;
  }

  // with_id is the pool of id on any device (ids are the process's).
  std::vector<std::shared_ptr<goalloc_split::Pool>> with_id(c10::MempoolId_t id) {
    std::vector<std::shared_ptr<goalloc_split::Pool>> out;
    for (auto& [key, p] : all())
      if (std::get<1>(key) == id.first && std::get<2>(key) == id.second) out.push_back(p);
    return out;
  }

  void set_use_on_oom(c10::DeviceIndex device, c10::MempoolId_t id, bool on) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(Key{device, id.first, id.second});
    if (it != pools_.end()) it->second.use_on_oom = on;
  }

  // free gives ptr back to its pool; false when no such pool holds it.
  bool free(void* ptr) {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    for (auto& [key, p] : all()) {
      if (p->free(ptr)) {
        if (p->users() == 0) drop_if_done(std::get<0>(key), {std::get<1>(key), std::get<2>(key)}, p);
        return true;
      }
    }
    return false;
  }

  bool record_stream(void* ptr, void* stream) {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    for (auto& [key, p] : all())
      if (p->record_stream(ptr, stream)) return true;
    return false;
  }

  // take_on_oom serves a request goalloc refused for lack of memory from
  // the free blocks of device's use_on_oom pools, as PyTorch's allocator
  // does before it raises.
  void* take_on_oom(c10::DeviceIndex device, size_t size, void* stream) {
    if (count_.load(std::memory_order_acquire) == 0) return nullptr;
    for (auto& [key, p] : all(device, true))
      if (void* q = p->take(size, stream)) return q;
    return nullptr;
  }

  // empty_released is the global empty_cache's part: pools no one uses any
  // more give back what they can, and go when they hold nothing.
  void empty_released() {
    if (count_.load(std::memory_order_acquire) == 0) return;
    for (auto& [key, p] : all()) {
      if (p->users() > 0) continue;
      p->empty();
      drop_if_done(std::get<0>(key), {std::get<1>(key), std::get<2>(key)}, p);
    }
  }

  // snapshot lists the segments of device's pools (id {0, 0}: all pools).
  std::vector<std::pair<Key, std::vector<goalloc_split::SegmentView>>> snapshot(c10::MempoolId_t id) {
    std::vector<std::pair<Key, std::vector<goalloc_split::SegmentView>>> out;
    for (auto& [key, p] : all()) {
      if (id != c10::MempoolId_t{0, 0} && (std::get<1>(key) != id.first || std::get<2>(key) != id.second)) continue;
      out.emplace_back(key, p->snapshot());
    }
    return out;
  }

 private:
  struct Entry {
    std::shared_ptr<goalloc_split::Pool> pool;
    bool use_on_oom = false;
  };

  // all copies the pools (of device's use_on_oom ones), so that none is
  // called with mu_ held.
  std::vector<std::pair<Key, std::shared_ptr<goalloc_split::Pool>>> all(int device = -1, bool on_oom = false) {
    std::vector<std::pair<Key, std::shared_ptr<goalloc_split::Pool>>> out;
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [key, e] : pools_)
      if ((device < 0 || std::get<0>(key) == device) && (!on_oom || e.use_on_oom)) out.emplace_back(key, e.pool);
    return out;
  }

  void drop_if_done(int device, c10::MempoolId_t id, const std::shared_ptr<goalloc_split::Pool>& p) {
    if (p->users() != 0 || !p->holds_nothing()) return;
    std::lock_guard<std::mutex> g(mu_);
    auto it = pools_.find(Key{device, id.first, id.second});
    if (it != pools_.end() && it->second.pool == p) {
      pools_.erase(it);
      count_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex mu_;
  std::map<Key, Entry> pools_;
  std::atomic<int> count_{0};
};
OwnAllocatorPools& own_pools = *new OwnAllocatorPools();

// The contexts of the memory history (goalloc_contexts.h): the stack
// traces torch's context recorder gathers, named in Go by ids. Never
// destroyed, like the front: frees made while the process exits pass
// through it.
goalloc_contexts::Contexts<c10::GatheredContext>& contexts =
    *new goalloc_contexts::Contexts<c10::GatheredContext>();

// Profiled: while torch's profiler records memory (profile_memory=True),
// every allocation and free is reported to it, as PyTorch's allocator
// reports them, with the device's allocated and reserved figures; the
// sizes of the allocations made meanwhile are kept to report their frees.
// count lets every free outside profiling skip the map with one load.
struct Profiled {
  std::mutex mu;
  std::unordered_map<void*, std::pair<size_t, c10::DeviceIndex>> live;
  std::atomic<size_t> count{0};

  static void report(void* p, int64_t delta, c10::DeviceIndex device) {
    long long allocated = lib.stat(device, 0), reserved = lib.stat(device, 2);
    c10::reportMemoryUsageToProfiler(p, delta, static_cast<size_t>(std::max(0LL, allocated)),
                                     static_cast<size_t>(std::max(0LL, reserved)),
                                     c10::Device(c10::DeviceType::CUDA, device));
  }

  void allocated(void* p, size_t size, c10::DeviceIndex device) {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> g(mu);
      live[p] = {size, device};
      count.store(live.size(), std::memory_order_release);
    }
    report(p, static_cast<int64_t>(size), device);
  }

  // freed reports the free of ptr, if it was allocated while profiling;
  // called before the free, as the block's memory is still ptr's.
  void freed(void* p) {
    if (count.load(std::memory_order_acquire) == 0) return;
    std::pair<size_t, c10::DeviceIndex> e;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = live.find(p);
      if (it == live.end()) return;
      e = it->second;
      live.erase(it);
      count.store(live.size(), std::memory_order_release);
    }
    report(p, -static_cast<int64_t>(e.first), e.second);
  }
};
Profiled& profiled = *new Profiled();  // never destroyed, like the front

// --- reuse within a capture (torch's graph_capture_record_stream_reuse) ---
//
// A block freed during a capture while other streams used it
// (record_stream) waits for the end of the capture (caching.deferIfRecorded):
// those streams' captured work may run after the free. With PyTorch's
// graph_capture_record_stream_reuse setting it may be reused earlier, as
// PyTorch's allocator does: at the free, the terminal nodes of the capture
// graph on each stream that used it (its "free markers") are noted; a
// later allocation on the block's stream during the capture walks the
// graph back from that stream's terminal nodes, and when every marker is
// among their ancestors, all work added from there on runs after the
// block's last use, so the free completes then (Go's
// CompleteRecordedFree). The graph's topology decides: no event is queried.
class CaptureReuse {
 public:
  static bool enabled() {
    return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
  }

  // allocated notes the stream of a block allocated in a capture.
  void allocated(void* p, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(mu_);
    alloc_stream_[p] = stream;
    any_.store(true, std::memory_order_release);
  }

  void used_on(void* p, cudaStream_t stream) {
    std::lock_guard<std::mutex> g(mu_);
    used_on_[p].push_back(stream);
    any_.store(true, std::memory_order_release);
  }

  // freeing notes the free markers of p, freed during a capture after
  // record_stream; with a stream not capturing, none (the free waits for
  // the end of the capture).
  void freeing(void* p) {
    if (!any_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> g(mu_);
    auto used = used_on_.find(p);
    auto own = alloc_stream_.find(p);
    if (own == alloc_stream_.end()) {
      if (used != used_on_.end()) used_on_.erase(used);
      return;
    }
    cudaStream_t stream = own->second;
    alloc_stream_.erase(own);
    if (used == used_on_.end()) return;
    std::vector<cudaStream_t> streams = std::move(used->second);
    used_on_.erase(used);
    streams.push_back(stream);
    std::vector<cudaGraphNode_t> markers;
    for (cudaStream_t s : streams) {
      Capture c = capture_of(s);
      if (!c.capturing) return;  // waits for the end of the capture
      markers.insert(markers.end(), c.terminals, c.terminals + c.n);
    }
    deferred_[p] = Deferred{stream, std::move(markers)};
  }

  // reusable completes, in device's Go allocator, the deferred frees of
  // stream's blocks whose markers all precede the stream's terminal nodes.
  void reusable(c10::DeviceIndex device, cudaStream_t stream) {
    if (!any_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> g(mu_);
    if (deferred_.empty()) return;
    Capture c = capture_of(stream);
    if (!c.capturing || c.n == 0) return;
    std::unordered_set<cudaGraphNode_t> ancestors = walk_back(c);
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      bool done = it->second.stream == stream && !it->second.markers.empty();
      for (cudaGraphNode_t m : it->second.markers) done = done && ancestors.count(m) != 0;
      if (done) {
        (void)lib.complete_recorded_free(device, it->first);
        it = deferred_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // forget drops everything once no capture is underway: Go completes the
  // frees that waited itself.
  void forget() {
    std::lock_guard<std::mutex> g(mu_);
    alloc_stream_.clear();
    used_on_.clear();
    deferred_.clear();
    any_.store(false, std::memory_order_release);
  }

 private:
  struct Deferred {
    cudaStream_t stream;
    std::vector<cudaGraphNode_t> markers;
  };
  struct Capture {
    bool capturing = false;
    const cudaGraphNode_t* terminals = nullptr;
    size_t n = 0;
  };

  // capture_of is the capture state of stream; errors read as "not
  // capturing" (a free must not throw; it then waits for the end).
  static Capture capture_of(cudaStream_t stream) {
    Capture c;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
    cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &c.terminals, nullptr, &c.n);
#else
    cudaError_t err = cudaStreamGetCaptureInfo_v2(stream, &status, nullptr, nullptr, &c.terminals, &c.n);
#endif
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Capture{};
    }
    c.capturing = status == cudaStreamCaptureStatusActive;
    return c;
  }

  // walk_back is every node from which c's terminal nodes are reached.
  static std::unordered_set<cudaGraphNode_t> walk_back(const Capture& c) {
    std::unordered_set<cudaGraphNode_t> seen;
    std::vector<cudaGraphNode_t> todo(c.terminals, c.terminals + c.n);
    std::vector<cudaGraphNode_t> deps;
    while (!todo.empty()) {
      cudaGraphNode_t v = todo.back();
      todo.pop_back();
      if (!seen.insert(v).second) continue;
      size_t n = 0;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
      if (cudaGraphNodeGetDependencies(v, nullptr, nullptr, &n) != cudaSuccess) { (void)cudaGetLastError(); continue; }
      deps.resize(n);
      std::vector<cudaGraphEdgeData> edges(n);
      if (n > 0 && cudaGraphNodeGetDependencies(v, deps.data(), edges.data(), &n) != cudaSuccess) { (void)cudaGetLastError(); continue; }
#else
      if (cudaGraphNodeGetDependencies(v, nullptr, &n) != cudaSuccess) { (void)cudaGetLastError(); continue; }
      deps.resize(n);
      if (n > 0 && cudaGraphNodeGetDependencies(v, deps.data(), &n) != cudaSuccess) { (void)cudaGetLastError(); continue; }
#endif
      todo.insert(todo.end(), deps.begin(), deps.begin() + static_cast<std::ptrdiff_t>(n));
    }
    return seen;
  }

  std::mutex mu_;  // guards everything below
  std::atomic<bool> any_{false};
  std::unordered_map<void*, cudaStream_t> alloc_stream_;
  std::unordered_map<void*, std::vector<cudaStream_t>> used_on_;
  std::unordered_map<void*, Deferred> deferred_;
};
CaptureReuse& capture_reuse = *new CaptureReuse();  // never destroyed, like the front

// free_block frees ptr through the front, or in Go when the front does not
// take it, with its free's context while history is recorded (the front is
// off then): goalloc_free_ptr_ctx's status (0: freed).
int free_block(void* ptr) {
  if (ptr == nullptr) return 0;
  profiled.freed(ptr);
  if (front.give(ptr) || uncached.free(ptr) || own_pools.free(ptr)) return 0;
  capture_reuse.freeing(ptr);
  auto ctx = contexts.on_free(ptr);
  int device = -1;
  keeper.before_go_call();
  int st = lib.free_ptr(ptr, ctx.id, &device);
  contexts.freed(ctx, device);
  return st;
}

// A pool checkpoint: the live blocks of a private pool, as
// goalloc_pool_live_blocks lists them (address, size, requested, stream).
struct PoolState : CCA::AllocatorState {
  c10::DeviceIndex device;
  c10::MempoolId_t id;
  std::vector<ull> rows;  // 4 per block
};

constexpr int kMaxDevices = 64;  // goalloc's bound on device ordinals

class GoallocAllocator : public CCA::CUDAAllocator {
 public:
  // --- allocation: the hot path -------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    if (size == 0) {
      return {nullptr, nullptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
    }
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* p = malloc(size, device, stream);
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* p = malloc_block(size, device, stream);
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) profiled.allocated(p, size, device);
    return p;
  }

  // malloc_block is malloc but for reports to torch's profiler.
  void* malloc_block(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (!enabled_.load(std::memory_order_relaxed)) {
      c10::cuda::CUDAGuard guard(device);
      return uncached.alloc(size);
    }
    ull id0 = 0, id1 = 0;
    uint64_t s = reinterpret_cast<uintptr_t>(stream);
    bool windows = open_windows_.load(std::memory_order_acquire) > 0;
    if (windows) {
      pool_for(device, stream, &id0, &id1);
      if (id0 != 0 || id1 != 0) {
        if (auto own = own_pools.find(device, {id0, id1})) return malloc_own(*own, size, device, stream);
      }
    }
    // torch's roundup_power2_divisions (set in PYTORCH_CUDA_ALLOC_CONF or by
    // torch.cuda.memory._set_allocator_settings) rounds a request's block
    // as PyTorch's allocator does; such a block skips the front, which
    // serves exact sizes.
    size_t block = rounded_block(size);
    if (block == 0 && !windows) {
      if (void* p = front.take(device, s, size)) return p;
    }
    bool reuse = (id0 != 0 || id1 != 0) && CaptureReuse::enabled();
    if (reuse) capture_reuse.reusable(device, stream);
    auto ctx = contexts.on_malloc();  // nothing unless history is recorded
    int oom = 0;
    char* err = nullptr;
    keeper.before_go_call();
    void* p = lib.pool_malloc(size, block, device, stream, id0, id1, ctx.id, &oom, &err);
    contexts.allocated(p, device, ctx);
    if (p != nullptr && reuse) capture_reuse.allocated(p, stream);
    if (p != nullptr) {
      // A block with a context is not the front's: its free must come to
      // free_block's Go path, which ends the context, also once recording
      // stopped and the front took frees again.
      if (id0 == 0 && id1 == 0 && ctx.id == 0 && block == 0) front.track(p, device, s, size);
      return p;
    }
    std::string msg = err != nullptr ? std::string(err) : last_error();
    if (err != nullptr) lib.string_free(err);
    if (oom) {
      if (void* q = own_pools.take_on_oom(device, size, stream)) return q;
      notify_oom(device, size);
      TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    }
    TORCH_CHECK(false, msg);
  }

  // rounded_block is the block PyTorch's allocator would round a request
  // of size bytes to under torch's roundup_power2_divisions (its
  // round_size), or 0 where that setting does not round it.
  static size_t rounded_block(size_t size) {
    constexpr size_t kMinBlock = 512;
    size_t divisions = c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
    if (divisions <= 1 || size <= kMinBlock * divisions) return 0;
    if ((size & (size - 1)) == 0) return 0;  // a power of two stays
    size_t floor = size_t(1) << (63 - __builtin_clzll(size));
    size_t division = floor >> (63 - __builtin_clzll(divisions));
    if (division == 0) return floor << 1;
    size_t low = size & ~(division - 1);
    return low == size ? 0 : low + division;
  }

  // malloc_own carves a request from a pool with an allocator of its own.
  void* malloc_own(goalloc_split::Pool& pool, size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    std::string err;
    bool oom = false;
    void* p = pool.malloc(size, stream, &err, &oom);
    if (p != nullptr) return p;
    if (oom) {
      notify_oom(device, size);
      TORCH_CHECK_WITH(OutOfMemoryError, false, err);
    }
    TORCH_CHECK(false, err);
  }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override { check(free_block(ptr)); }

  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- set-up and the hooks the pluggable class had ------------------------

  void init(int device_count) override {
    lib.init(device_count);
    initialized_.store(true);
  }

  bool initialized() override { return initialized_.load(); }

  // The fraction is the library's to check ([0, 1], as PyTorch takes it;
  // 0 refuses every allocation) and to keep: the one it reports is the one
  // in force.
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(lib.set_fraction(device, fraction));
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    Json conf = parse(lib.config_json());
    const Json& set = conf["fractions"][std::to_string(device).c_str()];
    if (set.kind == Json::Number) return set.num;
    double f = conf["fraction"].num;  // GOALLOC_CONF's fraction, 0 if none
    return f > 0 ? f : 1.0;
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    // A private pool of goalloc's gives its cached memory back when its
    // last user releases it (MemPool's destructor calls releasePool, then
    // this); one with an allocator of its own gives back its wholly free
    // segments here, and the global empty_cache those of released pools.
    if (mempool_id == c10::MempoolId_t{0, 0}) {
      auto ctx = contexts.on_empty_cache();
      (void)lib.empty_cache(ctx.id);
      contexts.emptied(ctx);
      own_pools.empty_released();
      return;
    }
    for (auto& own : own_pools.with_id(mempool_id)) own->empty();
  }

  // torch.cuda.caching_allocator_enable(False): allocations go straight to
  // the driver, uncounted (Uncached above), until it is enabled again.
  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  // torch.accelerator's memory functions ask the device's allocator.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return {free, total};
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // An empty tensor has no block. A DataPtr this class did not make may
    // still be over one of its blocks: a storage shared with another
    // process, which torch's _share_cuda_ put behind a CudaIPCSentData
    // DataPtr of its own (the block's free comes when the receivers let
    // go, and must still wait for this stream). Go records it if the
    // pointer is one of its blocks, and ignores any other (a tensor
    // received from another process, another allocator's).
    if (ptr.get() == nullptr) return;
    if (ptr.get_deleter() != &raw_delete_fn) {
      front.forget(ptr.get());
      TORCH_CHECK(lib.record_stream_held(ptr.get(), stream.stream()) >= 0, last_error());
      return;
    }
    if (own_pools.record_stream(ptr.get(), stream.stream())) return;
    if (open_windows_.load(std::memory_order_acquire) > 0 && CaptureReuse::enabled())
      capture_reuse.used_on(ptr.get(), stream.stream());
    front.forget(ptr.get());  // its free goes to Go, which waits for the other stream
    lib.record_stream(ptr.get(), stream.stream());
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // goalloc has no expandable segments
  }

  // --- statistics -----------------------------------------------------------

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    long long f[kStatFigures];
    check(lib.device_stats(device, f, kStatFigures));
    // The figures in the order of goalloc.h's table: each statistic's
    // StatArray (indexed by c10's StatType, the table's pool order), each
    // Stat's values, then the counters; each field by its name.
    DeviceStats st;
    const long long* next = f;
#define GOALLOC_VALUE(value) s.value = *next++;
#define GOALLOC_ARRAY(name, ...) \
  for (auto& s : st.name) {      \
    GOALLOC_STAT_VALUES(GOALLOC_VALUE) \
  }
#define GOALLOC_COUNTER(name) st.name = *next++;
    GOALLOC_STAT_ARRAYS(GOALLOC_ARRAY)
    GOALLOC_STAT_COUNTERS(GOALLOC_COUNTER)
#undef GOALLOC_VALUE
#undef GOALLOC_ARRAY
#undef GOALLOC_COUNTER
    st.max_split_size = -1;  // PyTorch's figure when no max_split_size_mb is set
    return st;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override { check(lib.reset_accumulated(device)); }
  void resetPeakStats(c10::DeviceIndex device) override { check(lib.reset_peak(device)); }

  // cacheInfo is what cudnn.benchmark asks before trying algorithms: the
  // largest workspace the cache could hand out without going to the device.
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    long long n = lib.largest_cached(device);
    TORCH_CHECK(n >= 0, last_error());
    *largestBlock = static_cast<size_t>(n);
  }

  // --- snapshot and history ---------------------------------------------------

  // The snapshot puts the contexts back where Go names their ids
  // (goalloc_contexts.h): on live blocks, segments and trace entries.
  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    Json devices = parse(lib.snapshot_json(-1));
    CCA::SnapshotInfo info;
    contexts.with_view([&](const goalloc_contexts::Contexts<c10::GatheredContext>::View& ctx) {
      for (const Json& d : devices.items) {
        auto device = static_cast<c10::DeviceIndex>(d["device"].sint());
        for (const Json& s : d["segments"].items) {
          c10::MempoolId_t owner{s["segment_pool_id"].items.size() == 2 ? s["segment_pool_id"].items[0].uint() : 0,
                                 s["segment_pool_id"].items.size() == 2 ? s["segment_pool_id"].items[1].uint() : 0};
          if (mempool_id != c10::MempoolId_t{0, 0} && owner != mempool_id) continue;
          SegmentInfo seg;
          seg.device = device;
          seg.address = s["address"].uint();
          seg.total_size = s["total_size"].uint();
          seg.requested_size = s["requested_size"].uint();
          seg.allocated_size = s["allocated_size"].uint();
          seg.active_size = s["active_size"].uint();
          seg.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(s["stream"].uint()));
          seg.is_large = s["segment_type"].str == "large";
          seg.is_expandable = false;
          seg.owner_private_pool_id = owner;
          seg.context_when_allocated = ctx.segment(device, s["ctx"].uint());
          for (const Json& b : s["blocks"].items) {
            BlockInfo blk;
            blk.size = b["size"].uint();
            blk.requested_size = b["requested_size"].uint();
            const std::string& state = b["state"].str;
            blk.allocated = state == "active_allocated";
            blk.active = blk.allocated || state == "active_pending_free";
            if (blk.active) blk.context_when_allocated = ctx.block(b["address"].uint(), b["ctx"].uint());
            seg.blocks.push_back(std::move(blk));
          }
          info.segments.push_back(std::move(seg));
        }
        std::vector<TraceEntry> trace;
        if (include_traces) {
          for (const Json& t : d["device_traces"].items) {
            // PyTorch's compile_context when no torch.compile region runs.
            const std::string& compile = t["compile_context"].str;
            TraceEntry te(action(t["action"].str), device, t["addr"].uint(), t["size"].uint(),
                          reinterpret_cast<void*>(static_cast<uintptr_t>(t["stream"].uint())), c10::MempoolId_t{0, 0},
                          0, ctx.trace(device, t["ctx"].uint()), compile.empty() ? "N/A" : compile,
                          t["user_metadata"].str);
            te.time_.t_ = static_cast<time_t>(t["time_us"].sint());
            trace.push_back(std::move(te));
          }
        }
        info.device_traces.push_back(std::move(trace));
      }
    });
    if (include_traces) {
      std::lock_guard<std::mutex> g(mu_);
      annotations_.for_each([&](const AnnotationEntry& a) { info.external_annotations.push_back(a); });
    }
    for (auto& [key, segments] : own_pools.snapshot(mempool_id)) {
      for (const auto& v : segments) {
        SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(std::get<0>(key));
        seg.address = v.addr;
        seg.total_size = v.size;
        seg.stream = v.stream;
        seg.is_large = v.large;
        seg.is_expandable = false;
        seg.owner_private_pool_id = {std::get<1>(key), std::get<2>(key)};
        for (const auto& b : v.blocks) {
          BlockInfo blk;
          blk.size = b.size;
          blk.requested_size = b.requested;
          blk.allocated = blk.active = b.allocated;
          if (b.allocated) {
            seg.allocated_size += b.size;
            seg.active_size += b.size;
            seg.requested_size += b.requested;
          }
          seg.blocks.push_back(std::move(blk));
        }
        info.segments.push_back(std::move(seg));
      }
    }
    info.config_metadata.garbage_collection_threshold = 0;
    info.config_metadata.max_split_size = SIZE_MAX;
    info.config_metadata.pinned_num_register_threads = 0;
    info.config_metadata.expandable_segments = false;
    info.config_metadata.release_lock_on_malloc = false;
    info.config_metadata.pinned_use_host_register = false;
    info.config_metadata.graph_capture_record_stream_reuse = false;
    info.config_metadata.last_allocator_settings = "goalloc " + parse(lib.config_json())["conf"].str;
    return info;
  }

  // recordHistory: Go records the events, this class the stack traces
  // (goalloc_contexts.h) and the annotations, each in a ring of the same
  // max_entries. torch's default max_entries is sys.maxsize: keep the most
  // the library takes (its config's max_history).
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     CCA::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == CCA::RecordContext::NEVER || context_recorder != nullptr,
                "goalloc: recordHistory: recording stack traces (RecordContext ", std::to_string(static_cast<int>(when)),
                ") needs a context recorder");
    std::string skip;
    for (const std::string& a : skip_actions) {
      (void)c10::CachingDeviceAllocator::parseTraceEntryAction(a);  // torch's own error for a name it lacks
      skip += (skip.empty() ? "" : ",") + a;
    }
    int entries = 0;
    if (enabled) {
      long long most = parse(lib.config_json())["max_history"].sint();
      TORCH_CHECK(most > 0, "goalloc: the library does not say how long a history it keeps (max_history)");
      entries = static_cast<int>(std::min<size_t>(std::max<size_t>(alloc_trace_max_entries, 1), static_cast<size_t>(most)));
    }
    check(lib.record_history(entries, skip.c_str(), clear_history ? 1 : 0));
    contexts.record(enabled, context_recorder, static_cast<int>(when), static_cast<size_t>(entries), clear_history,
                    skip_actions);
    std::vector<AnnotationEntry> dropped;  // no Python in them: let go of under the lock
    std::lock_guard<std::mutex> g(mu_);
    if (!enabled || clear_history) annotations_.clear(dropped);
    if (enabled) annotations_.set_capacity(static_cast<size_t>(entries), dropped);
  }

  // recordAnnotation keeps an annotation (torch's record_function, with
  // global_record_annotations) in the snapshot's external_annotations,
  // while history is recorded.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (contexts.recording()) record_annotation(current_device(), md);
  }

  // The compile context (the torch.compile region running) and the user
  // metadata label every trace entry recorded on the device from now on;
  // Go stamps them (caching.TraceLabels). As in PyTorch, compile contexts
  // are kept only while history is recorded, the metadata always.
  void pushCompileContext(std::string& md) override {
    if (contexts.recording()) push_compile_context(current_device(), md);
  }
  void popCompileContext() override {
    if (contexts.recording()) pop_compile_context(current_device());
  }
  void setUserMetadata(const std::string& metadata) override { set_user_metadata(current_device(), metadata); }
  std::string getUserMetadata() override { return user_metadata(current_device()); }

  // The same on a device given (tests/c/cxx_class_test.cpp has no device
  // to be current).
  void record_annotation(c10::DeviceIndex device, const std::vector<std::pair<std::string, std::string>>& md) {
    AnnotationEntry ae(device, 0);
    ae.time_.t_ = static_cast<time_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count());
    for (const auto& kv : md) ae.recordUserMetadata(kv.first, kv.second);
    std::lock_guard<std::mutex> g(mu_);
    annotations_.push(std::move(ae), [](AnnotationEntry&&) {});
  }
  void push_compile_context(c10::DeviceIndex device, const std::string& md) {
    check_device(device);
    std::lock_guard<std::mutex> g(labels_mu_);
    compile_contexts_[device].push_back(md);
    set_labels(device);
  }
  void pop_compile_context(c10::DeviceIndex device) {
    check_device(device);
    std::lock_guard<std::mutex> g(labels_mu_);
    if (compile_contexts_[device].empty()) return;
    compile_contexts_[device].pop_back();
    set_labels(device);
  }
  void set_user_metadata(c10::DeviceIndex device, const std::string& metadata) {
    check_device(device);
    std::lock_guard<std::mutex> g(labels_mu_);
    user_metadata_[device] = metadata;
    set_labels(device);
  }
  std::string user_metadata(c10::DeviceIndex device) {
    check_device(device);
    std::lock_guard<std::mutex> g(labels_mu_);
    return user_metadata_[device];
  }

  // Asked of the library: goalloc.record_history() turns it on too.
  bool isHistoryEnabled() override { return parse(lib.config_json())["history"].sint() > 0; }

  // --- private pools: CUDA graphs, MemPool, use_mem_pool ---------------------
  //
  // PyTorch brackets the allocations that go to a pool with
  // beginAllocateToPool and endAllocateToPool, giving a filter that says
  // which ones: those of a stream being captured into a graph, or of one
  // thread (use_mem_pool, and the warm-up runs of torch.compile's CUDA graph
  // trees). The filter is evaluated here, and goalloc is told the pool.

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    {
      std::lock_guard<std::mutex> g(mu_);
      for (const auto& w : windows_[device])
        TORCH_CHECK(w.id != id, "goalloc: beginAllocateToPool: already allocating to pool ", pool_name(id));
      windows_[device].push_back(Window{id, std::move(filter)});
      open_windows_.fetch_add(1, std::memory_order_release);
    }
    // A pool with an allocator of its own counts the window as a user;
    // goalloc does so for its own, as PyTorch does, and knows a capture may
    // be under way (no synchronising, no freeing into the driver on a
    // capturing stream).
    if (auto own = own_pools.find(device, id)) {
      own->incref();
      return;
    }
    lib.begin_pool(device, id.first, id.second, nullptr);
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& ws = windows_[device];
      bool found = false;
      for (auto it = ws.begin(); it != ws.end(); ++it) {
        if (it->id == id) {
          ws.erase(it);
          open_windows_.fetch_sub(1, std::memory_order_release);
          found = true;
          break;
        }
      }
      TORCH_CHECK(found, "goalloc: endAllocateToPool: not allocating to pool ", pool_name(id));
    }
    if (open_windows_.load(std::memory_order_acquire) == 0) capture_reuse.forget();
    if (own_pools.find(device, id) != nullptr) return;
    lib.end_pool(device, id.first, id.second);
  }

  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    if (own_pools.find(device, id) != nullptr) {
      TORCH_CHECK(own_pools.release(device, id) >= 0, "goalloc: releasePool: pool ", pool_name(id), " has no user left");
      return;
    }
    lib.release_pool(device, id.first, id.second);
  }

  // A pool with an allocator of its own (MemPool(allocator=...)) is
  // carved here (goalloc_split.h); any other is goalloc's.
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    check_device(device);
    if ((allocator != nullptr && allocator.get() != this) || own_pools.find(device, id) != nullptr) {
      own_pools.create_or_incref(device, id, std::move(allocator));
      return;
    }
    check(lib.incref_pool(device, id.first, id.second));
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    if (auto own = own_pools.find(device, id)) return own->users();
    int n = lib.pool_use_count(device, id.first, id.second);
    TORCH_CHECK(n >= 0, last_error());
    return n;
  }

  // use_on_oom: a request goalloc refuses for lack of memory takes a free
  // block of the pool before it raises. Pools with an allocator of their
  // own can; goalloc's own pools keep whole blocks, not carved for others.
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t id, bool use_on_oom) override {
    check_device(device);
    if (own_pools.find(device, id) != nullptr) {
      own_pools.set_use_on_oom(device, id, use_on_oom);
      return;
    }
    TORCH_CHECK(!use_on_oom, "goalloc: MemPool(use_on_oom=True) is supported for a pool with an allocator of its own "
                             "(MemPool(allocator=..., use_on_oom=True)); goalloc's own pools are not carved for other "
                             "allocations");
  }

  // goalloc never splits a block of its own pools: they are no-split pools.
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    if (auto own = own_pools.find(device, id)) own->set_no_split();
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    check_device(device);
    Json live = parse(lib.pool_live_blocks(device, id.first, id.second));
    if (live.items.size() != expected_live_allocations.size()) return false;
    for (const Json& row : live.items) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(row.items.at(0).uint()));
      if (expected_live_allocations.count(p) == 0) return false;
    }
    return true;
  }

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    Json live = parse(lib.pool_live_blocks(device, id.first, id.second));
    auto st = std::make_shared<PoolState>();
    st->device = device;
    st->id = id;
    for (const Json& row : live.items)
      for (const Json& x : row.items) st->rows.push_back(x.uint());
    return st;
  }

  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> as) override {
    auto st = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(st != nullptr, "goalloc: setCheckpointPoolState with a state goalloc did not make");
    TORCH_CHECK(st->device == device, "goalloc: setCheckpointPoolState: a state of device ", std::to_string(st->device),
                " for device ", std::to_string(device));
    int n = static_cast<int>(st->rows.size() / 4);
    Json res = parse(lib.restore_pool(device, st->id.first, st->id.second, st->rows.data(), n));
    TORCH_CHECK(res["error"].str.empty(), res["error"].str);
    CCA::CheckpointDelta delta;
    for (const Json& p : res["freed"].items)
      delta.ptrs_freed.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(p.uint())));
    for (int i = 0; i < n; i++) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(st->rows[4 * i]));
      delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // --- the rest of the interface ------------------------------------------------

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker) override {
    TORCH_WARN_ONCE("goalloc does not report allocation events to trace trackers; the tracker is never called");
  }

  void* getBaseAllocation(void*, size_t*) override {
    TORCH_CHECK(false, "goalloc does not support getBaseAllocation (CUDA IPC): its memory comes from a "
                       "stream-ordered pool, which cudaIpcGetMemHandle cannot share");
  }

  // CUDA IPC (goalloc_ipc.h; Note [CUDA IPC] in arena/vmm_ipc.go). The
  // handle is torch's expandable-segment string, which a native receiver
  // opens. The share goalloc_ipc_export counts is released at once: under
  // torch the block's free already waits for every receiver (_share_cuda_
  // puts the block behind a CudaIPCSentData and its counter), and a share
  // held here would have no one to release it.
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    goalloc_ipc::Range r;
    int pid = 0;
    ull granule = 0, offset = 0;
    std::vector<int> fds(64);
    for (;;) {
      int n = lib.ipc_export(ptr, &pid, nullptr, &granule, &offset, fds.data(), static_cast<int>(fds.size()));
      TORCH_CHECK(n >= 0, "goalloc: sharing a CUDA tensor with another process: ", last_error());
      if (n <= static_cast<int>(fds.size())) {
        fds.resize(n);
        break;
      }
      fds.resize(n);  // more handles than room: ask again, nothing was counted
    }
    lib.ipc_release(ptr);
    r.pid = pid;
    r.segment_size = granule;
    r.fds.assign(fds.begin(), fds.end());
    return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), goalloc_ipc::encode(r)};
  }

  // getIpcDevPtr opens a handle on the current device, once per distinct
  // string while anything holds it (as torch's allocator does: a 'c'
  // handle cannot be opened twice in one process). 'e' is mapped by
  // goalloc (any sender's: goalloc's or native expandable segments'), 'c'
  // (a native sender's cudaMalloc segment) by cudaIpcOpenMemHandle. The
  // pointer is the mapping's base: torch adds the offset.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> g(ipc_mu_);
    auto it = ipc_open_.find(handle);
    if (it != ipc_open_.end()) {
      if (auto sp = it->second.lock()) return sp;
    }
    goalloc_ipc::Parsed h;
    std::string err;
    TORCH_CHECK(goalloc_ipc::parse(handle, &h, &err), "goalloc: cannot open ", err);
    c10::DeviceIndex device = c10::cuda::current_device();
    void* base = nullptr;
    std::function<void(void*)> close;
    if (h.type == goalloc_ipc::kTypeCudaMalloc) {
      cudaIpcMemHandle_t mh;
      std::memcpy(&mh, h.cuda_handle.data(), sizeof mh);
      C10_CUDA_CHECK(cudaIpcOpenMemHandle(&base, mh, cudaIpcMemLazyEnablePeerAccess));
      close = [device](void* p) {
        c10::cuda::CUDAGuard guard(device);
        C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(p));
      };
    } else {
      base = lib.ipc_import(device, h.range.pid, h.range.segment_size, h.range.fds.data(),
                            static_cast<int>(h.range.fds.size()));
      TORCH_CHECK(base != nullptr, "goalloc: opening a CUDA tensor of process ", std::to_string(h.range.pid), ": ",
                  last_error());
      close = [device](void* p) {
        if (lib.ipc_close(device, p) != 0) TORCH_WARN("goalloc: closing a CUDA IPC mapping: ", last_error());
      };
    }
    std::shared_ptr<void> sp(base, [this, handle, close](void* p) {
      {
        std::lock_guard<std::mutex> g2(ipc_mu_);
        auto at = ipc_open_.find(handle);
        if (at != ipc_open_.end() && at->second.expired()) ipc_open_.erase(at);
      }
      close(p);
    });
    ipc_open_[handle] = sp;
    return sp;
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  // goalloc's memory comes from a stream-ordered pool, which another device
  // reaches only if the pool grants it access (cuMemPoolSetAccess), whatever
  // the peer access between the devices; without it, cudaMemcpyAsync between
  // them failed with "invalid argument" on the H200s. cudaMemcpyPeerAsync
  // copies between devices either way, as PyTorch's cudaMallocAsync backend
  // relies on.
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool) override {
    if (dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "goalloc"; }

 private:
  struct Window {
    c10::MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };

  void check_device(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "goalloc: device ", std::to_string(device), " is outside [0, ",
                std::to_string(kMaxDevices), ")");
  }

  // pool_for finds the pool an allocation on stream goes to: the window
  // opened last whose filter takes it, as PyTorch's caching allocator
  // searches its windows, so that a use_mem_pool nested in another wins.
  void pool_for(c10::DeviceIndex device, cudaStream_t stream, ull* id0, ull* id1) {
    if (device < 0 || device >= kMaxDevices) return;  // goalloc refuses the device itself
    std::lock_guard<std::mutex> g(mu_);
    const auto& ws = windows_[device];
    for (auto w = ws.rbegin(); w != ws.rend(); ++w) {
      if (w->filter(stream)) {
        *id0 = w->id.first;
        *id1 = w->id.second;
        return;
      }
    }
  }

  void notify_oom(c10::DeviceIndex device, size_t size) {
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(mu_);
      observers = oom_observers_;
    }
    if (observers.empty()) return;
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
    for (auto& o : observers) o(device, size, total, free);
  }

  static c10::DeviceIndex current_device() {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return device;
  }

  // set_labels tells Go device's labels. Called with labels_mu_ held, so
  // that Go gets them in the order they were set.
  void set_labels(c10::DeviceIndex device) {
    const auto& stack = compile_contexts_[device];
    check(lib.set_trace_labels(device, stack.empty() ? "" : stack.back().c_str(), user_metadata_[device].c_str()));
  }

  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> open_windows_{0};
  std::mutex mu_;  // guards everything below
  std::vector<Window> windows_[kMaxDevices];
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  // The annotations of the history (recordAnnotation), as many as its
  // entries.
  goalloc_contexts::Ring<AnnotationEntry> annotations_;
  std::mutex labels_mu_;  // guards the labels below, by device
  std::vector<std::string> compile_contexts_[kMaxDevices];
  std::string user_metadata_[kMaxDevices];
  // The CUDA IPC handles open (getIpcDevPtr), by string: one mapping per
  // string while anything holds it.
  std::mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_open_;

  static TraceEntry::Action action(const std::string& s) {
    if (s == "alloc") return TraceEntry::ALLOC;
    if (s == "free_requested") return TraceEntry::FREE_REQUESTED;
    if (s == "free_completed") return TraceEntry::FREE_COMPLETED;
    if (s == "segment_alloc") return TraceEntry::SEGMENT_ALLOC;
    if (s == "segment_free") return TraceEntry::SEGMENT_FREE;
    if (s == "oom") return TraceEntry::OOM;
    return TraceEntry::SNAPSHOT;
  }
};

// The deleter of every DataPtr this class makes, and its raw_deleter():
// PyTorch's CUDA graph trees compare the two. A deleter must not throw; a
// bad free is counted and reported by goalloc.
void raw_delete_fn(void* ptr) { (void)free_block(ptr); }

#ifndef GOALLOC_TORCH_NO_MODULE
std::shared_ptr<GoallocAllocator> installed;

// install opens libgoalloc.so at path and makes goalloc torch's CUDA
// allocator. It must run before CUDA is initialised in the process.
void install(const std::string& path) {
  std::call_once(lib_once, [&] { open_library(path); });
  if (installed != nullptr) return;
  auto a = std::make_shared<GoallocAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
  // changeCurrentAllocator swaps the allocator torch's CUDA tensors use but
  // not the one registered for the device type, which torch.accelerator's
  // functions (memory_stats, memory_allocated, ...) ask: register this
  // one too, above the built-in registration's priority 0.
  c10::SetAllocator(c10::DeviceType::CUDA, a.get(), 1);
  // The library is initialised already (the package does it with torch's
  // device count); torch.accelerator asks initialized() before any call.
  a->init(c10::cuda::device_count());
  installed = a;
}

bool is_installed() { return installed != nullptr && CCA::get() == installed.get(); }

#endif  // GOALLOC_TORCH_NO_MODULE

}  // namespace goalloc_torch

#ifndef GOALLOC_TORCH_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "goalloc's C++ allocator class for PyTorch";
  m.def("install", &goalloc_torch::install, "Make goalloc (libgoalloc.so at path) torch's CUDA allocator");
  m.def("is_installed", &goalloc_torch::is_installed, "Whether goalloc's class is torch's CUDA allocator now");
  m.attr("stat_figures") = goalloc_torch::kStatFigures;
}
#endif  // GOALLOC_TORCH_NO_MODULE
