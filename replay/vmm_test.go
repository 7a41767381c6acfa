package replay

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

// TestReplayVMM replays the bundled traces on the simulated VMM backend,
// with goalloc's default cache policy and with a policy that sends fewer
// misses to the device: the ratio goal (peak reserved, here the physical
// bytes held, at most 1.03x the live peak) holds, and the driver calls each
// took are logged (BENCHMARKS.md quotes them: go test ./replay -run
// TestReplayVMM -v).
func TestReplayVMM(t *testing.T) {
	for _, conf := range []string{"backend:vmm", "backend:vmm,miss_release:false,large_cache:128M"} {
		for _, path := range bundled {
			tr, err := Open(path)
			require.NoError(t, err)
			dev, err := arena.NewSimVMM(0, 0)
			require.NoError(t, err)
			r, err := Replay(tr, dev, Options{Policy: "goalloc", Conf: conf})
			require.NoError(t, err)
			require.LessOrEqual(t, r.Ratio, 1.03, path)
			t.Logf("%s, %s: ratio %.4f, %d device allocs, %d frees; driver calls (the final close included) %v",
				path, conf, r.Ratio, r.DeviceAllocs, r.DeviceFrees, dev.Calls())
		}
	}
}
