package caching

import (
	"math"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// streamRecords is how many per-stream records (StreamFreeLists) the
// allocator keeps, in every cache pool.
func streamRecords(a *Allocator) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.allLists())
}

// Short-lived streams (one per request in some servers) leave nothing
// behind that grows with their number: the memory kept for them is bounded
// by the cache budgets, and so are the per-stream records, and with them
// the cost of the operations that look at every stream. On vmm the device
// too keeps nothing per dead stream: a stream's segment gives its VA back
// once it holds nothing, and no operation walks the segments of streams
// gone. The time of the last streams against the first says so: a cost
// that grew with the streams seen would make the last ones slower. Each
// side's time is the CPU time of the test's thread in its fastest run of
// streams: a loaded machine delays the thread, but the CPU it spends stays
// (by wall time, make test's load once made the last runs slower).
func TestManyShortLivedStreamsStayBounded(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, _ *arena.Sim) {
		const streams, timed, run = 20000, 5000, 250
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		most := 0
		// The fastest run of streams of each side.
		first, last := time.Duration(math.MaxInt64), time.Duration(math.MaxInt64)
		start := threadCPU(t)
		for i := 0; i < streams; i++ {
			if i%run == 0 { // the run [i-run, i) ends
				took := threadCPU(t) - start
				switch {
				case i > 0 && i <= timed:
					first = min(first, took)
				case i-run >= streams-timed:
					last = min(last, took)
				}
				start = threadCPU(t)
			}
			s := arena.Stream(0x1000 + i)
			small, err := a.Malloc(1000, s)
			require.NoError(t, err)
			large, err := a.Malloc(1<<20, s)
			require.NoError(t, err)
			require.NoError(t, a.Free(small, 1000, s))
			require.NoError(t, a.Free(large, 1<<20, s))
			most = max(most, streamRecords(a))
		}
		last = min(last, threadCPU(t)-start)
		t.Logf("the fastest run of %d streams, CPU time: %v among the first %d, %v among the last", run, first, timed, last)
		require.NoError(t, a.CheckInvariants())
		st := a.Stats()
		assert.Zero(t, st.AllocatedBytes[StatAll].Current)
		budget := int64(a.cfg.LargeCache + emptySegmentBudget)
		assert.LessOrEqual(t, st.ReservedBytes[StatAll].Peak, budget+int64(classSegment[1])+1<<20,
			"reserved stays within the cache budgets, whatever the number of streams")
		// Each record holds at least one cached block or empty segment.
		bound := int(a.cfg.LargeCache/(1<<20)) + int(emptySegmentBudget/uint64(classSegment[1])) + 1
		assert.LessOrEqual(t, most, bound, "per-stream records are bounded by what is cached, not by the streams seen")
		if vmm, ok := a.dev.(*arena.SimVMM); ok {
			// What the device holds is at most the streams the cache keeps
			// something for, so is the VA its segments reserve: a segment
			// per stream with memory mapped.
			_, total, err := vmm.MemInfo()
			require.NoError(t, err)
			held := uint64(st.ReservedBytes[StatAll].Current)
			segments := held/vmm.Phys().Granularity() + 1
			assert.LessOrEqual(t, vmm.Phys().ReservedVA(), segments*total,
				"VA is reserved only for streams that hold memory")
		}
		assert.Less(t, last, first*5/2, "a run of the last %d streams took %v, of the first %v", timed, last, first)
	})
}

// threadCPU is the CPU time the calling OS thread has used, in
// nanoseconds (Linux's CLOCK_THREAD_CPUTIME_ID; getrusage counts in ticks).
func threadCPU(t *testing.T) time.Duration {
	const clockThreadCPUTime = 3
	var ts syscall.Timespec
	_, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0)
	require.Zero(t, errno, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)")
	return time.Duration(ts.Nano())
}

// A stream that allocated a little and freed it keeps at most what the cache
// budgets allow, on vmm too, where memory of different streams never shares
// a physical handle: what the device holds while nothing is live is within
// large_cache plus the empty segments' budget (doc.go, retention.go).
func TestIdleStreamsHoldWithinTheCacheBudgets(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, _ *arena.Sim) {
		for i := 0; i < 200; i++ {
			s := arena.Stream(0x1000 + i)
			p, err := a.Malloc(1000, s)
			require.NoError(t, err)
			require.NoError(t, a.Free(p, 1000, s))
		}
		require.NoError(t, a.CheckInvariants())
		st := a.Stats()
		assert.Zero(t, st.AllocatedBytes[StatAll].Current)
		assert.LessOrEqual(t, st.ReservedBytes[StatAll].Current, int64(a.cfg.LargeCache+emptySegmentBudget),
			"what the device holds for idle streams is within the cache budgets")
		assert.LessOrEqual(t, st.ReservedBytes[StatAll].Peak, int64(a.cfg.LargeCache+emptySegmentBudget))
	})
}

// empty_cache forgets every stream that holds nothing live; a stream with a
// live block keeps its record until that block is freed and the cache
// emptied again. On vmm the device forgets them too: their segments' VA is
// given back, and only the segment holding the live block keeps its own.
func TestEmptyCacheDropsIdleStreams(t *testing.T) {
	simBackends(t, DefaultConfig(), func(t *testing.T, a *Allocator, _ *arena.Sim) {
		reservedVA := func() uint64 {
			if vmm, ok := a.dev.(*arena.SimVMM); ok {
				return vmm.Phys().ReservedVA()
			}
			return 0
		}
		_, total, err := a.dev.MemInfo()
		require.NoError(t, err)
		for i := 0; i < 100; i++ {
			s := arena.Stream(0x1000 + i)
			p, err := a.Malloc(1000, s)
			require.NoError(t, err)
			require.NoError(t, a.Free(p, 1000, s))
		}
		live, err := a.Malloc(1<<20, 0x99)
		require.NoError(t, err)
		require.Greater(t, streamRecords(a), 1)
		require.NoError(t, a.EmptyCache())
		assert.Equal(t, 1, streamRecords(a), "only the stream with a live block is kept")
		assert.LessOrEqual(t, reservedVA(), total, "and, on vmm, only its segment")
		require.NoError(t, a.CheckInvariants())
		require.NoError(t, a.Free(live, 1<<20, 0x99))
		require.NoError(t, a.EmptyCache())
		assert.Zero(t, streamRecords(a))
		assert.Zero(t, a.Stats().ReservedBytes[StatAll].Current)
		assert.Zero(t, reservedVA(), "no segment is left")
		// And the allocator works as before on a stream it forgot.
		p, err := a.Malloc(1000, 0x1000)
		require.NoError(t, err)
		require.NoError(t, a.Free(p, 1000, 0x1000))
		require.NoError(t, a.CheckInvariants())
	})
}
