package caching

import "github.com/goalloc/goalloc/arena"

// What the device holds for this allocator, when the device can say so
// exactly.
//
// goalloc's own reserved figure counts its segments and blocks: what it took
// from its memory source. A source that places physical memory itself, the
// VMM backend, holds more than that: its page and granule rounding, and
// free memory it keeps mapped for a stream's next request (arena's
// segments). Its PoolUsage is the physical memory it holds, exactly, and
// the cap already bounds that figure (arena.Capped). For such a source
// memory_reserved() and max_memory_reserved() report the physical figure,
// so that they agree with what the device lost (torch.cuda.mem_get_info) up
// to memory outside the allocator; the small_pool and large_pool parts of
// reserved_bytes stay goalloc's own segments. The stream-ordered pool's
// figure is not used this way (yet): reading it is a driver call, the pool
// may release memory on its own at synchronisations (below its release
// threshold), and the cap does not bound it.

// heldObserver is a MemorySource adaptor that, after every call that can
// change what its device holds, reads the device's figure into Stats. Every
// call reaches it under the allocator's mutex, like Stats itself.
type heldObserver struct {
	arena.MemorySource
	st *Stats
}

// observesHeld says whether dev's own reserved figure is exact, the
// physical memory it holds for this allocator: a device that caps that
// memory itself.
func observesHeld(dev arena.Device) bool {
	_, ok := dev.(arena.Capped)
	return ok
}

// refresh reads the device's figure; a failed read keeps the last one.
func (o *heldObserver) refresh() {
	if u, err := o.MemorySource.PoolUsage(); err == nil {
		o.st.heldNow, o.st.heldHigh = int64(u.ReservedCurrent), int64(u.ReservedHigh)
	}
}

func (o *heldObserver) Alloc(size uint64, s arena.Stream) (uintptr, error) {
	p, err := o.MemorySource.Alloc(size, s)
	o.refresh()
	return p, err
}

func (o *heldObserver) AllocUncaptured(size uint64) (uintptr, error) {
	p, err := o.MemorySource.AllocUncaptured(size)
	o.refresh()
	return p, err
}

func (o *heldObserver) Free(ptr uintptr, size uint64, s arena.Stream) error {
	err := o.MemorySource.Free(ptr, size, s)
	o.refresh()
	return err
}

func (o *heldObserver) Trim(keep uint64) error {
	err := o.MemorySource.Trim(keep)
	o.refresh()
	return err
}

// reservedAll is reserved_bytes.all's current and peak as reported: the
// device's figure where it is exact, goalloc's own otherwise.
func (s *Stats) reservedAll() (current, peak int64) {
	if s.heldExact {
		return s.heldNow, s.heldHigh
	}
	return s.ReservedBytes[StatAll].Current, s.ReservedBytes[StatAll].Peak
}
