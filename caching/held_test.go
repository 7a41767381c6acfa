package caching

import (
	"errors"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// On the stream-ordered pool (backend:async) memory_reserved() and
// max_memory_reserved() are what the pool holds (its 32 MiB chunks, and the
// memory goalloc freed to it), published lock-free and in memory_stats
// alike; the small and large parts and goalloc.own_reserved_bytes stay
// goalloc's own; reset_peak_memory_stats resets the pool's high-water mark.
func TestReservedIsWhatThePoolHolds(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 0 // a freed block goes back to the pool at once
	a, sim := newTestAllocator(t, cfg)
	check := func(what string) {
		t.Helper()
		u, err := sim.PoolUsage()
		require.NoError(t, err)
		st := a.Stats()
		m := st.Map()
		assert.Equal(t, int64(u.ReservedCurrent), m["reserved_bytes.all.current"], what)
		assert.Equal(t, int64(u.ReservedHigh), m["reserved_bytes.all.peak"], what)
		assert.Equal(t, int64(u.ReservedCurrent), a.Scalar(ScalarReservedBytes), "%s: published", what)
		assert.Equal(t, int64(u.ReservedHigh), a.Scalar(ScalarReservedBytesPeak), "%s: published", what)
		assert.Equal(t, m["reserved_bytes.small_pool.current"]+m["reserved_bytes.large_pool.current"],
			m["goalloc.own_reserved_bytes.current"], "%s: goalloc's own", what)
		requirePublishedEqualsStats(t, a, what)
		require.NoError(t, a.CheckInvariants(), what)
	}
	check("fresh")
	p, err := a.Malloc(5<<19, 0)
	require.NoError(t, err)
	q, err := a.Malloc(1000, 0)
	require.NoError(t, err)
	check("two allocations")
	st := a.Stats()
	m := st.Map()
	assert.EqualValues(t, 32<<20, m["reserved_bytes.all.current"], "one 32 MiB chunk holds both")
	assert.Less(t, m["goalloc.own_reserved_bytes.current"], m["reserved_bytes.all.current"])
	r, err := a.Malloc(40<<20, 0)
	require.NoError(t, err)
	check("a block past the first chunk")
	require.NoError(t, a.Free(r, 40<<20, 0))
	check("a block given back (the pool keeps it)")
	assert.EqualValues(t, 64<<20, a.Scalar(ScalarReservedBytes), "the pool keeps what goalloc gave back")
	require.NoError(t, a.ResetPeakStats())
	check("peaks reset")
	require.NoError(t, a.EmptyCache())
	check("empty_cache")
	assert.EqualValues(t, 32<<20, a.Scalar(ScalarReservedBytes), "trimmed to the chunk in use")
	assert.EqualValues(t, 64<<20, a.Scalar(ScalarReservedBytesPeak))
	require.NoError(t, a.ResetPeakStats())
	check("peaks reset again")
	assert.EqualValues(t, 32<<20, a.Scalar(ScalarReservedBytesPeak), "the pool's high-water mark restarts at what it holds")
	require.NoError(t, a.Free(p, 5<<19, 0))
	require.NoError(t, a.Free(q, 1000, 0))
	require.NoError(t, a.EmptyCache())
	check("everything freed")
	assert.Zero(t, a.Scalar(ScalarReservedBytes))
}

// With a release threshold below the maximum the pool gives memory back on
// its own at a synchronisation goalloc does not see (torch.cuda.synchronize,
// here the simulated device's); memory_reserved() and memory_stats() still
// say what it holds.
func TestReservedFollowsThePoolsOwnRelease(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 0
	cfg.ReleaseThreshold = 0
	a, sim := newTestAllocator(t, cfg)
	p, err := a.Malloc(100<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 100<<20, 0))
	assert.EqualValues(t, 128<<20, a.Scalar(ScalarReservedBytes), "the pool keeps the freed block")
	require.NoError(t, sim.Synchronize()) // the user's synchronisation
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	require.Zero(t, u.ReservedCurrent, "the pool released it at the synchronisation")
	assert.Zero(t, a.Scalar(ScalarReservedBytes))
	out := make([]int64, NumScalars)
	a.Scalars(out)
	assert.Zero(t, out[ScalarReservedBytes])
	assert.Zero(t, a.Stats().ReservedBytes[StatAll].Current)
	requirePublishedEqualsStats(t, a, "after the pool's own release")
}

// The cap bounds what the pool holds, not only goalloc's own count: 1 MiB
// blocks packed by the pool fill 32 MiB chunks, so under a 100 MiB cap 96
// of them fit (three chunks), not the 100 goalloc's count would allow; the
// refusal is an OOMError; and the pool's high-water mark never passes the
// cap, in the pool's own figure or the one reported.
func TestCapBoundsWhatThePoolHolds(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 0
	a, sim := newTestAllocator(t, cfg)
	const limit = 100 << 20
	require.NoError(t, a.SetLimit(limit))
	n := 0
	var err error
	for ; n < 100; n++ {
		if _, err = a.Malloc(1<<20, 0); err != nil {
			break
		}
	}
	var oom *OOMError
	require.ErrorAs(t, err, &oom)
	require.True(t, errors.Is(err, arena.ErrOutOfMemory))
	assert.ErrorIs(t, oom.Cause, arena.ErrCapReached)
	assert.Equal(t, 96, n)
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.LessOrEqual(t, u.ReservedCurrent, uint64(limit))
	assert.LessOrEqual(t, a.Scalar(ScalarReservedBytesPeak), int64(limit))
	require.NoError(t, a.CheckInvariants())
}

// A request the pool can place under the cap once frees still pending on
// another stream have completed is not refused: the cap gives back the
// allocation that took the pool over, lets the frees complete and trims,
// and the retry fits. The pool never holds more than the cap after a call.
func TestCapRetriesWhatFitsAfterATrim(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 0
	a, sim := newTestAllocator(t, cfg)
	sim.SetManual(true)
	const limit = 64 << 20
	require.NoError(t, a.SetLimit(limit))
	const s1, s2 = arena.Stream(0x100), arena.Stream(0x200)
	p, err := a.Malloc(60<<20, s1)
	require.NoError(t, err)
	sim.Launch(s1) // work on s1 still running when p is freed
	require.NoError(t, a.Free(p, 60<<20, s1))
	// The pool may not give s2 the range freed on s1 until that free has
	// completed: placed past it, the block would need two more chunks.
	q, err := a.Malloc(40<<20, s2)
	require.NoError(t, err, "it fits once the free on s1 has completed")
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.LessOrEqual(t, u.ReservedCurrent, uint64(limit))
	assert.LessOrEqual(t, a.Scalar(ScalarReservedBytesPeak), int64(limit),
		"the refused placement's moment over the cap is not a peak")
	require.NoError(t, a.Free(q, 40<<20, s2))
	require.NoError(t, a.CheckInvariants())
}

// The property test's random operations (model_test.go: four streams that
// complete when the model says, record_stream, empty_cache, caps moved at
// random) on the stream-ordered pool: under a cap, what the pool holds never
// grows above it.
func TestPropertyPoolHeldUnderTheCap(t *testing.T) {
	modelSeeds(t, 1, 4, 3000, func(t *testing.T, seed uint64, cfg Config, steps int) {
		m := newModel(t, seed, cfg, 8<<30)
		var prev uint64
		for i := 0; i < steps; i++ {
			m.step()
			m.check()
			u := requireNoGrowthAboveTheCap(t, m, m.sim, &prev)
			require.Equal(t, int64(u.ReservedCurrent), m.a.Scalar(ScalarReservedBytes), "op %d", m.ops)
		}
		m.drain()
	})
}

// A reserve just under the cap would leave the pool holding a chunk past
// it (40 MiB pre-warmed: two 32 MiB chunks under a 40 MiB cap): the cap
// wins, and the pool starts empty, its high-water mark too.
func TestReserveNeverLeavesThePoolAboveTheCap(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Fraction = float64(40<<20) / float64(16<<30)
	cfg.Reserve = cfg.Fraction
	a, sim := newTestAllocator(t, cfg)
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.LessOrEqual(t, u.ReservedCurrent, a.Limit())
	assert.LessOrEqual(t, a.Scalar(ScalarReservedBytes), int64(a.Limit()))
	assert.LessOrEqual(t, a.Scalar(ScalarReservedBytesPeak), int64(a.Limit()))
	p, err := a.Malloc(20<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 20<<20, 0))
	require.NoError(t, a.EmptyCache())
}
