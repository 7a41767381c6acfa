package caching

import (
	"errors"
	"fmt"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/units"
)

// Asking the memory stack for memory (poolAlloc, the one place the cache
// does), and out of memory: the stack's retry hook, the reclaim rounds
// before giving up, and the OOMError a refused request gets.

// poolAlloc takes n bytes from the pool for a request of size bytes,
// through the stack that enforces the cap and reclaims when the cap or the
// driver says no (retryAfterOOM).
func (a *Allocator) poolAlloc(n uint64, l *StreamFreeList, size uint64) (uintptr, error) {
	p, err := l.pool.rule.alloc(a.mem, n, l.stream)
	if err == nil {
		return p, nil
	}
	if !errors.Is(err, arena.ErrOutOfMemory) {
		return 0, fmt.Errorf("goalloc: device %d: %w", a.dev.Ordinal(), err)
	}
	return 0, a.outOfMemory(size, err)
}

// retryAfterOOM is the stack's out-of-memory hook: a pool allocation of n
// bytes failed, from the cap or the driver, after attempt retries. It
// reclaims in two rounds before giving up (see doc.go, "Out of memory").
// It runs inside poolAlloc, with a.mu held.
func (a *Allocator) retryAfterOOM(n uint64, attempt int, _ error) bool {
	if limit := a.limited.Limit(); attempt == 2 || n > a.total || (limit > 0 && n > limit) {
		// Nothing to reclaim can make a request larger than the device
		// or the cap fit.
		return false
	}
	a.stats.NumAllocRetries++
	a.reclaim(attempt == 1)
	return true
}

// reclaim gives every cached byte back to the pool and trims the pool.
// With sync (the last step before an out-of-memory) it also waits for the
// whole device, which completes every deferred free; see releaseAll.
func (a *Allocator) reclaim(sync bool) {
	if sync && !a.capturing() { // synchronising would break a capture
		_ = a.releaseAll()
		return
	}
	a.pollDeferred()
	a.releaseCached(0)
	a.releaseEmptySegments()
	_ = a.mem.Trim(a.reserveBytes)
}

// OOMError is a request that failed for lack of memory, with what a person
// needs to understand why.
type OOMError struct {
	Device                      int
	Requested                   uint64
	Limit, Total                uint64
	Reserved, Allocated, Cached uint64 // Reserved: what the device holds, the figure the cap bounds (held.go)
	LargestFree                 uint64
	Cause                       error
}

func (e *OOMError) Error() string {
	limit := "no cap"
	if e.Limit > 0 {
		limit = fmt.Sprintf("cap %s", units.FormatBytes(e.Limit))
	}
	return fmt.Sprintf("goalloc: out of memory on device %d: %s requested; %s, device %s; reserved %s, allocated %s, cached free %s, largest free cached block %s (%v)",
		e.Device, units.FormatBytes(e.Requested), limit, units.FormatBytes(e.Total), units.FormatBytes(e.Reserved),
		units.FormatBytes(e.Allocated), units.FormatBytes(e.Cached), units.FormatBytes(e.LargestFree), e.Cause)
}

func (e *OOMError) Unwrap() error { return arena.ErrOutOfMemory }

func (a *Allocator) outOfMemory(size uint64, cause error) error {
	a.stats.NumOOMs++
	f := a.fragmentation()
	if a.history != nil {
		a.history.add(actionOOM, 0, size, 0, a.callCtx)
	}
	held, _ := a.mu.held.get()
	return &OOMError{
		Device: a.dev.Ordinal(), Requested: size, Limit: a.limited.Limit(), Total: a.total,
		Reserved: uint64(held), Allocated: uint64(a.cells.current(StatAll, statAllocatedBytes)),
		Cached: f.FreeBytes, LargestFree: f.LargestFreeBlock, Cause: cause,
	}
}
