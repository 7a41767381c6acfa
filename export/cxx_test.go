package main

import (
	"testing"

	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The figures the C++ class copies into c10's DeviceStats are torch's keys,
// in DeviceStats's declaration order.
func TestTorchStatsFollowDeviceStatsOrder(t *testing.T) {
	l := simLibrary(t, "2")
	p := l.malloc(3_000_000, 1, 0)
	require.NotZero(t, p)
	st, err := l.stats(1)
	require.NoError(t, err)
	got := make([]int64, torchStatFigures)
	torchStats(&st, got)

	m := stats(t, l, 1)
	var want []int64
	for _, name := range []string{"allocation", "segment", "active", "inactive_split", "allocated_bytes",
		"reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"} {
		for _, pool := range []string{"all", "small_pool", "large_pool"} {
			for _, fig := range []string{"current", "peak", "allocated", "freed"} {
				want = append(want, m[name+"."+pool+"."+fig])
			}
		}
	}
	for _, name := range []string{"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"} {
		want = append(want, m[name])
	}
	assert.Equal(t, want, got)
	assert.EqualValues(t, 3_000_320, got[4*4*3]) // allocated_bytes.all.current

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
