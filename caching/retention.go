package caching

// Retention: what a cache pool keeps of the memory freed into it.
//
// Every cache pool (the general cache, and each private pool of CUDA graph
// captures) goes through the same paths for malloc, free and release; where
// the two kinds of pool differ, the path asks the pool's rule. The general
// cache keeps within budgets and gives memory back on misses
// (generalRetention); a graph's private pool keeps everything until torch
// releases it, then gives back what is free at once and the rest as it is
// freed (graphRetention).
type retention interface {
	// blockCached is called when the large block id went into its
	// stream's cache.
	blockCached(a *Allocator, id blockID)
	// blockUncached is called when the cached block id leaves the cache,
	// handed out again or given back to the device pool.
	blockUncached(a *Allocator, id blockID)
	// segmentEmptied is called when the last slot of the small segment seg
	// was freed; cl is its class's list.
	segmentEmptied(a *Allocator, seg *Segment, cl *segmentList)
	// beforeMiss is called when a large request of n bytes on l found
	// nothing cached and is about to ask the device.
	beforeMiss(a *Allocator, l *StreamFreeList, n uint64)
	// alloc takes n bytes from the device for l.
	alloc(a *Allocator, n uint64, l *StreamFreeList) (uintptr, error)
	// defersFrees says whether the free of a block that other streams used
	// (record_stream) waits for their work.
	defersFrees() bool
}

// generalRetention is the general cache's rule: cached large blocks are
// kept, least recently freed first out, within Config.LargeCache; a miss
// gives back what lets the device pool serve it (Config.MissRelease); one
// empty small segment per stream and class is kept against churn, within
// emptySegmentBudget over all streams. The Allocator embeds it: its fields
// are the general cache's, and reclaiming memory (out of memory,
// empty_cache) walks them.
type generalRetention struct {
	// lru lists every cached large block of the general cache, least
	// recently freed first.
	lru blockList
	// cachedLarge is the bytes of those blocks. Invariant: it equals the sum
	// of the sizes of the general cache's blocks in state blockCached.
	cachedLarge uint64
	// emptySegs lists the empty segments the general cache keeps against
	// churn, oldest first.
	emptySegs emptySegments
}

func (g *generalRetention) blockCached(a *Allocator, id blockID) {
	a.pushBack(&g.lru, id, lruLinks)
	g.cachedLarge += a.blocks[id].size
	for g.cachedLarge > a.cfg.LargeCache && g.lru.head != noBlock {
		if a.releaseBlock(g.lru.head) != nil {
			break
		}
	}
}

func (g *generalRetention) blockUncached(a *Allocator, id blockID) {
	a.unlink(&g.lru, id, lruLinks)
	g.cachedLarge -= a.blocks[id].size
}

// segmentEmptied keeps one empty segment per stream and class as a buffer
// against churn, within emptySegmentBudget over all streams (the oldest go
// first: their streams may be gone), and gives the others back to the
// pool, where any size can use them.
func (g *generalRetention) segmentEmptied(a *Allocator, seg *Segment, cl *segmentList) {
	g.emptySegs.pushBack(seg)
	if cl.empty > 1 {
		_ = a.releaseSegment(seg)
	}
	for g.emptySegs.bytes > emptySegmentBudget {
		if a.releaseSegment(g.emptySegs.head) != nil {
			break
		}
	}
}

func (g *generalRetention) beforeMiss(a *Allocator, l *StreamFreeList, n uint64) {
	if a.cfg.MissRelease {
		a.releaseForMiss(l, n)
	}
}

func (g *generalRetention) alloc(a *Allocator, n uint64, l *StreamFreeList) (uintptr, error) {
	return a.mem.Alloc(n, l.stream)
}

func (g *generalRetention) defersFrees() bool { return true }

// emptySegmentBudget bounds the bytes of empty small segments the general
// cache keeps. They are a buffer against churn, one per stream and class
// (24 classes of 256-448 KiB: at most 6.6 MiB for a stream using all of
// them), so a few active streams fit; memory kept for streams that are
// gone goes back to the pool, oldest first, instead of growing with the
// number of streams ever seen. The budget is its own, apart from
// Config.LargeCache, so that large_cache keeps meaning what every figure
// measured with it meant.
const emptySegmentBudget = 32 << 20

// graphRetention is a private pool's rule: everything freed into the pool
// stays there, out of the general cache's budgets, until the pool is
// released (the graph's replays use exactly the addresses the capture
// saw); after that, memory goes back to the device pool as it is freed.
// Its memory comes from the device outside the capture, so the graph gets
// no allocation node, and its frees never wait for other streams' events:
// the graph's own order protects its blocks, which only replays of the
// same captures reuse, in the captured order.
type graphRetention struct{ pool *cachePool }

func (r graphRetention) blockCached(a *Allocator, id blockID) {
	if r.pool.released {
		_ = a.releaseBlock(id)
	}
}

func (r graphRetention) blockUncached(*Allocator, blockID) {}

func (r graphRetention) segmentEmptied(a *Allocator, seg *Segment, _ *segmentList) {
	if r.pool.released {
		_ = a.releaseSegment(seg)
	}
}

func (r graphRetention) beforeMiss(*Allocator, *StreamFreeList, uint64) {}

func (r graphRetention) alloc(a *Allocator, n uint64, _ *StreamFreeList) (uintptr, error) {
	return a.mem.AllocUncaptured(n)
}

func (r graphRetention) defersFrees() bool { return false }

// newPrivatePool makes the private pool id, empty.
func newPrivatePool(id PoolID) *cachePool {
	p := &cachePool{id: id}
	p.rule = graphRetention{pool: p}
	return p
}
