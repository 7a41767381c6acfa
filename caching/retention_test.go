package caching

import (
	"math/rand/v2"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The rules alone: their limits, and what they ask of the memory stack.
func TestRetentionRules(t *testing.T) {
	general := generalRetention{largeCache: 256 << 20, missRelease: true}
	assert.Equal(t, limits{maxCachedLarge: 256 << 20, maxEmptyPerClass: 1, maxEmptyBytes: emptySegmentBudget}, general.limits())
	// Where streams share no handle, the empty segments' budget is what
	// the device holds for them, and admits one stream's handle at least.
	general.perStream = 16 << 20
	assert.EqualValues(t, emptySegmentBudget, general.limits().maxEmptyBytes)
	general.perStream = 64 << 20
	assert.EqualValues(t, 64<<20, general.limits().maxEmptyBytes, "one stream may keep its empty segments")
	general.perStream = 0

	p := newGraphPool(PoolID{1, 2})
	graph := p.rule.(graphRetention)
	assert.Equal(t, keepAll, graph.limits(), "a graph pool keeps everything until released")
	assert.Equal(t, keepAll, p.limits)
	p.setReleased(true)
	assert.Equal(t, keepNothing, graph.limits(), "a released graph pool keeps nothing")
	assert.Equal(t, keepNothing, p.limits)
	p.setReleased(false)
	assert.Equal(t, keepAll, p.limits, "a pool in use again keeps everything again")
	graph.beforeMiss(nil, nil, 1<<30) // a miss may release nothing of a graph pool: it touches nothing

	src := &callsSource{MemorySource: arena.NewSim(0, 1<<30)}
	_, err := general.alloc(src, 4<<20, 0x10)
	require.NoError(t, err)
	_, err = graph.alloc(src, 4<<20, 0x10)
	require.NoError(t, err)
	assert.Equal(t, []string{"Alloc", "AllocUncaptured"}, src.calls,
		"a graph pool takes its memory outside the capture, so the graph gets no allocation node")
}

type callsSource struct {
	arena.MemorySource
	calls []string
}

func (s *callsSource) Alloc(n uint64, st arena.Stream) (uintptr, error) {
	s.calls = append(s.calls, "Alloc")
	return s.MemorySource.Alloc(n, st)
}

func (s *callsSource) AllocUncaptured(n uint64) (uintptr, error) {
	s.calls = append(s.calls, "AllocUncaptured")
	return s.MemorySource.AllocUncaptured(n)
}

// A graph pool's rule keeps every block and empty segment freed into it,
// past the general cache's budgets, until torch releases the pool; then all
// of it goes back, and so does what is freed later.
func TestGraphRetentionKeepsUntilReleased(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 1 << 20 // the general rule would keep none of the blocks below
	a, sim := newTestAllocator(t, cfg)
	id := PoolID{3, 4}
	const S = arena.Stream(0x10)
	require.NoError(t, a.IncrefPool(id))
	p := a.private[id]

	var blocks []uintptr
	for range 3 {
		b, err := a.MallocIn(id, 4<<20, S)
		require.NoError(t, err)
		blocks = append(blocks, b)
	}
	c := sizeToClass[(1000+classAlign-1)/classAlign]
	perSeg := int(classSegment[c] / classSize[c])
	var slots []uintptr
	for range perSeg + 1 { // two segments of one class
		s, err := a.MallocIn(id, 1000, S)
		require.NoError(t, err)
		slots = append(slots, s)
	}
	kept, err := a.MallocIn(id, 8<<20, S) // live when the pool is released
	require.NoError(t, err)
	for _, b := range blocks {
		require.NoError(t, a.Free(b, 4<<20, S))
	}
	for _, s := range slots {
		require.NoError(t, a.Free(s, 1000, S))
	}
	require.NoError(t, a.CheckInvariants())
	assert.Zero(t, sim.Frees, "nothing of the pool went back")
	assert.EqualValues(t, 12<<20, p.cachedLarge)
	assert.EqualValues(t, 2*uint64(classSegment[c]), p.emptySegs.bytes, "both empty segments of one stream and class are kept")
	assert.Zero(t, a.cachedLarge, "the general cache holds none of it")
	assert.EqualValues(t, 20<<20+2*uint64(classSegment[c]), a.Stats().GraphReservedBytes)

	require.NoError(t, a.ReleasePool(id))
	require.NoError(t, a.CheckInvariants())
	assert.EqualValues(t, 5, sim.Frees, "released: the free blocks and segments went back")
	assert.EqualValues(t, 8<<20, a.Stats().GraphReservedBytes, "the live block stays")
	require.NoError(t, a.Free(kept, 8<<20, S))
	assert.EqualValues(t, 6, sim.Frees, "a block freed into a released pool goes back at once")
	assert.Empty(t, a.private, "the released pool is forgotten once empty")
	require.NoError(t, a.CheckInvariants())
}

// The general rule's large-block budget counts the general cache alone,
// and gives back the least recently freed blocks first.
func TestGeneralRetentionLargeBudget(t *testing.T) {
	cfg := DefaultConfig()
	cfg.LargeCache = 6 << 20
	cfg.MissRelease = false
	a, sim := newTestAllocator(t, cfg)
	id := PoolID{5, 6}
	require.NoError(t, a.IncrefPool(id))
	g, err := a.MallocIn(id, 16<<20, 0)
	require.NoError(t, err)
	require.NoError(t, a.Free(g, 16<<20, 0)) // cached in the graph pool, beyond the budget
	var ps []uintptr
	for i := range 3 {
		p, err := a.Malloc(uint64(2+i)<<20, 0)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	for i, p := range ps {
		require.NoError(t, a.Free(p, uint64(2+i)<<20, 0))
	}
	// 2 + 3 + 4 MiB is over 6 MiB: the oldest (2 MiB) goes; 7 MiB is still
	// over, so the next oldest (3 MiB) goes too.
	assert.EqualValues(t, 4<<20, a.cachedLarge)
	assert.EqualValues(t, 2, sim.Frees)
	assert.EqualValues(t, 16<<20, a.private[id].cachedLarge, "the graph pool's block is not the general budget's")
	require.NoError(t, a.CheckInvariants())
}

// The general rule keeps one empty segment per stream and class, and
// within emptySegmentBudget over all streams, the oldest going first.
func TestGeneralRetentionEmptySegmentPerStream(t *testing.T) {
	a, sim := newTestAllocator(t, DefaultConfig())
	c := sizeToClass[(1000+classAlign-1)/classAlign]
	perSeg := int(classSegment[c] / classSize[c])
	fill := func(s arena.Stream, n int) {
		var slots []uintptr
		for range n {
			p, err := a.Malloc(1000, s)
			require.NoError(t, err)
			slots = append(slots, p)
		}
		for _, p := range slots {
			require.NoError(t, a.Free(p, 1000, s))
		}
	}
	fill(0x10, perSeg+1) // two segments on one stream
	fill(0x20, perSeg+1) // and two on another
	require.NoError(t, a.CheckInvariants())
	assert.EqualValues(t, 2, sim.Frees, "each stream gave back its second empty segment")
	assert.EqualValues(t, 2*uint64(classSegment[c]), a.emptySegs.bytes, "each stream kept one")
	first := a.emptySegs.head

	// One empty segment of the largest class per stream, on more streams
	// than the budget holds: the oldest go.
	big := uint64(smallMax)
	bigSeg := uint64(classSegment[numSmallClasses-1])
	streams := int(emptySegmentBudget/bigSeg) + 2
	for i := range streams {
		p, err := a.Malloc(big, arena.Stream(0x1000+i))
		require.NoError(t, err)
		require.NoError(t, a.Free(p, big, arena.Stream(0x1000+i)))
	}
	require.NoError(t, a.CheckInvariants())
	assert.LessOrEqual(t, a.emptySegs.bytes, uint64(emptySegmentBudget))
	assert.Greater(t, a.emptySegs.bytes, uint64(emptySegmentBudget)-bigSeg, "only as many go as the budget needs")
	assert.NotEqual(t, first, a.emptySegs.head, "the oldest empty segment went first")
	assert.Equal(t, arena.Stream(0x1000+streams-1), a.emptySegs.tail.stream, "the newest stays")
}

// Random operations on the general cache and three graph pools, with a
// small large-block budget so that the general rule gives back often: the
// self-check (each pool's LRU, cached bytes, empty segments and limits)
// holds after every step, every allocation comes from the pool asked for,
// and a graph pool in use never gives back any memory, whatever the
// general cache does around it.
func TestRetentionRandomOps(t *testing.T) {
	steps := 1500
	if testing.Short() {
		steps /= 5 // `make stress` takes them all
	}
	for seed := uint64(1); seed <= 4; seed++ {
		cfg := DefaultConfig()
		cfg.LargeCache = 8 << 20
		a, _ := newTestAllocator(t, cfg)
		rng := rand.New(rand.NewPCG(seed, 12))
		ids := []PoolID{{}, {1, 1}, {1, 2}, {2, 1}}
		type live struct {
			ptr  uintptr
			size uint64
			s    arena.Stream
			pool PoolID
		}
		var lives []live
		users := map[PoolID]int{}
		held := map[PoolID]uint64{} // a pool's reserved bytes while it has users
		for step := 0; step < steps; step++ {
			id := ids[rng.IntN(len(ids))]
			switch op := rng.IntN(20); {
			case op == 0 && id != (PoolID{}):
				require.NoError(t, a.IncrefPool(id))
				users[id]++
			case op == 1 && users[id] > 0:
				require.NoError(t, a.ReleasePool(id))
				users[id]--
			case op == 2:
				require.NoError(t, a.EmptyCache())
			case op < 12 && (id == PoolID{} || users[id] > 0):
				size := uint64(1 + rng.IntN(48<<10))
				if rng.IntN(3) == 0 {
					size = uint64(64<<10 + rng.IntN(6<<20))
				}
				s := arena.Stream(0x10 * (1 + rng.IntN(2)))
				p, err := a.MallocIn(id, size, s)
				require.NoError(t, err)
				lives = append(lives, live{p, size, s, id})
				a.mu.Lock()
				var pool *cachePool
				if bid, ok := a.largeByAddr.Get(p); ok {
					pool = a.blocks[bid].list.pool
				} else {
					pool = a.findSegment(p).list.pool
				}
				a.mu.Unlock()
				require.Equal(t, id, pool.id, "step %d: memory from the pool asked for", step)
			case len(lives) > 0:
				i := rng.IntN(len(lives))
				l := lives[i]
				lives[i] = lives[len(lives)-1]
				lives = lives[:len(lives)-1]
				require.NoError(t, a.Free(l.ptr, l.size, l.s))
			}
			require.NoError(t, a.CheckInvariants(), "seed %d step %d", seed, step)
			a.mu.Lock()
			for _, id := range ids[1:] {
				p := a.private[id]
				if p == nil || users[id] == 0 {
					delete(held, id)
					continue
				}
				require.GreaterOrEqual(t, p.reserved, held[id], "seed %d step %d: pool %v in use gave memory back", seed, step, id)
				held[id] = p.reserved
			}
			a.mu.Unlock()
		}
		for _, l := range lives {
			require.NoError(t, a.Free(l.ptr, l.size, l.s))
		}
		for id, n := range users {
			for range n {
				require.NoError(t, a.ReleasePool(id))
			}
		}
		require.NoError(t, a.EmptyCache())
		require.NoError(t, a.CheckInvariants())
		assert.Zero(t, a.reserved(), "seed %d: everything went back", seed)
		assert.Empty(t, a.private, "seed %d: every released pool is forgotten", seed)
	}
}
