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
	Free                        uint64 // what the device had free (cuMemGetInfo) when the request failed
	Reserved, Allocated, Cached uint64 // Reserved: what the device holds, the figure the cap bounds (held.go)
	LargestFree                 uint64
	Cause                       error
}

// maxTorchRequest is PyTorch's bound on one request (one exbibyte): its
// allocator refuses a larger one as out of memory without looking, and so
// does goalloc, in PyTorch's words.
const maxTorchRequest = 1 << 60

// Error opens with PyTorch's own sentences (scripts and tests match "CUDA
// out of memory" and "Tried to allocate"), then says what goalloc held.
func (e *OOMError) Error() string {
	if e.Requested > maxTorchRequest {
		return fmt.Sprintf("CUDA out of memory. Tried to allocate more than 1EB memory. goalloc: device %d (%v)", e.Device, e.Cause)
	}
	limit := "no cap"
	if e.Limit > 0 {
		limit = fmt.Sprintf("cap %s", units.FormatBytes(e.Limit))
	}
	return fmt.Sprintf("CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s is free. "+
		"goalloc on device %d: reserved %s (%s), allocated %s, cached free %s, largest free cached block %s (%v)",
		units.FormatBytes(e.Requested), e.Device, units.FormatBytes(e.Total), units.FormatBytes(e.Free),
		e.Device, units.FormatBytes(e.Reserved), limit, units.FormatBytes(e.Allocated), units.FormatBytes(e.Cached),
		units.FormatBytes(e.LargestFree), e.Cause)
}

func (e *OOMError) Unwrap() error { return arena.ErrOutOfMemory }

func (a *Allocator) outOfMemory(size uint64, cause error) error {
	a.stats.NumOOMs++
	f := a.fragmentation()
	if a.history != nil {
		a.history.add(actionOOM, 0, size, 0, a.callCtx)
	}
	held, _ := a.mu.held.get()
	free, _, err := a.dev.MemInfo()
	if err != nil {
		free = 0 // the message says 0 B free; the cause says why the request failed
	}
	return &OOMError{
		Device: a.dev.Ordinal(), Requested: size, Limit: a.limited.Limit(), Total: a.total, Free: free,
		Reserved: uint64(held), Allocated: uint64(a.cells.current(StatAll, statAllocatedBytes)),
		Cached: f.FreeBytes, LargestFree: f.LargestFreeBlock, Cause: cause,
	}
}
