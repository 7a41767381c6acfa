package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// blocksOn2MiB is a simulated device of 2 MiB handles with blocks of
// sizes placed on stream 1, in order, and their addresses.
func blocksOn2MiB(t *testing.T, sizes ...uint64) (*SimVMM, []uintptr) {
	t.Helper()
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule})
	require.NoError(t, err)
	ptrs := make([]uintptr, len(sizes))
	for i, n := range sizes {
		ptrs[i], err = d.Alloc(n, 1)
		require.NoError(t, err)
	}
	return d, ptrs
}

// What the device holds splits into live spans, free spans' shared and
// whole granules, and pending spans, which add up to held: blocks of 3, 3
// and 1 MiB on 2 MiB handles, then the middle one freed on its stream and
// the last one on another.
func TestHeldSplitAddsUpToHeld(t *testing.T) {
	d, p := blocksOn2MiB(t, 3*mib, 3*mib, 1*mib)
	a, b, c := p[0], p[1], p[2]
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

// The split at the peak is the device's own, taken when held last rose:
// after the frees that follow, it still shows what held the memory then,
// and a reset of the peaks starts it again from the current split.
func TestHeldSplitAtPeak(t *testing.T) {
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule})
	require.NoError(t, err)
	a, err := d.Alloc(3*mib, 1)
	require.NoError(t, err)
	b, err := d.Alloc(3*mib, 1)
	require.NoError(t, err)
	peak := HeldSplit{Held: 6 * mib, Live: 6 * mib}
	assert.Equal(t, peak, d.HeldSplitAtPeak())
	require.NoError(t, d.Free(b, 3*mib, 1))
	c, err := d.Alloc(1*mib, 1) // in b's free span: held does not rise
	require.NoError(t, err)
	assert.Equal(t, peak, d.HeldSplitAtPeak(), "held did not rise: the split at the peak stays")
	assert.Equal(t, HeldSplit{Held: 6 * mib, Live: 4 * mib, FreeWhole: 2 * mib, FreeSpans: 1}, d.HeldSplit())

	require.NoError(t, d.ResetPoolHigh())
	assert.Equal(t, d.HeldSplit(), d.HeldSplitAtPeak(), "a reset takes the split of now")
	_, err = d.Alloc(4*mib, 1) // the free granule [4, 6) MiB, then one more
	require.NoError(t, err)
	got := d.HeldSplitAtPeak()
	assert.Equal(t, uint64(8*mib), got.Held)
	assert.Equal(t, got.Held, got.Parts())
	assert.Equal(t, uint64(8*mib), got.Live+got.FreeShared)
	_, _ = a, c
}

// The free ends a small live span pins are counted apart: after a 3 MiB
// block and a 256 KiB one on 2 MiB handles, the free end of the second
// granule lies beside the small one; once the large block is freed, its
// free span's tail shares that granule with the small one too.
func TestHeldSplitFreeBesideSmall(t *testing.T) {
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule})
	require.NoError(t, err)
	a, err := d.Alloc(3*mib, 1)
	require.NoError(t, err)
	got := d.HeldSplit()
	assert.Equal(t, uint64(mib), got.FreeShared)
	assert.Zero(t, got.FreeBesideSmall, "the free end lies beside the 3 MiB block")

	s, err := d.Alloc(256<<10, 1)
	require.NoError(t, err)
	require.Equal(t, a+3*mib, s)
	got = d.HeldSplit()
	assert.Equal(t, uint64(768<<10), got.FreeShared)
	assert.Equal(t, uint64(768<<10), got.FreeBesideSmall, "the rest of the granule, after the small block")

	require.NoError(t, d.Free(a, 3*mib, 1))
	got = d.HeldSplit()
	assert.Equal(t, uint64(768<<10+mib), got.FreeShared, "the freed block's tail [2, 3) MiB and the end after the small one")
	assert.Equal(t, got.FreeShared, got.FreeBesideSmall, "both share a granule with the small block")
	assert.Equal(t, got.Held, got.Parts())
}

// FreeEndsBeside groups the free ends by the size of the live span they
// lie beside: on 2 MiB handles, after blocks of 3, 3 and 3 MiB, the middle
// one freed and 512 KiB placed in the last granule's free end, a 3 MiB
// block has 1 MiB beside it (the freed block's head, in the first block's
// granule) and the small block the rest of the last granule.
func TestFreeEndsBeside(t *testing.T) {
	d, p := blocksOn2MiB(t, 3*mib, 3*mib, 3*mib)
	a, b := p[0], p[1]
	require.Equal(t, []uintptr{a + 3*mib, a + 6*mib}, p[1:])
	assert.Equal(t, []FreeEnds{{LiveSize: 3 * mib, LiveSpans: 1, Bytes: mib}}, d.FreeEndsBeside(), "the end after the third block")

	require.NoError(t, d.Free(b, 3*mib, 1))
	assert.Equal(t, []FreeEnds{{LiveSize: 3 * mib, LiveSpans: 2, Bytes: 2 * mib}}, d.FreeEndsBeside(),
		"the freed block's head beside the first, the end beside the third")

	s, err := d.Alloc(512<<10, 1)
	require.NoError(t, err)
	require.Equal(t, a+9*mib, s, "the smallest free span that holds it")
	got := d.FreeEndsBeside()
	assert.Equal(t, []FreeEnds{{LiveSize: 3 * mib, LiveSpans: 1, Bytes: mib}, {LiveSize: 512 << 10, LiveSpans: 1, Bytes: 512 << 10}}, got)
	assert.Equal(t, d.HeldSplit().FreeShared, got[0].Bytes+got[1].Bytes, "every shared end lies beside a live span")

	// A live span between two free ones counts once, with both ends: 2 MiB
	// at [3, 5) MiB after its neighbours of 3 MiB are freed.
	d, p = blocksOn2MiB(t, 3*mib, 2*mib, 3*mib)
	require.NoError(t, d.Free(p[0], 3*mib, 1))
	require.NoError(t, d.Free(p[2], 3*mib, 1))
	assert.Equal(t, []FreeEnds{{LiveSize: 2 * mib, LiveSpans: 1, Bytes: 2 * mib}}, d.FreeEndsBeside())
}
