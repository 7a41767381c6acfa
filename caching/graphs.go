package caching

import (
	"errors"
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// CUDA graphs (see doc.go, "CUDA graphs").
//
// While PyTorch captures a graph it brackets the capture with
// BeginAllocateToPool and EndAllocateToPool, naming a private pool. Every
// allocation made in that window on a stream that is being captured comes
// from that pool's own cache, and memory freed into it stays there: the
// graph's replays read and write exactly the addresses the capture saw, so
// none of it may reach eager code or another graph until torch releases
// the pool (ReleasePool, when the last graph using it is reset).

// PoolID names a private pool, as PyTorch's MempoolId_t does.
type PoolID [2]uint64

// BeginAllocateToPool starts a capture window: until the matching
// EndAllocateToPool, allocations on streams being captured come from the
// private pool id.
func (a *Allocator) BeginAllocateToPool(id PoolID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id == (PoolID{}) {
		return a.badInput("invalid_pool", fmt.Sprintf("begin_allocate_to_pool on device %d with pool id (0, 0), which names no pool", a.dev.Ordinal()))
	}
	p := a.private[id]
	if p == nil {
		p = newGraphPool(id)
		a.private[id] = p
	}
	if p.released {
		// torch reuses a released id only for a new graph: start afresh.
		p.setReleased(false)
	}
	p.users++
	a.windows = append(a.windows, id)
	if len(a.windows) == 1 {
		a.capturesBegin()
	}
	a.publishFront()
	a.stats.GraphBegins++
	return nil
}

// EndAllocateToPool ends the capture window of pool id.
func (a *Allocator) EndAllocateToPool(id PoolID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := len(a.windows) - 1; i >= 0; i-- {
		if a.windows[i] == id {
			a.windows = append(a.windows[:i], a.windows[i+1:]...)
			a.publishFront()
			a.stats.GraphEnds++
			p := a.private[id]
			var errs []error
			for p.deferredReleases > 0 && !a.windowOpen(id) {
				p.deferredReleases--
				errs = append(errs, a.release(p))
			}
			if len(a.windows) == 0 {
				errs = append(errs, a.capturesEnd())
			}
			return errors.Join(errs...)
		}
	}
	return a.badInput("invalid_pool", fmt.Sprintf("end_allocate_to_pool on device %d for pool (%d, %d), which has no capture in progress", a.dev.Ordinal(), id[0], id[1]))
}

// ReleasePool says a graph using pool id is gone. When none is left, the
// pool's free memory goes back to the driver pool, and its live memory
// follows as it is freed.
//
// torch releases a pool when a graph object is destroyed, which may happen
// while a capture into the same pool is still open (the hooks of one
// device arrive in any order from any thread). Releasing then would pull
// the pool from under the open window, so the release is deferred: it is
// counted now and takes effect when the pool's last window ends. A release
// with no graph left to release (more releases than begins) is bad input.
func (a *Allocator) ReleasePool(id PoolID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	p := a.private[id]
	if p == nil || p.users-p.deferredReleases == 0 {
		return a.badInput("invalid_pool", fmt.Sprintf("release_pool on device %d for pool (%d, %d), which goalloc does not hold", a.dev.Ordinal(), id[0], id[1]))
	}
	a.stats.GraphReleases++
	if a.windowOpen(id) {
		p.deferredReleases++
		return nil
	}
	return a.release(p)
}

// capturing says whether any capture window is open: a capture may be
// underway on the device, as PyTorch's captures_underway says. Then an
// allocation may belong to a private pool (captureTarget), and goalloc
// records, queries and synchronises nothing (the driver forbids a query
// from any thread during a capture, and would make a record on a captured
// stream part of the graph): deferred frees are not polled
// (pollDeferred), a free that needs events waits for the end of the
// captures to record them (deferIfRecorded), nothing of a private pool
// goes back to the device (mayFree), and the device's own use of events
// is gated (arena.CaptureAware).
func (a *Allocator) capturing() bool { return len(a.windows) > 0 }

// capturesBegin is called when the first window opens.
func (a *Allocator) capturesBegin() {
	if g, ok := a.dev.(arena.CaptureAware); ok {
		g.SetCaptureUnderway(true)
	}
}

// capturesEnd is called when the last window closes: what waited for the
// end of the captures goes ahead. Frees that need events record them now,
// and the cached memory of private pools released meanwhile goes back.
func (a *Allocator) capturesEnd() error {
	if g, ok := a.dev.(arena.CaptureAware); ok {
		g.SetCaptureUnderway(false)
	}
	for _, f := range a.afterCapture {
		a.deferred.Add(f.ptr, f.used)
	}
	clear(a.afterCapture)
	a.afterCapture = a.afterCapture[:0]
	a.pollDeferred() // nothing captured has run: these usually complete at once
	var errs []error
	for _, p := range a.private {
		if p.released {
			errs = append(errs, a.releaseCachedOf(p))
		}
	}
	return errors.Join(errs...)
}

// windowOpen says whether a capture window of pool id is open.
func (a *Allocator) windowOpen(id PoolID) bool {
	for _, w := range a.windows {
		if w == id {
			return true
		}
	}
	return false
}

// release drops one user of the private pool p; with none left, p's free
// memory goes back to the driver pool. The caller holds a.mu and no window
// of p is open.
func (a *Allocator) release(p *cachePool) error {
	p.users--
	if p.users > 0 {
		return nil
	}
	p.setReleased(true)
	return a.releaseCachedOf(p)
}

// releaseCachedOf gives the free memory of the released private pool p
// back to the device (while a capture is underway, mayFree keeps it until
// capturesEnd), and forgets p if it then holds nothing.
func (a *Allocator) releaseCachedOf(p *cachePool) error {
	var errs []error
	for _, l := range append([]*StreamFreeList(nil), p.lists...) {
		for i := range l.buckets {
			for l.buckets[i].count > 0 {
				if err := a.releaseBlock(l.buckets[i].list.head); err != nil {
					if err != errCapturing {
						errs = append(errs, err)
					}
					break
				}
			}
		}
		for c := range l.small {
			for seg := l.small[c].head; seg != nil; {
				next := seg.next
				if seg.used == 0 {
					if err := a.releaseSegment(seg); err != nil && err != errCapturing {
						errs = append(errs, err)
					}
				}
				seg = next
			}
		}
	}
	a.dropIfEmpty(p)
	return errors.Join(errs...)
}

// dropIfEmpty forgets the private pool p once it is released and holds
// nothing.
func (a *Allocator) dropIfEmpty(p *cachePool) {
	if p.released && p.empty() {
		delete(a.private, p.id)
	}
}

// setReleased marks the private pool p released by torch, or in use again,
// and gives it the limits of its rule for that state: keep nothing, or keep
// everything.
func (p *cachePool) setReleased(released bool) {
	p.released = released
	p.limits = p.rule.limits()
}

// captureTarget picks the cache an allocation on s comes from while a
// capture window is open: the window's private pool if s is being captured.
func (a *Allocator) captureTarget(s arena.Stream) (*cachePool, error) {
	st, err := a.dev.CaptureStatus(s)
	if err != nil {
		return nil, fmt.Errorf("goalloc: device %d: is stream %#x capturing? %w", a.dev.Ordinal(), s, err)
	}
	if st != arena.CaptureActive {
		return a.general, nil
	}
	// The innermost window: PyTorch captures one graph per thread at a time.
	// Its pool exists: a pool with an open window is never released
	// (ReleasePool defers).
	return a.private[a.windows[len(a.windows)-1]], nil
}

var errCapturing = errors.New("a CUDA graph capture is underway")

// mayFree says whether giving memory of pool p back to the device, ordered
// on s, is safe now (the general cache's and the memory tags' pools
// alike). Not while s is being captured: the free would become a node of
// the graph. Nor, while any capture is underway, memory of a private
// pool: it was taken outside the captures for any stream's use
// (AllocUncaptured), so its free needs events, which wait for the end of
// the captures (capturesEnd gives it back then).
func (a *Allocator) mayFree(p *cachePool, s arena.Stream) error {
	if !a.capturing() {
		return nil
	}
	if p.id != (PoolID{}) {
		return errCapturing
	}
	st, err := a.dev.CaptureStatus(s)
	if err != nil {
		return err
	}
	if st != arena.CaptureNone {
		return errCapturing
	}
	return nil
}

// GraphPools reports the private pools: how many, and the bytes they hold.
func (a *Allocator) graphPoolBytes() (pools int, reserved uint64) {
	for _, p := range a.private {
		pools++
		reserved += p.reserved
	}
	return pools, reserved
}
