package caching

import "github.com/goalloc/goalloc/arena"

// Cache pools: the general cache and each private pool of CUDA graph
// captures are a cachePool, a set of per-stream caches (StreamFreeList:
// segments with free slots by class, cached blocks by size).

// A cachePool is a set of stream free lists: the general cache, or one
// private pool of CUDA graph captures.
type cachePool struct {
	id PoolID // the zero PoolID for the general cache and the tags' pools
	// tag is a memory tag's pool's tag (sleep.go), 0 for the others;
	// asleep says the tag is asleep.
	tag    Tag
	asleep bool
	// lists has one StreamFreeList per stream that holds memory here
	// (byStream finds it); last is the one used most recently, checked
	// first because one stream does most work. A list that holds nothing
	// is dropped (see dropIfUnused): the records do not grow with the
	// streams ever seen.
	lists    []*StreamFreeList
	byStream map[arena.Stream]*StreamFreeList
	last     *StreamFreeList

	// retained is what the pool keeps of the memory freed into it, and
	// rule decides how much (retention.go).
	*retained
	rule retention

	// Private pools only. users counts the captures that began with this
	// pool and were not released; once it drops to 0 the pool is released:
	// its cached memory goes back to the driver pool, and so does the rest
	// as it is freed.
	users    int
	released bool
	// deferredReleases counts ReleasePool calls that arrived while a
	// capture window of this pool was open; they take effect when the
	// pool's last window ends (EndAllocateToPool).
	deferredReleases int
	// reserved is the bytes of segments and blocks the pool holds.
	reserved uint64
}

// newGeneralPool makes the general cache, which keeps its memory in kept
// under the rule of cfg, on a device that holds at least perStream bytes
// for a stream that holds anything (emptySegments.perStream).
func newGeneralPool(kept *retained, cfg Config, perStream uint64) *cachePool {
	rule := generalRetention{largeCache: cfg.LargeCache, missRelease: cfg.MissRelease, perStream: perStream}
	kept.emptySegs.perStream = perStream
	p := &cachePool{retained: kept, rule: rule}
	p.limits = p.rule.limits()
	return p
}

// newGraphPool makes the private pool id, empty.
func newGraphPool(id PoolID) *cachePool {
	p := &cachePool{id: id, retained: newRetained()}
	p.rule = graphRetention{pool: p}
	p.limits = p.rule.limits()
	return p
}

// list finds or makes the StreamFreeList of s and makes it last. The list
// that was last is dropped if it holds nothing.
func (p *cachePool) list(s arena.Stream) *StreamFreeList {
	if old := p.last; old != nil && old.refs == 0 {
		p.drop(old)
	}
	l := p.byStream[s]
	if l == nil {
		if p.byStream == nil {
			p.byStream = map[arena.Stream]*StreamFreeList{}
		}
		l = &StreamFreeList{stream: s, pool: p, index: len(p.lists)}
		p.lists = append(p.lists, l)
		p.byStream[s] = l
	}
	p.last = l
	return l
}

// drop forgets the StreamFreeList l, which holds nothing.
func (p *cachePool) drop(l *StreamFreeList) {
	n := len(p.lists) - 1
	moved := p.lists[n]
	p.lists[l.index], moved.index = moved, l.index
	p.lists[n] = nil
	p.lists = p.lists[:n]
	delete(p.byStream, l.stream)
	if p.last == l {
		p.last = nil
	}
}

// dropIfUnused drops l once it holds nothing, unless it is the list in use
// (last), which a Malloc in progress may be holding; list drops that one
// when another stream takes its place, and EmptyCache drops it for good.
func (p *cachePool) dropIfUnused(l *StreamFreeList) {
	if l.refs == 0 && l != p.last {
		p.drop(l)
	}
}

// dropAllUnused drops every list that holds nothing, last included. Only
// for EmptyCache: no Malloc is in progress.
func (p *cachePool) dropAllUnused() {
	for i := len(p.lists) - 1; i >= 0; i-- {
		if l := p.lists[i]; l.refs == 0 {
			p.drop(l)
		}
	}
}

// empty says whether the pool holds no memory at all.
func (p *cachePool) empty() bool { return p.reserved == 0 }

// StreamFreeList is the cache of one stream: its small segments with free
// slots, by class, and its cached large blocks, by size. Everything in it may
// be handed to this stream's work at once (see doc.go, "Streams").
type StreamFreeList struct {
	stream arena.Stream
	pool   *cachePool
	// refs counts the segments and blocks (live, pending or cached) that
	// belong to this list; at 0 the list holds nothing and is dropped.
	refs int
	// index is the list's position in pool.lists.
	index int
	small [numSmallClasses]segmentList
	// emptyBytes is the bytes of its segments on its pool's emptySegs.
	emptyBytes uint64
	// buckets is sorted by size. Buckets may be empty; empty ones are pruned
	// on the slow path when they outnumber the full ones.
	buckets     []sizeBucket
	emptyBucket int
}

// bucketIndex returns the index of the first bucket with size >= n.
func (l *StreamFreeList) bucketIndex(n uint64) int {
	b := l.buckets
	lo, hi := 0, len(b)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if b[m].size < n {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// bucketFor returns the bucket of exactly size n, creating it (slow path).
func (l *StreamFreeList) bucketFor(n uint64) *sizeBucket {
	i := l.bucketIndex(n)
	if i < len(l.buckets) && l.buckets[i].size == n {
		return &l.buckets[i]
	}
	l.buckets = append(l.buckets, sizeBucket{})
	copy(l.buckets[i+1:], l.buckets[i:])
	l.buckets[i] = sizeBucket{size: n, list: emptyList()}
	l.emptyBucket++
	return &l.buckets[i]
}

// pruneBuckets drops empty buckets once they are the majority.
func (l *StreamFreeList) pruneBuckets() {
	if l.emptyBucket*2 <= len(l.buckets) {
		return
	}
	kept := l.buckets[:0]
	for _, b := range l.buckets {
		if b.count > 0 {
			kept = append(kept, b)
		}
	}
	l.buckets = kept
	l.emptyBucket = 0
}
