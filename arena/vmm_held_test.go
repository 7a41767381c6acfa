package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What the device holds splits into live spans, free spans' shared and
// whole granules, and pending spans, which add up to held: blocks of 3, 3
// and 1 MiB on 2 MiB handles, then the middle one freed on its stream and
// the last one on another.
func TestHeldSplitAddsUpToHeld(t *testing.T) {
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule})
	require.NoError(t, err)
	a, err := d.Alloc(3*mib, 1)
	require.NoError(t, err)
	b, err := d.Alloc(3*mib, 1)
	require.NoError(t, err)
	c, err := d.Alloc(1*mib, 1)
	require.NoError(t, err)
	require.Equal(t, uint64(3*mib), uint64(b-a))
	assert.Equal(t, HeldSplit{Held: 8 * mib, Live: 7 * mib, FreeShared: 1 * mib, FreeSpans: 1}, d.HeldSplit(),
		"7 MiB live on four handles: the last one's free end")

	require.NoError(t, d.Free(b, 3*mib, 1))
	assert.Equal(t, HeldSplit{Held: 8 * mib, Live: 4 * mib, FreeShared: 2 * mib, FreeWhole: 2 * mib, FreeSpans: 2}, d.HeldSplit(),
		"b's granule [4, 6) MiB is its alone; [3, 4) shares a's granule")

	require.NoError(t, d.Free(c, 1*mib, 2))
	got := d.HeldSplit()
	assert.Equal(t, HeldSplit{Held: 8 * mib, Live: 3 * mib, FreeShared: 2 * mib, FreeWhole: 2 * mib, FreeSpans: 2, Pending: 1 * mib}, got,
		"c, freed on another stream, waits for its event")
	assert.Equal(t, got.Held, got.Parts())
}
