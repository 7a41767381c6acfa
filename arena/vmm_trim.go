// Trimming: free memory released, empty segments' VA given back, and Close.
// See vmm.go for the overview.

package arena

import (
	"errors"
	"slices"
	"sort"
)

// Trim unmaps and releases complete free memory, the largest spans first,
// from their tails, until at most keep bytes are held or nothing free is
// complete. Pending spans and free ones still in use keep their memory.
func (e *vmmSegments) Trim(keep uint64) error {
	// Unrecorded spans get their event now: they are known complete when it
	// has (at once, after a device synchronisation: see synchronized).
	e.fenceAll()
	if err := e.pollPending(); err != nil {
		return err
	}
	if err := e.pollDraining(); err != nil {
		return err
	}
	if err := e.releaseSpare(); err != nil {
		return err
	}
	var free []segRef
	for _, g := range e.segs {
		if g.nfree == 0 || g.asleep {
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if g.span(id).state == spanFree {
				free = append(free, segRef{g, id})
			}
		}
	}
	sort.SliceStable(free, func(a, b int) bool { return e.wholeBytes(free[a]) > e.wholeBytes(free[b]) })
	for _, ref := range free {
		if e.held <= keep {
			break
		}
		sp := ref.g.span(ref.id)
		if done, err := e.spanDone(sp); err != nil {
			return err
		} else if !done {
			continue
		}
		if e.drainMapped(ref.g, sp) {
			continue
		}
		bytes := min(e.wholeBytes(ref), e.roundGranule(e.held-keep))
		if bytes == 0 {
			continue
		}
		if err := e.unmapWhole(ref.g, ref.id, bytes, true); err != nil {
			return err
		}
	}
	return e.dropEmpty()
}

// dropEmpty gives back the VA of every segment that holds nothing.
func (e *vmmSegments) dropEmpty() error {
	var empty []*vmmSegment
	for _, g := range e.segs {
		if g.first == noSpan {
			empty = append(empty, g)
		}
	}
	for _, g := range empty {
		if err := e.dropIfEmpty(g); err != nil {
			return err
		}
	}
	return nil
}

// dropIfEmpty gives g's VA back once g holds nothing: no span, so nothing
// mapped, live, pending or draining (see "VA and streams" in vmm.go). Its
// stream's share goes with its last segment. A segment already dropped
// (order -1) is left alone; one the driver would not free stays, as it
// was.
func (e *vmmSegments) dropIfEmpty(g *vmmSegment) error {
	if g.first != noSpan || g.order < 0 || (g.asleep && g.holdsHandles()) {
		return nil
	}
	if err := e.drv.FreeVA(g.base, g.size); err != nil {
		if errors.Is(err, ErrCaptureUnderway) {
			return nil // kept until a Trim after the capture
		}
		return err
	}
	i := slices.Index(e.segs, g)
	e.segs = slices.Delete(e.segs, i, i+1)
	st := e.streams[g.key()]
	st.remove(g)
	if len(st.segs) == 0 {
		delete(e.streams, g.key())
		if e.last == st {
			e.last = nil
		}
	}
	return nil
}

// remove takes g, which has no free span, out of the stream's segments:
// those after it move down one place, and so do their keys in the free
// index, which keeps its order (every key at a place above g's drops by
// one, and none is at g's).
func (st *segStream) remove(g *vmmSegment) {
	k := g.order
	st.segs = slices.Delete(st.segs, int(k), int(k)+1)
	for j := int(k); j < len(st.segs); j++ {
		st.segs[j].order = int32(j)
	}
	for i := range st.free {
		if st.free[i].order > k {
			st.free[i].order--
		}
	}
	g.order = -1
}

// Close unmaps and releases everything and gives the VA back. Live spans
// are lost.
func (e *vmmSegments) Close() error {
	var errs []error
	// Draining mappings go first: a handle is released only once mapped
	// nowhere.
	for _, ref := range e.draining {
		errs = append(errs, e.unmapDraining(ref.g, ref.id))
	}
	e.draining = nil
	destroyed := map[Event]bool{}
	for _, g := range e.segs {
		for k, m := range g.mapped {
			if m {
				errs = append(errs, e.unmapGranule(g, g.base+uintptr(k)*uintptr(e.gran)))
			}
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.event != 0 && sp.event != unrecorded && !destroyed[sp.event] {
				destroyed[sp.event] = true // a fence's event, shared
				errs = append(errs, e.drv.DestroyEvent(sp.event))
			}
		}
		g.nodes, g.unused, g.first, g.last = nil, nil, noSpan, noSpan
		errs = append(errs, e.releaseSpare(), e.drv.FreeVA(g.base, g.size))
	}
	for _, ev := range e.events {
		errs = append(errs, e.drv.DestroyEvent(ev))
	}
	errs = append(errs, e.host.close(e.copier))
	*e = vmmSegments{drv: e.drv, gran: e.gran, segVA: e.segVA, mem: e.mem, streams: map[shareKey]*segStream{},
		drainMaps: map[PhysHandle]int32{}, sleeping: map[Tag]bool{}, copier: e.copier}
	return errors.Join(errs...)
}
