package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A KV cache grown a token at a time, as transformers' generate grows it
// (torch.cat: the longer tensor allocated, then the shorter one freed),
// every layer's keys and values on one stream after a prefill whose
// temporaries sat between them: each new tensor goes where a shorter one
// was freed or extends the free end beside it, so growth leaves no free
// end per tensor, only a few handles' worth in all, whatever the handle
// size. (Small allocations that stay can pin the free ends beside these
// tensors, and hold far more; this test makes none.)
func TestVMMGrowingTensorsPackTightly(t *testing.T) {
	const (
		tensors     = 48 // 24 layers, keys and values
		start       = 40*mib + 3<<10
		perToken    = 43 << 10 // batch 42 x 4 heads x 128 x bf16
		tokens      = 160
		prefillTemp = 300*mib + 5<<10
	)
	for _, handle := range []uint64{16 * mib, 4 * mib} {
		d, err := NewSimVMMWith(0, 8<<30, VMMLayout{Handle: handle})
		require.NoError(t, err)
		ptrs := make([]uintptr, tensors)
		size := uint64(start)
		for i := 0; i < tensors; i += 2 {
			tmp, err := d.Alloc(prefillTemp, 1)
			require.NoError(t, err)
			ptrs[i], err = d.Alloc(size, 1)
			require.NoError(t, err)
			ptrs[i+1], err = d.Alloc(size, 1)
			require.NoError(t, err)
			require.NoError(t, d.Free(tmp, prefillTemp, 1))
		}
		for tok := 0; tok < tokens; tok++ {
			for i := range ptrs {
				p, err := d.Alloc(size+perToken, 1)
				require.NoError(t, err)
				require.NoError(t, d.Free(ptrs[i], size, 1))
				ptrs[i] = p
			}
			size += perToken
		}
		at := d.HeldSplitAtPeak()
		require.Equal(t, at.Held, at.Parts())
		t.Logf("%d MiB handles: %d MiB live at the peak, %d MiB beyond in %d free spans",
			handle/mib, at.Live/mib, (at.Held-at.Live)/mib, at.FreeSpans)
		assert.LessOrEqual(t, at.Held-at.Live, 4*handle, "%d MiB handles: a few handles' free ends in all", handle/mib)
		assert.LessOrEqual(t, at.Live, uint64(tensors+1)*size+prefillTemp, "the peak's live spans")
		require.NoError(t, d.CheckInvariants())
	}
}
