package caching

import (
	"errors"
	"fmt"
	"sort"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

var errInjected = errors.New("injected driver failure")

// TestFaultInjection drives the model while the simulated driver fails:
// allocations fail with out-of-memory or with a broken-driver error, event
// records and queries fail, and one stream hangs forever. Every failure must
// fail the single request cleanly (or be survived), and every invariant the
// model checks must hold after every step. Under -short each seed takes a
// fifth of the steps (`make stress` takes them all).
func TestFaultInjection(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps /= 5
	}
	for seed := uint64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			m := newModel(t, seed, DefaultConfig(), 4<<30)
			hung := arena.Stream(0x3000)
			m.sim.SetFaults(arena.SimFaults{
				Alloc: func(size uint64, s arena.Stream) error {
					switch m.rng.IntN(20) {
					case 0:
						return fmt.Errorf("sim: injected: %w", arena.ErrOutOfMemory)
					case 1:
						return errInjected
					}
					return nil
				},
				EventRecord: func(arena.Stream) error {
					if m.rng.IntN(10) == 0 {
						return errInjected
					}
					return nil
				},
				EventQuery: func(arena.Event) error {
					if m.rng.IntN(10) == 0 {
						return errInjected
					}
					return nil
				},
			})
			m.sim.Stall(hung)
			m.stalled[hung] = true
			var failedOOM, failedDriver int
			for i := 0; i < steps; i++ {
				m.ops++
				switch r := m.rng.IntN(100); {
				case r < 45 || len(m.live) < 4:
					size, s := m.size(), m.stream()
					before := m.a.Stats().Allocation[StatAll].Current
					_, err := m.mallocAllowingFaults(size, s)
					if err != nil {
						if errors.Is(err, arena.ErrOutOfMemory) {
							failedOOM++
						} else {
							failedDriver++
							require.ErrorIs(t, err, errInjected)
						}
						require.Equal(t, before, m.a.Stats().Allocation[StatAll].Current, "a failed request leaves nothing allocated")
					}
				case r < 80:
					m.free(m.anyLive())
				case r < 86:
					m.recordStream(m.anyLive(), m.stream())
				case r < 92:
					m.launch(m.stream())
				default:
					m.complete(m.stream())
				}
				m.prune()
				m.check()
			}
			require.Positive(t, failedOOM+failedDriver, "the faults fired")
			// Without faults, everything not held by the hung stream drains.
			m.sim.SetFaults(arena.SimFaults{})
			for p := range m.live {
				m.free(p)
			}
			// The hung stream makes the device-wide synchronisation fail (the
			// real one would never return); empty_cache says so.
			require.ErrorContains(t, m.a.EmptyCache(), "stalled")
			m.observeSync()
			m.check()
			st := m.a.Stats()
			require.Zero(t, st.Allocation[StatAll].Current)
			// Blocks recorded on the hung stream can never be reused: they
			// stay pending (active) rather than being handed out early.
			require.Equal(t, st.ActiveBytes[StatAll].Current > 0, m.a.deferred.Len() > 0)
		})
	}
}

// mallocAllowingFaults is malloc, accepting driver errors as well as OOMs.
func (m *model) mallocAllowingFaults(size uint64, s arena.Stream) (uintptr, error) {
	p, err := m.a.Malloc(size, s)
	m.observeSync()
	if err != nil {
		return 0, err
	}
	m.accept(p, size, s)
	return p, nil
}

// FuzzOps interprets the fuzzer's bytes as a sequence of operations on four
// streams and checks the model after each. `go test` runs the seed corpus;
// `go test -fuzz FuzzOps ./caching` explores.
func FuzzOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
	f.Add([]byte("malloc free record complete launch empty limit"))
	f.Add([]byte{0, 0, 0, 0, 200, 200, 200, 40, 41, 42, 43, 90, 91, 250, 251, 252, 253})
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 2000 {
			ops = ops[:2000]
		}
		m := newModel(t, 1, DefaultConfig(), 2<<30)
		for i := 0; i+1 < len(ops); i += 2 {
			m.ops++
			op, arg := ops[i], ops[i+1]
			s := m.streams[arg%4]
			switch op % 8 {
			case 0, 1:
				sizes := []uint64{0, 1, 512, 513, 4096, smallMax, smallMax + 1, 1 << 20, 3<<20 + 7, 100 << 20}
				_, _ = m.malloc(sizes[int(arg)%len(sizes)]*uint64(1+arg/64), s)
			case 2, 3:
				if len(m.live) > 0 {
					m.free(m.nthLive(int(arg)))
				}
			case 4:
				if len(m.live) > 0 {
					m.recordStream(m.nthLive(int(arg)), s)
				}
			case 5:
				m.launch(s)
			case 6:
				m.complete(s)
			case 7:
				if arg%16 == 0 {
					require.NoError(t, m.a.EmptyCache())
					m.observeSync()
				} else {
					require.NoError(t, m.a.SetLimit(uint64(arg)<<23))
				}
			}
			m.prune()
			m.check()
		}
		m.drain()
	})
}

func (m *model) nthLive(n int) uintptr {
	keys := make([]uintptr, 0, len(m.live))
	for p := range m.live {
		keys = append(keys, p)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	return keys[n%len(keys)]
}
