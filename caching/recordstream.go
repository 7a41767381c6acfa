package caching

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// Frees that wait for other streams (Tensor.record_stream): recording the
// streams that use a block, deferring its free behind their events, and
// completing it once they are done (package streams keeps the events).

// RecordStream notes that stream s uses the live block at ptr, so that its
// free waits for s (PyTorch's Tensor.record_stream).
func (a *Allocator) RecordStream(ptr uintptr, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	owner, live := arena.Stream(0), false
	if id, ok := a.largeByAddr.Get(ptr); ok {
		owner, live = a.blocks[id].stream, a.blocks[id].state == blockLive
	} else if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			owner, live = seg.stream, seg.state[i] == slotLive
		}
	} else {
		return a.badInput("unknown_pointer", fmt.Sprintf("record_stream of %#x on device %d: goalloc did not allocate it on this device", ptr, a.dev.Ordinal()))
	}
	if !live {
		return a.badInput("record_stream_not_live", fmt.Sprintf("record_stream of %#x on device %d: the block is not allocated", ptr, a.dev.Ordinal()))
	}
	if s == owner {
		return nil
	}
	for _, r := range a.recorded[ptr] {
		if r == s {
			return nil
		}
	}
	if a.recorded == nil {
		a.recorded = map[uintptr][]arena.Stream{}
	}
	a.recorded[ptr] = append(a.recorded[ptr], s)
	return nil
}

// deferIfRecorded starts a deferred free when other streams used ptr, in
// any pool: in a graph's private pool too, since within a capture the
// streams that used a block may still run its captured work after the
// free (PyTorch's allocator defers these frees to the end of the capture).
func (a *Allocator) deferIfRecorded(ptr uintptr, l *StreamFreeList) bool {
	if len(a.recorded) == 0 {
		return false
	}
	used, ok := a.recorded[ptr]
	if !ok {
		return false
	}
	delete(a.recorded, ptr)
	if len(a.recorded) == 0 {
		a.recorded = nil
	}
	if a.capturing() {
		// No event may be recorded now (see capturing): the free waits,
		// pending, for the end of the captures, as in PyTorch's allocator.
		a.afterCapture = append(a.afterCapture, recordedFree{ptr, used})
	} else {
		a.deferred.Add(ptr, used)
	}
	if a.callCtx != 0 {
		if a.pendingCtx == nil {
			a.pendingCtx = map[uintptr]uint64{}
		}
		a.pendingCtx[ptr] = a.callCtx
	}
	a.stats.DeferredFrees++
	return true
}

// takePendingCtx is the context id of the deferred free of ptr, which is
// completing (0 if it had none).
func (a *Allocator) takePendingCtx(ptr uintptr) uint64 {
	ctx, ok := a.pendingCtx[ptr]
	if ok {
		delete(a.pendingCtx, ptr)
		if len(a.pendingCtx) == 0 {
			a.pendingCtx = nil
		}
	}
	return ctx
}

// CompleteRecordedFree completes now a free that waits for the end of the
// captures (afterCapture): the caller has proven that every stream that
// used ptr is done with it as far as any later captured work is concerned
// (PyTorch's graph_capture_record_stream_reuse: the free's markers precede
// every terminal node of the allocating stream's capture, a check of the
// graph's topology that goalloc's C++ class makes). It says whether such a
// free was waiting.
func (a *Allocator) CompleteRecordedFree(ptr uintptr) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, f := range a.afterCapture {
		if f.ptr == ptr {
			a.afterCapture = append(a.afterCapture[:i], a.afterCapture[i+1:]...)
			a.completeFree(ptr)
			return true
		}
	}
	return false
}

// recordedFree is a free of ptr that must wait for the streams in used.
type recordedFree struct {
	ptr  uintptr
	used []arena.Stream
}

// pollDeferred completes the deferred frees whose events have completed.
// While a capture is underway nothing is polled (see capturing).
func (a *Allocator) pollDeferred() int {
	if a.deferred.Len() == 0 || a.capturing() {
		return 0
	}
	return a.deferred.Poll(a.completeFree)
}

// completeFree finishes a deferred free: its block becomes reusable by its
// owner stream.
func (a *Allocator) completeFree(ptr uintptr) {
	if id, ok := a.largeByAddr.Get(ptr); ok && a.blocks[id].state == blockPending {
		b := &a.blocks[id]
		a.cells.sub(StatLarge, statActive, 1)
		a.cells.sub(StatLarge, statActiveBytes, int64(b.size))
		ctx := a.takePendingCtx(ptr)
		if a.history != nil {
			a.history.add(actionFreeCompleted, ptr, b.requested, b.stream, ctx)
		}
		a.cacheBlock(id)
		return
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 && seg.state[i] == slotPending {
			a.releaseSlot(seg, i, a.takePendingCtx(ptr))
			return
		}
	}
	panic(fmt.Sprintf("goalloc: deferred free of %#x completed, but no pending block has that address", ptr))
}
