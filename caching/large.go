package caching

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// Large requests (> smallMax): whole blocks, cached by exact size on their
// owner stream. Taking a cached block, allocating a new one on a miss, and
// putting a freed block into (and out of) the cache.

// findCached returns a cached block of s for an n-byte request, the
// smallest one of at least n bytes and at most n plus the configured slack,
// and its bucket.
func (a *Allocator) findCached(l *StreamFreeList, n uint64) (blockID, *sizeBucket) {
	most := n + uint64(float64(n)*a.cfg.LargeSlack)
	for i := l.bucketIndex(n); i < len(l.buckets) && l.buckets[i].size <= most; i++ {
		if b := &l.buckets[i]; b.count > 0 {
			return b.list.head, b
		}
	}
	return noBlock, nil
}

// takeBlock hands out the cached block id, which is in bucket.
func (a *Allocator) takeBlock(id blockID, bucket *sizeBucket, size uint64) uintptr {
	b := &a.blocks[id]
	a.uncache(id, bucket)
	b.state = blockLive
	b.requested = size
	b.ctx = a.callCtx
	a.countAlloc(StatLarge, int64(b.size), size)
	if a.history != nil {
		a.history.add(actionAlloc, b.addr, size, b.stream, a.callCtx)
	}
	return b.addr
}

func (a *Allocator) mallocLargeSlow(l *StreamFreeList, n, size uint64) (uintptr, error) {
	a.cells.miss()
	if a.pollDeferred() > 0 {
		if id, bucket := a.findCached(l, n); id != noBlock {
			return a.takeBlock(id, bucket, size), nil
		}
	}
	l.pruneBuckets()
	l.pool.rule.beforeMiss(a, l, n)
	p, err := a.poolAlloc(n, l, size)
	if err != nil {
		return 0, err
	}
	id := a.newBlock()
	b := &a.blocks[id]
	*b = Block{addr: p, size: n, requested: size, stream: l.stream, list: l, state: blockLive,
		ctx: a.callCtx, segCtx: a.callCtx,
		sizePrev: noBlock, sizeNext: noBlock, lruPrev: noBlock, lruNext: noBlock}
	a.largeByAddr.Put(p, id)
	l.refs++
	a.cells.add(StatLarge, statSegment, 1)
	a.cells.add(StatLarge, statReservedBytes, int64(n))
	l.pool.reserved += n
	if a.history != nil {
		a.history.add(actionSegmentAlloc, p, n, l.stream, a.callCtx)
	}
	a.countAlloc(StatLarge, int64(n), size)
	if a.history != nil {
		a.history.add(actionAlloc, p, size, l.stream, a.callCtx)
	}
	return p, nil
}

func (a *Allocator) newBlock() blockID {
	if k := len(a.unusedIDs); k > 0 {
		id := a.unusedIDs[k-1]
		a.unusedIDs = a.unusedIDs[:k-1]
		return id
	}
	a.blocks = append(a.blocks, Block{})
	return blockID(len(a.blocks) - 1)
}

func (a *Allocator) freeBlock(id blockID, ptr uintptr, size uint64, s arena.Stream) error {
	b := &a.blocks[id]
	if b.state != blockLive {
		return a.badInput("double_free", fmt.Sprintf("double free of %#x (%d bytes) on device %d", ptr, size, a.dev.Ordinal()))
	}
	if a.ipc != nil {
		if held, err := a.holdIfShared(ptr, size, s); held {
			return err
		}
	}
	a.countFree(StatLarge, int64(b.size), b.requested)
	if a.history != nil {
		a.history.add(actionFreeRequested, ptr, b.requested, b.stream, a.callCtx)
	}
	warn := a.checkFree(ptr, size, b.requested, s, b.stream)
	if a.deferIfRecorded(ptr, b.list) {
		b.state = blockPending
		return warn
	}
	a.cells.sub(StatLarge, statActive, 1)
	a.cells.sub(StatLarge, statActiveBytes, int64(b.size))
	if a.history != nil {
		a.history.add(actionFreeCompleted, ptr, b.requested, b.stream, a.callCtx)
	}
	a.cacheBlock(id)
	return warn
}

// cacheBlock puts the free large block id into its stream's cache; past its
// pool's limit, the pool's rule decides what goes back.
func (a *Allocator) cacheBlock(id blockID) {
	b := &a.blocks[id]
	b.state = blockCached
	l := b.list
	bucket := l.bucketFor(b.size)
	if bucket.count == 0 {
		l.emptyBucket--
	}
	bucket.count++
	a.pushFront(&bucket.list, id, sizeLinks)
	p := l.pool
	a.pushBack(&p.lru, id, lruLinks)
	p.cachedLarge += b.size
	if p.cachedLarge > p.maxCachedLarge {
		p.rule.overLarge(a, p, id)
	}
}

// uncache takes the cached block id out of its bucket (found if nil) and
// its pool's LRU list.
func (a *Allocator) uncache(id blockID, bucket *sizeBucket) {
	b := &a.blocks[id]
	l := b.list
	if bucket == nil {
		bucket = &l.buckets[l.bucketIndex(b.size)]
	}
	a.unlink(&bucket.list, id, sizeLinks)
	bucket.count--
	if bucket.count == 0 {
		l.emptyBucket++
	}
	p := l.pool
	a.unlink(&p.lru, id, lruLinks)
	p.cachedLarge -= b.size
}
