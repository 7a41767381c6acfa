package caching

import (
	"fmt"
	"math"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/internal/addrmap"
	"github.com/goalloc/goalloc/streams"
	"github.com/goalloc/goalloc/units"
)

// The Allocator: its state, how New builds it (the memory stack under the
// cache), and the entry points: Malloc and Free route a request to the small
// or large path of its cache pool (small.go, large.go); Holds, the cap
// (SetFraction, SetLimit) and Close.

// MaxRequest is the largest request any device could hold (256 TiB), so
// that size arithmetic below it cannot overflow. Malloc answers a larger
// one as PyTorch's allocator does, out of memory, without asking the
// device; from 2^63 up it is a caller bug (a negative ssize_t cast to
// unsigned), reported as bad input (checkRequest).
const MaxRequest = 1 << 48

// checkRequest refuses a request no device can hold, before any pool
// is asked: bad input from 2^63 up, else out of memory. Called with a.mu
// held.
func (a *Allocator) checkRequest(size uint64) error {
	if size >= 1<<63 {
		return a.badInput("invalid_size", fmt.Sprintf("malloc of %d bytes on device %d: a negative size?", size, a.dev.Ordinal()))
	}
	if size > MaxRequest {
		return a.outOfMemory(size, fmt.Errorf("%d bytes is more than any device has: %w", size, arena.ErrOutOfMemory))
	}
	return nil
}

// Allocator is the caching allocator of one device. All its methods are safe
// for concurrent use; each takes the one mutex once.
type Allocator struct {
	mu statsMutex // Unlock publishes the lock-free figures (counters.go)

	// The fields a request or a free reads come first, after the mutex, so
	// that they share a few cache lines: between two calls in training
	// torch's own work evicts them, and each line is a memory access.

	// cells keeps the statistics every call updates (stats.go).
	cells   *statCells
	history *history
	// callCtx is the context id of the call in progress (MallocInCtx,
	// FreeOwnedCtx, EmptyCacheCtx), 0 outside them and for calls without
	// one; what it names is in history.go, "Context ids".
	callCtx uint64
	// callBlock is the block size the caller of the call in progress
	// rounded its request to (MallocInRounded: PyTorch's
	// roundup_power2_divisions), 0 for goalloc's own rounding.
	callBlock uint64
	// general is the cache of ordinary allocations, and windows the CUDA
	// graph captures in progress, innermost last (graphs.go).
	general *cachePool
	windows []PoolID
	// external is what pools with an allocator of their own hold
	// (external.go).
	external externalTally
	// afterCapture holds the frees that wait for other streams and were
	// made while a capture was underway: their events are recorded when
	// the last window closes (capturesEnd).
	afterCapture []recordedFree
	// recorded maps a live pointer to the streams other than its owner that
	// Tensor.record_stream said use it. It is nil while it would be empty,
	// so that a free finds it empty without reading a map.
	recorded map[uintptr][]arena.Stream
	// blocks holds every large Block, indexed by blockID; unusedIDs are
	// slots of blocks that went back to the pool, ready for reuse.
	blocks []Block
	// largeByAddr finds every large block goalloc holds (live, pending or cached).
	largeByAddr addrmap.Map[blockID]
	// segments holds every small segment, sorted by address, so a pointer
	// finds its segment by binary search, in segmentAddrs. Invariant:
	// segmentAddrs[i] == segments[i].addr.
	segmentAddrs []uintptr
	segments     []*Segment
	// mem is where the cache's memory comes from: dev's memory source under
	// three adaptors (see New), so that the cache itself only caches. A
	// cache hit never reaches it.
	mem      arena.MemorySource
	deferred *streams.DeferredFrees
	// ipc holds the blocks shared with other processes (ipc.go), by
	// address; nil until the first.
	ipc       map[uintptr]*ipcShare
	unusedIDs []blockID

	dev arena.Device
	// limited is the cap on reserved bytes in mem's stack (0: no cap).
	// Invariant: its count of held bytes is reserved(), so no pool
	// allocation is made that would take reserved above the cap.
	limited *arena.Limited
	// counting counts the calls that reach the device (num_device_alloc,
	// num_device_free).
	counting *arena.Counting
	// held reads what the device holds after each call (held.go).
	held *heldObserver
	// heldDrifts: the device's pool may release memory on its own, at
	// synchronisations goalloc does not see (a release threshold below the
	// maximum), so its figure is read again when it is read (held.go).
	heldDrifts bool
	cfg        Config
	// total is the device's memory, read once at creation.
	total uint64
	// reserveBytes is what Config.Reserve pre-warmed; empty_cache trims the
	// pool down to it, not below.
	reserveBytes uint64
	// private holds the pools of CUDA graph captures (graphs.go).
	private map[PoolID]*cachePool
	// tags holds the pools of memory tags (sleep.go), made on first use;
	// tagsInUse says the process uses memory tags, which keeps the front
	// off (SetTagsInUse).
	tags      map[Tag]*cachePool
	tagsInUse bool
	// retained is what the general cache keeps of freed memory (its cached
	// large blocks, least recently freed first, and its empty segments),
	// the Allocator's own so that reclaiming memory (out of memory,
	// empty_cache) walks it as a.lru, a.cachedLarge and a.emptySegs.
	retained

	events *streams.EventPool
	// labels are stamped on every history entry (SetTraceLabels); nil for
	// none.
	labels *TraceLabels
	// pendingCtx holds the context ids of frees that wait for other
	// streams, by pointer, for their free_completed entries; nil while
	// empty. Only frees made with an id are in it.
	pendingCtx map[uintptr]uint64
	// stats is Stats as it stands but for its nine statistics by pool
	// type and its cache hits and misses, which cells keeps (Stats()
	// copies them in).
	stats Stats
}

// New makes the caching allocator of dev. It pre-warms cfg.Reserve of the
// device into the pool and sets the pool's release threshold.
func New(dev arena.Device, cfg Config) (*Allocator, error) {
	_, total, err := dev.MemInfo()
	if err != nil {
		return nil, fmt.Errorf("goalloc: reading device %d memory: %w", dev.Ordinal(), err)
	}
	a := &Allocator{
		dev:     dev,
		cfg:     cfg,
		total:   total,
		private: map[PoolID]*cachePool{},
		stats:   Stats{BadInput: map[string]int64{}},
		cells:   new(statCells),
	}
	a.retained.lru = emptyList()
	var perStream uint64
	if g, ok := dev.(arena.StreamGranular); ok {
		perStream = g.StreamGranule()
	}
	a.general = newGeneralPool(&a.retained, cfg, perStream)
	a.mu.watch(a.cells)
	a.mu.drain = a.drainFront
	a.events = streams.NewEventPool(dev)
	a.deferred = streams.NewDeferredFrees(a.events)
	var limit uint64
	if cfg.Fraction > 0 {
		limit = fractionLimit(cfg.Fraction, total)
	}
	// The stack, bottom up: the device's memory source, capped in what it
	// holds (the VMM backend caps itself; the stream-ordered pool gets
	// arena.PoolCapped); the cap on goalloc's own count, which refuses
	// before the device is asked and passes itself down (arena.Capped), so
	// that the cap bounds what the device holds, which the device's
	// placement and rounding make more than goalloc's own count; the
	// counts, which see only calls that reached the device (and time them,
	// without the reads above them); the observer of what the device holds
	// (held.go); on an out-of-memory, from the cap or the device, the hook
	// reclaims cached memory and says whether to retry.
	var src arena.MemorySource = dev
	if _, ok := dev.(arena.Capped); !ok {
		src = arena.NewPoolCapped(dev, a.settle)
		a.heldDrifts = cfg.ReleaseThreshold != math.MaxUint64
	}
	a.limited = arena.NewLimited(src, limit)
	a.counting = arena.NewCounting(a.limited)
	a.held = newHeldObserver(a.counting, &a.mu.held)
	a.mem = arena.NewRetrying(a.held, a.retryAfterOOM)
	if err := dev.SetReleaseThreshold(cfg.ReleaseThreshold); err != nil {
		return nil, fmt.Errorf("goalloc: setting the pool release threshold on device %d: %w", dev.Ordinal(), err)
	}
	if cfg.Reserve > 0 {
		if err := a.prewarm(uint64(cfg.Reserve * float64(total))); err != nil {
			return nil, err
		}
	}
	a.mu.Lock()
	a.refreshHeld()
	a.mu.Unlock()
	return a, nil
}

// refreshHeld reads what the device holds after something changed it
// outside the memory stack (pre-warming, a new cap, a reset of its
// high-water mark, empty_cache's synchronisations). Called with a.mu held.
func (a *Allocator) refreshHeld() { a.held.refresh() }

// settle is the pool cap's wait for the free of an allocation it undid
// (arena.PoolCapped): a device synchronisation, as the out-of-memory path
// makes, except while a capture is open, which it would break. Called from
// the memory stack, with a.mu held.
func (a *Allocator) settle() {
	if a.capturing() {
		return
	}
	if a.dev.Synchronize() == nil {
		a.stats.NumSyncAllStreams++
	}
}

// prewarm makes the pool reserve n bytes by allocating and freeing them, so
// that the pool holds them (release threshold permitting) for later requests.
// It asks the device itself, under the adaptors: the pair holds nothing
// afterwards and is not one of the cache's device calls.
func (a *Allocator) prewarm(n uint64) error {
	n = units.RoundUp(n, 2<<20)
	if limit := a.limited.Limit(); limit > 0 && n > limit {
		// ParseConfig keeps the reserve at or under the fraction; only the
		// rounding up can pass the cap. Round down instead.
		n = limit / (2 << 20) * (2 << 20)
	}
	if n == 0 {
		return nil
	}
	p, err := a.dev.Alloc(n, 0)
	if err != nil {
		return fmt.Errorf("goalloc: pre-warming %d bytes on device %d: %w", n, a.dev.Ordinal(), err)
	}
	if err := a.dev.Free(p, n, 0); err != nil {
		return fmt.Errorf("goalloc: pre-warming device %d: %w", a.dev.Ordinal(), err)
	}
	a.reserveBytes = n
	if err := a.dev.Synchronize(); err != nil {
		return err
	}
	// The stream-ordered pool maps whole chunks: a reserve just under the
	// cap can leave it holding more than the cap. The cap wins.
	if limit := a.limited.Limit(); limit > 0 {
		if u, err := a.dev.PoolUsage(); err == nil && u.ReservedCurrent > limit {
			a.reserveBytes = 0
			if err := a.dev.Trim(0); err != nil {
				return fmt.Errorf("goalloc: pre-warming device %d: %w", a.dev.Ordinal(), err)
			}
			return a.limited.ResetPoolHigh()
		}
	}
	return nil
}

// Device is the device this allocator takes memory from.
func (a *Allocator) Device() arena.Device { return a.dev }

// Total is the device's memory in bytes.
func (a *Allocator) Total() uint64 { return a.total }

func (a *Allocator) reserved() uint64 { return uint64(a.cells.current(StatAll, statReservedBytes)) }

// Malloc returns size bytes usable by work on stream s. Size 0 gets a unique
// 512-byte block, so that every successful call returns a distinct pointer.
//
// The fast path (a cached slot or block of the right size on s) takes the
// mutex once, allocates nothing on the Go heap and never calls the driver.
func (a *Allocator) Malloc(size uint64, s arena.Stream) (uintptr, error) { return a.malloc(0, size, s) }

// malloc is Malloc in memory tag tag (0: untagged; sleep.go): a capture's
// allocation goes to the capture's pool whatever the tag, any other to the
// tag's pool.
func (a *Allocator) malloc(tag Tag, size uint64, s arena.Stream) (uintptr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if size > MaxRequest {
		return 0, a.checkRequest(size)
	}
	cp := a.general
	var err error
	if a.capturing() {
		if cp, err = a.captureTarget(s); err != nil {
			return 0, err
		}
	}
	if cp == a.general && tag != 0 {
		if cp, err = a.tagPool(tag); err != nil {
			return 0, err
		}
	}
	return a.mallocIn(cp, size, s)
}

// mallocIn is Malloc from the cache pool cp, with a.mu held.
func (a *Allocator) mallocIn(cp *cachePool, size uint64, s arena.Stream) (uintptr, error) {
	if a.deferred.Len() > 0 {
		// Frees waiting for other streams complete as soon as they can, as
		// PyTorch's allocator processes its events at every malloc: the
		// owner then gets its block back where it would under PyTorch.
		a.pollDeferred()
	}
	l := cp.last
	if l == nil || l.stream != s {
		l = cp.list(s)
	}
	if size <= smallMax && a.callBlock <= smallMax {
		c := sizeToClass[(size+classAlign-1)/classAlign]
		if seg := l.small[c].head; seg != nil {
			a.cells.hit()
			return a.takeSlot(l, seg, size), nil
		}
		return a.mallocSmallSlow(l, c, size)
	}
	n := units.RoundUp(max(size, a.callBlock), classAlign)
	if id, bucket := a.findCached(l, n); id != noBlock {
		a.cells.hit()
		return a.takeBlock(id, bucket, size), nil
	}
	return a.mallocLargeSlow(l, n, size)
}

// Free returns ptr, which Malloc returned for size bytes on stream s. The
// pointer decides what is freed: a wrong size or stream is reported (as an
// *InputError) but the block is freed all the same, on the stream it was
// allocated on, since that is the stream its memory is ordered on.
func (a *Allocator) Free(ptr uintptr, size uint64, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.freeLocked(ptr, size, s)
}

// freeLocked is Free with a.mu held.
func (a *Allocator) freeLocked(ptr uintptr, size uint64, s arena.Stream) error {
	// The size says where to look first (a small request's slot, or a large
	// block), but the pointer decides: a wrong size still finds its block.
	if size <= smallMax {
		if seg := a.findSegment(ptr); seg != nil {
			return a.freeInSegment(seg, ptr, size, s)
		}
	}
	if id, ok := a.largeByAddr.Get(ptr); ok {
		return a.freeBlock(id, ptr, size, s)
	}
	if size > smallMax {
		if seg := a.findSegment(ptr); seg != nil {
			return a.freeInSegment(seg, ptr, size, s)
		}
	}
	if ptr == 0 {
		return a.badInput("null_pointer", fmt.Sprintf("free of a NULL pointer on device %d", a.dev.Ordinal()))
	}
	return a.badInput("unknown_pointer", fmt.Sprintf("free of %#x on device %d: goalloc did not allocate it on this device", ptr, a.dev.Ordinal()))
}

// freeInSegment frees the slot of seg that starts at ptr.
func (a *Allocator) freeInSegment(seg *Segment, ptr uintptr, size uint64, s arena.Stream) error {
	if i := seg.slotOf(ptr); i >= 0 {
		return a.freeSlot(seg, i, ptr, size, s)
	}
	return a.badInput("unknown_pointer", fmt.Sprintf("free of %#x on device %d: inside a goalloc segment but not the start of a block", ptr, a.dev.Ordinal()))
}

func (a *Allocator) countAlloc(t StatType, held int64, requested uint64) {
	a.cells.add(t, statAllocation, 1)
	a.cells.add(t, statAllocatedBytes, held)
	a.cells.add(t, statRequestedBytes, int64(requested))
	a.cells.add(t, statActive, 1)
	a.cells.add(t, statActiveBytes, held)
}

func (a *Allocator) countFree(t StatType, held int64, requested uint64) {
	a.cells.sub(t, statAllocation, 1)
	a.cells.sub(t, statAllocatedBytes, held)
	a.cells.sub(t, statRequestedBytes, int64(requested))
}

// Holds says whether ptr is the start of a block or slot goalloc holds on
// this device, live or not. It counts nothing: the library asks it to find
// the device of a pointer torch names without one (record_stream).
func (a *Allocator) Holds(ptr uintptr) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.largeByAddr.Get(ptr); ok {
		return true
	}
	seg := a.findSegment(ptr)
	return seg != nil && seg.slotOf(ptr) >= 0
}

// SetFraction caps reserved memory at fraction x the device's memory, as
// torch.cuda.set_per_process_memory_fraction does.
func (a *Allocator) SetFraction(fraction float64) error {
	if err := CheckFraction(fraction); err != nil {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.badInput("invalid_fraction", fmt.Sprintf("device %d: memory fraction %v", a.dev.Ordinal(), err))
	}
	return a.SetLimit(fractionLimit(fraction, a.total))
}

// SetLimit caps reserved memory at limit bytes (0: no cap). Lowering the cap
// releases cached memory until reserved fits under it, as far as live
// memory allows.
func (a *Allocator) SetLimit(limit uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.limited.SetLimit(limit)
	defer a.refreshHeld() // a device that caps itself releases free memory at once
	a.refreshHeld()
	if held, _ := a.mu.held.get(); limit > 0 && max(a.reserved(), uint64(held)) > limit {
		if a.capturing() { // synchronising would break the capture
			a.reclaim(false)
			return nil
		}
		return a.releaseAll()
	}
	return nil
}

// Limit is the cap on reserved bytes, 0 if none.
func (a *Allocator) Limit() uint64 {
	return a.limited.Limit()
}

// Close gives everything back to the pool and destroys it. Live blocks are
// lost with it; Close is for process exit and tests.
func (a *Allocator) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.events.Close()
	return a.dev.Close()
}
