package caching

import (
	"errors"
	"fmt"
	"sort"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/streams"
	"github.com/goalloc/goalloc/units"
)

// MaxRequest is the largest size Malloc considers a request at all (256 TiB);
// anything larger is a caller bug (a negative ssize_t cast to unsigned, say),
// reported as bad input rather than as an out-of-memory.
const MaxRequest = 1 << 48

// Allocator is the caching allocator of one device. All its methods are safe
// for concurrent use; each takes the one mutex once.
type Allocator struct {
	mu  statsMutex // Unlock publishes the lock-free figures (counters.go)
	dev arena.Device
	// mem is where the cache's memory comes from: dev's memory source under
	// three adaptors (see New), so that the cache itself only caches. A
	// cache hit never reaches it.
	mem arena.MemorySource
	// limited is the cap on reserved bytes in mem's stack (0: no cap).
	// Invariant: its count of held bytes is reserved(), so no pool
	// allocation is made that would take reserved above the cap.
	limited *arena.Limited
	// counting counts the calls that reach the device (num_device_alloc,
	// num_device_free).
	counting *arena.Counting
	cfg      Config
	// total is the device's memory, read once at creation.
	total uint64
	// reserveBytes is what Config.Reserve pre-warmed; empty_cache trims the
	// pool down to it, not below.
	reserveBytes uint64

	// general is the cache of ordinary allocations; private holds the
	// pools of CUDA graph captures (graphs.go), and windows the captures in
	// progress, innermost last.
	general *cachePool
	private map[PoolID]*cachePool
	windows []PoolID

	// blocks holds every large Block, indexed by blockID; unusedIDs are
	// slots of blocks that went back to the pool, ready for reuse.
	blocks    []Block
	unusedIDs []blockID
	// largeByAddr finds every large block goalloc holds (live, pending or cached).
	largeByAddr map[uintptr]blockID
	// lru lists every cached large block, least recently freed first.
	lru blockList
	// cachedLarge is the bytes of cached large blocks. Invariant: it equals
	// the sum of the sizes of blocks in state blockCached.
	cachedLarge uint64

	// segments holds every small segment, sorted by address, so a pointer
	// finds its segment by binary search.
	segments []*Segment
	// emptySegs lists the empty segments the general cache keeps against
	// churn, oldest first.
	emptySegs emptySegments

	events   *streams.EventPool
	deferred *streams.DeferredFrees
	// recorded maps a live pointer to the streams other than its owner that
	// Tensor.record_stream said use it.
	recorded map[uintptr][]arena.Stream

	stats   Stats
	history *history
}

// New makes the caching allocator of dev. It pre-warms cfg.Reserve of the
// device into the pool and sets the pool's release threshold.
func New(dev arena.Device, cfg Config) (*Allocator, error) {
	_, total, err := dev.MemInfo()
	if err != nil {
		return nil, fmt.Errorf("goalloc: reading device %d memory: %w", dev.Ordinal(), err)
	}
	a := &Allocator{
		dev:         dev,
		cfg:         cfg,
		total:       total,
		largeByAddr: map[uintptr]blockID{},
		general:     &cachePool{},
		private:     map[PoolID]*cachePool{},
		lru:         emptyList(),
		recorded:    map[uintptr][]arena.Stream{},
		stats:       Stats{BadInput: map[string]int64{}},
	}
	a.mu.watch(&a.stats)
	a.events = streams.NewEventPool(dev)
	a.deferred = streams.NewDeferredFrees(a.events)
	var limit uint64
	if cfg.Fraction > 0 {
		limit = fractionLimit(cfg.Fraction, total)
	}
	// The stack, bottom up: the cap refuses before the device is asked (and
	// passes itself to a device that caps its physical memory, the VMM
	// backend, so that the cap bounds what the device holds, which rounding
	// makes a little more than goalloc's own count); the counts see only
	// calls that reached the device; on an out-of-memory, from the cap or
	// the device, the hook reclaims cached memory and says whether to retry.
	a.limited = arena.NewLimited(dev, limit)
	a.counting = arena.NewCounting(a.limited)
	a.mem = arena.NewRetrying(a.counting, a.retryAfterOOM)
	if err := dev.SetReleaseThreshold(cfg.ReleaseThreshold); err != nil {
		return nil, fmt.Errorf("goalloc: setting the pool release threshold on device %d: %w", dev.Ordinal(), err)
	}
	if cfg.Reserve > 0 {
		if err := a.prewarm(uint64(cfg.Reserve * float64(total))); err != nil {
			return nil, err
		}
	}
	return a, nil
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
	return a.dev.Synchronize()
}

// Device is the device this allocator takes memory from.
func (a *Allocator) Device() arena.Device { return a.dev }

// Total is the device's memory in bytes.
func (a *Allocator) Total() uint64 { return a.total }

// Malloc returns size bytes usable by work on stream s. Size 0 gets a unique
// 512-byte block, so that every successful call returns a distinct pointer.
//
// The fast path (a cached slot or block of the right size on s) takes the
// mutex once, allocates nothing on the Go heap and never calls the driver.
func (a *Allocator) Malloc(size uint64, s arena.Stream) (uintptr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if size > MaxRequest {
		return 0, a.badInput("invalid_size", fmt.Sprintf("malloc of %d bytes on device %d: larger than any device (a negative size?)", size, a.dev.Ordinal()))
	}
	cp := a.general
	if len(a.windows) > 0 {
		var err error
		if cp, err = a.captureTarget(s); err != nil {
			return 0, err
		}
	}
	return a.mallocIn(cp, size, s)
}

// mallocIn is Malloc from the cache pool cp, with a.mu held.
func (a *Allocator) mallocIn(cp *cachePool, size uint64, s arena.Stream) (uintptr, error) {
	l := cp.last
	if l == nil || l.stream != s {
		l = cp.list(s)
	}
	if size <= smallMax {
		c := sizeToClass[(size+classAlign-1)/classAlign]
		if seg := l.small[c].head; seg != nil {
			a.stats.CacheHits++
			return a.takeSlot(l, seg, size), nil
		}
		return a.mallocSmallSlow(l, c, size)
	}
	n := units.RoundUp(size, classAlign)
	if id, bucket := a.findCached(l, n); id != noBlock {
		a.stats.CacheHits++
		return a.takeBlock(id, bucket, size), nil
	}
	return a.mallocLargeSlow(l, n, size)
}

// takeSlot hands out a free slot of seg, the head of its avail list.
func (a *Allocator) takeSlot(l *StreamFreeList, seg *Segment, size uint64) uintptr {
	n := len(seg.freeSlots) - 1
	i := seg.freeSlots[n]
	seg.freeSlots = seg.freeSlots[:n]
	return a.liveSlot(l, seg, i, size)
}

// liveSlot hands out slot i of seg, already taken off its free stack.
func (a *Allocator) liveSlot(l *StreamFreeList, seg *Segment, i int32, size uint64) uintptr {
	seg.state[i] = slotLive
	seg.requested[i] = uint32(size)
	slot := int64(seg.slotSize)
	if seg.used == 0 {
		// The segment was empty: it becomes split, its other slots inactive.
		l.small[seg.class].empty--
		if seg.inEmpty {
			a.emptySegs.remove(seg)
		}
		a.stats.InactiveSplit.add(StatSmall, int64(seg.nslots-1))
		a.stats.InactiveSplitBytes.add(StatSmall, int64(seg.size)-slot)
	} else {
		a.stats.InactiveSplit.sub(StatSmall, 1)
		a.stats.InactiveSplitBytes.sub(StatSmall, slot)
	}
	seg.used++
	if len(seg.freeSlots) == 0 {
		l.small[seg.class].remove(seg)
	}
	a.countAlloc(StatSmall, slot, size)
	p := seg.slotAddr(i)
	if a.history != nil {
		a.history.add(actionAlloc, p, uint64(slot), seg.stream)
	}
	return p
}

func (a *Allocator) countAlloc(t StatType, held int64, requested uint64) {
	st := &a.stats
	st.Allocation.add(t, 1)
	st.AllocatedBytes.add(t, held)
	st.RequestedBytes.add(t, int64(requested))
	st.Active.add(t, 1)
	st.ActiveBytes.add(t, held)
}

// findCached returns a cached block of s for an n-byte request, the
// smallest one of at least n bytes and at most n plus the configured slack,
// and its bucket.
func (a *Allocator) findCached(l *StreamFreeList, n uint64) (blockID, *sizeBucket) {
	most := n + uint64(float64(n)*a.cfg.LargeSlack)
	for i := l.bucketIndex(n); i < len(l.buckets) && l.buckets[i].size <= most; i++ {
		if b := &l.buckets[i]; b.count > 0 {
			return b.list.head, b
		}
	}
	return noBlock, nil
}

// takeBlock hands out the cached block id, which is in bucket.
func (a *Allocator) takeBlock(id blockID, bucket *sizeBucket, size uint64) uintptr {
	b := &a.blocks[id]
	a.uncache(id, bucket)
	b.state = blockLive
	b.requested = size
	a.countAlloc(StatLarge, int64(b.size), size)
	if a.history != nil {
		a.history.add(actionAlloc, b.addr, b.size, b.stream)
	}
	return b.addr
}

func (a *Allocator) mallocSmallSlow(l *StreamFreeList, c uint8, size uint64) (uintptr, error) {
	a.stats.CacheMisses++
	a.pollDeferred()
	if seg := l.small[c].head; seg != nil { // a deferred free completed into it
		return a.takeSlot(l, seg, size), nil
	}
	p, err := a.poolAlloc(uint64(classSegment[c]), l, size)
	if err != nil {
		return 0, err
	}
	seg := newSegment(p, c, l)
	l.refs++
	a.insertSegment(seg)
	l.small[c].pushBack(seg)
	l.small[c].empty++
	a.stats.Segment.add(StatSmall, 1)
	a.stats.ReservedBytes.add(StatSmall, int64(seg.size))
	l.pool.reserved += seg.size
	if a.history != nil {
		a.history.add(actionSegmentAlloc, p, seg.size, l.stream)
	}
	return a.takeSlot(l, seg, size), nil
}

func (a *Allocator) mallocLargeSlow(l *StreamFreeList, n, size uint64) (uintptr, error) {
	a.stats.CacheMisses++
	if a.pollDeferred() > 0 {
		if id, bucket := a.findCached(l, n); id != noBlock {
			return a.takeBlock(id, bucket, size), nil
		}
	}
	l.pruneBuckets()
	if a.cfg.MissRelease && !l.pool.private() {
		a.releaseForMiss(l, n)
	}
	p, err := a.poolAlloc(n, l, size)
	if err != nil {
		return 0, err
	}
	id := a.newBlock()
	b := &a.blocks[id]
	*b = Block{addr: p, size: n, requested: size, stream: l.stream, list: l, state: blockLive,
		sizePrev: noBlock, sizeNext: noBlock, lruPrev: noBlock, lruNext: noBlock}
	a.largeByAddr[p] = id
	l.refs++
	a.stats.Segment.add(StatLarge, 1)
	a.stats.ReservedBytes.add(StatLarge, int64(n))
	l.pool.reserved += n
	if a.history != nil {
		a.history.add(actionSegmentAlloc, p, n, l.stream)
	}
	a.countAlloc(StatLarge, int64(n), size)
	if a.history != nil {
		a.history.add(actionAlloc, p, n, l.stream)
	}
	return p, nil
}

func (a *Allocator) newBlock() blockID {
	if k := len(a.unusedIDs); k > 0 {
		id := a.unusedIDs[k-1]
		a.unusedIDs = a.unusedIDs[:k-1]
		return id
	}
	a.blocks = append(a.blocks, Block{})
	return blockID(len(a.blocks) - 1)
}

func (a *Allocator) reserved() uint64 { return uint64(a.stats.ReservedBytes[StatAll].Current) }

// poolAlloc takes n bytes from the pool for a request of size bytes,
// through the stack that enforces the cap and reclaims when the cap or the
// driver says no (retryAfterOOM).
func (a *Allocator) poolAlloc(n uint64, l *StreamFreeList, size uint64) (uintptr, error) {
	var p uintptr
	var err error
	if l.pool.private() {
		p, err = a.mem.AllocUncaptured(n)
	} else {
		p, err = a.mem.Alloc(n, l.stream)
	}
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
	if sync && len(a.windows) == 0 { // synchronising would break a capture
		_ = a.releaseAll()
		return
	}
	a.pollDeferred()
	a.releaseCached(0)
	a.releaseEmptySegments()
	_ = a.mem.Trim(a.reserveBytes)
}

// releaseAll gives back everything not in use: it waits for the device so
// that every deferred free completes, releases every cached block and empty
// segment, waits again so that those stream-ordered frees complete (the pool
// trims only memory whose frees have completed), and trims the pool down to
// the pre-warmed reserve.
func (a *Allocator) releaseAll() error {
	var errs []error
	if err := a.dev.Synchronize(); err != nil {
		errs = append(errs, err)
		a.pollDeferred() // a stream is broken: only what completed is safe
	} else {
		a.stats.NumSyncAllStreams++
		a.deferred.AllComplete(a.completeFree)
	}
	a.releaseCached(0)
	a.releaseEmptySegments()
	if len(errs) == 0 {
		if err := a.dev.Synchronize(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := a.mem.Trim(a.reserveBytes); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// OOMError is a request that failed for lack of memory, with what a person
// needs to understand why.
type OOMError struct {
	Device                      int
	Requested                   uint64
	Limit, Total                uint64
	Reserved, Allocated, Cached uint64
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
		a.history.add(actionOOM, 0, size, 0)
	}
	return &OOMError{
		Device: a.dev.Ordinal(), Requested: size, Limit: a.limited.Limit(), Total: a.total,
		Reserved: a.reserved(), Allocated: uint64(a.stats.AllocatedBytes[StatAll].Current),
		Cached: f.FreeBytes, LargestFree: f.LargestFreeBlock, Cause: cause,
	}
}

// Free returns ptr, which Malloc returned for size bytes on stream s. The
// pointer decides what is freed: a wrong size or stream is reported (as an
// *InputError) but the block is freed all the same, on the stream it was
// allocated on, since that is the stream its memory is ordered on.
func (a *Allocator) Free(ptr uintptr, size uint64, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id, ok := a.largeByAddr[ptr]; ok {
		return a.freeBlock(id, ptr, size, s)
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			return a.freeSlot(seg, i, ptr, size, s)
		}
		return a.badInput("unknown_pointer", fmt.Sprintf("free of %#x on device %d: inside a goalloc segment but not the start of a block", ptr, a.dev.Ordinal()))
	}
	if ptr == 0 {
		return a.badInput("null_pointer", fmt.Sprintf("free of a NULL pointer on device %d", a.dev.Ordinal()))
	}
	return a.badInput("unknown_pointer", fmt.Sprintf("free of %#x on device %d: goalloc did not allocate it on this device", ptr, a.dev.Ordinal()))
}

func (a *Allocator) freeBlock(id blockID, ptr uintptr, size uint64, s arena.Stream) error {
	b := &a.blocks[id]
	if b.state != blockLive {
		return a.badInput("double_free", fmt.Sprintf("double free of %#x (%d bytes) on device %d", ptr, size, a.dev.Ordinal()))
	}
	a.countFree(StatLarge, int64(b.size), b.requested)
	if a.history != nil {
		a.history.add(actionFreeRequested, ptr, b.size, b.stream)
	}
	warn := a.checkFree(ptr, size, b.requested, s, b.stream)
	if a.deferIfRecorded(ptr, b.list) {
		b.state = blockPending
		return warn
	}
	a.stats.Active.sub(StatLarge, 1)
	a.stats.ActiveBytes.sub(StatLarge, int64(b.size))
	if a.history != nil {
		a.history.add(actionFreeCompleted, ptr, b.size, b.stream)
	}
	a.cacheBlock(id)
	return warn
}

func (a *Allocator) freeSlot(seg *Segment, i int32, ptr uintptr, size uint64, s arena.Stream) error {
	if seg.state[i] != slotLive {
		return a.badInput("double_free", fmt.Sprintf("double free of %#x (%d bytes) on device %d", ptr, size, a.dev.Ordinal()))
	}
	req := uint64(seg.requested[i])
	a.countFree(StatSmall, int64(seg.slotSize), req)
	if a.history != nil {
		a.history.add(actionFreeRequested, ptr, seg.slotSize, seg.stream)
	}
	warn := a.checkFree(ptr, size, req, s, seg.stream)
	if a.deferIfRecorded(ptr, seg.list) {
		seg.state[i] = slotPending
		return warn
	}
	a.releaseSlot(seg, i)
	return warn
}

func (a *Allocator) countFree(t StatType, held int64, requested uint64) {
	st := &a.stats
	st.Allocation.sub(t, 1)
	st.AllocatedBytes.sub(t, held)
	st.RequestedBytes.sub(t, int64(requested))
}

// checkFree reports a free whose size or stream differ from the
// allocation's, each mistake under its own kind. The block is freed all the
// same: these are warnings (InputError.Handled).
func (a *Allocator) checkFree(ptr uintptr, size, requested uint64, s, owner arena.Stream) error {
	var errs []error
	if size != requested && !(size == 0 && requested == 0) {
		errs = append(errs, a.warnInput("size_mismatch", fmt.Sprintf("free of %#x with size %d, allocated with size %d, on device %d; freed by pointer", ptr, size, requested, a.dev.Ordinal())))
	}
	if s != owner {
		errs = append(errs, a.warnInput("stream_mismatch", fmt.Sprintf("free of %#x on stream %#x, allocated on stream %#x, on device %d; freed in the allocation stream's order", ptr, s, owner, a.dev.Ordinal())))
	}
	return errors.Join(errs...)
}

// deferIfRecorded starts a deferred free when other streams used ptr. In a
// private pool the graph's own order protects the memory: its blocks are
// reused only by replays of the same captures, in the captured order.
func (a *Allocator) deferIfRecorded(ptr uintptr, l *StreamFreeList) bool {
	if len(a.recorded) == 0 {
		return false
	}
	used, ok := a.recorded[ptr]
	if !ok {
		return false
	}
	delete(a.recorded, ptr)
	if l.pool.private() {
		return false
	}
	a.deferred.Add(ptr, used)
	a.stats.DeferredFrees++
	return true
}

// releaseSlot makes slot i of seg free (its events, if any, completed).
func (a *Allocator) releaseSlot(seg *Segment, i int32) {
	slot := int64(seg.slotSize)
	a.stats.Active.sub(StatSmall, 1)
	a.stats.ActiveBytes.sub(StatSmall, slot)
	if a.history != nil {
		a.history.add(actionFreeCompleted, seg.slotAddr(i), seg.slotSize, seg.stream)
	}
	seg.state[i] = slotFree
	seg.freeSlots = append(seg.freeSlots, i)
	seg.used--
	l := seg.list
	if !seg.inAvail {
		l.small[seg.class].pushBack(seg)
	}
	if seg.used > 0 {
		a.stats.InactiveSplit.add(StatSmall, 1)
		a.stats.InactiveSplitBytes.add(StatSmall, slot)
		return
	}
	a.stats.InactiveSplit.sub(StatSmall, int64(seg.nslots-1))
	a.stats.InactiveSplitBytes.sub(StatSmall, int64(seg.size)-slot)
	cl := &l.small[seg.class]
	cl.empty++
	// Keep one empty segment per stream and class as a buffer against
	// churn, within emptySegmentBudget over all streams (the oldest go
	// first: their streams may be gone); give the others back to the pool,
	// where any size can use them. A private pool keeps everything until it
	// is released.
	p := l.pool
	if p.private() {
		if p.released {
			_ = a.releaseSegment(seg)
		}
		return
	}
	a.emptySegs.pushBack(seg)
	if cl.empty > 1 {
		_ = a.releaseSegment(seg)
	}
	for a.emptySegs.bytes > emptySegmentBudget {
		if a.releaseSegment(a.emptySegs.head) != nil {
			break
		}
	}
}

// emptySegmentBudget bounds the bytes of empty small segments the general
// cache keeps. They are a buffer against churn, one per stream and class
// (24 classes of 256-448 KiB: at most 6.6 MiB for a stream using all of
// them), so a few active streams fit; memory kept for streams that are
// gone goes back to the pool, oldest first, instead of growing with the
// number of streams ever seen. The budget is its own, apart from
// Config.LargeCache, so that large_cache keeps meaning what every figure
// measured with it meant.
const emptySegmentBudget = 32 << 20

// cacheBlock puts the free large block id into its stream's cache, then
// keeps the cache within its budget.
func (a *Allocator) cacheBlock(id blockID) {
	b := &a.blocks[id]
	b.state = blockCached
	l := b.list
	bucket := l.bucketFor(b.size)
	if bucket.count == 0 {
		l.emptyBucket--
	}
	bucket.count++
	a.pushFront(&bucket.list, id, sizeLinks)
	if p := l.pool; p.private() {
		// A private pool keeps its blocks, out of the LRU and the budget,
		// until it is released.
		if p.released {
			_ = a.releaseBlock(id)
		}
		return
	}
	a.pushBack(&a.lru, id, lruLinks)
	a.cachedLarge += b.size
	for a.cachedLarge > a.cfg.LargeCache && a.lru.head != noBlock {
		if a.releaseBlock(a.lru.head) != nil {
			break
		}
	}
}

// uncache takes the cached block id out of its bucket (found if nil) and
// the LRU list.
func (a *Allocator) uncache(id blockID, bucket *sizeBucket) {
	b := &a.blocks[id]
	l := b.list
	if bucket == nil {
		bucket = &l.buckets[l.bucketIndex(b.size)]
	}
	a.unlink(&bucket.list, id, sizeLinks)
	bucket.count--
	if bucket.count == 0 {
		l.emptyBucket++
	}
	if !l.pool.private() {
		a.unlink(&a.lru, id, lruLinks)
		a.cachedLarge -= b.size
	}
}

// releaseBlock gives the cached block id back to the pool, ordered on its
// stream.
func (a *Allocator) releaseBlock(id blockID) error {
	b := &a.blocks[id]
	if err := a.mayFree(b.stream); err != nil {
		return err
	}
	if err := a.mem.Free(b.addr, b.size, b.stream); err != nil {
		return err
	}
	a.uncache(id, nil)
	a.stats.Segment.sub(StatLarge, 1)
	a.stats.ReservedBytes.sub(StatLarge, int64(b.size))
	if a.history != nil {
		a.history.add(actionSegmentFree, b.addr, b.size, b.stream)
	}
	delete(a.largeByAddr, b.addr)
	l := b.list
	p := l.pool
	p.reserved -= b.size
	*b = Block{state: blockUnused}
	a.unusedIDs = append(a.unusedIDs, id)
	l.refs--
	p.dropIfUnused(l)
	a.dropIfEmpty(p)
	return nil
}

// releaseAtLeast gives the least recently freed cached blocks back to the
// pool until at least n bytes went back or nothing is cached.
func (a *Allocator) releaseAtLeast(n uint64) {
	var released uint64
	for released < n && a.lru.head != noBlock {
		size := a.blocks[a.lru.head].size
		if a.releaseBlock(a.lru.head) != nil {
			return
		}
		released += size
	}
}

// releaseForMiss makes room in the pool for an n-byte block on l's stream:
// it gives back the smallest cached block of at least n bytes, which the
// pool's best fit will then reuse in place; with none, the least recently
// freed blocks until n bytes went back. Blocks of l's own stream come
// first: memory another stream freed reaches l's stream only once that free
// has completed, or by the pool making l's stream wait for it.
func (a *Allocator) releaseForMiss(l *StreamFreeList, n uint64) {
	best := a.smallestCachedAtLeast(l, n)
	if best == noBlock {
		for _, other := range a.general.lists {
			if b := a.smallestCachedAtLeast(other, n); b != noBlock &&
				(best == noBlock || a.blocks[b].size < a.blocks[best].size) {
				best = b
			}
		}
	}
	if best != noBlock {
		_ = a.releaseBlock(best)
		return
	}
	a.releaseAtLeast(n)
}

// smallestCachedAtLeast is the least recently freed block of the smallest
// cached size of at least n bytes on l, or noBlock.
func (a *Allocator) smallestCachedAtLeast(l *StreamFreeList, n uint64) blockID {
	for i := l.bucketIndex(n); i < len(l.buckets); i++ {
		if b := &l.buckets[i]; b.count > 0 {
			return b.list.tail
		}
	}
	return noBlock
}

// releaseCached gives cached large blocks back to the pool, oldest first,
// until at most keep bytes stay cached.
func (a *Allocator) releaseCached(keep uint64) {
	for a.cachedLarge > keep && a.lru.head != noBlock {
		if a.releaseBlock(a.lru.head) != nil {
			return
		}
	}
}

// releaseEmptySegments gives every empty small segment of the general
// cache back to the pool.
func (a *Allocator) releaseEmptySegments() {
	for seg := a.emptySegs.head; seg != nil; {
		next := seg.emptyNext
		_ = a.releaseSegment(seg) // a capturing stream keeps its segment
		seg = next
	}
}

func (a *Allocator) releaseSegment(seg *Segment) error {
	if err := a.mayFree(seg.stream); err != nil {
		return err
	}
	if err := a.mem.Free(seg.addr, seg.size, seg.stream); err != nil {
		return err
	}
	l := seg.list
	cl := &l.small[seg.class]
	cl.remove(seg)
	cl.empty--
	if seg.inEmpty {
		a.emptySegs.remove(seg)
	}
	a.removeSegment(seg)
	a.stats.Segment.sub(StatSmall, 1)
	a.stats.ReservedBytes.sub(StatSmall, int64(seg.size))
	if a.history != nil {
		a.history.add(actionSegmentFree, seg.addr, seg.size, seg.stream)
	}
	l.pool.reserved -= seg.size
	l.refs--
	l.pool.dropIfUnused(l)
	a.dropIfEmpty(l.pool)
	return nil
}

func (a *Allocator) insertSegment(seg *Segment) {
	i := sort.Search(len(a.segments), func(i int) bool { return a.segments[i].addr > seg.addr })
	a.segments = append(a.segments, nil)
	copy(a.segments[i+1:], a.segments[i:])
	a.segments[i] = seg
}

func (a *Allocator) removeSegment(seg *Segment) {
	i := sort.Search(len(a.segments), func(i int) bool { return a.segments[i].addr >= seg.addr })
	a.segments = append(a.segments[:i], a.segments[i+1:]...)
}

// findSegment returns the small segment holding ptr, or nil.
func (a *Allocator) findSegment(ptr uintptr) *Segment {
	s := a.segments
	lo, hi := 0, len(s)
	for lo < hi { // first segment with addr > ptr
		m := int(uint(lo+hi) >> 1)
		if s[m].addr <= ptr {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo == 0 {
		return nil
	}
	if seg := s[lo-1]; ptr < seg.addr+uintptr(seg.size) {
		return seg
	}
	return nil
}

// pollDeferred completes the deferred frees whose events have completed.
func (a *Allocator) pollDeferred() int {
	if a.deferred.Len() == 0 {
		return 0
	}
	return a.deferred.Poll(a.completeFree)
}

// completeFree finishes a deferred free: its block becomes reusable by its
// owner stream.
func (a *Allocator) completeFree(ptr uintptr) {
	if id, ok := a.largeByAddr[ptr]; ok && a.blocks[id].state == blockPending {
		b := &a.blocks[id]
		a.stats.Active.sub(StatLarge, 1)
		a.stats.ActiveBytes.sub(StatLarge, int64(b.size))
		if a.history != nil {
			a.history.add(actionFreeCompleted, ptr, b.size, b.stream)
		}
		a.cacheBlock(id)
		return
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 && seg.state[i] == slotPending {
			a.releaseSlot(seg, i)
			return
		}
	}
	panic(fmt.Sprintf("goalloc: deferred free of %#x completed, but no pending block has that address", ptr))
}

// Holds says whether ptr is the start of a block or slot goalloc holds on
// this device, live or not. It counts nothing: the library asks it to find
// the device of a pointer torch names without one (record_stream).
func (a *Allocator) Holds(ptr uintptr) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.largeByAddr[ptr]; ok {
		return true
	}
	seg := a.findSegment(ptr)
	return seg != nil && seg.slotOf(ptr) >= 0
}

// RecordStream notes that stream s uses the live block at ptr, so that its
// free waits for s (PyTorch's Tensor.record_stream).
func (a *Allocator) RecordStream(ptr uintptr, s arena.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	owner, live := arena.Stream(0), false
	if id, ok := a.largeByAddr[ptr]; ok {
		owner, live = a.blocks[id].stream, a.blocks[id].state == blockLive
	} else if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			owner, live = seg.stream, seg.state[i] == slotLive
		}
	} else {
		return a.badInput("unknown_pointer", fmt.Sprintf("record_stream of %#x on device %d: goalloc did not allocate it on this device", ptr, a.dev.Ordinal()))
	}
	if !live {
		return a.badInput("record_stream_not_live", fmt.Sprintf("record_stream of %#x on device %d: the block is not allocated", ptr, a.dev.Ordinal()))
	}
	if s == owner {
		return nil
	}
	for _, r := range a.recorded[ptr] {
		if r == s {
			return nil
		}
	}
	a.recorded[ptr] = append(a.recorded[ptr], s)
	return nil
}

// EmptyCache is torch.cuda.empty_cache: it gives back to the pool every
// byte not in use and trims the pool down to the pre-warmed reserve
// (releaseAll).
func (a *Allocator) EmptyCache() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	err := a.releaseAll()
	// Forget the streams that hold nothing now: a stream's record costs
	// host memory, and operations that look at every stream time.
	a.general.dropAllUnused()
	for _, p := range a.private {
		p.dropAllUnused()
	}
	if a.history != nil {
		a.history.add(actionEmptyCache, 0, 0, 0)
	}
	return err
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
	if limit > 0 && a.reserved() > limit {
		return a.releaseAll()
	}
	return nil
}

// Limit is the cap on reserved bytes, 0 if none.
func (a *Allocator) Limit() uint64 {
	return a.limited.Limit()
}

// Stats returns a copy of the statistics, after collecting completed
// deferred frees so that active figures are current.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pollDeferred()
	st := a.stats.clone()
	st.NumDeviceAlloc, st.NumDeviceFree = int64(a.counting.Allocs()), int64(a.counting.Frees())
	st.EventErrors = int64(a.deferred.Errors)
	lat := a.counting.Latency()
	st.DeviceAllocCount, st.DeviceAllocMaxNs = int64(lat.Count()), int64(lat.Max())
	st.DeviceAllocP50Ns, st.DeviceAllocP99Ns = int64(lat.Quantile(0.50)), int64(lat.Quantile(0.99))
	pools, bytes := a.graphPoolBytes()
	st.GraphPools, st.GraphReservedBytes = int64(pools), int64(bytes)
	return st
}

// ResetPeakStats sets every peak to its current value, here and in the pool.
func (a *Allocator) ResetPeakStats() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.resetPeaks()
	return a.dev.ResetPoolHigh()
}

// ResetAccumulatedStats zeroes the allocated and freed totals and counters.
func (a *Allocator) ResetAccumulatedStats() {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := &a.stats
	for _, arr := range st.arrays() {
		for t := range arr {
			arr[t].Allocated, arr[t].Freed = arr[t].Current, 0
		}
	}
	st.NumAllocRetries, st.NumOOMs, st.NumSyncAllStreams = 0, 0, 0
	a.counting.ResetCounts()
	a.deferred.Errors = 0
	st.CacheHits, st.CacheMisses, st.DeferredFrees = 0, 0, 0
}

// Fragmentation reports the cached free memory and how scattered it is.
func (a *Allocator) Fragmentation() Fragmentation {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.fragmentation()
}

func (a *Allocator) fragmentation() Fragmentation {
	var f Fragmentation
	for i := range a.blocks {
		if b := &a.blocks[i]; b.state == blockCached && !b.list.pool.private() {
			f.FreeBytes += b.size
			f.LargestFreeBlock = max(f.LargestFreeBlock, b.size)
		}
	}
	_, f.GraphPrivateBytes = a.graphPoolBytes()
	for _, seg := range a.segments {
		if seg.list.pool.private() {
			continue
		}
		free := uint64(len(seg.freeSlots)) * seg.slotSize
		f.FreeBytes += free
		if seg.used == 0 {
			f.LargestFreeBlock = max(f.LargestFreeBlock, seg.size)
		} else if free > 0 {
			f.LargestFreeBlock = max(f.LargestFreeBlock, seg.slotSize)
		}
	}
	if f.FreeBytes > 0 {
		f.Ratio = 1 - float64(f.LargestFreeBlock)/float64(f.FreeBytes)
	}
	if u, err := a.mem.PoolUsage(); err == nil {
		f.PoolReserved, f.PoolUsed = u.ReservedCurrent, u.UsedCurrent
		f.PoolReservedHigh, f.PoolUsedHigh = u.ReservedHigh, u.UsedHigh
	}
	return f
}

// Close gives everything back to the pool and destroys it. Live blocks are
// lost with it; Close is for process exit and tests.
func (a *Allocator) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.events.Close()
	return a.dev.Close()
}

// InputError is a call with bad arguments. Kind is a stable name for the
// kind of mistake ("double_free", "unknown_pointer", ...), also the key of its
// counter in Stats.BadInput.
type InputError struct {
	Kind string
	Msg  string
	// Handled says the call did its work all the same (a free with a wrong
	// size is freed by pointer): the error is a warning, not a refusal.
	Handled bool
}

func (e *InputError) Error() string { return "goalloc: " + e.Msg }

// InputErrors lists the InputErrors in err, which may join several (a free
// with a wrong size and a wrong stream).
func InputErrors(err error) []*InputError {
	var out []*InputError
	var walk func(error)
	walk = func(err error) {
		if ie, ok := err.(*InputError); ok {
			out = append(out, ie)
		} else if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
		} else if e := errors.Unwrap(err); e != nil {
			walk(e)
		}
	}
	walk(err)
	return out
}

// badInput counts a refused call and returns its error. The caller holds a.mu.
func (a *Allocator) badInput(kind, msg string) error {
	a.stats.BadInput[kind]++
	return &InputError{Kind: kind, Msg: msg}
}

// warnInput counts a call that was wrong but done all the same.
func (a *Allocator) warnInput(kind, msg string) error {
	a.stats.BadInput[kind]++
	return &InputError{Kind: kind, Msg: msg, Handled: true}
}
