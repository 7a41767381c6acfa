package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A pool with an allocator of its own (torch.cuda.MemPool(allocator=...))
// is carved by the C++ class; goalloc counts what it holds in the
// statistics, the device's reserved figure and the history, and holds it
// under the cap, as PyTorch's allocator counts its pools' segments.
func TestExternalPoolsAreCountedAndCapped(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, _ *arena.Sim) {
		const S = arena.Stream(0x5)
		a.RecordHistory(100)
		require.NoError(t, a.SetLimit(100<<20))
		before := a.Stats()
		require.NoError(t, a.ClaimExternal(60<<20))
		const seg, blk = uintptr(0x7f0000000000), uintptr(0x7f0000000000)
		require.NoError(t, a.ExternalSegment(true, seg, 60<<20, true, S))
		require.NoError(t, a.ExternalBlock(true, blk, 40<<20, 40<<20-100, true, S))
		require.NoError(t, a.CheckInvariants())
		st := a.Stats()
		assert.EqualValues(t, 60<<20, st.ReservedBytes[StatLarge].Current-before.ReservedBytes[StatLarge].Current)
		assert.EqualValues(t, 60<<20, st.ReservedBytes[StatAll].Current-before.ReservedBytes[StatAll].Current,
			"memory_reserved() includes it")
		assert.EqualValues(t, 1, st.Segment[StatLarge].Current-before.Segment[StatLarge].Current)
		assert.EqualValues(t, 40<<20, st.AllocatedBytes[StatAll].Current)
		assert.EqualValues(t, 40<<20-100, st.RequestedBytes[StatAll].Current)
		assert.EqualValues(t, 1, st.Active[StatAll].Current)

		// The cap holds across both: 60 MiB of the pool's, 50 more of goalloc's is over 100.
		_, err := a.Malloc(50<<20, S)
		var oom *OOMError
		require.ErrorAs(t, err, &oom)
		require.ErrorAs(t, a.ClaimExternal(50<<20), &oom, "the pool's next segment too")
		require.NoError(t, a.CheckInvariants())

		require.NoError(t, a.ExternalBlock(false, blk, 40<<20, 40<<20-100, true, S))
		require.NoError(t, a.ExternalSegment(false, seg, 60<<20, true, S))
		require.NoError(t, a.CheckInvariants())
		p, err := a.Malloc(50<<20, S)
		require.NoError(t, err, "the segment's claim went back")
		require.NoError(t, a.Free(p, 50<<20, S))

		// A claim whose segment the pool's allocator did not give goes back too.
		require.NoError(t, a.ClaimExternal(90<<20))
		require.NoError(t, a.UnclaimExternal(90<<20))
		require.NoError(t, a.CheckInvariants())

		var acts []string
		for _, e := range a.Snapshot().Trace {
			if e.Addr == uint64(seg) {
				acts = append(acts, e.Action)
			}
		}
		assert.Equal(t, []string{"segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"}, acts)
		st = a.Stats()
		assert.Zero(t, st.AllocatedBytes[StatAll].Current)
		assert.Equal(t, before.ReservedBytes[StatLarge].Current, st.ReservedBytes[StatLarge].Current)
	})
}
