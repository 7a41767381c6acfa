package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Together, a small request takes the free end of a large span's last
// granule (step 1's smallest fit); with SmallApart it goes to a segment of
// its own and shares no granule with the large span.
func TestVMMSmallApartKeepsSmallRequestsOffLargeGranules(t *testing.T) {
	for _, apart := range []uint64{0, mib} {
		d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule, SmallApart: apart})
		require.NoError(t, err)
		large, err := d.Alloc(3*mib, 1)
		require.NoError(t, err)
		small, err := d.Alloc(256<<10, 1)
		require.NoError(t, err)
		if apart == 0 {
			assert.Equal(t, large+3*mib, small, "together: the free end of the large span's granule")
		} else {
			inLarge := small >= large && small < large+4*mib
			assert.False(t, inLarge, "apart: %#x lies in the large span's granules from %#x", small, large)
			assert.Equal(t, uint64(3*simVMMGranule), d.Phys().Used(), "the large span's two granules, and one of the small share's")
		}
		require.NoError(t, d.CheckInvariants())
	}
}

// The two shares of a stream pay each other: small frees whose last use
// still runs lend their granules to a large request of the same stream,
// which creates nothing and waits for nothing (the stream orders both).
func TestVMMSmallApartSharesPayEachOther(t *testing.T) {
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: simVMMGranule, SmallApart: mib})
	require.NoError(t, err)
	d.SetManual(true)
	var small []uintptr
	for i := 0; i < 16; i++ { // four granules of 512 KiB requests
		p, err := d.Alloc(512<<10, 1)
		require.NoError(t, err)
		small = append(small, p)
	}
	created := d.Phys().Calls["cuMemCreate"]
	d.Launch(1) // the frees' last use is still queued
	for _, p := range small {
		require.NoError(t, d.Free(p, 512<<10, 1))
	}
	_, err = d.Alloc(6*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, created, d.Phys().Calls["cuMemCreate"], "the small share's granules paid")
	for _, c := range d.DriverCalls() {
		assert.NotEqual(t, "cuStreamWaitEvent", c.Name, "its own stream: no wait")
	}
	assert.Equal(t, uint64(4*simVMMGranule), d.Phys().Used())
	require.NoError(t, d.CheckInvariants())
}

// A KV cache grown a token at a time (growKVCache) while small blocks that
// stay arrive between its tensors' growth: placed together, each small one
// pins the free end beside a tensor, and the memory beyond the live spans
// at the peak grows with them; kept apart, it stays a few handles.
func TestVMMSmallApartUnpinsGrowingTensors(t *testing.T) {
	beyond := map[uint64]uint64{}
	for _, apart := range []uint64{0, mib} {
		d, err := NewSimVMMWith(0, 8<<30, VMMLayout{Handle: 16 * mib, SmallApart: apart})
		require.NoError(t, err)
		ptrs := make([]uintptr, kvTensors)
		for i := range ptrs {
			ptrs[i], err = d.Alloc(kvStart, 1)
			require.NoError(t, err)
		}
		growKVCache(t, d, ptrs, kvStart, 7)
		at := d.HeldSplitAtPeak()
		beyond[apart] = at.Held - at.Live
		t.Logf("small apart below %d bytes: %d MiB beyond the live spans at the peak, %d free spans",
			apart, beyond[apart]/mib, at.FreeSpans)
		require.NoError(t, d.CheckInvariants())
	}
	assert.Less(t, beyond[mib]*3, beyond[0], "apart holds a third or less of what together holds beyond live")
	assert.LessOrEqual(t, beyond[mib], uint64(8*16*mib), "apart: a few handles")
}
