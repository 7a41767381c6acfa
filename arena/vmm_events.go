// Events: fences, polling, and what a device synchronisation completes.
// See vmm.go for the overview ("Events").

package arena

// unrecorded is the event of a free span whose free recorded none: its
// last use was queued on the segment's stream before the free, so an
// event recorded on that stream at any later moment covers it. It never
// reaches the driver.
const unrecorded = ^Event(0)

// fenceEvery is how many frees a segment leaves unrecorded before one
// event, recorded on its stream, is given to all of them (fence): so a
// free costs a driver call once in fenceEvery, and free memory is known
// complete, for another stream or for Trim, at most that many frees late.
const fenceEvery = 32

// event is a spare event, or a new one when none is spare: events are
// recycled, since creating one is a driver call.
func (e *vmmSegments) event() (Event, error) {
	if k := len(e.events); k > 0 {
		ev := e.events[k-1]
		e.events = e.events[:k-1]
		return ev, nil
	}
	return e.drv.NewEvent()
}

// dropEvent lets go of a span's event: it goes back to the spare events
// once no span holds it (0 and unrecorded are no events).
func (e *vmmSegments) dropEvent(ev Event) {
	if ev == 0 || ev == unrecorded {
		return
	}
	if n, _ := e.holders.Get(uintptr(ev)); n > 1 {
		e.holders.Put(uintptr(ev), n-1)
		return
	}
	e.holders.Delete(uintptr(ev))
	e.events = append(e.events, ev)
}

// holdEvent counts one more span holding ev, a span's event now shared
// with a piece split from it (0 and unrecorded are no events).
func (e *vmmSegments) holdEvent(ev Event) {
	if ev == 0 || ev == unrecorded {
		return
	}
	n, ok := e.holders.Get(uintptr(ev))
	if !ok {
		n = 1
	}
	e.holders.Put(uintptr(ev), n+1)
}

// spanDone says whether the last use of the free span sp has completed,
// polling its event; sp lets go of an event that completed. An unrecorded
// span is not known to have completed (fence records its event).
func (e *vmmSegments) spanDone(sp *segSpan) (bool, error) {
	switch sp.event {
	case 0:
		return true, nil
	case unrecorded:
		return false, nil
	}
	done, err := e.drv.EventDone(sp.event)
	if err != nil || !done {
		return false, err
	}
	e.dropEvent(sp.event)
	sp.event, sp.seq = 0, 0
	return true, nil
}

// fence records one event on g's stream and gives it to every free span of
// g whose free recorded none: recorded after their frees, on their stream,
// it covers each of them. Nothing is recorded on a stream being captured
// (the event would join the graph), nor when the driver refuses: the spans
// stay unrecorded, for a later fence or the next synchronisation, which
// only keeps their memory from paying or being trimmed until then. freeing
// says a free on g's stream called it: that stream is not being captured
// (the layer above frees nothing on a capturing stream), so its status is
// not asked (cuStreamIsCapturing is a driver call).
func (e *vmmSegments) fence(g *vmmSegment, freeing bool) {
	g.unfenced = 0
	// One walk: the event is recorded at the first unrecorded span, so that
	// a segment with none costs no driver call, and the spans from there
	// on take it as the walk goes.
	ev, n := Event(0), int32(0)
	for id := g.first; id != noSpan; id = g.next(id) {
		sp := g.span(id)
		if sp.event != unrecorded {
			continue
		}
		if ev == 0 {
			if ev = e.fenceEvent(g, freeing); ev == 0 {
				return
			}
			e.seq++
		}
		sp.event, sp.seq = ev, e.seq
		n++
	}
	if n > 1 {
		e.holders.Put(uintptr(ev), n)
	}
}

// fenceEvent is an event recorded now on g's stream for fence, or 0 when
// the stream is being captured or the driver refuses.
func (e *vmmSegments) fenceEvent(g *vmmSegment, freeing bool) Event {
	if !freeing {
		if st, err := e.drv.CaptureStatus(g.stream); err != nil || st != CaptureNone {
			return 0
		}
	}
	ev, err := e.event()
	if err != nil {
		return 0
	}
	if err := e.drv.RecordEvent(ev, g.stream); err != nil {
		e.events = append(e.events, ev)
		return 0
	}
	return ev
}

// fenceAll fences every segment with unrecorded spans. Only free spans
// are unrecorded, so a segment with none has nothing to fence.
func (e *vmmSegments) fenceAll() {
	for _, g := range e.segs {
		if g.nfree == 0 || g.asleep {
			g.unfenced = 0
			continue
		}
		e.fence(g, false)
	}
}

// syncMark is what synchronized takes after a device-wide synchronisation
// that began after this call: the frees so far.
func (e *vmmSegments) syncMark() uint64 { return e.seq }

// synchronized is told that every stream has completed all the work queued
// before the mark was taken: spans freed (or fenced) by then are complete.
// Only the unrecorded ones change here; recorded events say so when polled.
func (e *vmmSegments) synchronized(mark uint64) {
	for _, g := range e.segs {
		if g.nfree == 0 || g.asleep {
			continue // only free spans are unrecorded
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.event == unrecorded && sp.seq <= mark {
				sp.event, sp.seq = 0, 0
			}
		}
	}
}

// pollPending frees the pending spans whose events have completed.
func (e *vmmSegments) pollPending() error {
	var err error
	e.pending, err = e.pollSpans(e.pending, func(g *vmmSegment, id spanID) error {
		e.dropEvent(g.span(id).event)
		e.setFree(g, id, 0, 0)
		return nil
	})
	return err
}

// pollDraining unmaps the draining spans whose frees have completed:
// their VA becomes a hole.
func (e *vmmSegments) pollDraining() error {
	var err error
	e.draining, err = e.pollSpans(e.draining, func(g *vmmSegment, id spanID) error {
		if err := e.unmapDraining(g, id); err != nil {
			return err
		}
		// The drain over, g may hold nothing; if the driver would not
		// free its VA, it stays, empty, for the next Trim to try again.
		_ = e.dropIfEmpty(g)
		return nil
	})
	return err
}

// pollSpans polls the events of the spans refs lists (pending or draining,
// oldest first): done is called for each span whose event completed, and a
// span it handled without error leaves the list. Polling stops at the first
// error (the rest stay listed, as they were). Events are polled, never
// waited on.
func (e *vmmSegments) pollSpans(refs []segRef, done func(g *vmmSegment, id spanID) error) ([]segRef, error) {
	keep := refs[:0]
	var err error
	for _, ref := range refs {
		if err == nil {
			ok, qerr := e.drv.EventDone(ref.g.span(ref.id).event)
			if qerr != nil {
				err = qerr
			} else if ok {
				if err = done(ref.g, ref.id); err == nil {
					continue
				}
			}
		}
		keep = append(keep, ref)
	}
	return keep, err
}

// unmapDraining drops the mappings of draining span id of g, from its tail
// (the span shrinks as it goes, so an error leaves it consistent; it goes
// when empty). The handles stay with their owners.
func (e *vmmSegments) unmapDraining(g *vmmSegment, id spanID) error {
	sp := g.span(id)
	for sp.size > 0 {
		va := sp.end() - uintptr(e.gran)
		k := int((va - g.base) / uintptr(e.gran))
		if err := e.drv.Unmap(va, e.gran); err != nil {
			return err
		}
		h := g.handles[k]
		if e.drainMaps[h]--; e.drainMaps[h] == 0 {
			delete(e.drainMaps, h)
		}
		g.handles[k], g.mapped[k] = 0, false
		sp.size -= e.gran
	}
	e.dropEvent(sp.event)
	g.unlink(id)
	return nil
}
