package caching

import (
	"encoding/json"
	"sort"

	"github.com/goalloc/goalloc/arena"
)

// StatType indexes a Stat array the way PyTorch's memory_stats() splits its
// figures: all blocks, small-pool blocks (<= smallMax), large-pool blocks.
type StatType int

const (
	StatAll StatType = iota
	StatSmall
	StatLarge
	numStatTypes
)

var statTypeNames = [numStatTypes]string{"all", "small_pool", "large_pool"}

// Stat is one counter with PyTorch's four figures.
// Invariant: Current == Allocated - Freed, and Peak >= Current.
type Stat struct {
	Current, Peak, Allocated, Freed int64
}

// statValueNames names Stat's figures, in the order of values.
var statValueNames = [...]string{"current", "peak", "allocated", "freed"}

func (x Stat) values() [len(statValueNames)]int64 {
	return [...]int64{x.Current, x.Peak, x.Allocated, x.Freed}
}

// statArray is one statistic split by pool type, as Stats reports it.
type statArray [numStatTypes]Stat

// statField names one of the nine statistics Stats splits by pool type, in
// the order statCells keeps them: the five every request and free updates,
// then the two of a small segment's slots, then the two of a miss.
type statField int

const (
	statAllocation statField = iota
	statAllocatedBytes
	statRequestedBytes
	statActive
	statActiveBytes
	statInactiveSplit
	statInactiveSplitBytes
	statSegment
	statReservedBytes
	numStatFields
)

// statCell is one statistic of one pool type as the allocator keeps it.
// Freed is allocated - current: ResetAccumulatedStats keeps it so.
type statCell struct{ current, peak, allocated int64 }

func (c *statCell) add(n int64) {
	c.current += n
	c.allocated += n
	if c.current > c.peak {
		c.peak = c.current
	}
}

func (c *statCell) sub(n int64) { c.current -= n }

// statRow is one pool type's statistics, padded to 256 bytes. The "all"
// row also counts the cache's hits and misses (Stats.CacheHits,
// CacheMisses), in the lines every request updates anyway: a hit's count
// costs no line of its own.
type statRow struct {
	hits   int64
	cells  [numStatFields]statCell
	misses int64
	_      [256 - 16 - int(numStatFields)*24]byte
}

// statCells is where the allocator keeps the nine statistics: by pool
// type, then by field. A request or a free updates five fields (seven for
// a small slot) of "all" and of its own pool type, bytes 8 to 128 (176) of
// each row: four (six) 64-byte lines in all. Stats' layout, by field then pool
// type, spread the same updates over eight (ten) lines. Each line is a
// memory access when the allocator's lines went cold between two calls, as
// they do in training, where the functions that updated the statistics
// were a large share of goalloc's first-level cache misses
// (tests/misspath_compare.sh measures them). A statCells is allocated alone: 768 bytes, a size class
// of Go's allocator whose objects start on 64-byte boundaries, so each row
// starts a line.
type statCells [numStatTypes]statRow

// add and sub update field f of pool type t and of "all".
func (c *statCells) add(t StatType, f statField, n int64) {
	c[StatAll].cells[f].add(n)
	c[t].cells[f].add(n)
}

func (c *statCells) sub(t StatType, f statField, n int64) {
	c[StatAll].cells[f].sub(n)
	c[t].cells[f].sub(n)
}

// hit and miss count a request the cache served, or did not.
func (c *statCells) hit()  { c[StatAll].hits++ }
func (c *statCells) miss() { c[StatAll].misses++ }

// current is field f's current value for pool type t.
func (c *statCells) current(t StatType, f statField) int64 { return c[t].cells[f].current }

// array is field f as a Stats field has it.
func (c *statCells) array(f statField) statArray {
	var a statArray
	for t := range a {
		x := c[t].cells[f]
		a[t] = Stat{Current: x.current, Peak: x.peak, Allocated: x.allocated, Freed: x.allocated - x.current}
	}
	return a
}

// fill copies the nine statistics, and the hits and misses, into s.
func (c *statCells) fill(s *Stats) {
	for _, a := range statArrays {
		*a.of(s) = c.array(a.field)
	}
	s.CacheHits, s.CacheMisses = c[StatAll].hits, c[StatAll].misses
}

func (c *statCells) resetPeaks() {
	for t := range c {
		for f := range c[t].cells {
			c[t].cells[f].peak = c[t].cells[f].current
		}
	}
}

// resetAccumulated zeroes what was freed (allocated becomes current), and
// the hits and misses.
func (c *statCells) resetAccumulated() {
	c[StatAll].hits, c[StatAll].misses = 0, 0
	for t := range c {
		for f := range c[t].cells {
			c[t].cells[f].allocated = c[t].cells[f].current
		}
	}
}

// Stats is everything PyTorch's memory_stats() reports, with the same meaning
// where goalloc has the same notion (see doc.go, "Statistics"):
//
//   - allocation / allocated_bytes: blocks handed to the user and not freed
//     (bytes: their slot or block size, rounded up);
//   - requested_bytes: the sizes the user asked for, of those same blocks;
//   - active / active_bytes: allocated blocks plus freed blocks that still wait
//     for other streams' events;
//   - segment / reserved_bytes: memory goalloc holds from the driver pool
//     (small-class segments and large blocks, in use or cached);
//   - inactive_split / inactive_split_bytes: free slots inside small segments
//     that still have a live slot, so cannot go back to the pool.
type Stats struct {
	Allocation, AllocatedBytes, RequestedBytes statArray
	Active, ActiveBytes                        statArray
	Segment, ReservedBytes                     statArray
	InactiveSplit, InactiveSplitBytes          statArray

	NumAllocRetries   int64 // cache misses retried after freeing cached memory
	NumOOMs           int64 // requests that failed for lack of memory
	NumSyncAllStreams int64 // device-wide synchronisations (empty_cache, last-ditch OOM)
	NumDeviceAlloc    int64 // successful cuMemAllocFromPoolAsync calls
	NumDeviceFree     int64 // cuMemFreeAsync calls

	// goalloc's own counters, beyond PyTorch's keys.
	CacheHits, CacheMisses int64
	DeferredFrees          int64 // frees that had to wait for other streams' events
	EventErrors            int64 // failed event records and queries (those frees wait for a synchronisation)
	// Frees the C++ class's front passed in its log, and how many of those it
	// handed out again before Go saw them (front.go); both are also counted
	// as ordinary frees, and a recycled one as a cache hit.
	FrontFrees, FrontRecycled int64
	// How long the cache misses' calls to the memory source took, in ns
	// (arena.Counting's histogram: within 12.5%), and how many were timed.
	DeviceAllocCount, DeviceAllocP50Ns, DeviceAllocP99Ns, DeviceAllocMaxNs int64
	// CUDA graph private pools (graphs.go), read when the stats are taken:
	// how many, and the bytes they hold (part of reserved_bytes).
	GraphPools, GraphReservedBytes int64
	// Calls of the three graph hooks, and releases that emptied a pool.
	GraphBegins, GraphEnds, GraphReleases int64
	// Sleep and wake (sleep.go), read when the stats are taken: the bytes
	// of goalloc's blocks and segments asleep, and of host copies kept for
	// them.
	AsleepBytes, OffloadedBytes int64
	BadInput                    map[string]int64
	// DriverCalls is the VMM backend's profile of its driver calls (count
	// and ns per driver function), read when the stats are taken; nil under
	// a device that keeps none.
	DriverCalls []arena.DriverCallStat

	// OwnReserved is reserved_bytes.all as goalloc counts it, its segments
	// and blocks; reserved_bytes.all is what the device holds (held.go).
	OwnReserved Stat
}

// The statistics of c10's DeviceStats that Stats has, as the table
// GOALLOC_STAT_ARRAYS and GOALLOC_STAT_COUNTERS of goalloc.h
// (python/goalloc/csrc) lists them, in its order: their names are
// memory_stats()'s keys, and their order that of goalloc_torch_device_stats's
// figures (TorchFigures), which the C++ class reads by position.
// export/header_test.go holds these tables, statTypeNames and statValueNames
// to the header's.
var (
	statArrays = [...]struct {
		name  string
		field statField
		of    func(*Stats) *statArray
	}{
		{"allocation", statAllocation, func(s *Stats) *statArray { return &s.Allocation }},
		{"segment", statSegment, func(s *Stats) *statArray { return &s.Segment }},
		{"active", statActive, func(s *Stats) *statArray { return &s.Active }},
		{"inactive_split", statInactiveSplit, func(s *Stats) *statArray { return &s.InactiveSplit }},
		{"allocated_bytes", statAllocatedBytes, func(s *Stats) *statArray { return &s.AllocatedBytes }},
		{"reserved_bytes", statReservedBytes, func(s *Stats) *statArray { return &s.ReservedBytes }},
		{"active_bytes", statActiveBytes, func(s *Stats) *statArray { return &s.ActiveBytes }},
		{"inactive_split_bytes", statInactiveSplitBytes, func(s *Stats) *statArray { return &s.InactiveSplitBytes }},
		{"requested_bytes", statRequestedBytes, func(s *Stats) *statArray { return &s.RequestedBytes }},
	}
	statCounters = [...]struct {
		name string
		of   func(*Stats) *int64
	}{
		{"num_alloc_retries", func(s *Stats) *int64 { return &s.NumAllocRetries }},
		{"num_ooms", func(s *Stats) *int64 { return &s.NumOOMs }},
		{"num_sync_all_streams", func(s *Stats) *int64 { return &s.NumSyncAllStreams }},
		{"num_device_alloc", func(s *Stats) *int64 { return &s.NumDeviceAlloc }},
		{"num_device_free", func(s *Stats) *int64 { return &s.NumDeviceFree }},
	}
)

// NumTorchFigures is how many figures TorchFigures writes.
const NumTorchFigures = len(statArrays)*int(numStatTypes)*len(statValueNames) + len(statCounters)

// TorchFigures writes s as goalloc_torch_device_stats gives it: each
// statistic of statArrays, by pool type, by value; then the counters.
func (s *Stats) TorchFigures(dst *[NumTorchFigures]int64) {
	k := 0
	for _, a := range statArrays {
		for _, x := range a.of(s) {
			v := x.values()
			k += copy(dst[k:], v[:])
		}
	}
	for _, c := range statCounters {
		dst[k] = *c.of(s)
		k++
	}
}

// StatTables is the names of the tables above, for export's test against
// goalloc.h: the statistics split by pool type, the pool types, each
// Stat's values, and the counters.
func StatTables() (arrays, pools, values, counters []string) {
	for _, a := range statArrays {
		arrays = append(arrays, a.name)
	}
	for _, c := range statCounters {
		counters = append(counters, c.name)
	}
	return arrays, statTypeNames[:], statValueNames[:], counters
}

// Map flattens s into PyTorch's memory_stats() keys, e.g.
// "allocated_bytes.all.current" and "num_ooms".
func (s *Stats) Map() map[string]int64 {
	m := map[string]int64{}
	for _, a := range statArrays {
		for t, x := range a.of(s) {
			for v, n := range x.values() {
				m[a.name+"."+statTypeNames[t]+"."+statValueNames[v]] = n
			}
		}
	}
	for _, c := range statCounters {
		m[c.name] = *c.of(s)
	}
	m["max_split_size"] = -1 // PyTorch's value when no max_split_size_mb is set
	m["oversize_allocations.current"] = 0
	m["oversize_allocations.peak"] = 0
	m["oversize_allocations.allocated"] = 0
	m["oversize_allocations.freed"] = 0
	m["oversize_segments.current"] = 0
	m["oversize_segments.peak"] = 0
	m["oversize_segments.allocated"] = 0
	m["oversize_segments.freed"] = 0
	m["goalloc.cache_hits"] = s.CacheHits
	m["goalloc.cache_misses"] = s.CacheMisses
	m["goalloc.deferred_frees"] = s.DeferredFrees
	m["goalloc.event_errors"] = s.EventErrors
	m["goalloc.front.frees"] = s.FrontFrees
	m["goalloc.front.recycled"] = s.FrontRecycled
	m["goalloc.own_reserved_bytes.current"] = s.OwnReserved.Current
	m["goalloc.own_reserved_bytes.peak"] = s.OwnReserved.Peak
	m["goalloc.device_alloc_ns.count"] = s.DeviceAllocCount
	m["goalloc.device_alloc_ns.p50"] = s.DeviceAllocP50Ns
	m["goalloc.device_alloc_ns.p99"] = s.DeviceAllocP99Ns
	m["goalloc.device_alloc_ns.max"] = s.DeviceAllocMaxNs
	m["goalloc.graph_pools"] = s.GraphPools
	m["goalloc.graph_pools.reserved_bytes"] = s.GraphReservedBytes
	m["goalloc.graph_hooks.begin"] = s.GraphBegins
	m["goalloc.graph_hooks.end"] = s.GraphEnds
	m["goalloc.graph_hooks.release"] = s.GraphReleases
	m["goalloc.sleep.asleep_bytes"] = s.AsleepBytes
	m["goalloc.sleep.offloaded_bytes"] = s.OffloadedBytes
	for k, v := range s.BadInput {
		m["goalloc.bad_input."+k] = v
	}
	for _, c := range s.DriverCalls {
		m["goalloc.driver."+c.Name+".count"] = int64(c.Count)
		m["goalloc.driver."+c.Name+".ns"] = int64(c.Nanos)
	}
	return m
}

// JSON is Map as a JSON object with sorted keys.
func (s *Stats) JSON() []byte {
	m := s.Map()
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	b := []byte{'{'}
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		kb, _ := json.Marshal(k)
		b = append(b, kb...)
		b = append(b, ':')
		vb, _ := json.Marshal(m[k])
		b = append(b, vb...)
	}
	return append(b, '}')
}

func (s *Stats) clone() Stats {
	c := *s
	c.BadInput = make(map[string]int64, len(s.BadInput))
	for k, v := range s.BadInput {
		c.BadInput[k] = v
	}
	return c
}

// Fragmentation describes the cached free memory of one device.
type Fragmentation struct {
	// FreeBytes is cached memory not in use: free slots of small segments
	// and cached large blocks (reserved minus active).
	FreeBytes uint64 `json:"free_bytes"`
	// LargestFreeBlock is the largest request the cache could serve from
	// one free piece without going to the pool.
	LargestFreeBlock uint64 `json:"largest_free_block"`
	// Ratio is 1 - LargestFreeBlock/FreeBytes: 0 when all free memory is one
	// piece, near 1 when it is scattered in small pieces. 0 when nothing is free.
	Ratio float64 `json:"fragmentation"`
	// GraphPrivateBytes is memory held by CUDA graph private pools, free or
	// not; it is not counted in FreeBytes, since no other use may take it.
	GraphPrivateBytes uint64 `json:"graph_private_bytes"`
	// PoolReserved and PoolUsed are the driver pool's own figures.
	PoolReserved uint64 `json:"pool_reserved_bytes"`
	PoolUsed     uint64 `json:"pool_used_bytes"`
	// PoolReservedHigh and PoolUsedHigh are the pool's high-water marks
	// since it was made or reset_peak_memory_stats: what the device really
	// had to map for this process's allocations at most.
	PoolReservedHigh uint64 `json:"pool_reserved_high_bytes"`
	PoolUsedHigh     uint64 `json:"pool_used_high_bytes"`
	// Held is what a VMM device holds now, span by span (arena.HeldSplit):
	// where its bytes beyond goalloc's blocks lie; HeldAtPeak the same when
	// held last reached its high-water mark (PoolReservedHigh). Nil on
	// other devices.
	Held       *arena.HeldSplit `json:"held,omitempty"`
	HeldAtPeak *arena.HeldSplit `json:"held_at_peak,omitempty"`
}

// Stats returns a copy of the statistics, after collecting completed
// deferred frees so that active figures are current.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pollDeferred()
	if a.heldDrifts {
		a.refreshHeld()
	}
	st := a.stats.clone()
	a.cells.fill(&st)
	st.NumDeviceAlloc, st.NumDeviceFree = int64(a.counting.Allocs()), int64(a.counting.Frees())
	st.EventErrors = int64(a.deferred.Errors)
	lat := a.counting.Latency()
	st.DeviceAllocCount, st.DeviceAllocMaxNs = int64(lat.Count()), int64(lat.Max())
	st.DeviceAllocP50Ns, st.DeviceAllocP99Ns = int64(lat.Quantile(0.50)), int64(lat.Quantile(0.99))
	if p, ok := a.dev.(arena.DriverProfiler); ok {
		st.DriverCalls = p.DriverCalls()
	}
	pools, bytes := a.graphPoolBytes()
	st.GraphPools, st.GraphReservedBytes = int64(pools), int64(bytes)
	st.AsleepBytes = int64(a.asleepBytes())
	if sl, ok := a.dev.(arena.Sleeper); ok {
		st.OffloadedBytes = int64(sl.SleepState().Offloaded)
	}
	st.OwnReserved = st.ReservedBytes[StatAll]
	r := &st.ReservedBytes[StatAll]
	r.Current, r.Peak = a.mu.held.get()
	return st
}

// ResetPeakStats sets every peak to its current value, here and in the pool.
func (a *Allocator) ResetPeakStats() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.cells.resetPeaks()
	err := a.mem.ResetPoolHigh() // through the pool's cap, which keeps a mark of its own
	a.refreshHeld()
	return err
}

// ResetAccumulatedStats zeroes the allocated and freed totals and counters.
func (a *Allocator) ResetAccumulatedStats() {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := &a.stats
	a.cells.resetAccumulated()
	st.NumAllocRetries, st.NumOOMs, st.NumSyncAllStreams = 0, 0, 0
	a.counting.ResetCounts()
	a.deferred.Errors = 0
	st.DeferredFrees = 0
	st.FrontFrees, st.FrontRecycled = 0, 0
}

// Fragmentation reports the cached free memory and how scattered it is.
func (a *Allocator) Fragmentation() Fragmentation {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.fragmentation()
}

func (a *Allocator) fragmentation() Fragmentation {
	// Only the general cache's free memory counts: no other use may take a
	// private pool's.
	var f Fragmentation
	for id := a.lru.head; id != noBlock; id = a.blocks[id].lruNext {
		size := a.blocks[id].size
		f.FreeBytes += size
		f.LargestFreeBlock = max(f.LargestFreeBlock, size)
	}
	_, f.GraphPrivateBytes = a.graphPoolBytes()
	for _, seg := range a.segments {
		if seg.list.pool != a.general {
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
	if hs, ok := a.dev.(arena.HeldSplitter); ok {
		h, p := hs.HeldSplit(), hs.HeldSplitAtPeak()
		f.Held, f.HeldAtPeak = &h, &p
	}
	return f
}
