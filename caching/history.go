package caching

import (
	"time"

	"github.com/goalloc/goalloc/arena"
)

// Action is what a history entry records, named as PyTorch's memory
// snapshots name trace actions. This is goalloc's one table of those names:
// the allocator's history is written with it, and the replay tool reads
// recorded traces and memory snapshots with it.
type Action uint8

const (
	ActionAlloc Action = iota
	ActionFreeRequested
	ActionFreeCompleted
	ActionSegmentAlloc
	ActionSegmentFree
	ActionSegmentMap   // PyTorch's expandable segments map pages in
	ActionSegmentUnmap // and out of a segment; goalloc records neither
	ActionOOM
	ActionSnapshot
	NumActions
)

var actionNames = [NumActions]string{"alloc", "free_requested", "free_completed",
	"segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom", "snapshot"}

func (a Action) String() string { return actionNames[a] }

// ActionNamed is the action PyTorch calls name, and false for a name that is
// none of them.
func ActionNamed(name string) (Action, bool) {
	for a, n := range actionNames {
		if n == name {
			return Action(a), true
		}
	}
	return 0, false
}

// The actions as the allocator's code records them.
const (
	actionAlloc         = ActionAlloc
	actionFreeRequested = ActionFreeRequested
	actionFreeCompleted = ActionFreeCompleted
	actionSegmentAlloc  = ActionSegmentAlloc
	actionSegmentFree   = ActionSegmentFree
	actionOOM           = ActionOOM
	actionEmptyCache    = ActionSnapshot // goalloc marks an empty_cache with "snapshot"
)

// TraceEntry is one recorded allocator event.
type TraceEntry struct {
	Action Action
	Addr   uintptr
	Size   uint64
	Stream arena.Stream
	TimeNs int64 // wall clock, Unix nanoseconds
}

// MaxHistoryEntries bounds RecordHistory's ring: a snapshot turns every
// entry into JSON and then into a Python dict, about 1.4 KB an entry at the
// peak (measured: a snapshot of 1,000,000 entries of one device grew a
// Python process by 1.3 GiB), so 2^20 entries stay near 1.4 GiB a device,
// where the old bound of 2^26 would have needed about 90 GB.
const MaxHistoryEntries = 1 << 20

// history is a ring of the most recent TraceEntries. A nil *history records
// nothing, so the hot path pays one nil check when recording is off.
//
// The segment entries (segment_alloc, segment_free) are written here by
// the cache, where it takes or gives back memory (small.go, large.go,
// release.go), not by an adaptor on the memory stack as the cap and the
// device-call counts are (arena/limit.go, counting.go), for two reasons.
// An entry names the stream the segment belongs to, and a graph pool's
// segments come from AllocUncaptured, which takes no stream: only the
// cache knows the capturing stream whose free list the segment joins, and
// an adaptor would record stream 0 in their place, changing the snapshots
// torch's viewer and the replay read. And the segment entries interleave
// with the cache's own alloc and free entries in this one ring, switched
// on and off under the allocator's mutex (RecordHistory), so an adaptor
// would call back into the ring here all the same.
type history struct {
	ring  []TraceEntry
	next  int  // where the next entry goes
	full  bool // the ring has wrapped
	total int64
}

func (h *history) add(act Action, addr uintptr, size uint64, s arena.Stream) {
	if h == nil {
		return
	}
	h.ring[h.next] = TraceEntry{Action: act, Addr: addr, Size: size, Stream: s, TimeNs: time.Now().UnixNano()}
	h.total++
	h.next++
	if h.next == len(h.ring) {
		h.next, h.full = 0, true
	}
}

func (h *history) entries() []TraceEntry {
	if h == nil {
		return nil
	}
	if !h.full {
		return append([]TraceEntry(nil), h.ring[:h.next]...)
	}
	out := append([]TraceEntry(nil), h.ring[h.next:]...)
	return append(out, h.ring[:h.next]...)
}

// RecordHistory turns event recording on, keeping the last maxEntries
// events (the old ones are dropped), or off when maxEntries is 0.
func (a *Allocator) RecordHistory(maxEntries int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.publishFront()
	if maxEntries <= 0 {
		a.history = nil
		return
	}
	a.history = &history{ring: make([]TraceEntry, maxEntries)}
}
