package caching

import (
	"fmt"
	"strings"
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

// ActionSet is a set of actions, one bit each.
type ActionSet uint16

// Has says whether act is in the set.
func (s ActionSet) Has(act Action) bool { return s&(1<<act) != 0 }

// ParseActions is the set of the actions named, as PyTorch's
// _record_memory_history takes them in skip_actions; an unknown name is an
// error that lists the names there are.
func ParseActions(names []string) (ActionSet, error) {
	var s ActionSet
	for _, n := range names {
		act, ok := ActionNamed(n)
		if !ok {
			return 0, fmt.Errorf("unknown trace action %q; the actions are %s", n, strings.Join(actionNames[:], ", "))
		}
		s |= 1 << act
	}
	return s, nil
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
//
// Size is, as in PyTorch's traces, the size the user asked for in alloc,
// free_requested and free_completed (not the slot or block handed out: a
// block's own size is in the snapshot's segments), the segment's size in
// segment_alloc and segment_free, the request's in oom, 0 in snapshot.
type TraceEntry struct {
	Action Action
	Addr   uintptr
	Size   uint64
	Stream arena.Stream
	TimeNs int64 // wall clock, Unix nanoseconds
	// Ctx is the caller's context id of the call that made the entry, 0
	// for none (see "Context ids" below).
	Ctx uint64
	// Labels are the labels in force when the entry was made (nil: none).
	Labels *TraceLabels
}

// Context ids. A caller that records where its calls come from (goalloc's
// C++ class keeps PyTorch's stack traces) names each call with an opaque
// 64-bit id: MallocInCtx, FreeOwnedCtx and EmptyCacheCtx take one, 0
// meaning none. goalloc keeps the ids and gives them back in the snapshot;
// what an id stands for is the caller's. Which id an entry carries:
//
//   - alloc, free_requested, segment_alloc, oom and the empty_cache marker:
//     the id of the call that made it;
//   - free_completed: its free's id, also when the free waited for other
//     streams (record_stream) and completed in a later call;
//   - segment_free: the id of the call that gave the segment back, or, when
//     that call has none, the segment's own (below).
//
// A live block keeps the id of the call that allocated it, and a segment
// (a small segment, or a large block, which is its own segment) the id of
// the call that took it from the pool. An id is stored only when a call
// brings one, so a caller that never passes one costs nothing but a store.

// TraceLabels are the labels PyTorch puts on every trace entry: the
// torch.compile region being run (compile_context) and the user's
// torch.cuda.memory._set_memory_metadata. An entry keeps the labels in
// force when it was made.
type TraceLabels struct {
	CompileContext string
	UserMetadata   string
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
	// skip holds the actions not recorded (PyTorch's skip_actions).
	skip ActionSet
	// labels is the Allocator's labels, stamped on every entry.
	labels *TraceLabels
}

func (h *history) add(act Action, addr uintptr, size uint64, s arena.Stream, ctx uint64) {
	if h == nil || h.skip.Has(act) {
		return
	}
	h.ring[h.next] = TraceEntry{Action: act, Addr: addr, Size: size, Stream: s, TimeNs: time.Now().UnixNano(),
		Ctx: ctx, Labels: h.labels}
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

// HistoryOptions say how RecordHistoryWith records.
type HistoryOptions struct {
	// MaxEntries is how many of the last entries are kept; 0 turns
	// recording off and drops what was recorded.
	MaxEntries int
	// Skip holds the actions not recorded.
	Skip ActionSet
	// Clear drops what was recorded. Without it, turning recording on
	// while it is on keeps the newest entries that fit MaxEntries, as
	// PyTorch's _record_memory_history does unless clear_history is set.
	Clear bool
}

// RecordHistory turns event recording on, keeping the last maxEntries
// events (the old ones are dropped), or off when maxEntries is 0. It starts
// afresh: what was recorded is dropped.
func (a *Allocator) RecordHistory(maxEntries int) {
	a.RecordHistoryWith(HistoryOptions{MaxEntries: maxEntries, Clear: true})
}

// RecordHistoryWith turns event recording on or off as o says.
func (a *Allocator) RecordHistoryWith(o HistoryOptions) {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.publishFront()
	if o.MaxEntries <= 0 {
		a.history = nil
		return
	}
	h := &history{ring: make([]TraceEntry, o.MaxEntries), skip: o.Skip, labels: a.labels}
	if !o.Clear {
		kept := a.history.entries()
		kept = kept[max(0, len(kept)-o.MaxEntries):]
		h.next = copy(h.ring, kept)
		h.total = int64(h.next)
		if h.next == len(h.ring) {
			h.next, h.full = 0, true
		}
	}
	a.history = h
}

// SetTraceLabels sets the labels stamped on every entry recorded from now
// on (empty strings: none).
func (a *Allocator) SetTraceLabels(l TraceLabels) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.labels = nil
	if l != (TraceLabels{}) {
		a.labels = &l
	}
	if a.history != nil {
		a.history.labels = a.labels
	}
}

// TraceLabels is what SetTraceLabels set.
func (a *Allocator) TraceLabels() TraceLabels {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.labels == nil {
		return TraceLabels{}
	}
	return *a.labels
}
