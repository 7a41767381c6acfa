package replay

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The simulator's test set: histories bench/workloads.py recorded on an
// H200 under backend:vmm from the process's start (bench/README.md says
// how), each with what the GPU's device held at most
// (goalloc_reserved_peak) under the 16 MiB handles it was recorded with,
// and what it held in a later run under the default handles. A replay on
// the simulated VMM device predicts both within 1%, with the device in
// step with the host and running 10 ms behind it: a change to the
// placement that moves the figure shows here.
// Checkpointed FSDP runs two streams (FSDP's all-gathers on their own), so
// it holds the rules by which one stream's frees serve another's misses, a
// complete free span where it lies and one still in use after a wait
// (steps 1 and 3 in arena/vmm.go): without both the replay 10 ms behind
// misses the GPU's figure.
// Serving and the RL rollout keep KV caches placed among activations that
// die soon after, so they hold free ends of handles beside live tensors.
// Under -short (make test) each trace is replayed 10 ms behind only.
var gpuTraces = []string{"checkpoint-vmm", "checkpoint-r2-vmm", "moe-vmm", "rollout-vmm", "serving-vmm", "serving-r1-vmm"}

// recordedLayout is the handles the histories were recorded under: 16
// MiB, the default then.
var recordedLayout = arena.VMMLayout{Handle: 16 << 20}

// newGPUTraceDevice is a simulated H200 of recordedLayout.
func newGPUTraceDevice(t *testing.T) *arena.SimVMM {
	return newGPUTraceDeviceWith(t, recordedLayout)
}

func newGPUTraceDeviceWith(t *testing.T, l arena.VMMLayout) *arena.SimVMM {
	dev, err := arena.NewSimVMMWith(0, 140<<30, l)
	require.NoError(t, err)
	return dev
}

// gpuHeldWithDefaultHandles is what the GPU held at most in later runs of
// the same workloads and shapes (not recorded) under the default 4 MiB
// handles, at 57e7e76 (bench/results/harsh.json, held_split_at_peak).
var gpuHeldWithDefaultHandles = map[string]uint64{
	"checkpoint-vmm":    20_921_188_352,
	"checkpoint-r2-vmm": 17_863_540_736,
	"moe-vmm":           25_904_021_504,
	"rollout-vmm":       13_648_265_216,
	"serving-vmm":       5_024_776_192,
	"serving-r1-vmm":    3_183_476_736,
}

func TestSimulatorPredictsTheGPU(t *testing.T) {
	for _, name := range gpuTraces {
		tr, err := Open("../traces/" + name + ".jsonl.gz")
		require.NoError(t, err, name)
		require.NotZero(t, tr.Header.GoallocReservedPeak, "%s: the trace names the GPU's figure", name)
		require.Contains(t, gpuHeldWithDefaultHandles, name)
		lags := []int64{0, 10_000}
		if testing.Short() {
			lags = lags[1:]
		}
		for _, handles := range []struct {
			layout arena.VMMLayout
			gpu    uint64
		}{
			{recordedLayout, tr.Header.GoallocReservedPeak},
			{arena.VMMLayout{}, gpuHeldWithDefaultHandles[name]},
		} {
			for _, lag := range lags {
				dev := newGPUTraceDeviceWith(t, handles.layout)
				r, err := Replay(tr, dev, Options{Conf: "backend:vmm", DeviceLag: lag})
				require.NoError(t, err, name)
				assert.InDelta(t, 1, float64(r.PeakReservedBytes)/float64(handles.gpu), 0.01,
					"%s, handles %+v, device %d µs behind: the simulated device held %d bytes at most, the GPU %d",
					name, handles.layout, lag, r.PeakReservedBytes, handles.gpu)
				assert.Zero(t, r.OOMs)
			}
		}
	}
}

// The default handles hold every history within 1.03 of its peak live
// bytes, the device 10 ms behind: the memory goal on the harsh workloads.
// Serving's repeat 1 is the one 16 MiB handles miss: its KV cache's
// tensors, placed among activations that die soon after, each sit between
// free ends of their handles at the peak.
func TestDefaultHandlesHoldEachHistoryWithinTheGoal(t *testing.T) {
	for _, name := range gpuTraces {
		tr, err := Open("../traces/" + name + ".jsonl.gz")
		require.NoError(t, err, name)
		r, err := Replay(tr, newGPUTraceDeviceWith(t, arena.VMMLayout{}), Options{Conf: "backend:vmm", DeviceLag: 10_000})
		require.NoError(t, err, name)
		assert.LessOrEqual(t, float64(r.PeakReservedBytes)/float64(r.PeakLiveBytes), 1.03, name)
	}
}

// What holds serving's memory beyond live, per handle (BENCHMARKS.md
// quotes it). The KV cache's 24 tensors of 48,857,088 bytes (2.9 granules)
// outlive the activations around them; started at a free span's head, one
// touches 4 granules and, at the peak, sits between two free ends. Started
// on a granule (granuleStart, arena/vmm_segments.go), most touch the 3
// their size needs, so little of a handle is left beside each.
func TestServingFreeEndsBesideTheKVCache(t *testing.T) {
	r := replayTenMillisBehind(t, "serving-vmm")
	require.NotEmpty(t, r.FreeEndsAtPeak)
	kv := r.FreeEndsAtPeak[0]
	assert.Equal(t, arena.FreeEnds{LiveSize: 48_857_088, LiveSpans: 23, Bytes: 50_692_096}, kv)
	assert.Less(t, kv.Bytes, uint64(kv.LiveSpans)*(16<<20)/4, "a quarter of a handle each, at most")
}

// FSDP's repeat 2: the compute stream's logits, placed in a free span of
// the all-gather stream's segment (step 1), were pending there once freed
// until the GPU reached the free, and the next step's logits were created
// beside them: on the H200 that run held 1.13x with 2.40 GiB pending at
// its peak, as this history replays with the device 10 ms behind before
// takeOwnPending (arena/vmm_segments.go), which gives the stream its own
// pending free back. The GPU run that recorded the history, its host
// slowed by the recording, held 1.009x.
func TestFSDPStreamTakesBackItsPendingLogits(t *testing.T) {
	r := replayTenMillisBehind(t, "checkpoint-r2-vmm")
	assert.Zero(t, r.HeldAtPeak.Pending, "nothing pending at the peak")
	assert.Less(t, r.Ratio, 1.02)
}

// replayTenMillisBehind replays traces/NAME.jsonl.gz on the simulated VMM
// device 10 ms behind the host (goalloc replay --device-lag 10ms).
func replayTenMillisBehind(t *testing.T, name string) *Result {
	tr, err := Open("../traces/" + name + ".jsonl.gz")
	require.NoError(t, err)
	dev := newGPUTraceDevice(t)
	r, err := Replay(tr, dev, Options{Conf: "backend:vmm", DeviceLag: 10_000})
	require.NoError(t, err)
	require.NotNil(t, r.HeldAtPeak)
	return r
}

// FSDP's all-gather stream may run far behind the compute stream (its
// copies wait for the compute stream's events). Spans of the compute
// stream's segments that the all-gather stream took and freed are then
// pending until it catches up: the GPU run BENCHMARKS.md describes held
// them at its peak while the compute stream created memory beside them.
// With that stream 200 ms behind (--stream-lag), a miss of the compute
// stream that would create memory waits for those frees instead
// (adoptPending in arena/vmm_segments.go): nothing pending at the peak,
// as with every stream 10 ms behind, and the compute stream waited.
func TestAllGatherStreamFarBehind(t *testing.T) {
	tr, err := Open("../traces/checkpoint-vmm.jsonl.gz")
	require.NoError(t, err)
	var allGather arena.Stream
	for _, ev := range tr.Events {
		if ev.Stream != 0 {
			allGather = ev.Stream
			break
		}
	}
	require.NotZero(t, allGather, "the trace has FSDP's all-gather stream")
	replay := func(lags map[arena.Stream]int64) *Result {
		dev := newGPUTraceDevice(t)
		r, err := Replay(tr, dev, Options{Conf: "backend:vmm", DeviceLag: 10_000, StreamLag: lags})
		require.NoError(t, err)
		require.NotNil(t, r.HeldAtPeak)
		return r
	}
	lags := map[arena.Stream]int64{allGather: 200_000}
	far := replay(lags)
	assert.Equal(t, lags, far.StreamLagMicros)
	assert.Zero(t, far.HeldAtPeak.Pending, "the all-gather stream's frees not pending at the peak")
	assert.Less(t, far.Ratio, 1.01)
	waits := 0
	for _, c := range far.DriverCalls {
		if c.Name == "cuStreamWaitEvent" {
			waits += int(c.Count)
		}
	}
	assert.Positive(t, waits, "the compute stream waited for them")
	step := replay(nil)
	assert.Zero(t, step.HeldAtPeak.Pending)
	assert.Less(t, step.Ratio, 1.01)
}

// FSDP's repeat 0 at 217622e on the H200 held 1.024x, 1.5 GiB of it
// pending at the peak: the compute stream's logits, freed in the
// all-gather stream's segment, were pending while the GPU ran the compute
// stream behind, and the next step's logits, larger, were created beside
// them (too large for takeOwnPending). With the compute stream 50 ms
// behind this history held the same; the stream's own pending free now
// lends its granules to the growth (lendOwnPending, arena/vmm_grow.go),
// which drain where they lay until the GPU reaches the free.
func TestComputeStreamBehindLendsItsPendingLogits(t *testing.T) {
	tr, err := Open("../traces/checkpoint-vmm.jsonl.gz")
	require.NoError(t, err)
	dev := newGPUTraceDevice(t)
	r, err := Replay(tr, dev, Options{Conf: "backend:vmm", DeviceLag: 10_000, StreamLag: map[arena.Stream]int64{0: 50_000}})
	require.NoError(t, err)
	require.NotNil(t, r.HeldAtPeak)
	assert.Zero(t, r.HeldAtPeak.Pending, "nothing pending at the peak")
	assert.Positive(t, r.HeldAtPeak.Draining, "the lent granules drain where they lay")
	assert.Less(t, r.Ratio, 1.01)
}
