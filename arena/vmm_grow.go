// Growth, steps 2 to 4: where a miss goes, and its pay, lend and map steps.
// See vmm.go for the overview.

package arena

import (
	"errors"
	"fmt"
	"slices"
	"sort"
)

// fill is where step 2 puts a request: region [start, start+n) of segment
// g, made of the free span before a hole (left, its whole), granules of
// the hole, [run, run+need), and the head of the free span after it
// (rightUse bytes of it). What the new granules hold beyond the request,
// less than a granule, becomes a free span.
type fill struct {
	g          *vmmSegment
	start, run uintptr
	need       uint64
	left       spanID // the free span used whole, or noSpan
	right      spanID // the free span whose head is used, or noSpan
	rightUse   uint64
}

// bestFill finds the fill of n bytes in the segments of the share key that
// maps the fewest granules (the lowest address on a tie), of new granules
// alone if fresh; ok false when no hole fits.
func (e *vmmSegments) bestFill(n uint64, key shareKey, fresh bool) (best fill, ok bool) {
	consider := func(f fill) {
		if !ok || f.need < best.need || (f.need == best.need && f.start < best.start) {
			best, ok = f, true
		}
	}
	st := e.share(key)
	if st == nil {
		return best, false
	}
	for _, g := range st.segs {
		// The hole between prev and next, each noSpan at the segment's
		// ends: before every span, and after the last.
		prev, next := noSpan, g.first
		for {
			e.holeFills(g, prev, next, n, fresh, consider)
			if next == noSpan {
				break
			}
			prev, next = next, g.next(next)
		}
	}
	return best, ok
}

// holeFills offers consider each fill of n bytes around the hole of g
// between spans prev and next (noSpan: the segment's ends), if there is a
// hole there: the free span before it extended into it, the free span
// after it extended back, both joined through it, or new granules alone
// (only these if fresh).
func (e *vmmSegments) holeFills(g *vmmSegment, prev, next spanID, n uint64, fresh bool, consider func(fill)) {
	holeBase, holeEnd := g.base, g.end()
	if prev != noSpan {
		holeBase = g.span(prev).end()
	}
	if next != noSpan {
		holeEnd = g.span(next).base
	}
	hole := uint64(holeEnd - holeBase)
	if hole == 0 {
		return
	}
	var l, r uint64
	if prev != noSpan && g.span(prev).state == spanFree && !fresh {
		l = g.span(prev).size
	}
	if next != noSpan && g.span(next).state == spanFree && !fresh {
		r = g.span(next).size
	}
	// Step 1 failed: l < n and r < n. A hole's ends are on granules, so
	// need (whole granules) starts at one.
	if m := e.roundGranule(n - l); l > 0 && m <= hole {
		consider(fill{g: g, start: holeBase - uintptr(l), run: holeBase, need: m, left: prev, right: noSpan})
	}
	if m := e.roundGranule(n - r); r > 0 && m <= hole {
		f := fill{g: g, start: holeEnd - uintptr(m), run: holeEnd - uintptr(m), need: m, left: noSpan, right: noSpan}
		if n > m { // else the request fits the new granules, and their rest joins the span
			f.right, f.rightUse = next, n-m
		}
		consider(f)
	}
	if l > 0 && r > 0 && l+hole < n && n <= l+hole+r {
		consider(fill{g: g, start: holeBase - uintptr(l), run: holeBase, need: hole, left: prev, right: next, rightUse: n - l - hole})
	}
	if m := e.roundGranule(n); m <= hole {
		consider(fill{g: g, start: holeBase, run: holeBase, need: m, left: noSpan, right: noSpan})
	}
}

// segPay: bytes from the tail of the whole granules of the free span id
// of g that pay for new granules: unmapped by the map step when its last
// use has completed; else (drain) mapped at the new place too, and left
// mapped here, draining, until the event of its free completes.
type segPay struct {
	g     *vmmSegment
	id    spanID
	bytes uint64
	drain bool
	// pending: the span is a pending one the request's stream freed
	// itself (lendOwnPending); the pieces a drain leaves of it stay
	// pending, with the free's event, and events is unused.
	pending bool
	// A drain leaves up to two free pieces of the span, before and after
	// the draining granules; each takes an event recorded now on the
	// span's stream, or, lent to another stream, is unrecorded.
	events [2]Event
}

// growth is a miss that step 1 could not serve, as grow carries it through
// steps 2 to 4.
type growth struct {
	s   Stream
	tag Tag
	// f is where the request goes (step 2); newSeg says f lies in a
	// segment still to be reserved.
	f      fill
	newSeg bool
	// pays are the free spans that pay for f's new granules (step 3):
	// complete ones, unmapped by the map step, and those still in use,
	// which lend (drain). paid is their bytes, with the spare handles'.
	pays []segPay
	paid uint64
	// borrowed are the handles the lending spans' tails lend, in the order
	// they map at f.run, first.
	borrowed []PhysHandle
}

// grow is steps 2-4: map what is missing, paid for with free memory. A
// step that fails leaves the state consistent and gives back what the
// steps before it took. With adopt, memory that would be created sends
// the request back to step 1 (errAdopted) once the pending spans of its
// own segments are its free spans (adoptPending).
func (e *vmmSegments) grow(n uint64, key shareKey, adopt bool) (uintptr, error) {
	// AllocTagged has fenced every segment: free memory pays only once
	// known complete.
	gr, err := e.plan(n, key, false)
	if err != nil {
		return 0, err
	}
	if gr.paid < gr.f.need {
		if adopt {
			if va, ok := e.takeOwnPending(n, key); ok {
				e.unpay(gr.pays)
				return va, nil
			}
		}
		e.lendOwnPending(gr)
		if adopt && gr.paid < gr.f.need && e.adoptable(key) {
			e.unpay(gr.pays)
			e.adoptPending(key)
			return 0, errAdopted
		}
	}
	if err := e.afford(gr); err != nil {
		e.unpay(gr.pays)
		if !errors.Is(err, ErrOutOfMemory) || (gr.f.left == noSpan && gr.f.right == noSpan) {
			return 0, err
		}
		// The free spans the fill extends cannot pay for its own new
		// granules, and the cap or the device refuses to create them: new
		// granules alone, which every free span's whole granules may pay
		// for: more maps, but every complete granule that no live span
		// touches can then pay.
		if gr, err = e.plan(n, key, true); err != nil {
			return 0, err
		}
		e.lendOwnPending(gr)
		if err := e.afford(gr); err != nil {
			e.unpay(gr.pays)
			return 0, err
		}
	}
	// From here on the driver is called; each failure leaves the state
	// consistent and gives back what was unmapped to pay.
	if err := e.mapGrowth(gr); err != nil {
		return 0, err
	}
	return e.commit(gr.f, n, gr.pays), nil
}

// plan is steps 2 and 3: where n bytes go (new granules alone if fresh)
// and what pays for them.
func (e *vmmSegments) plan(n uint64, key shareKey, fresh bool) (*growth, error) {
	gr := &growth{s: key.s, tag: key.tag}
	var ok bool
	if gr.f, ok = e.bestFill(n, key, fresh); !ok {
		gr.newSeg = true
		gr.f = fill{need: e.roundGranule(n), left: noSpan, right: noSpan}
	}
	if err := e.payOrLend(gr); err != nil {
		return nil, err
	}
	return gr, nil
}

// payOrLend is step 3: free memory pays for f's new granules, the
// request's own share first. Its own free spans pay, complete ones
// unmapped and the rest lending; then other shares' complete spans; then
// other streams' spans still in use lend, once s waits for their frees.
// Taking its own memory first leaves other streams theirs: a stream whose
// free memory is taken while its own frees are still in use by the work
// queued on it can only create more.
func (e *vmmSegments) payOrLend(gr *growth) error {
	gr.paid = uint64(len(e.spare)) * e.gran
	cands := e.payCandidates(gr.f)
	for _, own := range []bool{true, false} {
		later, err := e.payComplete(gr, cands, own)
		if err == nil {
			err = e.lend(gr, later)
		}
		if err != nil {
			e.unpay(gr.pays)
			return err
		}
	}
	return nil
}

// payComplete pays with the candidates of the request's share (own) or of
// the others whose last use has completed, the largest first, with the
// tail of their whole granules (unmapped by the map step; their handles
// map at the new place), whatever their tag: an unmapped handle holds
// nothing of anyone's. It returns those still in use that may lend: of
// the request's stream and tag, or of another stream and the same tag. A
// span with a handle still mapped in a draining span does not pay.
func (e *vmmSegments) payComplete(gr *growth, cands []segRef, own bool) ([]segRef, error) {
	var later []segRef
	for _, c := range cands {
		if gr.paid >= gr.f.need {
			break
		}
		if mine := c.g.stream == gr.s && c.g.tag == gr.tag && gr.s != anyStream; mine != own {
			continue
		}
		sp := c.g.span(c.id)
		done, err := e.spanDone(sp)
		if err != nil {
			return nil, err
		}
		if !done {
			if c.g.tag == gr.tag && gr.s != anyStream && c.g.stream != anyStream {
				later = append(later, c)
			}
			continue
		}
		if e.drainMapped(c.g, sp) {
			continue
		}
		take := min(e.wholeBytes(c), gr.f.need-gr.paid)
		gr.pays = append(gr.pays, segPay{g: c.g, id: c.id, bytes: take})
		gr.paid += take
	}
	return later, nil
}

// lend is step 3's second half: free spans whose last use may still run,
// the largest first, lend the handles of their whole granules' tail,
// mapped at both places until the free completes. The request's work is
// queued on s after that last use: a span of s's own was freed on s, and
// for another stream's s first waits for the span's event
// (StreamWaitEvent), the way a stream-ordered pool reuses another
// stream's frees by adding a dependency. While a capture is underway
// nothing lends (no event can be recorded or waited for): what is missing
// is created.
func (e *vmmSegments) lend(gr *growth, later []segRef) error {
	for _, c := range later {
		if gr.paid >= gr.f.need {
			break
		}
		sp := c.g.span(c.id)
		if sp.event == unrecorded {
			// The draining tail is polled: it needs an event, and one
			// recorded now covers its free; without one, it does not lend.
			if e.fence(c.g, false); sp.event == unrecorded {
				continue
			}
		}
		_, hi := e.whole(sp)
		take := min(e.wholeBytes(c), gr.f.need-gr.paid)
		p := segPay{g: c.g, id: c.id, bytes: take, drain: true}
		if c.g.stream != gr.s {
			// Without the wait the memory may not serve s: a refused wait
			// leaves the span where it is, and what it would have paid is
			// created.
			if err := e.drv.StreamWaitEvent(gr.s, sp.event); err != nil {
				if errors.Is(err, ErrCaptureUnderway) {
					return nil
				}
				continue
			}
		}
		if c.g.stream != gr.s {
			// The pieces left free stay their segment's stream's: their
			// last use is that stream's work, queued before the free, which
			// its next fence covers. An event recorded on s would not cover
			// that stream's frees that the pieces coalesce with later (the
			// newer event is kept, see merge).
			p.events = [2]Event{unrecorded, unrecorded}
		} else if err := e.recordPieces(&p, gr.s); err != nil {
			if errors.Is(err, ErrCaptureUnderway) {
				return nil
			}
			return err
		}
		for va := hi - uintptr(take); va < hi; va += uintptr(e.gran) {
			gr.borrowed = append(gr.borrowed, c.g.handles[(va-c.g.base)/uintptr(e.gran)])
		}
		gr.pays = append(gr.pays, p)
		gr.paid += take
	}
	return nil
}

// lendOwnPending is step 3's last lender before memory is created: the
// pending spans the request's stream freed itself, in other streams'
// segments of its tag, the largest first, lend the handles of their whole
// granules' tail, as its own free spans still in use do (lend). No wait is
// needed: the stream's later work is ordered after its own free, so after
// every use of the old VA. The tail drains where it lies until the free's
// event completes, and the pieces left stay pending with that event.
// takeOwnPending, which moves nothing, serves a request that one such span
// holds whole; this serves one larger than each: FSDP's logits, freed on
// the compute stream in the all-gather stream's segment and asked for
// again, larger, while the GPU ran behind, were otherwise created anew
// beside their pending predecessor.
func (e *vmmSegments) lendOwnPending(gr *growth) {
	if gr.s == anyStream || gr.paid >= gr.f.need {
		return
	}
	var cands []segRef
	for _, r := range e.pending {
		if ownPending(r, shareKey{gr.s, gr.tag}) && e.wholeBytes(r) > 0 {
			cands = append(cands, r)
		}
	}
	if len(cands) == 0 {
		return
	}
	// A stream being captured queues nothing now: the graph's replays,
	// wherever they are launched, are not ordered after its earlier work,
	// so nothing lends to it (its own free spans still in use do not
	// either: the events of their pieces cannot be recorded).
	if st, err := e.drv.CaptureStatus(gr.s); err != nil || st != CaptureNone {
		return
	}
	sort.SliceStable(cands, func(a, b int) bool { return e.wholeBytes(cands[a]) > e.wholeBytes(cands[b]) })
	for _, c := range cands {
		if gr.paid >= gr.f.need {
			break
		}
		_, hi := e.whole(c.g.span(c.id))
		take := min(e.wholeBytes(c), gr.f.need-gr.paid)
		for va := hi - uintptr(take); va < hi; va += uintptr(e.gran) {
			gr.borrowed = append(gr.borrowed, c.g.handles[(va-c.g.base)/uintptr(e.gran)])
		}
		gr.pays = append(gr.pays, segPay{g: c.g, id: c.id, bytes: take, drain: true, pending: true})
		gr.paid += take
	}
}

// recordPieces gives each piece of p's span, of s's own, left free around
// the lent tail (before it, and the span's end in a granule it shares) an
// event recorded now on s, after the free's. On an error the events it
// took go back to the spare ones.
func (e *vmmSegments) recordPieces(p *segPay, s Stream) error {
	sp := p.g.span(p.id)
	_, hi := e.whole(sp)
	pieces := 0
	if hi-uintptr(p.bytes) > sp.base {
		pieces++
	}
	if hi < sp.end() {
		pieces++
	}
	for k := 0; k < pieces; k++ {
		ev, err := e.event()
		if err == nil {
			if err = e.drv.RecordEvent(ev, s); err != nil {
				e.events = append(e.events, ev)
			}
		}
		if err != nil {
			e.unpay([]segPay{*p})
			return err
		}
		p.events[k] = ev
	}
	return nil
}

// unpay gives back the events recorded for the pieces of lending spans,
// when their grow fails (the spans change only at commit).
func (e *vmmSegments) unpay(pays []segPay) {
	for _, p := range pays {
		for _, ev := range p.events {
			if ev != 0 && ev != unrecorded {
				e.events = append(e.events, ev)
			}
		}
	}
}

// afford is step 4: what nothing free pays for is created, if the cap and
// the device's memory allow it; a refusal comes before any driver call.
func (e *vmmSegments) afford(gr *growth) error {
	var create uint64
	if gr.paid < gr.f.need {
		create = gr.f.need - gr.paid
	}
	// Held grows by what is created; above a lowered cap, a request that
	// needs nothing created still goes through (held does not grow).
	if after := e.held + create; e.cap > 0 && create > 0 && after > e.cap {
		return fmt.Errorf("arena: VMM: %d bytes more would hold %d bytes, above the cap of %d: %w",
			create, after, e.cap, ErrOutOfMemory)
	}
	// Nor more than the device has: that would create handles until the
	// driver refuses one, holding the device's memory for a moment, and
	// give them all back.
	if after := e.held + create; create > 0 && e.mem > 0 && after > e.mem {
		return fmt.Errorf("arena: VMM: %d bytes more would hold %d bytes, more than the device's %d: %w",
			create, after, e.mem, ErrOutOfMemory)
	}
	return nil
}

// mapGrowth is the map step: it reserves the new segment, if f lies in
// one, unmaps the complete spans that pay (their handles become spare),
// and maps the new granules (mapNew). A failure undoes what it did and
// releases the spare handles.
func (e *vmmSegments) mapGrowth(gr *growth) error {
	if gr.newSeg {
		g, err := e.newSegment(shareKey{gr.s, gr.tag}, max(e.segVA, gr.f.need))
		if err != nil {
			e.unpay(gr.pays)
			return err
		}
		gr.f.g, gr.f.start, gr.f.run = g, g.base, g.base
	}
	for _, p := range gr.pays {
		if p.drain {
			continue
		}
		if err := e.unmapWhole(p.g, p.id, p.bytes, false); err != nil {
			e.unpay(gr.pays)
			return errors.Join(err, e.releaseSpare())
		}
	}
	return e.mapNew(gr)
}

// mapNew maps f's new granules, borrowed handles first (so that a failure
// knows which of the new granules are theirs), then spare ones, then new
// ones, and sets access over them once.
func (e *vmmSegments) mapNew(gr *growth) error {
	f := gr.f
	g := f.g
	nb := uint64(len(gr.borrowed)) * e.gran
	// fail undoes the first mapped bytes of the run.
	fail := func(err error, mapped uint64) error {
		e.unpay(gr.pays)
		return errors.Join(err, e.unmapRun(g, f.run, mapped, nb), e.releaseSpare())
	}
	for off := uint64(0); off < f.need; off += e.gran {
		var h PhysHandle
		switch k := len(e.spare); {
		case off < nb:
			h = gr.borrowed[off/e.gran]
		case k > 0:
			h = e.spare[k-1]
			e.spare = e.spare[:k-1]
		default:
			var err error
			if h, err = e.drv.CreateHandle(e.gran); err != nil {
				return fail(err, off)
			}
			e.held += e.gran
			e.heldHigh = max(e.heldHigh, e.held)
		}
		va := f.run + uintptr(off)
		if err := e.drv.Map(va, e.gran, h); err != nil {
			if off >= nb {
				e.spare = append(e.spare, h)
			}
			return fail(err, off)
		}
		e.setHandle(g, va, h)
	}
	if err := e.drv.SetAccess(f.run, f.need); err != nil {
		return fail(err, f.need)
	}
	return nil
}

// payCandidates is what may pay for f's new granules (step 3): the free
// spans with whole granules, but for those f itself joins, the largest
// first (in creation order of their segments, then address, on a tie).
// Only segments with a free span are walked, so segments of streams that
// hold only live memory cost nothing here.
func (e *vmmSegments) payCandidates(f fill) []segRef {
	var cands []segRef
	for _, g := range e.segs {
		if g.nfree == 0 || g.asleep {
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			sp := g.span(id)
			if sp.state != spanFree || (g == f.g && (id == f.left || id == f.right)) {
				continue
			}
			if lo, hi := e.whole(sp); hi > lo {
				cands = append(cands, segRef{g, id})
			}
		}
	}
	sort.SliceStable(cands, func(a, b int) bool { return e.wholeBytes(cands[a]) > e.wholeBytes(cands[b]) })
	return cands
}

// newSegment reserves a segment of size bytes of VA for the share key,
// the last of its share's; the share is made with its first.
func (e *vmmSegments) newSegment(key shareKey, size uint64) (*vmmSegment, error) {
	base, err := e.drv.ReserveVA(size)
	if err != nil {
		return nil, err
	}
	st := e.streams[key]
	if st == nil {
		st = &segStream{}
		e.streams[key] = st
	}
	g := &vmmSegment{stream: key.s, tag: key.tag, order: int32(len(st.segs)), base: base, size: size, free: &st.free, first: noSpan, last: noSpan}
	e.segs = append(e.segs, g)
	st.segs = append(st.segs, g)
	return g, nil
}

// commit ends a grow whose driver calls all succeeded: the borrowed tails
// drain, the region's spans become one live span of n bytes, and a
// segment that paid with its last granules gives its VA back.
func (e *vmmSegments) commit(f fill, n uint64, pays []segPay) uintptr {
	lent := false
	for _, p := range pays {
		if p.drain {
			e.drain(p)
			lent = true
		}
	}
	e.placeLive(f, n, lent)
	for _, p := range pays {
		// The request is served: a segment the driver would not free
		// stays, empty, for the next Trim to try again.
		_ = e.dropIfEmpty(p.g)
	}
	return f.start
}

// placeLive makes f's region one live span of n bytes: the free spans it
// joins go into it, and what the new granules hold beyond it is free. With
// lent, some new granule's handle was lent by a span whose last use may
// still run (step 3): only s's own work is ordered after that use, so the
// rest is free as after a free on s (unrecorded: an event recorded on s
// from now on covers it), not complete, lest another stream take it where
// it lies (takeComplete) while that use runs.
func (e *vmmSegments) placeLive(f fill, n uint64, lent bool) {
	g := f.g
	live := segSpan{base: f.start, size: n, state: spanLive, stream: g.stream}
	// next: the span the live one goes before.
	next := g.spanAt(f.start)
	if f.left != noSpan {
		// The whole left span goes into the request: next is it.
		e.unindex(g, next)
		e.dropEvent(g.span(next).event)
		left := next
		next = g.next(left)
		g.unlink(left)
	}
	if f.right != noSpan {
		r := g.span(next)
		e.unindex(g, next)
		if f.rightUse == r.size {
			e.dropEvent(r.event)
			right := next
			next = g.next(right)
			g.unlink(right)
		} else {
			r.base += uintptr(f.rightUse)
			r.size -= f.rightUse
			e.index(g, next)
		}
	}
	at := g.insert(next, live)
	if end, mapped := f.start+uintptr(n), f.run+uintptr(f.need); end < mapped {
		// The new granules' rest: free, joined to a free span after it;
		// complete unless a handle was lent.
		rest := g.insert(g.next(at), segSpan{base: end, size: uint64(mapped - end)})
		if lent {
			e.freeUnrecorded(g, rest)
		} else {
			e.setFree(g, rest, 0, 0)
		}
	}
	e.byBase.Put(f.start, segRef{g, at})
	e.live += n
}

// drain makes the tail of the whole granules of p's free span draining:
// still mapped, its handles now owned by the span they were just mapped
// into as well. The draining granules keep the free's event; the pieces
// of the span before and after them, if any, stay free with p.events, or,
// of a pending span, pending with its event (which they then share).
func (e *vmmSegments) drain(p segPay) {
	g := p.g
	sp := *g.span(p.id)
	_, hi := e.whole(&sp)
	tail := segSpan{base: hi - uintptr(p.bytes), size: p.bytes, state: spanDraining, event: sp.event, seq: sp.seq}
	piece := func(base uintptr, size uint64, k int) segSpan {
		if p.pending {
			e.holdEvent(sp.event)
			return segSpan{base: base, size: size, state: spanPending, event: sp.event, seq: sp.seq, stream: sp.stream}
		}
		e.seq++
		if p.events[k] == unrecorded {
			g.unfenced++
		}
		return segSpan{base: base, size: size, state: spanFree, event: p.events[k], seq: e.seq}
	}
	var pieces [3]segSpan
	np, k, at := 0, 0, 0 // at: the tail's place among the pieces
	if tail.base > sp.base {
		pieces[np] = piece(sp.base, uint64(tail.base-sp.base), k)
		np, k, at = np+1, k+1, 1
	}
	pieces[np] = tail
	np++
	if hi < sp.end() {
		pieces[np] = piece(hi, uint64(sp.end()-hi), k)
		np++
	}
	e.unindex(g, p.id)
	ids := [3]spanID{p.id}
	*g.span(p.id) = pieces[0]
	for j := 1; j < np; j++ {
		ids[j] = g.insert(g.next(ids[j-1]), pieces[j])
	}
	for j := 0; j < np; j++ {
		e.index(g, ids[j])
	}
	if p.pending {
		// The pieces take the span's place in the pending list (they are as
		// old), the tail goes to the draining one.
		i := slices.Index(e.pending, segRef{g, p.id})
		var refs []segRef
		for j := 0; j < np; j++ {
			if j != at {
				refs = append(refs, segRef{g, ids[j]})
			}
		}
		e.pending = slices.Replace(e.pending, i, i+1, refs...)
	}
	for va := tail.base; va < tail.end(); va += uintptr(e.gran) {
		e.drainMaps[g.handles[(va-g.base)/uintptr(e.gran)]]++
	}
	e.mapped -= p.bytes
	e.draining = append(e.draining, segRef{g, ids[at]})
}

// drainMapped says whether a whole granule of sp, of g, has a handle also
// mapped in a draining span: such a handle must not be released, so its
// span does not pay. The free that made the draining span came before
// this span's last use, so this is rare once pollDraining has run.
func (e *vmmSegments) drainMapped(g *vmmSegment, sp *segSpan) bool {
	if len(e.drainMaps) == 0 {
		return false
	}
	lo, hi := e.whole(sp)
	for va := lo; va < hi; va += uintptr(e.gran) {
		if e.drainMaps[g.handles[(va-g.base)/uintptr(e.gran)]] > 0 {
			return true
		}
	}
	return false
}

func (e *vmmSegments) setHandle(g *vmmSegment, va uintptr, h PhysHandle) {
	k := int((va - g.base) / uintptr(e.gran))
	for len(g.handles) <= k {
		g.handles = append(g.handles, 0)
		g.mapped = append(g.mapped, false)
	}
	g.handles[k], g.mapped[k] = h, true
	e.mapped += e.gran
}

// unmapGranule drops the mapping at va of g; its handle becomes spare.
func (e *vmmSegments) unmapGranule(g *vmmSegment, va uintptr) error {
	k := int((va - g.base) / uintptr(e.gran))
	if err := e.drv.Unmap(va, e.gran); err != nil {
		return err
	}
	e.spare = append(e.spare, g.handles[k])
	g.handles[k], g.mapped[k] = 0, false
	e.mapped -= e.gran
	return nil
}

// unmapRun undoes the first size bytes mapped at run by a failed grow: no
// work can use them yet. The first borrowed bytes map handles borrowed
// from a free span, which keeps them.
func (e *vmmSegments) unmapRun(g *vmmSegment, run uintptr, size, borrowed uint64) error {
	var errs []error
	for off := uint64(0); off < size; off += e.gran {
		va := run + uintptr(off)
		if off >= borrowed {
			errs = append(errs, e.unmapGranule(g, va))
			continue
		}
		if err := e.drv.Unmap(va, e.gran); err != nil {
			errs = append(errs, err)
			continue
		}
		k := int((va - g.base) / uintptr(e.gran))
		g.handles[k], g.mapped[k] = 0, false
		e.mapped -= e.gran
	}
	return errors.Join(errs...)
}

// releaseSpare releases every spare handle.
func (e *vmmSegments) releaseSpare() error {
	for len(e.spare) > 0 {
		k := len(e.spare) - 1
		if err := e.drv.ReleaseHandle(e.spare[k]); err != nil {
			return err
		}
		e.spare = e.spare[:k]
		e.held -= e.gran
	}
	return nil
}

// unmapWhole unmaps bytes from the tail of the whole granules of the
// complete free span id of g, a granule at a time; the handles become
// spare, or are released. Each unmapped granule cuts the span: what lies
// before it keeps the base, what lies after it (the span's end, in a
// granule shared with the next span) becomes a free span of its own, and
// the granule a hole between them; so an error leaves a consistent state.
// bytes is at most the span's whole granules, so span id lasts until the
// last granule.
func (e *vmmSegments) unmapWhole(g *vmmSegment, id spanID, bytes uint64, release bool) error {
	for done := uint64(0); done < bytes; done += e.gran {
		sp := *g.span(id)
		_, hi := e.whole(&sp)
		va := hi - uintptr(e.gran)
		if err := e.unmapGranule(g, va); err != nil {
			return err
		}
		after := segSpan{base: va + uintptr(e.gran), size: uint64(sp.end() - va - uintptr(e.gran)), state: spanFree}
		e.unindex(g, id)
		next := g.next(id)
		if va > sp.base {
			g.span(id).size = uint64(va - sp.base)
			e.index(g, id)
		} else {
			g.unlink(id)
		}
		if after.size > 0 {
			e.index(g, g.insert(next, after))
		}
		if release {
			if err := e.releaseSpare(); err != nil {
				return err
			}
		}
	}
	return nil
}
