package caching

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

// model is the reference the property tests drive the allocator against: it
// knows what the user holds, which streams touched which memory and how far
// each stream has run, and checks after every step what must hold whatever
// the allocator's internals do:
//
//   - no two live blocks overlap;
//   - the statistics equal the sum of the live blocks (and CheckInvariants,
//     which recomputes every internal figure, passes);
//   - reserved never grows above the cap;
//   - no memory reaches a stream while another stream that used it has not
//     completed the work queued before its free, unless the allocator made
//     the stream wait for that work (cuStreamWaitEvent).
type model struct {
	t     testing.TB
	sim   *arena.Sim
	a     *Allocator
	rng   *rand.Rand
	live  map[uintptr]*liveBlock
	freed []freedRange
	pos   map[arena.Stream]uint64 // work enqueued per stream
	done  map[arena.Stream]uint64 // work completed per stream
	syncs uint64                  // sim.Syncs seen so far
	// stalled streams never complete.
	stalled map[arena.Stream]bool
	streams []arena.Stream
	ops     int
	// front, when set, is the C++ class's front (front_emulator.go): requests
	// and frees go through it first, as they do in PyTorch.
	front *FrontEmulator
	// peakRequested is the most bytes the user held at once.
	peakRequested int64
	// recentFrees are the sizes and streams of the last frees: with a
	// front, half the requests ask for one of them again, as a training
	// step does.
	recentFrees []liveBlock
}

type liveBlock struct {
	ptr      uintptr
	size     uint64
	stream   arena.Stream
	recorded []arena.Stream
}

// freedRange is memory the user freed, with the position each stream that
// used it had reached at the free (busy: the model's count; device: the
// simulated device's): until a stream completes that position, only that
// stream, or one the allocator made wait for it, may get the memory again.
type freedRange struct {
	addr, size uint64
	busy       map[arena.Stream]uint64
	device     map[arena.Stream]uint64
}

func newModel(t testing.TB, seed uint64, cfg Config, capacity uint64) *model {
	sim := arena.NewSim(0, capacity)
	sim.SetManual(true)
	a, err := New(sim, cfg)
	require.NoError(t, err)
	m := &model{
		t: t, sim: sim, a: a, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		live: map[uintptr]*liveBlock{}, pos: map[arena.Stream]uint64{}, done: map[arena.Stream]uint64{},
		stalled: map[arena.Stream]bool{}, streams: []arena.Stream{0, 0x1000, 0x2000, 0x3000},
	}
	return m
}

// size draws a request size: mostly small, often large, sometimes huge.
func (m *model) size() uint64 {
	switch r := m.rng.IntN(100); {
	case r < 3:
		return 0
	case r < 45:
		return 1 + m.rng.Uint64N(smallMax)
	case r < 90:
		return smallMax + 1 + m.rng.Uint64N(32<<20)
	case r < 98:
		// A few fixed sizes, so that the cache gets exact hits.
		return []uint64{1 << 20, 3 << 20, 20 << 20, 100 << 20}[m.rng.IntN(4)]
	default:
		return 256<<20 + m.rng.Uint64N(1<<30)
	}
}

func (m *model) stream() arena.Stream { return m.streams[m.rng.IntN(len(m.streams))] }

// observeSync notices a device-wide synchronisation the allocator made.
func (m *model) observeSync() {
	if m.sim.Syncs != m.syncs {
		m.syncs = m.sim.Syncs
		for s, p := range m.pos {
			if !m.stalled[s] {
				m.done[s] = p
			}
		}
	}
}

func (m *model) malloc(size uint64, s arena.Stream) (uintptr, error) {
	if m.front != nil {
		if p := m.front.take(m.a, size, s); p != 0 {
			m.accept(p, size, s)
			return p, nil
		}
	}
	reservedBefore := m.a.reserved()
	p, err := m.a.Malloc(size, s)
	m.observeSync()
	if err != nil {
		var oom *OOMError
		require.True(m.t, errors.As(err, &oom), "op %d: malloc(%d) failed with a non-OOM error: %v", m.ops, size, err)
		require.True(m.t, errors.Is(err, arena.ErrOutOfMemory))
		return 0, err
	}
	m.accept(p, size, s)
	if m.front != nil {
		m.front.track(m.a, p, size, s)
	}
	if lim := m.a.Limit(); lim > 0 && m.a.reserved() > reservedBefore {
		require.LessOrEqual(m.t, m.a.reserved(), lim, "op %d: reserved grew above the cap", m.ops)
	}
	return p, nil
}

// accept checks a pointer Malloc returned for size bytes on stream s
// against everything the model knows, and records it as live.
func (m *model) accept(p uintptr, size uint64, s arena.Stream) {
	require.NotZero(m.t, p)
	require.Zero(m.t, p%512, "op %d: pointer %#x is not 512-byte aligned", m.ops, p)
	n := max(size, 1)
	// No overlap with any live block.
	for q, b := range m.live {
		if p < q+uintptr(max(b.size, 1)) && q < p+uintptr(n) {
			m.t.Fatalf("op %d: malloc(%d) on stream %#x returned [%#x,+%d), which overlaps live [%#x,+%d)", m.ops, size, s, p, n, q, b.size)
		}
	}
	// No memory still in use by another stream.
	for _, f := range m.freed {
		if uint64(p) < f.addr+f.size && f.addr < uint64(p)+n {
			for x, at := range f.busy {
				if x != s && m.done[x] < at && !m.sim.OrderedAfter(s, x, f.device[x]) {
					m.t.Fatalf("op %d: malloc(%d) on stream %#x returned %#x, still in use by stream %#x (at %d, completed %d)", m.ops, size, s, p, x, at, m.done[x])
				}
			}
		}
	}
	m.live[p] = &liveBlock{ptr: p, size: size, stream: s}
	m.peakRequested = max(m.peakRequested, m.requested())
}

// requested is what the user holds, in bytes asked for.
func (m *model) requested() int64 {
	var n int64
	for _, b := range m.live {
		n += int64(b.size)
	}
	return n
}

// resetPeak is reset_peak_memory_stats: peaks start again from now.
func (m *model) resetPeak() {
	require.NoError(m.t, m.a.ResetPeakStats())
	m.peakRequested = m.requested()
}

func (m *model) free(p uintptr) {
	b := m.live[p]
	if m.front == nil || !m.front.give(m.a, p) {
		require.NoError(m.t, m.a.Free(p, b.size, b.stream), "op %d", m.ops)
	}
	m.observeSync()
	delete(m.live, p)
	if m.front != nil {
		m.recentFrees = append(m.recentFrees, *b)
		if len(m.recentFrees) > 16 {
			m.recentFrees = m.recentFrees[1:]
		}
	}
	f := freedRange{addr: uint64(p), size: max(b.size, 1), busy: map[arena.Stream]uint64{}, device: map[arena.Stream]uint64{}}
	for _, s := range append([]arena.Stream{b.stream}, b.recorded...) {
		f.busy[s], f.device[s] = m.pos[s], m.sim.Enqueued(s)
	}
	m.freed = append(m.freed, f)
}

func (m *model) recordStream(p uintptr, s arena.Stream) {
	if m.front != nil {
		m.front.forget(p)
	}
	require.NoError(m.t, m.a.RecordStream(p, s))
	b := m.live[p]
	b.recorded = append(b.recorded, s)
	m.launch(s) // the other stream now uses it
}

func (m *model) launch(s arena.Stream) {
	m.sim.Launch(s)
	m.pos[s]++
}

func (m *model) complete(s arena.Stream) {
	m.sim.Complete(s)
	if !m.stalled[s] {
		m.done[s] = m.pos[s]
	}
}

// prune forgets freed ranges that no stream can still be using.
func (m *model) prune() {
	kept := m.freed[:0]
	for _, f := range m.freed {
		for x, at := range f.busy {
			if m.done[x] < at {
				kept = append(kept, f)
				break
			}
		}
	}
	m.freed = kept
}

// check verifies everything the model knows after a step.
func (m *model) check() {
	m.t.Helper()
	require.NoError(m.t, m.a.CheckInvariants(), "op %d", m.ops)
	st := m.a.Stats()
	require.Equal(m.t, m.requested(), st.RequestedBytes[StatAll].Current, "op %d: requested_bytes", m.ops)
	require.Equal(m.t, int64(len(m.live)), st.Allocation[StatAll].Current, "op %d: allocation count", m.ops)
	require.Equal(m.t, m.peakRequested, st.RequestedBytes[StatAll].Peak, "op %d: requested_bytes peak", m.ops)
	require.GreaterOrEqual(m.t, st.ReservedBytes[StatAll].Current, st.ActiveBytes[StatAll].Current)
	require.GreaterOrEqual(m.t, st.ActiveBytes[StatAll].Current, st.AllocatedBytes[StatAll].Current)
}

// step does one random operation.
func (m *model) step() {
	m.ops++
	switch r := m.rng.IntN(100); {
	case r < 40 || len(m.live) < 4:
		size, s := m.size(), m.stream()
		if k := len(m.recentFrees); m.front != nil && k > 0 && m.rng.IntN(2) == 0 {
			b := m.recentFrees[k-1-m.rng.IntN(min(k, 3))]
			size, s = b.size, b.stream
		}
		if _, err := m.malloc(size, s); err != nil {
			return
		}
	case r < 75:
		m.free(m.anyLive())
	case r < 80:
		p := m.anyLive()
		m.recordStream(p, m.stream())
	case r < 88:
		m.launch(m.stream())
	case r < 97:
		m.complete(m.stream())
	case r < 98:
		require.NoError(m.t, m.a.EmptyCache())
		m.observeSync()
	default:
		// Move the cap somewhere between nothing and the device.
		var lim uint64
		if m.rng.IntN(3) > 0 {
			lim = uint64(m.rng.Int64N(int64(m.a.total)))
		}
		require.NoError(m.t, m.a.SetLimit(lim))
	}
	m.prune()
}

func (m *model) anyLive() uintptr {
	keys := make([]uintptr, 0, len(m.live))
	for p := range m.live {
		keys = append(keys, p)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	return keys[m.rng.IntN(len(keys))]
}

// drain frees everything and checks that the allocator and the pool end
// empty: nothing lost, no event leaked.
func (m *model) drain() {
	for p := range m.live {
		m.free(p)
	}
	require.NoError(m.t, m.a.EmptyCache())
	m.check()
	st := m.a.Stats()
	require.Zero(m.t, st.ReservedBytes[StatAll].Current, "reserved after empty_cache")
	require.Zero(m.t, st.ActiveBytes[StatAll].Current)
	require.Zero(m.t, m.sim.LiveAllocations(), "pool allocations left after empty_cache")
	require.Zero(m.t, m.a.events.InUse(), "events still in use")
}

// modelSeeds runs body as one subtest per seed in [first, last], each with
// the default configuration under a large-cache budget the seed picks
// (none, 64 MiB, 1 GiB, unbounded) and steps random operations (a fifth
// of them under -short).
func modelSeeds(t *testing.T, first, last uint64, steps int, body func(t *testing.T, seed uint64, cfg Config, steps int)) {
	if testing.Short() {
		steps /= 5
	}
	for seed := first; seed <= last; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.LargeCache = []uint64{0, 64 << 20, 1 << 30, 1 << 40}[seed%4]
			body(t, seed, cfg, steps)
		})
	}
}

func TestPropertyRandomOps(t *testing.T) {
	modelSeeds(t, 1, 6, 4000, func(t *testing.T, seed uint64, cfg Config, steps int) {
		m := newModel(t, seed, cfg, 8<<30)
		for i := 0; i < steps; i++ {
			m.step()
			m.check()
		}
		m.drain()
	})
}
