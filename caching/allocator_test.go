package caching

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newTestAllocator(t testing.TB, cfg Config) (*Allocator, *arena.Sim) {
	sim := arena.NewSim(0, 16<<30)
	a, err := New(sim, cfg)
	require.NoError(t, err)
	return a, sim
}

func TestSizeClassTable(t *testing.T) {
	for i, c := range classSize {
		require.Zero(t, c%classAlign, "class %d", i)
		if i > 0 {
			require.Greater(t, c, classSize[i-1])
		}
	}
	require.EqualValues(t, smallMax, classSize[numSmallClasses-1])
	for n := uint64(1); n <= smallMax; n++ {
		c := sizeToClass[(n+classAlign-1)/classAlign]
		require.GreaterOrEqual(t, uint64(classSize[c]), n, "n=%d", n)
		if c > 0 {
			require.Less(t, uint64(classSize[c-1]), n, "n=%d is not in its smallest class", n)
		}
		if n > 4*classAlign {
			waste := float64(uint64(classSize[c])-n) / float64(classSize[c])
			require.Less(t, waste, 0.25, "n=%d wastes %.3f", n, waste)
		}
	}
}

func TestSmallAllocationStats(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	p1, err := a.Malloc(100, 0)
	require.NoError(t, err)
	p2, err := a.Malloc(600, 0)
	require.NoError(t, err)
	require.NotEqual(t, p1, p2)
	st := a.Stats()
	assert.EqualValues(t, 512+1024, st.AllocatedBytes[StatSmall].Current)
	assert.EqualValues(t, 700, st.RequestedBytes[StatAll].Current)
	assert.EqualValues(t, 2, st.Allocation[StatAll].Current)
	assert.EqualValues(t, classSegment[0]+classSegment[1], st.ReservedBytes[StatSmall].Current, "one segment per class")
	assert.EqualValues(t, 2, st.Segment[StatAll].Current)
	assert.EqualValues(t, 2, sim.Allocs)
	reads := sim.UsageReads
	require.NoError(t, a.Free(p1, 100, 0))
	p3, err := a.Malloc(200, 0)
	require.NoError(t, err)
	assert.Equal(t, p1, p3, "a freed slot is reused by its stream at once")
	assert.EqualValues(t, 2, sim.Allocs, "a cache hit calls no driver")
	assert.Equal(t, reads, sim.UsageReads, "nor reads the pool's figures")
	st = a.Stats()
	assert.EqualValues(t, 2, st.CacheMisses)
	assert.EqualValues(t, 1, st.CacheHits)
	assert.EqualValues(t, 512+1024, st.AllocatedBytes[StatAll].Current)
	assert.EqualValues(t, 2*512+1024, st.AllocatedBytes[StatAll].Allocated)
	assert.EqualValues(t, 512, st.AllocatedBytes[StatAll].Freed)
	require.NoError(t, a.CheckInvariants())
}

func TestLargeCacheExactAndSlack(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeSlack = 1.0 / 16
	cfg.MissRelease = false // see TestMissReleaseFeedsThePool
	a, sim := newTestAllocator(t, cfg)
	p, err := a.Malloc(16<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 16<<20, 0))
	q, err := a.Malloc(16<<20-100, 0)
	require.NoError(t, err)
	assert.Equal(t, p, q, "within slack, the cached block serves")
	require.NoError(t, a.Free(q, 16<<20-100, 0))
	r, err := a.Malloc(14<<20, 0)
	require.NoError(t, err)
	assert.NotEqual(t, p, r, "a block 14%% too large is not used for the request")
	assert.EqualValues(t, 2, sim.Allocs)
	s, err := a.Malloc(16<<20, 0x1000)
	require.NoError(t, err)
	assert.NotEqual(t, p, s, "another stream does not take the owner's cached block")
	require.NoError(t, a.CheckInvariants())
}

func TestMissReleaseFeedsThePool(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	p, err := a.Malloc(40<<20, 0)
	require.NoError(t, err)
	q, err := a.Malloc(10<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 40<<20, 0))
	require.NoError(t, a.Free(q, 10<<20, 0))
	before, _ := sim.PoolUsage()
	// A 30 MiB miss: the smallest cached block that holds it (40 MiB) goes
	// back to the pool, which reuses it in place instead of growing.
	r, err := a.Malloc(30<<20, 0)
	require.NoError(t, err)
	assert.Equal(t, p, r)
	after, _ := sim.PoolUsage()
	assert.Equal(t, before.ReservedCurrent, after.ReservedCurrent, "the pool did not grow")
	assert.EqualValues(t, 10<<20, a.cachedLarge, "the 10 MiB block stays cached")
	require.NoError(t, a.CheckInvariants())
}

func TestLargeCacheBudgetReleasesOldest(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 4 << 20
	a, sim := newTestAllocator(t, cfg)
	var ps []uintptr
	for i := 0; i < 3; i++ {
		p, err := a.Malloc(uint64(1+i)<<20+512, 0)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	for i, p := range ps {
		require.NoError(t, a.Free(p, uint64(1+i)<<20+512, 0))
	}
	// All three are over 4 MiB: the two oldest go back to the pool.
	assert.LessOrEqual(t, a.cachedLarge, uint64(4<<20))
	assert.EqualValues(t, 2, sim.Frees)
	p, err := a.Malloc(3<<20+512, 0)
	require.NoError(t, err)
	assert.Equal(t, ps[2], p, "the newest stays cached")
	require.NoError(t, a.CheckInvariants())
}

func TestHitPathAllocatesNothing(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	for _, size := range []uint64{1, 4096, smallMax, smallMax + 1, 64 << 20} {
		p, err := a.Malloc(size, 7)
		require.NoError(t, err)
		require.NoError(t, a.Free(p, size, 7))
		allocs := testing.AllocsPerRun(1000, func() {
			p, _ := a.Malloc(size, 7)
			_ = a.Free(p, size, 7)
		})
		assert.Zero(t, allocs, "size %d: a cache-hit pair allocates on the Go heap", size)
	}
}

func TestRecordStreamDefersFree(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	sim.SetManual(true)
	const A, B = arena.Stream(0x10), arena.Stream(0x20)
	for _, size := range []uint64{4000, 8 << 20} {
		p, err := a.Malloc(size, A)
		require.NoError(t, err)
		require.NoError(t, a.RecordStream(p, B))
		require.NoError(t, a.RecordStream(p, A), "recording the owner is a no-op")
		sim.Launch(B) // B reads the tensor
		require.NoError(t, a.Free(p, size, A))
		assert.Nil(t, a.recorded, "nothing recorded is left: the next free reads no map")
		st := a.Stats()
		assert.EqualValues(t, 1, st.Active[StatAll].Current, "a pending block stays active")
		assert.Zero(t, st.Allocation[StatAll].Current)
		q, err := a.Malloc(size, A)
		require.NoError(t, err)
		assert.NotEqual(t, p, q, "B has not finished: the block must wait")
		sim.Complete(B)
		require.NoError(t, a.Free(q, size, A))
		r, err := a.Malloc(size, A)
		require.NoError(t, err)
		require.Contains(t, []uintptr{p, q}, r)
		require.NoError(t, a.Free(r, size, A))
		require.NoError(t, a.CheckInvariants())
		st = a.Stats()
		assert.Zero(t, st.Active[StatAll].Current, "the deferred free completed once B did")
	}
	assert.EqualValues(t, 2, a.Stats().DeferredFrees)
	assert.Zero(t, a.events.InUse(), "events go back to the pool")
}

func TestCapOOMAndRecovery(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	require.NoError(t, a.SetLimit(100<<20))
	p, err := a.Malloc(60<<20, 0)
	require.NoError(t, err)
	_, err = a.Malloc(60<<20, 0)
	var oom *OOMError
	require.ErrorAs(t, err, &oom)
	assert.True(t, errors.Is(err, arena.ErrOutOfMemory))
	assert.EqualValues(t, 60<<20, oom.Requested)
	assert.EqualValues(t, 100<<20, oom.Limit)
	assert.EqualValues(t, 64<<20, oom.Reserved, "what the pool holds: two 32 MiB chunks")
	for _, want := range []string{"CUDA out of memory. Tried to allocate 60.00 MiB. GPU 0 has a total capacity of 16.00 GiB of which",
		"cap 100.00 MiB", "reserved 64.00 MiB", "allocated 60.00 MiB", "largest free cached block"} {
		assert.Contains(t, err.Error(), want)
	}
	assert.EqualValues(t, 1, a.Stats().NumOOMs)
	// Freeing makes room: the cached block is released to fit another size.
	require.NoError(t, a.Free(p, 60<<20, 0))
	q, err := a.Malloc(70<<20, 0)
	require.NoError(t, err, "cached memory must be reclaimed before declaring an OOM")
	assert.GreaterOrEqual(t, a.Stats().NumAllocRetries, int64(1))
	assert.LessOrEqual(t, a.reserved(), uint64(100<<20))
	require.NoError(t, a.Free(q, 70<<20, 0))
	require.NoError(t, a.CheckInvariants())
}

func TestLoweringCapReleasesCache(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	p, err := a.Malloc(200<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 200<<20, 0))
	require.EqualValues(t, 200<<20, a.reserved(), "cached")
	require.NoError(t, a.SetFraction(float64(100<<20)/float64(a.Total())))
	assert.Zero(t, a.reserved(), "lowering the cap releases cached memory")
	u, _ := sim.PoolUsage()
	assert.Zero(t, u.ReservedCurrent, "and trims the pool")
	for _, f := range []float64{-1, 1.5, math.NaN(), math.Inf(1), math.Inf(-1), -0.1} {
		err := a.SetFraction(f)
		var ie *InputError
		require.ErrorAs(t, err, &ie, "fraction %v", f)
		assert.Equal(t, "invalid_fraction", ie.Kind)
	}
	assert.EqualValues(t, 6, a.Stats().BadInput["invalid_fraction"])
}

func TestRequestLargerThanDeviceFailsFast(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	_, err := a.Malloc(a.Total()+1, 0)
	var oom *OOMError
	require.ErrorAs(t, err, &oom)
	assert.Zero(t, sim.Syncs, "no synchronisation can make it fit")
	// Beyond any device, PyTorch's words: out of memory, up to 2^63.
	_, err = a.Malloc(MaxRequest+1, 0)
	require.ErrorAs(t, err, &oom)
	assert.Contains(t, err.Error(), "CUDA out of memory. Tried to allocate 262144.00 GiB. GPU 0 has a total capacity of 16.00 GiB")
	_, err = a.Malloc(1<<60+1, 0)
	require.ErrorAs(t, err, &oom)
	assert.Contains(t, err.Error(), "CUDA out of memory. Tried to allocate more than 1EB memory.")
	_, err = a.MallocIn(PoolID{}, 1<<62, 0)
	require.ErrorAs(t, err, &oom, "the same through MallocIn")
	assert.Zero(t, sim.Syncs, "no synchronisation can make them fit")
	// From 2^63 a size_t is a negative ssize_t: bad input.
	_, err = a.Malloc(1<<63, 0)
	var ie *InputError
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, "invalid_size", ie.Kind)
}

// TestBadInputMatrix: every kind of bad call gets its error kind and
// counter, and the allocator keeps serving correct blocks afterwards.
func TestBadInputMatrix(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	small, err := a.Malloc(1000, 0)
	require.NoError(t, err)
	large, err := a.Malloc(1<<20, 0)
	require.NoError(t, err)
	freed, err := a.Malloc(2000, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(freed, 2000, 0))
	rows := []struct {
		name string
		call func() error
		kind string
	}{
		{"null", func() error { return a.Free(0, 0, 0) }, "null_pointer"},
		{"unknown", func() error { return a.Free(0xdead000, 512, 0) }, "unknown_pointer"},
		{"misaligned into a segment", func() error { return a.Free(small+8, 1000, 0) }, "unknown_pointer"},
		{"interior of a large block", func() error { return a.Free(large+4096, 1<<20, 0) }, "unknown_pointer"},
		{"double free small", func() error { return a.Free(freed, 2000, 0) }, "double_free"},
		{"record_stream unknown", func() error { return a.RecordStream(0xdead000, 5) }, "unknown_pointer"},
		{"record_stream freed", func() error { return a.RecordStream(freed, 5) }, "record_stream_not_live"},
		{"size too large", func() error { _, err := a.Malloc(1<<63, 0); return err }, "invalid_size"},
	}
	for _, r := range rows {
		err := r.call()
		var ie *InputError
		require.ErrorAs(t, err, &ie, r.name)
		assert.Equal(t, r.kind, ie.Kind, r.name)
		assert.True(t, strings.HasPrefix(err.Error(), "goalloc: "), r.name)
		require.NoError(t, a.CheckInvariants(), r.name)
	}
	// Wrong size and wrong stream: reported, and freed by pointer all the same.
	err = a.Free(large, 12345, 0)
	var ie *InputError
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, "size_mismatch", ie.Kind)
	err = a.Free(small, 1000, 0x99)
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, "stream_mismatch", ie.Kind)
	assert.Zero(t, a.Stats().Allocation[StatAll].Current)
	err = a.Free(large, 1<<20, 0)
	require.ErrorAs(t, err, &ie)
	assert.Equal(t, "double_free", ie.Kind)

	st := a.Stats()
	assert.EqualValues(t, 4, st.BadInput["unknown_pointer"])
	assert.EqualValues(t, 1, st.BadInput["null_pointer"])
	assert.EqualValues(t, 2, st.BadInput["double_free"])
	// Still correct: fresh blocks, no overlap.
	m := &model{t: t, a: a, sim: a.dev.(*arena.Sim), live: map[uintptr]*liveBlock{}, pos: map[arena.Stream]uint64{}, done: map[arena.Stream]uint64{}, stalled: map[arena.Stream]bool{}}
	for _, n := range []uint64{1000, 1000, 1 << 20, 1 << 20, 0} {
		_, err := m.malloc(n, 0)
		require.NoError(t, err)
	}
	require.NoError(t, a.CheckInvariants())
}

func TestEmptyCacheKeepsPrewarmedReserve(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Reserve = 0.25
	a, sim := newTestAllocator(t, cfg)
	u, _ := sim.PoolUsage()
	require.EqualValues(t, 4<<30, u.ReservedCurrent, "a quarter of 16 GiB pre-warmed")
	p, err := a.Malloc(1<<30, 0)
	require.NoError(t, err)
	u, _ = sim.PoolUsage()
	assert.EqualValues(t, 4<<30, u.ReservedCurrent, "served from the pre-warmed memory")
	require.NoError(t, a.Free(p, 1<<30, 0))
	require.NoError(t, a.EmptyCache())
	assert.Zero(t, a.reserved())
	u, _ = sim.PoolUsage()
	assert.EqualValues(t, 4<<30, u.ReservedCurrent, "empty_cache trims down to the reserve, not below")
}

func TestConcurrentGoroutines(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	var wg sync.WaitGroup
	const workers = 8
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			s := arena.Stream(w % 3) // streams shared between goroutines
			type held struct {
				p    uintptr
				size uint64
			}
			var live []held
			for i := 0; i < 3000; i++ {
				if len(live) > 0 && rng.IntN(2) == 0 {
					k := rng.IntN(len(live))
					assert.NoError(t, a.Free(live[k].p, live[k].size, s))
					live = append(live[:k], live[k+1:]...)
					continue
				}
				size := 1 + rng.Uint64N(4<<20)
				p, err := a.Malloc(size, s)
				if !assert.NoError(t, err) {
					return
				}
				live = append(live, held{p, size})
				if i%500 == 0 {
					assert.NoError(t, a.CheckInvariants())
				}
			}
			for _, h := range live {
				assert.NoError(t, a.Free(h.p, h.size, s))
			}
		}(w)
	}
	wg.Wait()
	require.NoError(t, a.CheckInvariants())
	assert.Zero(t, a.Stats().Allocation[StatAll].Current)
}

func TestParseConfig(t *testing.T) {
	c, err := ParseConfig("fraction:0.5, reserve:0.1,release_threshold:2G,large_cache:256M,miss_release:false,large_slack:0.125,quiet:true")
	require.NoError(t, err)
	assert.Equal(t, 0.5, c.Fraction)
	assert.Equal(t, 0.1, c.Reserve)
	assert.EqualValues(t, 2<<30, c.ReleaseThreshold)
	assert.EqualValues(t, 256<<20, c.LargeCache)
	assert.Equal(t, 0.125, c.LargeSlack)
	assert.True(t, c.Quiet)
	again, err := ParseConfig(c.String())
	require.NoError(t, err)
	assert.Equal(t, c, again, "String round-trips")
	c, err = ParseConfig("")
	require.NoError(t, err)
	assert.Equal(t, DefaultConfig(), c)
	// large_cache's default follows the backend: the stream-ordered pool
	// caches for itself (largeCacheDefault); given, it is kept on both.
	for _, tc := range []struct {
		conf string
		want uint64
	}{
		{"backend:vmm", 256 << 20},
		{"backend:async", 0},
		{"backend:async,large_cache:64M", 64 << 20},
		{"large_cache:64M,backend:async", 64 << 20},
		{"backend:vmm,large_cache:0", 0},
		{"", 256 << 20}, // no cap: fraction left out of String, as 0 is refused
		{"front:false,fraction:0.5", 256 << 20},
		{"yield_every:0", 256 << 20},
		{"yield_every:2500us", 256 << 20},
	} {
		c, err = ParseConfig(tc.conf)
		require.NoError(t, err, tc.conf)
		assert.EqualValues(t, tc.want, c.LargeCache, tc.conf)
		again, err := ParseConfig(c.String())
		require.NoError(t, err, tc.conf)
		assert.Equal(t, c, again, "%s: String round-trips", tc.conf)
	}
	for _, bad := range []struct{ conf, want string }{
		{"bogus:1", `unknown key "bogus"`},
		{"fraction", "not key:value"},
		{"fraction:0", "0 would refuse every allocation"},
		{"fraction:1.5", "outside [0, 1]"},
		{"fraction:nan", "not a number"},
		{"reserve:1", "outside [0, 1)"},
		{"release_threshold:lots", "not a byte size"},
		{"large_cache:-5M", "not a byte size"},
		{"quiet:maybe", "quiet"},
		{"fraction:0.5,fraction:0.6", "given twice"},
		{"yield_every:10ms", "outside [0, 10ms)"},
		{"yield_every:-1ms", "outside [0, 10ms)"},
		{"yield_every:often", "not a duration"},
	} {
		_, err := ParseConfig(bad.conf)
		require.Error(t, err, bad.conf)
		assert.Contains(t, err.Error(), bad.want, bad.conf)
		assert.Contains(t, err.Error(), "GOALLOC_CONF", bad.conf)
	}
}

func TestSnapshotMatchesStats(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	a.RecordHistory(100)
	p, _ := a.Malloc(3000, 0)
	q, _ := a.Malloc(5<<20, 0)
	r, _ := a.Malloc(100, 0)
	require.NoError(t, a.Free(r, 100, 0))
	snap := a.Snapshot()
	var total, allocated, requested uint64
	for _, seg := range snap.Segments {
		total += seg.TotalSize
		allocated += seg.AllocatedSize
		requested += seg.RequestedSize
		var sum uint64
		for _, b := range seg.Blocks {
			sum += b.Size
		}
		assert.Equal(t, seg.TotalSize, sum, "blocks tile the segment %#x", seg.Address)
	}
	st := a.Stats()
	assert.EqualValues(t, st.OwnReserved.Current, total)
	assert.EqualValues(t, st.AllocatedBytes[StatAll].Current, allocated)
	assert.EqualValues(t, 3000+5<<20, requested)
	var actions []string
	for _, e := range snap.Trace {
		actions = append(actions, e.Action)
	}
	assert.Equal(t, []string{"segment_alloc", "alloc", "segment_alloc", "alloc", "segment_alloc", "alloc", "free_requested", "free_completed"}, actions)
	_, _ = p, q
}

// An inactive block reports the size last requested in it, as PyTorch's
// allocator does (its merged free block keeps the requested size of the
// block freed last): the snapshot of a freed allocation still names its
// size, which torch's own test of memory plots looks for once the trace's
// alloc-free pairs are filtered out.
func TestSnapshotInactiveBlocksKeepTheLastRequest(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	x, err := a.Malloc(65536, 0) // a small slot
	require.NoError(t, err)
	var tmp []uintptr
	for i := 0; i < 3; i++ {
		p, err := a.Malloc(60000, 0)
		require.NoError(t, err)
		tmp = append(tmp, p)
	}
	for _, p := range tmp {
		require.NoError(t, a.Free(p, 60000, 0))
	}
	require.NoError(t, a.Free(x, 65536, 0)) // freed last
	big, err := a.Malloc(3<<20+1000, 0)     // a large block
	require.NoError(t, err)
	require.NoError(t, a.Free(big, 3<<20+1000, 0))

	var small, large []SnapshotBlock
	for _, seg := range a.Snapshot().Segments {
		for _, b := range seg.Blocks {
			require.Equal(t, "inactive", b.State)
			if seg.SegmentType == "small" {
				small = append(small, b)
			} else {
				large = append(large, b)
			}
		}
		assert.Zero(t, seg.RequestedSize, "a segment counts only its active blocks' requests")
	}
	require.Len(t, small, 1, "the free slots are one inactive block")
	assert.EqualValues(t, 65536, small[0].RequestedSize, "the slot freed last")
	require.Len(t, large, 1)
	assert.EqualValues(t, 3<<20+1000, large[0].RequestedSize)
}

// A cap is a cap: a fraction of 0, as torch.cuda.set_per_process_memory_fraction
// takes it, or one so small that fraction x device rounds to 0 bytes, must
// not turn into a limit of 0, which means "no cap".
func TestFractionZeroRefusesEverything(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, _ *arena.Sim) {
		p, err := a.Malloc(3<<20, 0)
		require.NoError(t, err)
		require.NoError(t, a.SetFraction(0))
		var oom *OOMError
		for _, n := range []uint64{1, 4096, 3 << 20, 1 << 30} {
			_, err = a.Malloc(n, 1)
			require.ErrorAs(t, err, &oom, "%d bytes under a fraction of 0", n)
		}
		require.NoError(t, a.Free(p, 3<<20, 0), "what was live before is freed as usual")
		require.NoError(t, a.SetFraction(1))
		q, err := a.Malloc(1<<30, 1)
		require.NoError(t, err, "a fraction of 1 lifts it")
		require.NoError(t, a.Free(q, 1<<30, 1))
		require.NoError(t, a.CheckInvariants())
	})
}

func TestTinyFractionIsStillACap(t *testing.T) {
	for _, f := range []float64{1e-12, 1e-11, 5e-324} {
		a, _ := newTestAllocator(t, DefaultConfig())
		require.NoError(t, a.SetFraction(f))
		_, err := a.Malloc(1<<30, 0)
		var oom *OOMError
		require.ErrorAs(t, err, &oom, "fraction %v set by SetFraction", f)
		_, err = a.Malloc(1, 0)
		require.ErrorAs(t, err, &oom, "the smallest cap refuses everything above it")

		cfg := DefaultConfig()
		cfg.Fraction = f
		b, _ := newTestAllocator(t, cfg)
		_, err = b.Malloc(1<<30, 0)
		require.ErrorAs(t, err, &oom, "fraction %v from the configuration", f)
	}
}

// A reserve above the cap can never be pre-warmed: the configuration is
// refused, naming both keys, instead of every allocation failing silently.
func TestReserveAboveFractionIsRefused(t *testing.T) {
	_, err := ParseConfig("reserve:0.5,fraction:0.25")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "reserve")
	assert.Contains(t, err.Error(), "fraction")
	c, err := ParseConfig("fraction:0.25,reserve:0.25")
	require.NoError(t, err, "a reserve equal to the cap is fine")
	a, _ := newTestAllocator(t, c)
	p, err := a.Malloc(1<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 1<<20, 0))
}

// Free looks where the size says first (a slot for a small size, a block
// for a large one), but the pointer decides: a size on the wrong side of
// smallMax still frees the block it names.
func TestFreeFindsItsBlockWhateverSideTheSizeIsOn(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	small, err := a.Malloc(1000, 0x10)
	require.NoError(t, err)
	large, err := a.Malloc(4<<20, 0x10)
	require.NoError(t, err)
	for _, c := range []struct {
		p    uintptr
		size uint64
	}{{small, 4 << 20}, {large, 1000}} {
		err := a.Free(c.p, c.size, 0x10)
		var ie *InputError
		require.ErrorAs(t, err, &ie, "%#x freed with %d bytes", c.p, c.size)
		assert.Equal(t, "size_mismatch", ie.Kind)
		require.NoError(t, a.CheckInvariants())
	}
	st := a.Stats()
	assert.Zero(t, st.Allocation[StatAll].Current, "both freed by pointer")
	assert.Zero(t, st.BadInput["unknown_pointer"])
}

// A free with a wrong size and a wrong stream is two mistakes: each kind is
// counted, and the block is freed by pointer all the same (a warning, not
// a refusal).
func TestFreeWithWrongSizeAndStreamCountsBoth(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	for _, size := range []uint64{1000, 1 << 20} {
		p, err := a.Malloc(size, 0x10)
		require.NoError(t, err)
		err = a.Free(p, size+1, 0x20)
		require.Error(t, err)
		var kinds []string
		for _, ie := range InputErrors(err) {
			kinds = append(kinds, ie.Kind)
			assert.True(t, ie.Handled, "freed by pointer: a warning")
		}
		assert.Equal(t, []string{"size_mismatch", "stream_mismatch"}, kinds)
	}
	st := a.Stats()
	assert.EqualValues(t, 2, st.BadInput["size_mismatch"])
	assert.EqualValues(t, 2, st.BadInput["stream_mismatch"])
	assert.Zero(t, st.Allocation[StatAll].Current)
	require.NoError(t, a.CheckInvariants())
}

// A miss that gives a cached block back and then takes new memory reaches
// the device twice, and reads what the device holds once, when the figure
// is next read; the figure and its peak are still the device's own.
func TestAMissReadsWhatTheDeviceHoldsOnce(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	big, err := a.Malloc(8<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(big, 8<<20, 0)) // cached
	allocs, frees, reads := sim.Allocs, sim.Frees, sim.UsageReads
	p, err := a.Malloc(4<<20, 0) // too small for the cached block: a miss that releases it
	require.NoError(t, err)
	assert.Equal(t, allocs+1, sim.Allocs)
	assert.Equal(t, frees+1, sim.Frees, "the miss gave the cached block back")
	assert.Equal(t, reads+1, sim.UsageReads, "and read the device's figure once")
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, u.ReservedCurrent, a.Scalar(ScalarReservedBytes), "memory_reserved() is the device's figure")
	assert.EqualValues(t, u.ReservedHigh, a.Scalar(ScalarReservedBytesPeak))
	st := a.Stats()
	assert.EqualValues(t, u.ReservedCurrent, st.ReservedBytes[StatAll].Current)
	assert.EqualValues(t, u.ReservedHigh, st.ReservedBytes[StatAll].Peak)
	reads = sim.UsageReads
	q, err := a.Malloc(4<<20, 0) // a miss of a fresh block, nothing to give back
	require.NoError(t, err)
	assert.Equal(t, reads+1, sim.UsageReads)
	reads = sim.UsageReads
	_ = a.Stats() // nothing reached the device since: no read
	assert.Equal(t, reads, sim.UsageReads)
	require.NoError(t, a.Free(p, 4<<20, 0))
	require.NoError(t, a.Free(q, 4<<20, 0))
	require.NoError(t, a.CheckInvariants())
}

// A block freed while another stream used it (record_stream) is the owner's
// again as soon as that stream's work is done: the next allocation of its
// size on the owner gets it back, as under PyTorch's allocator
// (test_cuda.py's test_record_stream), even when the cache would serve the
// request without a miss.
func TestRecordedFreeIsReusedOnceComplete(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, sim *arena.Sim) {
		const A, B = arena.Stream(0xa0), arena.Stream(0xb0)
		sim.SetManual(true)
		for _, size := range []uint64{16, 1 << 20} {
			p, err := a.Malloc(size, A)
			require.NoError(t, err)
			require.NoError(t, a.RecordStream(p, B))
			sim.Launch(B) // B reads p
			require.NoError(t, a.Free(p, size, A))
			q, err := a.Malloc(size, A)
			require.NoError(t, err)
			assert.NotEqual(t, p, q, "reused while B may still read it")
			sim.Complete(B)
			r, err := a.Malloc(size, A)
			require.NoError(t, err)
			assert.Equal(t, p, r, "size %d: the block comes back once B is done", size)
			require.NoError(t, a.Free(q, size, A))
			require.NoError(t, a.Free(r, size, A))
		}
		require.NoError(t, a.CheckInvariants())
	})
}
