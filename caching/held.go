package caching

import "github.com/goalloc/goalloc/arena"

// What the device holds for this allocator.
//
// goalloc's own reserved figure counts its segments and blocks: what it took
// from its memory source. The source holds more than that, on both
// backends. The VMM backend rounds to its 2 MiB granules and keeps free
// memory mapped for a stream's next request (arena's segments). The
// stream-ordered pool (backend:async) maps physical memory in 32 MiB chunks
// that one live allocation pins, and keeps what goalloc frees to it until it
// is trimmed. Each says exactly what it holds (PoolUsage: for the pool,
// CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT and _HIGH), and the cap bounds that
// figure, not goalloc's own (arena.Capped: the VMM backend caps itself, the
// pool is capped by arena.PoolCapped). So memory_reserved() and
// max_memory_reserved() report the device's figure, and agree with what the
// device lost (torch.cuda.mem_get_info) up to memory outside the allocator;
// the small_pool and large_pool parts of reserved_bytes stay goalloc's own
// segments and blocks, and goalloc.own_reserved_bytes is goalloc's own
// total.
//
// The figure is read when it is next wanted after a call that reached the
// memory source (a miss, a free to the source, a trim: the observer marks
// it stale, and heldFigure.get reads it again first), and at once after the
// calls that change it outside the stack (empty_cache, a new cap, a reset
// of the peaks); never on the cache-hit path: reading it is a driver call
// on the pool, and a lock of the VMM backend's. So a miss, which gives a
// cached block back and then takes its memory (two calls to the source),
// reads it once, when the mutex's Unlock publishes it, before the mutex is
// let go; the high-water mark is the source's own, so no peak between two
// reads is lost. Between those calls the VMM backend's figure cannot
// change. The pool's can, in one case: it releases idle memory on its own
// at a synchronisation (of a stream, event or the context) when it holds
// more than its release threshold. goalloc sets the threshold to the
// maximum (Config.ReleaseThreshold), so by default the pool releases memory
// only when goalloc trims it, and the figure so read is exact. A user who
// sets release_threshold below the maximum lets the pool release at
// synchronisations goalloc does not see; then the figure is read again
// whenever it is read (Stats, and the published scalars, see
// reservedFigure): one driver call more per memory_reserved().

// heldFigure is what the device holds and its high-water mark as of the
// last read: reserved_bytes.all's current and peak (get). It lives in the
// allocator's mutex (statsMutex), whose Unlock publishes it, and is read and
// written under that mutex.
type heldFigure struct {
	// stale: a call reached the memory source since now and high were
	// read. unpublished: they were read since Unlock last published them.
	// Every Unlock reads both, so they come first, in the mutex's first
	// cache line; now and high are read only when one of them is set.
	stale, unpublished bool
	now, high          int64
	// external is what pools with an allocator of their own hold
	// (external.go): the device's figure does not include it, so now adds
	// it, and high follows now where now passes it.
	external int64
	// read reads them (the observer's refresh; nil before there is one).
	read func()
}

// get is reserved_bytes.all's current and peak as reported: the device's
// figure, read again first if a call reached the device since the last
// read.
func (h *heldFigure) get() (now, high int64) {
	if h.stale && h.read != nil {
		h.read()
	}
	return h.now, h.high
}

// heldObserver is a MemorySource adaptor that, after every call that can
// change what its device holds, marks the device's figure stale;
// heldFigure.get reads it again (refresh) before it answers. Every call
// reaches it under the allocator's mutex, which holds the figure.
type heldObserver struct {
	arena.MemorySource
	h *heldFigure
}

func newHeldObserver(src arena.MemorySource, h *heldFigure) *heldObserver {
	o := &heldObserver{MemorySource: src, h: h}
	h.read = o.refresh
	return o
}

// refresh reads the device's figure; a failed read keeps the last one (and
// is not tried again until the source is called again).
func (o *heldObserver) refresh() {
	o.h.stale = false
	if u, err := o.MemorySource.PoolUsage(); err == nil {
		o.h.now, o.h.high = int64(u.ReservedCurrent)+o.h.external, int64(u.ReservedHigh)+o.h.external
		o.h.unpublished = true
	}
}

// addExternal adds d bytes to what own-allocator pools hold. The peak is
// the device's peak plus what they held when it was read, or a later now:
// a peak of theirs between two reads while the device held less is not
// seen (their peak and the device's are not taken at the same moment).
func (h *heldFigure) addExternal(d int64) {
	h.external += d
	h.now += d
	h.high = max(h.high, h.now)
	h.unpublished = true
}

func (o *heldObserver) Alloc(size uint64, s arena.Stream) (uintptr, error) {
	p, err := o.MemorySource.Alloc(size, s)
	o.h.stale = true
	return p, err
}

func (o *heldObserver) AllocUncaptured(size uint64) (uintptr, error) {
	p, err := o.MemorySource.AllocUncaptured(size)
	o.h.stale = true
	return p, err
}

func (o *heldObserver) Free(ptr uintptr, size uint64, s arena.Stream) error {
	err := o.MemorySource.Free(ptr, size, s)
	o.h.stale = true
	return err
}

func (o *heldObserver) Trim(keep uint64) error {
	err := o.MemorySource.Trim(keep)
	o.h.stale = true
	return err
}

// reservedFigure reads again what a pool that releases memory on its own
// holds (heldDrifts) before a reserved figure is read; it is the published
// scalars' only path to the driver, and only with a release threshold below
// the maximum. The Unlock publishes what it read.
func (a *Allocator) reservedFigure(k Scalar) {
	if a.heldDrifts && (k == ScalarReservedBytes || k == ScalarReservedBytesPeak) {
		a.mu.Lock()
		a.refreshHeld()
		a.mu.Unlock()
	}
}
