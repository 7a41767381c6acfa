// Package streams holds what goalloc needs to know about CUDA streams: a pool
// of reusable events and the list of frees that wait on them.
//
// Why frees wait: a tensor allocated on stream A and used on stream B (PyTorch's
// Tensor.record_stream(B)) may be freed by the host while B's kernels still read
// it. Its memory may go back into A's cache only once B has finished the work
// that was queued before the free. So at free time goalloc records an event on
// every stream other than A that used the block, and the block waits in
// DeferredFrees until all of them have completed. A's own later work is
// ordered after the free by the stream itself, so A needs no event.
//
// Events are polled with cuEventQuery, never waited on: the allocation path
// must not block the host. Poll is called on the slow paths of the caching
// allocator (a cache miss, empty_cache, a statistics read). If an event cannot
// be recorded or queried, the free cannot be proven complete by polling; it
// completes only at the next device-wide synchronisation (AllComplete), which
// the allocator performs before declaring an out-of-memory and in empty_cache.
//
// Nothing here takes a lock: the caching allocator owns one EventPool and one
// DeferredFrees per device and calls them under its own lock.
package streams

import (
	"github.com/goalloc/goalloc/arena"
)

// EventPool recycles driver events: creating one costs a driver call and
// some microseconds, recording an existing one is cheap.
type EventPool struct {
	dev  arena.Device
	idle []arena.Event
	// Created counts events ever created; Created - len(idle) are in use.
	Created int
}

// NewEventPool makes an empty pool of events on dev.
func NewEventPool(dev arena.Device) *EventPool { return &EventPool{dev: dev} }

// Get returns an idle event, creating one if none is idle.
func (p *EventPool) Get() (arena.Event, error) {
	if n := len(p.idle); n > 0 {
		e := p.idle[n-1]
		p.idle = p.idle[:n-1]
		return e, nil
	}
	e, err := p.dev.NewEvent()
	if err != nil {
		return 0, err
	}
	p.Created++
	return e, nil
}

// Put makes e idle again. e must not be awaited by anyone any more.
func (p *EventPool) Put(e arena.Event) { p.idle = append(p.idle, e) }

// InUse is how many events are out of the pool.
func (p *EventPool) InUse() int { return p.Created - len(p.idle) }

// Close destroys every idle event. Events in use are leaked to the driver,
// which frees them with the context.
func (p *EventPool) Close() {
	for _, e := range p.idle {
		_ = p.dev.DestroyEvent(e)
	}
	p.Created -= len(p.idle)
	p.idle = nil
}

// DeferredFrees is the list of freed blocks that wait for events.
type DeferredFrees struct {
	events  *EventPool
	pending []deferredFree
	// Errors counts driver failures seen while recording or polling events
	// (the caching layer's goalloc.event_errors; it zeroes it with the other
	// accumulated counters). Each failed free waits for a device-wide
	// synchronisation instead, so a failure costs time, never correctness.
	Errors int
}

type deferredFree struct {
	ptr    uintptr
	events []arena.Event
	// needsSync: an event could not be recorded or queried, so only a
	// device-wide synchronisation proves this free complete.
	needsSync bool
}

// NewDeferredFrees makes an empty list that takes its events from events.
func NewDeferredFrees(events *EventPool) *DeferredFrees {
	return &DeferredFrees{events: events}
}

// Add defers the free of ptr until every stream in used has completed the
// work queued on it so far.
func (d *DeferredFrees) Add(ptr uintptr, used []arena.Stream) {
	f := deferredFree{ptr: ptr, events: make([]arena.Event, 0, len(used))}
	for _, s := range used {
		e, err := d.events.Get()
		if err == nil {
			if err = d.events.dev.RecordEvent(e, s); err != nil {
				d.events.Put(e)
			}
		}
		if err != nil {
			d.fail()
			f.needsSync = true
			continue
		}
		f.events = append(f.events, e)
	}
	d.pending = append(d.pending, f)
}

func (d *DeferredFrees) fail() { d.Errors++ }

// Pending lists the pointers whose frees are waiting, in the order added.
func (d *DeferredFrees) Pending() []uintptr {
	out := make([]uintptr, len(d.pending))
	for i, f := range d.pending {
		out[i] = f.ptr
	}
	return out
}

// Events is the events the free of ptr waits for; ok is false when one of
// them could not be recorded or queried (only a device-wide
// synchronisation proves that free done), or ptr waits for nothing.
func (d *DeferredFrees) Events(ptr uintptr) (events []arena.Event, ok bool) {
	for _, f := range d.pending {
		if f.ptr == ptr {
			return append([]arena.Event(nil), f.events...), !f.needsSync
		}
	}
	return nil, false
}

// Len is how many frees are waiting.
func (d *DeferredFrees) Len() int { return len(d.pending) }

// Poll queries the events of every waiting free without blocking and calls
// done(ptr) for each free whose events have all completed, in the order the
// frees were added. It returns how many completed.
func (d *DeferredFrees) Poll(done func(ptr uintptr)) int {
	n := 0
	kept := d.pending[:0]
	for _, f := range d.pending {
		if d.complete(&f) {
			done(f.ptr)
			n++
			continue
		}
		kept = append(kept, f)
	}
	clear(d.pending[len(kept):])
	d.pending = kept
	return n
}

// complete drops the events of f that have completed and says whether none
// is left. A failed query keeps the event and marks f as needing a sync.
func (d *DeferredFrees) complete(f *deferredFree) bool {
	left := f.events[:0]
	for _, e := range f.events {
		ok, err := d.events.dev.EventDone(e)
		if err != nil {
			d.fail()
			f.needsSync = true
		}
		if ok && err == nil {
			d.events.Put(e)
			continue
		}
		left = append(left, e)
	}
	f.events = left
	return len(left) == 0 && !f.needsSync
}

// AllComplete is called after a device-wide synchronisation: every waiting
// free has completed, whatever its events say. It calls done for each.
func (d *DeferredFrees) AllComplete(done func(ptr uintptr)) int {
	n := len(d.pending)
	for _, f := range d.pending {
		for _, e := range f.events {
			d.events.Put(e)
		}
		done(f.ptr)
	}
	clear(d.pending)
	d.pending = d.pending[:0]
	return n
}
