package main

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The figures the C++ class copies into c10's DeviceStats are memory_stats()'s,
// in the order of goalloc.h's table (caching.StatTables, which
// TestStatTablesMatchTheHeader holds to the header).
func TestTorchStatsFollowTheHeadersTable(t *testing.T) {
	l := simLibrary(t, "2")
	p := l.malloc(3_000_000, 1, 0)
	require.NotZero(t, p)
	st, err := l.stats(1)
	require.NoError(t, err)
	var figures [caching.NumTorchFigures]int64
	st.TorchFigures(&figures)

	m := stats(t, l, 1)
	arrays, pools, values, counters := caching.StatTables()
	var want []int64
	for _, name := range arrays {
		for _, pool := range pools {
			for _, v := range values {
				want = append(want, m[name+"."+pool+"."+v])
			}
		}
	}
	for _, name := range counters {
		want = append(want, m[name])
	}
	assert.Equal(t, want, figures[:])
	assert.EqualValues(t, 3_000_320, m["allocated_bytes.all.current"])

	none, err := l.stats(0)
	require.NoError(t, err)
	assert.Zero(t, none.AllocatedBytes[caching.StatAll].Current, "an untouched device reads zero")
	_, err = l.stats(7)
	require.Error(t, err)
}

// The DataPtr deleter knows only the pointer: it is freed on whichever
// device holds it, with the size and stream it was allocated with.
func TestFreeOwnedFindsTheDevice(t *testing.T) {
	l := simLibrary(t, "3")
	p, err := l.mallocIn(1<<20, 2, 0x10, caching.PoolID{})
	require.NoError(t, err)
	q, err := l.mallocIn(1000, 0, 0x20, caching.PoolID{})
	require.NoError(t, err)
	require.NoError(t, l.freeOwned(p))
	require.NoError(t, l.freeOwned(q))
	require.NoError(t, l.freeOwned(0), "an empty tensor's deleter")
	assert.Error(t, l.freeOwned(p), "a double free")
	assert.Error(t, l.freeOwned(0xdead000), "not goalloc's pointer")
	assert.Zero(t, stats(t, l, 2)["allocated_bytes.all.current"])
	assert.Zero(t, stats(t, l, 0)["allocated_bytes.all.current"])
	assert.Zero(t, stats(t, l, 2)["goalloc.bad_input.size_mismatch"]+stats(t, l, 2)["goalloc.bad_input.stream_mismatch"],
		"freed with its own size and stream")
	assert.EqualValues(t, 1, stats(t, l, 2)["goalloc.bad_input.double_free"])
	assert.EqualValues(t, 1, stats(t, l, 0)["goalloc.bad_input.unknown_pointer"])
}

// A refused allocation hands back its error: the class throws it as
// torch.OutOfMemoryError when it is an out-of-memory, and that is the one
// place it is said, as with PyTorch's allocator: nothing on stderr. The C
// ABI's NULL says nothing, so there goalloc prints it.
func TestMallocInReturnsTheError(t *testing.T) {
	out := captureLibraryOutput(t)
	l := simLibrary(t, "1")
	_, err := l.mallocIn(1<<40, 0, 0, caching.PoolID{})
	var oom *caching.OOMError
	require.ErrorAs(t, err, &oom)
	assert.Contains(t, err.Error(), "CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 8.00 GiB")
	assert.Equal(t, []string{""}, out.lines(), "the class's out-of-memory is not printed")
	assert.Zero(t, l.malloc(1<<40, 0, 0))
	assert.Len(t, out.lines(), 1, "the C ABI's is")
	_, err = l.mallocIn(64, 0, 0, caching.PoolID{0, 9})
	require.Error(t, err)
	assert.NotErrorAs(t, err, &oom)
	_, err = l.mallocIn(64, 5, 0, caching.PoolID{})
	require.ErrorContains(t, err, "device 5 does not exist")
}

// snapshotOf is device d's snapshot as goalloc_snapshot_json writes it.
func snapshotOf(t *testing.T, l *library, d int) caching.Snapshot {
	t.Helper()
	b, err := l.snapshotJSON(d)
	require.NoError(t, err)
	var out []struct {
		Device int `json:"device"`
		caching.Snapshot
	}
	require.NoError(t, json.Unmarshal(b, &out))
	require.Len(t, out, 1)
	return out[0].Snapshot
}

// The C++ class's calls name themselves with context ids: the library
// passes them to the device's allocator, says which device a free was on,
// and the snapshot JSON gives the ids back on entries and blocks.
func TestContextIDsThroughTheLibrary(t *testing.T) {
	l := simLibrary(t, "2")
	require.NoError(t, l.recordHistoryWith(100, nil, false))
	p, err := l.mallocInCtx(1000, 0, 1, 0x10, caching.PoolID{}, 7)
	require.NoError(t, err)
	q, err := l.mallocInCtx(3_000_000, 0, 1, 0x10, caching.PoolID{}, 8)
	require.NoError(t, err)
	d, err := l.freeOwnedCtx(p, 9)
	require.NoError(t, err)
	assert.Equal(t, 1, d, "the device the block was on")
	d, err = l.freeOwnedCtx(0, 9)
	assert.NoError(t, err, "an empty tensor's deleter")
	assert.Equal(t, -1, d)
	d, err = l.freeOwnedCtx(0xdead000, 9)
	assert.Error(t, err)
	assert.Equal(t, -1, d)
	require.NoError(t, l.emptyCacheCtx(10))

	snap := snapshotOf(t, l, 1)
	var got []string
	for _, e := range snap.Trace {
		got = append(got, fmt.Sprintf("%s %d %d", e.Action, e.Size, e.Ctx))
	}
	assert.Equal(t, []string{
		"segment_alloc 262144 7", "alloc 1000 7", "segment_alloc 3000320 8", "alloc 3000000 8",
		"free_requested 1000 9", "free_completed 1000 9", "snapshot 0 10", "segment_free 262144 10",
	}, got)
	var live []string
	for _, s := range snap.Segments {
		for _, b := range s.Blocks {
			if b.State == "active_allocated" {
				live = append(live, fmt.Sprintf("%#x %d %d", b.Address, b.Ctx, s.Ctx))
			}
		}
	}
	assert.Equal(t, []string{fmt.Sprintf("%#x 8 8", q)}, live)
	b, err := l.snapshotJSON(1)
	require.NoError(t, err)
	assert.Contains(t, string(b), `"frames":[],"ctx":7}`, "the id after frames")

	// Without an id nothing is added: the JSON reads as before.
	require.NoError(t, l.recordHistory(100))
	r, err := l.mallocIn(1000, 0, 0, caching.PoolID{})
	require.NoError(t, err)
	require.NoError(t, l.freeOwned(r))
	b, err = l.snapshotJSON(0)
	require.NoError(t, err)
	assert.NotContains(t, string(b), `"ctx"`)
	assert.NotContains(t, string(b), `"user_metadata"`)
}

// skip_actions and clear_history reach every device, present and future;
// an unknown action is refused as bad input and changes nothing.
func TestRecordHistoryOptions(t *testing.T) {
	l := simLibrary(t, "2")
	require.NoError(t, l.recordHistoryWith(100, []string{"free_requested"}, false))
	p := l.malloc(1000, 0, 0)
	l.free(p, 1000, 0, 0)
	q := l.malloc(1000, 1, 0) // made after the call
	l.free(q, 1000, 1, 0)
	for d := range 2 {
		var acts []string
		for _, e := range snapshotOf(t, l, d).Trace {
			acts = append(acts, e.Action)
		}
		assert.Equal(t, []string{"segment_alloc", "alloc", "free_completed"}, acts, "device %d", d)
	}
	err := l.recordHistoryWith(100, []string{"alloc", "frees"}, false)
	require.ErrorContains(t, err, `skip_actions: unknown trace action "frees"`)
	assert.Equal(t, errBadArgument, l.lastErrorKind())
	assert.Len(t, snapshotOf(t, l, 0).Trace, 3, "a refused call changes nothing")
	require.NoError(t, l.recordHistoryWith(100, nil, false))
	assert.Len(t, snapshotOf(t, l, 0).Trace, 3, "on again keeps the history")
	require.NoError(t, l.recordHistoryWith(100, nil, true))
	assert.Empty(t, snapshotOf(t, l, 0).Trace, "clear_history")
	assert.Error(t, l.recordHistoryWith(-1, nil, false))
}

// Trace labels are per device, kept for a device not made yet, and
// stamped on the entries made while they are in force.
func TestTraceLabelsPerDevice(t *testing.T) {
	l := simLibrary(t, "2")
	require.NoError(t, l.setTraceLabels(1, caching.TraceLabels{CompileContext: "region", UserMetadata: "meta"}))
	assert.Nil(t, l.existingDevice(1), "setting labels makes no device")
	require.NoError(t, l.recordHistory(100))
	p := l.malloc(1000, 1, 0)
	q := l.malloc(1000, 0, 0)
	for _, e := range snapshotOf(t, l, 1).Trace {
		assert.Equal(t, [2]string{"region", "meta"}, [2]string{e.CompileContext, e.UserMetadata})
	}
	for _, e := range snapshotOf(t, l, 0).Trace {
		assert.Equal(t, [2]string{"", ""}, [2]string{e.CompileContext, e.UserMetadata}, "device 0 has none")
	}
	require.NoError(t, l.setTraceLabels(1, caching.TraceLabels{}))
	l.free(p, 1000, 1, 0)
	tr := snapshotOf(t, l, 1).Trace
	assert.Empty(t, tr[len(tr)-1].UserMetadata)
	l.free(q, 1000, 0, 0)
	assert.Error(t, l.setTraceLabels(5, caching.TraceLabels{}), "no device 5")
}
