// Pools with an allocator of their own: torch.cuda.MemPool(allocator=...),
// how NCCL buffer registration and symmetric memory get their memory.
//
// goalloc does not hold that memory: the pool's allocator gives it, a
// segment at a time, and the pool carves blocks from the segments as
// PyTorch's caching allocator carves them (c10/cuda/CUDACachingAllocator.cpp),
// because that is what the pool's users count on (how many segments, hence
// how many registrations, a pool of small tensors needs):
//
//   - a request is rounded up to kMinBlockSize; up to kSmallSize it is
//     small, above it large;
//   - a free block of the request's stream and kind, the smallest that
//     fits (lowest address on a tie), serves it; else a new segment is
//     taken: kSmallBuffer for a small request, kLargeBuffer for one under
//     kMinLargeAlloc, else the request rounded up to kRoundLarge;
//   - the block is split when what is left is at least kMinBlockSize
//     (small) or more than kSmallSize (large), unless the pool is no_split;
//   - a freed block merges with its free neighbours in the segment;
//   - empty() gives every wholly free segment back to the pool's allocator.
//
// Everything the pool holds is counted by goalloc (statistics, history,
// the cap): the Env it is given does that (goalloc_torch.cpp, over
// caching/external.go). A pool is used by one allocator class and locks
// itself; the Env is called with the pool's lock held, and must not call
// back into the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace goalloc_split {

// PyTorch's caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp).
constexpr size_t kMinBlockSize = 512;
constexpr size_t kSmallSize = size_t(1) << 20;
constexpr size_t kSmallBuffer = size_t(2) << 20;
constexpr size_t kLargeBuffer = size_t(20) << 20;
constexpr size_t kMinLargeAlloc = size_t(10) << 20;
constexpr size_t kRoundLarge = size_t(2) << 20;

struct Segment;

// A block: a run of a segment, free or handed out. prev and next are its
// neighbours in the segment, in address order; together the blocks of a
// segment tile it.
struct Block {
  uintptr_t addr = 0;
  size_t size = 0;
  size_t requested = 0;  // while allocated
  bool allocated = false;
  Block* prev = nullptr;
  Block* next = nullptr;
  Segment* seg = nullptr;
  std::vector<void*> used_on;  // streams record_stream named, while allocated
};

struct Segment {
  uintptr_t addr = 0;
  size_t size = 0;
  void* stream = nullptr;
  bool large = false;
  Block* first = nullptr;
};

// Env is what a pool asks of the world: segments from the pool's
// allocator, counted by goalloc.
struct Env {
  virtual ~Env() = default;
  // segment_alloc returns size bytes for stream, or nullptr with *err and,
  // for lack of memory (the cap, the allocator's own refusal), *oom set.
  virtual void* segment_alloc(size_t size, void* stream, bool large, std::string* err, bool* oom) = 0;
  virtual void segment_free(const Segment& seg) = 0;
  // block_counted counts a block handed out (alloc) or freed.
  virtual void block_counted(const Block& b, void* stream, bool alloc) = 0;
  // wait_for makes a freed block's memory safe to reuse after the streams
  // record_stream named for it.
  virtual void wait_for(const std::vector<void*>& streams) = 0;
};

// round_request is PyTorch's round_size without roundup_power2_divisions.
inline size_t round_request(size_t size) {
  return size < kMinBlockSize ? kMinBlockSize : (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

// segment_size is PyTorch's get_allocation_size.
inline size_t segment_size(size_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

// What snapshot() reports of one segment.
struct SegmentView {
  uintptr_t addr;
  size_t size;
  void* stream;
  bool large;
  struct BlockView {
    size_t size, requested;
    bool allocated;
  };
  std::vector<BlockView> blocks;
};

class Pool {
 public:
  explicit Pool(std::unique_ptr<Env> env) : env_(std::move(env)) {}
  ~Pool() {
    for (auto& s : segments_) free_blocks_of(s.get());
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // malloc carves size bytes for stream, taking a segment when no free
  // block fits; nullptr with *err (and *oom) when the segment cannot be had.
  void* malloc(size_t size, void* stream, std::string* err, bool* oom) {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = round_request(size);
    Block* b = best_fit(n, stream);
    if (b == nullptr) {
      b = new_segment(n, stream, err, oom);
      if (b == nullptr) return nullptr;
    }
    return hand_out(b, n, size, stream);
  }

  // take is malloc from free blocks alone (no new segment): the use_on_oom
  // fallback, for a request another pool could not serve.
  void* take(size_t size, void* stream) {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = round_request(size);
    Block* b = best_fit(n, stream);
    return b == nullptr ? nullptr : hand_out(b, n, size, stream);
  }

  // free gives back the block at ptr and says whether it was this pool's.
  // A released pool (users 0) keeps nothing: a wholly free segment goes.
  bool free(void* ptr) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == live_.end()) return false;
    Block* b = it->second;
    live_.erase(it);
    env_->block_counted(*b, b->seg->stream, false);
    if (!b->used_on.empty()) {
      env_->wait_for(b->used_on);
      b->used_on.clear();
    }
    b->allocated = false;
    b->requested = 0;
    b = merge(b);
    if (users_ == 0 && b->prev == nullptr && b->next == nullptr) {
      release_segment(b->seg);
    } else {
      free_.insert(b);
    }
    return true;
  }

  // record_stream says the block at ptr is used on stream too; false when
  // it is not a live block of this pool.
  bool record_stream(void* ptr, void* stream) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == live_.end()) return false;
    Block* b = it->second;
    if (stream != b->seg->stream) {
      for (void* s : b->used_on)
        if (s == stream) return true;
      b->used_on.push_back(stream);
    }
    return true;
  }

  bool owns(void* ptr) {
    std::lock_guard<std::mutex> g(mu_);
    return live_.count(reinterpret_cast<uintptr_t>(ptr)) != 0;
  }

  // empty gives every wholly free segment back to the pool's allocator.
  void empty() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Segment*> whole;
    for (auto& s : segments_)
      if (!s->first->allocated && s->first->next == nullptr) whole.push_back(s.get());
    for (Segment* s : whole) {
      free_.erase(s->first);
      release_segment(s);
    }
  }

  // The pool's users: MemPool objects and open use_mem_pool windows, as
  // PyTorch counts them. At 0 the pool is released: empty() runs, and
  // blocks freed later go back as their segments empty.
  void incref() {
    std::lock_guard<std::mutex> g(mu_);
    users_++;
  }
  // decref drops a user and says how many are left (-1: there was none).
  int decref() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (users_ == 0) return -1;
      if (--users_ > 0) return users_;
    }
    empty();
    return 0;
  }
  int users() {
    std::lock_guard<std::mutex> g(mu_);
    return users_;
  }
  // holds_nothing: no segment left (a released pool can then go).
  bool holds_nothing() {
    std::lock_guard<std::mutex> g(mu_);
    return segments_.empty();
  }

  void set_no_split() {
    std::lock_guard<std::mutex> g(mu_);
    no_split_ = true;
  }

  std::vector<SegmentView> snapshot() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<SegmentView> out;
    for (auto& s : segments_) {
      SegmentView v{s->addr, s->size, s->stream, s->large, {}};
      for (Block* b = s->first; b != nullptr; b = b->next) v.blocks.push_back({b->size, b->requested, b->allocated});
      out.push_back(std::move(v));
    }
    return out;
  }

  // check verifies the invariants, for tests: the blocks tile each segment,
  // no two free blocks touch, and the free set and the live map list
  // exactly the free and the allocated blocks. "" when they hold.
  std::string check() {
    std::lock_guard<std::mutex> g(mu_);
    size_t free_n = 0, live_n = 0;
    for (auto& s : segments_) {
      uintptr_t at = s->addr;
      for (Block* b = s->first; b != nullptr; b = b->next) {
        if (b->addr != at || b->seg != s.get() || (b->next != nullptr && b->next->prev != b))
          return "blocks do not tile a segment";
        if (!b->allocated && b->next != nullptr && !b->next->allocated) return "two free blocks touch";
        if (b->allocated) {
          live_n++;
          if (live_.count(b->addr) == 0) return "an allocated block is not live";
        } else {
          free_n++;
          if (free_.count(b) == 0) return "a free block is not in the free set";
        }
        at += b->size;
      }
      if (at != s->addr + s->size) return "blocks do not cover a segment";
    }
    if (free_n != free_.size() || live_n != live_.size()) return "stray entries in the free set or the live map";
    return "";
  }

 private:
  // Free blocks by stream, kind, size, address: best_fit's order.
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const {
      return std::make_tuple(reinterpret_cast<uintptr_t>(a->seg->stream), a->seg->large, a->size, a->addr) <
             std::make_tuple(reinterpret_cast<uintptr_t>(b->seg->stream), b->seg->large, b->size, b->addr);
    }
  };

  // best_fit finds and removes the smallest free block of n bytes or more
  // of stream and n's kind.
  Block* best_fit(size_t n, void* stream) {
    bool large = n > kSmallSize;
    Segment key_seg{0, 0, stream, large, nullptr};
    Block key;
    key.seg = &key_seg;
    key.size = n;
    auto it = free_.lower_bound(&key);
    if (it == free_.end() || (*it)->seg->stream != stream || (*it)->seg->large != large) return nullptr;
    Block* b = *it;
    free_.erase(it);
    return b;
  }

  // new_segment takes a segment for an n-byte request: one free block.
  Block* new_segment(size_t n, void* stream, std::string* err, bool* oom) {
    bool large = n > kSmallSize;
    size_t size = segment_size(n);
    void* p = env_->segment_alloc(size, stream, large, err, oom);
    if (p == nullptr) return nullptr;
    auto s = std::make_unique<Segment>();
    s->addr = reinterpret_cast<uintptr_t>(p);
    s->size = size;
    s->stream = stream;
    s->large = large;
    Block* b = new Block();
    b->addr = s->addr;
    b->size = size;
    b->seg = s.get();
    s->first = b;
    segments_.push_back(std::move(s));
    return b;
  }

  // hand_out splits free block b (out of the free set) to n bytes where
  // the rules allow, and hands it out for a request of requested bytes.
  void* hand_out(Block* b, size_t n, size_t requested, void* stream) {
    size_t rest = b->size - n;
    bool split = !no_split_ && (b->seg->large ? rest > kSmallSize : rest >= kMinBlockSize);
    if (split) {
      Block* r = new Block();
      r->addr = b->addr + n;
      r->size = rest;
      r->seg = b->seg;
      r->prev = b;
      r->next = b->next;
      if (b->next != nullptr) b->next->prev = r;
      b->next = r;
      b->size = n;
      free_.insert(r);
    }
    b->allocated = true;
    b->requested = requested;
    live_[b->addr] = b;
    env_->block_counted(*b, stream, true);
    return reinterpret_cast<void*>(b->addr);
  }

  // merge joins the just-freed block b with its free neighbours (taken out
  // of the free set) and returns the block that covers them.
  Block* merge(Block* b) {
    if (Block* p = b->prev; p != nullptr && !p->allocated) {
      free_.erase(p);
      p->size += b->size;
      p->next = b->next;
      if (b->next != nullptr) b->next->prev = p;
      delete b;
      b = p;
    }
    if (Block* n = b->next; n != nullptr && !n->allocated) {
      free_.erase(n);
      b->size += n->size;
      b->next = n->next;
      if (n->next != nullptr) n->next->prev = b;
      delete n;
    }
    return b;
  }

  // release_segment gives back s, whose one block is free and out of the
  // free set.
  void release_segment(Segment* s) {
    env_->segment_free(*s);
    for (auto it = segments_.begin(); it != segments_.end(); ++it) {
      if (it->get() == s) {
        free_blocks_of(s);
        segments_.erase(it);
        return;
      }
    }
  }

  static void free_blocks_of(Segment* s) {
    for (Block* b = s->first; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    s->first = nullptr;
  }

  std::unique_ptr<Env> env_;
  std::mutex mu_;  // guards everything below
  std::vector<std::unique_ptr<Segment>> segments_;
  std::set<Block*, BlockLess> free_;
  std::unordered_map<uintptr_t, Block*> live_;
  int users_ = 0;
  bool no_split_ = false;
};

}  // namespace goalloc_split
