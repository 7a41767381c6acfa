package replay

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

// TestReplayVMM replays the bundled traces on the simulated VMM backend:
// the ratio goal (peak reserved, here the physical bytes held, at most
// 1.03x the live peak) holds, and the driver calls it took are logged
// (BENCHMARKS.md quotes them: go test ./replay -run TestReplayVMM -v).
func TestReplayVMM(t *testing.T) {
	for _, path := range bundled {
		tr, err := Open(path)
		require.NoError(t, err)
		dev, err := arena.NewSimVMM(0, 0)
		require.NoError(t, err)
		r, err := Replay(tr, dev, Options{Policy: "goalloc", Conf: "backend:vmm"})
		require.NoError(t, err)
		require.LessOrEqual(t, r.Ratio, 1.03, path)
		t.Logf("%s: ratio %.4f, %d device allocs, %d frees; driver calls (the final close included) %v",
			path, r.Ratio, r.DeviceAllocs, r.DeviceFrees, dev.Calls())
	}
}
