package arena_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/goalloc/goalloc/replay"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// vmmCallCost is what each VMM driver call cost on an H200 (driver 580,
// CUDA 13.0, measured from Python through ctypes, the middle of each
// range): cuMemCreate 11-13 us, cuMemMap 2-5 us, cuMemSetAccess about
// 30 us, cuMemUnmap about 18 us, cuMemRelease 11-18 us.
var vmmCallCost = map[string]time.Duration{
	"cuMemCreate":    12 * time.Microsecond,
	"cuMemMap":       3500 * time.Nanosecond,
	"cuMemSetAccess": 30 * time.Microsecond,
	"cuMemUnmap":     18 * time.Microsecond,
	"cuMemRelease":   15 * time.Microsecond,
}

// vmmReplayFigures replays trace on the simulated VMM device with
// placement p: the ratio, the cache misses that reached the device, and
// the driver calls they made (the final close left out).
type vmmReplayFigures struct {
	ratio    float64
	misses   int
	calls    map[string]int
	perMiss  float64
	cost     time.Duration // the calls at vmmCallCost, per miss
	nsPerOp  float64
	physPeak uint64
	// free: the share of misses that made no driver call; p99: the 99th
	// percentile of a miss's calls at vmmCallCost.
	free float64
	p99  time.Duration
}

func replayVMM(t *testing.T, path string, p arena.VMMPlacement) vmmReplayFigures {
	tr, err := replay.Open(path)
	require.NoError(t, err)
	dev, err := arena.NewSimVMMPlaced(0, 0, p)
	require.NoError(t, err)
	// The replay closes the device; the calls are read before that.
	var calls map[string]int
	cd := &closeCounting{SimVMM: dev, out: &calls}
	r, err := replay.Replay(tr, cd, replay.Options{Policy: "goalloc", Conf: "backend:vmm"})
	require.NoError(t, err)
	if calls == nil {
		calls = dev.Calls()
	}
	f := vmmReplayFigures{ratio: r.Ratio, misses: int(r.DeviceAllocs), calls: calls, nsPerOp: r.NsPerOp, physPeak: r.PeakReservedBytes}
	free := 0
	for _, c := range cd.perAlloc {
		if c == 0 {
			free++
		}
	}
	f.free = float64(free) / float64(len(cd.perAlloc))
	slices.Sort(cd.perAlloc)
	f.p99 = cd.perAlloc[len(cd.perAlloc)*99/100]
	n := 0
	for name, c := range calls {
		if name == "cuMemAddressReserve" || name == "cuMemAddressFree" {
			continue
		}
		n += c
		f.cost += time.Duration(c) * vmmCallCost[name]
	}
	f.perMiss = float64(n) / float64(f.misses)
	f.cost /= time.Duration(f.misses)
	return f
}

// closeCounting reads the driver calls just before the replay closes the
// device, so that Close's unmaps and releases are not counted as misses',
// and prices the calls of each allocation.
type closeCounting struct {
	*arena.SimVMM
	out      *map[string]int
	perAlloc []time.Duration
}

func (c *closeCounting) Alloc(size uint64, s arena.Stream) (uintptr, error) {
	before := c.SimVMM.Calls()
	p, err := c.SimVMM.Alloc(size, s)
	var cost time.Duration
	for name, n := range c.SimVMM.Calls() {
		cost += time.Duration(n-before[name]) * vmmCallCost[name]
	}
	c.perAlloc = append(c.perAlloc, cost)
	return p, err
}

func (c *closeCounting) Close() error {
	*c.out = c.SimVMM.Calls()
	return c.SimVMM.Close()
}

// TestVMMPlacementReplay replays both bundled traces with both placements
// and compares them: the figures the default placement was chosen by
// (go test ./arena -run TestVMMPlacementReplay -v logs them). Segments
// keep the ratio of ranges (within a hundredth) and make a small fraction
// of their driver calls.
func TestVMMPlacementReplay(t *testing.T) {
	for _, path := range []string{"../traces/gpt2-train.jsonl.gz", "../traces/resnet50-train.jsonl.gz"} {
		figs := map[arena.VMMPlacement]vmmReplayFigures{}
		for _, p := range []arena.VMMPlacement{arena.VMMRanges, arena.VMMSegments} {
			f := replayVMM(t, path, p)
			figs[p] = f
			t.Logf("%s, %s: ratio %.4f, %d misses, %.3f driver calls per miss (at H200 prices: %v per miss, p99 %v, %.1f%% of misses call nothing), %.0f ns/op; calls %v",
				path, p, f.ratio, f.misses, f.perMiss, f.cost, f.p99, 100*f.free, f.nsPerOp, fmt.Sprint(f.calls))
			assert.LessOrEqual(t, f.ratio, 1.03, "%s, %s", path, p)
		}
		seg, rng := figs[arena.VMMSegments], figs[arena.VMMRanges]
		assert.LessOrEqual(t, seg.ratio, rng.ratio+0.01, path)
		assert.Less(t, seg.perMiss, rng.perMiss/4, "%s: segments make a quarter of ranges' calls or fewer", path)
	}
}

// GOALLOC_CONF's vmm_placement names the placement; a bad name is refused
// with the key named, and none means the default.
func TestVMMPlacementConf(t *testing.T) {
	c, err := caching.ParseConfig("backend:vmm")
	require.NoError(t, err)
	assert.Equal(t, arena.DefaultVMMPlacement, c.VMMPlacement)
	c, err = caching.ParseConfig("backend:vmm,vmm_placement:ranges")
	require.NoError(t, err)
	assert.Equal(t, arena.VMMRanges, c.VMMPlacement)
	c, err = caching.ParseConfig("vmm_placement:segments")
	require.NoError(t, err)
	assert.Equal(t, arena.VMMSegments, c.VMMPlacement)
	_, err = caching.ParseConfig("backend:vmm,vmm_placement:stripes")
	assert.ErrorContains(t, err, "vmm_placement")
	assert.ErrorContains(t, err, "neither segments nor ranges")
}
