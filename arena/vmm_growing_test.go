package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The shape of a KV cache as transformers' generate grows it: 24 layers'
// keys and values, each a token longer at every step (torch.cat: the
// longer tensor allocated, then the shorter one freed), on one stream.
const (
	kvTensors  = 48
	kvStart    = 40*mib + 3<<10
	kvPerToken = 43 << 10 // batch 42 x 4 heads x 128 x bf16
	kvTokens   = 160
)

// growKVCache grows the tensors at ptrs (each size bytes) on stream 1 of d
// for kvTokens tokens. Before every smallEvery-th request of the first 20
// tokens' worth (never, for 0) a 448 KiB block arrives that stays, as a
// cache's small segment does. It returns the tensors' last size.
func growKVCache(t *testing.T, d *SimVMM, ptrs []uintptr, size uint64, smallEvery int) uint64 {
	n := 0
	for tok := 0; tok < kvTokens; tok++ {
		for i := range ptrs {
			if n++; smallEvery > 0 && n%smallEvery == 0 && n < 20*len(ptrs) {
				_, err := d.Alloc(448<<10, 1)
				require.NoError(t, err)
			}
			p, err := d.Alloc(size+kvPerToken, 1)
			require.NoError(t, err)
			require.NoError(t, d.Free(ptrs[i], size, 1))
			ptrs[i] = p
		}
		size += kvPerToken
	}
	return size
}

// A KV cache grown after a prefill whose temporaries sat between its
// tensors: each new tensor goes where a shorter one was freed or extends
// the free end beside it, so growth leaves no free end per tensor, only a
// few handles' worth in all, whatever the handle size. (Requests of a
// granule or more start on a granule boundary where that saves one, so a
// few heads under a granule stay free beside them too.)
func TestVMMGrowingTensorsPackTightly(t *testing.T) {
	const prefillTemp = 300*mib + 5<<10
	for _, handle := range []uint64{16 * mib, 4 * mib} {
		d, err := NewSimVMMWith(0, 8<<30, VMMLayout{Handle: handle})
		require.NoError(t, err)
		ptrs := make([]uintptr, kvTensors)
		for i := 0; i < kvTensors; i += 2 {
			tmp, err := d.Alloc(prefillTemp, 1)
			require.NoError(t, err)
			ptrs[i], err = d.Alloc(kvStart, 1)
			require.NoError(t, err)
			ptrs[i+1], err = d.Alloc(kvStart, 1)
			require.NoError(t, err)
			require.NoError(t, d.Free(tmp, prefillTemp, 1))
		}
		size := growKVCache(t, d, ptrs, kvStart, 0)
		at := d.HeldSplitAtPeak()
		require.Equal(t, at.Held, at.Parts())
		t.Logf("%d MiB handles: %d MiB live at the peak, %d MiB beyond in %d free spans",
			handle/mib, at.Live/mib, (at.Held-at.Live)/mib, at.FreeSpans)
		assert.LessOrEqual(t, at.Held-at.Live, 5*handle, "%d MiB handles: a few handles' free ends in all", handle/mib)
		assert.LessOrEqual(t, at.Live, uint64(kvTensors+1)*size+prefillTemp, "the peak's live spans")
		require.NoError(t, d.CheckInvariants())
	}
}
