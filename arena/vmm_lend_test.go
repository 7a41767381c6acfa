package arena

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Another stream's free memory whose last use is still queued serves a
// request at once: the request's stream waits for the free's event
// (cuStreamWaitEvent), the handles are mapped at the new place and drain
// at the old one, and held does not grow. On a GPU the host runs ahead of
// the device, so such frees are the usual case: without this, FSDP's
// all-gather stream creates memory for every layer while the compute
// stream's frees sit free (BENCHMARKS.md has the GPU's figures).
func TestSegmentsLendAcrossStreamsWithAWait(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	sim.Launch(1) // the work using p, still running
	require.NoError(t, e.Free(p, 1, false))
	_, err = e.Alloc(8*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 8*mib, e.Held(), "stream 1's free memory serves stream 2")
	assert.Equal(t, 4, phys.Calls["cuMemCreate"], "nothing created for stream 2")
	assert.Equal(t, 1, phys.Calls["cuStreamWaitEvent"])
	assert.Zero(t, phys.Calls["cuMemUnmap"], "nothing still in use is unmapped")
	assert.Equal(t, [][3]uint64{{0, 8, spanDraining}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	require.NoError(t, e.CheckInvariants())

	// Stream 2's work from now on runs after stream 1's.
	ev, err := sim.NewEvent()
	require.NoError(t, err)
	sim.Launch(2)
	require.NoError(t, sim.RecordEvent(ev, 2))
	sim.Complete(2)
	done, err := sim.EventDone(ev)
	require.NoError(t, err)
	assert.False(t, done, "stream 2 waits for stream 1")
	sim.Complete(1)
	sim.Complete(2)
	done, err = sim.EventDone(ev)
	require.NoError(t, err)
	assert.True(t, done)

	// Once stream 1's free completes the old mapping goes, and with it
	// stream 1's segment.
	require.NoError(t, e.pollDraining())
	assert.Equal(t, 4, phys.Calls["cuMemUnmap"])
	assert.EqualValues(t, 8*mib, e.Held())
	assert.EqualValues(t, 8*mib, phys.Used())
	require.NoError(t, e.CheckInvariants())
}

// A request takes its own stream's free memory, in use or not, before
// other streams' complete memory: a stream whose complete memory is taken
// while its own frees still run can only create more, and the next
// request of the first would take it back, the two streams growing in
// turn.
func TestSegmentsGrowthTakesItsOwnFreeMemoryFirst(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	x, err := e.Alloc(8*mib, 2)
	require.NoError(t, err)
	_, err = e.Alloc(2*mib, 2)
	require.NoError(t, err)
	a, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	require.NoError(t, e.Free(a, 1, true)) // stream 1: 8 MiB free, complete
	sim.Launch(2)
	require.NoError(t, e.Free(x, 2, false)) // stream 2: 8 MiB free, still in use
	_, err = e.Alloc(10*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 18*mib, e.Held(), "nothing created")
	assert.Equal(t, 9, phys.Calls["cuMemCreate"])
	assert.Equal(t, [][3]uint64{{0, 6, spanFree}}, spanStates(e.streams[shareKey{s: 1}].segs[0]),
		"stream 1 gave one granule, what stream 2's own could not pay")
	assert.Zero(t, phys.Calls["cuStreamWaitEvent"], "its own frees need no wait")
	require.NoError(t, e.CheckInvariants())
}

// While a capture is underway no stream waits for another's event (a
// captured stream may not wait for an event recorded outside the
// capture): what is missing is created, and stream 1's memory stays.
func TestSegmentsLendAcrossStreamsNotDuringACapture(t *testing.T) {
	e, gate, sim := segmentsBehindGate(t)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	e.fenceAll() // its event recorded before the capture
	gate.underway.Store(true)
	_, err = e.Alloc(8*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 16*mib, e.Held())
	assert.Equal(t, [][3]uint64{{0, 8, spanFree}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	gate.underway.Store(false)
	require.NoError(t, e.CheckInvariants())
}

// A wait the driver refuses leaves the other stream's memory where it is:
// the request is served with memory created instead, and nothing fails.
func TestSegmentsLendAcrossStreamsRefusedWait(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	phys.FailStreamWait = func(Stream, Event) error { return errors.New("CUDA_ERROR_NOT_SUPPORTED") }
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	_, err = e.Alloc(8*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 16*mib, e.Held(), "created, not lent")
	assert.Equal(t, [][3]uint64{{0, 8, spanFree}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	require.NoError(t, e.CheckInvariants())
}

// Coalescing keeps the newer of two free spans' events, which covers both
// only when both were recorded on the segment's stream. So the pieces of
// another stream's span left free around what it lends are unrecorded, as
// after a free on their own stream, not given an event of the borrower's:
// here such an event would cover stream 1's work only up to the free the
// borrower waited for, and once a, freed later, coalesced with the piece,
// a's memory would look complete to stream 3 while stream 1 still used it.
func TestSegmentsLentPiecesStayTheirStreams(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	a, err := e.Alloc(1*mib, 1)
	require.NoError(t, err)
	b, err := e.Alloc(1*mib, 1)
	require.NoError(t, err)
	c, err := e.Alloc(9*mib, 1)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(c, 1, false))
	e.fenceAll() // c's free gets its event, as any stream's miss makes it
	lent := sim.Enqueued(1)
	sim.Launch(1) // stream 1's last use of a, after that event
	require.NoError(t, e.Free(a, 1, false))
	useA := sim.Enqueued(1)

	_, err = e.Alloc(2*mib, 2) // lends c's tail once it waits for c's event
	require.NoError(t, err)
	require.Equal(t, 1, phys.Calls["cuStreamWaitEvent"])
	sim.Launch(3)
	require.NoError(t, e.Free(b, 3, false))
	sim.Complete(3)
	require.NoError(t, e.pollPending()) // b is free: a, b and c's piece coalesce
	sim.CompleteThrough(1, lent)        // c's free is done, a's last use is not
	sim.Complete(2)

	q, err := e.Alloc(1*mib, 3)
	require.NoError(t, err)
	if q >= a && q < a+2*mib {
		assert.True(t, sim.OrderedAfter(3, 1, useA), "stream 3 got a's memory at %#x before stream 1's last use of it", q)
	}
	require.NoError(t, e.CheckInvariants())
}
