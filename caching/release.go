package caching

import (
	"errors"

	"github.com/goalloc/goalloc/arena"
)

// Giving memory back to the device pool: one block or segment, what a miss
// or a budget releases, and everything not in use (empty_cache, the last
// round before an out-of-memory).

// releaseBlock gives the cached block id back to the pool, ordered on its
// stream.
func (a *Allocator) releaseBlock(id blockID) error {
	b := &a.blocks[id]
	if err := a.mayFree(b.list.pool, b.stream); err != nil {
		return err
	}
	if err := a.freeToPool(b.list.pool, b.addr, b.size, b.stream); err != nil {
		return err
	}
	a.uncache(id, nil)
	a.cells.sub(StatLarge, statSegment, 1)
	a.cells.sub(StatLarge, statReservedBytes, int64(b.size))
	if a.history != nil {
		a.history.add(actionSegmentFree, b.addr, b.size, b.stream, a.segmentFreeCtx(b.segCtx))
	}
	a.largeByAddr.Delete(b.addr)
	l := b.list
	p := l.pool
	p.reserved -= b.size
	*b = Block{state: blockUnused}
	a.unusedIDs = append(a.unusedIDs, id)
	l.refs--
	p.dropIfUnused(l)
	p.rule.gaveBack(a, p)
	return nil
}

// freeToPool gives n bytes at addr of cache pool p back to the memory
// stack, ordered on s. Memory of a pool asleep is out of the cap's count
// (sleep.go), which the stack's free takes it out of again: it is counted
// back first.
func (a *Allocator) freeToPool(p *cachePool, addr uintptr, n uint64, s arena.Stream) error {
	if p.asleep {
		a.limited.Resume(n, true)
	}
	err := a.mem.Free(addr, n, s)
	if err != nil && p.asleep {
		a.limited.Suspend(n)
	}
	return err
}

// segmentFreeCtx is the context id of a segment_free entry: the call's
// that gives the segment back, else the segment's own (history.go,
// "Context ids").
func (a *Allocator) segmentFreeCtx(own uint64) uint64 {
	if a.callCtx != 0 {
		return a.callCtx
	}
	return own
}

func (a *Allocator) releaseSegment(seg *Segment) error {
	if err := a.mayFree(seg.list.pool, seg.stream); err != nil {
		return err
	}
	if err := a.freeToPool(seg.list.pool, seg.addr, seg.size, seg.stream); err != nil {
		return err
	}
	l := seg.list
	cl := &l.small[seg.class]
	cl.remove(seg)
	cl.empty--
	if seg.inEmpty {
		l.pool.emptySegs.remove(seg)
	}
	a.removeSegment(seg)
	a.cells.sub(StatSmall, statSegment, 1)
	a.cells.sub(StatSmall, statReservedBytes, int64(seg.size))
	if a.history != nil {
		a.history.add(actionSegmentFree, seg.addr, seg.size, seg.stream, a.segmentFreeCtx(seg.segCtx))
	}
	l.pool.reserved -= seg.size
	l.refs--
	l.pool.dropIfUnused(l)
	l.pool.rule.gaveBack(a, l.pool)
	return nil
}

// releaseAtLeast gives p's least recently freed blocks back to the pool
// until at least n bytes went back or nothing is cached.
func (a *Allocator) releaseAtLeast(p *cachePool, n uint64) {
	var released uint64
	for released < n && p.lru.head != noBlock {
		size := a.blocks[p.lru.head].size
		if a.releaseBlock(p.lru.head) != nil {
			return
		}
		released += size
	}
}

// releaseForMiss makes room in the pool for an n-byte block on l's stream:
// it gives back the smallest cached block of l's cache pool of at least n
// bytes, which the pool's best fit will then reuse in place; with none,
// the least recently freed blocks until n bytes went back. Blocks of l's
// own stream come first: memory another stream freed reaches l's stream
// only once that free has completed, or by the pool making l's stream
// wait for it.
func (a *Allocator) releaseForMiss(l *StreamFreeList, n uint64) {
	best := a.smallestCachedAtLeast(l, n)
	if best == noBlock {
		for _, other := range l.pool.lists {
			if b := a.smallestCachedAtLeast(other, n); b != noBlock &&
				(best == noBlock || a.blocks[b].size < a.blocks[best].size) {
				best = b
			}
		}
	}
	if best != noBlock {
		_ = a.releaseBlock(best)
		return
	}
	a.releaseAtLeast(l.pool, n)
}

// smallestCachedAtLeast is the least recently freed block of the smallest
// cached size of at least n bytes on l, or noBlock.
func (a *Allocator) smallestCachedAtLeast(l *StreamFreeList, n uint64) blockID {
	for i := l.bucketIndex(n); i < len(l.buckets); i++ {
		if b := &l.buckets[i]; b.count > 0 {
			return b.list.tail
		}
	}
	return noBlock
}

// releaseCached gives the cached large blocks of the general cache and of
// the memory tags' pools back to the pool, oldest first, until at most
// keep bytes stay cached in each.
func (a *Allocator) releaseCached(keep uint64) {
	for _, p := range a.freeCaches() {
		a.releaseLRU(p, keep)
	}
}

// releaseLRU gives p's cached large blocks back to the pool, oldest first,
// until at most keep bytes stay cached.
func (a *Allocator) releaseLRU(p *cachePool, keep uint64) {
	for p.cachedLarge > keep && p.lru.head != noBlock {
		if a.releaseBlock(p.lru.head) != nil {
			return
		}
	}
}

// releaseEmptySegments gives every empty small segment of the general
// cache and of the memory tags' pools back to the pool.
func (a *Allocator) releaseEmptySegments() {
	for _, p := range a.freeCaches() {
		a.releaseEmptyOf(p)
	}
}

// releaseEmptyOf gives every empty small segment of p back to the pool.
func (a *Allocator) releaseEmptyOf(p *cachePool) {
	for seg := p.emptySegs.head; seg != nil; {
		next := seg.emptyNext
		_ = a.releaseSegment(seg) // a capturing stream keeps its segment
		seg = next
	}
}

// freeCaches is the cache pools whose free memory goes back when memory
// is reclaimed or empty_cache is called: the general cache and the memory
// tags' pools (a graph's private pool keeps its memory until released).
func (a *Allocator) freeCaches() []*cachePool {
	return append([]*cachePool{a.general}, a.tagPools()...)
}

// releaseAll gives back everything not in use: it waits for the device so
// that every deferred free completes, releases every cached block and empty
// segment, waits again so that those stream-ordered frees complete (the pool
// trims only memory whose frees have completed), and trims the pool down to
// the pre-warmed reserve.
func (a *Allocator) releaseAll() error {
	var errs []error
	if err := a.dev.Synchronize(); err != nil {
		errs = append(errs, err)
		a.pollDeferred() // a stream is broken: only what completed is safe
	} else {
		a.stats.NumSyncAllStreams++
		a.deferred.AllComplete(a.completeFree)
	}
	a.releaseCached(0)
	a.releaseEmptySegments()
	if len(errs) == 0 {
		if err := a.dev.Synchronize(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := a.mem.Trim(a.reserveBytes); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// EmptyCache is torch.cuda.empty_cache: it gives back to the pool every
// byte not in use and trims the pool down to the pre-warmed reserve
// (releaseAll). While a capture is underway it does not synchronise the
// device, which would break the capture: it gives back what it can.
func (a *Allocator) EmptyCache() error { return a.EmptyCacheCtx(0) }

// EmptyCacheCtx is EmptyCache for a call whose context id is ctx
// (history.go, "Context ids").
func (a *Allocator) EmptyCacheCtx(ctx uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.callCtx = ctx
	defer a.endCall()
	// The marker goes first, so that the entries of what empty_cache gives
	// back follow it, and the last entry of a history that ends with an
	// empty_cache is its last segment_free, as in PyTorch's.
	if a.history != nil {
		a.history.add(actionEmptyCache, 0, 0, 0, a.callCtx)
	}
	var err error
	if a.capturing() {
		a.reclaim(false)
	} else {
		err = a.releaseAll()
	}
	// Forget the streams that hold nothing now: a stream's record costs
	// host memory, and operations that look at every stream time.
	for _, p := range a.freeCaches() {
		p.dropAllUnused()
	}
	for _, p := range a.private {
		p.dropAllUnused()
	}
	return err
}
