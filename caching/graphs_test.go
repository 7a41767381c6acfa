package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The simulated device refuses stream-ordered calls on a capturing stream
// and synchronisation during a capture, as the real driver would turn them
// into graph nodes or invalidate the capture; these tests would fail if the
// allocator made one.
func TestGraphCaptureUsesAPrivatePool(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	const C, E = arena.Stream(0xc0), arena.Stream(0xe0) // capture stream, eager stream
	id := PoolID{1, 7}

	// Eager memory cached on the capture stream before the capture.
	warm, err := a.Malloc(8<<20, C)
	require.NoError(t, err)
	require.NoError(t, a.Free(warm, 8<<20, C))

	sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(id))
	x, err := a.Malloc(8<<20, C)
	require.NoError(t, err)
	assert.NotEqual(t, warm, x, "the capture does not take eager cached memory")
	tmp, err := a.Malloc(1000, C)
	require.NoError(t, err)
	require.NoError(t, a.Free(tmp, 1000, C)) // a temporary freed during capture
	tmp2, err := a.Malloc(1000, C)
	require.NoError(t, err)
	assert.Equal(t, tmp, tmp2, "memory freed during capture is reused within the capture")
	y, err := a.Malloc(4<<20, E)
	require.NoError(t, err, "an eager stream allocates normally during the window")
	require.NoError(t, a.EndAllocateToPool(id))
	sim.SetCapture(C, arena.CaptureNone)
	require.NoError(t, a.CheckInvariants())

	st := a.Stats()
	assert.EqualValues(t, 1, st.GraphPools)
	assert.EqualValues(t, 8<<20+uint64(classSegment[1]), st.GraphReservedBytes)
	f := a.Fragmentation()
	assert.EqualValues(t, 8<<20+uint64(classSegment[1]), f.GraphPrivateBytes)

	// The graph's output x dies; its memory stays private.
	require.NoError(t, a.Free(x, 8<<20, C))
	z, err := a.Malloc(8<<20, C)
	require.NoError(t, err)
	assert.Equal(t, warm, z, "eager code gets its own cache back, never the graph's memory")
	require.NoError(t, a.Free(z, 8<<20, C))
	require.NoError(t, a.Free(y, 4<<20, E))

	// A second graph shares the pool (torch.cuda.graph(pool=g1.pool())).
	sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(id))
	x2, err := a.Malloc(8<<20, C)
	require.NoError(t, err)
	assert.Equal(t, x, x2, "a capture into a shared pool reuses its free memory")
	require.NoError(t, a.EndAllocateToPool(id))
	sim.SetCapture(C, arena.CaptureNone)

	// Releasing the first graph keeps the pool for the second.
	require.NoError(t, a.ReleasePool(id))
	assert.EqualValues(t, 1, a.Stats().GraphPools)
	require.NoError(t, a.ReleasePool(id))
	// Released: the free memory went back; x2 is still live and follows when freed.
	assert.EqualValues(t, 8<<20+uint64(classSegment[1]), a.Stats().GraphReservedBytes, "x2 and tmp2 are live")
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, a.Free(x2, 8<<20, C))
	require.NoError(t, a.Free(tmp2, 1000, C))
	st = a.Stats()
	assert.Zero(t, st.GraphPools, "an empty released pool is forgotten")
	assert.Zero(t, st.GraphReservedBytes)
	require.NoError(t, a.CheckInvariants())

	var ie *InputError
	require.ErrorAs(t, a.ReleasePool(id), &ie)
	assert.Equal(t, "invalid_pool", ie.Kind)
	require.ErrorAs(t, a.EndAllocateToPool(PoolID{9, 9}), &ie)
	require.ErrorAs(t, a.BeginAllocateToPool(PoolID{}), &ie)
}

func TestGraphCaptureNeverFreesOnTheCapturingStream(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 16 << 20 // small budget: frees would evict
	a, sim := newTestAllocator(t, cfg)
	const C = arena.Stream(0xc0)
	var ps []uintptr
	for i := 0; i < 4; i++ {
		p, err := a.Malloc(uint64(10+i)<<20, C)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(PoolID{2, 2}))
	// Eager tensors of the capture stream die during the capture: caching
	// them would go over budget, but evicting now would free on C.
	for i, p := range ps {
		require.NoError(t, a.Free(p, uint64(10+i)<<20, C))
	}
	// An over-cap request during capture must not synchronise the device.
	require.NoError(t, a.SetLimit(a.reserved()+1<<20))
	_, err := a.Malloc(64<<20, C)
	var oom *OOMError
	require.ErrorAs(t, err, &oom)
	require.NoError(t, a.EndAllocateToPool(PoolID{2, 2}))
	sim.SetCapture(C, arena.CaptureNone)
	require.NoError(t, a.SetLimit(0))
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, a.EmptyCache())
	require.NoError(t, a.ReleasePool(PoolID{2, 2}))
	assert.Zero(t, a.reserved())
}

// torch releases a pool when its graph is destroyed, which can happen while
// a capture into the same pool is still open (a graph object dropped inside
// another capture's window). The release waits for the window to close:
// until then the window's allocations still land in the pool.
func TestReleaseDuringOpenWindowIsDeferred(t *testing.T) {
	for _, order := range []string{"release-end", "release-end-release"} {
		t.Run(order, func(t *testing.T) {
			a, sim := newTestAllocator(t, DefaultConfig())
			const C = arena.Stream(0xc0)
			id := PoolID{3, 0}
			sim.SetCapture(C, arena.CaptureActive)
			require.NoError(t, a.BeginAllocateToPool(id))
			require.NoError(t, a.ReleasePool(id), "a release during the window is deferred, not refused")
			p, err := a.Malloc(1<<20, C)
			require.NoError(t, err, "the window still allocates from its pool")
			q, err := a.Malloc(100, C)
			require.NoError(t, err)
			require.NoError(t, a.CheckInvariants())
			assert.EqualValues(t, 1, a.Stats().GraphPools)
			require.NoError(t, a.EndAllocateToPool(id))
			sim.SetCapture(C, arena.CaptureNone)
			// Released now: the pool's live memory goes back as it is freed.
			require.NoError(t, a.Free(p, 1<<20, C))
			require.NoError(t, a.Free(q, 100, C))
			assert.Zero(t, a.Stats().GraphPools, "the released pool is gone once empty")
			assert.Zero(t, a.Stats().OwnReserved.Current)
			if order == "release-end-release" {
				require.Error(t, a.ReleasePool(id), "a second release of a pool with no graph left is bad input")
			}
			require.NoError(t, a.CheckInvariants())
		})
	}
}

// Two releases for one begin during the window: the first is deferred, the
// second is bad input (no graph left to release), and nothing panics.
func TestReleaseTwiceDuringWindow(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	const C = arena.Stream(0xc0)
	id := PoolID{4, 0}
	sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(id))
	require.NoError(t, a.ReleasePool(id))
	require.Error(t, a.ReleasePool(id))
	_, err := a.Malloc(1<<20, C)
	require.NoError(t, err)
	require.NoError(t, a.EndAllocateToPool(id))
	require.NoError(t, a.CheckInvariants())
}

// simBackends runs f on the simulated device under each backend: the
// stream-ordered pool (async) and goalloc's own placement (vmm), both over
// the same Sim, which the test drives (streams, captures, faults).
func simBackends(t *testing.T, cfg Config, f func(t *testing.T, a *Allocator, sim *arena.Sim)) {
	t.Run("async", func(t *testing.T) {
		a, sim := newTestAllocator(t, cfg)
		f(t, a, sim)
	})
	t.Run("vmm", func(t *testing.T) {
		dev, err := arena.NewSimVMM(0, 16<<30)
		require.NoError(t, err)
		a, err := New(dev, cfg)
		require.NoError(t, err)
		f(t, a, dev.Sim)
		require.NoError(t, dev.CheckInvariants())
	})
}

// While a capture is underway goalloc records, queries and synchronises
// nothing, whatever the device has pending: PyTorch's
// test_cuda_graph_allocator_propagates_stream saw a cuEventQuery during a
// capture that a second stream had joined, which the driver refuses and
// which spoils the capture. The simulated device counts every such call
// (arena.Sim.CaptureViolations) and invalidates the capture, as the driver
// does. The joined stream's allocations go to the capture's pool, and
// what had to wait for events goes ahead once the capture ends.
func TestCaptureRecordsQueriesAndSynchronisesNothing(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, sim *arena.Sim) {
		const E, R = arena.Stream(0xe0), arena.Stream(0xf0)   // eager streams
		const C0, C1 = arena.Stream(0xc0), arena.Stream(0xc1) // the capture's origin, and a stream that joins it
		id := PoolID{1, 9}
		sim.SetManual(true) // work completes only when the test says

		// Before the capture: eager blocks freed with work still queued,
		// one of them used on R too (record_stream), so its free waits for
		// an event; on vmm their spans wait for fences.
		var eager []uintptr
		for i := 0; i < 4; i++ {
			p, err := a.Malloc(40<<20, E)
			require.NoError(t, err)
			eager = append(eager, p)
		}
		require.NoError(t, a.RecordStream(eager[0], R))
		sim.Launch(E)
		sim.Launch(R)
		for _, p := range eager {
			require.NoError(t, a.Free(p, 40<<20, E))
		}
		kept, err := a.Malloc(40<<20, E) // live across the capture, used by the capture's streams
		require.NoError(t, err)

		require.NoError(t, a.BeginAllocateToPool(id))
		sim.SetCapture(C0, arena.CaptureActive)
		x, err := a.Malloc(40<<20, C0)
		require.NoError(t, err)
		sim.SetCapture(C1, arena.CaptureActive) // s1.wait_stream(s0) inside the capture
		y, err := a.Malloc(40<<20, C1)
		require.NoError(t, err)
		small, err := a.Malloc(1000, C1)
		require.NoError(t, err)
		live := a.PoolLive(id)
		require.Len(t, live, 3, "the joined stream's allocations are the capture's")
		require.NoError(t, a.Free(y, 40<<20, C1))
		require.NoError(t, a.RecordStream(kept, C1))
		require.NoError(t, a.Free(kept, 40<<20, E)) // its free needs an event on a captured stream
		_ = a.Stats()                               // reads poll deferred frees
		_ = a.Snapshot()
		require.NoError(t, a.EmptyCache()) // empty_cache synchronises, but not during a capture
		z, err := a.Malloc(80<<20, C1)     // more memory for the pool
		require.NoError(t, err)
		sim.SetCapture(C0, arena.CaptureNone)
		sim.SetCapture(C1, arena.CaptureNone)
		require.NoError(t, a.EndAllocateToPool(id))

		assert.Zero(t, sim.CaptureViolations, "an event was recorded, queried or the device synchronised during the capture")
		require.NoError(t, a.CheckInvariants())

		// After the capture the waiting frees go ahead.
		sim.SetManual(false)
		require.NoError(t, a.EmptyCache())
		st := a.Stats()
		assert.EqualValues(t, 3, st.Active[StatAll].Current, "the frees that waited completed: only x, z and small are active")
		assert.Len(t, a.PoolLive(id), 3)
		require.NoError(t, a.Free(x, 40<<20, C0))
		require.NoError(t, a.Free(z, 80<<20, C1))
		require.NoError(t, a.Free(small, 1000, C1))
		require.NoError(t, a.ReleasePool(id))
		require.NoError(t, a.EmptyCache())
		st = a.Stats()
		assert.Zero(t, st.Active[StatAll].Current)
		assert.Zero(t, st.ReservedBytes[StatAll].Current, "everything went back")
		assert.Zero(t, st.GraphPools)
		require.NoError(t, a.CheckInvariants())
	})
}

// Inside a capture, a block of the capture's pool freed while another
// captured stream still reads it (record_stream) is not handed out again
// during the capture: the captured work of that stream may run after the
// free (test_cuda.py's test_graph_capture_reclaim_2_streams, "BEFORE JOIN:
// must NOT reuse"). Once the capture ends its events are recorded, and the
// pool has it again.
func TestRecordedFreeInACaptureWaitsForTheCaptureToEnd(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, sim *arena.Sim) {
		const C1, C2 = arena.Stream(0xc1), arena.Stream(0xc2)
		id := PoolID{3, 1}
		for _, size := range []uint64{32, 2 << 20} {
			require.NoError(t, a.BeginAllocateToPool(id))
			sim.SetCapture(C1, arena.CaptureActive)
			sim.SetCapture(C2, arena.CaptureActive)
			data1, err := a.Malloc(size, C1)
			require.NoError(t, err)
			require.NoError(t, a.RecordStream(data1, C2))
			require.NoError(t, a.Free(data1, size, C1))
			data2, err := a.Malloc(size, C1)
			require.NoError(t, err)
			assert.NotEqual(t, data1, data2, "size %d: reused while C2's captured work may still read it", size)
			sim.SetCapture(C1, arena.CaptureNone)
			sim.SetCapture(C2, arena.CaptureNone)
			require.NoError(t, a.EndAllocateToPool(id))
			assert.Zero(t, sim.CaptureViolations)

			require.NoError(t, a.BeginAllocateToPool(id))
			sim.SetCapture(C1, arena.CaptureActive)
			data3, err := a.Malloc(size, C1)
			require.NoError(t, err)
			assert.Equal(t, data1, data3, "size %d: the next capture into the pool has it again", size)
			sim.SetCapture(C1, arena.CaptureNone)
			require.NoError(t, a.EndAllocateToPool(id))
			require.NoError(t, a.Free(data2, size, C1))
			require.NoError(t, a.Free(data3, size, C1))
			require.NoError(t, a.CheckInvariants())
		}
	})
}

// empty_cache during a capture gives physical memory back but keeps the
// VA of emptied VMM segments (whether the driver allows cuMemAddressFree
// during a capture is not known: the simulated device refuses it); the VA
// goes at the next empty_cache after the capture.
func TestEmptyCacheDuringACaptureKeepsVA(t *testing.T) {
	dev, err := arena.NewSimVMM(0, 16<<30)
	require.NoError(t, err)
	a, err := New(dev, DefaultConfig())
	require.NoError(t, err)
	const X, C = arena.Stream(0x11), arena.Stream(0xc0)
	p, err := a.Malloc(40<<20, X)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 40<<20, X))
	require.NoError(t, a.BeginAllocateToPool(PoolID{5, 5}))
	dev.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, dev.CaptureViolations)
	assert.NotZero(t, dev.Phys().ReservedVA(), "X's segment keeps its VA during the capture")
	dev.SetCapture(C, arena.CaptureNone)
	require.NoError(t, a.EndAllocateToPool(PoolID{5, 5}))
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, dev.Phys().ReservedVA(), "and gives it back after")
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, dev.CheckInvariants())
}

// With PyTorch's graph_capture_record_stream_reuse, goalloc's C++ class
// proves from the capture's graph that the streams that used a block freed
// in the capture are done with it (they joined the allocating stream), and
// completes the free then: the block is the capture's again at once
// (test_graph_capture_reclaim_2_streams, "AFTER JOIN: now reuse is
// allowed").
func TestRecordedFreeCompletedDuringTheCapture(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, sim *arena.Sim) {
		const C1, C2 = arena.Stream(0xc1), arena.Stream(0xc2)
		id := PoolID{3, 2}
		require.NoError(t, a.BeginAllocateToPool(id))
		sim.SetCapture(C1, arena.CaptureActive)
		sim.SetCapture(C2, arena.CaptureActive)
		for _, size := range []uint64{32, 2 << 20} {
			data1, err := a.Malloc(size, C1)
			require.NoError(t, err)
			require.NoError(t, a.RecordStream(data1, C2))
			require.NoError(t, a.Free(data1, size, C1))
			assert.False(t, a.CompleteRecordedFree(data1+512), "no such free")
			assert.True(t, a.CompleteRecordedFree(data1))
			assert.False(t, a.CompleteRecordedFree(data1), "once")
			data3, err := a.Malloc(size, C1)
			require.NoError(t, err)
			assert.Equal(t, data1, data3, "size %d: reused in the capture", size)
			require.NoError(t, a.Free(data3, size, C1))
			require.NoError(t, a.CheckInvariants())
		}
		sim.SetCapture(C1, arena.CaptureNone)
		sim.SetCapture(C2, arena.CaptureNone)
		require.NoError(t, a.EndAllocateToPool(id))
		assert.Zero(t, sim.CaptureViolations)
		require.NoError(t, a.ReleasePool(id))
		require.NoError(t, a.CheckInvariants())
	})
}
