// The segments placement's state, its entry points (Alloc, Free) and step 1.
// See vmm.go for the overview.

package arena

import (
	"errors"
	"fmt"
	"slices"

	"github.com/goalloc/goalloc/internal/addrmap"
)

// segQuantum is the alignment of spans: requests are packed at this step,
// so the granule's rounding is paid once per run of spans, not once per
// request.
const segQuantum = pieceAlign

// The states of a span (see "Segments and spans" in vmm.go).
const (
	spanLive = iota
	spanFree
	spanPending
	spanDraining
)

// segSpan is a run of mapped granules of a segment.
type segSpan struct {
	base  uintptr
	size  uint64
	state uint8
	// event: free, recorded on the segment's stream after its last free
	// (0: its last use has completed; unrecorded: none recorded yet, see
	// "Events"; a fence's event is shared by the spans it covered, counted
	// in holders); pending, recorded on the stream of the free; draining,
	// the event of the free it was before.
	event Event
	// seq orders a free span's event on the segment's stream (newer covers
	// older): when it was recorded, or, unrecorded, when the span was
	// freed; 0 with event 0.
	seq uint64
	// stream: live, the stream it serves (step 1 may place a request in
	// another stream's segment; Sleep waits for each); pending, the stream
	// of the free, never its segment's, which may take it again at once
	// (takeOwnPending).
	stream Stream
}

func (sp *segSpan) end() uintptr { return sp.base + uintptr(sp.size) }

// vmmSegments is the segments placement.
type vmmSegments struct {
	drv   PhysDriver
	gran  uint64
	cap   uint64 // most bytes held; 0: no cap but the device
	segVA uint64 // VA reserved per segment: the device's memory, rounded
	mem   uint64 // the device's memory: more can never be held

	segs []*vmmSegment // in creation order
	// streams holds each share of the placement, by stream and memory tag
	// (see "Sleep and wake" in vmm_sleep.go: memory of two tags never
	// shares a segment, so never a handle).
	streams map[shareKey]*segStream
	// last is the share of lastKey, that of the latest request (nil: none
	// yet): a run of requests on one stream finds its share without a map
	// lookup.
	last     *segStream
	lastKey  shareKey
	byBase   addrmap.Map[segRef] // live spans by base
	pending  []segRef            // pending spans, oldest first
	draining []segRef            // draining spans, oldest first
	// drainMaps counts, per handle, its mappings in draining spans: those
	// are besides the one in the span that owns it.
	drainMaps map[PhysHandle]int32
	spare     []PhysHandle // unmapped handles, between an unmap and a map
	events    []Event      // spare events
	// holders counts the free or draining spans holding a fence's event,
	// for an event more than one holds: it goes back to events when the
	// last lets go (dropEvent). Invariant: it matches the spans.
	holders addrmap.Map[int32] // by Event
	seq     uint64
	// searched is takeComplete's scratch: the shares' free indexes it has
	// searched, empty between calls.
	searched []*freeIndex

	held, heldHigh, live, mapped uint64

	// Sleep and wake (vmm_sleep.go): the tags asleep, what sleep and wake
	// need of the driver (nil: they are refused), and the pinned host
	// memory and streams of their copies.
	sleeping map[Tag]bool
	copier   HostCopier
	host     offloadArea
}

// shareKey names a share of the placement: a stream, and the memory tag of
// what is placed for it (0: untagged).
type shareKey struct {
	s   Stream
	tag Tag
}

// segStream is a stream's share of the placement for one memory tag, found
// with one lookup: its segments, in creation order (a segment's order is
// its place here), and the index of their free spans.
type segStream struct {
	segs []*vmmSegment
	// free indexes the free spans of segs. Invariant: it holds exactly
	// those (CheckInvariants).
	free freeIndex
}

// segRef names a span of a segment.
type segRef struct {
	g  *vmmSegment
	id spanID
}

func newVMMSegments(drv PhysDriver, mem, limit uint64) (*vmmSegments, error) {
	g := drv.Granularity()
	if g == 0 || g&(g-1) != 0 {
		return nil, fmt.Errorf("arena: VMM granularity %d is not a power of two", g)
	}
	e := &vmmSegments{drv: drv, gran: g, cap: limit, mem: mem, streams: map[shareKey]*segStream{},
		drainMaps: map[PhysHandle]int32{}, sleeping: map[Tag]bool{}}
	e.segVA = e.roundGranule(mem)
	return e, nil
}

func (e *vmmSegments) round(n uint64) uint64 {
	if n == 0 {
		return segQuantum
	}
	return (n + segQuantum - 1) &^ (segQuantum - 1)
}

func (e *vmmSegments) roundGranule(n uint64) uint64 { return (n + e.gran - 1) &^ (e.gran - 1) }

func (e *vmmSegments) granule() uint64     { return e.gran }
func (e *vmmSegments) Held() uint64        { return e.held }
func (e *vmmSegments) HeldHigh() uint64    { return e.heldHigh }
func (e *vmmSegments) Live() uint64        { return e.live }
func (e *vmmSegments) SetCap(limit uint64) { e.cap = limit }
func (e *vmmSegments) resetHigh()          { e.heldHigh = e.held }

// Owns says whether va is a live span, and its size.
func (e *vmmSegments) Owns(va uintptr) (uint64, bool) {
	r, ok := e.byBase.Get(va)
	if !ok {
		return 0, false
	}
	return r.g.span(r.id).size, true
}

// eachLive calls f for every live span.
func (e *vmmSegments) eachLive(f func(va uintptr, size uint64)) {
	e.byBase.Range(func(va uintptr, r segRef) bool {
		f(va, r.g.span(r.id).size)
		return true
	})
}

// Alloc places n bytes for stream s, untagged (steps 1-4 of the overview,
// vmm.go).
func (e *vmmSegments) Alloc(size uint64, s Stream) (uintptr, error) { return e.AllocTagged(size, s, 0) }

// AllocTagged places n bytes for stream s in the segments of memory tag
// tag; a tag asleep takes nothing (ErrTagAsleep).
func (e *vmmSegments) AllocTagged(size uint64, s Stream, tag Tag) (uintptr, error) {
	n := e.round(size)
	if e.sleeping[tag] {
		return 0, fmt.Errorf("arena: VMM: allocation of %d bytes in memory tag %d: %w", size, tag, ErrTagAsleep)
	}
	key := shareKey{s, tag}
	if err := e.pollPending(); err != nil {
		return 0, err
	}
	if err := e.pollDraining(); err != nil {
		return 0, err
	}
	if va, ok := e.takeOwn(n, key); ok {
		return va, nil
	}
	// Free memory serves another stream only once known complete:
	// unrecorded spans get their event now (one per segment), which on a
	// stream with nothing left to run completes at once.
	e.fenceAll()
	if va, ok, err := e.takeComplete(n, key); err != nil || ok {
		return va, err
	}
	va, err := e.grow(n, key, true)
	if !errors.Is(err, errAdopted) {
		return va, err
	}
	// s's segments have their pending spans back as free spans: the
	// placement starts again, with nothing left to adopt.
	if va, ok := e.takeOwn(n, key); ok {
		return va, nil
	}
	return e.grow(n, key, false)
}

// takeOwn is step 1's first half: the first free span of key's share of
// at least n bytes, in step 1's order, split with no driver call.
func (e *vmmSegments) takeOwn(n uint64, key shareKey) (uintptr, bool) {
	if st := e.share(key); st != nil {
		if j := st.free.search(freeKey{size: n}); j < len(st.free) {
			return e.take(st, st.free[j], n, key.s), true
		}
	}
	return 0, false
}

// freeUnrecorded makes span id of g free as after a free on g's stream:
// that stream may reuse it at once, and the segment's next fence (an event
// recorded on that stream) covers its last use.
func (e *vmmSegments) freeUnrecorded(g *vmmSegment, id spanID) {
	e.seq++
	e.setFree(g, id, unrecorded, e.seq)
	g.unfenced++
}

// errAdopted is grow's word that, rather than create memory, it gave the
// pending spans of the request's own segments back to its stream
// (adoptPending): the placement starts again.
var errAdopted = errors.New("arena: VMM: pending spans adopted; place again")

// adoptable says whether a segment of key's share holds a pending span:
// memory another stream freed there, whose event key's stream could wait
// for.
func (e *vmmSegments) adoptable(key shareKey) bool {
	if key.s == anyStream {
		return false
	}
	for _, r := range e.pending {
		if r.g.stream == key.s && r.g.tag == key.tag && !r.g.asleep {
			return true
		}
	}
	return false
}

// adoptPending makes the pending spans of key's share free spans of its
// stream once the stream waits for the event of each one's free
// (StreamWaitEvent): its later work is then ordered after that free, as
// after its own frees. A span whose wait is refused (a capture underway)
// stays pending. Step 3's last resort: a miss would otherwise create
// memory while another stream's frees in the segments hold it, frees the
// GPU may reach long after the host (FSDP's all-gather stream, queued
// behind the compute stream's events).
func (e *vmmSegments) adoptPending(key shareKey) {
	e.pending = slices.DeleteFunc(e.pending, func(r segRef) bool {
		g := r.g
		if g.stream != key.s || g.tag != key.tag || g.asleep {
			return false
		}
		sp := g.span(r.id)
		if err := e.drv.StreamWaitEvent(key.s, sp.event); err != nil {
			return false
		}
		e.dropEvent(sp.event)
		// As after a free on s: an event recorded on s from now on covers it.
		e.freeUnrecorded(g, r.id)
		return true
	})
}

// takeOwnPending places n bytes in the smallest pending span of at least
// n bytes that key's stream freed (in another stream's segment of key's
// tag, where step 1 placed it or the program freed it on key's stream):
// the stream's later work is ordered after its own free, so it may use the
// span again at once, as a free span of its own; only other streams wait
// for the free's event. The
// rest of the span stays pending with that event. Step 3's last resort
// before creating memory: without it, a stream that took another's
// complete span and freed it created as much again beside it while the GPU
// ran behind (FSDP's logits, freed and asked for again every step).
func (e *vmmSegments) takeOwnPending(n uint64, key shareKey) (uintptr, bool) {
	if key.s == anyStream {
		return 0, false
	}
	best := -1
	var bestSize uint64
	for i, r := range e.pending {
		if sp := r.g.span(r.id); ownPending(r, key) && sp.size >= n && (best < 0 || sp.size < bestSize) {
			best, bestSize = i, sp.size
		}
	}
	if best < 0 {
		return 0, false
	}
	r := e.pending[best]
	g := r.g
	sp := g.span(r.id)
	base, ev := sp.base, sp.event
	if sp.size > n {
		// The rest keeps the span's place in the list (it is as old) and
		// its event, the only holder still.
		rest := segSpan{base: base + uintptr(n), size: sp.size - n, state: spanPending, event: ev, stream: key.s}
		*sp = segSpan{base: base, size: n, state: spanLive, stream: key.s}
		e.pending[best] = segRef{g, g.insert(g.next(r.id), rest)}
	} else {
		*sp = segSpan{base: base, size: n, state: spanLive, stream: key.s}
		e.dropEvent(ev)
		e.pending = slices.Delete(e.pending, best, best+1)
	}
	e.byBase.Put(base, r)
	e.live += n
	return base, true
}

// ownPending says whether the pending span r names was freed by key's
// stream, in a segment of key's tag that is awake: one the stream may use
// again with no wait (takeOwnPending, lendOwnPending), its later work
// being ordered after its own free.
func ownPending(r segRef, key shareKey) bool {
	return r.g.span(r.id).stream == key.s && r.g.tag == key.tag && !r.g.asleep
}

// takeComplete is step 1's second half: the smallest free span of at
// least n bytes, of another stream's share of the request's tag, whose
// last use has completed, split as take splits the request's own. No
// work uses it any more, so it serves the request where it lies, with no
// driver call but the queries of its event: it stays in its segment, and
// its free, on a stream other than the segment's, is pending like any
// other (Free). Memory taken outside a capture (anyStream) keeps to
// segments of its own, and no other stream takes a span of those: their
// spans are any stream's, so no one stream's order covers them.
func (e *vmmSegments) takeComplete(n uint64, key shareKey) (uintptr, bool, error) {
	if key.s == anyStream {
		return 0, false, nil
	}
	var best *segStream
	var bestKey freeKey
	limit := ^uint64(0)
	// Each share is searched once, in the order of its first segment with
	// a free span, so neither the choice nor the events asked depend on a
	// map's order.
	seen := e.searched[:0]
	defer func() { clear(seen); e.searched = seen[:0] }()
	for _, g := range e.segs {
		if g.nfree == 0 || g.asleep || g.tag != key.tag || g.stream == key.s || g.stream == anyStream || slices.Contains(seen, g.free) {
			continue
		}
		seen = append(seen, g.free)
		st := e.streams[shareKey{g.stream, g.tag}]
		k, ok, err := e.firstComplete(st, n, limit)
		if err != nil {
			return 0, false, err
		}
		if ok && (best == nil || k.size < bestKey.size || k.size == bestKey.size && k.base < bestKey.base) {
			best, bestKey, limit = st, k, k.size
		}
	}
	if best == nil {
		return 0, false, nil
	}
	return e.take(best, bestKey, n, key.s), true, nil
}

// firstComplete is the first of st's free spans of at least n bytes and at
// most limit, in step 1's order, whose last use has completed. The spans a
// fence covered share its event, which is asked once.
func (e *vmmSegments) firstComplete(st *segStream, n, limit uint64) (freeKey, bool, error) {
	var notDone Event
	for j := st.free.search(freeKey{size: n}); j < len(st.free) && st.free[j].size <= limit; j++ {
		k := st.free[j]
		sp := st.segs[k.order].span(k.id)
		if sp.event != 0 && sp.event == notDone {
			continue
		}
		done, err := e.spanDone(sp)
		if err != nil {
			return freeKey{}, false, err
		}
		if done {
			return k, true, nil
		}
		notDone = sp.event
	}
	return freeKey{}, false, nil
}

// share is the share key names, or nil before its first segment.
func (e *vmmSegments) share(key shareKey) *segStream {
	if e.last != nil && e.lastKey == key {
		return e.last
	}
	st := e.streams[key]
	if st != nil {
		e.last, e.lastKey = st, key
	}
	return st
}

// take places n bytes for stream s at the head of the free span k of the
// share st (step 1): the rest stays free, with the event of its last use. A
// request of a granule or more, in a span with a granule to spare, starts
// on the span's first granule boundary instead (granuleStart).
func (e *vmmSegments) take(st *segStream, k freeKey, n uint64, s Stream) uintptr {
	g := st.segs[k.order]
	sp := g.span(k.id)
	if at := e.granuleStart(k.base, sp.size, n); at != k.base {
		// The span's head, before the boundary, stays free apart, with
		// the same event (one more holder).
		e.unindex(g, k.id)
		head := *sp
		head.size = uint64(at - k.base)
		sp.base, sp.size = at, sp.size-head.size
		e.holdEvent(sp.event)
		h := g.insert(k.id, head)
		e.index(g, h)
		e.index(g, k.id)
		sp = g.span(k.id) // insert may move the nodes
		k = freeKey{size: sp.size, base: at, order: g.order, id: k.id}
	}
	if sp.size > n {
		// The rest keeps the span's place in the index, moved to its size.
		rest := segSpan{base: k.base + uintptr(n), size: sp.size - n, state: spanFree, event: sp.event, seq: sp.seq}
		*sp = segSpan{base: k.base, size: n, state: spanLive, stream: s}
		r := g.insert(g.next(k.id), rest)
		g.free.replace(k, freeKey{size: rest.size, base: rest.base, order: g.order, id: r})
	} else {
		e.unindex(g, k.id)
		e.dropEvent(sp.event)
		*sp = segSpan{base: k.base, size: n, state: spanLive, stream: s}
	}
	e.byBase.Put(k.base, segRef{g, k.id})
	e.live += n
	return k.base
}

// granuleStart is where take puts n bytes in the free span [base,
// base+size): on the span's first granule boundary when n is a granule or
// more, the span has a granule to spare (so the request fits after the
// boundary) and the request touches one granule fewer there; else at base.
// A span's granules are held as long as any live byte touches them, so a
// request that outlives its neighbours holds every granule it touches:
// started at base, a tensor of 2.9 granules may touch 4, and when the
// memory around it is freed, the ends of the outer two stay held. Serving's
// KV cache is such: its tensors, grown a token at a time, each placed in
// the free memory its predecessor and the step's activations left, sat
// between two free ends. The head left before the boundary is less than a
// granule, free for smaller requests; a span with less than a granule to
// spare is not split twice.
func (e *vmmSegments) granuleStart(base uintptr, size, n uint64) uintptr {
	if n < e.gran || size < n+e.gran {
		return base
	}
	g := uintptr(e.gran)
	at := (base + g - 1) &^ (g - 1)
	touched := func(p uintptr) uintptr { return (p+uintptr(n)+g-1)/g - p/g }
	if touched(at) < touched(base) {
		return at
	}
	return base
}

// Free gives back the live span at va, ordered on s. On the segment's own
// stream it is free at once for that stream, its event recorded later (a
// fence, see "Events" in vmm.go); on another, it is pending until the
// event recorded there now completes.
func (e *vmmSegments) Free(va uintptr, s Stream, done bool) error {
	r, ok := e.byBase.Get(va)
	if !ok {
		return fmt.Errorf("arena: VMM: free of %#x, which is not a live range", va)
	}
	g := r.g
	if g.asleep {
		// Nothing of it is mapped, and no work may use it: the free is
		// complete at once, and its bytes are not mapped again on wake.
		e.freeAsleep(g, r.id)
		return nil
	}
	own := s == g.stream && s != anyStream
	var ev Event
	if !done && !own {
		var err error
		if ev, err = e.event(); err != nil {
			return err
		}
		if err := e.drv.RecordEvent(ev, s); err != nil {
			e.events = append(e.events, ev)
			return err
		}
	}
	e.byBase.Delete(va)
	sp := g.span(r.id)
	e.live -= sp.size
	if done {
		e.setFree(g, r.id, 0, 0)
		return nil
	}
	if own {
		// Free for s at once, its event recorded later (unrecorded).
		if e.freeUnrecorded(g, r.id); g.unfenced >= fenceEvery {
			e.fence(g, true)
		}
		return nil
	}
	sp.state, sp.event, sp.stream = spanPending, ev, s
	e.pending = append(e.pending, r)
	return nil
}
