package caching

import "github.com/goalloc/goalloc/arena"

// A Block is one large allocation: a whole pool allocation of more than
// smallMax bytes, never split. Blocks live in Allocator.blocks and are named
// by their index (a blockID) so that lists can link them without pointers and
// the slice can grow on the slow path.
type Block struct {
	addr uintptr
	// size is what the pool gave: the request rounded up to 512 bytes.
	size uint64
	// requested is the size the user asked for; meaningful while live.
	requested uint64
	// stream is the stream the block was allocated on, its owner: only that
	// stream reuses it from the cache, and it goes back to the pool ordered
	// on that stream.
	stream arena.Stream
	// list is the StreamFreeList of stream in the block's cache pool.
	list  *StreamFreeList
	state blockState

	// While cached: links in its size bucket and in the device's LRU list.
	sizePrev, sizeNext blockID
	lruPrev, lruNext   blockID
}

type blockID int32

const noBlock blockID = -1

type blockState uint8

const (
	blockUnused  blockState = iota // the Block struct is on the recycle list
	blockLive                      // handed to the user
	blockPending                   // freed, waiting for other streams' events
	blockCached                    // free, in its stream's cache
)

// blockList is an intrusive doubly linked list of blocks threaded through
// either the size links or the LRU links (the link accessors say which).
type blockList struct{ head, tail blockID }

func emptyList() blockList { return blockList{noBlock, noBlock} }

// sizeBucket holds the cached blocks of one exact size on one stream, most
// recently freed first.
type sizeBucket struct {
	size  uint64
	list  blockList
	count int
}

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

// linkKind says which pair of links a blockList threads through.
type linkKind uint8

const (
	sizeLinks linkKind = iota // a sizeBucket's list
	lruLinks                  // the device's LRU list
)

func (a *Allocator) links(id blockID, k linkKind) (prev, next *blockID) {
	b := &a.blocks[id]
	if k == sizeLinks {
		return &b.sizePrev, &b.sizeNext
	}
	return &b.lruPrev, &b.lruNext
}

func (a *Allocator) pushFront(l *blockList, id blockID, k linkKind) {
	prev, next := a.links(id, k)
	*prev, *next = noBlock, l.head
	if l.head != noBlock {
		hp, _ := a.links(l.head, k)
		*hp = id
	} else {
		l.tail = id
	}
	l.head = id
}

func (a *Allocator) pushBack(l *blockList, id blockID, k linkKind) {
	prev, next := a.links(id, k)
	*prev, *next = l.tail, noBlock
	if l.tail != noBlock {
		_, tn := a.links(l.tail, k)
		*tn = id
	} else {
		l.head = id
	}
	l.tail = id
}

func (a *Allocator) unlink(l *blockList, id blockID, k linkKind) {
	prev, next := a.links(id, k)
	if *prev != noBlock {
		_, pn := a.links(*prev, k)
		*pn = *next
	} else {
		l.head = *next
	}
	if *next != noBlock {
		np, _ := a.links(*next, k)
		*np = *prev
	} else {
		l.tail = *prev
	}
	*prev, *next = noBlock, noBlock
}
