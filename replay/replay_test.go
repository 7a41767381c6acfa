package replay

import (
	"fmt"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay/reference"
	"github.com/stretchr/testify/require"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20
	GiB = 1 << 30
)

// smallTrace has a peak of 3 MiB + 1 KiB live after its fourth event.
func smallTrace(t *testing.T) *Trace {
	tr, err := Open(writeFile(t, "small.jsonl.gz", traceText(
		ev("alloc", 1, 1024),
		ev("alloc", 2, 1*MiB),
		ev("segment_alloc", 3, 20*MiB),
		ev("alloc", 3, 2*MiB),
		ev("free_requested", 2, 1*MiB),
		ev("free_completed", 2, 1*MiB),
		ev("alloc", 4, 512),
		ev("free_completed", 3, 2*MiB),
		ev("free_completed", 1, 1024),
	)))
	require.NoError(t, err)
	return tr
}

func TestReplayEveryPolicy(t *testing.T) {
	tr := smallTrace(t)
	require.Equal(t, 2, tr.PeakEvent)
	for _, name := range reference.Names {
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: name})
		require.NoError(t, err, name)
		require.Equal(t, name, r.Policy)
		require.Equal(t, "sim", r.Device)
		require.Equal(t, "synthetic", r.Workload)
		require.Equal(t, 9, r.Events)
		require.Equal(t, 7, r.Replayed)
		require.Equal(t, uint64(3*MiB+1024), r.PeakLiveBytes, name)
		require.Equal(t, 2, r.PeakLiveEvent, name)
		require.GreaterOrEqual(t, r.PeakReservedBytes, r.PeakLiveBytes, name)
		require.InDelta(t, float64(r.PeakReservedBytes)/float64(r.PeakLiveBytes), r.Ratio, 1e-12)
		require.NotZero(t, r.DeviceAllocs, name)
		require.Zero(t, r.OOMs)
		require.Equal(t, uint64(4096), r.NativeMaxReserved)
		require.Equal(t, uint64(3072), r.NativeMaxAllocated)
		require.InDelta(t, 4096.0/3072, r.NativeRatio, 1e-12)
		require.Equal(t, 1, r.NativeSegmentAllocs)
		require.Positive(t, r.NsPerOp)
		require.Positive(t, r.EventsPerSecond)
		require.Positive(t, r.EndToEndEventsPerSecond)
		require.Len(t, r.Timeline.Live, 7)
		require.Equal(t, []uint64{1024, MiB + 1024, 3*MiB + 1024, 2*MiB + 1024, 2*MiB + 1536, 1536, 512}, r.Timeline.Live)
		// The device wrapper's count of what the policy holds must agree
		// with the policy's own, which differs only in where it comes from.
		_, held := r.Timeline.AllocatorReserved.Peak()
		require.Equal(t, held, r.AllocatorPeakReservedBytes, name)
		// So must its record of the pool's reserved bytes with the pool's
		// own high-water mark (the headline, but for cudaMalloc-style
		// policies, whose headline is what they held).
		_, pool := r.Timeline.PoolReserved.Peak()
		if _, segments := mustPolicy(t, name).(reference.SegmentHolder); segments {
			require.Equal(t, held, r.PeakReservedBytes, name)
		} else {
			require.Equal(t, pool, r.PeakReservedBytes, name)
		}
	}
}

// TestReplayNativeMatchesRecordedRun is the strongest check of the native
// policy: replaying a trace of PyTorch's own allocator must take exactly the
// segments the recorded run took, and so peak at its max_reserved.
func TestReplayNativeMatchesRecordedRun(t *testing.T) {
	for _, path := range bundled {
		tr, err := Open(path)
		require.NoError(t, err)
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: "native"})
		require.NoError(t, err)
		require.Equal(t, tr.Header.MaxReserved, r.PeakReservedBytes, path)
		require.Equal(t, tr.Header.MaxReserved, r.AllocatorPeakReservedBytes, path)
		require.Equal(t, uint64(tr.SegmentAllocs()), r.DeviceAllocs, path)
		require.Zero(t, r.DeviceFrees)
		// allocated_bytes peaks a little below the recorded run's, which
		// counts a few blocks the recording's window saw only partly.
		require.InEpsilon(t, float64(tr.Header.MaxAllocated), float64(r.AllocatorPeakAllocatedBytes), 0.001, path)
	}
}

func TestReplayOOM(t *testing.T) {
	tr, err := Open(writeFile(t, "oom.jsonl", traceText(
		ev("alloc", 1, 20*MiB),
		ev("alloc", 2, 20*MiB), // does not fit in 32 MiB next to the first
		ev("alloc", 3, 1*MiB),
		ev("free_completed", 2, 20*MiB), // skipped: its alloc failed
		ev("free_completed", 1, 20*MiB),
		ev("free_completed", 3, 1*MiB),
	)))
	require.NoError(t, err)
	for _, name := range reference.Names {
		r, err := Replay(tr, arena.NewSim(0, 32*MiB), Options{Policy: name})
		require.NoError(t, err, name)
		require.Contains(t, r.OOMError, "line 3: ", name)
		if name == "buddy" || name == "fixed" {
			// 20 MiB takes a 32 MiB block, the whole device: the 1 MiB
			// request fails too.
			require.Equal(t, 2, r.OOMs, name)
			require.Equal(t, uint64(20*MiB), r.PeakLiveBytes, name)
		} else {
			require.Equal(t, 1, r.OOMs, name)
			require.Equal(t, uint64(21*MiB), r.PeakLiveBytes, name)
		}
		require.Equal(t, uint64(0), r.Timeline.Live[len(r.Timeline.Live)-1])
	}
}

func TestReplayErrors(t *testing.T) {
	tr := smallTrace(t)
	sim := arena.NewSim(0, 0)
	_, err := Replay(tr, sim, Options{Policy: "bogus"})
	require.ErrorContains(t, err, `unknown policy "bogus"`)
	_, err = sim.Alloc(512, 0)
	require.Error(t, err, "the device is closed after a failed replay too")

	_, err = Replay(tr, arena.NewSim(0, 0), Options{Policy: "goalloc", Conf: "fraction:2"})
	require.ErrorContains(t, err, "GOALLOC_CONF: fraction")

	// A device failure other than an out-of-memory stops the replay and
	// names the line.
	bad := arena.NewSim(0, 0)
	bad.SetFaults(arena.SimFaults{Alloc: func(size uint64, s arena.Stream) error {
		return &arena.DriverError{Op: "cuMemAllocFromPoolAsync", Code: 999}
	}})
	_, err = Replay(tr, bad, Options{Policy: "native"})
	require.ErrorContains(t, err, "small.jsonl.gz: line 2: alloc of 1024 bytes on stream 0x0: policy native: ")
	require.ErrorContains(t, err, "cuMemAllocFromPoolAsync failed")
}

func TestReplayConf(t *testing.T) {
	tr := smallTrace(t)
	r, err := Replay(tr, arena.NewSim(0, 0), Options{Conf: "large_cache:0"})
	require.NoError(t, err)
	require.Equal(t, "goalloc", r.Policy)
	require.Equal(t, "large_cache:0", r.Conf)
	r, err = Replay(tr, arena.NewSim(0, 0), Options{Policy: "native"})
	require.NoError(t, err)
	require.Empty(t, r.Conf)
}

func TestCountingDevice(t *testing.T) {
	sim := arena.NewSim(0, 0)
	d := newCountingDevice(sim)
	p, err := d.Alloc(3*MiB, 0)
	require.NoError(t, err)
	q, err := d.Alloc(512, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(3*MiB+512), d.counts.Held())
	require.Equal(t, uint64(32*MiB), d.poolReserved, "the sim maps 32 MiB chunks; the 512 bytes fit in the first's rest")
	require.NoError(t, d.Free(p, 3*MiB, 0))
	require.NoError(t, d.Free(q, 512, 0))
	require.Equal(t, uint64(2), d.counts.Allocs())
	require.Equal(t, uint64(2), d.counts.Frees())
	require.Zero(t, d.counts.Held())
	require.Equal(t, uint64(32*MiB), d.poolReserved, "freed memory stays in the pool")
	require.NoError(t, d.Trim(0))
	require.Zero(t, d.poolReserved)
	require.Error(t, d.Free(p, 3*MiB, 0))
	require.Equal(t, uint64(2), d.counts.Frees(), "a failed free is not counted")
}

func mustPolicy(t *testing.T, name string) reference.Allocator {
	a, err := reference.New(name, arena.NewSim(0, 0), "")
	require.NoError(t, err)
	return a
}

// DeviceName asks the device for its name, which is what --device says
// ("sim", "cuda") whichever backend serves the memory; a device with none is
// named by its Go type.
func TestDeviceName(t *testing.T) {
	require.Equal(t, "sim", DeviceName(arena.NewSim(0, 0)))
	require.Equal(t, "cuda", DeviceName((*arena.CUDA)(nil)), "a CUDA device names itself without a GPU")
	require.Equal(t, "cuda", DeviceName((*arena.VMM)(nil)))
	vmm, err := arena.NewSimVMM(0, 0)
	require.NoError(t, err)
	defer vmm.Close()
	require.Equal(t, "sim", DeviceName(vmm), "the simulated VMM device is the simulated device's")
	// A wrapper that does not pass Name on is not taken for what it wraps.
	require.Equal(t, "*replay.countingDevice", DeviceName(&countingDevice{Device: arena.NewSim(0, 0)}))
}

// A free on another stream than its allocation's is a mistake goalloc
// reports and handles (it frees the block in the allocation stream's
// order); every policy replays the trace, and goalloc's warning is counted
// in the result, the first one kept with where it happened.
func TestReplayFreeOnAnotherStream(t *testing.T) {
	onStream := func(action string, addr, size, stream uint64) string {
		return fmt.Sprintf(`{"a": "%s", "addr": %d, "size": %d, "stream": %d, "t": 1000}`, action, addr, size, stream)
	}
	tr, err := Open(writeFile(t, "streams.jsonl", traceText(
		onStream("alloc", 1, 4096, 7),
		onStream("free_completed", 1, 4096, 9),
		onStream("alloc", 2, 4096, 7),
	)))
	require.NoError(t, err)
	var results []*Result
	for _, name := range reference.Names {
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: name})
		require.NoError(t, err, name)
		results = append(results, r)
		require.Equal(t, uint64(4096), r.PeakLiveBytes, name)
		if name == "goalloc" {
			require.Equal(t, 1, r.InputWarnings, name)
			require.Contains(t, r.InputWarning, "line 3: ")
			require.Contains(t, r.InputWarning, "freed in the allocation stream's order")
		} else {
			require.Zero(t, r.InputWarnings, name)
			require.Empty(t, r.InputWarning, name)
		}
	}
	var page strings.Builder
	require.NoError(t, WriteHTML(&page, tr, results))
	require.Contains(t, page.String(), "goalloc: calls carried out despite bad input (a warning each): 1; the first at line 3: ")
}
