package arena

import (
	"errors"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// segmentsOnly makes a segments placement over a fake driver on a manual
// Sim, segments of capacity bytes of VA.
func segmentsOnly(t *testing.T, capacity, limit uint64) (*vmmSegments, *FakePhys, *Sim) {
	sim := NewSim(0, capacity)
	sim.SetManual(true)
	phys := NewFakePhys(sim, capacity, simVMMGranule)
	e, err := newVMMSegments(phys, capacity, limit)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	return e, phys, sim
}

// segmentsBehindGate is segmentsOnly (1 GiB, no cap) behind the capture
// gate that a VMM device puts between its placement and the driver, for
// tests of what the placement does while a capture is underway.
func segmentsBehindGate(t *testing.T) (*vmmSegments, *captureGate, *Sim) {
	sim := NewSim(0, 1<<30)
	sim.SetManual(true)
	gate := &captureGate{PhysDriver: NewFakePhys(sim, 1<<30, simVMMGranule)}
	e, err := newVMMSegments(gate, 1<<30, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	return e, gate, sim
}

// spanStates lists the spans of a segment as (offset in MiB, size in MiB,
// state) triples, for comparisons.
func spanStates(g *vmmSegment) [][3]uint64 {
	var out [][3]uint64
	for _, sp := range g.spanList() {
		out = append(out, [3]uint64{uint64(sp.base-g.base) / mib, sp.size / mib, uint64(sp.state)})
	}
	return out
}

func TestSegmentsSplitCoalesceAndSameStreamReuse(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(10*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, 5, phys.Calls["cuMemCreate"], "one handle per granule")
	assert.Equal(t, 5, phys.Calls["cuMemMap"])
	assert.Equal(t, 1, phys.Calls["cuMemSetAccess"], "access set once over the new granules")
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	before := calls(phys)
	a, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	b, err := e.Alloc(6*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, a, "the free span is split: its head first")
	assert.Equal(t, p+4*mib, b, "and its rest next")
	assert.Equal(t, before, calls(phys), "reuse on the same stream before the free completes calls no driver")
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, [][3]uint64{{0, 4, spanLive}, {4, 6, spanLive}}, spanStates(g))
	sim.Launch(1)
	require.NoError(t, e.Free(a, 1, false))
	require.NoError(t, e.Free(b, 1, false))
	assert.Equal(t, [][3]uint64{{0, 10, spanFree}}, spanStates(g), "neighbouring frees coalesce")
	assert.Equal(t, unrecorded, g.spanList()[0].event, "frees on the segment's own stream record no event")
	assert.Equal(t, e.seq, g.spanList()[0].seq, "the newer free orders the coalesced span")
	require.NoError(t, e.CheckInvariants())
}

// countRecords counts the events recorded on sim from here on.
func countRecords(sim *Sim) *int {
	n := new(int)
	sim.SetFaults(SimFaults{EventRecord: func(Stream) error { *n++; return nil }})
	return n
}

// A free on the segment's own stream records no event; every fenceEvery
// of them, one event recorded on the stream goes to all the spans freed
// unrecorded, shared, and back to the spare events once the last lets go.
func TestSegmentsOwnStreamFreesShareOneFence(t *testing.T) {
	e, _, sim := segmentsOnly(t, 1<<30, 0)
	records := countRecords(sim)
	var ps []uintptr
	for i := 0; i < 2*fenceEvery; i++ { // live spans between the freed ones keep them apart
		p, err := e.Alloc(512<<10, 1)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	sim.Launch(1)
	for i := 0; i < fenceEvery-1; i++ {
		require.NoError(t, e.Free(ps[2*i], 1, false))
	}
	assert.Zero(t, *records, "frees on the segment's own stream record nothing")
	require.NoError(t, e.CheckInvariants())
	require.NoError(t, e.Free(ps[2*(fenceEvery-1)], 1, false))
	assert.Equal(t, 1, *records, "the fence: one event for all of them")
	g := e.streams[shareKey{s: 1}].segs[0]
	ev := g.spanList()[0].event
	require.NotEqual(t, unrecorded, ev)
	for _, sp := range g.spanList() {
		if sp.state == spanFree {
			assert.Equal(t, ev, sp.event, "every span freed since the last fence holds the fence's event")
		}
	}
	n, _ := e.holders.Get(uintptr(ev))
	assert.EqualValues(t, fenceEvery, n)
	require.NoError(t, e.CheckInvariants())
	// Taking the spans back lets go of the event; the last one spares it.
	for i := 0; i < fenceEvery; i++ {
		_, err := e.Alloc(512<<10, 1)
		require.NoError(t, err)
		require.NoError(t, e.CheckInvariants())
	}
	_, held := e.holders.Get(uintptr(ev))
	assert.False(t, held, "the last holder let the event go")
	assert.Contains(t, e.events, ev)
	assert.Equal(t, 1, *records)
}

// The device's synchronisation completes what was freed before it began,
// so empty_cache (synchronise, then trim) gives back memory whose frees
// recorded no event; a free after the mark stays unrecorded until the trim
// fences it.
func TestSegmentsSynchronizeCompletesUnrecordedFrees(t *testing.T) {
	e, _, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	_, err = e.Alloc(8*mib, 1) // stays live, between the two
	require.NoError(t, err)
	q, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	records := countRecords(sim)
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	mark := e.syncMark()
	require.NoError(t, e.Free(q, 1, false)) // after the synchronisation began: may still run
	require.NoError(t, sim.Synchronize())
	e.synchronized(mark)
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, [][3]uint64{{0, 8, spanFree}, {8, 8, spanLive}, {16, 8, spanFree}}, spanStates(g))
	assert.EqualValues(t, 0, g.spanList()[0].event, "freed before the mark: complete")
	assert.Equal(t, unrecorded, g.spanList()[2].event, "freed after it: not known complete")
	require.NoError(t, e.CheckInvariants())
	assert.Zero(t, *records)
	require.NoError(t, e.Trim(0))
	assert.Equal(t, 1, *records, "the trim fences the unrecorded span")
	assert.EqualValues(t, 8*mib, e.Held(), "both freed spans went back: the fence completed at once on the idle stream")
	require.NoError(t, e.CheckInvariants())
}

// A free span followed by unmapped VA grows into it: only the missing
// granules are mapped, and the request starts where the span did.
func TestSegmentsExtendMapsOnlyTheMissingGranules(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	before := phys.Calls["cuMemMap"]
	q, err := e.Alloc(10*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, q, "the free span at the end is extended")
	assert.Equal(t, 3, phys.Calls["cuMemMap"]-before, "three granules mapped, not five")
	assert.Equal(t, 5, phys.Calls["cuMemCreate"])
	assert.Equal(t, 2, phys.Calls["cuMemSetAccess"])
	assert.EqualValues(t, 10*mib, e.Held())
	require.NoError(t, e.CheckInvariants())
}

// A hole between two free spans joins them: the request takes the span
// before, the hole, and the head of the span after.
func TestSegmentsFillJoinsFreeSpansThroughAHole(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	x1, _ := e.Alloc(4*mib, 1)
	x2, _ := e.Alloc(4*mib, 1)
	x3, _ := e.Alloc(8*mib, 1)
	_, err := e.Alloc(2*mib, 1)
	require.NoError(t, err)
	require.NoError(t, e.Free(x2, 1, true))
	require.NoError(t, e.Trim(e.Held()-4*mib))
	require.NoError(t, e.Free(x1, 1, true))
	sim.Launch(1)
	require.NoError(t, e.Free(x3, 1, false))
	g := e.streams[shareKey{s: 1}].segs[0]
	require.Equal(t, [][3]uint64{{0, 4, spanFree}, {8, 8, spanFree}, {16, 2, spanLive}}, spanStates(g))
	maps := phys.Calls["cuMemMap"]
	p, err := e.Alloc(14*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, x1, p)
	assert.Equal(t, 2, phys.Calls["cuMemMap"]-maps, "only the hole's two granules are mapped")
	assert.Equal(t, [][3]uint64{{0, 14, spanLive}, {14, 2, spanFree}, {16, 2, spanLive}}, spanStates(g))
	require.NoError(t, e.CheckInvariants())
}

// A span freed on another stream than its segment's is pending: no other
// stream takes it, and its segment's stream takes it back once the event
// recorded at the free completes, or, rather than create memory, after
// waiting for that event (cuStreamWaitEvent): its later work is then
// ordered after the free.
func TestSegmentsCrossStreamFreeWaitsForItsEvent(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	sim.Launch(2)
	require.NoError(t, e.Free(p, 2, false))
	q, err := e.Alloc(8*mib, 3)
	require.NoError(t, err)
	assert.NotEqual(t, p, q, "stream 2 may still use it")
	assert.EqualValues(t, 16*mib, e.Held())
	require.NoError(t, e.CheckInvariants())

	creates := phys.Calls["cuMemCreate"]
	r, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, r, "its own segment's stream waits rather than create")
	assert.True(t, sim.OrderedAfter(1, 2, sim.Enqueued(2)), "stream 1 now waits for stream 2's free")
	assert.EqualValues(t, 16*mib, e.Held())
	assert.Equal(t, creates, phys.Calls["cuMemCreate"])
	assert.Equal(t, 1, phys.Calls["cuStreamWaitEvent"])
	require.NoError(t, e.CheckInvariants())

	// Complete before the request: taken back with no wait.
	sim.Launch(2)
	require.NoError(t, e.Free(r, 2, false))
	sim.Complete(2)
	x, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, x, "once stream 2 is done it is free again")
	assert.Equal(t, 1, phys.Calls["cuStreamWaitEvent"])
	assert.EqualValues(t, 16*mib, e.Held())
	require.NoError(t, e.CheckInvariants())
}

// A miss that frees nothing to pay with waits for the pending spans of its
// own segments only: another stream's segments keep theirs, and a stream
// with free memory to pay with creates nothing and waits for nothing.
func TestSegmentsAdoptOnlyWhatWouldBeCreated(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	a := allocAll(t, e, 1, 8*mib, 8*mib)
	b := allocAll(t, e, 3, 8*mib)
	sim.Launch(2)
	require.NoError(t, e.Free(a[0], 2, false)) // pending in stream 1's segment
	require.NoError(t, e.Free(b[0], 2, false)) // pending in stream 3's
	require.NoError(t, e.Free(a[1], 1, true))  // stream 1's own, complete
	y, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, a[1], y, "its own free span first")
	assert.Zero(t, phys.Calls["cuStreamWaitEvent"])
	z, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, a[0], z, "then its segment's pending span, after a wait")
	assert.Equal(t, 1, phys.Calls["cuStreamWaitEvent"], "one wait: stream 3's pending span is not stream 1's to take")
	assert.EqualValues(t, 24*mib, e.Held())
	require.NoError(t, e.CheckInvariants())
}

// pendingFreeOfStream2 has stream 2 take n bytes of stream 1's complete
// free memory where it lies (step 1) and free them while it is busy: a
// span pending in stream 1's segment, freed by stream 2. It returns its
// address.
func pendingFreeOfStream2(t *testing.T, e *vmmSegments, sim *Sim, n uint64) uintptr {
	t.Helper()
	p, err := e.Alloc(n, 1)
	require.NoError(t, err)
	require.NoError(t, e.Free(p, 1, true))
	q, err := e.Alloc(n, 2)
	require.NoError(t, err)
	require.Equal(t, p, q, "stream 1's complete span serves stream 2 where it lies")
	sim.Launch(2)
	require.NoError(t, e.Free(q, 2, false))
	return p
}

// A stream that took another's complete span and freed it takes it back
// at once, rather than create memory beside it: its later work is ordered
// after its own free. Only the rest stays pending, and no other stream
// takes that.
func TestSegmentsStreamTakesBackItsOwnPendingFree(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p := pendingFreeOfStream2(t, e, sim, 8*mib)
	creates := phys.Calls["cuMemCreate"]
	r, err := e.Alloc(6*mib, 2)
	require.NoError(t, err)
	assert.Equal(t, p, r, "stream 2 takes its own free back before the GPU reaches it")
	assert.Equal(t, creates, phys.Calls["cuMemCreate"])
	assert.Zero(t, phys.Calls["cuStreamWaitEvent"], "its own free needs no wait")
	assert.EqualValues(t, 8*mib, e.Held())
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, [][3]uint64{{0, 6, spanLive}, {6, 2, spanPending}}, spanStates(g))
	require.NoError(t, e.CheckInvariants())

	x, err := e.Alloc(2*mib, 3)
	require.NoError(t, err)
	assert.NotEqual(t, p+6*mib, x, "the rest is stream 2's free, not stream 3's")
	assert.EqualValues(t, 10*mib, e.Held())
	sim.Complete(2)
	y, err := e.Alloc(2*mib, 3)
	require.NoError(t, err)
	assert.Equal(t, p+6*mib, y, "free for any stream once complete")
	require.NoError(t, e.CheckInvariants())
}

// A request larger than every pending span its stream freed: the largest
// lends its whole granules (no wait: the stream's later work follows its
// own free), which drain where they lie; the pieces beside them stay
// pending with the free's event; only the rest is created.
func TestSegmentsStreamLendsItsOwnPendingFree(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	_, err := e.Alloc(1*mib, 1) // stays: the span below starts inside a granule
	require.NoError(t, err)
	p := pendingFreeOfStream2(t, e, sim, 8*mib)
	g := e.streams[shareKey{s: 1}].segs[0]
	require.Equal(t, [][3]uint64{{0, 1, spanLive}, {1, 8, spanPending}, {9, 1, spanFree}}, spanStates(g))
	require.EqualValues(t, 10*mib, e.Held())
	creates := phys.Calls["cuMemCreate"]

	r, err := e.Alloc(12*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 16*mib, e.Held(), "the pending span's three whole granules lend; three are created")
	assert.Equal(t, creates+3, phys.Calls["cuMemCreate"])
	assert.Zero(t, phys.Calls["cuStreamWaitEvent"], "its own free needs no wait")
	assert.Equal(t, [][3]uint64{{0, 1, spanLive}, {1, 1, spanPending}, {2, 6, spanDraining}, {8, 1, spanPending}, {9, 1, spanFree}},
		spanStates(g), "the lent granules drain until stream 2 reaches its free")
	require.NoError(t, e.CheckInvariants())
	x, err := e.Alloc(1*mib, 3)
	require.NoError(t, err)
	assert.NotEqual(t, p, x, "the pieces are stream 2's pending frees, not stream 3's")

	sim.Complete(2)
	require.NoError(t, e.Free(r, 2, true))
	require.NoError(t, e.Trim(0))
	require.NoError(t, e.CheckInvariants())
	assert.EqualValues(t, 4*mib, e.Held(), "the drain is over: only the granules of the two live spans stay")
}

// A stream being captured borrows nothing of its pending frees: what the
// graph does runs at its replays, not after the stream's earlier work.
func TestSegmentsCapturedStreamLendsNoPendingFree(t *testing.T) {
	e, gate, sim := segmentsBehindGate(t)
	pendingFreeOfStream2(t, e, sim, 8*mib)
	gate.underway.Store(true)
	sim.SetCapture(2, CaptureActive)
	_, err := e.Alloc(12*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 20*mib, e.Held(), "all of it created")
	assert.Equal(t, [][3]uint64{{0, 8, spanPending}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	sim.SetCapture(2, CaptureNone)
	gate.underway.Store(false)
	require.NoError(t, e.CheckInvariants())
}

// During a capture the wait is refused: the pending span stays pending and
// the request creates memory instead.
func TestSegmentsNoAdoptionWhileCapturing(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	sim.Launch(2)
	require.NoError(t, e.Free(p, 2, false))
	phys.FailStreamWait = func(Stream, Event) error { return errors.New("capturing") }
	q, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.NotEqual(t, p, q, "stream 2 may still use it")
	assert.EqualValues(t, 16*mib, e.Held())
	require.NoError(t, e.CheckInvariants())
	phys.FailStreamWait = nil
	sim.Complete(2)
	r, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p, r, "free again once stream 2 is done")
	require.NoError(t, e.CheckInvariants())
}

// Another stream's completed free span, too small for the request, gives
// up its granules, unmapped and mapped again where the request needs them,
// with no release.
func TestSegmentsUnmapFreeMemoryToPayForGrowth(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p := allocAll(t, e, 1, 8*mib, 1*mib)[0]
	_, err := e.Alloc(8*mib, 2)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	sim.Complete(1)
	require.EqualValues(t, 18*mib, e.Held())
	_, err = e.Alloc(10*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 20*mib, e.Held(), "paid with stream 1's four free granules, one created")
	assert.Equal(t, 10, phys.Calls["cuMemCreate"])
	assert.Equal(t, 4, phys.Calls["cuMemUnmap"], "four granules moved")
	assert.Zero(t, phys.Calls["cuMemRelease"])
	assert.Zero(t, phys.Calls["cuStreamWaitEvent"], "a complete free needs no wait")
	assert.Equal(t, [][3]uint64{{8, 1, spanLive}, {9, 1, spanFree}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	assert.EqualValues(t, 20*mib, phys.Used())
	require.NoError(t, e.CheckInvariants())
}

// Another stream's completed free span large enough for the request serves
// it where it lies, the smallest such: nothing is mapped, unmapped or
// created. Its free on the request's stream waits for that stream's event,
// as any free on another stream than the segment's does, and then the span
// is its segment's stream's again. A span still in use, or of another
// memory tag, is not taken.
func TestSegmentsTakeAnotherStreamsCompleteSpan(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	other := allocAll(t, e, 3, 7*mib, 1*mib) // stream 3's segment comes first
	spans := allocAll(t, e, 1, 8*mib, 1*mib, 6*mib, 1*mib, 5*mib, 1*mib)
	g := e.streams[shareKey{s: 1}].segs[0]
	inSegment := func(p uintptr) bool { return p >= g.base && p < g.base+uintptr(g.size) }
	sim.Launch(1)
	for _, i := range []int{0, 2, 4} {
		require.NoError(t, e.Free(spans[i], 1, false))
	}
	p, err := e.Alloc(5*mib+512, 2)
	require.NoError(t, err)
	assert.False(t, inSegment(p), "stream 1's frees still run")
	require.NoError(t, e.CheckInvariants())

	sim.Complete(1)
	require.NoError(t, e.pollDraining()) // what stream 1 lent to p drains first
	require.NoError(t, e.Free(other[0], 3, true))
	moves := func() int { return phys.Calls["cuMemMap"] + phys.Calls["cuMemUnmap"] + phys.Calls["cuMemCreate"] }
	held, before := e.Held(), moves()
	q, err := e.Alloc(5*mib+512, 2)
	require.NoError(t, err)
	assert.Equal(t, spans[2], q, "the smallest that fits of any stream: stream 1's 6 MiB, not its 8 or stream 3's 7")
	assert.Equal(t, held, e.Held())
	assert.Equal(t, before, moves(), "no map, unmap or create")
	require.NoError(t, e.CheckInvariants())

	r, err := e.AllocTagged(5*mib, 3, 1)
	require.NoError(t, err)
	assert.False(t, inSegment(r), "memory of two tags never shares a handle")
	require.NoError(t, e.CheckInvariants())

	sim.Launch(2)
	require.NoError(t, e.Free(q, 2, false))
	x, err := e.Alloc(6*mib, 1)
	require.NoError(t, err)
	assert.NotEqual(t, q, x, "stream 2 may still use it")
	sim.Complete(2)
	y, err := e.Alloc(6*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, q, y, "stream 1's again once stream 2 is done")
	require.NoError(t, e.CheckInvariants())
}

// What new granules hold beyond a request is complete only when no handle
// of theirs was lent: a lent handle's last use, at its old place, may still
// run, and only the request's stream is ordered after it. Another stream
// takes that rest only once the lender's work completes.
func TestSegmentsRestOfLentGranulesWaitsForTheLender(t *testing.T) {
	e, _, sim := segmentsOnly(t, 1<<30, 0)
	spans := allocAll(t, e, 1, 8*mib, 2*mib, 8*mib, 2*mib)
	sim.Launch(1)
	for _, i := range []int{0, 2} {
		require.NoError(t, e.Free(spans[i], 1, false))
	}
	p, err := e.Alloc(11*mib, 1)
	require.NoError(t, err)
	require.NotEmpty(t, e.draining, "stream 1's frees lent their handles")
	require.NoError(t, e.CheckInvariants())
	rest := p + 11*mib
	q, err := e.Alloc(512<<10, 2)
	require.NoError(t, err)
	assert.NotEqual(t, rest, q, "the rest's handle was lent by stream 1's free, still in use")
	require.NoError(t, e.CheckInvariants())
	sim.Complete(1)
	r, err := e.Alloc(512<<10, 3)
	require.NoError(t, err)
	assert.Equal(t, rest, r, "once stream 1 is done, the smallest complete span of any stream")
	require.NoError(t, e.CheckInvariants())
}

// Memory taken outside a capture (anyStream) may have been used by any
// stream: no other stream takes a span of its segments where it lies.
func TestSegmentsNoStreamTakesAnyStreamsSpans(t *testing.T) {
	e, _, _ := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(4*mib, anyStream)
	require.NoError(t, err)
	require.NoError(t, e.Free(p, 2, true))
	q, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	assert.NotEqual(t, p, q)
	require.NoError(t, e.CheckInvariants())
}

func TestSegmentsCapRefusesBeforeAnyDriverCall(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 32*mib)
	p, err := e.Alloc(20*mib, 1)
	require.NoError(t, err)
	before := calls(phys)
	reserves := phys.Calls["cuMemAddressReserve"]
	_, err = e.Alloc(20*mib, 2)
	require.ErrorIs(t, err, ErrOutOfMemory, "the cap leaves 12 MiB")
	assert.Equal(t, before, calls(phys), "a refused request calls no driver")
	assert.Equal(t, reserves, phys.Calls["cuMemAddressReserve"], "not even to reserve a segment")
	require.NoError(t, e.CheckInvariants())
	sim.Launch(1)
	require.NoError(t, e.Free(p, 1, false))
	_, err = e.Alloc(20*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 20*mib, e.Held(), "stream 1's memory, still in use, lent to stream 2")
	_, err = e.Alloc(14*mib, 2)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.EqualValues(t, 20*mib, e.Held())
	require.NoError(t, e.CheckInvariants())
}

// Under a cap lowered below what is held, a request that moves free memory
// and creates nothing is served: held does not grow.
func TestSegmentsLoweredCapStillMovesFreeMemory(t *testing.T) {
	e, phys, _ := segmentsOnly(t, 1<<30, 0)
	p, _ := e.Alloc(16*mib, 1)
	_, err := e.Alloc(16*mib, 2)
	require.NoError(t, err)
	require.NoError(t, e.Free(p, 1, true))
	e.SetCap(16 * mib)
	_, err = e.Alloc(8*mib, 2)
	require.NoError(t, err)
	assert.EqualValues(t, 32*mib, e.Held())
	assert.Equal(t, 16, phys.Calls["cuMemCreate"])
	_, err = e.Alloc(10*mib, 2)
	require.ErrorIs(t, err, ErrOutOfMemory, "2 MiB would have to be created")
	require.NoError(t, e.CheckInvariants())
}

// The device refusing a handle midway leaves a consistent state: what was
// unmapped to pay and what was made is released.
func TestSegmentsDeviceOOMMidway(t *testing.T) {
	// A 64 MiB device of which others use all but 16 MiB: the placement's
	// bound (the device's memory) passes, the driver refuses midway.
	sim := NewSim(0, 64*mib)
	sim.SetManual(true)
	phys := NewFakePhys(sim, 16*mib, simVMMGranule)
	e, err := newVMMSegments(phys, 64*mib, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	require.NoError(t, e.Free(p, 1, true))
	_, err = e.Alloc(20*mib, 2)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Zero(t, e.Held())
	assert.Zero(t, phys.Used())
	require.NoError(t, e.CheckInvariants())
	q, err := e.Alloc(16*mib, 2)
	require.NoError(t, err, "all of the device is usable after the failure")
	_ = q
	_ = sim
	require.NoError(t, e.CheckInvariants())
}

func TestSegmentsTrim(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	a, _ := e.Alloc(8*mib, 1)
	b, _ := e.Alloc(4*mib, 1)
	c, err := e.Alloc(16*mib, 2)
	require.NoError(t, err)
	sim.Launch(1)
	sim.Launch(2)
	require.NoError(t, e.Free(a, 1, false))
	require.NoError(t, e.Free(c, 2, false))
	require.NoError(t, e.Trim(0))
	assert.EqualValues(t, 28*mib, e.Held(), "frees still in use keep their memory")
	sim.Complete(2)
	require.NoError(t, e.Trim(12*mib))
	assert.EqualValues(t, 12*mib, e.Held(), "the completed 16 MiB go, down to keep")
	assert.EqualValues(t, 12*mib, phys.Used())
	sim.Complete(1)
	require.NoError(t, e.Trim(0))
	assert.EqualValues(t, 4*mib, e.Held(), "what is live stays")
	assert.Equal(t, 2, phys.Handles())
	require.NoError(t, e.CheckInvariants())
	_ = b
}

func TestSegmentsCloseReleasesEverything(t *testing.T) {
	sim := NewSim(0, 1<<30)
	sim.SetManual(true)
	phys := NewFakePhys(sim, 1<<30, simVMMGranule)
	e, err := newVMMSegments(phys, 1<<30, 0)
	require.NoError(t, err)
	live, _ := e.Alloc(6*mib, 1)
	freed, _ := e.Alloc(4*mib, 1)
	pending, err := e.Alloc(2*mib, 3)
	require.NoError(t, err)
	sim.Launch(1)
	sim.Launch(2)
	require.NoError(t, e.Free(freed, 1, false))
	require.NoError(t, e.Free(pending, 2, false))
	require.NoError(t, e.CheckInvariants())
	require.NoError(t, e.Close())
	assert.Zero(t, phys.Used())
	assert.Zero(t, phys.Handles())
	assert.Empty(t, phys.res, "every segment's VA is given back")
	assert.Zero(t, sim.Events(), "events destroyed")
	_ = live
}

// drainSetup leaves stream 1's segment as two free spans of 8 MiB, each
// before a live span of 2 MiB, whose frees have not completed.
func drainSetup(t *testing.T) (e *vmmSegments, phys *FakePhys, sim *Sim, p1, p2 uintptr) {
	e, phys, sim = segmentsOnly(t, 1<<30, 0)
	p1, _ = e.Alloc(8*mib, 1)
	_, _ = e.Alloc(2*mib, 1)
	p2, _ = e.Alloc(8*mib, 1)
	_, err := e.Alloc(2*mib, 1)
	require.NoError(t, err)
	sim.Launch(1)
	require.NoError(t, e.Free(p1, 1, false))
	require.NoError(t, e.Free(p2, 1, false))
	require.Equal(t, [][3]uint64{{0, 8, spanFree}, {8, 2, spanLive}, {10, 8, spanFree}, {18, 2, spanLive}}, spanStates(e.streams[shareKey{s: 1}].segs[0]))
	return e, phys, sim, p1, p2
}

// A stream's free spans still in use pay for its larger request: their
// handles are mapped at the new place too, nothing is created, and the
// old mappings stay, their VA handed to nobody, until the free completes;
// then they are unmapped and become holes (another stream's request takes
// them only after a wait: TestSegmentsLendAcrossStreamsWithAWait).
func TestSegmentsSameStreamPaysWithFreeSpansInUse(t *testing.T) {
	e, phys, sim, p1, p2 := drainSetup(t)
	h1, _ := phys.HandleAt(p1)
	var unmapped []uintptr
	phys.OnUnmap = func(va uintptr, size uint64) error {
		unmapped = append(unmapped, va)
		return nil
	}

	require.EqualValues(t, 20*mib, e.Held())
	creates := phys.Calls["cuMemCreate"]
	q, err := e.Alloc(12*mib, 1)
	require.NoError(t, err)
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, g.base+20*mib, q, "no free span fits: the hole at the end")
	assert.Equal(t, creates, phys.Calls["cuMemCreate"], "paid with the free spans in use: no handle created")
	assert.EqualValues(t, 20*mib, e.Held(), "a handle mapped twice is held once")
	assert.EqualValues(t, 20*mib, phys.Used())
	assert.Empty(t, unmapped, "nothing in use is unmapped")
	for off := uintptr(0); off < 8*mib; off += 2 * mib {
		hq, _ := phys.HandleAt(q + off)
		hp, ok := phys.HandleAt(p1 + off)
		require.True(t, ok, "the old mapping stays")
		assert.Equal(t, hp, hq, "the same memory at both places")
	}
	for off := uintptr(0); off < 4*mib; off += 2 * mib {
		hq, _ := phys.HandleAt(q + 8*mib + off)
		hp, _ := phys.HandleAt(p2 + 4*mib + off)
		assert.Equal(t, hp, hq, "the tail of the second span")
	}
	assert.Equal(t, [][3]uint64{{0, 8, spanDraining}, {8, 2, spanLive}, {10, 4, spanFree}, {14, 4, spanDraining}, {18, 2, spanLive}, {20, 12, spanLive}},
		spanStates(g), "the whole first span and the tail of the second drain")
	require.NoError(t, e.CheckInvariants())

	// The draining VA goes to nobody and stays mapped until the free
	// completes.
	r, err := e.Alloc(2*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p2, r, "the free head of the second span, not the draining VA")
	require.NoError(t, e.Free(r, 1, false))
	require.NoError(t, e.Trim(0))
	assert.Empty(t, unmapped, "Trim leaves what is in use")
	require.NoError(t, e.CheckInvariants())

	sim.Complete(1)
	require.NoError(t, e.Trim(e.Held()))
	assert.ElementsMatch(t, []uintptr{p1, p1 + 2*mib, p1 + 4*mib, p1 + 6*mib, p2 + 4*mib, p2 + 6*mib}, unmapped,
		"once the free completed, the old mappings go")
	_, ok := phys.HandleAt(p1)
	assert.False(t, ok)
	hq, _ := phys.HandleAt(q)
	assert.Equal(t, h1, hq, "the handle lives on at the new place only")
	assert.Equal(t, [][3]uint64{{8, 2, spanLive}, {10, 4, spanFree}, {18, 2, spanLive}, {20, 12, spanLive}}, spanStates(g), "holes where they drained")
	assert.EqualValues(t, 20*mib, e.Held())
	assert.Equal(t, 10, phys.Handles())
	require.NoError(t, e.CheckInvariants())

	// The holes are filled again like any other: the free 4 MiB extend
	// into the one after them.
	s, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p2, s)
	require.NoError(t, e.CheckInvariants())
}

// The device refusing a handle after borrowed ones were mapped leaves the
// free spans as they were, their handles kept.
func TestSegmentsDeviceOOMAfterBorrowing(t *testing.T) {
	e, phys, sim, _, _ := drainSetup(t)
	phys.FailCreate = func(uint64) error { return ErrOutOfMemory }
	_, err := e.Alloc(20*mib, 1)
	require.ErrorIs(t, err, ErrOutOfMemory)
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, [][3]uint64{{0, 8, spanFree}, {8, 2, spanLive}, {10, 8, spanFree}, {18, 2, spanLive}}, spanStates(g))
	assert.EqualValues(t, 20*mib, e.Held())
	assert.EqualValues(t, 20*mib, phys.Used())
	require.NoError(t, e.CheckInvariants())
	phys.FailCreate = nil
	sim.Complete(1)
	_, err = e.Alloc(20*mib, 1)
	require.NoError(t, err)
	require.NoError(t, e.CheckInvariants())
}

// Requests are packed at segQuantum, not at the granule: neighbours share
// the granule between them, so the granule's rounding is paid once per run
// of spans (a free rest at its end), not once per request.
func TestSegmentsPackRequestsAcrossGranules(t *testing.T) {
	e, phys, _ := segmentsOnly(t, 1<<30, 0)
	a, err := e.Alloc(3*mib, 1)
	require.NoError(t, err)
	g := e.streams[shareKey{s: 1}].segs[0]
	assert.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 1, spanFree}}, spanStates(g), "the second granule's rest is free")
	b, err := e.Alloc(3*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, a+3*mib, b, "the next request starts in the shared granule")
	assert.EqualValues(t, 6*mib, e.Held(), "three granules, not four")
	assert.Equal(t, 3, phys.Calls["cuMemCreate"])
	c, err := e.Alloc(5000, 1)
	require.NoError(t, err)
	assert.Equal(t, b+3*mib, c)
	assert.EqualValues(t, 6*mib+5120, e.Live(), "live is rounded to 512 bytes")
	sz, ok := e.Owns(c)
	assert.True(t, ok)
	assert.EqualValues(t, 5120, sz)
	assert.EqualValues(t, 8*mib, e.Held())
	require.NoError(t, e.CheckInvariants())

	// Freed, the neighbours coalesce with the rest, and Trim gives back
	// every granule: nothing is live.
	for _, p := range []uintptr{b, a, c} {
		require.NoError(t, e.Free(p, 1, true))
		require.NoError(t, e.CheckInvariants())
	}
	assert.Equal(t, [][3]uint64{{0, 8, spanFree}}, spanStates(g))
	require.NoError(t, e.Trim(0))
	assert.Zero(t, e.Held())
	require.NoError(t, e.CheckInvariants())
}

// allocAll places each size on stream s, in order, and returns the places.
func allocAll(t *testing.T, e *vmmSegments, s Stream, sizes ...uint64) []uintptr {
	var out []uintptr
	for _, n := range sizes {
		p, err := e.Alloc(n, s)
		require.NoError(t, err)
		out = append(out, p)
	}
	return out
}

// A free span that shares granules with its neighbours pays with the
// granules it covers alone: each one unmapped cuts it, its ends staying
// free in the shared granules. (The requests are of another memory tag, so
// the span pays rather than serving them where it lies.)
func TestSegmentsPayWithTheWholeGranulesOfASpan(t *testing.T) {
	e, phys, _ := segmentsOnly(t, 1<<30, 8*mib)
	b := allocAll(t, e, 1, 3*mib, 4*mib, 1*mib)[1]
	g := e.streams[shareKey{s: 1}].segs[0]
	require.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 4, spanLive}, {7, 1, spanLive}}, spanStates(g))
	require.EqualValues(t, 8*mib, e.Held())
	require.NoError(t, e.Free(b, 1, true))
	// [3, 7) covers the granule [4, 6) alone; [3, 4) and [6, 7) share.
	q, err := e.AllocTagged(2*mib, 2, 1)
	require.NoError(t, err, "paid with the one whole granule, under the cap")
	assert.EqualValues(t, 8*mib, e.Held())
	assert.Equal(t, 4, phys.Calls["cuMemCreate"])
	assert.Equal(t, 1, phys.Calls["cuMemUnmap"])
	assert.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 1, spanFree}, {6, 1, spanFree}, {7, 1, spanLive}}, spanStates(g))
	require.NoError(t, e.CheckInvariants())
	_, err = e.AllocTagged(2*mib, 2, 1)
	require.ErrorIs(t, err, ErrOutOfMemory, "the pieces left share their granules: they cannot pay")
	require.NoError(t, e.Free(q, 2, true))
	require.NoError(t, e.CheckInvariants())
}

// A stream's free span still in use lends the granules it covers alone;
// its pieces in shared granules stay free, each with an event recorded at
// the lending, and the lent granules drain into a hole.
func TestSegmentsLendTheWholeGranulesOfASpanInUse(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 14*mib)
	b := allocAll(t, e, 1, 3*mib, 6*mib, 1*mib)[1]
	g := e.streams[shareKey{s: 1}].segs[0]
	require.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 6, spanLive}, {9, 1, spanLive}}, spanStates(g))
	sim.Launch(1)
	require.NoError(t, e.Free(b, 1, false))
	creates := phys.Calls["cuMemCreate"]
	d, err := e.Alloc(7*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, g.base+10*mib, d)
	assert.Equal(t, 2, phys.Calls["cuMemCreate"]-creates, "two of the four granules lent, two created")
	assert.EqualValues(t, 14*mib, e.Held())
	assert.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 1, spanFree}, {4, 4, spanDraining}, {8, 1, spanFree}, {9, 1, spanLive},
		{10, 7, spanLive}, {17, 1, spanFree}}, spanStates(g))
	for _, i := range []int{1, 3} {
		assert.NotZero(t, g.spanList()[i].event, "a piece left free carries an event of its own")
	}
	assert.NotEqual(t, g.spanList()[1].event, g.spanList()[3].event)
	require.NoError(t, e.CheckInvariants())
	sim.Complete(1)
	require.NoError(t, e.Trim(e.Held()))
	assert.Equal(t, [][3]uint64{{0, 3, spanLive}, {3, 1, spanFree}, {8, 1, spanFree}, {9, 1, spanLive},
		{10, 7, spanLive}, {17, 1, spanFree}}, spanStates(g), "the lent granules are a hole once drained")
	require.NoError(t, e.CheckInvariants())
}

// A request the device cannot hold is refused before any driver call: not
// after creating handles until the driver says no.
func TestSegmentsRefuseMoreThanTheDeviceBeforeAnyDriverCall(t *testing.T) {
	e, phys, _ := segmentsOnly(t, 64*mib, 0)
	allocAll(t, e, 1, 40*mib)
	before := calls(phys)
	_, err := e.Alloc(30*mib, 2)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.ErrorContains(t, err, "more than the device's")
	assert.Equal(t, before, calls(phys), "no driver call")
	_, err = e.Alloc(1<<40, 1)
	require.ErrorIs(t, err, ErrOutOfMemory)
	assert.Equal(t, before, calls(phys))
	require.NoError(t, e.CheckInvariants())
	_, err = e.Alloc(24*mib, 2)
	require.NoError(t, err, "what fits still does")
	assert.EqualValues(t, 64*mib, e.Held())
}

// No event is recorded on a stream being captured (it would join the
// graph): a fence then leaves the spans unrecorded, and a trim keeps their
// memory; once the capture ends, the next fence covers them.
func TestSegmentsFenceSkipsACapturingStream(t *testing.T) {
	e, _, sim := segmentsOnly(t, 1<<30, 0)
	p, err := e.Alloc(8*mib, 1)
	require.NoError(t, err)
	records := countRecords(sim)
	require.NoError(t, e.Free(p, 1, false))
	sim.SetCapture(1, CaptureActive)
	require.NoError(t, e.Trim(0))
	assert.Zero(t, *records, "nothing recorded on the capturing stream")
	assert.EqualValues(t, 8*mib, e.Held(), "not known complete: kept")
	assert.Equal(t, unrecorded, e.streams[shareKey{s: 1}].segs[0].spanList()[0].event)
	require.NoError(t, e.CheckInvariants())
	sim.SetCapture(1, CaptureNone)
	require.NoError(t, e.Trim(0))
	assert.Equal(t, 1, *records)
	assert.Zero(t, e.Held(), "fenced, complete at once on the idle stream, and given back")
	require.NoError(t, e.CheckInvariants())
}

// TestFreeIndexReplaceKeepsItsOrder checks the free index's one-shift move
// against a remove and an add, for keys moved down, up, and in place.
func TestFreeIndexReplaceKeepsItsOrder(t *testing.T) {
	keys := func(sizes ...uint64) freeIndex {
		var x freeIndex
		for i, s := range sizes {
			x.add(freeKey{size: s, base: uintptr(i+1) << 20})
		}
		return x
	}
	for _, tc := range []struct {
		name string
		from int
		to   uint64
	}{{"down to the front", 3, 100}, {"down past two", 4, 250}, {"up to the end", 0, 9000}, {"up past two", 1, 450}, {"in place", 2, 320}} {
		t.Run(tc.name, func(t *testing.T) {
			x := keys(128, 256, 300, 384, 512, 1024)
			want := keys(128, 256, 300, 384, 512, 1024)
			old := x[tc.from]
			k := freeKey{size: tc.to, base: old.base + 512}
			x.replace(old, k)
			want.remove(old)
			want.add(k)
			assert.Equal(t, want, x)
			for i := 1; i < len(x); i++ {
				assert.True(t, x[i-1].less(x[i]), "keys %v and %v out of order", x[i-1], x[i])
			}
		})
	}
	x := keys(128, 256)
	assert.Panics(t, func() { x.replace(freeKey{size: 200}, freeKey{size: 100}) }, "a key the index does not hold")
}

// spanList is g's spans in address order.
func (g *vmmSegment) spanList() []segSpan {
	spans, _ := g.ordered()
	return spans
}

// TestSpanListLinksAndReusesNodes checks a segment's list of spans alone:
// inserting at either end and between, unlinking, reusing unlinked nodes,
// finding the first span at an address, and checkList catching a broken
// link.
func TestSpanListLinksAndReusesNodes(t *testing.T) {
	g := &vmmSegment{base: 0, size: 1 << 30, first: noSpan, last: noSpan}
	bases := func() []uintptr {
		var out []uintptr
		for _, sp := range g.spanList() {
			out = append(out, sp.base)
		}
		return out
	}
	b := g.insert(noSpan, segSpan{base: 2 << 20, size: 1 << 20})
	a := g.insert(b, segSpan{base: 1 << 20, size: 1 << 20})
	d := g.insert(noSpan, segSpan{base: 4 << 20, size: 1 << 20})
	c := g.insert(d, segSpan{base: 3 << 20, size: 1 << 20})
	require.NoError(t, g.checkList())
	assert.Equal(t, []uintptr{1 << 20, 2 << 20, 3 << 20, 4 << 20}, bases())
	assert.Equal(t, a, g.first)
	assert.Equal(t, d, g.last)
	assert.Equal(t, c, g.spanAt(3<<20-512), "the first span at or above the address")
	assert.Equal(t, noSpan, g.spanAt(5<<20))

	g.unlink(a)
	g.unlink(d)
	require.NoError(t, g.checkList())
	assert.Equal(t, []uintptr{2 << 20, 3 << 20}, bases())
	assert.Equal(t, b, g.first)
	assert.Equal(t, c, g.last)
	e := g.insert(c, segSpan{base: 2<<20 + 512, size: 512})
	assert.Contains(t, []spanID{a, d}, e, "an unlinked node is reused")
	assert.Len(t, g.nodes, 4, "no node added while one was unused")
	require.NoError(t, g.checkList())
	assert.Equal(t, []uintptr{2 << 20, 2<<20 + 512, 3 << 20}, bases())

	g.nodes[e].prev = c // a broken back link
	assert.ErrorContains(t, g.checkList(), "follows")
	g.nodes[e].prev = b
	g.unused = append(g.unused, e) // a span also listed unused
	assert.ErrorContains(t, g.checkList(), "unused node")
}

// A segment reserves the device's memory size of VA, and a window of VA
// holds few segments of a device that large: a segment that holds nothing
// gives its VA back, and its stream's state goes with it, once Trim has
// unmapped it (empty_cache), so streams come and go without end. Before,
// the ninth stream's reservation found the window used up.
func TestSegmentsGiveTheirVABackOnTrim(t *testing.T) {
	d, err := NewSimVMM(0, 1<<50)
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Close() })
	e := d.src.eng
	for i := 0; i < 20; i++ {
		s := Stream(0x100 + i)
		p, err := d.Alloc(1000, s)
		require.NoError(t, err, "stream %d", i)
		require.NoError(t, d.Free(p, 1000, s))
		require.NoError(t, d.Trim(0))
		assert.Zero(t, d.Phys().ReservedVA(), "stream %d: a segment that holds nothing keeps no VA", i)
		assert.Empty(t, e.segs)
		assert.Empty(t, e.streams, "nor any state for its stream")
		require.NoError(t, d.CheckInvariants())
	}
}

// Without a Trim too: a segment whose last granule pays for another
// stream's growth gives its VA back then, so what is reserved follows the
// streams that hold memory, not the streams seen.
func TestSegmentsGiveTheirVABackWhenTheirLastMemoryGoes(t *testing.T) {
	d, err := NewSimVMM(0, 1<<50)
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Close() })
	e := d.src.eng
	segVA := e.segVA
	for i := 0; i < 20; i++ {
		s := Stream(0x100 + i)
		p, err := d.Alloc(1000, s)
		require.NoError(t, err, "stream %d", i)
		require.NoError(t, d.Free(p, 1000, s))
		require.LessOrEqual(t, d.Phys().ReservedVA(), 2*segVA, "stream %d: the previous stream's segment is gone", i)
		require.LessOrEqual(t, len(e.streams), 2)
		require.EqualValues(t, e.gran, e.Held(), "one stream's freed memory paid for the next's")
		require.NoError(t, d.CheckInvariants())
	}
}

// A stream's segment dropped between two of its siblings takes its place
// with it: those after it move down one place, with their free spans' keys,
// so the free index keeps step 1's order. Random requests on a device too
// small for its streams' memory make siblings (no hole fits) and drop them
// (their last granules pay for others, or Trim); the invariants are
// checked after every step, and the test sees at least one such drop.
func TestSegmentsDropASiblingBetweenOthers(t *testing.T) {
	middle := 0
	for seed := int64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewSource(seed))
		e, _, _ := segmentsOnly(t, 32*mib, 0)
		e.segVA = 8 * mib // a quarter of the device: a stream's memory spans siblings
		live := map[uintptr]Stream{}
		var order []uintptr // live allocations, oldest first
		sizes := []uint64{512 << 10, mib, 3 * mib, 5 * mib}
		for step := 0; step < 400; step++ {
			before := map[*vmmSegment]int32{}
			for _, g := range e.segs {
				before[g] = g.order
			}
			switch r := rng.Intn(10); {
			case r < 5:
				s := Stream(1 + rng.Intn(4)/3) // stream 1 mostly
				if p, err := e.Alloc(sizes[rng.Intn(len(sizes))], s); err == nil {
					live[p] = s
					order = append(order, p)
				} else {
					require.ErrorIs(t, err, ErrOutOfMemory)
				}
			case r < 9 && len(order) > 0:
				k := rng.Intn(len(order))
				p := order[k]
				order = append(order[:k], order[k+1:]...)
				require.NoError(t, e.Free(p, live[p], true))
				delete(live, p)
			default:
				require.NoError(t, e.Trim(uint64(rng.Intn(16))*mib))
			}
			require.NoError(t, e.CheckInvariants(), "seed %d step %d", seed, step)
			for g, k := range before {
				if g.order < 0 && e.streams[g.key()] != nil && int(k) < len(e.streams[g.key()].segs) {
					middle++ // a sibling after it took its place
				}
			}
		}
	}
	assert.Positive(t, middle, "no sibling was dropped between others")
}

// Under a cap, a fill that extends free spans through a hole, its new
// granules paid by nothing else, gives way to new granules alone, which
// those spans' whole granules pay for: what is not live always serves.
func TestSegmentsFreshGranulesWhenAFillCannotBePaid(t *testing.T) {
	e, phys, _ := segmentsOnly(t, 1<<30, 0)
	a, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	h, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	b, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	_, err = e.Alloc(1*mib, 1)
	require.NoError(t, err)
	require.NoError(t, e.Free(h, 1, true))
	require.NoError(t, e.Trim(0)) // a hole where h was
	require.NoError(t, e.Free(a, 1, true))
	require.NoError(t, e.Free(b, 1, true))
	require.EqualValues(t, 10*mib, e.Held())
	// 1 MiB live in one granule: 9 MiB more, five granules, fit under 12.
	e.SetCap(12 * mib)
	creates := phys.Calls["cuMemCreate"]
	p, err := e.Alloc(9*mib, 1)
	require.NoError(t, err, "a's and b's granules pay for new ones")
	assert.EqualValues(t, 12*mib, e.Held())
	assert.Equal(t, creates+1, phys.Calls["cuMemCreate"], "one granule created")
	assert.NotEqual(t, a, p)
	require.NoError(t, e.CheckInvariants())
}

// A request of a granule or more, taken from a free span with a granule to
// spare, starts on the span's first granule boundary when it touches one
// granule fewer there: a tensor that outlives its neighbours then holds
// only the granules its size needs. The head stays free with the span's
// event; smaller requests, and spans with less to spare, start at the head.
func TestSegmentsLargeRequestStartsOnAGranule(t *testing.T) {
	e, phys, sim := segmentsOnly(t, 1<<30, 0)
	p := allocAll(t, e, 1, 1*mib, 10*mib, 1*mib)
	g := e.streams[shareKey{s: 1}].segs[0]
	sim.Launch(1)
	require.NoError(t, e.Free(p[1], 1, false))
	e.fence(g, true) // the free span gets an event, which both pieces will hold
	ev := g.span(g.spanAt(p[1])).event
	require.NotZero(t, ev)
	require.NotEqual(t, unrecorded, ev)
	before := calls(phys)

	// 4 MiB at offset 1 MiB touches granules 0-2; at 2 MiB, granules 1-2.
	d, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p[0]+2*mib, d, "starts on the granule boundary")
	assert.Equal(t, [][3]uint64{{0, 1, spanLive}, {1, 1, spanFree}, {2, 4, spanLive}, {6, 5, spanFree}, {11, 1, spanLive}}, spanStates(g))
	assert.Equal(t, ev, g.span(g.spanAt(p[0]+1*mib)).event, "the head keeps the span's event")
	assert.Equal(t, ev, g.span(g.spanAt(p[0]+6*mib)).event, "and so does the rest")
	n, _ := e.holders.Get(uintptr(ev))
	assert.EqualValues(t, 2, n)
	assert.Equal(t, before, calls(phys), "no driver call")
	require.NoError(t, e.CheckInvariants())

	// Less than a granule: at the head of the smallest span that fits.
	s, err := e.Alloc(512<<10, 1)
	require.NoError(t, err)
	assert.Equal(t, p[0]+1*mib, s)
	// A span without a granule to spare: at its head. The rest is 5 MiB at
	// 6 MiB; 4 MiB there touches granules 3-4 either way, and 4 MiB + 2
	// MiB > 5 MiB.
	f, err := e.Alloc(4*mib, 1)
	require.NoError(t, err)
	assert.Equal(t, p[0]+6*mib, f)
	require.NoError(t, e.CheckInvariants())

	for _, q := range []uintptr{d, s, f} {
		require.NoError(t, e.Free(q, 1, false))
		require.NoError(t, e.CheckInvariants())
	}
	assert.Equal(t, [][3]uint64{{0, 1, spanLive}, {1, 10, spanFree}, {11, 1, spanLive}}, spanStates(g), "the pieces coalesce again")
}
