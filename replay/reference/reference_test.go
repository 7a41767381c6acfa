package reference

import (
	"errors"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20
	GiB = 1 << 30
)

func newSim(capacity uint64) *arena.Sim { return arena.NewSim(0, capacity) }

// newPolicy makes the named policy over a fresh sim of capacity bytes.
func newPolicy(t *testing.T, name string, capacity uint64) (Allocator, *arena.Sim) {
	t.Helper()
	sim := newSim(capacity)
	a, err := New(name, sim, "")
	require.NoError(t, err)
	t.Cleanup(func() { a.Close() })
	return a, sim
}

type liveBlock struct {
	ptr    uintptr
	size   uint64
	stream arena.Stream
}

// TestPoliciesRandom drives every policy with random requests on two streams
// and checks what must hold whatever the policy does: pointers are 512-byte
// aligned, no two live blocks overlap, frees of unknown pointers fail, and
// once everything is freed the policy holds no live memory (the caching ones
// hold it all as free).
func TestPoliciesRandom(t *testing.T) {
	for _, name := range Names {
		t.Run(name, func(t *testing.T) {
			a, sim := newPolicy(t, name, 64*GiB)
			rng := rand.New(rand.NewPCG(1, uint64(len(name))))
			streams := []arena.Stream{0, 0x7000}
			var live []liveBlock
			for op := 0; op < 4000; op++ {
				if len(live) > 0 && (rng.IntN(100) < 45 || len(live) > 300) {
					i := rng.IntN(len(live))
					b := live[i]
					require.NoError(t, a.Free(b.ptr, b.size, b.stream), "op %d", op)
					live[i] = live[len(live)-1]
					live = live[:len(live)-1]
					continue
				}
				size := randomSize(rng)
				s := streams[rng.IntN(len(streams))]
				p, err := a.Malloc(size, s)
				require.NoError(t, err, "op %d: malloc(%d)", op, size)
				require.NotZero(t, p)
				require.Zero(t, p%512, "op %d: %#x not 512-byte aligned", op, p)
				for _, b := range live {
					require.False(t, p < b.ptr+uintptr(max(b.size, 1)) && b.ptr < p+uintptr(max(size, 1)),
						"op %d: malloc(%d) = %#x overlaps live [%#x,+%d)", op, size, p, b.ptr, b.size)
				}
				live = append(live, liveBlock{p, size, s})
			}
			// A pointer never handed out, and one freed twice.
			err := a.Free(0x1234000, 512, 0)
			require.Error(t, err)
			b := live[0]
			require.NoError(t, a.Free(b.ptr, b.size, b.stream))
			require.Error(t, a.Free(b.ptr, b.size, b.stream), "double free")
			for _, b := range live[1:] {
				require.NoError(t, a.Free(b.ptr, b.size, b.stream))
			}
			f := a.Fragmentation()
			u, err := sim.PoolUsage()
			require.NoError(t, err)
			switch name {
			case "passthrough":
				require.Zero(t, u.UsedCurrent, "passthrough must give everything back")
				require.Zero(t, sim.LiveAllocations())
			case "goalloc":
				// goalloc gives some of its cache back to the pool by design.
			default:
				require.Equal(t, u.UsedCurrent, f.FreeBytes, "%s: everything it holds is free once all is freed", name)
			}
		})
	}
}

func randomSize(rng *rand.Rand) uint64 {
	switch r := rng.IntN(100); {
	case r < 2:
		return 0
	case r < 50:
		return 1 + rng.Uint64N(MiB)
	case r < 90:
		return MiB + 1 + rng.Uint64N(12*MiB)
	case r < 98:
		return []uint64{512, 4 * KiB, 2 * MiB, 20 * MiB}[rng.IntN(4)]
	default:
		return 20*MiB + rng.Uint64N(200*MiB)
	}
}

func TestNewErrors(t *testing.T) {
	_, err := New("bogus", newSim(GiB), "")
	require.ErrorContains(t, err, `unknown policy "bogus"`)
	require.ErrorContains(t, err, "goalloc, native, buddy, fixed, passthrough")
	_, err = New("native", newSim(GiB), "fraction:0.5")
	require.ErrorContains(t, err, "takes no configuration")
	_, err = New("goalloc", newSim(GiB), "nonsense:1")
	require.ErrorContains(t, err, `unknown key "nonsense"`)
	a, err := New("goalloc", newSim(GiB), "large_cache:0")
	require.NoError(t, err)
	require.NoError(t, a.Close())
}

func TestBadPointer(t *testing.T) {
	for _, name := range Names {
		a, _ := newPolicy(t, name, GiB)
		p, err := a.Malloc(4096, 0)
		require.NoError(t, err)
		require.Error(t, a.Free(p+512, 4096, 0), "%s: free inside a block", name)
		require.Error(t, a.Free(0, 4096, 0), "%s: free of NULL", name)
		if name != "goalloc" {
			require.ErrorIs(t, a.Free(p+512, 4096, 0), ErrUnknownPointer, name)
		}
		require.NoError(t, a.Free(p, 4096, 0))
	}
}

func TestMallocTooLarge(t *testing.T) {
	for _, name := range Names {
		a, _ := newPolicy(t, name, GiB)
		_, err := a.Malloc(^uint64(0), 0)
		require.Error(t, err, name)
	}
}

// TestReuse checks that every caching policy serves a repeated request from
// its cache, on the same stream only.
func TestReuse(t *testing.T) {
	for _, name := range []string{"goalloc", "native", "buddy", "fixed"} {
		for _, size := range []uint64{1000, 3 * MiB, 40 * MiB} {
			a, sim := newPolicy(t, name, 8*GiB)
			p, err := a.Malloc(size, 1)
			require.NoError(t, err)
			require.NoError(t, a.Free(p, size, 1))
			allocs := sim.Allocs
			q, err := a.Malloc(size, 1)
			require.NoError(t, err)
			require.Equal(t, p, q, "%s: a freed %d-byte block comes back for the same request", name, size)
			require.Equal(t, allocs, sim.Allocs, "%s: no device allocation for a cached size", name)
			require.NoError(t, a.Free(q, size, 1))
			r, err := a.Malloc(size, 2)
			require.NoError(t, err)
			if name == "goalloc" {
				// goalloc's miss gives stream 1's cached block back to the pool,
				// which may hand it to stream 2 once the free completed.
				require.Greater(t, sim.Allocs, allocs, "%s: stream 2 is not served from stream 1's cache", name)
			} else {
				require.NotEqual(t, p, r, "%s: a block cached for stream 1 went to stream 2", name)
			}
		}
	}
}

func TestNativeSegments(t *testing.T) {
	a := NewNative(newSim(8 * GiB))
	sim := a.dev.(*arena.Sim)
	for _, c := range []struct{ size, segment uint64 }{
		{1, 2 * MiB}, {MiB, 2 * MiB}, {MiB + 1, 20 * MiB}, {10*MiB - 512, 20 * MiB}, {10*MiB - 1, 10 * MiB},
		{10 * MiB, 10 * MiB}, {11*MiB + 1, 12 * MiB}, {300 * MiB, 300 * MiB},
	} {
		before := a.reserved.cur
		_, err := a.Malloc(c.size, 0x99) // a fresh stream each time has nothing cached
		require.NoError(t, err)
		require.Equal(t, c.segment, a.reserved.cur-before, "segment for a %d-byte request", c.size)
		a.streams = map[arena.Stream]*nativeStream{}
		a.last = nil
	}
	require.Equal(t, uint64(8), sim.Allocs)
}

// TestNativeSplitAndMerge follows PyTorch's rules on one 20 MiB segment.
func TestNativeSplitAndMerge(t *testing.T) {
	a := NewNative(newSim(8 * GiB))
	x, err := a.Malloc(3*MiB, 0)
	require.NoError(t, err)
	y, err := a.Malloc(4*MiB, 0)
	require.NoError(t, err)
	z, err := a.Malloc(5*MiB, 0)
	require.NoError(t, err)
	require.Equal(t, x+3*MiB, y, "split blocks are carved in address order")
	require.Equal(t, y+4*MiB, z)
	require.Equal(t, uint64(20*MiB), a.reserved.cur, "one segment serves all three")
	f := a.Fragmentation()
	require.Equal(t, uint64(8*MiB), f.FreeBytes)
	require.Equal(t, uint64(8*MiB), f.LargestFreeBlock)

	// Free the outer two: no merge with the live middle one.
	require.NoError(t, a.Free(x, 3*MiB, 0))
	require.NoError(t, a.Free(z, 5*MiB, 0)) // merges with the 8 MiB tail into 13 MiB
	f = a.Fragmentation()
	require.Equal(t, uint64(16*MiB), f.FreeBytes)
	require.Equal(t, uint64(13*MiB), f.LargestFreeBlock)
	require.InDelta(t, 1-13.0/16, f.Ratio, 1e-9)

	// Best fit: a 2 MiB request takes the 3 MiB hole, not the 13 MiB one,
	// and the 1 MiB rest is not split off (large pool: rest must exceed 1 MiB).
	w, err := a.Malloc(2*MiB, 0)
	require.NoError(t, err)
	require.Equal(t, x, w)
	require.Equal(t, uint64(3*MiB), a.live[w].size)
	require.Equal(t, uint64(3*MiB+4*MiB), a.allocated.cur, "allocated counts whole blocks, the unsplit rest too")
	require.NoError(t, a.Free(w, 2*MiB, 0))

	// Freeing the middle merges all three back into the whole segment.
	require.NoError(t, a.Free(y, 4*MiB, 0))
	f = a.Fragmentation()
	require.Equal(t, uint64(20*MiB), f.FreeBytes)
	require.Equal(t, uint64(20*MiB), f.LargestFreeBlock)
	require.Zero(t, f.Ratio)
	n := 0
	a.stream(0).large.each(func(size, addr uint64, b *nblock) {
		n++
		require.Nil(t, b.prev)
		require.Nil(t, b.next)
	})
	require.Equal(t, 1, n)
}

func TestNativeSmallPool(t *testing.T) {
	a := NewNative(newSim(8 * GiB))
	p, err := a.Malloc(100, 0)
	require.NoError(t, err)
	q, err := a.Malloc(700, 0)
	require.NoError(t, err)
	require.Equal(t, p+512, q, "small requests round to 512 and pack in a 2 MiB segment")
	r, err := a.Malloc(2*MiB, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(2*MiB+20*MiB), a.reserved.cur, "a large request never comes from the small pool")
	for _, x := range []uintptr{p, q, r} {
		require.NoError(t, a.Free(x, 0, 0))
	}
	f := a.Fragmentation()
	require.Equal(t, uint64(22*MiB), f.FreeBytes)
	require.Equal(t, uint64(20*MiB), f.LargestFreeBlock)
}

// TestReleaseOnOOM checks that the caching policies give their fully free
// memory back when the device runs out, and succeed on the retry.
func TestReleaseOnOOM(t *testing.T) {
	for _, name := range []string{"native", "buddy", "fixed", "passthrough"} {
		sim := newSim(64 * MiB)
		var a Allocator
		if name == "buddy" {
			a = NewBuddy(sim, 8*MiB)
		} else {
			var err error
			a, err = New(name, sim, "")
			require.NoError(t, err)
		}
		var ps []uintptr
		for i := 0; i < 12; i++ {
			p, err := a.Malloc(4*MiB, 0)
			require.NoError(t, err, "%s: malloc %d", name, i)
			ps = append(ps, p)
		}
		for _, p := range ps {
			require.NoError(t, a.Free(p, 4*MiB, 0))
		}
		p, err := a.Malloc(60*MiB, 0)
		require.NoError(t, err, "%s: the cache must be given back before an out-of-memory", name)
		_, err = a.Malloc(60*MiB, 0)
		require.ErrorIs(t, err, arena.ErrOutOfMemory, name)
		require.NoError(t, a.Free(p, 60*MiB, 0))
		require.NoError(t, a.Close())
	}
}

func TestBuddySplitMerge(t *testing.T) {
	a := NewBuddy(newSim(8*GiB), 64*KiB) // order 7 arenas
	p0, err := a.Malloc(512, 0)
	require.NoError(t, err)
	p1, err := a.Malloc(300, 0)
	require.NoError(t, err)
	require.Equal(t, p0+512, p1, "the buddy of the first block serves the second")
	p2, err := a.Malloc(1500, 0) // a 2 KiB block
	require.NoError(t, err)
	require.Equal(t, p0+2*KiB, p2)
	f := a.Fragmentation()
	require.Equal(t, uint64(64*KiB-3*KiB), f.FreeBytes)
	require.Equal(t, uint64(32*KiB), f.LargestFreeBlock)
	require.Equal(t, uint64(512+512+2048), a.allocated.cur)

	require.NoError(t, a.Free(p0, 512, 0))
	require.Equal(t, buddyBlock{a.live[p1].arena, 0}, a.free[p0], "p0 cannot merge: its buddy p1 is live")
	require.NoError(t, a.Free(p1, 300, 0))
	require.NoError(t, a.Free(p2, 1500, 0))
	f = a.Fragmentation()
	require.Equal(t, uint64(64*KiB), f.FreeBytes)
	require.Equal(t, uint64(64*KiB), f.LargestFreeBlock, "everything merged back into the arena")
	require.Len(t, a.free, 1)

	// A device with no room for a whole arena still serves the request.
	small := NewBuddy(newSim(40*MiB), GiB)
	p, err := small.Malloc(3*MiB, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(4*MiB), small.reserved.cur)
	require.NoError(t, small.Free(p, 3*MiB, 0))

	// A request larger than an arena gets an arena of its own power of two.
	big, err := a.Malloc(100*KiB, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(64*KiB+128*KiB), a.reserved.cur)
	require.NoError(t, a.Free(big, 100*KiB, 0))
}

func TestBuddyOrder(t *testing.T) {
	for _, c := range []struct {
		n     uint64
		order uint8
	}{{0, 0}, {1, 0}, {512, 0}, {513, 1}, {1024, 1}, {1025, 2}, {GiB, 21}, {GiB + 1, 22}} {
		require.Equal(t, c.order, orderOf(c.n), "orderOf(%d)", c.n)
	}
}

func TestFixedClasses(t *testing.T) {
	a := NewFixed(newSim(8 * GiB))
	p, err := a.Malloc(3000, 0) // 4 KiB class
	require.NoError(t, err)
	require.Equal(t, uint64(4*KiB), a.reserved.cur)
	require.NoError(t, a.Free(p, 3000, 0))
	q, err := a.Malloc(2000, 0) // 2 KiB class: no reuse of the 4 KiB block
	require.NoError(t, err)
	require.NotEqual(t, p, q)
	r, err := a.Malloc(4096, 0)
	require.NoError(t, err)
	require.Equal(t, p, r, "same class reuses the cached block")
	require.Equal(t, uint64(6*KiB), a.reserved.cur)
	require.NoError(t, a.Free(q, 2000, 0))
	f := a.Fragmentation()
	require.Equal(t, uint64(2*KiB), f.FreeBytes)
	require.Equal(t, uint64(2*KiB), f.LargestFreeBlock)
}

func TestPassthroughGoesToDevice(t *testing.T) {
	a, sim := newPolicy(t, "passthrough", GiB)
	for i := 0; i < 3; i++ {
		p, err := a.Malloc(5000, 0)
		require.NoError(t, err)
		require.NoError(t, a.Free(p, 5000, 0))
	}
	require.Equal(t, uint64(3), sim.Allocs)
	require.Equal(t, uint64(3), sim.Frees)
	require.Equal(t, uint64(5120), a.(*Passthrough).PeakReserved())
}

// TestPeakReserved checks each policy's own count of reserved bytes against
// the pool's: every policy's reserved bytes are device allocations, and the
// sim pool maps each in 2 MiB chunks, sharing none across allocations of 2 MiB
// multiples.
func TestPeakReserved(t *testing.T) {
	for _, name := range []string{"goalloc", "native", "buddy", "fixed"} {
		a, sim := newPolicy(t, name, 64*GiB)
		var ps []uintptr
		for _, size := range []uint64{3 * MiB, 40 * MiB, 200 * MiB} {
			p, err := a.Malloc(size, 0)
			require.NoError(t, err)
			ps = append(ps, p)
		}
		peak := a.(PeakReserver).PeakReserved()
		u, err := sim.PoolUsage()
		require.NoError(t, err)
		require.Equal(t, u.UsedHigh, peak, name)
	}
}

var (
	_ PeakReserver  = (*Goalloc)(nil)
	_ PeakAllocator = (*Goalloc)(nil)
	_ PeakAllocator = (*Native)(nil)
)

func TestOrdered(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	var s ordered[int]
	ref := map[[2]uint64]int{}
	keys := func() [][2]uint64 {
		var ks [][2]uint64
		for k := range ref {
			ks = append(ks, k)
		}
		sort.Slice(ks, func(i, j int) bool { return keyLess(ks[i][0], ks[i][1], ks[j][0], ks[j][1]) })
		return ks
	}
	for i := 0; i < 6000; i++ {
		k := [2]uint64{rng.Uint64N(50), rng.Uint64N(50)}
		switch rng.IntN(3) {
		case 0:
			if _, ok := ref[k]; !ok {
				s.insert(k[0], k[1], i)
				ref[k] = i
			}
		case 1:
			_, ok := ref[k]
			require.Equal(t, ok, s.remove(k[0], k[1]))
			delete(ref, k)
		default:
			var want *[2]uint64
			for _, r := range keys() {
				if !keyLess(r[0], r[1], k[0], k[1]) {
					want = &r
					break
				}
			}
			got := s.ceil(k[0], k[1])
			if want == nil {
				require.Nil(t, got)
			} else {
				require.NotNil(t, got)
				require.Equal(t, *want, [2]uint64{got.k1, got.k2})
				require.Equal(t, ref[*want], got.val)
			}
		}
		require.Equal(t, len(ref), s.len)
	}
	var walked [][2]uint64
	s.each(func(k1, k2 uint64, _ int) { walked = append(walked, [2]uint64{k1, k2}) })
	want := keys()
	if len(want) == 0 {
		want = nil
	}
	require.Equal(t, want, walked)
}

func TestErrorsAreOOM(t *testing.T) {
	// A failure that is not an out-of-memory is passed through untouched,
	// without releasing the cache.
	sim := newSim(GiB)
	boom := errors.New("driver broke")
	sim.SetFaults(arena.SimFaults{Alloc: func(uint64, arena.Stream) error { return boom }})
	a := NewNative(sim)
	_, err := a.Malloc(4096, 0)
	require.ErrorIs(t, err, boom)
}

// The replay command reads its device and the configuration keys here, so
// that it needs nothing of package caching.
func TestDeviceSpecAndConfKeys(t *testing.T) {
	s, err := DeviceSpec(arena.KindSim, 0, "")
	require.NoError(t, err)
	require.Equal(t, arena.KindSim, s.Kind)
	require.Equal(t, "vmm", s.Backend, "the default backend")
	require.Zero(t, s.Layout.Handle, "the default handles")
	s, err = DeviceSpec(arena.KindCUDA, 0, "large_cache:1G,backend:vmm,vmm_placement:segments,vmm_handle:4M")
	require.NoError(t, err)
	require.Equal(t, arena.DeviceSpec{Kind: arena.KindCUDA, Backend: "vmm", Layout: arena.VMMLayout{Handle: 4 << 20}}, s)
	_, err = DeviceSpec(arena.KindSim, 0, "vmm_placement:ranges")
	require.ErrorContains(t, err, "retired")
	s, err = DeviceSpec(arena.KindSim, 1<<30, "backend:async")
	require.NoError(t, err)
	require.Equal(t, "async", s.Backend)
	require.Equal(t, uint64(1<<30), s.SimMemory)
	dev, err := arena.NewDevice(s, 0)
	require.NoError(t, err)
	require.IsType(t, &arena.Sim{}, dev)
	require.NoError(t, dev.Close())
	_, err = DeviceSpec(arena.KindSim, 0, "backend:tape")
	require.Error(t, err)
	_, err = DeviceSpec(arena.KindSim, 0, "vmm_placement:tape")
	require.Error(t, err)
	_, err = DeviceSpec(arena.KindSim, 0, "no_such_key:1")
	require.ErrorContains(t, err, "no_such_key")
	keys := ConfKeys()
	require.True(t, sort.StringsAreSorted(keys))
	require.Contains(t, keys, "backend")
	require.Contains(t, keys, "large_cache")
}
