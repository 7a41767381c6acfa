package replay

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/require"
)

// The bundled training traces replayed through the C++ class's front (Go's
// copy of it, caching.FrontEmulator) and without it, on the simulated VMM
// backend: the requested bytes' figures and the allocation counts, peaks
// included, are the same both ways, every free written to the log is
// applied, and nothing is left. (The allocated bytes may differ: a block
// the front hands back is the one freed, where Go's cache may pick
// another, with its own rounding.) go test ./replay -run Front -v logs
// how much the front served.
func TestFrontKeepsTheTracesFigures(t *testing.T) {
	for _, path := range bundled {
		tr, err := Open(path)
		require.NoError(t, err)
		run := func(front *caching.FrontEmulator) caching.Stats {
			dev, err := arena.NewSimVMM(0, 0)
			require.NoError(t, err)
			a, err := caching.New(dev, caching.DefaultConfig())
			require.NoError(t, err)
			ptrs := make([]uintptr, tr.Slots)
			for i := range tr.Events {
				ev := &tr.Events[i]
				switch ev.Op {
				case OpAlloc:
					var p uintptr
					if front != nil {
						p, err = front.Malloc(a, ev.Size, ev.Stream)
					} else {
						p, err = a.Malloc(ev.Size, ev.Stream)
					}
					require.NoError(t, err, "%s line %d", path, ev.Line)
					ptrs[ev.Slot] = p
				case OpFree:
					if front != nil {
						err = front.Free(a, ptrs[ev.Slot])
					} else {
						err = a.Free(ptrs[ev.Slot], ev.Size, ev.Stream)
					}
					require.NoError(t, err, "%s line %d", path, ev.Line)
				}
			}
			st := a.Stats()
			require.NoError(t, a.CheckInvariants())
			require.Zero(t, a.Pending())
			require.NoError(t, a.Close())
			return st
		}
		f := caching.NewFrontEmulator()
		with, without := run(f), run(nil)
		all := caching.StatAll
		require.Equal(t, without.RequestedBytes[all], with.RequestedBytes[all], path)
		require.Equal(t, without.Allocation[all], with.Allocation[all], path)
		require.Equal(t, without.AllocatedBytes[all].Current, with.AllocatedBytes[all].Current, path)
		require.NotZero(t, f.Given, path)
		require.Equal(t, int64(f.Given), with.FrontFrees, path)
		require.Equal(t, int64(f.Recycled), with.FrontRecycled, path)
		t.Logf("%s: %d allocations, %d frees through the front, %d served by it; allocated peak %d with, %d without; own reserved peak %d with, %d without",
			path, with.Allocation[all].Allocated, f.Given, f.Recycled, with.AllocatedBytes[all].Peak,
			without.AllocatedBytes[all].Peak, with.OwnReserved.Peak, without.OwnReserved.Peak)
	}
}
