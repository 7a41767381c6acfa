package caching

import (
	"bytes"
	"errors"
	"math/rand"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const mib = 1 << 20

// sleepAllocator is an allocator over a simulated VMM device of capacity
// bytes with 2 MiB handles, and the tags "weights" and "kv".
func sleepAllocator(t *testing.T, capacity uint64) (*Allocator, *arena.SimVMM, Tag, Tag) {
	dev, err := arena.NewSimVMMWith(0, capacity, arena.VMMLayout{Handle: 2 * mib})
	require.NoError(t, err)
	a, err := New(dev, DefaultConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	w, err := InternTag("weights")
	require.NoError(t, err)
	kv, err := InternTag("kv")
	require.NoError(t, err)
	return a, dev, w, kv
}

func mallocTagged(t *testing.T, a *Allocator, tag Tag, n uint64, s arena.Stream) uintptr {
	t.Helper()
	p, err := a.MallocTagged(tag, n, s)
	require.NoError(t, err)
	return p
}

// writeCookie fills n bytes at p with random bytes seeded by p.
func writeCookie(t *testing.T, dev *arena.SimVMM, p uintptr, n uint64) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.New(rand.NewSource(int64(p))).Read(b)
	require.NoError(t, dev.Phys().Write(p, b))
	return b
}

func reserved(a *Allocator) uint64 {
	st := a.Stats()
	return uint64(st.ReservedBytes[StatAll].Current)
}

func check(t *testing.T, a *Allocator, dev *arena.SimVMM) {
	t.Helper()
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, dev.CheckInvariants())
}

func TestTagNames(t *testing.T) {
	a, err := InternTag("a.b-c:1/x_y")
	require.NoError(t, err)
	again, _ := InternTag("a.b-c:1/x_y")
	assert.Equal(t, a, again, "a tag is named once")
	got, ok := LookupTag("a.b-c:1/x_y")
	assert.True(t, ok)
	assert.Equal(t, a, got)
	assert.Equal(t, "a.b-c:1/x_y", TagName(a))
	for _, bad := range []string{"", "a,b", "a b", "tab\t", "é", string(make([]byte, MaxTagName+1))} {
		_, err := InternTag(bad)
		var ie *InputError
		assert.True(t, errors.As(err, &ie), "%q: %v", bad, err)
	}
	_, ok = LookupTag("never named")
	assert.False(t, ok)
}

// Each tag has its own pool: a slot of a small segment, a cached block,
// never hold memory of two tags; the pools' memory lies in the device's
// segments of its tag.
func TestTagsAreKeptApart(t *testing.T) {
	a, dev, w, kv := sleepAllocator(t, 1<<30)
	u := mallocTagged(t, a, 0, 1000, 1)
	x := mallocTagged(t, a, w, 1000, 1)
	y := mallocTagged(t, a, kv, 1000, 1)
	assert.NotSame(t, a.findSegment(u), a.findSegment(x), "small segments never mix tags")
	assert.NotSame(t, a.findSegment(x), a.findSegment(y))
	assert.Equal(t, w, a.tagOf(x))
	big := mallocTagged(t, a, w, 8*mib, 1)
	require.NoError(t, a.Free(big, 8*mib, 1))
	again := mallocTagged(t, a, 0, 8*mib, 1)
	assert.NotEqual(t, big, again, "an untagged request does not get the tag's cached block")
	assert.Equal(t, big, mallocTagged(t, a, w, 8*mib, 1), "the tag's own request does")
	ph := func(p uintptr) arena.PhysHandle { h, _ := dev.Phys().HandleAt(p); return h }
	assert.NotEqual(t, ph(u), ph(x))
	assert.NotEqual(t, ph(x), ph(y))
	// The C++ class's path: the zero pool id takes the tag, a named pool
	// does not.
	p, err := a.MallocInTagged(kv, PoolID{}, 3*mib, 0, 1, 0)
	require.NoError(t, err)
	assert.Equal(t, kv, a.tagOf(p))
	require.NoError(t, a.IncrefPool(PoolID{0, 9}))
	q, err := a.MallocInTagged(kv, PoolID{0, 9}, 3*mib, 0, 1, 0)
	require.NoError(t, err)
	assert.Zero(t, a.tagOf(q), "a named pool's allocation is untagged")
	check(t, a, dev)
}

// Sleep releases the tags' memory and the free cache: memory_reserved()
// drops by what was released, to the untagged live memory; the offloaded
// tag comes back byte for byte, at its addresses, the discarded one
// usable; the figures come back on wake.
func TestSleepStatsDropAndReturn(t *testing.T) {
	a, dev, w, kv := sleepAllocator(t, 1<<30)
	weights := mallocTagged(t, a, w, 64*mib, 1)
	small := mallocTagged(t, a, w, 3000, 1)
	cache := mallocTagged(t, a, kv, 32*mib, 2)
	live := mallocTagged(t, a, 0, 16*mib, 1)
	freed := mallocTagged(t, a, 0, 8*mib, 1)
	require.NoError(t, a.Free(freed, 8*mib, 1)) // cached in the general cache
	cw, cs := writeCookie(t, dev, weights, 64*mib), writeCookie(t, dev, small, 3000)
	before := a.Stats()
	check(t, a, dev)

	res, err := a.Sleep([]Tag{w})
	require.NoError(t, err)
	check(t, a, dev)
	st := a.Stats()
	assert.EqualValues(t, 64*mib+uint64(classSegment[sizeToClass[(3000+classAlign-1)/classAlign]]), res.Offloaded, "the weights' block and small segment")
	assert.EqualValues(t, before.ReservedBytes[StatAll].Current-st.ReservedBytes[StatAll].Current, res.Released)
	assert.EqualValues(t, 16*mib, st.ReservedBytes[StatAll].Current, "the device holds the untagged live memory alone")
	assert.EqualValues(t, dev.Phys().Used(), st.ReservedBytes[StatAll].Current)
	assert.Equal(t, before.AllocatedBytes[StatAll].Current, st.AllocatedBytes[StatAll].Current, "the tensors live on")
	assert.EqualValues(t, 96*mib+st.AsleepBytes-96*mib, st.AsleepBytes)
	assert.GreaterOrEqual(t, st.AsleepBytes, int64(96*mib))
	assert.EqualValues(t, res.Offloaded, st.OffloadedBytes)
	assert.True(t, a.Asleep())

	wr, err := a.Wake(nil)
	require.NoError(t, err)
	check(t, a, dev)
	assert.Equal(t, []Tag{w, kv}, wr.Woken)
	assert.Equal(t, res.Offloaded, wr.Restored)
	got, err := dev.Phys().Read(weights, 64*mib)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(cw, got), "the weights came back byte for byte")
	got, err = dev.Phys().Read(small, 3000)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(cs, got))
	c := writeCookie(t, dev, cache, 32*mib)
	got, err = dev.Phys().Read(cache, 32*mib)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(c, got), "the discarded tag is usable")
	st = a.Stats()
	assert.Zero(t, st.AsleepBytes)
	assert.Zero(t, st.OffloadedBytes)
	assert.EqualValues(t, 16*mib+wr.Mapped, st.ReservedBytes[StatAll].Current, "what wake mapped comes back")
	assert.False(t, a.Asleep())
	_ = live
}

// While a tag is asleep, an allocation in it is refused, untagged ones use
// what the sleep gave back, and frees of its blocks (also a free waiting
// for another stream) take effect on wake.
func TestFreesAndAllocationsWhileAsleep(t *testing.T) {
	a, dev, w, kv := sleepAllocator(t, 512*mib)
	keep := mallocTagged(t, a, w, 100*mib, 1)
	gone := mallocTagged(t, a, w, 100*mib, 1)
	slot := mallocTagged(t, a, w, 1000, 1)
	shared := mallocTagged(t, a, kv, 100*mib, 1)
	require.NoError(t, a.RecordStream(shared, 7))
	ck := writeCookie(t, dev, keep, 100*mib)
	_, err := a.Sleep([]Tag{w, kv})
	require.NoError(t, err)
	_, err = a.MallocTagged(w, mib, 1)
	var se *StateError
	require.True(t, errors.As(err, &se), "%v", err)
	assert.Contains(t, err.Error(), `"weights"`)
	train := mallocTagged(t, a, 0, 400*mib, 3)
	assert.NotZero(t, train, "untagged memory takes what the sleep gave back")
	require.NoError(t, a.Free(train, 400*mib, 3))

	asleep := a.Stats().AsleepBytes
	require.NoError(t, a.Free(gone, 100*mib, 1))
	require.NoError(t, a.Free(slot, 1000, 1))
	require.NoError(t, a.Free(shared, 100*mib, 1)) // waits for stream 7
	check(t, a, dev)
	assert.Less(t, a.Stats().AsleepBytes, asleep-100*mib, "freed at once, out of what is asleep")
	_, err = a.Malloc(mib, 1) // polls the deferred free, which completes
	require.NoError(t, err)
	check(t, a, dev)
	assert.EqualValues(t, 100*mib, a.Stats().AsleepBytes, "only the block kept is asleep")

	wr, err := a.Wake([]Tag{w})
	require.NoError(t, err)
	assert.EqualValues(t, 100*mib, wr.Mapped, "the freed blocks are not mapped again")
	got, err := dev.Phys().Read(keep, 100*mib)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(ck, got))
	check(t, a, dev)
	_, err = a.Wake(nil)
	require.NoError(t, err, "kv holds nothing, and wakes")
	check(t, a, dev)
}

// Refusals: a clear error, and nothing changed.
func TestSleepRefusals(t *testing.T) {
	a, dev, w, _ := sleepAllocator(t, 1<<30)
	mallocTagged(t, a, w, 8*mib, 1)
	var se *StateError
	_, err := a.Wake(nil)
	require.True(t, errors.As(err, &se), "wake_up without sleep: %v", err)
	assert.Contains(t, err.Error(), "nothing is asleep")

	const C = arena.Stream(0xc0)
	dev.Sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(PoolID{1, 1}))
	_, err = a.Sleep(nil)
	require.True(t, errors.As(err, &se), "during a capture: %v", err)
	assert.Contains(t, err.Error(), "capture")
	require.NoError(t, a.EndAllocateToPool(PoolID{1, 1}))
	dev.Sim.SetCapture(C, arena.CaptureNone)
	assert.False(t, a.Asleep())
	check(t, a, dev)

	_, err = a.Sleep(nil)
	require.NoError(t, err)
	_, err = a.Sleep(nil)
	require.True(t, errors.As(err, &se), "sleep twice: %v", err)
	assert.Contains(t, err.Error(), `"weights"`)
	other, _ := InternTag("other")
	_, err = a.Wake([]Tag{other})
	require.True(t, errors.As(err, &se), "a tag not asleep: %v", err)
	check(t, a, dev)
	_, err = a.Wake(nil)
	require.NoError(t, err)

	// backend:async cannot.
	async, _ := newTestAllocator(t, DefaultConfig())
	_, err = async.Sleep(nil)
	require.ErrorIs(t, err, ErrNeedsVMM)
	_, err = async.Wake(nil)
	require.ErrorIs(t, err, ErrNeedsVMM)
	p, err := async.MallocTagged(w, mib, 1)
	require.NoError(t, err, "tags are kept apart there too, and never sleep")
	require.NoError(t, async.Free(p, mib, 1))
	require.NoError(t, async.CheckInvariants())
}

// Out of memory on wake, from the device here and from the cap below, is
// an OOMError: the tag stays asleep, and wakes once memory is freed.
func TestWakeOutOfMemoryIsRetryable(t *testing.T) {
	a, dev, w, _ := sleepAllocator(t, 256*mib)
	p := mallocTagged(t, a, w, 128*mib, 1)
	c := writeCookie(t, dev, p, 128*mib)
	_, err := a.Sleep([]Tag{w})
	require.NoError(t, err)
	u := mallocTagged(t, a, 0, 200*mib, 1)
	res, err := a.Wake(nil)
	var oom *OOMError
	require.True(t, errors.As(err, &oom), "%v", err)
	require.ErrorIs(t, err, arena.ErrOutOfMemory)
	assert.Contains(t, err.Error(), `wake_up of memory tag "weights"`)
	assert.Empty(t, res.Woken)
	assert.True(t, a.Asleep())
	check(t, a, dev)
	require.NoError(t, a.Free(u, 200*mib, 1))
	_, err = a.Wake(nil)
	require.NoError(t, err, "the free cache is reclaimed for the wake")
	got, err := dev.Phys().Read(p, 128*mib)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(c, got))
	check(t, a, dev)

	// Under a cap: what is asleep is out of the cap's count, so untagged
	// memory can use it, and the wake then does not fit.
	require.NoError(t, a.SetLimit(192*mib))
	_, err = a.Sleep([]Tag{w})
	require.NoError(t, err)
	u = mallocTagged(t, a, 0, 120*mib, 1)
	_, err = a.Wake(nil)
	require.True(t, errors.As(err, &oom), "%v", err)
	check(t, a, dev)
	require.NoError(t, a.Free(u, 120*mib, 1))
	_, err = a.Wake(nil)
	require.NoError(t, err)
	check(t, a, dev)
}

// A CUDA graph's private pool never sleeps: its memory stays mapped at its
// addresses through a cycle, with the tagged memory it read back beside it.
func TestGraphPoolsSurviveASleep(t *testing.T) {
	a, dev, w, _ := sleepAllocator(t, 1<<30)
	weights := mallocTagged(t, a, w, 16*mib, 1)
	cw := writeCookie(t, dev, weights, 16*mib)
	const C = arena.Stream(0xc0)
	id := PoolID{1, 3}
	dev.Sim.SetCapture(C, arena.CaptureActive)
	require.NoError(t, a.BeginAllocateToPool(id))
	out, err := a.MallocTagged(w, 4*mib, C) // in the graph's pool, untagged
	require.NoError(t, err)
	require.NoError(t, a.EndAllocateToPool(id))
	dev.Sim.SetCapture(C, arena.CaptureNone)
	assert.Zero(t, a.tagOf(out))
	co := writeCookie(t, dev, out, 4*mib)
	_, err = a.Sleep([]Tag{w})
	require.NoError(t, err)
	got, err := dev.Phys().Read(out, 4*mib)
	require.NoError(t, err, "the graph's memory is still mapped")
	assert.True(t, bytes.Equal(co, got))
	_, err = a.Wake(nil)
	require.NoError(t, err)
	got, err = dev.Phys().Read(weights, 16*mib)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(cw, got))
	check(t, a, dev)
}

// PrepareSleep pins the host area without the allocator's mutex: a thread
// allocating while it pins is served (under the mutex it would wait for the
// pinning, and here deadlock), and the sleep after it pins nothing.
func TestPrepareSleepLetsAllocationsGoOn(t *testing.T) {
	a, dev, weights, _ := sleepAllocator(t, 1<<30)
	p := mallocTagged(t, a, weights, 8*mib, 1)
	var during uintptr
	dev.Phys().FailHost = func(uint64) error {
		done := make(chan error, 1)
		go func() {
			var err error
			during, err = a.Malloc(mib, 2)
			done <- err
		}()
		return <-done
	}
	n, err := a.PrepareSleep(8 * mib)
	require.NoError(t, err)
	dev.Phys().FailHost = nil
	assert.NotZero(t, during)
	assert.GreaterOrEqual(t, n, uint64(8*mib))
	pinned := dev.Phys().Calls["cuMemHostAlloc"]
	_, err = a.Sleep([]Tag{weights})
	require.NoError(t, err)
	assert.Equal(t, pinned, dev.Phys().Calls["cuMemHostAlloc"], "the sleep pinned nothing")
	_, err = a.Wake(nil)
	require.NoError(t, err)
	require.NoError(t, a.Free(p, 8*mib, 1))
	require.NoError(t, a.Free(during, mib, 2))
	check(t, a, dev)
}
