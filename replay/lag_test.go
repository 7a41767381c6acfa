package replay

import (
	"fmt"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// evAt is an event line of a stream at a time (microseconds).
func evAt(action string, addr, size, stream uint64, t int64) string {
	return fmt.Sprintf(`{"a": "%s", "addr": %d, "size": %d, "stream": %d, "t": %d}`, action, addr, size, stream, t)
}

// Stream 1 frees 64 MiB at 1 ms and stream 2 asks for as much at 2 ms.
// With the device running 10 ms behind, stream 1's free is still queued
// then: stream 2 waits for it on the device and takes its memory, and
// the peak does not grow; with no lag the free has completed and pays.
func TestReplayDeviceLag(t *testing.T) {
	tr, err := Open(writeFile(t, "lag.jsonl", traceText(
		evAt("alloc", 1, 64*MiB, 1, 0),
		evAt("free_requested", 1, 64*MiB, 1, 1000),
		evAt("free_completed", 1, 64*MiB, 1, 1000),
		evAt("alloc", 2, 64*MiB, 2, 2000),
		evAt("free_requested", 2, 64*MiB, 2, 3000),
		evAt("free_completed", 2, 64*MiB, 2, 3000),
	)))
	require.NoError(t, err)
	waits := func(r *Result) uint64 {
		for _, c := range r.DriverCalls {
			if c.Name == "cuStreamWaitEvent" {
				return c.Count
			}
		}
		return 0
	}
	for _, lag := range []int64{0, 10_000} {
		dev, err := arena.NewSimVMM(0, 1<<30)
		require.NoError(t, err)
		r, err := Replay(tr, dev, Options{Conf: "backend:vmm,large_cache:0", DeviceLag: lag})
		require.NoError(t, err)
		assert.EqualValues(t, 64*MiB, r.PeakReservedBytes, "lag %d µs", lag)
		if lag == 0 {
			assert.Zero(t, waits(r), "a completed free needs no wait")
		} else {
			assert.EqualValues(t, 1, waits(r), "stream 2 waited for stream 1's free")
		}
	}
}

func TestReplayDeviceLagRefuses(t *testing.T) {
	timeless, err := Open(writeFile(t, "timeless.jsonl", traceText(
		`{"a": "alloc", "addr": 1, "size": 512, "stream": 0}`,
		`{"a": "free_completed", "addr": 1, "size": 512, "stream": 0}`,
	)))
	require.NoError(t, err)
	dev, err := arena.NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	_, err = Replay(timeless, dev, Options{DeviceLag: 1000})
	require.ErrorContains(t, err, `a device lag needs the trace's times ("t")`)

	_, err = Replay(timeless, fakeGPU{arena.NewSim(0, 0)}, Options{DeviceLag: 1000})
	require.ErrorContains(t, err, "a device lag needs the simulated device")

	dev, err = arena.NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	_, err = Replay(timeless, dev, Options{DeviceLag: -1})
	require.ErrorContains(t, err, "a lag is 0 or more")

	// A stream's own lag is refused the same way.
	dev, err = arena.NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	_, err = Replay(timeless, dev, Options{StreamLag: map[arena.Stream]int64{7: -1}})
	require.ErrorContains(t, err, "a lag of -1 µs for stream 7: a lag is 0 or more")
	_, err = Replay(timeless, fakeGPU{arena.NewSim(0, 0)}, Options{StreamLag: map[arena.Stream]int64{7: 1000}})
	require.ErrorContains(t, err, "a device lag needs the simulated device")
}

// fakeGPU is a device whose streams cannot be held back.
type fakeGPU struct{ arena.Device }
