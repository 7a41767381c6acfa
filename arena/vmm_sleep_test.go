package arena

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sleepPlacement is segmentsOnly with the fake driver's copies, which sleep
// and wake need.
func sleepPlacement(t *testing.T, capacity, limit uint64) (*vmmSegments, *FakePhys, *Sim) {
	e, phys, sim := segmentsOnly(t, capacity, limit)
	e.copier = phys
	return e, phys, sim
}

// cookie writes n random bytes (seeded by p) at p and returns them.
func cookie(t *testing.T, phys *FakePhys, p uintptr, n uint64) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.New(rand.NewSource(int64(p))).Read(b)
	require.NoError(t, phys.Write(p, b))
	return b
}

// sparseCookie writes 4 KiB of random bytes every 16 MiB of [p, p+n) and
// at its end, and returns a check that they are there.
func sparseCookie(t *testing.T, phys *FakePhys, p uintptr, n uint64) func() {
	t.Helper()
	var at []uintptr
	for off := uint64(0); off+4096 <= n; off += 16 * mib {
		at = append(at, p+uintptr(off))
	}
	at = append(at, p+uintptr(n)-4096)
	want := map[uintptr][]byte{}
	for _, q := range at {
		want[q] = cookie(t, phys, q, 4096)
	}
	return func() {
		t.Helper()
		for _, q := range at {
			assert.Equal(t, want[q], readBack(t, phys, q, 4096), "at %#x", q)
		}
	}
}

func readBack(t *testing.T, phys *FakePhys, p uintptr, n uint64) []byte {
	t.Helper()
	b, err := phys.Read(p, n)
	require.NoError(t, err)
	return b
}

func allocTagged(t *testing.T, e *vmmSegments, n uint64, s Stream, tag Tag) uintptr {
	t.Helper()
	p, err := e.AllocTagged(n, s, tag)
	require.NoError(t, err)
	return p
}

// Tagged memory lies in segments of its own: a tagged and an untagged
// request of a few bytes each, on one stream, never share a handle.
func TestSleepTagsNeverShareAHandle(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 0)
	a := allocTagged(t, e, 1024, 1, 0)
	b := allocTagged(t, e, 1024, 1, 7)
	c := allocTagged(t, e, 1024, 1, 8)
	ha, _ := phys.HandleAt(a)
	hb, _ := phys.HandleAt(b)
	hc, _ := phys.HandleAt(c)
	assert.NotEqual(t, ha, hb)
	assert.NotEqual(t, hb, hc)
	assert.Len(t, e.segs, 3, "a segment per stream and tag")
	assert.Equal(t, a+1024, allocTagged(t, e, 1024, 1, 0), "untagged requests still pack")
	assert.Equal(t, b+1024, allocTagged(t, e, 1024, 1, 7), "and so do a tag's")
	require.NoError(t, e.CheckInvariants())
}

// Sleep releases every handle of the tag's segments and keeps their VA;
// wake maps the same addresses again, the live spans' granules only, and
// the offloaded contents come back byte for byte. Untagged memory is never
// touched.
func TestSleepAndWakeKeepAddressesAndContents(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 0)
	w1 := allocTagged(t, e, 10*mib, 1, 5)
	gap := allocTagged(t, e, 20*mib, 1, 5)
	w2 := allocTagged(t, e, 3*mib+512, 1, 5)
	u := allocTagged(t, e, 6*mib, 1, 0)
	require.NoError(t, e.Free(gap, 1, true))
	c1, c2, cu := cookie(t, phys, w1, 10*mib), cookie(t, phys, w2, 3*mib+512), cookie(t, phys, u, 6*mib)
	heldBefore, untagged := e.held, uint64(6*mib)
	copied := phys.CopiedBytes

	rep, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.NoError(t, err)
	require.NoError(t, e.CheckInvariants())
	assert.EqualValues(t, 10*mib+3*mib+512, rep.Offloaded, "the live spans, not the free one")
	assert.Equal(t, rep.Offloaded, phys.CopiedBytes-copied)
	assert.Equal(t, heldBefore-untagged, rep.Released, "every handle of the tag")
	assert.Equal(t, untagged, e.held)
	assert.Equal(t, e.held, phys.Used())
	_, mapped := phys.HandleAt(w1)
	assert.False(t, mapped, "nothing is mapped under a sleeping tag")
	assert.True(t, bytes.Equal(cu, readBack(t, phys, u, 6*mib)), "untagged memory is untouched")
	_, err = e.AllocTagged(1*mib, 1, 5)
	assert.ErrorIs(t, err, ErrTagAsleep)
	assert.Equal(t, []Tag{5}, e.sleepState().Asleep)
	assert.Equal(t, rep.Offloaded, e.sleepState().Offloaded)

	wr, err := e.Wake(5)
	require.NoError(t, err)
	require.NoError(t, e.CheckInvariants())
	assert.True(t, bytes.Equal(c1, readBack(t, phys, w1, 10*mib)), "at the same address, byte for byte")
	assert.True(t, bytes.Equal(c2, readBack(t, phys, w2, 3*mib+512)))
	assert.Equal(t, rep.Offloaded, wr.Restored)
	assert.EqualValues(t, 14*mib, wr.Mapped, "the granules the live spans touch: 5 + 2, not the free span's")
	assert.Equal(t, untagged+wr.Mapped, e.held)
	assert.Zero(t, e.sleepState().Offloaded)
	assert.Empty(t, e.sleepState().Asleep)
	p := allocTagged(t, e, 1*mib, 1, 5)
	assert.NotZero(t, p, "the tag takes allocations again")
	require.NoError(t, e.CheckInvariants())
}

// A tag slept without offload wakes usable, with contents undefined (the
// fake driver's fresh handles read as zeros); only the offloaded tags'
// bytes are copied.
func TestSleepDiscardsTheTagsNotOffloaded(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 0)
	w := allocTagged(t, e, 4*mib, 1, 5)
	kv := allocTagged(t, e, 8*mib, 2, 6)
	cw := cookie(t, phys, w, 4*mib)
	cookie(t, phys, kv, 8*mib)
	copied := phys.CopiedBytes
	rep, err := e.Sleep(SleepRequest{Tags: []Tag{5, 6}, Offload: []Tag{5}})
	require.NoError(t, err)
	assert.EqualValues(t, 4*mib, rep.Offloaded)
	assert.EqualValues(t, 4*mib, phys.CopiedBytes-copied, "the discarded tag is not copied")
	assert.Zero(t, e.held)
	_, err = e.Wake(6)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 8*mib), readBack(t, phys, kv, 8*mib), "discarded: fresh memory")
	c := cookie(t, phys, kv, 8*mib)
	assert.True(t, bytes.Equal(c, readBack(t, phys, kv, 8*mib)), "and usable")
	assert.Equal(t, []Tag{5}, e.sleepState().Asleep, "the other tag sleeps on")
	_, err = e.Wake(5)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(cw, readBack(t, phys, w, 4*mib)))
	require.NoError(t, e.CheckInvariants())
}

// The copies are pieces of at most copyChunk bytes spread over copyStreams
// streams; the offload area and the streams are made at the first sleep
// and reused by the next.
func TestSleepCopiesInChunksOnStreamsPreparedOnce(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 4<<30, 0)
	p := allocTagged(t, e, 5*copyChunk/2, 1, 5)
	check := sparseCookie(t, phys, p, 5*copyChunk/2)
	for cycle := 0; cycle < 2; cycle++ {
		dtoh := phys.Calls["cuMemcpyDtoHAsync"]
		_, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
		require.NoError(t, err)
		assert.Equal(t, 3, phys.Calls["cuMemcpyDtoHAsync"]-dtoh, "three pieces")
		_, err = e.Wake(5)
		require.NoError(t, err)
		check()
		if cycle == 1 {
			assert.Equal(t, 1, phys.Calls["cuMemHostAlloc"], "the offload area is pinned once")
			assert.Equal(t, copyStreams, phys.Calls["cuStreamCreate"], "and its streams made once")
			assert.Equal(t, copyStreams, phys.CopyStreams())
		}
	}
	assert.EqualValues(t, 3*copyChunk, e.sleepState().HostArea, "the area in steps of hostAlign")
	require.NoError(t, e.Close())
	assert.Zero(t, phys.HostUsed(), "Close frees the area")
	assert.Zero(t, phys.CopyStreams(), "and the streams")
}

// Memory in use by streams is released only once the work queued on it
// before the sleep has completed: the host waits for events of those
// streams alone (a stream's work up to the event completes, no other's),
// and a pending span's event (a free on another stream) is waited for too.
func TestSleepReleasesOnlyAfterTheEventsComplete(t *testing.T) {
	e, phys, sim := sleepPlacement(t, 1<<30, 0)
	live := allocTagged(t, e, 4*mib, 1, 5)
	pend := allocTagged(t, e, 4*mib, 1, 5)
	sim.Launch(1)
	sim.Launch(2)
	require.NoError(t, e.Free(pend, 2, false)) // pending on stream 2, after its work
	work1, _ := sim.NewEvent()
	require.NoError(t, sim.RecordEvent(work1, 1))
	work2, _ := sim.NewEvent()
	require.NoError(t, sim.RecordEvent(work2, 2))
	other, _ := sim.NewEvent()
	sim.Launch(3)
	require.NoError(t, sim.RecordEvent(other, 3))
	phys.OnUnmap = func(va uintptr, size uint64) error {
		for _, ev := range []Event{work1, work2} {
			if done, _ := sim.EventDone(ev); !done {
				return fmt.Errorf("unmap of %#x before the work queued on it completed", va)
			}
		}
		return nil
	}
	syncs := sim.Syncs
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}})
	require.NoError(t, err)
	assert.Zero(t, e.held)
	assert.Equal(t, syncs, sim.Syncs, "no device-wide synchronisation")
	done, _ := sim.EventDone(other)
	assert.False(t, done, "a stream that uses none of the memory is not waited for")
	assert.NotZero(t, sim.EventWaits)
	_ = live
	require.NoError(t, e.CheckInvariants())

	// A stream that never completes: the sleep fails and changes nothing.
	e2, _, sim2 := sleepPlacement(t, 1<<30, 0)
	p := allocTagged(t, e2, 4*mib, 9, 5)
	sim2.Launch(9)
	sim2.Stall(9)
	held := e2.held
	_, err = e2.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.Error(t, err)
	assert.Equal(t, held, e2.held, "nothing released")
	assert.Empty(t, e2.sleepState().Asleep)
	require.NoError(t, e2.CheckInvariants())
	require.NoError(t, e2.Free(p, 9, false))
	_, err = e2.AllocTagged(1*mib, 9, 5)
	assert.NoError(t, err, "the tag is awake")
}

// A span of a segment that step 1 placed for another stream (its complete
// free span, taken where it lies) is that stream's to use: the sleep waits
// for its work too before it copies and unmaps.
func TestSleepWaitsForTheStreamsASegmentServed(t *testing.T) {
	e, phys, sim := sleepPlacement(t, 1<<30, 0)
	p := allocTagged(t, e, 4*mib, 1, 5)
	require.NoError(t, e.Free(p, 1, true))
	q := allocTagged(t, e, 4*mib, 2, 5)
	require.Equal(t, p, q, "stream 1's complete span serves stream 2 where it lies")
	sim.Launch(2) // stream 2's work on it
	work, _ := sim.NewEvent()
	require.NoError(t, sim.RecordEvent(work, 2))
	phys.OnUnmap = func(va uintptr, size uint64) error {
		if done, _ := sim.EventDone(work); !done {
			return fmt.Errorf("unmap of %#x before stream 2's work on it completed", va)
		}
		return nil
	}
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.NoError(t, err)
	done, _ := sim.EventDone(work)
	assert.True(t, done, "the sleep waited for stream 2")
	require.NoError(t, e.CheckInvariants())
}

// A tag's draining spans (handles lent within its share) are unmapped at
// the sleep, and their handles released with their owners'.
func TestSleepReleasesDrainingMappings(t *testing.T) {
	e, phys, sim := sleepPlacement(t, 1<<30, 0)
	p1 := allocTagged(t, e, 8*mib, 1, 5)
	allocTagged(t, e, 2*mib, 1, 5)
	p2 := allocTagged(t, e, 8*mib, 1, 5)
	allocTagged(t, e, 2*mib, 1, 5)
	sim.Launch(1)
	require.NoError(t, e.Free(p1, 1, false))
	require.NoError(t, e.Free(p2, 1, false))
	allocTagged(t, e, 24*mib, 1, 5) // lends the free spans' handles: they drain
	require.NotEmpty(t, e.draining)
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.NoError(t, err)
	assert.Empty(t, e.draining)
	assert.Empty(t, e.drainMaps)
	assert.Zero(t, phys.Handles(), "every handle released")
	require.NoError(t, e.CheckInvariants())
	_, err = e.Wake(5)
	require.NoError(t, err)
	require.NoError(t, e.CheckInvariants())
}

// A free of sleeping memory is complete at once, and takes effect on wake:
// its granules are not mapped again; a segment left with nothing gives its
// VA back.
func TestSleepFreesWhileAsleep(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 0)
	a := allocTagged(t, e, 8*mib, 1, 5)
	b := allocTagged(t, e, 8*mib, 1, 5)
	only := allocTagged(t, e, 2*mib, 2, 5)
	cb := cookie(t, phys, b, 8*mib)
	rep, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.NoError(t, err)
	require.NoError(t, e.Free(a, 1, false))
	require.NoError(t, e.Free(only, 2, false))
	require.NoError(t, e.CheckInvariants())
	assert.Len(t, e.segs, 1, "stream 2's segment held nothing more: its VA went back")
	assert.Equal(t, rep.Offloaded-10*mib, e.sleepState().Offloaded, "their host copies went with them")
	wr, err := e.Wake(5)
	require.NoError(t, err)
	assert.EqualValues(t, 8*mib, wr.Mapped, "the freed span's granules are not mapped")
	assert.True(t, bytes.Equal(cb, readBack(t, phys, b, 8*mib)))
	_, ok := phys.HandleAt(a)
	assert.False(t, ok)
	q := allocTagged(t, e, 8*mib, 1, 5)
	assert.Equal(t, a, q, "the hole is filled where the freed span was")
	require.NoError(t, e.CheckInvariants())
}

// Out of memory on wake (the cap here, the device's refusal below) comes
// before any mapping or is undone: the tag stays asleep, whole, and wakes
// once memory is freed.
func TestWakeOutOfMemoryLeavesTheTagAsleep(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 64*mib)
	w := allocTagged(t, e, 40*mib, 1, 5)
	c := cookie(t, phys, w, 40*mib)
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.NoError(t, err)
	u := allocTagged(t, e, 40*mib, 1, 0) // takes what sleep released
	before := calls(phys)
	_, err = e.Wake(5)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Equal(t, before, calls(phys), "refused before any driver call")
	assert.Equal(t, []Tag{5}, e.sleepState().Asleep)
	require.NoError(t, e.CheckInvariants())

	// Freed, the untagged memory stays mapped, free: the wake trims it.
	require.NoError(t, e.Free(u, 1, true))
	n := 0
	phys.FailCreate = func(uint64) error {
		if n++; n == 10 {
			return fmt.Errorf("cuMemCreate refused: %w", ErrOutOfMemory)
		}
		return nil
	}
	held := e.held
	_, err = e.Wake(5)
	require.ErrorIs(t, err, ErrOutOfMemory, "the device refused midway")
	assert.Equal(t, []Tag{5}, e.sleepState().Asleep, "still asleep, whole")
	assert.LessOrEqual(t, e.held, held, "what the wake mapped is released")
	assert.Equal(t, e.held, phys.Used())
	require.NoError(t, e.CheckInvariants())
	phys.FailCreate = nil
	_, err = e.Wake(5)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(c, readBack(t, phys, w, 40*mib)))
	assert.LessOrEqual(t, e.held, uint64(64*mib))
	require.NoError(t, e.CheckInvariants())
}

// Sleep and wake refuse what they cannot do, and change nothing.
func TestSleepRefusals(t *testing.T) {
	e, _, _ := segmentsOnly(t, 1<<30, 0)
	allocTagged(t, e, mib, 1, 5)
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}})
	assert.ErrorIs(t, err, ErrNoSleep, "a driver without copies")
	e.copier = e.drv.(HostCopier)
	for _, req := range []SleepRequest{
		{Tags: []Tag{0}},
		{Tags: []Tag{5, 5}},
		{Tags: []Tag{5}, Offload: []Tag{6}},
	} {
		_, err := e.Sleep(req)
		assert.Error(t, err, "%+v", req)
		assert.Empty(t, e.sleepState().Asleep)
	}
	_, err = e.Wake(5)
	assert.ErrorIs(t, err, ErrNotAsleep)
	_, err = e.Sleep(SleepRequest{Tags: []Tag{5}})
	require.NoError(t, err)
	_, err = e.Sleep(SleepRequest{Tags: []Tag{6}})
	assert.ErrorIs(t, err, ErrTagAsleep, "one sleep at a time")
	_, err = e.Wake(6)
	assert.ErrorIs(t, err, ErrNotAsleep)
	require.NoError(t, e.CheckInvariants())
}

// A release the driver fails midway leaves a consistent state: the tag is
// asleep, what was not released stays mapped and counted, and a wake puts
// everything back.
func TestSleepReleaseFailureIsConsistent(t *testing.T) {
	e, phys, _ := sleepPlacement(t, 1<<30, 0)
	p := allocTagged(t, e, 9*mib, 1, 5)
	allocTagged(t, e, 9*mib, 1, 5)
	c := cookie(t, phys, p, 9*mib)
	n := 0
	phys.OnUnmap = func(uintptr, uint64) error {
		if n++; n == 4 {
			return errors.New("cuMemUnmap failed")
		}
		return nil
	}
	_, err := e.Sleep(SleepRequest{Tags: []Tag{5}, Offload: []Tag{5}})
	require.Error(t, err)
	phys.OnUnmap = nil
	assert.Equal(t, []Tag{5}, e.sleepState().Asleep)
	assert.NotZero(t, e.held, "what was not released is counted")
	assert.Equal(t, e.held, phys.Used())
	require.NoError(t, e.CheckInvariants())
	_, err = e.Wake(5)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(c, readBack(t, phys, p, 9*mib)))
	assert.EqualValues(t, 18*mib, e.held, "the two live spans' nine granules, nothing more")
	require.NoError(t, e.CheckInvariants())
}

// simVMMWithTaggedBlock is a simulated VMM device of 2 MiB handles with a
// block of 6 MiB tagged 3 on stream 1 (closed when the test ends).
func simVMMWithTaggedBlock(t *testing.T) (*SimVMM, uintptr) {
	t.Helper()
	d, err := NewSimVMMWith(0, 1<<30, VMMLayout{Handle: 2 * mib})
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	d.SetAllocTag(3)
	p, err := d.Alloc(6*mib, 1)
	require.NoError(t, err)
	d.SetAllocTag(0)
	return d, p
}

// Through the simulated VMM device: the allocation tag set before an
// allocation places it, sleep is refused while a capture is underway, and
// the device's figures follow.
func TestSimVMMSleepsThroughTheSource(t *testing.T) {
	d, p := simVMMWithTaggedBlock(t)
	q, err := d.Alloc(2*mib, 1)
	require.NoError(t, err)
	c := make([]byte, 6*mib)
	rand.New(rand.NewSource(1)).Read(c)
	require.NoError(t, d.Phys().Write(p, c))
	d.SetCaptureUnderway(true)
	_, err = d.Sleep(SleepRequest{Tags: []Tag{3}, Offload: []Tag{3}})
	assert.Error(t, err, "refused during a capture")
	d.SetCaptureUnderway(false)
	rep, err := d.Sleep(SleepRequest{Tags: []Tag{3}, Offload: []Tag{3}})
	require.NoError(t, err)
	u, _ := d.PoolUsage()
	assert.EqualValues(t, 2*mib, u.ReservedCurrent, "only the untagged granule is held")
	assert.EqualValues(t, 6*mib, rep.Released)
	free, total, _ := d.MemInfo()
	assert.Equal(t, total-2*mib, free)
	_, err = d.Wake(3)
	require.NoError(t, err)
	got, err := d.Phys().Read(p, 6*mib)
	require.NoError(t, err)
	assert.Equal(t, c, got)
	require.NoError(t, d.Free(p, 6*mib, 1))
	require.NoError(t, d.Free(q, 2*mib, 1))
	require.NoError(t, d.CheckInvariants())
}

// PrepareOffload pins the offload area without the source's lock: an
// allocation made while the driver pins completes (under the lock it would
// wait for the pinning, and here deadlock), and the sleep that follows
// pins nothing more. A prepare while asleep is refused and frees what it
// pinned; one smaller than the area is a no-op.
func TestPrepareOffloadPinsWithoutTheLock(t *testing.T) {
	d, p := simVMMWithTaggedBlock(t)
	var during uintptr
	d.Phys().FailHost = func(uint64) error {
		done := make(chan error, 1)
		go func() {
			var err error
			during, err = d.Alloc(mib, 2)
			done <- err
		}()
		return <-done
	}
	n, err := d.PrepareOffload(6 * mib)
	require.NoError(t, err)
	assert.NotZero(t, during, "an allocation went on while the area was pinned")
	d.Phys().FailHost = nil
	assert.EqualValues(t, hostAlign, n, "whole steps")
	pinned := d.Phys().Calls["cuMemHostAlloc"]

	rep, err := d.Sleep(SleepRequest{Tags: []Tag{3}, Offload: []Tag{3}})
	require.NoError(t, err)
	assert.EqualValues(t, 6*mib, rep.Offloaded)
	assert.Equal(t, pinned, d.Phys().Calls["cuMemHostAlloc"], "the sleep pinned nothing")
	n, err = d.PrepareOffload(2 * hostAlign)
	assert.ErrorContains(t, err, "holds 6291456 bytes of memory asleep")
	assert.EqualValues(t, hostAlign, n)
	assert.Equal(t, d.Phys().Calls["cuMemHostAlloc"], d.Phys().Calls["cuMemFreeHost"]+1, "what it pinned is freed")
	_, err = d.Wake(3)
	require.NoError(t, err)
	n, err = d.PrepareOffload(mib)
	require.NoError(t, err)
	assert.EqualValues(t, hostAlign, n, "never shrinks")
	require.NoError(t, d.Free(p, 6*mib, 1))
	require.NoError(t, d.Free(during, mib, 2))
	require.NoError(t, d.CheckInvariants())
}
