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
	// ctx is the context id of the call that allocated the block (set at
	// every allocation, 0 for a call without one), and segCtx that of the
	// call that took it from the pool: a block is its own segment
	// (history.go, "Context ids").
	ctx, segCtx uint64

	// While cached: links in its size bucket and in its pool's LRU list.
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

// linkKind says which pair of links a blockList threads through.
type linkKind uint8

const (
	sizeLinks linkKind = iota // a sizeBucket's list
	lruLinks                  // a cache pool's LRU list
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
