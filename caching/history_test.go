package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The action names are PyTorch's, in the order the replay tool lists them;
// each reads back to its action, and no other name reads as one.
func TestActionNames(t *testing.T) {
	want := []string{"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
		"segment_map", "segment_unmap", "oom", "snapshot"}
	require.Len(t, want, int(NumActions))
	for a := range NumActions {
		assert.Equal(t, want[a], a.String())
		got, ok := ActionNamed(a.String())
		assert.True(t, ok, a.String())
		assert.Equal(t, a, got)
	}
	for _, name := range []string{"", "Alloc", "free", "empty_cache", "alloc "} {
		_, ok := ActionNamed(name)
		assert.False(t, ok, name)
	}
	assert.Equal(t, "snapshot", actionEmptyCache.String(), "an empty_cache is marked as it was")
}

// trace is the snapshot's history as (action, addr, size, ctx).
type traced struct {
	act  string
	addr uintptr
	size uint64
	ctx  uint64
}

func traceOf(a *Allocator) []traced {
	var out []traced
	for _, e := range a.Snapshot().Trace {
		out = append(out, traced{e.Action, uintptr(e.Addr), e.Size, e.Ctx})
	}
	return out
}

// blockCtx is the ctx the snapshot gives the active block at p, and the
// ctx of its segment.
func blockCtx(t *testing.T, a *Allocator, p uintptr) (blk, seg uint64) {
	t.Helper()
	for _, s := range a.Snapshot().Segments {
		for _, b := range s.Blocks {
			if uintptr(b.Address) == p && b.State != "inactive" {
				return b.Ctx, s.Ctx
			}
		}
	}
	t.Fatalf("no active block at %#x", p)
	return 0, 0
}

// alloc, free_requested and free_completed carry the size asked for, as in
// PyTorch's traces (test_cpp_memory_snapshot_pickle checks it); segment
// entries the segment's size. The snapshot's blocks keep the slot or
// block handed out.
func TestTraceSizesAreTheRequests(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	a.RecordHistory(100)
	const small, large = 1000, 311 * 411 * 4
	p, err := a.Malloc(small, 0)
	require.NoError(t, err)
	q, err := a.Malloc(large, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, small, 0))
	require.NoError(t, a.Free(q, large, 0))
	seg := uint64(classSegment[sizeToClass[(small+classAlign-1)/classAlign]])
	assert.Equal(t, []traced{
		{"segment_alloc", p, seg, 0}, {"alloc", p, small, 0},
		{"segment_alloc", q, 511488, 0}, {"alloc", q, large, 0},
		{"free_requested", p, small, 0}, {"free_completed", p, small, 0},
		{"free_requested", q, large, 0}, {"free_completed", q, large, 0},
	}, traceOf(a))
}

// Every entry carries the context id of the call that made it; live blocks
// and segments keep theirs; the ids of frees reach their free_completed
// and the segment_free of the segments they give back.
func TestContextIDsReachEntriesBlocksAndSegments(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	a.RecordHistory(100)
	const small, large = 1000, 5 << 20
	p, err := a.MallocInCtx(PoolID{}, small, 0, 11)
	require.NoError(t, err)
	q, err := a.MallocInCtx(PoolID{}, large, 0, 12)
	require.NoError(t, err)
	p2, err := a.MallocInCtx(PoolID{}, small, 0, 13) // a second slot of p's segment
	require.NoError(t, err)
	blk, seg := blockCtx(t, a, p)
	assert.Equal(t, [2]uint64{11, 11}, [2]uint64{blk, seg})
	blk, seg = blockCtx(t, a, p2)
	assert.Equal(t, [2]uint64{13, 11}, [2]uint64{blk, seg}, "a slot's own allocation; its segment's first")
	blk, seg = blockCtx(t, a, q)
	assert.Equal(t, [2]uint64{12, 12}, [2]uint64{blk, seg}, "a large block is its own segment")

	held, err := a.FreeOwnedCtx(q, 21)
	require.True(t, held)
	require.NoError(t, err)
	// The cached block again, from a call without an id: its allocation
	// has none, its segment keeps the id of the call that made it.
	q2, err := a.MallocIn(PoolID{}, large, 0)
	require.NoError(t, err)
	require.Equal(t, q, q2)
	blk, seg = blockCtx(t, a, q2)
	assert.Equal(t, [2]uint64{0, 12}, [2]uint64{blk, seg})
	_, err = a.FreeOwned(q2)
	require.NoError(t, err)
	_, err = a.FreeOwnedCtx(p, 22)
	require.NoError(t, err)
	_, err = a.FreeOwnedCtx(p2, 23)
	require.NoError(t, err)
	p3, err := a.MallocIn(PoolID{}, small, 0)
	require.NoError(t, err)
	blk, _ = blockCtx(t, a, p3)
	assert.Zero(t, blk, "a slot taken by a call without an id does not keep an earlier one's")
	_, err = a.FreeOwned(p3)
	require.NoError(t, err)
	require.NoError(t, a.EmptyCacheCtx(31))
	require.NoError(t, a.EmptyCache())
	require.NoError(t, a.CheckInvariants())

	segSize := uint64(classSegment[sizeToClass[(small+classAlign-1)/classAlign]])
	assert.Equal(t, []traced{
		{"segment_alloc", p, segSize, 11}, {"alloc", p, small, 11},
		{"segment_alloc", q, large, 12}, {"alloc", q, large, 12},
		{"alloc", p2, small, 13},
		{"free_requested", q, large, 21}, {"free_completed", q, large, 21},
		{"alloc", q, large, 0},
		{"free_requested", q, large, 0}, {"free_completed", q, large, 0},
		{"free_requested", p, small, 22}, {"free_completed", p, small, 22},
		{"free_requested", p2, small, 23}, {"free_completed", p2, small, 23},
		{"alloc", p3, small, 0},
		{"free_requested", p3, small, 0}, {"free_completed", p3, small, 0},
		// The marker first, then what the call gives back, under its id.
		{"snapshot", 0, 0, 31},
		{"segment_free", q, large, 31}, {"segment_free", p, segSize, 31},
		{"snapshot", 0, 0, 0},
	}, traceOf(a))

	// A segment given back by a call without an id names its own.
	r, err := a.MallocInCtx(PoolID{}, large, 0, 41)
	require.NoError(t, err)
	_, err = a.FreeOwnedCtx(r, 42)
	require.NoError(t, err)
	require.NoError(t, a.EmptyCache())
	got := traceOf(a)
	assert.Equal(t, traced{"segment_free", r, large, 41}, got[len(got)-1])
}

// A free that waits for another stream (record_stream) completes in a
// later call; its free_completed carries the free's id all the same.
func TestDeferredFreeCompletesUnderItsFreesID(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	sim.SetManual(true)
	a.RecordHistory(100)
	const A, B = arena.Stream(0x10), arena.Stream(0x20)
	for _, size := range []uint64{4000, 8 << 20} {
		p, err := a.MallocInCtx(PoolID{}, size, A, 1)
		require.NoError(t, err)
		require.NoError(t, a.RecordStream(p, B))
		sim.Launch(B)
		_, err = a.FreeOwnedCtx(p, 2)
		require.NoError(t, err)
		blk, _ := blockCtx(t, a, p)
		assert.EqualValues(t, 1, blk, "a pending block keeps its allocation's id")
		require.NoError(t, a.CheckInvariants())
		sim.Complete(B)
		q, err := a.MallocInCtx(PoolID{}, size, A, 3) // polls the deferred free
		require.NoError(t, err)
		var completed []traced
		for _, e := range traceOf(a) {
			if e.act == "free_completed" && e.addr == p {
				completed = append(completed, e)
			}
		}
		assert.Equal(t, []traced{{"free_completed", p, size, 2}}, completed)
		_, err = a.FreeOwned(q)
		require.NoError(t, err)
		a.RecordHistory(100)
	}
	assert.Nil(t, a.pendingCtx)
	require.NoError(t, a.CheckInvariants())
}

// skip_actions: the actions named are not recorded, the others are.
func TestHistorySkipsActions(t *testing.T) {
	skip, err := ParseActions([]string{"free_requested", "segment_alloc"})
	require.NoError(t, err)
	a, _ := newTestAllocator(t, DefaultConfig())
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 100, Skip: skip})
	p, err := a.Malloc(1000, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 1000, 0))
	var acts []string
	for _, e := range traceOf(a) {
		acts = append(acts, e.act)
	}
	assert.Equal(t, []string{"alloc", "free_completed"}, acts)

	_, err = ParseActions([]string{"alloc", "free"})
	require.ErrorContains(t, err, `unknown trace action "free"`)
	require.ErrorContains(t, err, "alloc, free_requested, free_completed")
}

// Turning recording on while it is on keeps what was recorded, the newest
// entries that fit, unless told to clear; turning it off drops it.
func TestHistoryKeptUnlessCleared(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 100})
	for i := 0; i < 3; i++ {
		p, err := a.Malloc(1000, 0)
		require.NoError(t, err)
		require.NoError(t, a.Free(p, 1000, 0))
	}
	all := traceOf(a)
	require.Len(t, all, 10)
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 100})
	assert.Equal(t, all, traceOf(a), "on again: kept")
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 4})
	assert.Equal(t, all[6:], traceOf(a), "a smaller ring keeps the newest")
	p, err := a.Malloc(1000, 0)
	require.NoError(t, err)
	got := traceOf(a)
	assert.Equal(t, append(all[7:], traced{"alloc", p, 1000, 0}), got, "and goes on as a ring")
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 4, Clear: true})
	assert.Empty(t, traceOf(a), "cleared")
	require.NoError(t, a.Free(p, 1000, 0))
	a.RecordHistoryWith(HistoryOptions{})
	a.RecordHistoryWith(HistoryOptions{MaxEntries: 4})
	assert.Empty(t, traceOf(a), "off drops the history")
}

// Each entry keeps the labels in force when it was made.
func TestTraceLabelsAreStampedWhenRecorded(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	a.SetTraceLabels(TraceLabels{UserMetadata: "set before recording"})
	a.RecordHistory(100)
	p, err := a.Malloc(1000, 0)
	require.NoError(t, err)
	a.SetTraceLabels(TraceLabels{CompileContext: "Torch-Compiled Region: 0/0", UserMetadata: "m"})
	require.NoError(t, a.Free(p, 1000, 0))
	a.SetTraceLabels(TraceLabels{})
	require.NoError(t, a.EmptyCache())
	var got [][2]string
	for _, e := range a.Snapshot().Trace {
		got = append(got, [2]string{e.CompileContext, e.UserMetadata})
	}
	assert.Equal(t, [][2]string{
		{"", "set before recording"}, {"", "set before recording"}, // segment_alloc, alloc
		{"Torch-Compiled Region: 0/0", "m"}, {"Torch-Compiled Region: 0/0", "m"}, // the free
		{"", ""}, {"", ""}, // empty_cache: its marker and segment_free
	}, got)
	assert.Equal(t, TraceLabels{}, a.TraceLabels())
}
