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

#include "goalloc_clock.h"
#include "goalloc_contexts.h"
#include "goalloc_front.h"
#include "goalloc_sched.h"

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

// The functions of libgoalloc.so this class calls (export/main.go, export/cxx.go).
struct Library {
  void* (*pool_malloc)(size_t, int, cudaStream_t, ull, ull, ull, int*, char**);
  int (*free_ptr)(void*, ull, int*);
  void (*init)(int);
  int (*empty_cache)(ull);
  int (*set_fraction)(int, double);
  void (*record_stream)(void*, cudaStream_t);
  void (*begin_pool)(int, ull, ull, void*);
  void (*end_pool)(int, ull, ull);
  void (*release_pool)(int, ull, ull);
  int (*incref_pool)(int, ull, ull);
  int (*pool_use_count)(int, ull, ull);
  char* (*pool_live_blocks)(int, ull, ull);
  char* (*restore_pool)(int, ull, ull, const ull*, int);
  int (*device_stats)(int, long long*, int);
  long long (*largest_cached)(int);
  int (*reset_peak)(int);
  int (*reset_accumulated)(int);
  char* (*snapshot_json)(int);
  char* (*config_json)(void);
  int (*record_history)(int, const char*, int);
  int (*set_trace_labels)(int, const char*, const char*);
  char* (*last_error)(void);
  void (*string_free)(char*);
  void* (*front_log)(int);
  int (*front_drain)(int);
  void (*sched_yield)();
  long long (*yield_every_ns)();
};

Library lib;
std::once_flag lib_once;

// The figures goalloc_torch_device_stats writes: DeviceStats's nine
// StatArrays of 3 x 4, then five counters.
constexpr int kStatFigures = 9 * 3 * 4 + 5;

void open_library(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(h != nullptr, "goalloc: cannot open ", path, ": ", dlerror());
  std::string missing;
  auto sym = [&](const char* name) {
    void* f = dlsym(h, name);
    if (f == nullptr) missing += std::string(" ") + name;
    return f;
  };
#define GOALLOC_SYM(field, name) lib.field = reinterpret_cast<decltype(lib.field)>(sym(name))
  GOALLOC_SYM(pool_malloc, "goalloc_pool_malloc_ctx");
  GOALLOC_SYM(free_ptr, "goalloc_free_ptr_ctx");
  GOALLOC_SYM(init, "goalloc_init");
  GOALLOC_SYM(empty_cache, "goalloc_empty_cache_ctx");
  GOALLOC_SYM(set_fraction, "goalloc_set_fraction");
  GOALLOC_SYM(record_stream, "goalloc_record_stream");
  GOALLOC_SYM(begin_pool, "goalloc_begin_allocate_to_pool");
  GOALLOC_SYM(end_pool, "goalloc_end_allocate_to_pool");
  GOALLOC_SYM(release_pool, "goalloc_release_pool");
  GOALLOC_SYM(incref_pool, "goalloc_create_or_incref_pool");
  GOALLOC_SYM(pool_use_count, "goalloc_pool_use_count");
  GOALLOC_SYM(pool_live_blocks, "goalloc_pool_live_blocks");
  GOALLOC_SYM(restore_pool, "goalloc_restore_pool");
  GOALLOC_SYM(device_stats, "goalloc_torch_device_stats");
  GOALLOC_SYM(largest_cached, "goalloc_largest_cached_block");
  GOALLOC_SYM(reset_peak, "goalloc_reset_peak_stats");
  GOALLOC_SYM(reset_accumulated, "goalloc_reset_accumulated_stats");
  GOALLOC_SYM(snapshot_json, "goalloc_snapshot_json");
  GOALLOC_SYM(config_json, "goalloc_config_json");
  GOALLOC_SYM(record_history, "goalloc_record_history_opts");
  GOALLOC_SYM(set_trace_labels, "goalloc_set_trace_labels");
  GOALLOC_SYM(last_error, "goalloc_last_error");
  GOALLOC_SYM(string_free, "goalloc_string_free");
  GOALLOC_SYM(front_log, "goalloc_front");
  GOALLOC_SYM(front_drain, "goalloc_front_drain");
  GOALLOC_SYM(sched_yield, "goalloc_sched_yield");
  GOALLOC_SYM(yield_every_ns, "goalloc_yield_every_ns");
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
    TORCH_CHECK(p < end && *p == c, "goalloc: unexpected JSON from the library (wanted '", c, "')");
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

// The call clock (goalloc_clock.h): the class's calls into Go timed where
// they are made, when asked (set_call_clock in the module below). Its probe
// is the cheapest call into Go there is. Never destroyed: frees made while
// the process exits pass through it.
void probe_go() { (void)lib.yield_every_ns(); }
goalloc_clock::CallClock<>& call_clock = *new goalloc_clock::CallClock<>(&probe_go);

// The front (goalloc_front.h): a freed block served again to the next
// request of its stream and size, and frees handed to Go in batches.
void* front_log_of(int device) { return lib.front_log(device); }
int front_drain(int device) {
  keeper.before_go_call();
  return call_clock.time(goalloc_clock::kDrain, [&] { return lib.front_drain(device); });
}
// Never destroyed: torch frees tensors it keeps in its own statics (cuBLAS
// workspaces) while the process exits, after this library's statics would
// have gone, and each of those frees asks the front first.
goalloc_front::Front& front = *new goalloc_front::Front(&front_log_of, &front_drain);

// The contexts of the memory history (goalloc_contexts.h): the stack
// traces torch's context recorder gathers, named in Go by ids. Never
// destroyed, like the front: frees made while the process exits pass
// through it.
goalloc_contexts::Contexts<c10::GatheredContext>& contexts =
    *new goalloc_contexts::Contexts<c10::GatheredContext>();

// free_block frees ptr through the front, or in Go when the front does not
// take it, with its free's context while history is recorded (the front is
// off then): goalloc_free_ptr_ctx's status (0: freed).
int free_block(void* ptr) {
  if (ptr == nullptr || front.give(ptr)) return 0;
  auto ctx = contexts.on_free(ptr);
  int device = -1;
  keeper.before_go_call();
  int st = call_clock.time(goalloc_clock::kFree, [&] { return lib.free_ptr(ptr, ctx.id, &device); });
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
    ull id0 = 0, id1 = 0;
    uint64_t s = reinterpret_cast<uintptr_t>(stream);
    if (open_windows_.load(std::memory_order_acquire) > 0) {
      pool_for(device, stream, &id0, &id1);
    } else if (void* p = front.take(device, s, size)) {
      return p;
    }
    auto ctx = contexts.on_malloc();  // nothing unless history is recorded
    int oom = 0;
    char* err = nullptr;
    keeper.before_go_call();
    void* p = call_clock.time(goalloc_clock::kMalloc,
                              [&] { return lib.pool_malloc(size, device, stream, id0, id1, ctx.id, &oom, &err); });
    contexts.allocated(p, device, ctx);
    if (p != nullptr) {
      // A block with a context is not the front's: its free must come to
      // free_block's Go path, which ends the context, also once recording
      // stopped and the front took frees again.
      if (id0 == 0 && id1 == 0 && ctx.id == 0) front.track(p, device, s, size);
      return p;
    }
    std::string msg = err != nullptr ? std::string(err) : last_error();
    if (err != nullptr) lib.string_free(err);
    if (oom) {
      notify_oom(device, size);
      TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    }
    TORCH_CHECK(false, msg);
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
    // A private pool's cached memory goes back when its last user releases
    // it (MemPool's destructor calls releasePool, then this).
    if (mempool_id == c10::MempoolId_t{0, 0}) {
      auto ctx = contexts.on_empty_cache();
      (void)lib.empty_cache(ctx.id);
      contexts.emptied(ctx);
    }
  }

  void enable(bool) override {}
  bool isEnabled() const override { return true; }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // An empty tensor has no block; a pointer another allocator made (a
    // tensor shared from another process) is not goalloc's to track.
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) return;
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
    DeviceStats st;
    c10::CachingAllocator::StatArray* arrays[] = {
        &st.allocation, &st.segment, &st.active, &st.inactive_split, &st.allocated_bytes,
        &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes, &st.requested_bytes};
    int k = 0;
    for (auto* arr : arrays) {
      for (auto& s : *arr) {
        s.current = f[k];
        s.peak = f[k + 1];
        s.allocated = f[k + 2];
        s.freed = f[k + 3];
        k += 4;
      }
    }
    st.num_alloc_retries = f[k];
    st.num_ooms = f[k + 1];
    st.num_sync_all_streams = f[k + 2];
    st.num_device_alloc = f[k + 3];
    st.num_device_free = f[k + 4];
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
                "goalloc: recordHistory: recording stack traces (RecordContext ", static_cast<int>(when),
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
        TORCH_CHECK(w.id != id, "goalloc: beginAllocateToPool: already allocating to pool (", id.first, ", ",
                    id.second, ")");
      windows_[device].push_back(Window{id, std::move(filter)});
      open_windows_.fetch_add(1, std::memory_order_release);
    }
    // goalloc counts the window as a user of the pool, as PyTorch does, and
    // knows a capture may be under way (no synchronising, no freeing into
    // the driver on a capturing stream).
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
      TORCH_CHECK(found, "goalloc: endAllocateToPool: not allocating to pool (", id.first, ", ", id.second, ")");
    }
    lib.end_pool(device, id.first, id.second);
  }

  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    lib.release_pool(device, id.first, id.second);
  }

  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "goalloc: a torch.cuda.MemPool with its own allocator is not supported while goalloc is "
                "torch's allocator; make it without one (torch.cuda.MemPool()) and goalloc serves it");
    check_device(device);
    check(lib.incref_pool(device, id.first, id.second));
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    int n = lib.pool_use_count(device, id.first, id.second);
    TORCH_CHECK(n >= 0, last_error());
    return n;
  }

  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "goalloc: MemPool(use_on_oom=True) is not supported: goalloc does not take memory "
                             "from a private pool for other allocations");
  }

  // goalloc never splits a block, so every pool is a no-split pool.
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {}

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
    TORCH_CHECK(st->device == device, "goalloc: setCheckpointPoolState: a state of device ", st->device,
                " for device ", device);
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

  CCA::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, "goalloc does not support sharing CUDA tensors between processes (CUDA IPC)");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, "goalloc does not support opening CUDA IPC handles");
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
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "goalloc: device ", static_cast<int>(device),
                " is outside [0, ", kMaxDevices, ")");
  }

  // pool_for finds the pool an allocation on stream goes to: the first
  // window whose filter takes it, as PyTorch's caching allocator does.
  void pool_for(c10::DeviceIndex device, cudaStream_t stream, ull* id0, ull* id1) {
    if (device < 0 || device >= kMaxDevices) return;  // goalloc refuses the device itself
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& w : windows_[device]) {
      if (w.filter(stream)) {
        *id0 = w.id.first;
        *id1 = w.id.second;
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
  installed = a;
}

bool is_installed() { return installed != nullptr && CCA::get() == installed.get(); }

// set_call_clock starts (1: on, 2: probing) or stops (0) the call clock.
void set_call_clock(int mode) {
  TORCH_CHECK(mode == goalloc_clock::kOff || mode == goalloc_clock::kOn || mode == goalloc_clock::kProbing,
              "goalloc: call clock mode ", mode, " is not 0 (off), 1 (on) or 2 (probing)");
  call_clock.set_mode(mode);
}

// read_call_clock: what the clock holds, by kind: {kind: (calls, ns, histogram)}.
std::map<std::string, std::tuple<uint64_t, uint64_t, std::vector<uint64_t>>> read_call_clock() {
  static const char* names[goalloc_clock::kKinds] = {"malloc", "free", "drain", "probe"};
  std::map<std::string, std::tuple<uint64_t, uint64_t, std::vector<uint64_t>>> out;
  for (int k = 0; k < goalloc_clock::kKinds; k++) {
    goalloc_clock::Reading r = call_clock.read(static_cast<goalloc_clock::Kind>(k));
    out[names[k]] = {r.calls, r.ns, std::vector<uint64_t>(r.hist, r.hist + goalloc_clock::kBuckets)};
  }
  return out;
}
#endif  // GOALLOC_TORCH_NO_MODULE

}  // namespace goalloc_torch

#ifndef GOALLOC_TORCH_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "goalloc's C++ allocator class for PyTorch";
  m.def("install", &goalloc_torch::install, "Make goalloc (libgoalloc.so at path) torch's CUDA allocator");
  m.def("is_installed", &goalloc_torch::is_installed, "Whether goalloc's class is torch's CUDA allocator now");
  m.attr("stat_figures") = goalloc_torch::kStatFigures;
  m.def("set_call_clock", &goalloc_torch::set_call_clock,
        "Start (1: on, 2: probing) or stop (0) timing the class's calls into Go (goalloc_clock.h)");
  m.def("read_call_clock", &goalloc_torch::read_call_clock,
        "The call clock's figures by kind: (calls, ns, histogram of 2^b ns buckets)");
}
#endif  // GOALLOC_TORCH_NO_MODULE
