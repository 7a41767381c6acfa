package caching

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// Memory of pools with an allocator of their own: torch.cuda.MemPool(
// allocator=...), how NCCL buffer registration and symmetric memory get
// their memory. The C++ class carves such a pool as PyTorch's allocator
// would, from segments the pool's allocator gives (csrc/goalloc_split.h);
// goalloc never holds that memory. It counts it, so that memory_stats(),
// memory_reserved(), the history and the cap of
// set_per_process_memory_fraction see every byte torch's allocator answers
// for, as PyTorch's own allocator counts its pools' segments:
//
//   - a segment is claimed under the cap before the pool's allocator is
//     asked (ClaimExternal), and counted once it is made (ExternalSegment);
//   - a block carved from it is counted as an allocation (ExternalBlock).
//
// Its bytes are in reserved_bytes (the small or large pool as PyTorch
// files the segment, and the device's figure, heldFigure.external), and
// its blocks in allocated, active and requested bytes.

// externalTally is what own-allocator pools hold, for CheckInvariants: the
// figures they add to the statistics, which no block of goalloc's explains.
type externalTally struct {
	segments, reserved, live, allocated, requested [numStatTypes]int64
	claimed                                        uint64 // under the cap: their segments, and claims not yet made
}

func (x *externalTally) add(arr *[numStatTypes]int64, t StatType, n int64) {
	arr[StatAll] += n
	arr[t] += n
}

// unmade is the bytes claimed for segments not made yet: every segment
// made was claimed first, so its bytes are among the claimed.
func (x *externalTally) unmade() uint64 { return x.claimed - uint64(x.reserved[StatAll]) }

// ClaimExternal claims size bytes under the cap for a segment an own-
// allocator pool is about to take, or refuses them with an *OOMError, as a
// request of goalloc's own beyond the cap would be. A claim is given back
// with ExternalSegment(false, ...) once the segment is freed, or with
// UnclaimExternal if the pool's allocator did not give it.
func (a *Allocator) ClaimExternal(size uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if size > MaxRequest {
		return a.checkRequest(size)
	}
	err := a.limited.Claim(size)
	// Over the cap, cached memory goes back first, in the rounds a request
	// of goalloc's own makes (retryAfterOOM).
	for attempt := 1; err != nil && a.retryAfterOOM(size, attempt, err); attempt++ {
		err = a.limited.Claim(size)
	}
	if err != nil {
		return a.outOfMemory(size, err)
	}
	a.external.claimed += size
	return nil
}

// UnclaimExternal gives back a claim whose segment was never made. More
// than the claims not made is refused (invalid_size) and changes nothing:
// taken off the cap's count, it would wrap the count around and make the
// cap refuse every request.
func (a *Allocator) UnclaimExternal(size uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if unmade := a.external.unmade(); size > unmade {
		return a.badInput("invalid_size", fmt.Sprintf("unclaim of %d bytes for own-allocator pools on device %d, which have %d bytes claimed for segments not made", size, a.dev.Ordinal(), unmade))
	}
	a.limited.Unclaim(size)
	a.external.claimed -= size
	return nil
}

// ExternalSegment counts a segment of an own-allocator pool made
// (alloc: after ClaimExternal) or freed (its claim goes back). A segment
// made beyond the claims not made, or freed beyond what the pools' segments
// of its kind (large or small) hold, is refused (invalid_size) and changes
// nothing, so that the cap's count and the statistics never wrap around.
func (a *Allocator) ExternalSegment(alloc bool, addr uintptr, size uint64, large bool, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, n := poolOf(large), int64(size)
	x := &a.external
	if unmade := x.unmade(); alloc && size > unmade {
		return a.badInput("invalid_size", fmt.Sprintf("own-allocator segment %#x of %d bytes made on device %d, where %d bytes are claimed for segments not made", addr, size, a.dev.Ordinal(), unmade))
	}
	if !alloc && (x.segments[t] < 1 || size > uint64(x.reserved[t])) {
		return a.badInput("invalid_size", fmt.Sprintf("own-allocator segment %#x of %d bytes freed on device %d, where own-allocator pools hold %d bytes in %d %s segments", addr, size, a.dev.Ordinal(), x.reserved[t], x.segments[t], poolName(large)))
	}
	if alloc {
		x.add(&x.segments, t, 1)
		x.add(&x.reserved, t, n)
		a.cells.add(t, statSegment, 1)
		a.cells.add(t, statReservedBytes, n)
		a.mu.held.addExternal(n)
		if a.history != nil {
			a.history.add(actionSegmentAlloc, addr, size, s, 0)
		}
		return nil
	}
	x.add(&x.segments, t, -1)
	x.add(&x.reserved, t, -n)
	a.cells.sub(t, statSegment, 1)
	a.cells.sub(t, statReservedBytes, n)
	a.mu.held.addExternal(-n)
	a.limited.Unclaim(size)
	x.claimed -= size
	if a.history != nil {
		a.history.add(actionSegmentFree, addr, size, s, 0)
	}
	return nil
}

// ExternalBlock counts a block carved from an own-allocator pool's segment,
// handed out (alloc) or freed, as PyTorch counts an allocation. A block
// freed beyond what the pools' blocks of its kind hold is refused
// (invalid_size) and changes nothing.
func (a *Allocator) ExternalBlock(alloc bool, addr uintptr, size, requested uint64, large bool, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if size > MaxRequest || requested > size {
		return a.badInput("invalid_size", fmt.Sprintf("own-allocator block %#x of %d bytes for %d requested on device %d", addr, size, requested, a.dev.Ordinal()))
	}
	t, n, x := poolOf(large), int64(size), &a.external
	if !alloc && (x.live[t] < 1 || n > x.allocated[t] || int64(requested) > x.requested[t]) {
		return a.badInput("invalid_size", fmt.Sprintf("own-allocator block %#x of %d bytes (%d requested) freed on device %d, where own-allocator pools hold %d bytes (%d requested) in %d %s blocks", addr, size, requested, a.dev.Ordinal(), x.allocated[t], x.requested[t], x.live[t], poolName(large)))
	}
	sign := int64(1)
	if !alloc {
		sign = -1
	}
	x.add(&x.live, t, sign)
	x.add(&x.allocated, t, sign*n)
	x.add(&x.requested, t, sign*int64(requested))
	if alloc {
		a.countAlloc(t, int64(size), requested)
		if a.history != nil {
			a.history.add(actionAlloc, addr, requested, s, 0)
		}
		return nil
	}
	a.countFree(t, int64(size), requested)
	a.cells.sub(t, statActive, 1)
	a.cells.sub(t, statActiveBytes, int64(size))
	if a.history != nil {
		a.history.add(actionFreeRequested, addr, requested, s, 0)
		a.history.add(actionFreeCompleted, addr, requested, s, 0)
	}
	return nil
}

// poolName names the pool of poolOf(large) in messages.
func poolName(large bool) string {
	if large {
		return "large"
	}
	return "small"
}

// poolOf is the statistics' pool of a segment or block PyTorch files as
// large or small.
func poolOf(large bool) StatType {
	if large {
		return StatLarge
	}
	return StatSmall
}
