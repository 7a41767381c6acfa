package replay

import (
	"fmt"
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
			// goalloc's own peak (what it held from the device) is below what
			// the device held at its peak: granules and free mapped spans.
			require.Less(t, r.AllocatorPeakReservedBytes, r.PeakReservedBytes, path)
			require.GreaterOrEqual(t, r.AllocatorPeakReservedBytes, r.PeakLiveBytes, path)
			// What the device held at its peak, span by span, adds up to it.
			h := r.HeldAtPeak
			require.NotNil(t, h, path)
			require.Equal(t, r.PeakReservedBytes, h.Held, path)
			require.Equal(t, h.Held, h.Parts(), path)
			require.GreaterOrEqual(t, h.Live, r.Timeline.Live[r.PeakReservedEvent], path)
			// The result carries the device's profile of its driver calls.
			profiled := map[string]uint64{}
			for _, c := range r.DriverCalls {
				profiled[c.Name] = c.Count
			}
			require.NotZero(t, profiled["cuMemCreate"], path)
			require.LessOrEqual(t, profiled["cuMemCreate"], uint64(dev.Calls()["cuMemCreate"]), path)
			t.Logf("%s, %s: ratio %.4f, %d device allocs, %d frees; driver calls (the final close included) %v; at the peak %+v",
				path, conf, r.Ratio, r.DeviceAllocs, r.DeviceFrees, dev.Calls(), *h)
		}
	}
}

// The replay hands the policy a device that still caps its own physical
// memory, as the library does: a cap between goalloc's own peak and the
// physical peak bounds what the simulated VMM device holds.
func TestReplayVMMCapReachesTheDevice(t *testing.T) {
	tr, err := Open(bundled[0]) // GPT-2: 23.64 GiB live, 23.87 GiB physical at the peak
	require.NoError(t, err)
	const memory = 100 << 30
	dev, err := arena.NewSimVMM(0, memory)
	require.NoError(t, err)
	const fraction = 0.2375 // 23.75 GiB
	r, err := Replay(tr, dev, Options{Policy: "goalloc", Conf: fmt.Sprintf("backend:vmm,fraction:%v", fraction)})
	require.NoError(t, err)
	require.LessOrEqual(t, r.PeakReservedBytes, uint64(fraction*memory), "the device held more than the cap")
	t.Logf("physical peak %d under a cap of %d; %d allocations refused", r.PeakReservedBytes, uint64(fraction*memory), r.OOMs)
}

// A cudaMalloc-style policy's figure is its own segments, not the device's:
// the replay gives no split of the device's peak for it.
func TestReplayNoHeldSplitForSegmentPolicies(t *testing.T) {
	tr, err := Open(bundled[1])
	require.NoError(t, err)
	dev, err := arena.NewSimVMM(0, 0)
	require.NoError(t, err)
	r, err := Replay(tr, dev, Options{Policy: "native"})
	require.NoError(t, err)
	require.Nil(t, r.HeldAtPeak)
}
