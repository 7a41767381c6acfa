package caching

import (
	"math"

	"github.com/goalloc/goalloc/arena"
)

// Retention: what a cache pool keeps of the memory freed into it.
//
// Every cache pool, the general cache and each private pool of CUDA graph
// captures, goes through the same malloc, free and release paths (small.go,
// large.go, release.go). What differs is the pool's retention rule:
//
//   - The general cache (generalRetention) keeps cached large blocks within
//     Config.LargeCache, the least recently freed going back first; keeps
//     one empty small segment per stream and class, within
//     emptySegmentBudget of what the device holds for them over all
//     streams; and lets a large miss give back the cached block the device
//     pool will reuse in place (Config.MissRelease). See doc.go, "Cache
//     policy".
//   - A graph's private pool (graphRetention) keeps everything until torch
//     releases it, since the graph's replays use exactly the addresses the
//     capture saw; once released, it keeps nothing. Its memory is taken
//     outside the capture, and its frees never wait for other streams.
//
// A rule has two halves. Its limits are numbers, copied into the pool's
// retained record, that the free path compares inline: the cache-hit pair
// (a free that caches a block or empties a segment, then a malloc that
// takes it back) pays one comparison and no call, as it did when the free
// path told the two kinds of pool apart by testing the pool. Its actions
// are the methods of retention, called only off that pair: once a limit is
// passed, on a miss, when the pool takes or gives back memory. (Making the
// cached and uncached steps themselves interface calls would put two
// dynamic calls on the hit pair.)

// retention is a cache pool's rule for the memory freed into it: its
// limits, and what happens past them.
type retention interface {
	// limits is what the pool may keep now.
	limits() limits
	// overLarge is called when the large block id went into p's cache and
	// p's cached large bytes passed maxCachedLarge.
	overLarge(a *Allocator, p *cachePool, id blockID)
	// overEmpty is called when the small segment seg of p became empty and
	// p holds more empty segments of seg's stream and class (cl.empty) than
	// maxEmptyPerClass, or the device holds more for p's empty segments
	// than maxEmptyBytes.
	overEmpty(a *Allocator, p *cachePool, seg *Segment, cl *segmentList)
	// beforeMiss is called when a large request of n bytes on l found
	// nothing cached, before the pool asks the memory stack: what the miss
	// may give back first.
	beforeMiss(a *Allocator, l *StreamFreeList, n uint64)
	// alloc takes n bytes for the pool from mem, for work on stream s.
	alloc(mem arena.MemorySource, n uint64, s arena.Stream) (uintptr, error)
	// gaveBack is called after a block or segment of p went back to the
	// device pool.
	gaveBack(a *Allocator, p *cachePool)
}

// limits bound what a cache pool keeps of freed memory.
type limits struct {
	maxCachedLarge   uint64 // bytes of cached large blocks
	maxEmptyPerClass int    // empty small segments of one stream and class
	maxEmptyBytes    uint64 // what the device holds for empty small segments, all streams (emptySegments.held)
}

// retained is what a cache pool keeps of the memory freed into it, with
// the limits of its rule: the free path updates and checks it inline. The
// general cache's is the Allocator's own (reclaiming memory on out of
// memory and empty_cache walks it); a private pool has its own.
type retained struct {
	limits
	// lru lists the pool's cached large blocks, least recently freed first.
	lru blockList
	// cachedLarge is the bytes of those blocks. Invariant: it equals the
	// sum of the sizes of the pool's blocks in state blockCached.
	cachedLarge uint64
	// emptySegs lists the pool's empty small segments, least recently
	// emptied first. Invariant: a segment is on it exactly when it has no
	// used slot and has held one (a new segment is taken at once).
	emptySegs emptySegments
}

func newRetained() *retained { return &retained{lru: emptyList()} }

// generalRetention is the general cache's rule (see retention).
type generalRetention struct {
	largeCache  uint64 // Config.LargeCache
	missRelease bool   // Config.MissRelease
	// perStream is the least the device holds for a stream that holds
	// anything (emptySegments.perStream).
	perStream uint64
}

// limits bound the empty segments by what the device holds for them
// (emptySegments.held): on a device whose streams share no handle, a
// stream's kept segments hold a handle at least, so emptySegmentBudget
// keeps them for fewer streams. It admits one stream's handle at least:
// below that no stream, not even the one at work, could keep an empty
// segment, and each would go back to the device as it empties.
func (r generalRetention) limits() limits {
	return limits{maxCachedLarge: r.largeCache, maxEmptyPerClass: 1, maxEmptyBytes: max(emptySegmentBudget, r.perStream)}
}

// overLarge gives back the least recently freed blocks until the cache is
// within its budget.
func (generalRetention) overLarge(a *Allocator, p *cachePool, _ blockID) {
	for p.cachedLarge > p.maxCachedLarge && p.lru.head != noBlock {
		if a.releaseBlock(p.lru.head) != nil {
			break
		}
	}
}

// overEmpty keeps one empty segment per stream and class as a buffer
// against churn, within its budget over all streams (the oldest go
// first: their streams may be gone), and gives the others back to the
// pool, where any size can use them.
func (generalRetention) overEmpty(a *Allocator, p *cachePool, seg *Segment, cl *segmentList) {
	if cl.empty > p.maxEmptyPerClass {
		_ = a.releaseSegment(seg)
	}
	for p.emptySegs.held > p.maxEmptyBytes {
		if a.releaseSegment(p.emptySegs.head) != nil {
			break
		}
	}
}

func (r generalRetention) beforeMiss(a *Allocator, l *StreamFreeList, n uint64) {
	if r.missRelease {
		a.releaseForMiss(l, n)
	}
}

func (generalRetention) alloc(mem arena.MemorySource, n uint64, s arena.Stream) (uintptr, error) {
	return mem.Alloc(n, s)
}

func (generalRetention) gaveBack(*Allocator, *cachePool) {}

// emptySegmentBudget bounds what the device holds for the empty small
// segments the general cache keeps (emptySegments.held). They are a buffer
// against churn, one per stream and class (24 classes of 256-448 KiB: at
// most 6.6 MiB for a stream using all of them), so a few active streams
// fit; memory kept for streams that are gone goes back to the pool, oldest
// first, instead of growing with the number of streams ever seen. Where
// streams share no physical handle (the VMM backend), the device holds a
// handle at least for a stream that keeps anything, so a stream's kept
// segments count a handle at least: counted by their bytes alone, the
// budget kept a 256 KiB segment for each of 128 idle streams, and the
// device held a handle for each. A single stream's count is the same
// either way while its segments fill less than the budget, so it keeps
// what it kept. The budget is its own, apart from
// Config.LargeCache, so that large_cache keeps meaning what every figure
// measured with it meant.
const emptySegmentBudget = 32 << 20

// graphRetention is the rule of a private pool of CUDA graph captures
// (see retention): no limit until the pool is released, then nothing kept.
type graphRetention struct{ pool *cachePool }

// keepAll and keepNothing are a private pool's limits before and after
// torch releases it.
var (
	keepAll     = limits{maxCachedLarge: math.MaxUint64, maxEmptyPerClass: math.MaxInt, maxEmptyBytes: math.MaxUint64}
	keepNothing = limits{}
)

func (r graphRetention) limits() limits {
	if r.pool.released {
		return keepNothing
	}
	return keepAll
}

// overLarge, reached only once the pool is released, gives the block back.
func (graphRetention) overLarge(a *Allocator, _ *cachePool, id blockID) { _ = a.releaseBlock(id) }

// overEmpty, reached only once the pool is released, gives the segment back.
func (graphRetention) overEmpty(a *Allocator, _ *cachePool, seg *Segment, _ *segmentList) {
	_ = a.releaseSegment(seg)
}

// beforeMiss gives nothing back: nothing of a private pool may go before
// the pool is released, and nothing is cached after.
func (graphRetention) beforeMiss(*Allocator, *StreamFreeList, uint64) {}

// alloc takes the memory outside the capture, so that the graph gets no
// allocation node: the pool, not the graph, owns the memory.
func (graphRetention) alloc(mem arena.MemorySource, n uint64, _ arena.Stream) (uintptr, error) {
	return mem.AllocUncaptured(n)
}

// gaveBack forgets the pool once it is released and holds nothing.
func (graphRetention) gaveBack(a *Allocator, p *cachePool) { a.dropIfEmpty(p) }
