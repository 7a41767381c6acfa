package caching

import (
	"fmt"
	"slices"

	"github.com/goalloc/goalloc/arena"
)

// Small requests (<= smallMax): slots of segments, one size class per
// segment. Taking and freeing a slot, a segment's first allocation, and the
// index that finds a pointer's segment.

// takeSlot hands out a free slot of seg, the head of its avail list.
func (a *Allocator) takeSlot(l *StreamFreeList, seg *Segment, size uint64) uintptr {
	n := len(seg.freeSlots) - 1
	i := seg.freeSlots[n]
	seg.freeSlots = seg.freeSlots[:n]
	return a.liveSlot(l, seg, i, size)
}

// liveSlot hands out slot i of seg, already taken off its free stack.
func (a *Allocator) liveSlot(l *StreamFreeList, seg *Segment, i int32, size uint64) uintptr {
	seg.state[i] = slotLive
	seg.requested[i] = uint32(size)
	slot := int64(seg.slotSize)
	if seg.used == 0 {
		// The segment was empty: it becomes split, its other slots inactive.
		l.small[seg.class].empty--
		if seg.inEmpty {
			l.pool.emptySegs.remove(seg)
		}
		a.cells.add(StatSmall, statInactiveSplit, int64(seg.nslots-1))
		a.cells.add(StatSmall, statInactiveSplitBytes, int64(seg.size)-slot)
	} else {
		a.cells.sub(StatSmall, statInactiveSplit, 1)
		a.cells.sub(StatSmall, statInactiveSplitBytes, slot)
	}
	seg.used++
	if len(seg.freeSlots) == 0 {
		l.small[seg.class].remove(seg)
	}
	a.countAlloc(StatSmall, slot, size)
	if seg.ctx != nil || a.callCtx != 0 {
		seg.setCtx(i, a.callCtx)
	}
	p := seg.slotAddr(i)
	if a.history != nil {
		a.history.add(actionAlloc, p, size, seg.stream, a.callCtx)
	}
	return p
}

func (a *Allocator) mallocSmallSlow(l *StreamFreeList, c uint8, size uint64) (uintptr, error) {
	a.cells.miss()
	a.pollDeferred()
	if seg := l.small[c].head; seg != nil { // a deferred free completed into it
		return a.takeSlot(l, seg, size), nil
	}
	p, err := a.poolAlloc(uint64(classSegment[c]), l, size)
	if err != nil {
		return 0, err
	}
	seg := newSegment(p, c, l)
	seg.segCtx = a.callCtx
	l.refs++
	a.insertSegment(seg)
	l.small[c].pushBack(seg)
	l.small[c].empty++
	a.cells.add(StatSmall, statSegment, 1)
	a.cells.add(StatSmall, statReservedBytes, int64(seg.size))
	l.pool.reserved += seg.size
	if a.history != nil {
		a.history.add(actionSegmentAlloc, p, seg.size, l.stream, a.callCtx)
	}
	return a.takeSlot(l, seg, size), nil
}

func (a *Allocator) freeSlot(seg *Segment, i int32, ptr uintptr, size uint64, s arena.Stream) error {
	if seg.state[i] != slotLive {
		return a.badInput("double_free", fmt.Sprintf("double free of %#x (%d bytes) on device %d", ptr, size, a.dev.Ordinal()))
	}
	if a.ipc != nil {
		if held, err := a.holdIfShared(ptr, size, s); held {
			return err
		}
	}
	req := uint64(seg.requested[i])
	a.countFree(StatSmall, int64(seg.slotSize), req)
	if a.history != nil {
		a.history.add(actionFreeRequested, ptr, req, seg.stream, a.callCtx)
	}
	warn := a.checkFree(ptr, size, req, s, seg.stream)
	if a.deferIfRecorded(ptr, seg.list) {
		seg.state[i] = slotPending
		return warn
	}
	a.releaseSlot(seg, i, a.callCtx)
	return warn
}

// releaseSlot makes slot i of seg free (its events, if any, completed);
// ctx is its free's context id.
func (a *Allocator) releaseSlot(seg *Segment, i int32, ctx uint64) {
	slot := int64(seg.slotSize)
	a.cells.sub(StatSmall, statActive, 1)
	a.cells.sub(StatSmall, statActiveBytes, slot)
	if a.history != nil {
		a.history.add(actionFreeCompleted, seg.slotAddr(i), uint64(seg.requested[i]), seg.stream, ctx)
	}
	seg.state[i] = slotFree
	seg.freeSlots = append(seg.freeSlots, i)
	seg.used--
	l := seg.list
	if !seg.inAvail {
		l.small[seg.class].pushBack(seg)
	}
	if seg.used > 0 {
		a.cells.add(StatSmall, statInactiveSplit, 1)
		a.cells.add(StatSmall, statInactiveSplitBytes, slot)
		return
	}
	a.cells.sub(StatSmall, statInactiveSplit, int64(seg.nslots-1))
	a.cells.sub(StatSmall, statInactiveSplitBytes, int64(seg.size)-slot)
	cl := &l.small[seg.class]
	cl.empty++
	// The pool keeps the empty segment; past its limits, its rule decides
	// what goes back (retention.go).
	p := l.pool
	p.emptySegs.pushBack(seg)
	if cl.empty > p.maxEmptyPerClass || p.emptySegs.held > p.maxEmptyBytes {
		p.rule.overEmpty(a, p, seg, cl)
	}
}

func (a *Allocator) insertSegment(seg *Segment) {
	i := a.segmentAfter(seg.addr)
	a.segments = slices.Insert(a.segments, i, seg)
	a.segmentAddrs = slices.Insert(a.segmentAddrs, i, seg.addr)
}

func (a *Allocator) removeSegment(seg *Segment) {
	i := a.segmentAfter(seg.addr) - 1
	a.segments = slices.Delete(a.segments, i, i+1)
	a.segmentAddrs = slices.Delete(a.segmentAddrs, i, i+1)
}

// segmentAfter is the index of the first segment that starts above ptr.
// It searches segmentAddrs, not the segments: eight addresses share a
// cache line, where each probe of a segment would read its own.
func (a *Allocator) segmentAfter(ptr uintptr) int {
	s := a.segmentAddrs
	lo, hi := 0, len(s)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if s[m] <= ptr {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// findSegment returns the small segment holding ptr, or nil.
func (a *Allocator) findSegment(ptr uintptr) *Segment {
	i := a.segmentAfter(ptr)
	if i == 0 {
		return nil
	}
	if seg := a.segments[i-1]; ptr < seg.addr+uintptr(seg.size) {
		return seg
	}
	return nil
}
