package caching

import (
	"bytes"
	"errors"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ipcAllocator is an allocator over a simulated VMM device with 2 MiB
// handles, which shares its memory as descriptors of this process.
func ipcAllocator(t *testing.T, ordinal int) (*Allocator, *arena.SimVMM) {
	dev, err := arena.NewSimVMMWith(ordinal, 1<<30, arena.VMMLayout{Handle: 2 * mib})
	require.NoError(t, err)
	a, err := New(dev, DefaultConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a, dev
}

// A shared block freed while a share is held is not cached, so not handed
// out again, and the receiver still reads its cookie; after the last
// release the free is made, and the block is reused. Without the hold the
// same-size request right after the free would get the shared block back
// (the cache's hit) and overwrite what the receiver reads.
func TestIPCSharedBlockNotReusedUntilReleased(t *testing.T) {
	for _, n := range []uint64{8 * mib, 4096} { // a large block, a small slot
		a, dev := ipcAllocator(t, 0)
		p, err := a.Malloc(n, 1)
		require.NoError(t, err)
		want := writeCookie(t, dev, p, n)
		x1, err := a.ExportIPC(p)
		require.NoError(t, err)
		x2, err := a.ExportIPC(p) // a second receiver
		require.NoError(t, err)
		assert.Equal(t, x1, x2)
		assert.Equal(t, 2, a.SharedIPC(p))
		q, base, err := a.ImportIPC(x1)
		require.NoError(t, err)

		require.NoError(t, a.Free(p, n, 1))
		r, err := a.Malloc(n, 1)
		require.NoError(t, err)
		assert.NotEqual(t, p, r, "a shared block is not reused before its release (n=%d)", n)
		require.NoError(t, dev.Phys().Write(r, bytes.Repeat([]byte{0xab}, int(n))))
		got, err := dev.Phys().Read(q, n)
		require.NoError(t, err)
		assert.Equal(t, want, got, "the receiver's view is intact")
		assert.Error(t, a.Free(p, n, 1), "a second free of a shared block is a double free")

		require.NoError(t, a.ReleaseIPC(p))
		assert.Equal(t, 1, a.SharedIPC(p))
		require.NoError(t, a.ReleaseIPC(p))
		assert.Zero(t, a.SharedIPC(p))
		s, err := a.Malloc(n, 1)
		require.NoError(t, err)
		assert.Equal(t, p, s, "released, the block is cached and reused")
		require.NoError(t, a.CloseIPC(base))
		require.NoError(t, a.CheckInvariants())
	}
}

// A block released before it is freed is freed as usual; bad input is
// refused.
func TestIPCReleaseBeforeFreeAndBadInput(t *testing.T) {
	a, _ := ipcAllocator(t, 0)
	p, err := a.Malloc(8*mib, 1)
	require.NoError(t, err)
	_, err = a.ExportIPC(p)
	require.NoError(t, err)
	require.NoError(t, a.ReleaseIPC(p))
	require.NoError(t, a.Free(p, 8*mib, 1))
	q, err := a.Malloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, q)

	var in *InputError
	_, err = a.ExportIPC(q + 512)
	assert.True(t, errors.As(err, &in), "not a block's start: %v", err)
	assert.True(t, errors.As(a.ReleaseIPC(q), &in), "no share held")

	b, _ := ipcAllocator(t, 1)
	x, err := a.ExportIPC(q)
	require.NoError(t, err)
	_, _, err = b.ImportIPC(x)
	assert.ErrorContains(t, err, "memory of device 0")
}

// backend:async shares nothing: a clear error.
func TestIPCNeedsVMM(t *testing.T) {
	a, err := New(arena.NewSim(0, 1<<30), DefaultConfig())
	require.NoError(t, err)
	defer a.Close()
	p, err := a.Malloc(8*mib, 1)
	require.NoError(t, err)
	_, err = a.ExportIPC(p)
	assert.ErrorIs(t, err, arena.ErrNoIPC)
	_, _, err = a.ImportIPC(arena.IPCExport{})
	assert.ErrorIs(t, err, arena.ErrNoIPC)
}
