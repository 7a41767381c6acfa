package arena

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeSource hands out increasing addresses and fails the calls a test
// queues; it records the cap it was given, like the VMM devices.
type fakeSource struct {
	MemorySource // nil: the adaptors must not call anything else
	next         uintptr
	fail         []error // returned by the next allocations, in order
	freeErr      error
	allocs       int
	cap          uint64
}

func (f *fakeSource) alloc() (uintptr, error) {
	f.allocs++
	if len(f.fail) > 0 {
		err := f.fail[0]
		f.fail = f.fail[1:]
		if err != nil {
			return 0, err
		}
	}
	f.next += 512
	return f.next, nil
}

func (f *fakeSource) Alloc(uint64, Stream) (uintptr, error)   { return f.alloc() }
func (f *fakeSource) AllocUncaptured(uint64) (uintptr, error) { return f.alloc() }
func (f *fakeSource) Free(uintptr, uint64, Stream) error      { return f.freeErr }
func (f *fakeSource) SetCap(limit uint64)                     { f.cap = limit }

var errBroken = errors.New("driver broken")

func TestLimitedRefusesAboveTheCap(t *testing.T) {
	src := &fakeSource{}
	l := NewLimited(src, 3<<20)
	assert.Equal(t, uint64(3<<20), src.cap, "a source that caps itself gets the cap")
	p, err := l.Alloc(2<<20, 0)
	require.NoError(t, err)
	_, err = l.AllocUncaptured(2 << 20)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.ErrorIs(t, err, ErrCapReached)
	assert.EqualError(t, err, "the cap on reserved memory was reached")
	assert.Equal(t, 1, src.allocs, "a refused allocation never reaches the source")
	q, err := l.Alloc(1<<20, 0) // exactly at the cap
	require.NoError(t, err)
	assert.Equal(t, uint64(3<<20), l.Held())

	require.NoError(t, l.Free(p, 2<<20, 0))
	src.freeErr = errBroken
	require.Error(t, l.Free(q, 1<<20, 0))
	assert.Equal(t, uint64(1<<20), l.Held(), "a failed free keeps its bytes held")

	src.fail = []error{errBroken}
	_, err = l.Alloc(1<<20, 0)
	require.ErrorIs(t, err, errBroken)
	assert.Equal(t, uint64(1<<20), l.Held(), "a failed allocation gives its claim back")

	l.SetLimit(0)
	assert.Zero(t, src.cap)
	_, err = l.Alloc(1<<40, 0)
	require.NoError(t, err, "0 means no cap")
}

func TestCountingCountsWhatSucceeds(t *testing.T) {
	src := &fakeSource{}
	c := NewCounting(src)
	p, err := c.Alloc(3<<20, 0)
	require.NoError(t, err)
	q, err := c.AllocUncaptured(1 << 20)
	require.NoError(t, err)
	src.fail = []error{ErrOutOfMemory}
	_, err = c.Alloc(1<<20, 0)
	require.Error(t, err)
	assert.Equal(t, uint64(2), c.Allocs(), "a failed allocation is not counted")
	assert.Equal(t, uint64(2), c.Latency().Count(), "a failed allocation is not timed")
	assert.Equal(t, uint64(4<<20), c.Held())
	require.NoError(t, c.Free(p, 3<<20, 0))
	src.freeErr = errBroken
	require.Error(t, c.Free(q, 1<<20, 0))
	assert.Equal(t, uint64(1), c.Frees(), "a failed free is not counted")
	assert.Equal(t, uint64(1<<20), c.Held())
	assert.Equal(t, uint64(4<<20), c.Peak())
	c.ResetPeak()
	assert.Equal(t, uint64(1<<20), c.Peak())
	c.ResetCounts()
	assert.Zero(t, c.Allocs())
	assert.Zero(t, c.Frees())
	assert.Zero(t, c.Latency().Count())
	assert.Equal(t, uint64(1<<20), c.Held(), "resetting the counts keeps what is held")
}

func TestRetryingCallsTheHookOnOutOfMemory(t *testing.T) {
	src := &fakeSource{fail: []error{ErrOutOfMemory, ErrCapReached}}
	var attempts []int
	r := NewRetrying(src, func(size uint64, attempt int, err error) bool {
		assert.Equal(t, uint64(1<<20), size)
		assert.ErrorIs(t, err, ErrOutOfMemory)
		attempts = append(attempts, attempt)
		return true
	})
	_, err := r.Alloc(1<<20, 0)
	require.NoError(t, err, "the third try succeeds")
	assert.Equal(t, []int{0, 1}, attempts)

	attempts = nil
	src.fail = []error{ErrOutOfMemory, ErrOutOfMemory}
	r.onOOM = func(_ uint64, attempt int, _ error) bool { attempts = append(attempts, attempt); return attempt < 1 }
	_, err = r.AllocUncaptured(1 << 20)
	require.ErrorIs(t, err, ErrOutOfMemory, "the hook gave up: the last failure is returned")
	assert.Equal(t, []int{0, 1}, attempts)

	attempts = nil
	src.fail = []error{errBroken}
	_, err = r.Alloc(1<<20, 0)
	require.ErrorIs(t, err, errBroken)
	assert.Empty(t, attempts, "only an out-of-memory calls the hook")
}

// The stack the caching layer builds: the cap's refusal reaches the hook,
// which frees through the same stack, and the retry then fits.
func TestStackedAdaptors(t *testing.T) {
	sim := NewSim(0, 1<<30)
	lim := NewLimited(sim, 4<<20)
	cnt := NewCounting(lim)
	var held []uintptr
	stack := NewRetrying(cnt, func(_ uint64, attempt int, _ error) bool {
		for _, p := range held {
			require.NoError(t, cnt.Free(p, 2<<20, 0))
		}
		held = nil
		return attempt == 0
	})
	for range 2 {
		p, err := stack.Alloc(2<<20, 0)
		require.NoError(t, err)
		held = append(held, p)
	}
	_, err := stack.Alloc(2<<20, 0)
	require.NoError(t, err, "the hook freed under the cap")
	assert.Equal(t, uint64(3), cnt.Allocs())
	assert.Equal(t, uint64(2), cnt.Frees())
	assert.Equal(t, uint64(2<<20), lim.Held())
	assert.Equal(t, lim.Held(), cnt.Held())
	assert.Equal(t, uint64(4<<20), cnt.Peak())
}

// PoolCapped over the simulated pool: an allocation the pool can place
// within the cap passes; one that makes the pool map past it is given back
// (on its stream, or, for AllocUncaptured, on the side stream), the pool is
// trimmed and the call fails with ErrCapReached; the high-water mark it
// reports leaves that moment out, until ResetPoolHigh restarts it.
func TestPoolCappedUndoesWhatPassesTheCap(t *testing.T) {
	sim := NewSim(0, 1<<30)
	settles := 0
	c := NewPoolCapped(sim, func() { settles++; _ = sim.Synchronize() })
	var _ Capped = c
	c.SetCap(48 << 20)
	p, err := c.Alloc(20<<20, 0)
	require.NoError(t, err, "one 32 MiB chunk")
	for _, alloc := range []func() (uintptr, error){
		func() (uintptr, error) { return c.Alloc(20<<20, 0) },
		func() (uintptr, error) { return c.AllocUncaptured(20 << 20) },
	} {
		_, err = alloc()
		require.ErrorIs(t, err, ErrCapReached, "[20, 40) MiB needs a second chunk: 64 MiB")
		require.ErrorIs(t, err, ErrOutOfMemory)
		raw, err := sim.PoolUsage()
		require.NoError(t, err)
		assert.EqualValues(t, 32<<20, raw.ReservedCurrent, "given back and trimmed")
		assert.Equal(t, 1, sim.LiveAllocations())
		u, err := c.PoolUsage()
		require.NoError(t, err)
		assert.EqualValues(t, 32<<20, u.ReservedHigh, "the undone allocation is no peak")
	}
	assert.Zero(t, settles, "the frees completed at once: nothing to wait for")
	// With work still running on the stream, the free of the allocation
	// given back waits for it: the cap lets it complete before trimming.
	sim.SetManual(true)
	sim.Launch(0)
	_, err = c.Alloc(20<<20, 0)
	require.ErrorIs(t, err, ErrCapReached)
	assert.Equal(t, 1, settles)
	raw, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, 32<<20, raw.ReservedCurrent, "given back and trimmed once the free completed")
	sim.SetManual(false)
	q, err := c.Alloc(8<<20, 0)
	require.NoError(t, err, "[20, 28) MiB fits in the chunk in use")
	require.NoError(t, c.Free(q, 8<<20, 0))
	c.SetCap(0)
	q, err = c.Alloc(20<<20, 0)
	require.NoError(t, err, "no cap")
	require.NoError(t, c.Free(q, 20<<20, 0))
	u, err := c.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, 64<<20, u.ReservedHigh)
	require.NoError(t, c.Trim(0))
	require.NoError(t, c.ResetPoolHigh())
	u, err = c.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, 32<<20, u.ReservedHigh, "restarted at what the pool holds")
	require.NoError(t, c.Free(p, 20<<20, 0))
}

// Idle memory never makes the cap refuse: the pool holds 64 MiB of which
// one chunk is idle; a request that needs a second chunk in use passes
// under a 64 MiB cap, the idle chunk moved under it, with no trim and
// nothing given back.
func TestPoolCappedPassesWhatIdleMemoryHolds(t *testing.T) {
	sim := NewSim(0, 1<<30)
	c := NewPoolCapped(sim, func() { t.Fatal("nothing to give back") })
	p, err := c.Alloc(40<<20, 0)
	require.NoError(t, err)
	require.NoError(t, c.Free(p, 40<<20, 0))
	q, err := c.Alloc(1<<20, 0)
	require.NoError(t, err)
	c.SetCap(64 << 20)
	r, err := c.Alloc(50<<20, 0)
	require.NoError(t, err)
	assert.Zero(t, sim.Trims)
	u, err := sim.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, 64<<20, u.ReservedCurrent)
	require.NoError(t, c.Free(r, 50<<20, 0))
	require.NoError(t, c.Free(q, 1<<20, 0))
}

// capRecorder is a source that caps itself, recording the caps it is given.
type capRecorder struct {
	MemorySource
	caps []uint64
}

func (c *capRecorder) SetCap(limit uint64) { c.caps = append(c.caps, limit) }

// What Claim counts lies outside the source, so a source that caps itself
// is given the cap less it: together they stay under the cap.
func TestClaimsLowerTheSourcesCap(t *testing.T) {
	src := &capRecorder{MemorySource: NewSim(0, 1<<30)}
	l := NewLimited(src, 100<<20)
	require.NoError(t, l.Claim(30<<20))
	require.NoError(t, l.Claim(60<<20))
	require.ErrorIs(t, l.Claim(20<<20), ErrCapReached)
	l.Unclaim(60 << 20)
	l.SetLimit(20 << 20)
	l.Unclaim(30 << 20)
	assert.Equal(t, []uint64{100 << 20, 70 << 20, 10 << 20, 70 << 20, 1, 20 << 20}, src.caps,
		"less what was claimed, at least one byte (0 would mean no cap)")
	assert.Zero(t, l.Held())
}
