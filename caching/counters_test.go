package caching

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// requirePublishedEqualsStats checks every published figure against the
// same key of Stats().Map(), the figures memory_stats() reports.
func requirePublishedEqualsStats(t testing.TB, a *Allocator, msg string) {
	t.Helper()
	st := a.Stats()
	m := st.Map()
	out := make([]int64, NumScalars)
	require.Equal(t, int(NumScalars), a.Scalars(out))
	for k, key := range ScalarKeys() {
		want, ok := m[key]
		require.True(t, ok, "%s: published key %q is not a memory_stats key", msg, key)
		require.Equal(t, want, a.Scalar(Scalar(k)), "%s: %s", msg, key)
		require.Equal(t, want, out[k], "%s: %s from Scalars", msg, key)
	}
}

// The published figures never drift from memory_stats(): after every step
// of the property test's random operations (mallocs of every size class on
// four streams, frees, record_stream, stream progress, empty_cache, moving
// caps and the OOMs they cause), and the resets.
func TestPublishedScalarsEqualStatsAfterRandomOps(t *testing.T) {
	modelSeeds(t, 11, 14, 3000, func(t *testing.T, seed uint64, cfg Config, steps int) {
		m := newModel(t, seed, cfg, 8<<30)
		requirePublishedEqualsStats(t, m.a, "new allocator")
		for i := 0; i < steps; i++ {
			switch m.rng.IntN(50) {
			case 0:
				m.resetPeak()
			case 1:
				m.a.ResetAccumulatedStats()
			default:
				m.step()
			}
			requirePublishedEqualsStats(t, m.a, fmt.Sprintf("op %d", m.ops))
		}
		m.drain()
		requirePublishedEqualsStats(t, m.a, "drained")
	})
}

func TestResetPeakStatsResetsPublishedPeaks(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	p, err := a.Malloc(64<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 64<<20, 0))
	require.EqualValues(t, 64<<20, a.Scalar(ScalarAllocatedBytesPeak))
	require.Zero(t, a.Scalar(ScalarAllocatedBytes))
	require.NoError(t, a.ResetPeakStats())
	require.Zero(t, a.Scalar(ScalarAllocatedBytesPeak))
	// The freed block stays cached: reserved and its peak stay.
	require.EqualValues(t, 64<<20, a.Scalar(ScalarReservedBytesPeak))
	require.NoError(t, a.EmptyCache())
	require.Zero(t, a.Scalar(ScalarReservedBytes))
	require.EqualValues(t, 64<<20, a.Scalar(ScalarReservedBytesPeak))
	require.NoError(t, a.ResetPeakStats())
	require.Zero(t, a.Scalar(ScalarReservedBytesPeak))
}

// A reader never waits for the allocator's mutex: here another goroutine
// holds it (as a slow call, an empty_cache or a device synchronisation,
// would) while the figures are read.
func TestScalarsAreReadWithoutTheMutex(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	p, err := a.Malloc(3<<20, 0)
	require.NoError(t, err)

	held, release := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		a.mu.Lock()
		close(held)
		<-release
		a.mu.Unlock()
	}()
	<-held
	read := make(chan []int64)
	go func() {
		out := make([]int64, NumScalars)
		a.Scalars(out)
		read <- append(out, a.Scalar(ScalarAllocatedBytes))
	}()
	select {
	case got := <-read:
		// Reserved is what the pool holds: the 32 MiB chunk the block lies in.
		require.Equal(t, []int64{3 << 20, 3 << 20, 32 << 20, 32 << 20, 3 << 20}, got)
	case <-time.After(5 * time.Second):
		t.Fatal("reading a published figure waited for the allocator's mutex")
	}
	close(release)
	wg.Wait()
	require.NoError(t, a.Free(p, 3<<20, 0))
	require.Zero(t, a.Scalar(ScalarAllocatedBytes))
}

// Readers race with writers (under -race: no unsynchronised access), and
// the figures are exact once the writers stop.
func TestScalarsUnderConcurrentUse(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				size := uint64(1+i%7) << 20
				p, err := a.Malloc(size, 0)
				if err == nil {
					_ = a.Free(p, size, 0)
				}
				if i%1000 == 0 {
					_ = a.ResetPeakStats()
				}
			}
		}()
	}
	out := make([]int64, NumScalars)
	for i := 0; i < 20000; i++ {
		a.Scalars(out)
		for _, v := range out {
			require.GreaterOrEqual(t, v, int64(0))
		}
	}
	close(stop)
	wg.Wait()
	requirePublishedEqualsStats(t, a, "after concurrent use")
}

// The published figures cost the cache hit no Go allocation.
func TestPublishingAllocatesNothing(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	p, _ := a.Malloc(1<<20, 0)
	_ = a.Free(p, 1<<20, 0)
	allocs := testing.AllocsPerRun(100, func() {
		p, _ := a.Malloc(1<<20, 0)
		_ = a.Free(p, 1<<20, 0)
		_ = a.Scalar(ScalarAllocatedBytes)
	})
	require.Zero(t, allocs)
}

// The misses' device calls are timed: one timing per device allocation,
// none for a hit, the percentiles in order, all zero after a reset.
func TestDeviceAllocLatencyStats(t *testing.T) {
	a, _ := newTestAllocator(t, DefaultConfig())
	p, err := a.Malloc(8<<20, 0) // a miss
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 8<<20, 0))
	p, err = a.Malloc(8<<20, 0) // a hit
	require.NoError(t, err)
	q, err := a.Malloc(100, 0) // a small segment: a miss
	require.NoError(t, err)
	st := a.Stats()
	m := st.Map()
	require.Equal(t, m["num_device_alloc"], m["goalloc.device_alloc_ns.count"])
	require.Equal(t, int64(2), m["goalloc.device_alloc_ns.count"])
	require.LessOrEqual(t, m["goalloc.device_alloc_ns.p50"], m["goalloc.device_alloc_ns.p99"])
	require.LessOrEqual(t, m["goalloc.device_alloc_ns.p99"], m["goalloc.device_alloc_ns.max"])
	require.Positive(t, m["goalloc.device_alloc_ns.max"])
	a.ResetAccumulatedStats()
	st = a.Stats()
	m = st.Map()
	for _, k := range []string{"count", "p50", "p99", "max"} {
		require.Zero(t, m["goalloc.device_alloc_ns."+k], k)
	}
	require.NoError(t, a.Free(p, 8<<20, 0))
	require.NoError(t, a.Free(q, 100, 0))
}
