package caching

import "sort"

// SnapshotBlock is one block of a segment, with the keys of a block in
// torch.cuda.memory._snapshot().
type SnapshotBlock struct {
	Address       uint64 `json:"address"`
	Size          uint64 `json:"size"`
	RequestedSize uint64 `json:"requested_size"`
	// State is "active_allocated", "active_pending_free" or "inactive".
	State  string `json:"state"`
	Frames []any  `json:"frames"`
	// Ctx is the context id of the allocation of an active block, absent
	// when its call had none (history.go, "Context ids").
	Ctx uint64 `json:"ctx,omitempty"`
}

// SnapshotSegment is one pool allocation goalloc holds, with the keys of a
// segment in torch.cuda.memory._snapshot().
type SnapshotSegment struct {
	Device        int             `json:"device"`
	Address       uint64          `json:"address"`
	TotalSize     uint64          `json:"total_size"`
	AllocatedSize uint64          `json:"allocated_size"`
	ActiveSize    uint64          `json:"active_size"`
	RequestedSize uint64          `json:"requested_size"`
	Stream        uint64          `json:"stream"`
	SegmentType   string          `json:"segment_type"` // "small" or "large"
	SegmentPoolID [2]uint64       `json:"segment_pool_id"`
	IsExpandable  bool            `json:"is_expandable"`
	Frames        []any           `json:"frames"`
	Blocks        []SnapshotBlock `json:"blocks"`
	// Ctx is the context id of the call that took the segment from the
	// pool, absent when it had none.
	Ctx uint64 `json:"ctx,omitempty"`
}

// TraceJSON is one history entry with the keys of a device trace entry in
// torch.cuda.memory._snapshot(), and its context id. The keys after frames
// are absent when empty, so that a history recorded without ids or labels
// reads as before (python/goalloc/_trace.py reads this layout).
type TraceJSON struct {
	Action         string `json:"action"`
	Addr           uint64 `json:"addr"`
	Size           uint64 `json:"size"`
	Stream         uint64 `json:"stream"`
	TimeUs         int64  `json:"time_us"`
	Frames         []any  `json:"frames"`
	Ctx            uint64 `json:"ctx,omitempty"`
	CompileContext string `json:"compile_context,omitempty"`
	UserMetadata   string `json:"user_metadata,omitempty"`
}

// Snapshot is the state of one device: its segments, sorted by address, and
// the recorded history (empty unless RecordHistory is on).
type Snapshot struct {
	Segments []SnapshotSegment `json:"segments"`
	Trace    []TraceJSON       `json:"device_traces"`
}

// Snapshot describes every segment goalloc holds and the recorded history.
// Consecutive free slots of a small segment are shown as one inactive block,
// as PyTorch shows a free range.
func (a *Allocator) Snapshot() Snapshot {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pollDeferred()
	dev := a.dev.Ordinal()
	snap := Snapshot{Segments: []SnapshotSegment{}, Trace: []TraceJSON{}}
	for i := range a.blocks {
		b := &a.blocks[i]
		if b.state == blockUnused {
			continue
		}
		seg := SnapshotSegment{Device: dev, Address: uint64(b.addr), TotalSize: b.size,
			Stream: uint64(b.stream), SegmentType: "large", SegmentPoolID: b.list.pool.id, Frames: []any{}}
		// An inactive block keeps the size last requested in it (as
		// PyTorch's does); a segment counts only its active blocks'.
		blk := SnapshotBlock{Address: uint64(b.addr), Size: b.size, RequestedSize: b.requested, State: "inactive", Frames: []any{}}
		switch b.state {
		case blockLive:
			blk.State, blk.RequestedSize, blk.Ctx = "active_allocated", b.requested, b.ctx
			seg.AllocatedSize, seg.ActiveSize, seg.RequestedSize = b.size, b.size, b.requested
		case blockPending:
			blk.State, blk.Ctx = "active_pending_free", b.ctx
			seg.ActiveSize = b.size
		}
		seg.Ctx = b.segCtx
		seg.Blocks = []SnapshotBlock{blk}
		snap.Segments = append(snap.Segments, seg)
	}
	for _, s := range a.segments {
		seg := SnapshotSegment{Device: dev, Address: uint64(s.addr), TotalSize: s.size,
			Stream: uint64(s.stream), SegmentType: "small", SegmentPoolID: s.list.pool.id, Frames: []any{}, Ctx: s.segCtx}
		freedAt := s.freeOrder()
		lastFreed := int32(-1) // of the current run of free slots
		for i := int32(0); i < s.nslots; i++ {
			addr := uint64(s.slotAddr(i))
			blk := SnapshotBlock{Address: addr, Size: s.slotSize, State: "inactive", Frames: []any{}}
			switch s.state[i] {
			case slotLive:
				blk.State, blk.RequestedSize, blk.Ctx = "active_allocated", uint64(s.requested[i]), s.slotCtx(i)
				seg.AllocatedSize += s.slotSize
				seg.ActiveSize += s.slotSize
				seg.RequestedSize += blk.RequestedSize
			case slotPending:
				blk.State, blk.Ctx = "active_pending_free", s.slotCtx(i)
				seg.ActiveSize += s.slotSize
			}
			if blk.State != "inactive" {
				seg.Blocks = append(seg.Blocks, blk)
				continue
			}
			// A run of free slots is one inactive block, which keeps the
			// size last requested in the slot of the run freed last, as
			// PyTorch's merged free block keeps its last-freed block's.
			n := len(seg.Blocks)
			if n == 0 || seg.Blocks[n-1].State != "inactive" {
				seg.Blocks = append(seg.Blocks, blk)
				n++
				lastFreed = -1
			} else {
				seg.Blocks[n-1].Size += s.slotSize
			}
			if s.state[i] == slotFree && (lastFreed < 0 || freedAt[i] > freedAt[lastFreed]) {
				lastFreed = i
				seg.Blocks[n-1].RequestedSize = uint64(s.requested[i])
			}
		}
		if tail := s.size - uint64(s.nslots)*s.slotSize; tail > 0 {
			n := len(seg.Blocks)
			if seg.Blocks[n-1].State == "inactive" {
				seg.Blocks[n-1].Size += tail
			} else {
				seg.Blocks = append(seg.Blocks, SnapshotBlock{Address: uint64(s.addr) + s.size - tail,
					Size: tail, State: "inactive", Frames: []any{}})
			}
		}
		snap.Segments = append(snap.Segments, seg)
	}
	sort.Slice(snap.Segments, func(i, j int) bool { return snap.Segments[i].Address < snap.Segments[j].Address })
	for _, e := range a.history.entries() {
		t := TraceJSON{Action: e.Action.String(), Addr: uint64(e.Addr), Size: e.Size,
			Stream: uint64(e.Stream), TimeUs: e.TimeNs / 1000, Frames: []any{}, Ctx: e.Ctx}
		if e.Labels != nil {
			t.CompileContext, t.UserMetadata = e.Labels.CompileContext, e.Labels.UserMetadata
		}
		snap.Trace = append(snap.Trace, t)
	}
	return snap
}
