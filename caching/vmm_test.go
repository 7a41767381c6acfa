package caching

import (
	"errors"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseConfigBackend(t *testing.T) {
	c, err := ParseConfig("")
	require.NoError(t, err)
	assert.Equal(t, "vmm", c.Backend, "the VMM backend is the default")
	c, err = ParseConfig("fraction:0.5,backend:async")
	require.NoError(t, err)
	assert.Equal(t, "async", c.Backend)
	again, err := ParseConfig(c.String())
	require.NoError(t, err)
	assert.Equal(t, c, again)
	_, err = ParseConfig("backend:cudaMalloc")
	require.ErrorContains(t, err, "backend")
}

// The allocator passes its cap to a VMM device, so the cap bounds physical
// memory: a block of 2.5 MiB alone on its stream holds 4 MiB there (two
// 2 MiB granules of the stream's segment), so a 20 MiB cap fits 5 of them
// on 8 streams, not the 8 goalloc's own count would allow.
func TestVMMCapBoundsPhysicalMemory(t *testing.T) {
	dev, err := arena.NewSimVMMWith(0, 1<<30, arena.VMMLayout{Handle: 2 << 20})
	require.NoError(t, err)
	cfg := DefaultConfig()
	cfg.LargeCache = 0
	a, err := New(dev, cfg)
	require.NoError(t, err)
	require.NoError(t, a.SetLimit(20<<20))
	n := 0
	for ; n < 8; n++ {
		if _, err := a.Malloc(5<<19, arena.Stream(n+1)); err != nil {
			require.True(t, errors.Is(err, arena.ErrOutOfMemory), "%v", err)
			break
		}
	}
	assert.Equal(t, 5, n)
	u, err := dev.PoolUsage()
	require.NoError(t, err)
	assert.LessOrEqual(t, u.ReservedCurrent, uint64(20<<20))
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, dev.CheckInvariants())
}

// The model's random operations (model_test.go) on the VMM backend: the
// caching layer's invariants and stream order hold on it too, the device's
// own invariants hold after every step, and empty_cache gives every byte
// of physical memory back.
func TestPropertyRandomOpsVMM(t *testing.T) {
	modelSeeds(t, 1, 4, 3000, func(t *testing.T, seed uint64, cfg Config, steps int) {
		dev, err := arena.NewSimVMM(0, 8<<30)
		require.NoError(t, err)
		m := newModel(t, seed, cfg, 8<<30)
		dev.SetManual(true)
		m.sim = dev.Sim
		m.a, err = New(dev, cfg)
		require.NoError(t, err)
		var prev uint64
		for i := 0; i < steps; i++ {
			m.step()
			m.check()
			require.NoError(t, dev.CheckInvariants(), "op %d", m.ops)
			requireNoGrowthAboveTheCap(t, m, dev, &prev)
		}
		m.drain()
		u, err := dev.PoolUsage()
		require.NoError(t, err)
		assert.Zero(t, u.ReservedCurrent, "physical memory held after empty_cache")
		assert.Zero(t, dev.Phys().Used())
	})
}

// On the VMM backend memory_reserved() and max_memory_reserved() are the
// physical memory the device holds (granule rounding and the free memory a
// segment keeps mapped included), published lock-free and in memory_stats
// alike; the small and large parts stay goalloc's own. (The stream-ordered
// pool: TestReservedIsWhatThePoolHolds.)
func TestReservedIsWhatAVMMDeviceHolds(t *testing.T) {
	dev, err := arena.NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	cfg := DefaultConfig()
	cfg.LargeCache = 0 // a freed block goes back to the device at once
	a, err := New(dev, cfg)
	require.NoError(t, err)
	held := func() (uint64, uint64) {
		u, err := dev.PoolUsage()
		require.NoError(t, err)
		return u.ReservedCurrent, u.ReservedHigh
	}
	check := func(what string) {
		t.Helper()
		cur, high := held()
		st := a.Stats()
		m := st.Map()
		assert.Equal(t, int64(cur), m["reserved_bytes.all.current"], what)
		assert.Equal(t, int64(high), m["reserved_bytes.all.peak"], what)
		assert.Equal(t, int64(cur), a.Scalar(ScalarReservedBytes), "%s: published", what)
		assert.Equal(t, int64(high), a.Scalar(ScalarReservedBytesPeak), "%s: published", what)
		requirePublishedEqualsStats(t, a, what)
		require.NoError(t, a.CheckInvariants(), what)
	}
	check("fresh")
	p, err := a.Malloc(5<<19, 0) // 2.5 MiB: two 2 MiB granules
	require.NoError(t, err)
	q, err := a.Malloc(1000, 0) // a small segment in a 2 MiB page
	require.NoError(t, err)
	check("two allocations")
	st := a.Stats()
	m := st.Map()
	own := m["reserved_bytes.small_pool.current"] + m["reserved_bytes.large_pool.current"]
	assert.Greater(t, m["reserved_bytes.all.current"], own, "the device holds more than goalloc's segments")
	assert.Equal(t, own, m["goalloc.own_reserved_bytes.current"])
	require.NoError(t, a.Free(p, 5<<19, 0))
	check("a block given back (the segment keeps it mapped)")
	require.NoError(t, a.EmptyCache())
	check("empty_cache")
	require.NoError(t, a.ResetPeakStats())
	check("peaks reset")
	cur, high := held()
	assert.Equal(t, cur, high, "the high-water mark restarts at what is held")
	require.NoError(t, a.SetLimit(8<<20))
	check("a cap")
	require.NoError(t, a.Free(q, 1000, 0))
	require.NoError(t, a.EmptyCache())
	check("everything freed")
}

// requireNoGrowthAboveTheCap checks, after a step of m, that what dev holds
// did not grow while above m's cap (a lowered cap leaves it above until
// frees come back; it may never grow there), and returns the figures; prev
// is what dev held after the step before.
func requireNoGrowthAboveTheCap(t *testing.T, m *model, dev interface {
	PoolUsage() (arena.PoolUsage, error)
}, prev *uint64) arena.PoolUsage {
	t.Helper()
	u, err := dev.PoolUsage()
	require.NoError(t, err)
	if lim := m.a.Limit(); lim > 0 && u.ReservedCurrent > lim {
		require.LessOrEqual(t, u.ReservedCurrent, *prev, "op %d: what the device holds grew above the cap", m.ops)
	}
	*prev = u.ReservedCurrent
	return u
}

// Under the VMM backend memory_stats() carries the device's profile of its
// driver calls (goalloc.driver.<function>.count and .ns): a miss that maps
// memory shows there, a cache hit adds nothing.
func TestStatsCarryTheVMMDriverProfile(t *testing.T) {
	dev, err := arena.NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	a, err := New(dev, DefaultConfig())
	require.NoError(t, err)
	p, err := a.Malloc(4<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 4<<20, 0))
	st := a.Stats()
	m := st.Map()
	require.Equal(t, int64(dev.Calls()["cuMemCreate"]), m["goalloc.driver.cuMemCreate.count"])
	require.Positive(t, m["goalloc.driver.cuMemMap.count"])
	p, err = a.Malloc(4<<20, 0) // a hit in the large cache
	require.NoError(t, err)
	st = a.Stats()
	again := st.Map()
	for k, v := range again {
		if strings.HasPrefix(k, "goalloc.driver.") && strings.HasSuffix(k, ".count") {
			require.Equal(t, m[k], v, k)
		}
	}
	require.NoError(t, a.Free(p, 4<<20, 0))
	require.NoError(t, a.Close())
}

// Fragmentation carries the VMM device's split of what it holds: goalloc's
// blocks (a live one and a cached one) are its live spans, and the parts
// add up to the pool's reserved bytes; the stream-ordered pool has none.
func TestFragmentationCarriesTheHeldSplit(t *testing.T) {
	dev, err := arena.NewSimVMMWith(0, 1<<30, arena.VMMLayout{Handle: 2 << 20})
	require.NoError(t, err)
	a, err := New(dev, DefaultConfig())
	require.NoError(t, err)
	p, err := a.Malloc(3<<20, 1)
	require.NoError(t, err)
	q, err := a.Malloc(5<<20, 1)
	require.NoError(t, err)
	require.NoError(t, a.Free(q, 5<<20, 1))
	f := a.Fragmentation()
	require.NotNil(t, f.Held)
	assert.Equal(t, f.PoolReserved, f.Held.Held)
	assert.Equal(t, f.Held.Held, f.Held.Parts())
	assert.Equal(t, uint64(8<<20), f.Held.Live, "the live block and the cached one")
	require.NotNil(t, f.HeldAtPeak)
	assert.Equal(t, f.PoolReservedHigh, f.HeldAtPeak.Held, "the split when held peaked")
	assert.Equal(t, f.HeldAtPeak.Held, f.HeldAtPeak.Parts())
	require.NoError(t, a.Free(p, 3<<20, 1))

	async, _ := newTestAllocator(t, DefaultConfig())
	assert.Nil(t, async.Fragmentation().Held)
	assert.Nil(t, async.Fragmentation().HeldAtPeak)
}
