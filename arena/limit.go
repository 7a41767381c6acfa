package arena

import "go.uber.org/atomic"

// Limited is a MemorySource that refuses to hold more than a cap, in the
// manner of RMM's limiting_resource_adaptor: it counts the bytes it handed
// out and not yet took back, and an allocation that would take that count
// above the cap fails with ErrCapReached, which wraps ErrOutOfMemory, before
// the source under it is asked.
//
// Only allocations and frees that pass through it count, so the cap bounds
// exactly what its user reserved through it. The source under it may hold
// more than that (the VMM backend rounds to its granularity, the
// stream-ordered pool maps whole chunks and keeps freed memory); a source
// that caps what it holds (Capped: the VMM backend, or the pool under
// PoolCapped) is given the same cap.
//
// A cap of 0 means none. Concurrent calls are safe: an allocation claims its
// bytes before it asks the source and gives them back if the source says no.
type Limited struct {
	MemorySource
	limit atomic.Uint64
	held  atomic.Uint64
	// claimed is the part of held that Claim counted: memory outside the
	// source. A source that caps itself is given the cap less it, so that
	// together they stay under the cap.
	claimed atomic.Uint64
}

// ErrCapReached is the error of an allocation the cap refused.
var ErrCapReached error = capError{}

type capError struct{}

func (capError) Error() string        { return "the cap on reserved memory was reached" }
func (capError) Is(target error) bool { return target == ErrOutOfMemory }

// NewLimited caps src at limit bytes (0: no cap).
func NewLimited(src MemorySource, limit uint64) *Limited {
	l := &Limited{MemorySource: src}
	l.SetLimit(limit)
	return l
}

// SetLimit changes the cap (0: no cap). Bytes already held above a lowered
// cap stay held; only new allocations are refused.
func (l *Limited) SetLimit(limit uint64) {
	l.limit.Store(limit)
	l.capSource()
}

// capSource gives a source that caps itself the cap less what Claim
// counted outside it (at least one byte: a cap of 0 means none).
func (l *Limited) capSource() {
	c, ok := l.MemorySource.(Capped)
	if !ok {
		return
	}
	limit := l.limit.Load()
	if limit > 0 {
		limit = max(1, limit-min(limit, l.claimed.Load()))
	}
	c.SetCap(limit)
}

// Limit is the cap in bytes, 0 if none.
func (l *Limited) Limit() uint64 { return l.limit.Load() }

// Held is the bytes allocated through l and not freed.
func (l *Limited) Held() uint64 { return l.held.Load() }

// Claim counts size bytes held by something outside the source under the
// cap (a pool with an allocator of its own), or refuses them with
// ErrCapReached; Unclaim gives them back.
func (l *Limited) Claim(size uint64) error {
	if !l.claim(size) {
		return ErrCapReached
	}
	l.claimed.Add(size)
	l.capSource()
	return nil
}

// Unclaim gives back a Claim.
func (l *Limited) Unclaim(size uint64) {
	l.held.Sub(size)
	l.claimed.Sub(size)
	l.capSource()
}

// claim takes size bytes under the cap, or says the cap refuses them.
func (l *Limited) claim(size uint64) bool {
	held := l.held.Add(size)
	if limit := l.limit.Load(); limit > 0 && held > limit {
		l.held.Sub(size)
		return false
	}
	return true
}

// Suspend takes n bytes of memory put to sleep out of the cap's count: it
// holds nothing on the device while it sleeps (caching/sleep.go).
func (l *Limited) Suspend(n uint64) { l.held.Sub(n) }

// Resume counts n bytes of sleeping memory again, before it wakes or is
// freed: false, and nothing counted, when the cap has no room for them,
// unless force (memory about to be freed, which the free takes out again).
func (l *Limited) Resume(n uint64, force bool) bool {
	if force {
		l.held.Add(n)
		return true
	}
	return l.claim(n)
}

func (l *Limited) Alloc(size uint64, s Stream) (uintptr, error) {
	if !l.claim(size) {
		return 0, ErrCapReached
	}
	p, err := l.MemorySource.Alloc(size, s)
	if err != nil {
		l.held.Sub(size)
	}
	return p, err
}

func (l *Limited) AllocUncaptured(size uint64) (uintptr, error) {
	if !l.claim(size) {
		return 0, ErrCapReached
	}
	p, err := l.MemorySource.AllocUncaptured(size)
	if err != nil {
		l.held.Sub(size)
	}
	return p, err
}

func (l *Limited) Free(ptr uintptr, size uint64, s Stream) error {
	err := l.MemorySource.Free(ptr, size, s)
	if err == nil {
		l.held.Sub(size)
	}
	return err
}
