// The front of goalloc's C++ allocator class: the part that serves a freed
// block again, to the next request of its stream and size, without calling
// into Go, and hands frees to Go in batches.
//
// A call from C into Go costs tens of nanoseconds; a tensor's
// allocation and free made two of them, plus Go's own work, which put a
// torch.empty pair above PyTorch's own allocator. Every free now saves its
// own call (it reaches Go with the next call that is made anyway), and a
// request right after a free of its stream and size makes none: all of a
// torch.empty loop, but a small share of a training step, whose requests go
// to Go in between (BENCHMARKS.md, "What the front can serve").
//
// The front shares a log per device with Go (Go's caching.FrontLog, in Go
// memory that Go keeps in place): a spinlock, an enabled flag Go sets, and
// up to kLogCap entries in the order they were made.
//   - give (a free): the block's entry goes into the log, a "pending free".
//     Go applies it the next time anything takes that device's mutex, before
//     whatever that is: every request, statistic, snapshot and empty_cache
//     sees the free as if it had been made then.
//   - take (a request): a pending free of the same stream and the same
//     requested size is handed out again and marked recycled; Go counts it
//     at the drain as a free and a cache hit of that block, which moves no
//     current figure and no peak. No other block is ever handed out here.
// The front knows the blocks it may take frees of: blocks of goalloc's
// general cache that it handed out, by address, with their device, stream
// and requested size (a table with open addressing). Blocks of private
// pools (CUDA graphs, MemPool) are not in it, and record_stream takes a
// block out, so that those frees go to Go as before. Go clears enabled
// while history is recorded or a capture window is open.
//
// This header needs no torch and no CUDA: tests/c/front_test.cpp drives it
// against libgoalloc.so on the simulated device.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace goalloc_front {

constexpr int kLogCap = 64;     // caching.FrontCap
constexpr int kMaxDevices = 64;  // goalloc's bound on device ordinals

// One entry, caching.FrontEntry.
struct Entry {
  uint64_t ptr;
  uint64_t stream;
  uint64_t requested;
  uint64_t recycled;  // 1: handed out again
};

// A device's log, caching.FrontLog. lock and n are also touched by Go's
// atomics; the entries only under lock.
struct Log {
  uint32_t lock;
  uint32_t enabled;
  uint32_t n;
  uint32_t size;  // sizeof(Log) as Go laid it out
  Entry entries[kLogCap];
};
static_assert(sizeof(Log) == 16 + kLogCap * 32, "the layout of Go's caching.FrontLog");

// A spinlock on a word Go takes too (CompareAndSwap 0 -> 1, Store 0). Each
// side holds it for a few loads and stores.
inline void spin_lock(uint32_t* w) {
  for (int spins = 0;; spins++) {
    uint32_t expected = 0;
    if (__atomic_load_n(w, __ATOMIC_RELAXED) == 0 &&
        __atomic_compare_exchange_n(w, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      return;
    }
    if (spins >= 64) {
      sched_yield();
    } else {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
}

inline void spin_unlock(uint32_t* w) { __atomic_store_n(w, 0, __ATOMIC_RELEASE); }

struct SpinGuard {
  uint32_t* w;
  explicit SpinGuard(uint32_t* word) : w(word) { spin_lock(w); }
  ~SpinGuard() { spin_unlock(w); }
  SpinGuard(const SpinGuard&) = delete;
  SpinGuard& operator=(const SpinGuard&) = delete;
};

// A live block the front may take the free of.
struct Block {
  uintptr_t ptr;  // 0: an empty slot of the table
  uint64_t stream;
  uint64_t requested;
  int device;
};

// The live blocks by address: open addressing with linear probing, at most
// half full, deletion by backward shift (no tombstones), so that a lookup
// is a hash and a probe or two.
class BlockTable {
 public:
  BlockTable() : slots_(64) {}

  Block* find(uintptr_t p) {
    for (size_t i = home(p);; i = (i + 1) & mask()) {
      if (slots_[i].ptr == p) return &slots_[i];
      if (slots_[i].ptr == 0) return nullptr;
    }
  }

  // put adds b, or replaces the block at its address.
  void put(const Block& b) {
    if (2 * (used_ + 1) > slots_.size()) grow();
    size_t i = home(b.ptr);
    while (slots_[i].ptr != 0 && slots_[i].ptr != b.ptr) i = (i + 1) & mask();
    if (slots_[i].ptr == 0) used_++;
    slots_[i] = b;
  }

  // erase removes the block at e (from find), moving later blocks of its
  // probe run back so that every block stays reachable from its home.
  void erase(Block* e) {
    size_t i = static_cast<size_t>(e - slots_.data());
    for (size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].ptr == 0) break;
      size_t h = home(slots_[j].ptr);
      // slots_[j] may move to i if its home is not in (i, j] cyclically.
      bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Block{};
    used_--;
  }

  size_t size() const { return used_; }

 private:
  size_t mask() const { return slots_.size() - 1; }
  // Blocks are at least 512-byte aligned; Fibonacci hashing spreads them.
  size_t home(uintptr_t p) const {
    return static_cast<size_t>(((p >> 9) * 0x9E3779B97F4A7C15ull) >> (64 - bits_)) & mask();
  }
  void grow() {
    std::vector<Block> old(slots_.size() * 2);
    old.swap(slots_);
    bits_++;
    used_ = 0;
    for (const Block& b : old)
      if (b.ptr != 0) put(b);
  }

  std::vector<Block> slots_;  // a power of two
  int bits_ = 6;              // log2(slots_.size())
  size_t used_ = 0;
};

// The front. log_of(device) is the library's goalloc_front: the device's
// log, or NULL when it has none (GOALLOC_CONF front:false); drain(device)
// its goalloc_front_drain (which cannot fail for a device that has a log).
class Front {
 public:
  using LogOf = void* (*)(int);
  using Drain = int (*)(int);

  Front(LogOf log_of, Drain drain) : log_of_(log_of), drain_(drain) {
    for (auto& l : logs_) l.store(nullptr, std::memory_order_relaxed);
    for (auto& a : asked_) a.store(false, std::memory_order_relaxed);
  }

  // take hands out a pending free of device's stream with requested size
  // size, or returns nullptr (the request goes to Go).
  void* take(int device, uint64_t stream, uint64_t size) {
    Log* lg = known_log(device);
    if (lg == nullptr || size == 0) return nullptr;
    SpinGuard table(&table_lock_);
    uint64_t p = 0;
    {
      SpinGuard g(&lg->lock);
      if (__atomic_load_n(&lg->enabled, __ATOMIC_ACQUIRE) == 0) return nullptr;
      for (int i = static_cast<int>(__atomic_load_n(&lg->n, __ATOMIC_RELAXED)) - 1; i >= 0; i--) {
        Entry& e = lg->entries[i];
        if (e.recycled == 0 && e.stream == stream && e.requested == size) {
          e.recycled = 1;
          p = e.ptr;
          break;
        }
      }
    }
    if (p == 0) return nullptr;
    table_.put(Block{static_cast<uintptr_t>(p), stream, size, device});
    return reinterpret_cast<void*>(static_cast<uintptr_t>(p));
  }

  // track records a block Go allocated from its general cache.
  void track(void* p, int device, uint64_t stream, uint64_t size) {
    if (p == nullptr || size == 0 || log(device) == nullptr) return;
    SpinGuard table(&table_lock_);
    table_.put(Block{reinterpret_cast<uintptr_t>(p), stream, size, device});
  }

  // give writes the free of p into its device's log; a full log is
  // drained by Go first. false: p is not a block the front knows, or the
  // front is off; the caller frees it through Go.
  bool give(void* p) {
    uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    Block blk;
    {
      SpinGuard table(&table_lock_);
      Block* b = table_.find(addr);
      if (b == nullptr) return false;
      blk = *b;
      table_.erase(b);
    }
    Log* lg = logs_[blk.device].load(std::memory_order_acquire);
    for (int attempt = 0;; attempt++) {
      {
        SpinGuard g(&lg->lock);
        if (__atomic_load_n(&lg->enabled, __ATOMIC_ACQUIRE) == 0) return false;
        uint32_t n = __atomic_load_n(&lg->n, __ATOMIC_RELAXED);
        if (n < kLogCap) {
          lg->entries[n] = Entry{addr, blk.stream, blk.requested, 0};
          __atomic_store_n(&lg->n, n + 1, __ATOMIC_RELEASE);
          return true;
        }
      }
      if (attempt == 1) return false;  // filled again meanwhile by other threads
      (void)drain_(blk.device);         // a call into Go, outside every lock here
    }
  }

  // forget drops p: its free goes to Go (record_stream handed it to
  // another stream).
  void forget(void* p) {
    SpinGuard table(&table_lock_);
    if (Block* b = table_.find(reinterpret_cast<uintptr_t>(p))) table_.erase(b);
  }

  // tracked is how many live blocks the front knows (for tests).
  size_t tracked() {
    SpinGuard table(&table_lock_);
    return table_.size();
  }

 private:
  // known_log is the device's log if it was asked for already.
  Log* known_log(int device) {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return logs_[device].load(std::memory_order_acquire);
  }

  // log asks the library for the device's log once; a log of another
  // layout (a library of another version) is not used.
  Log* log(int device) {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    if (!asked_[device].load(std::memory_order_acquire)) {
      Log* lg = static_cast<Log*>(log_of_(device));
      if (lg != nullptr && lg->size != sizeof(Log)) lg = nullptr;
      logs_[device].store(lg, std::memory_order_release);
      asked_[device].store(true, std::memory_order_release);
    }
    return logs_[device].load(std::memory_order_acquire);
  }

  LogOf log_of_;
  Drain drain_;
  std::atomic<Log*> logs_[kMaxDevices];
  std::atomic<bool> asked_[kMaxDevices];
  uint32_t table_lock_ = 0;  // guards table_; taken before a log's lock
  BlockTable table_;
};

}  // namespace goalloc_front
