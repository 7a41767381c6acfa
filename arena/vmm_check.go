// The invariant checks of the segments placement, which tests run after
// every step. See vmm.go for the overview ("Invariants").

package arena

import (
	"fmt"
	"slices"
	"sort"
)

// CheckInvariants verifies the invariants of the overview (vmm.go,
// "Invariants"); tests call it after every step.
func (e *vmmSegments) CheckInvariants() error {
	t := checkTally{handles: map[PhysHandle]bool{}, drained: map[PhysHandle]int32{}, held: map[Event]int32{}}
	for _, g := range e.segs {
		if err := e.checkSegment(g, &t); err != nil {
			return err
		}
	}
	if err := e.checkDrained(&t); err != nil {
		return err
	}
	if err := e.checkFreeIndexes(); err != nil {
		return err
	}
	if err := e.checkEvents(t.held); err != nil {
		return err
	}
	return e.checkTotals(&t)
}

// checkTally is what CheckInvariants adds up over the segments' spans.
type checkTally struct {
	mapped, live uint64
	liveAsleep   uint64               // of live, the bytes of sleeping segments
	handles      map[PhysHandle]bool  // handles mapped by spans not draining
	drained      map[PhysHandle]int32 // mappings in draining spans, per handle
	held         map[Event]int32      // spans holding each event
	nLive        int
	nPending     int
	nDraining    int
}

// checkSegment verifies g's list and spans, and tallies them in t.
func (e *vmmSegments) checkSegment(g *vmmSegment, t *checkTally) error {
	if g.base%uintptr(e.gran) != 0 || g.size%e.gran != 0 {
		return fmt.Errorf("segment %#x+%d is not granule-aligned", g.base, g.size)
	}
	if err := g.checkList(); err != nil {
		return err
	}
	if g.asleep {
		return e.checkAsleep(g, t)
	}
	if len(g.offloads) > 0 {
		return fmt.Errorf("segment %#x is awake and keeps %d host copies", g.base, len(g.offloads))
	}
	spans, ids := g.ordered()
	// covered: per granule, 1 when spans cover it, 2 when a draining
	// span does (alone: a draining span is whole granules).
	covered := make([]uint8, len(g.mapped))
	for i, sp := range spans {
		if err := e.checkSpanPlace(g, spans, i); err != nil {
			return err
		}
		if err := e.checkSpanGranules(g, sp, covered, t); err != nil {
			return err
		}
		if err := e.checkSpanState(g, sp, ids[i], t); err != nil {
			return err
		}
	}
	for k, m := range g.mapped {
		if m && covered[k] == 0 {
			return fmt.Errorf("segment %#x: granule %d is mapped, in no span", g.base, k)
		}
	}
	return nil
}

// checkAsleep verifies a sleeping segment (vmm_sleep.go): its spans are
// whole quanta inside it, in order, live (or free and complete, where a
// release the driver failed left them, never two touching); each host
// copy is of a live span; it holds no handle but where such a release
// left one mapped, each counted once.
func (e *vmmSegments) checkAsleep(g *vmmSegment, t *checkTally) error {
	spans, ids := g.ordered()
	for i, sp := range spans {
		if sp.size == 0 || sp.size%segQuantum != 0 || sp.base%segQuantum != 0 || sp.base < g.base || sp.end() > g.end() {
			return fmt.Errorf("sleeping segment %#x: span %#x+%d is not whole quanta inside it", g.base, sp.base, sp.size)
		}
		if i > 0 && spans[i-1].end() > sp.base {
			return fmt.Errorf("sleeping segment %#x: span %#x+%d overlaps %#x", g.base, spans[i-1].base, spans[i-1].size, sp.base)
		}
		switch {
		case sp.state == spanFree && sp.event == 0:
			if i > 0 && spans[i-1].state == spanFree && spans[i-1].end() == sp.base {
				return fmt.Errorf("sleeping segment %#x: free spans %#x and %#x touch", g.base, spans[i-1].base, sp.base)
			}
		case sp.state == spanLive:
			if err := e.checkSpanState(g, sp, ids[i], t); err != nil {
				return err
			}
			t.liveAsleep += sp.size
		default:
			return fmt.Errorf("sleeping segment %#x: span %#x in state %d, event %d", g.base, sp.base, sp.state, sp.event)
		}
	}
	for base := range g.offloads {
		if r, ok := e.byBase.Get(base); !ok || r.g != g {
			return fmt.Errorf("sleeping segment %#x keeps a host copy of %#x, which is not one of its live spans", g.base, base)
		}
	}
	for k, m := range g.mapped {
		if !m {
			continue
		}
		if h := g.handles[k]; t.handles[h] {
			return fmt.Errorf("handle %d is mapped twice", h)
		} else {
			t.handles[h] = true
		}
		t.mapped += e.gran
	}
	return nil
}

// checkSpanPlace verifies where spans[i] of g lies: whole quanta inside
// the segment, on granules next to a hole, past its neighbour, and not a
// free span touching another.
func (e *vmmSegments) checkSpanPlace(g *vmmSegment, spans []segSpan, i int) error {
	sp := spans[i]
	if sp.size == 0 || sp.size%segQuantum != 0 || sp.base%segQuantum != 0 {
		return fmt.Errorf("span %#x+%d is not whole quanta", sp.base, sp.size)
	}
	if sp.state == spanDraining && (sp.size%e.gran != 0 || sp.base%uintptr(e.gran) != 0) {
		return fmt.Errorf("draining span %#x+%d is not whole granules", sp.base, sp.size)
	}
	if sp.base < g.base || sp.end() > g.end() {
		return fmt.Errorf("span %#x+%d lies outside its segment %#x+%d", sp.base, sp.size, g.base, g.size)
	}
	// Spans tile runs of mapped granules: next to a hole, a span ends on
	// a granule.
	if i == 0 || spans[i-1].end() != sp.base {
		if sp.base%uintptr(e.gran) != 0 {
			return fmt.Errorf("span %#x+%d begins after a hole, off a granule", sp.base, sp.size)
		}
	}
	if i+1 == len(spans) || sp.end() != spans[i+1].base {
		if sp.end()%uintptr(e.gran) != 0 {
			return fmt.Errorf("span %#x+%d ends before a hole, off a granule", sp.base, sp.size)
		}
	}
	if i > 0 {
		prev := spans[i-1]
		if prev.end() > sp.base {
			return fmt.Errorf("span %#x+%d overlaps %#x", prev.base, prev.size, sp.base)
		}
		if prev.end() == sp.base && prev.state == spanFree && sp.state == spanFree {
			return fmt.Errorf("free spans %#x and %#x touch", prev.base, sp.base)
		}
	}
	return nil
}

// checkSpanGranules verifies that the granules sp touches are mapped, and
// tallies their handles: once each for the spans that are not draining
// (covered 1), and per draining mapping (covered 2, the span's alone).
func (e *vmmSegments) checkSpanGranules(g *vmmSegment, sp segSpan, covered []uint8, t *checkTally) error {
	first := int((sp.base - g.base) / uintptr(e.gran))
	last := int((sp.end() - 1 - g.base) / uintptr(e.gran))
	for k := first; k <= last; k++ {
		if k >= len(g.mapped) || !g.mapped[k] {
			return fmt.Errorf("span %#x+%d: granule %d is not mapped", sp.base, sp.size, k)
		}
		if sp.state == spanDraining {
			covered[k] = 2
			t.drained[g.handles[k]]++
			continue
		}
		if covered[k] == 2 {
			return fmt.Errorf("span %#x+%d shares a draining granule", sp.base, sp.size)
		}
		if covered[k] == 0 {
			covered[k] = 1
			if t.handles[g.handles[k]] {
				return fmt.Errorf("handle %d is mapped twice", g.handles[k])
			}
			t.handles[g.handles[k]] = true
			t.mapped += e.gran
		}
	}
	return nil
}

// checkSpanState verifies what sp, span id of g, holds for its state:
// a live span is indexed and holds no event, a pending or draining one
// holds a recorded event, a free one an event with its seq; and tallies
// the spans and the events they hold.
func (e *vmmSegments) checkSpanState(g *vmmSegment, sp segSpan, id spanID, t *checkTally) error {
	switch sp.state {
	case spanLive:
		t.live += sp.size
		t.nLive++
		if r, _ := e.byBase.Get(sp.base); r.g != g || r.id != id {
			return fmt.Errorf("live span %#x is not indexed", sp.base)
		}
		if sp.event != 0 {
			return fmt.Errorf("live span %#x holds an event", sp.base)
		}
	case spanPending:
		t.nPending++
		if sp.event == 0 || sp.event == unrecorded {
			return fmt.Errorf("pending span %#x has no event", sp.base)
		}
		if sp.stream == g.stream {
			return fmt.Errorf("pending span %#x was freed on its segment's stream", sp.base)
		}
		t.held[sp.event]++
	case spanFree:
		if (sp.event == 0) != (sp.seq == 0) {
			return fmt.Errorf("free span %#x: event %d at %d", sp.base, sp.event, sp.seq)
		}
		if sp.event != 0 && sp.event != unrecorded {
			t.held[sp.event]++
		}
	case spanDraining:
		t.nDraining++
		if sp.event == 0 || sp.event == unrecorded {
			return fmt.Errorf("draining span %#x has no event", sp.base)
		}
		t.held[sp.event]++
	default:
		return fmt.Errorf("span %#x in state %d", sp.base, sp.state)
	}
	return nil
}

// checkDrained verifies that a draining mapping's handle is owned by
// exactly one other span, which held counts, and that drainMaps counts
// the draining mappings.
func (e *vmmSegments) checkDrained(t *checkTally) error {
	for h, n := range t.drained {
		if !t.handles[h] {
			return fmt.Errorf("handle %d is mapped only by draining spans", h)
		}
		if e.drainMaps[h] != n {
			return fmt.Errorf("handle %d: %d draining mappings, %d counted", h, n, e.drainMaps[h])
		}
	}
	if len(t.drained) != len(e.drainMaps) {
		return fmt.Errorf("%d handles in draining spans, %d counted", len(t.drained), len(e.drainMaps))
	}
	return nil
}

// checkFreeIndexes verifies each segment's place among its stream's and
// its count of free spans, that a stream's share lasts while it has a
// segment and lists only segments of the placement, and that each
// stream's free index is exactly its free spans, in step 1's order.
func (e *vmmSegments) checkFreeIndexes() error {
	want := map[shareKey]freeIndex{}
	for _, g := range e.segs {
		if st := e.streams[g.key()]; st == nil || g.order < 0 || int(g.order) >= len(st.segs) || st.segs[g.order] != g {
			return fmt.Errorf("segment %#x is not at its place %d among its share's", g.base, g.order)
		}
		spans, ids := g.ordered()
		nfree := int32(0)
		for i, sp := range spans {
			if sp.state == spanFree {
				want[g.key()] = append(want[g.key()], freeKey{size: sp.size, base: sp.base, order: g.order, id: ids[i]})
				nfree++
			}
		}
		if nfree != g.nfree {
			return fmt.Errorf("segment %#x has %d free spans, counts %d", g.base, nfree, g.nfree)
		}
	}
	nsegs := 0
	for k, st := range e.streams {
		if len(st.segs) == 0 {
			return fmt.Errorf("stream %#x, tag %d has a share and no segment", k.s, k.tag)
		}
		nsegs += len(st.segs)
	}
	if nsegs != len(e.segs) {
		return fmt.Errorf("streams list %d segments, the placement %d", nsegs, len(e.segs))
	}
	for k, st := range e.streams {
		w := want[k]
		sort.Slice(w, func(i, j int) bool { return w[i].less(w[j]) })
		if !slices.Equal(st.free, w) {
			return fmt.Errorf("stream %#x, tag %d: free index %v, free spans %v", k.s, k.tag, st.free, w)
		}
		delete(want, k)
	}
	for k, w := range want {
		return fmt.Errorf("stream %#x, tag %d has %d free spans and no free index", k.s, k.tag, len(w))
	}
	return nil
}

// checkEvents verifies that an event is held by one span, or by the spans
// holders counts, and that no spare event is held by a span.
func (e *vmmSegments) checkEvents(held map[Event]int32) error {
	for ev, n := range held {
		if c, _ := e.holders.Get(uintptr(ev)); n > 1 && c != n {
			return fmt.Errorf("event %d is held by %d spans, %d counted", ev, n, c)
		}
	}
	var herr error
	e.holders.Range(func(k uintptr, n int32) bool {
		if ev := Event(k); held[ev] != n {
			herr = fmt.Errorf("event %d counts %d holders, %d spans hold it", ev, n, held[ev])
			return false
		}
		return true
	})
	if herr != nil {
		return herr
	}
	for _, ev := range e.events {
		if held[ev] > 0 {
			return fmt.Errorf("spare event %d is held by a span", ev)
		}
	}
	return nil
}

// checkTotals verifies the byte counts against the spans (mapped, held,
// live), that no handle is spare between calls, and the lists of live,
// pending and draining spans.
func (e *vmmSegments) checkTotals(t *checkTally) error {
	if t.mapped != e.mapped {
		return fmt.Errorf("mapped %d, spans add up to %d", e.mapped, t.mapped)
	}
	if held := t.mapped + uint64(len(e.spare))*e.gran; held != e.held {
		return fmt.Errorf("held %d, mapped and spare handles add up to %d", e.held, held)
	}
	if len(e.spare) != 0 {
		return fmt.Errorf("%d spare handles between calls", len(e.spare))
	}
	if t.live != e.live || t.live-t.liveAsleep > e.held {
		return fmt.Errorf("live %d, live spans add up to %d (%d of them asleep), held %d", e.live, t.live, t.liveAsleep, e.held)
	}
	if s := e.heldSplit(); s.Parts() != e.held {
		return fmt.Errorf("held %d, its split %+v adds up to %d", e.held, s, s.Parts())
	}
	if t.nLive != e.byBase.Len() {
		return fmt.Errorf("%d live spans, %d indexed", t.nLive, e.byBase.Len())
	}
	if t.nPending != len(e.pending) {
		return fmt.Errorf("%d pending spans, %d listed", t.nPending, len(e.pending))
	}
	for _, ref := range e.pending {
		if !ref.g.linked(ref.id) || ref.g.span(ref.id).state != spanPending {
			return fmt.Errorf("listed pending span %d is not a pending span", ref.id)
		}
	}
	if t.nDraining != len(e.draining) {
		return fmt.Errorf("%d draining spans, %d listed", t.nDraining, len(e.draining))
	}
	for _, ref := range e.draining {
		if !ref.g.linked(ref.id) || ref.g.span(ref.id).state != spanDraining {
			return fmt.Errorf("listed draining span %d is not a draining span", ref.id)
		}
	}
	return nil
}

// checkList verifies the list of g's spans: linked both ways from first to
// last, and every node either in it or unused, once.
func (g *vmmSegment) checkList() error {
	seen := make([]bool, len(g.nodes))
	prev := noSpan
	for id := g.first; id != noSpan; prev, id = id, g.next(id) {
		if id < 0 || int(id) >= len(g.nodes) || seen[id] {
			return fmt.Errorf("segment %#x: span %d is outside its nodes or listed twice", g.base, id)
		}
		seen[id] = true
		if g.prev(id) != prev {
			return fmt.Errorf("segment %#x: span %d follows %d, says %d", g.base, id, prev, g.prev(id))
		}
	}
	if g.last != prev {
		return fmt.Errorf("segment %#x: the last span is %d, the list ends at %d", g.base, g.last, prev)
	}
	for _, id := range g.unused {
		if id < 0 || int(id) >= len(g.nodes) || seen[id] {
			return fmt.Errorf("segment %#x: unused node %d is a span, or listed twice", g.base, id)
		}
		seen[id] = true
	}
	for id, ok := range seen {
		if !ok {
			return fmt.Errorf("segment %#x: node %d is neither a span nor unused", g.base, id)
		}
	}
	return nil
}

// linked says whether id names a span of g (for checks: a walk).
func (g *vmmSegment) linked(id spanID) bool {
	for k := g.first; k != noSpan; k = g.next(k) {
		if k == id {
			return true
		}
	}
	return false
}
