package caching

import "github.com/goalloc/goalloc/arena"

// A Segment is one pool allocation of classSegment[class] bytes carved into equal
// slots of one small size class. It belongs to the stream it was allocated
// on: only that stream takes slots from it (see doc.go, "Streams").
type Segment struct {
	addr   uintptr
	size   uint64
	stream arena.Stream
	// list is the StreamFreeList the segment belongs to, in its cache pool.
	list     *StreamFreeList
	class    uint8
	slotSize uint64
	nslots   int32

	// freeSlots is a stack of the indices of free slots. Its capacity is
	// nslots from the start, so pushing never allocates.
	freeSlots []int32
	// state[i] says what slot i is doing. Invariant: the slots in freeSlots
	// are exactly those with state slotFree.
	state []slotState
	// used counts live and pending slots: nslots - len(freeSlots).
	used int32

	// Links in its StreamFreeList's list of segments of this class that have
	// a free slot (avail). Invariant: inAvail == (len(freeSlots) > 0).
	prev, next *Segment
	inAvail    bool

	// Links in its cache pool's list of kept empty segments (emptySegs),
	// oldest first. Invariant: inEmpty == (used == 0).
	emptyPrev, emptyNext *Segment
	inEmpty              bool

	// requested[i] is the size the user asked for in slot i, while live
	// and, once free, the last one (snapshots report it, as PyTorch does
	// for an inactive block); 0 for a slot never handed out.
	requested []uint32
	// ctx[i] is the context id of the call that allocated slot i; nil
	// until a call brought one (setCtx), so that a caller that passes none
	// pays no memory for it. segCtx is the id of the call that took the
	// segment from the pool (history.go, "Context ids").
	ctx    []uint64
	segCtx uint64
}

type slotState uint8

const (
	slotFree    slotState = iota // in freeSlots
	slotLive                     // handed to the user
	slotPending                  // freed, waiting for other streams' events
)

func newSegment(addr uintptr, class uint8, l *StreamFreeList) *Segment {
	slot := uint64(classSize[class])
	size := uint64(classSegment[class])
	n := int32(size / slot)
	seg := &Segment{
		addr: addr, size: size, stream: l.stream, list: l, class: class, slotSize: slot, nslots: n,
		freeSlots: make([]int32, n),
		state:     make([]slotState, n),
		requested: make([]uint32, n),
	}
	// Hand out low addresses first: slot 0 ends on top of the stack.
	for i := int32(0); i < n; i++ {
		seg.freeSlots[i] = n - 1 - i
	}
	return seg
}

// freeOrder is, for each free slot, its place in freeSlots: higher was
// freed later (the stack's bottom holds the slots never handed out, in
// the order they will be). For snapshots, which may allocate.
func (seg *Segment) freeOrder() []int32 {
	at := make([]int32, seg.nslots)
	for pos, i := range seg.freeSlots {
		at[i] = int32(pos)
	}
	return at
}

// slotOf returns the slot index of ptr, or -1 when ptr is not the start of a slot.
func (seg *Segment) slotOf(ptr uintptr) int32 {
	off := uint64(ptr - seg.addr)
	if off%seg.slotSize != 0 || off/seg.slotSize >= uint64(seg.nslots) {
		return -1
	}
	return int32(off / seg.slotSize)
}

// setCtx records ctx as the context id of slot i's allocation.
func (seg *Segment) setCtx(i int32, ctx uint64) {
	if seg.ctx == nil {
		seg.ctx = make([]uint64, seg.nslots)
	}
	seg.ctx[i] = ctx
}

// slotCtx is the context id of slot i's allocation.
func (seg *Segment) slotCtx(i int32) uint64 {
	if seg.ctx == nil {
		return 0
	}
	return seg.ctx[i]
}

func (seg *Segment) slotAddr(i int32) uintptr { return seg.addr + uintptr(uint64(i)*seg.slotSize) }

// segmentList is a doubly linked list of segments (the avail list of a class).
type segmentList struct {
	head, tail *Segment
	// empty counts the segments of this stream and class with no used slot.
	empty int
}

func (l *segmentList) pushBack(seg *Segment) {
	seg.prev, seg.next, seg.inAvail = l.tail, nil, true
	if l.tail != nil {
		l.tail.next = seg
	} else {
		l.head = seg
	}
	l.tail = seg
}

func (l *segmentList) remove(seg *Segment) {
	if seg.prev != nil {
		seg.prev.next = seg.next
	} else {
		l.head = seg.next
	}
	if seg.next != nil {
		seg.next.prev = seg.prev
	} else {
		l.tail = seg.prev
	}
	seg.prev, seg.next, seg.inAvail = nil, nil, false
}

// emptySegments lists the empty small segments a cache pool keeps, least
// recently emptied first, with their bytes and what the device holds for
// them; the pool's retention rule bounds the number and the latter (the
// general cache: one per stream and class, emptySegmentBudget in all,
// since the streams they are kept for may be gone).
type emptySegments struct {
	head, tail *Segment
	bytes      uint64
	// held is what the budget counts for the segments: per stream, its
	// segments' bytes, or perStream where that is more, which is what the
	// device holds for a stream that keeps nothing else (a stream at work
	// may share those handles with its live memory, and then counts more
	// than its segments cost). Invariant: it is that sum over the streams'
	// emptyBytes.
	held uint64
	// perStream is the least the device holds for a stream that holds
	// anything, where streams never share a physical handle (the VMM
	// backend: arena.StreamGranular); 0 where they may (the stream-ordered
	// pool packs every stream's memory in the same chunks).
	perStream uint64
}

// heldFor is what held counts for n bytes of one stream's empty segments.
func (l *emptySegments) heldFor(n uint64) uint64 {
	if n == 0 {
		return 0
	}
	return max(n, l.perStream)
}

func (l *emptySegments) pushBack(seg *Segment) {
	seg.emptyPrev, seg.emptyNext, seg.inEmpty = l.tail, nil, true
	if l.tail != nil {
		l.tail.emptyNext = seg
	} else {
		l.head = seg
	}
	l.tail = seg
	s := seg.list
	l.held -= l.heldFor(s.emptyBytes)
	s.emptyBytes += seg.size
	l.held += l.heldFor(s.emptyBytes)
	l.bytes += seg.size
}

func (l *emptySegments) remove(seg *Segment) {
	if seg.emptyPrev != nil {
		seg.emptyPrev.emptyNext = seg.emptyNext
	} else {
		l.head = seg.emptyNext
	}
	if seg.emptyNext != nil {
		seg.emptyNext.emptyPrev = seg.emptyPrev
	} else {
		l.tail = seg.emptyPrev
	}
	seg.emptyPrev, seg.emptyNext, seg.inEmpty = nil, nil, false
	s := seg.list
	l.held -= l.heldFor(s.emptyBytes)
	s.emptyBytes -= seg.size
	l.held += l.heldFor(s.emptyBytes)
	l.bytes -= seg.size
}
