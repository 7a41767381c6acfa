// The contexts of goalloc's C++ allocator class: where PyTorch's memory
// history says an allocation or a free came from (the stack traces of
// torch.cuda.memory._record_memory_history), kept in C++ and named in Go
// by an id.
//
// The history itself lives in Go (caching/history.go): Go records every
// event and keeps, with each entry, live block and segment, the opaque
// 64-bit context id of the call that made it ("Context ids" there). A
// GatheredContext is a C++ object (a Python traceback), so this class
// keeps what the ids stand for, and the snapshot puts the objects back
// where Go names the ids. Id 0 is none; ids are never reused.
//
// What is gathered, as in PyTorch's caching allocator (the level is c10's
// RecordContext: NEVER < STATE < ALLOC < ALL):
//   - every allocation, from STATE up: the block's context, kept while the
//     block is live (BlockInfo::context_when_allocated). A segment's
//     context_when_allocated is that of the allocation that took it from
//     the pool, found while that block lives or its context is in the ring
//     below (PyTorch keeps it as long as the segment);
//   - from ALLOC up, the same context is the alloc entry's (and that of
//     the segment_alloc or oom entry of the same call), and a free's
//     entries carry the allocation's context;
//   - at ALL, a free and an empty_cache gather their own.
// Below ALLOC no trace entry shows a context, whatever Go names: an entry's
// id is looked up among the trace contexts only.
//
// Memory stays bounded. A block's context is kept until the block is freed
// (erased at the free, whatever the level: blocks allocated while history
// was recorded keep theirs after it stops, as in PyTorch). The contexts of
// trace entries are kept in a ring per device, no larger than the
// history's max_entries, which is what Go's ring per device holds: a call
// puts its context in the ring of its device together with the entry it
// always writes (alloc for an allocation, free_requested or free_completed
// for a free, the empty_cache marker or segment_free for an empty_cache)
// and not when skip_actions drops that entry, so every context in a ring
// came with at least one entry of its device's history, written in the
// same call; the contexts of the newest max_entries entries are therefore
// among the newest max_entries in the ring, and older ones go. An entry
// shows no stack, though its call had one, in two cases: a free_completed
// that waited for another stream (record_stream) and completed after
// max_entries newer contexts were filed; and, with skip_actions, an entry
// of a call whose always-written entry is skipped (an allocation's
// segment_alloc when alloc is skipped), whose context is not filed. A call
// that writes no entry at all (a request refused as bad input) files its
// context all the same, which only makes older ones go sooner.
//
// Cost while nothing is recorded: on_malloc and on_free read one atomic
// each, and take no lock.
//
// No context is destroyed under this class's lock: the last reference to
// a Python traceback may take the GIL to let its frames go, and a thread
// holding the GIL may be waiting for the lock (every allocation from
// Python takes it). What a call drops is moved out and let go after the
// lock.
//
// This header needs no torch: the context type is a parameter.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace goalloc_contexts {

constexpr int kMaxDevices = 64;  // goalloc's bound on device ordinals

// The levels of c10's RecordContext, in its order.
enum Level : int { kNever = 0, kState = 1, kAlloc = 2, kAll = 3 };

// Ring holds the newest capacity() items pushed, oldest first. Its storage
// grows as items arrive, up to the capacity.
template <class T>
class Ring {
 public:
  size_t capacity() const { return cap_; }
  size_t size() const { return items_.size(); }

  // set_capacity keeps the newest min(size(), n) items; the others are
  // moved to dropped.
  void set_capacity(size_t n, std::vector<T>& dropped) {
    if (n == cap_) return;
    std::vector<T> all;
    all.reserve(items_.size());
    for_each([&](const T& v) { all.push_back(v); });
    size_t drop = all.size() > n ? all.size() - n : 0;
    for (size_t i = 0; i < drop; i++) dropped.push_back(std::move(all[i]));
    items_.assign(std::make_move_iterator(all.begin() + drop), std::make_move_iterator(all.end()));
    next_ = items_.size() == n ? 0 : items_.size();
    cap_ = n;
  }

  // push adds v; the oldest item, when it makes room for v, goes to
  // drop(T&&) for the caller to let go of.
  template <class Drop>
  void push(T v, Drop drop) {
    if (cap_ == 0) return;
    if (items_.size() < cap_) {
      items_.push_back(std::move(v));
      next_ = items_.size() == cap_ ? 0 : items_.size();
      return;
    }
    drop(std::move(items_[next_]));
    items_[next_] = std::move(v);
    next_ = next_ + 1 == cap_ ? 0 : next_ + 1;
  }

  // clear moves every item to dropped.
  void clear(std::vector<T>& dropped) {
    for (T& v : items_) dropped.push_back(std::move(v));
    items_.clear();
    next_ = 0;
  }

  // for_each calls f on every item, oldest first.
  template <class F>
  void for_each(F f) const {
    if (items_.size() < cap_) {
      for (const T& v : items_) f(v);
      return;
    }
    for (size_t i = 0; i < items_.size(); i++) f(items_[(next_ + i) % items_.size()]);
  }

 private:
  // Invariant: items_.size() <= cap_; once full, items_[next_] is the
  // oldest.
  std::vector<T> items_;
  size_t next_ = 0;
  size_t cap_ = 0;
};

template <class Ctx>
class Contexts {
 public:
  using Gather = std::shared_ptr<Ctx> (*)();

  // A call's context: id 0 for none. traced: the context goes into its
  // device's ring when the call is done.
  struct Call {
    uint64_t id = 0;
    std::shared_ptr<Ctx> ctx;
    bool traced = false;
    bool recording = false;
  };

  // record is recordHistory: level is c10's RecordContext, entries the
  // history's max_entries (its ring per device), skip the actions not
  // recorded. A gather function is needed from STATE up (the caller
  // checks). Off, or clear, drops the trace contexts; the contexts of live
  // blocks stay until they are freed.
  void record(bool enabled, Gather gather, int level, size_t entries, bool clear,
              const std::vector<std::string>& skip) {
    std::vector<Entry> dropped;
    std::lock_guard<std::mutex> g(mu_);
    recording_.store(enabled, std::memory_order_relaxed);
    gather_ = enabled ? gather : nullptr;
    level_ = enabled && gather != nullptr ? level : kNever;
    auto skipped = [&](const char* name) {
      for (const auto& s : skip)
        if (s == name) return true;
      return false;
    };
    trace_alloc_ = !skipped("alloc");
    trace_free_ = !skipped("free_requested") || !skipped("free_completed");
    trace_empty_ = !skipped("snapshot") || !skipped("segment_free");
    for (auto& r : rings_) {
      if (!enabled || clear) r.clear(dropped);
      if (enabled) r.set_capacity(entries, dropped);
    }
    publish();
  }

  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  // on_malloc gathers the context of an allocation, before the call into
  // Go (the gather function runs Python; no lock is held). It may throw
  // what the gather function throws.
  Call on_malloc() {
    Call c;
    if (!recording()) return c;
    Gather gather;
    {
      std::lock_guard<std::mutex> g(mu_);
      c.recording = recording_.load(std::memory_order_relaxed);
      if (level_ < kState || gather_ == nullptr) return c;
      gather = gather_;
      c.traced = level_ >= kAlloc && trace_alloc_;
    }
    c.ctx = gather();
    c.id = next_id_.fetch_add(1, std::memory_order_relaxed) + 1;
    return c;
  }

  // allocated files c after the call into Go: p is the block (nullptr when
  // the request was refused: an oom entry may carry the context all the
  // same). A context that cannot be filed (no memory) is dropped.
  void allocated(void* p, int device, const Call& c) noexcept {
    if (!c.recording || device < 0 || device >= kMaxDevices) return;
    seen_.fetch_or(uint64_t(1) << device, std::memory_order_relaxed);
    if (c.id == 0) return;
    Entry old, evicted;
    try {
      std::lock_guard<std::mutex> g(mu_);
      if (p != nullptr) {
        Entry& e = live_[reinterpret_cast<uintptr_t>(p)];
        old = std::move(e);  // none, unless a free of p never came here
        e = Entry{c.id, c.ctx};
      }
      if (c.traced) rings_[device].push(Entry{c.id, c.ctx}, [&](Entry&& o) { evicted = std::move(o); });
      publish();
    } catch (...) {
    }
  }

  // on_free ends the life of p's context and gives the context of its
  // free: at ALL, one gathered now; at ALLOC, the allocation's. A deleter
  // must not throw: a gather that fails gives none.
  Call on_free(void* p) noexcept {
    Call c;
    if (!active_.load(std::memory_order_acquire)) return c;
    Entry e;  // p's context, let go of (if not passed on) after the lock
    Gather gather = nullptr;
    int level = kNever;
    try {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(p));
      if (it != live_.end()) {
        e = std::move(it->second);
        live_.erase(it);
        publish();
      }
      if (!recording_.load(std::memory_order_relaxed) || !trace_free_) return c;
      gather = gather_;
      level = level_;
    } catch (...) {
      return c;
    }
    c.traced = true;
    if (level == kAll) {
      try {
        c.ctx = gather();
      } catch (...) {
        return Call{};
      }
      c.id = next_id_.fetch_add(1, std::memory_order_relaxed) + 1;
    } else if (level == kAlloc && e.id != 0) {
      c.id = e.id;
      c.ctx = std::move(e.ctx);
    }
    return c;
  }

  // freed files c in the ring of device, where Go recorded the free (-1:
  // nothing was freed).
  void freed(const Call& c, int device) noexcept {
    if (c.id == 0 || !c.traced || device < 0 || device >= kMaxDevices) return;
    Entry evicted;
    try {
      std::lock_guard<std::mutex> g(mu_);
      rings_[device].push(Entry{c.id, c.ctx}, [&](Entry&& o) { evicted = std::move(o); });
    } catch (...) {
    }
  }

  // on_empty_cache gathers the context of an empty_cache, at ALL. It may
  // throw what the gather function throws.
  Call on_empty_cache() {
    Call c;
    if (!recording()) return c;
    Gather gather;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (level_ < kAll || gather_ == nullptr || !trace_empty_) return c;
      gather = gather_;
    }
    c.ctx = gather();
    c.id = next_id_.fetch_add(1, std::memory_order_relaxed) + 1;
    c.traced = true;
    return c;
  }

  // emptied files c in the ring of every device an allocation was filed
  // for: empty_cache writes entries on each.
  void emptied(const Call& c) noexcept {
    if (c.id == 0) return;
    uint64_t seen = seen_.load(std::memory_order_relaxed);
    std::vector<Entry> evicted;
    try {
      evicted.reserve(kMaxDevices);
      std::lock_guard<std::mutex> g(mu_);
      for (int d = 0; d < kMaxDevices; d++)
        if (seen & (uint64_t(1) << d))
          rings_[d].push(Entry{c.id, c.ctx}, [&](Entry&& o) { evicted.push_back(std::move(o)); });
    } catch (...) {
    }
  }

  // View answers the snapshot's lookups, under the lock (with_view).
  class View {
   public:
    // block is the context of the live block at addr, if Go names it by
    // the same id (an id of an earlier block at that address is not it).
    std::shared_ptr<Ctx> block(uintptr_t addr, uint64_t id) const {
      if (id == 0) return nullptr;
      auto it = t_.live_.find(addr);
      return it != t_.live_.end() && it->second.id == id ? it->second.ctx : nullptr;
    }

    // segment is the context of the call that took a segment of device
    // from the pool: a live block's, or a trace context.
    std::shared_ptr<Ctx> segment(int device, uint64_t id) const {
      if (id == 0) return nullptr;
      if (live_ids_.empty() && !t_.live_.empty())
        for (const auto& kv : t_.live_) live_ids_[kv.second.id] = kv.second.ctx;
      auto it = live_ids_.find(id);
      return it != live_ids_.end() ? it->second : trace(device, id);
    }

    // trace is the context of a trace entry of device.
    std::shared_ptr<Ctx> trace(int device, uint64_t id) const {
      if (id == 0 || device < 0 || device >= kMaxDevices) return nullptr;
      auto& index = ring_ids_[device];
      if (index.empty() && t_.rings_[device].size() > 0)
        t_.rings_[device].for_each([&](const Entry& e) { index[e.id] = e.ctx; });
      auto it = index.find(id);
      return it != index.end() ? it->second : nullptr;
    }

   private:
    friend class Contexts;
    explicit View(const Contexts& t) : t_(t) {}
    const Contexts& t_;
    mutable std::unordered_map<uint64_t, std::shared_ptr<Ctx>> live_ids_;
    mutable std::unordered_map<uint64_t, std::shared_ptr<Ctx>> ring_ids_[kMaxDevices];
  };

  // with_view calls f(view) with the lock held; f must not call back.
  template <class F>
  auto with_view(F f) const {
    std::lock_guard<std::mutex> g(mu_);
    View v(*this);
    return f(v);
  }

  // For tests: the trace contexts kept for device, and the live ones.
  size_t traced(int device) const {
    std::lock_guard<std::mutex> g(mu_);
    return device >= 0 && device < kMaxDevices ? rings_[device].size() : 0;
  }
  size_t live() const {
    std::lock_guard<std::mutex> g(mu_);
    return live_.size();
  }

 private:
  struct Entry {
    uint64_t id = 0;
    std::shared_ptr<Ctx> ctx;
  };

  // publish says whether a free may have something to do: history is
  // recorded, or a block still has its context. Called with mu_ held.
  void publish() { active_.store(recording_.load(std::memory_order_relaxed) || !live_.empty(), std::memory_order_release); }

  std::atomic<bool> recording_{false};
  std::atomic<bool> active_{false};
  std::atomic<uint64_t> next_id_{0};
  std::atomic<uint64_t> seen_{0};  // devices an allocation was filed for, a bit each
  mutable std::mutex mu_;          // guards everything below
  Gather gather_ = nullptr;
  int level_ = kNever;
  bool trace_alloc_ = true, trace_free_ = true, trace_empty_ = true;
  std::unordered_map<uintptr_t, Entry> live_;  // by address
  Ring<Entry> rings_[kMaxDevices];
};

}  // namespace goalloc_contexts
