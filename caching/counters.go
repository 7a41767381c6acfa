package caching

import (
	"sync"

	"go.uber.org/atomic"
)

// Published statistics: the figures a training loop reads every step
// (torch.cuda.memory_allocated() and its family), readable without the
// allocator's mutex.
//
// Stats is kept in plain fields under the mutex, where the hot path updates
// dozens of them per call; making each an atomic would put a locked
// instruction on every update.
// Instead the mutex's Unlock copies the few published figures from Stats
// into atomics, storing only those that changed: a cache hit changes
// allocated_bytes.all.current and, at a new high, its peak, so it pays one
// atomic store and four comparisons. Every change made under the mutex is
// published by the Unlock that ends it, whichever path made it (malloc,
// free, empty_cache, reset_peak_memory_stats, ...), so no path can forget
// to publish, and a reader sees each figure as it was after some completed
// call. (Stats() also collects completed deferred frees first, which can
// give memory back to the pool; the published figures follow at the end of
// that same call.)
//
// Each published figure costs every call a comparison, so only the figures
// torch has a scalar function for are published; the rest of
// memory_stats() goes through Stats().

// Scalar names one published figure. The order is part of the C ABI
// (goalloc_stat, goalloc_stat_scalars): figures are only ever added at the
// end.
type Scalar int

const (
	ScalarAllocatedBytes     Scalar = iota // allocated_bytes.all.current: memory_allocated()
	ScalarAllocatedBytesPeak               // allocated_bytes.all.peak: max_memory_allocated()
	ScalarReservedBytes                    // reserved_bytes.all.current: memory_reserved()
	ScalarReservedBytesPeak                // reserved_bytes.all.peak: max_memory_reserved()
	NumScalars
)

// scalarKeys is the memory_stats() key of each Scalar.
var scalarKeys = [NumScalars]string{
	ScalarAllocatedBytes:     "allocated_bytes.all.current",
	ScalarAllocatedBytesPeak: "allocated_bytes.all.peak",
	ScalarReservedBytes:      "reserved_bytes.all.current",
	ScalarReservedBytesPeak:  "reserved_bytes.all.peak",
}

// ScalarKeys lists the memory_stats() key of every Scalar, in Scalar order.
func ScalarKeys() []string { return append([]string(nil), scalarKeys[:]...) }

// statsMutex is the allocator's mutex. Unlock publishes the Scalars from
// the statistics it watches (the allocator's statCells, and held) before
// it lets the next holder in.
//
// Every call reads its first 64 bytes (the mutex, what Unlock publishes
// from, the published figures, front, and held's two flags), in that
// order so that they share one cache line where the allocator starts one;
// the rest is read when held changed, or the front log holds frees.
type statsMutex struct {
	sync.Mutex
	cells     *statCells // nil until watch
	published [NumScalars]atomic.Int64
	// front is the device's front log (front.go), nil until goalloc's C++
	// class asks for it: Lock drains it first. Set once, under the mutex;
	// read without it by Pending.
	front atomic.Pointer[FrontLog]
	// held is reserved_bytes.all's figure (held.go).
	held  heldFigure
	drain func()
}

// Lock takes the mutex, then applies what the front log holds (front.go),
// so that whatever the holder does sees every free made before it.
func (m *statsMutex) Lock() {
	m.Mutex.Lock()
	if f := m.front.Load(); f != nil && f.n.Load() != 0 {
		m.drain()
	}
}

// watch makes Unlock publish from c (and held). Called once, before the
// mutex is shared.
func (m *statsMutex) watch(c *statCells) {
	m.cells = c
	m.Lock()
	m.Unlock()
}

// Unlock publishes the figures that changed, then unlocks. Each figure is
// stored and read on its own: figures read together while calls run may
// come from different calls.
func (m *statsMutex) Unlock() {
	if c := m.cells; c != nil {
		allocated := &c[StatAll].cells[statAllocatedBytes]
		m.set(ScalarAllocatedBytes, allocated.current)
		m.set(ScalarAllocatedBytesPeak, allocated.peak)
	}
	// The held figure changes only when it is read again, which a call
	// that reached the memory source (stale) makes happen here.
	if h := &m.held; h.stale || h.unpublished {
		r, rp := h.get()
		h.unpublished = false
		m.set(ScalarReservedBytes, r)
		m.set(ScalarReservedBytesPeak, rp)
	}
	m.Mutex.Unlock()
}

// set stores v as figure k if it changed: a load is a plain read, a store a
// locked instruction.
func (m *statsMutex) set(k Scalar, v int64) {
	if m.published[k].Load() != v {
		m.published[k].Store(v)
	}
}

// Scalar returns one published figure without taking the mutex: its value
// after the last call that completed. k must be in [0, NumScalars). (The
// exceptions: frees waiting in the front log are applied first, under the
// mutex (settleFront); a reserved figure of a pool that releases memory on
// its own is read again first, under the mutex; see reservedFigure.)
func (a *Allocator) Scalar(k Scalar) int64 {
	a.settleFront()
	a.reservedFigure(k)
	return a.mu.published[k].Load()
}

// settleFront makes the published figures count the frees waiting in the
// front log: taking the mutex drains it (front.go). Without pending
// entries, as between a training loop's steps, it costs one load.
func (a *Allocator) settleFront() {
	if a.Pending() > 0 {
		a.DrainFront()
	}
}

// Scalars fills out with the published figures in Scalar order, as many as
// fit, without taking the mutex (but for Scalar's exceptions), and returns
// how many it wrote.
func (a *Allocator) Scalars(out []int64) int {
	n := min(len(out), int(NumScalars))
	a.settleFront()
	if n > int(ScalarReservedBytes) {
		a.reservedFigure(ScalarReservedBytes)
	}
	for i := range n {
		out[i] = a.mu.published[i].Load()
	}
	return n
}
