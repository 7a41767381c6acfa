package arena

import (
	"sync"

	"go.uber.org/atomic"
)

// PoolCapped is a MemorySource that bounds what a stream-ordered pool holds
// (its own reserved figure, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), not only
// what its user took from it: the pool places memory itself, maps physical
// memory in chunks (32 MiB on an H200, simpool.go) and keeps freed memory,
// so it can hold more than the bytes handed out. It is a Capped source, so
// Limited, above it, passes it the cap.
//
// The pool says nothing before it maps memory, so the rule is checked
// after each allocation, off the cache-hit path: when the allocation took
// the pool over the cap, it is given back and the pool trimmed (where the
// pool still holds more than the cap, because the free has not completed,
// the frees are let complete first: settle, a device synchronisation where
// one is allowed, as the out-of-memory path makes), and the allocation fails
// with ErrCapReached, which the caller's out-of-memory path (Retrying)
// meets as it meets the driver's own out-of-memory: it reclaims and asks
// again, and the pool places the request in what is left. Nothing is
// trimmed before: the pool moves an idle physical chunk under any part of
// its range (simpool.go), so memory it holds idle never makes it grow, and
// trimming it first would only make it map that memory again.
//
// So after every call returns the pool holds at most the cap, except where
// settling is not allowed (a CUDA graph capture is open): then the refused
// allocation's memory goes back to the driver at the next synchronisation.
//
// The refused allocation was mapped for a moment, and the driver's
// high-water mark saw it. PoolUsage reports the high-water mark of what the
// pool held after calls returned instead: when it undoes an allocation, it
// resets the driver's mark and keeps the mark from before the allocation
// (floor), and reports the greater of the two.
//
// A cap of 0 means none: every call then passes straight through.
type PoolCapped struct {
	MemorySource
	cap    atomic.Uint64
	settle func()

	mu sync.Mutex // serialises allocations under a cap, and floor
	// floor is the pool's high-water marks as they were before the last
	// undone allocation, kept across the reset that forgot it.
	floor PoolUsage
}

// NewPoolCapped caps the pool src (no cap until SetCap). settle waits until
// the frees made so far have completed, where the caller allows it; it is
// called with the caller's locks held.
func NewPoolCapped(src MemorySource, settle func()) *PoolCapped {
	return &PoolCapped{MemorySource: src, settle: settle}
}

// SetCap bounds what the pool holds at limit bytes (0: no bound). Memory the
// pool already holds above a lowered cap stays until it is freed and
// trimmed; only growth is refused.
func (c *PoolCapped) SetCap(limit uint64) { c.cap.Store(limit) }

// uncapturedFreer is a source that can give an AllocUncaptured allocation
// back at once, outside any capture (its own side stream).
type uncapturedFreer interface {
	FreeUncaptured(ptr uintptr, size uint64) error
}

func (c *PoolCapped) Alloc(size uint64, s Stream) (uintptr, error) {
	if c.cap.Load() == 0 {
		return c.MemorySource.Alloc(size, s)
	}
	return c.capped(size,
		func() (uintptr, error) { return c.MemorySource.Alloc(size, s) },
		func(p uintptr) error { return c.MemorySource.Free(p, size, s) })
}

func (c *PoolCapped) AllocUncaptured(size uint64) (uintptr, error) {
	if c.cap.Load() == 0 {
		return c.MemorySource.AllocUncaptured(size)
	}
	return c.capped(size,
		func() (uintptr, error) { return c.MemorySource.AllocUncaptured(size) },
		func(p uintptr) error {
			if f, ok := c.MemorySource.(uncapturedFreer); ok {
				return f.FreeUncaptured(p, size)
			}
			return c.MemorySource.Free(p, size, 0)
		})
}

// capped is the rule: alloc under the cap, undo when the pool passed it.
func (c *PoolCapped) capped(size uint64, alloc func() (uintptr, error), undo func(uintptr) error) (uintptr, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	limit := c.cap.Load()
	if size > limit {
		return 0, ErrCapReached
	}
	before, err := c.MemorySource.PoolUsage()
	if err != nil {
		return 0, err
	}
	p, err := alloc()
	if err != nil {
		return 0, err
	}
	after, err := c.MemorySource.PoolUsage()
	if err == nil && after.ReservedCurrent <= limit {
		return p, nil
	}
	if uerr := undo(p); uerr != nil {
		// The allocation cannot be given back: keep it rather than lose it.
		return p, nil
	}
	// A trim releases only memory whose free it has seen complete; when
	// the free is still pending on its stream, let it complete first.
	_ = c.MemorySource.Trim(0)
	if u, uerr := c.MemorySource.PoolUsage(); uerr != nil || u.ReservedCurrent > limit {
		c.settle()
		_ = c.MemorySource.Trim(0)
	}
	c.floor.ReservedHigh = max(c.floor.ReservedHigh, before.ReservedHigh)
	c.floor.UsedHigh = max(c.floor.UsedHigh, before.UsedHigh)
	_ = c.MemorySource.ResetPoolHigh()
	if err != nil {
		return 0, err
	}
	return 0, ErrCapReached
}

// PoolUsage is the pool's figures, with high-water marks that leave out
// allocations the cap undid.
func (c *PoolCapped) PoolUsage() (PoolUsage, error) {
	u, err := c.MemorySource.PoolUsage()
	c.mu.Lock()
	u.ReservedHigh = max(u.ReservedHigh, c.floor.ReservedHigh)
	u.UsedHigh = max(u.UsedHigh, c.floor.UsedHigh)
	c.mu.Unlock()
	return u, err
}

// ResetPoolHigh resets the pool's high-water marks to what it holds now.
func (c *PoolCapped) ResetPoolHigh() error {
	c.mu.Lock()
	c.floor = PoolUsage{}
	c.mu.Unlock()
	return c.MemorySource.ResetPoolHigh()
}
