package caching

import (
	"sync"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

// The property test's random operations with every request and free going
// through the front first, and the checks every seventh step only, so that
// pending and recycled entries pile up between drains: no overlap, no
// memory reaching a stream early, statistics equal to the live blocks
// (requested bytes' peak too), CheckInvariants, and nothing lost at the end.
func TestPropertyRandomOpsThroughFront(t *testing.T) {
	modelSeeds(t, 31, 36, 4000, func(t *testing.T, seed uint64, cfg Config, steps int) {
		m := newModel(t, seed, cfg, 8<<30)
		m.front = NewFrontEmulator()
		for i := 0; i < steps; i++ {
			m.step()
			if i%7 == 0 {
				m.check()
			}
		}
		m.drain()
		require.Zero(t, m.a.Pending())
		require.NotZero(t, m.front.Recycled)
		st := m.a.Stats()
		require.Equal(t, int64(m.front.Given), st.FrontFrees, "every free written to the log was applied once")
		require.Equal(t, int64(m.front.Recycled), st.FrontRecycled)
		t.Logf("seed %d: %d frees through the front, %d of them handed out again", seed, m.front.Given, m.front.Recycled)
	})
}

// A recycled pair crosses into Go only at the drain, and counts there as
// a free and a cache hit of the same block: every figure, current,
// peak and cumulative, equals those of an allocator that saw the free and
// then the request, for a large block and for a small segment's only slot
// and one of several.
func TestFrontRecycledPairCountsAsFreeAndHit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		sizes  []uint64 // allocated first; the last is freed and requested again
		stream arena.Stream
	}{
		{"large", []uint64{3 << 20}, 0},
		{"small, the segment's only slot", []uint64{4096}, 0x10},
		{"small, one slot of several", []uint64{4096, 4096, 4000}, 0x10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(front bool) (Stats, uintptr, uintptr) {
				a, err := New(arena.NewSim(0, 0), DefaultConfig())
				require.NoError(t, err)
				f := NewFrontEmulator()
				var p uintptr
				for _, size := range tc.sizes {
					p, err = a.Malloc(size, tc.stream)
					require.NoError(t, err)
					f.track(a, p, size, tc.stream)
				}
				size := tc.sizes[len(tc.sizes)-1]
				var q uintptr
				if front {
					require.True(t, f.give(a, p))
					q = f.take(a, size, tc.stream)
					require.Equal(t, 1, a.Pending(), "the pair waits in the log")
				} else {
					require.NoError(t, a.Free(p, size, tc.stream))
					q, err = a.Malloc(size, tc.stream)
					require.NoError(t, err)
				}
				st := a.Stats()
				st.DeviceAllocP50Ns, st.DeviceAllocP99Ns, st.DeviceAllocMaxNs = 0, 0, 0 // timings
				if front {
					require.Equal(t, int64(1), st.FrontFrees)
					require.Equal(t, int64(1), st.FrontRecycled)
					st.FrontFrees, st.FrontRecycled = 0, 0 // the front's own counters
				}
				require.Zero(t, a.Pending())
				require.NoError(t, a.CheckInvariants())
				return st, p, q
			}
			viaFront, p, q := run(true)
			require.Equal(t, p, q, "the front hands out the block it was given")
			direct, p2, q2 := run(false)
			require.Equal(t, p2, q2, "this test needs Go to give back the same block")
			require.Equal(t, direct, viaFront)
		})
	}
}

// A free waiting in the log is applied before anything that looks at the
// device: a request that misses sees the memory freed (so the peak does
// not count it), and the published figures read without the mutex
// count it as freed.
func TestFrontPendingFreesAreSeenBeforeTheNextCall(t *testing.T) {
	a, err := New(arena.NewSim(0, 0), DefaultConfig())
	require.NoError(t, err)
	f := NewFrontEmulator()
	x, err := a.Malloc(10<<20, 0)
	require.NoError(t, err)
	f.track(a, x, 10<<20, 0)
	y, err := a.Malloc(10<<20, 0)
	require.NoError(t, err)
	f.track(a, y, 10<<20, 0)
	require.True(t, f.give(a, x))
	require.Equal(t, 1, a.Pending())
	require.Equal(t, int64(10<<20), a.Scalar(ScalarAllocatedBytes), "the published figure counts the pending free")
	require.Zero(t, a.Pending())

	require.True(t, f.give(a, y))
	z, err := a.Malloc(20<<20, 0) // not the size of y: Go serves it, after applying y's free
	require.NoError(t, err)
	st := a.Stats()
	require.Equal(t, int64(20<<20), st.AllocatedBytes[StatAll].Current)
	require.Equal(t, int64(20<<20), st.AllocatedBytes[StatAll].Peak, "the peak never counted y's bytes after its free")
	require.NoError(t, a.Free(z, 20<<20, 0))
}

// A log whose count was corrupted past its entries (the C++ side never
// writes one) is reported as bad input and drained as far as it goes,
// without crashing, and the allocator stays consistent.
func TestFrontLogCountPastItsEntries(t *testing.T) {
	a, err := New(arena.NewSim(0, 0), DefaultConfig())
	require.NoError(t, err)
	p, err := a.Malloc(1<<20, 0)
	require.NoError(t, err)
	f := a.EnableFront()
	f.acquire()
	f.entries[0] = FrontEntry{Ptr: uint64(p), Requested: 1 << 20}
	f.n.Store(FrontCap + 5)
	f.release()
	st := a.Stats()
	require.Equal(t, int64(1), st.BadInput["invalid_argument"])
	require.Zero(t, a.Pending())
	require.Zero(t, st.Allocation[StatAll].Current, "the one real entry was applied")
	require.NoError(t, a.CheckInvariants())
}

// The front is off while history is recorded (each event is timed as it
// happens) and while a capture window is open; Go publishes that at every
// Unlock, and the frees then go to Go. GOALLOC_CONF's front:false leaves
// the allocator without a log.
func TestFrontOffWhileHistoryOrCapture(t *testing.T) {
	a, err := New(arena.NewSim(0, 0), DefaultConfig())
	require.NoError(t, err)
	require.Nil(t, a.Front(), "no log until the C++ class asks for one")
	f := NewFrontEmulator()
	p, err := a.Malloc(1<<20, 0)
	require.NoError(t, err)
	f.track(a, p, 1<<20, 0)
	require.NotNil(t, a.Front())

	a.RecordHistory(100)
	require.False(t, f.give(a, p), "history is on")
	require.NoError(t, a.Free(p, 1<<20, 0))
	a.RecordHistory(0)

	p, err = a.Malloc(1<<20, 0)
	require.NoError(t, err)
	f.track(a, p, 1<<20, 0)
	id := PoolID{1, 2}
	require.NoError(t, a.BeginAllocateToPool(id))
	require.False(t, f.give(a, p), "a capture window is open")
	require.NoError(t, a.Free(p, 1<<20, 0))
	require.NoError(t, a.EndAllocateToPool(id))

	p, err = a.Malloc(1<<20, 0)
	require.NoError(t, err)
	f.track(a, p, 1<<20, 0)
	require.True(t, f.give(a, p), "on again")
	require.Equal(t, p, f.take(a, 1<<20, 0))
	require.NoError(t, a.Free(p, 1<<20, 0))
	require.NoError(t, a.CheckInvariants())

	cfg := DefaultConfig()
	cfg.Front = false
	b, err := New(arena.NewSim(0, 0), cfg)
	require.NoError(t, err)
	require.Nil(t, b.EnableFront())
	require.Nil(t, b.Front())
	require.Zero(t, b.Pending())
}

// Several threads through the front and straight into Go at once (run with
// -race): frees written to the log while others drain it, recycled pairs,
// statistics read without the mutex. Nothing is lost: at the end the
// statistics equal what the threads hold, and everything goes back.
func TestFrontConcurrent(t *testing.T) {
	a, err := New(arena.NewSim(0, 0), DefaultConfig())
	require.NoError(t, err)
	f := NewFrontEmulator()
	sizes := []uint64{512, 4096, 1 << 20, 3 << 20}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			s := arena.Stream(g * 0x100)
			var held []uintptr
			for i := 0; i < 3000; i++ {
				size := sizes[(i+g)%len(sizes)]
				p := f.take(a, size, s)
				if p == 0 {
					var err error
					p, err = a.Malloc(size, s)
					if err != nil {
						t.Error(err)
						return
					}
					f.track(a, p, size, s)
				}
				held = append(held, p)
				if len(held) > 3 || i%5 == 0 {
					q := held[0]
					held = held[1:]
					if !f.give(a, q) {
						if _, err := a.FreeOwned(q); err != nil {
							t.Error(err)
						}
					}
				}
				if i%97 == 0 {
					_ = a.Scalar(ScalarAllocatedBytes)
				}
			}
			for _, q := range held {
				if !f.give(a, q) {
					_, _ = a.FreeOwned(q)
				}
			}
		}(g)
	}
	wg.Wait()
	st := a.Stats()
	require.Zero(t, st.Allocation[StatAll].Current)
	require.Zero(t, st.AllocatedBytes[StatAll].Current)
	require.Equal(t, st.Allocation[StatAll].Allocated, st.Allocation[StatAll].Freed)
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, a.EmptyCache())
	require.Zero(t, a.Stats().ReservedBytes[StatAll].Current)
}
