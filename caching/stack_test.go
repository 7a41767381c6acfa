package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A free that waits for another stream records an event there; when the
// record fails, the free waits for a synchronisation instead, and the
// failure is counted in the statistics, not lost.
func TestEventFailuresReachTheStats(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	sim.SetFaults(arena.SimFaults{EventRecord: func(arena.Stream) error { return errInjected }})
	p, err := a.Malloc(4<<20, 0x10)
	require.NoError(t, err)
	require.NoError(t, a.RecordStream(p, 0x20))
	require.NoError(t, a.Free(p, 4<<20, 0x10))
	st := a.Stats()
	assert.EqualValues(t, 1, st.EventErrors)
	assert.EqualValues(t, 1, st.Map()["goalloc.event_errors"])
	assert.EqualValues(t, 1, st.Active[StatAll].Current, "the free waits for a synchronisation")
	a.ResetAccumulatedStats()
	assert.Zero(t, a.Stats().EventErrors, "an accumulated counter")
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, a.Stats().Active[StatAll].Current)
	require.NoError(t, a.CheckInvariants())
}

// The device-call counts come from the stack under the cache: a hit is not
// a device call, the pre-warming pair is not one of the cache's, and the
// counts reset with the other accumulated counters.
func TestDeviceCallsAreCountedUnderTheCache(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Reserve = 0.01
	a, sim := newTestAllocator(t, cfg)
	require.EqualValues(t, 1, sim.Allocs, "the pre-warming allocation")
	p, err := a.Malloc(4<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 4<<20, 0))
	p, err = a.Malloc(4<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 4<<20, 0))
	st := a.Stats()
	assert.EqualValues(t, 1, st.NumDeviceAlloc)
	assert.EqualValues(t, 1, st.CacheHits)
	require.NoError(t, a.EmptyCache())
	st = a.Stats()
	assert.EqualValues(t, 1, st.NumDeviceFree)
	assert.EqualValues(t, st.NumDeviceAlloc, st.Map()["num_device_alloc"])
	a.ResetAccumulatedStats()
	st = a.Stats()
	assert.Zero(t, st.NumDeviceAlloc)
	assert.Zero(t, st.NumDeviceFree)
}
