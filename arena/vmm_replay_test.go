package arena_test

import (
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/goalloc/goalloc/replay"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// vmmCallCost is what each VMM driver call cost on an H200 (driver 580,
// CUDA 13.0), from the device's own profile of its calls replaying
// traces/gpt2-train.jsonl.gz on the GPU with 2 MiB handles
// (tests/gpu/profile_vmm.sh): cuMemCreate 12.1 us, cuMemMap 2.1 us,
// cuMemUnmap 21.2 us; cuMemRelease 11-18 us (measured from Python through
// ctypes). cuMemSetAccess costs per handle it opens, not per call: 33 us
// each (334 calls over 14,342 handles took 470 ms), priced through
// vmmAccessKey.
var vmmCallCost = map[string]time.Duration{
	"cuMemCreate":  12 * time.Microsecond,
	"cuMemMap":     2 * time.Microsecond,
	vmmAccessKey:   33 * time.Microsecond,
	"cuMemUnmap":   21 * time.Microsecond,
	"cuMemRelease": 15 * time.Microsecond,
}

// vmmAccessKey counts, among the calls, the handles cuMemSetAccess opened.
const vmmAccessKey = "cuMemSetAccess (handles)"

// callsOf is the fake driver's calls so far, with the handles
// cuMemSetAccess opened under vmmAccessKey.
func callsOf(d *arena.SimVMM) map[string]int {
	c := d.Calls()
	c[vmmAccessKey] = d.Phys().AccessHandles
	return c
}

// vmmReplayFigures replays trace on the simulated VMM device laid out as
// l says: the ratio, the cache misses that reached the device, and
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

func replayVMM(t *testing.T, path string, l arena.VMMLayout) vmmReplayFigures {
	tr, err := replay.Open(path)
	require.NoError(t, err)
	dev, err := arena.NewSimVMMWith(0, 0, l)
	require.NoError(t, err)
	// The replay closes the device; the calls are read before that.
	var calls map[string]int
	cd := &closeCounting{SimVMM: dev, out: &calls}
	r, err := replay.Replay(tr, cd, replay.Options{Policy: "goalloc", Conf: "backend:vmm"})
	require.NoError(t, err)
	if calls == nil {
		calls = callsOf(dev)
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
		if name != vmmAccessKey {
			n += c
		}
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
	before := callsOf(c.SimVMM)
	p, err := c.SimVMM.Alloc(size, s)
	var cost time.Duration
	for name, n := range callsOf(c.SimVMM) {
		cost += time.Duration(n-before[name]) * vmmCallCost[name]
	}
	c.perAlloc = append(c.perAlloc, cost)
	return p, err
}

func (c *closeCounting) Close() error {
	*c.out = callsOf(c.SimVMM)
	return c.SimVMM.Close()
}

// TestVMMPlacementReplay replays both bundled traces with the default
// handles and with 2 MiB ones (the driver's granularity on an H200): the
// figures BENCHMARKS.md quotes (go test ./arena -run TestVMMPlacementReplay
// -v logs them). The default handles keep the ratio within a hundredth of
// 2 MiB ones, make fewer driver calls per miss, and most misses make none.
func TestVMMPlacementReplay(t *testing.T) {
	for _, path := range []string{"../traces/gpt2-train.jsonl.gz", "../traces/resnet50-train.jsonl.gz"} {
		var figs [2]vmmReplayFigures
		for i, l := range []arena.VMMLayout{{}, {Handle: 2 << 20}} {
			f := replayVMM(t, path, l)
			figs[i] = f
			t.Logf("%s, %+v: ratio %.4f, %d misses, %.3f driver calls per miss (at H200 prices: %v per miss, p99 %v, %.1f%% of misses call nothing), %.0f ns/op; calls %v",
				path, l, f.ratio, f.misses, f.perMiss, f.cost, f.p99, 100*f.free, f.nsPerOp, fmt.Sprint(f.calls))
			assert.LessOrEqual(t, f.ratio, 1.03, "%s, %+v", path, l)
		}
		def, small := figs[0], figs[1]
		assert.LessOrEqual(t, def.ratio, small.ratio+0.01, path)
		assert.Less(t, def.perMiss, small.perMiss, "%s: larger handles, fewer driver calls", path)
		assert.Greater(t, def.free, 0.95, "%s: most misses make no driver call", path)
	}
}

// GOALLOC_CONF's vmm_placement is retired: segments, the one placement
// left, is still taken (old configurations name it); ranges, removed, is
// refused with a message that says so, and any other name too.
func TestVMMPlacementConf(t *testing.T) {
	_, err := caching.ParseConfig("backend:vmm,vmm_placement:segments")
	require.NoError(t, err)
	_, err = caching.ParseConfig("backend:vmm,vmm_placement:ranges")
	assert.ErrorContains(t, err, "vmm_placement")
	assert.ErrorContains(t, err, "ranges placement was retired")
	_, err = caching.ParseConfig("backend:vmm,vmm_placement:stripes")
	assert.ErrorContains(t, err, "vmm_placement")
	assert.ErrorContains(t, err, "takes only segments")
}

// GOALLOC_CONF's vmm_handle sizes the physical handles: a power of two,
// the default when none is named; the device's granule is at least the
// driver's (2 MiB on the simulated device).
func TestVMMHandleConf(t *testing.T) {
	c, err := caching.ParseConfig("backend:vmm")
	require.NoError(t, err)
	assert.Zero(t, c.VMM.Handle, "the placement's default")
	c, err = caching.ParseConfig("vmm_handle:64M,vmm_placement:segments")
	require.NoError(t, err)
	assert.Equal(t, uint64(64<<20), c.VMM.Handle)
	// goalloc.config() prints the layout in keys that read back.
	var printed []string
	for _, kv := range strings.Split(c.String(), ",") {
		if strings.HasPrefix(kv, "vmm_") {
			printed = append(printed, kv)
		}
	}
	again, err := caching.ParseConfig(strings.Join(printed, ","))
	require.NoError(t, err)
	assert.Equal(t, c.VMM, again.VMM, c.String())
	for _, bad := range []string{"vmm_handle:3M", "vmm_handle:0", "vmm_handle:lots"} {
		_, err = caching.ParseConfig(bad)
		assert.ErrorContains(t, err, "vmm_handle", bad)
	}
	for handle, granule := range map[uint64]uint64{0: arena.DefaultVMMHandle, 1 << 20: 2 << 20, 32 << 20: 32 << 20} {
		d, err := arena.NewSimVMMWith(0, 1<<30, arena.VMMLayout{Handle: handle})
		require.NoError(t, err)
		assert.Equal(t, granule, d.Phys().Granularity(), "handle %d", handle)
		p, err := d.Alloc(1000, 1)
		require.NoError(t, err)
		u, err := d.PoolUsage()
		require.NoError(t, err)
		assert.Equal(t, granule, u.ReservedCurrent, "one handle held for a small request")
		require.NoError(t, d.Free(p, 1000, 1))
		require.NoError(t, d.Close())
	}
	_, err = arena.NewSimVMMWith(0, 1<<30, arena.VMMLayout{Handle: 3 << 20})
	assert.ErrorContains(t, err, "not a power of two")
	_, err = arena.NewSimVMMWith(0, 1<<30, arena.VMMLayout{Handle: 2 << 30})
	assert.ErrorContains(t, err, "larger than the device's")
	// The default shrinks to a device smaller than it.
	small, err := arena.NewSimVMMWith(0, 4<<20, arena.VMMLayout{})
	require.NoError(t, err)
	assert.Equal(t, uint64(4<<20), small.Phys().Granularity())
	require.NoError(t, small.Close())
}

// placementHash is a device that folds every request goalloc's cache makes
// of it, and where the placement put it, into one number.
type placementHash struct {
	*arena.SimVMM
	sum uint64
}

func (d *placementHash) mix(op byte, a, b uint64) {
	f := fnv.New64a()
	fmt.Fprintf(f, "%d %c %x %x", d.sum, op, a, b)
	d.sum = f.Sum64()
}

func (d *placementHash) Alloc(size uint64, s arena.Stream) (uintptr, error) {
	p, err := d.SimVMM.Alloc(size, s)
	d.mix('a', uint64(p), size)
	return p, err
}

func (d *placementHash) Free(p uintptr, size uint64, s arena.Stream) error {
	err := d.SimVMM.Free(p, size, s)
	d.mix('f', uint64(p), size)
	return err
}

// TestVMMPlacementsAreUnchanged replays the bundled traces on the simulated
// VMM device under several configurations and layouts, and checks every
// address the placement chose, and the peak, against those of the
// release before the segments' spans became a list (01ce892): work on the
// placement's speed or shape must not move a byte. A change meant to place
// differently updates these figures, and says why: 289e547 started requests
// of a granule or more on a granule boundary (granuleStart). Each row names
// its handle size: the 16 MiB rows were the default's until 4 MiB became it.
// (The retired ranges placement had rows here too, until it was removed.)
func TestVMMPlacementsAreUnchanged(t *testing.T) {
	if testing.Short() {
		t.Skip("replays both bundled traces eight times")
	}
	for _, tc := range []struct {
		trace, conf string
		layout      arena.VMMLayout
		sum, peak   uint64
	}{
		{"gpt2", "backend:vmm", arena.VMMLayout{Handle: 16 << 20}, 0xd5c2f71a7a325a90, 25585254400},
		{"gpt2", "backend:vmm,large_cache:0", arena.VMMLayout{Handle: 16 << 20}, 0xfa12df64304278e4, 26826768384},
		{"gpt2", "backend:vmm,miss_release:false", arena.VMMLayout{Handle: 16 << 20}, 0x74da56cb871fe821, 25635586048},
		{"gpt2", "backend:vmm", arena.VMMLayout{Handle: 2 << 20}, 0x86bbe1b07c0a6a6c, 25438453760},
		{"resnet50", "backend:vmm", arena.VMMLayout{Handle: 16 << 20}, 0xa44b1aaa5a958104, 5972688896},
		{"resnet50", "backend:vmm,large_cache:0", arena.VMMLayout{Handle: 16 << 20}, 0xe155f522909f52a5, 5972688896},
		{"resnet50", "backend:vmm,miss_release:false", arena.VMMLayout{Handle: 16 << 20}, 0xad33aa4573160469, 6123683840},
		{"resnet50", "backend:vmm", arena.VMMLayout{Handle: 2 << 20}, 0xeefc91b49dba741f, 5951717376},
	} {
		t.Run(fmt.Sprintf("%s/%s/%+v", tc.trace, tc.conf, tc.layout), func(t *testing.T) {
			tr, err := replay.Open("../traces/" + tc.trace + "-train.jsonl.gz")
			require.NoError(t, err)
			dev, err := arena.NewSimVMMWith(0, 0, tc.layout)
			require.NoError(t, err)
			d := &placementHash{SimVMM: dev}
			r, err := replay.Replay(tr, d, replay.Options{Policy: "goalloc", Conf: tc.conf})
			require.NoError(t, err)
			assert.Equal(t, tc.peak, r.PeakReservedBytes)
			assert.Equal(t, fmt.Sprintf("%#x", tc.sum), fmt.Sprintf("%#x", d.sum), "the placement's addresses")
		})
	}
}
