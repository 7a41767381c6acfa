package caching

import (
	"fmt"
	"slices"
	"sort"

	"github.com/goalloc/goalloc/arena"
)

// CheckInvariants recomputes everything the allocator keeps incrementally
// and compares: block states against lists, statistics against the blocks,
// and that no two pieces of memory goalloc holds overlap. It is slow (linear
// in everything held) and meant for tests.
func (a *Allocator) CheckInvariants() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if f := a.Front(); f != nil {
		want := a.frontAllowed()
		if got := f.enabled.Load() == 1; got != want {
			return fmt.Errorf("front log enabled %v, but history %v, capture windows %d and tags in use %v say %v", got, a.history != nil, len(a.windows), a.tagsInUse, want)
		}
	}
	type span struct {
		addr, size uint64
		what       string
	}
	var spans []span
	var allocated, active, reserved, requested [numStatTypes]int64
	var live, activeN, segs [numStatTypes]int64
	add := func(t StatType, arr *[numStatTypes]int64, n int64) { arr[StatAll] += n; arr[t] += n }

	cachedIDs := map[blockID]bool{}
	poolCached := map[*cachePool]uint64{}
	poolCachedN := map[*cachePool]int{}
	poolBytes := map[*cachePool]uint64{}
	for i := range a.blocks {
		b := &a.blocks[i]
		if b.state == blockUnused {
			continue
		}
		if id, ok := a.largeByAddr.Get(b.addr); !ok || id != blockID(i) {
			return fmt.Errorf("block %d at %#x is not indexed by its address", i, b.addr)
		}
		if b.size <= smallMax || b.size%classAlign != 0 {
			return fmt.Errorf("large block %#x has size %d", b.addr, b.size)
		}
		spans = append(spans, span{uint64(b.addr), b.size, "large block"})
		add(StatLarge, &reserved, int64(b.size))
		add(StatLarge, &segs, 1)
		switch b.state {
		case blockLive:
			add(StatLarge, &allocated, int64(b.size))
			add(StatLarge, &requested, int64(b.requested))
			add(StatLarge, &live, 1)
			add(StatLarge, &active, int64(b.size))
			add(StatLarge, &activeN, 1)
		case blockPending:
			add(StatLarge, &active, int64(b.size))
			add(StatLarge, &activeN, 1)
		case blockCached:
			poolCached[b.list.pool] += b.size
			poolCachedN[b.list.pool]++
			cachedIDs[blockID(i)] = true
		}
		poolBytes[b.list.pool] += b.size
	}
	if a.largeByAddr.Len() != int(segs[StatLarge]) {
		return fmt.Errorf("%d addresses indexed, %d large blocks held", a.largeByAddr.Len(), segs[StatLarge])
	}
	pools := a.cachePools()
	for _, p := range pools {
		if poolCached[p] != p.cachedLarge {
			return fmt.Errorf("pool %v: cachedLarge %d, cached blocks add up to %d", p.id, p.cachedLarge, poolCached[p])
		}
	}
	// Every cached block is in exactly one bucket of its stream and in its
	// pool's LRU.
	inLists := 0
	for _, l := range a.allLists() {
		empty := 0
		for bi, bk := range l.buckets {
			if bi > 0 && l.buckets[bi-1].size >= bk.size {
				return fmt.Errorf("stream %#x: buckets out of order", l.stream)
			}
			n := 0
			for id := bk.list.head; id != noBlock; id = a.blocks[id].sizeNext {
				b := &a.blocks[id]
				if !cachedIDs[id] || b.size != bk.size || b.stream != l.stream {
					return fmt.Errorf("stream %#x bucket %d holds block %d (state %d, size %d, stream %#x)", l.stream, bk.size, id, b.state, b.size, b.stream)
				}
				n++
			}
			if n != bk.count {
				return fmt.Errorf("bucket %d counts %d, holds %d", bk.size, bk.count, n)
			}
			if n == 0 {
				empty++
			}
			inLists += n
		}
		if empty != l.emptyBucket {
			return fmt.Errorf("stream %#x: %d empty buckets, counted %d", l.stream, empty, l.emptyBucket)
		}
	}
	if inLists != len(cachedIDs) {
		return fmt.Errorf("%d cached blocks, %d in buckets", len(cachedIDs), inLists)
	}
	for _, p := range pools {
		lruN := 0
		for id := p.lru.head; id != noBlock; id = a.blocks[id].lruNext {
			if !cachedIDs[id] || a.blocks[id].list.pool != p {
				return fmt.Errorf("pool %v: LRU holds block %d, which is not cached in the pool", p.id, id)
			}
			if (a.blocks[id].lruNext == noBlock) != (id == p.lru.tail) {
				return fmt.Errorf("pool %v: LRU is broken at block %d", p.id, id)
			}
			lruN++
		}
		if lruN != poolCachedN[p] {
			return fmt.Errorf("pool %v: %d cached blocks, %d in the LRU", p.id, poolCachedN[p], lruN)
		}
	}

	var inactive, inactiveN int64
	if len(a.segmentAddrs) != len(a.segments) {
		return fmt.Errorf("%d segment addresses for %d segments", len(a.segmentAddrs), len(a.segments))
	}
	for i, seg := range a.segments {
		if i > 0 && a.segments[i-1].addr >= seg.addr {
			return fmt.Errorf("segments out of order")
		}
		if a.segmentAddrs[i] != seg.addr {
			return fmt.Errorf("segment %d at %#x listed at %#x", i, seg.addr, a.segmentAddrs[i])
		}
		spans = append(spans, span{uint64(seg.addr), seg.size, "segment"})
		poolBytes[seg.list.pool] += seg.size
		add(StatSmall, &reserved, int64(seg.size))
		add(StatSmall, &segs, 1)
		free := 0
		used := int32(0)
		for s := int32(0); s < seg.nslots; s++ {
			switch seg.state[s] {
			case slotFree:
				free++
			case slotLive:
				used++
				add(StatSmall, &allocated, int64(seg.slotSize))
				add(StatSmall, &requested, int64(seg.requested[s]))
				add(StatSmall, &live, 1)
				add(StatSmall, &active, int64(seg.slotSize))
				add(StatSmall, &activeN, 1)
			case slotPending:
				used++
				add(StatSmall, &active, int64(seg.slotSize))
				add(StatSmall, &activeN, 1)
			}
		}
		if free != len(seg.freeSlots) || used != seg.used {
			return fmt.Errorf("segment %#x: %d free slots, stack holds %d; %d used, counted %d", seg.addr, free, len(seg.freeSlots), used, seg.used)
		}
		for _, s := range seg.freeSlots {
			if seg.state[s] != slotFree {
				return fmt.Errorf("segment %#x: slot %d on the free stack is not free", seg.addr, s)
			}
		}
		if seg.inAvail != (free > 0) {
			return fmt.Errorf("segment %#x: %d free slots, inAvail %v", seg.addr, free, seg.inAvail)
		}
		if used > 0 {
			inactive += int64(seg.size) - int64(used)*int64(seg.slotSize)
			inactiveN += int64(free)
		}
	}
	for _, l := range a.allLists() {
		for c := range l.small {
			empty := 0
			for seg := l.small[c].head; seg != nil; seg = seg.next {
				if seg.stream != l.stream || int(seg.class) != c || !seg.inAvail {
					return fmt.Errorf("stream %#x class %d lists a foreign segment %#x", l.stream, c, seg.addr)
				}
				if seg.used == 0 {
					empty++
				}
			}
			if empty != l.small[c].empty {
				return fmt.Errorf("stream %#x class %d: %d empty segments, counted %d", l.stream, c, empty, l.small[c].empty)
			}
		}
	}

	x := &a.external
	for t := StatAll; t < numStatTypes; t++ {
		segs[t] += x.segments[t]
		reserved[t] += x.reserved[t]
		live[t] += x.live[t]
		activeN[t] += x.live[t]
		allocated[t] += x.allocated[t]
		active[t] += x.allocated[t]
		requested[t] += x.requested[t]
	}
	var st Stats
	a.cells.fill(&st)
	for t := StatAll; t < numStatTypes; t++ {
		for _, chk := range []struct {
			name string
			got  int64
			want int64
		}{
			{"allocated_bytes", st.AllocatedBytes[t].Current, allocated[t]},
			{"requested_bytes", st.RequestedBytes[t].Current, requested[t]},
			{"allocation", st.Allocation[t].Current, live[t]},
			{"active_bytes", st.ActiveBytes[t].Current, active[t]},
			{"active", st.Active[t].Current, activeN[t]},
			{"reserved_bytes", st.ReservedBytes[t].Current, reserved[t]},
			{"segment", st.Segment[t].Current, segs[t]},
		} {
			if chk.got != chk.want {
				return fmt.Errorf("%s.%s.current is %d, blocks add up to %d", chk.name, statTypeNames[t], chk.got, chk.want)
			}
		}
	}
	if st.InactiveSplitBytes[StatAll].Current != inactive || st.InactiveSplit[StatAll].Current != inactiveN {
		return fmt.Errorf("inactive_split %d (%d bytes), segments add up to %d (%d bytes)",
			st.InactiveSplit[StatAll].Current, st.InactiveSplitBytes[StatAll].Current, inactiveN, inactive)
	}
	// The stack under the cache counts what it handed out on its own; the
	// cap is only right if that count is reserved_bytes, but for what is
	// asleep, which holds nothing on the device (sleep.go).
	own := uint64(reserved[StatAll] - x.reserved[StatAll])
	if asleep := a.asleepBytes(); a.limited.Held() != own+x.claimed-asleep || a.counting.Held() != own {
		return fmt.Errorf("the memory stack holds %d bytes (cap's count, own-allocator pools' %d in it, %d asleep out of it) and %d (device count), blocks add up to %d",
			a.limited.Held(), x.claimed, asleep, a.counting.Held(), own)
	}
	if err := a.checkTagPools(); err != nil {
		return err
	}
	for _, p := range pools {
		if poolBytes[p] != p.reserved {
			return fmt.Errorf("pool %v holds %d bytes, counted %d", p.id, poolBytes[p], p.reserved)
		}
	}
	for id, p := range a.private {
		if p.released && p.empty() {
			return fmt.Errorf("released pool %v is empty but still kept", id)
		}
	}
	if err := a.checkStreamRecords(); err != nil {
		return err
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].addr < spans[j].addr })
	for i := 1; i < len(spans); i++ {
		if p := spans[i-1]; p.addr+p.size > spans[i].addr {
			return fmt.Errorf("%s [%#x,+%d) overlaps %s at %#x", p.what, p.addr, p.size, spans[i].what, spans[i].addr)
		}
	}
	for ptr := range a.recorded {
		if !a.isLive(ptr) {
			return fmt.Errorf("record_stream entry for %#x, which is not live", ptr)
		}
	}
	for ptr, ctx := range a.pendingCtx {
		if !a.isPending(ptr) || ctx == 0 {
			return fmt.Errorf("context id %d kept for the deferred free of %#x, which is not pending", ctx, ptr)
		}
	}
	if a.callCtx != 0 {
		return fmt.Errorf("context id %d outlived its call", a.callCtx)
	}
	return nil
}

// checkStreamRecords checks the per-stream records and the kept empty
// segments: each list is found by its stream, counts exactly the blocks and
// segments that belong to it, and holds at least one unless it is the list
// in use; the empty segments of each pool are exactly those on its
// emptySegs.
func (a *Allocator) checkStreamRecords() error {
	refs := map[*StreamFreeList]int{}
	for i := range a.blocks {
		if b := &a.blocks[i]; b.state != blockUnused {
			refs[b.list]++
		}
	}
	emptyBytes := map[*cachePool]uint64{}
	emptyN := map[*cachePool]int{}
	listEmpty := map[*StreamFreeList]uint64{}
	for _, seg := range a.segments {
		refs[seg.list]++
		if seg.inEmpty != (seg.used == 0) {
			return fmt.Errorf("segment %#x: %d used, on the empty list %v", seg.addr, seg.used, seg.inEmpty)
		}
		if seg.inEmpty {
			emptyBytes[seg.list.pool] += seg.size
			emptyN[seg.list.pool]++
			listEmpty[seg.list] += seg.size
		}
	}
	emptyHeld := map[*cachePool]uint64{}
	for l, n := range listEmpty {
		emptyHeld[l.pool] += l.pool.emptySegs.heldFor(n)
	}
	pools := a.cachePools()
	for _, p := range pools {
		n := 0
		for seg := p.emptySegs.head; seg != nil; seg = seg.emptyNext {
			if !seg.inEmpty || seg.list.pool != p || (seg.emptyNext == nil) != (seg == p.emptySegs.tail) {
				return fmt.Errorf("pool %v: empty segment list is broken at %#x", p.id, seg.addr)
			}
			n++
		}
		if n != emptyN[p] || emptyBytes[p] != p.emptySegs.bytes {
			return fmt.Errorf("pool %v: %d empty segments (%d bytes), list holds %d (%d bytes)", p.id, emptyN[p], emptyBytes[p], n, p.emptySegs.bytes)
		}
		if emptyHeld[p] != p.emptySegs.held {
			return fmt.Errorf("pool %v: the device holds %d for its empty segments, counted %d", p.id, emptyHeld[p], p.emptySegs.held)
		}
		if p.limits != p.rule.limits() {
			return fmt.Errorf("pool %v: limits %+v, its rule says %+v", p.id, p.limits, p.rule.limits())
		}
	}
	for _, p := range pools {
		if len(p.byStream) != len(p.lists) {
			return fmt.Errorf("pool %v: %d lists, %d indexed by stream", p.id, len(p.lists), len(p.byStream))
		}
		for i, l := range p.lists {
			if l.index != i || p.byStream[l.stream] != l || l.pool != p {
				return fmt.Errorf("pool %v: list of stream %#x is misfiled", p.id, l.stream)
			}
			if l.emptyBytes != listEmpty[l] {
				return fmt.Errorf("stream %#x: %d bytes of empty segments, counted %d", l.stream, listEmpty[l], l.emptyBytes)
			}
			if l.refs != refs[l] {
				return fmt.Errorf("stream %#x holds %d blocks and segments, counted %d", l.stream, refs[l], l.refs)
			}
			if l.refs == 0 && l != p.last {
				return fmt.Errorf("stream %#x holds nothing but is kept", l.stream)
			}
			delete(refs, l)
		}
		if p.last != nil && p.byStream[p.last.stream] != p.last {
			return fmt.Errorf("pool %v: the list in use is not filed", p.id)
		}
	}
	if len(refs) > 0 {
		return fmt.Errorf("%d blocks or segments belong to a dropped stream record", len(refs))
	}
	return nil
}

func (a *Allocator) isLive(ptr uintptr) bool {
	if id, ok := a.largeByAddr.Get(ptr); ok {
		return a.blocks[id].state == blockLive
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			return seg.state[i] == slotLive
		}
	}
	return false
}

func (a *Allocator) isPending(ptr uintptr) bool {
	if id, ok := a.largeByAddr.Get(ptr); ok {
		return a.blocks[id].state == blockPending
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			return seg.state[i] == slotPending
		}
	}
	return false
}

// checkTagPools checks the memory tags' pools: filed under their tag, a
// pool asleep caches nothing, and the device's tags asleep are theirs.
func (a *Allocator) checkTagPools() error {
	for t, p := range a.tags {
		if p.tag != t || t == 0 || p.id != (PoolID{}) {
			return fmt.Errorf("the pool of memory tag %d is filed as tag %d, pool %v", p.tag, t, p.id)
		}
		if p.asleep && !a.capturing() && (p.cachedLarge > 0 || p.emptySegs.head != nil) {
			return fmt.Errorf("memory tag %d is asleep and caches %d bytes of blocks, empty segments %v", t, p.cachedLarge, p.emptySegs.head != nil)
		}
	}
	if sl, ok := a.dev.(arena.Sleeper); ok {
		if got, want := sl.SleepState().Asleep, a.asleepTags(); !slices.Equal(got, want) {
			return fmt.Errorf("the device has memory tags %v asleep, the pools %v", got, want)
		}
	}
	return nil
}

// cachePools is every cache pool: the general cache, the memory tags'
// pools and the private pools.
func (a *Allocator) cachePools() []*cachePool {
	return append(append([]*cachePool{a.general}, a.tagPools()...), a.privatePools()...)
}

// allLists is every StreamFreeList of every cache pool.
func (a *Allocator) allLists() []*StreamFreeList {
	var out []*StreamFreeList
	for _, p := range a.cachePools() {
		out = append(out, p.lists...)
	}
	return out
}

// privatePools lists the private pools in a stable order.
func (a *Allocator) privatePools() []*cachePool {
	out := make([]*cachePool, 0, len(a.private))
	for _, p := range a.private {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].id[0] != out[j].id[0] {
			return out[i].id[0] < out[j].id[0]
		}
		return out[i].id[1] < out[j].id[1]
	})
	return out
}
