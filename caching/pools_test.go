package caching

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A torch.cuda.MemPool with use_mem_pool: no capture, the caller names the
// pool; the pool's memory stays its own until its last user releases it.
func TestMallocInNamesThePool(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	const S = arena.Stream(0x10)
	id := PoolID{0, 3}

	_, err := a.MallocIn(id, 1<<20, S)
	require.Error(t, err, "a pool nobody made")
	require.NoError(t, a.IncrefPool(id)) // MemPool()
	assert.Equal(t, 1, a.PoolUseCount(id))
	require.NoError(t, a.BeginAllocateToPool(id)) // use_mem_pool: +1
	assert.Equal(t, 2, a.PoolUseCount(id))

	big, err := a.MallocIn(id, 8<<20, S)
	require.NoError(t, err)
	small, err := a.MallocIn(id, 1000, S)
	require.NoError(t, err)
	eager, err := a.MallocIn(PoolID{}, 8<<20, S)
	require.NoError(t, err)
	require.NoError(t, a.EndAllocateToPool(id))
	require.NoError(t, a.ReleasePool(id)) // leaving use_mem_pool
	assert.Equal(t, 1, a.PoolUseCount(id))

	live := a.PoolLive(id)
	require.Len(t, live, 2)
	got := map[uintptr]uint64{live[0].Addr: live[0].Requested, live[1].Addr: live[1].Requested}
	assert.Equal(t, map[uintptr]uint64{big: 8 << 20, small: 1000}, got)
	assert.Len(t, a.PoolLive(PoolID{}), 1, "the general cache's one live block")

	held, err := a.FreeOwned(big)
	require.NoError(t, err)
	assert.True(t, held)
	held, err = a.FreeOwned(0x1234)
	require.NoError(t, err)
	assert.False(t, held, "not goalloc's pointer: nothing counted")
	again, err := a.MallocIn(PoolID{}, 8<<20, S)
	require.NoError(t, err)
	assert.NotEqual(t, big, again, "the pool's freed block is not the general cache's")
	assert.Equal(t, map[string]int64{"invalid_pool": 1}, a.Stats().BadInput, "only the malloc in a pool nobody made")

	for _, p := range []uintptr{small, eager, again} {
		_, err := a.FreeOwned(p)
		require.NoError(t, err)
	}
	require.NoError(t, a.ReleasePool(id)) // ~MemPool
	assert.Equal(t, 0, a.PoolUseCount(id))
	require.NoError(t, a.CheckInvariants())
	assert.EqualValues(t, 0, a.Stats().GraphPools, "released and empty: forgotten")
}

// torch.compile's CUDA graph trees checkpoint a pool after each recording
// and set it back before recording on another path.
func TestRestorePoolReturnsToACheckpoint(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	const S = arena.Stream(0x10)
	id := PoolID{5, 0}
	require.NoError(t, a.IncrefPool(id))

	x, err := a.MallocIn(id, 4<<20, S)
	require.NoError(t, err)
	y, err := a.MallocIn(id, 300, S)
	require.NoError(t, err)
	tmp, err := a.MallocIn(id, 600, S)
	require.NoError(t, err)
	_, err = a.FreeOwned(tmp)
	require.NoError(t, err)
	checkpoint := a.PoolLive(id)
	require.Len(t, checkpoint, 2)
	before := a.Stats()

	// Later work: x dies, z is born, y's slot is freed and reused.
	_, err = a.FreeOwned(x)
	require.NoError(t, err)
	z, err := a.MallocIn(id, 2<<20, S)
	require.NoError(t, err)
	_, err = a.FreeOwned(y)
	require.NoError(t, err)
	w, err := a.MallocIn(id, 300, S)
	require.NoError(t, err)

	freed, err := a.RestorePool(id, checkpoint)
	require.NoError(t, err)
	assert.ElementsMatch(t, []uintptr{z, w}, freed)
	assert.Equal(t, checkpoint, a.PoolLive(id))
	after := a.Stats()
	assert.Equal(t, before.AllocatedBytes[StatAll].Current, after.AllocatedBytes[StatAll].Current)
	assert.Equal(t, before.RequestedBytes[StatAll].Current, after.RequestedBytes[StatAll].Current)
	require.NoError(t, a.CheckInvariants())

	// A block the pool no longer holds cannot be restored.
	_, err = a.RestorePool(id, []LiveBlock{{Addr: 0x42, Size: 512, Requested: 1}})
	require.Error(t, err)
	_, err = a.RestorePool(PoolID{9, 9}, checkpoint)
	require.Error(t, err)
}
