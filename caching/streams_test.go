package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// streamRecords is how many per-stream records (StreamFreeLists) the
// allocator keeps, in every cache pool.
func streamRecords(a *Allocator) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.allLists())
}

// Short-lived streams (one per request in some servers) leave nothing
// behind that grows with their number: the memory kept for them is bounded
// by the cache budgets, and so are the per-stream records, and with them
// the cost of the operations that look at every stream.
func TestManyShortLivedStreamsStayBounded(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	const streams = 20000
	most := 0
	for i := 0; i < streams; i++ {
		s := arena.Stream(0x1000 + i)
		small, err := a.Malloc(1000, s)
		require.NoError(t, err)
		large, err := a.Malloc(1<<20, s)
		require.NoError(t, err)
		require.NoError(t, a.Free(small, 1000, s))
		require.NoError(t, a.Free(large, 1<<20, s))
		most = max(most, streamRecords(a))
	}
	require.NoError(t, a.CheckInvariants())
	st := a.Stats()
	assert.Zero(t, st.AllocatedBytes[StatAll].Current)
	budget := int64(a.cfg.LargeCache + emptySegmentBudget)
	assert.LessOrEqual(t, st.ReservedBytes[StatAll].Peak, budget+int64(classSegment[1])+1<<20,
		"reserved stays within the cache budgets, whatever the number of streams")
	// Each record holds at least one cached block or empty segment.
	bound := int(a.cfg.LargeCache/(1<<20)) + int(emptySegmentBudget/uint64(classSegment[1])) + 1
	assert.LessOrEqual(t, most, bound, "per-stream records are bounded by what is cached, not by the streams seen")
}

// empty_cache forgets every stream that holds nothing live; a stream with a
// live block keeps its record until that block is freed and the cache
// emptied again.
func TestEmptyCacheDropsIdleStreams(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	for i := 0; i < 100; i++ {
		s := arena.Stream(0x1000 + i)
		p, err := a.Malloc(1000, s)
		require.NoError(t, err)
		require.NoError(t, a.Free(p, 1000, s))
	}
	live, err := a.Malloc(1<<20, 0x99)
	require.NoError(t, err)
	require.Greater(t, streamRecords(a), 1)
	require.NoError(t, a.EmptyCache())
	assert.Equal(t, 1, streamRecords(a), "only the stream with a live block is kept")
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, a.Free(live, 1<<20, 0x99))
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, streamRecords(a))
	assert.Zero(t, a.Stats().ReservedBytes[StatAll].Current)
	// And the allocator works as before on a stream it forgot.
	p, err := a.Malloc(1000, 0x1000)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 1000, 0x1000))
	require.NoError(t, a.CheckInvariants())
}
