// What the physical memory a VMM device holds is made of, span by span: the
// measure behind "what holds the memory beyond live". See vmm.go for the
// overview ("What it wastes").

package arena

import "sort"

// HeldSplit is the physical memory a VMM device holds, by what its spans
// are (vmm.go's glossary). Held is Live + FreeShared + FreeWhole +
// Pending + Asleep: a draining span's granules are mapped at its old VA as
// well as at the new one, and held counts each handle once, at the new one.
type HeldSplit struct {
	Held uint64 `json:"held"`
	// Live is the spans handed to the layer above: goalloc's blocks and
	// small segments, in use or cached there.
	Live uint64 `json:"live"`
	// FreeShared is the bytes of free spans in granules they share with a
	// live or pending neighbour: mapped, usable by the segment's stream,
	// but no handle of it can move. FreeWhole is their granules covered
	// alone, which the next growth pays with (step 3). FreeSpans counts
	// the free spans.
	FreeShared uint64 `json:"free_shared"`
	FreeWhole  uint64 `json:"free_whole"`
	FreeSpans  int    `json:"free_spans"`
	// FreeBesideSmall is the part of FreeShared in granules shared with a
	// live span under smallLiveSpan: free ends a small block pins, so
	// that a run says whether small blocks or large ones hold them.
	FreeBesideSmall uint64 `json:"free_beside_small"`
	// Pending is spans freed on another stream, waiting for its event;
	// Draining, spans whose handles were lent (not in Held).
	Pending  uint64 `json:"pending"`
	Draining uint64 `json:"draining"`
	// Asleep is what sleeping segments still map: granules whose release
	// the driver failed (vmm_sleep.go); nothing otherwise.
	Asleep uint64 `json:"asleep,omitempty"`
}

// smallLiveSpan is what FreeBesideSmall counts as a small live span: the
// caching layer's small segments, and its blocks under 1 MiB, are below it.
const smallLiveSpan = 1 << 20

// Parts is what the split adds up to, which is Held.
func (s HeldSplit) Parts() uint64 { return s.Live + s.FreeShared + s.FreeWhole + s.Pending + s.Asleep }

// HeldSplitter is a device that says what its held memory is made of: the
// VMM devices. HeldSplitAtPeak is the split when held last reached a new
// high-water mark (since the device was made or its peaks reset): what
// held the memory at the peak, taken by the device itself rather than by
// a sampler that may see the peak late.
type HeldSplitter interface {
	HeldSplit() HeldSplit
	HeldSplitAtPeak() HeldSplit
	FreeEndsBeside() []FreeEnds
}

// HeldSplit, HeldSplitAtPeak and FreeEndsBeside are HeldSplitter's
// methods; the first and the last walk every span.
func (d *SimVMM) HeldSplit() HeldSplit       { return d.src.heldSplit() }
func (d *SimVMM) HeldSplitAtPeak() HeldSplit { return d.src.heldSplitAtPeak() }
func (d *SimVMM) FreeEndsBeside() []FreeEnds { return d.src.freeEndsBeside() }

func (v *vmmSource) freeEndsBeside() []FreeEnds {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.eng.freeEndsBeside()
}

func (v *vmmSource) heldSplit() HeldSplit {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.eng.heldSplit()
}

func (v *vmmSource) heldSplitAtPeak() HeldSplit {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.peakSplit
}

// heldSplit adds up the spans; CheckInvariants checks that the parts make
// up held.
func (e *vmmSegments) heldSplit() HeldSplit {
	out := HeldSplit{Held: e.held}
	for _, g := range e.segs {
		if g.asleep {
			for _, m := range g.mapped {
				if m {
					out.Asleep += e.gran
				}
			}
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			sp := g.span(id)
			switch sp.state {
			case spanLive:
				out.Live += sp.size
			case spanFree:
				lo, hi := e.whole(sp)
				whole := uint64(max(hi, lo) - lo)
				out.FreeWhole += whole
				out.FreeShared += sp.size - whole
				out.FreeBesideSmall += e.besideSmall(g, id, lo, hi)
				out.FreeSpans++
			case spanPending:
				out.Pending += sp.size
			case spanDraining:
				out.Draining += sp.size
			}
		}
	}
	return out
}

// sharedEnd is the bytes at one end of a free span that lie in a granule
// it shares with a neighbour: beside, and also (noSpan: none) the span
// after it when the free span ends inside the granule of its head.
type sharedEnd struct {
	bytes        uint64
	beside, also spanID
}

// endsOf is the shared ends of the free span id of g, whose whole granules
// are [lo, hi): its head, before lo, shares a granule with the span before
// it, and with the one after it too when the span ends unaligned inside
// that granule; its tail, from hi, with the span after it.
func (e *vmmSegments) endsOf(g *vmmSegment, id spanID, lo, hi uintptr) (head, tail sharedEnd) {
	sp := g.span(id)
	end := sp.end()
	head, tail = sharedEnd{beside: g.prev(id), also: noSpan}, sharedEnd{beside: g.next(id), also: noSpan}
	if headEnd := min(lo, end); headEnd > sp.base {
		head.bytes = uint64(headEnd - sp.base)
		if end < lo {
			head.also = g.next(id)
		}
	}
	if end > lo && hi < end {
		tail.bytes = uint64(end - hi)
	}
	return head, tail
}

// besideSmall is the bytes of the free span id of g, whose whole granules
// are [lo, hi), in granules it shares with a live span under
// smallLiveSpan.
func (e *vmmSegments) besideSmall(g *vmmSegment, id spanID, lo, hi uintptr) uint64 {
	small := func(n spanID) bool {
		return n != noSpan && g.span(n).state == spanLive && g.span(n).size < smallLiveSpan
	}
	head, tail := e.endsOf(g, id, lo, hi)
	var out uint64
	if small(head.beside) || small(head.also) {
		out += head.bytes
	}
	if small(tail.beside) {
		out += tail.bytes
	}
	return out
}

// FreeEnds is the free ends beside the live spans of one size: the bytes
// of free spans in granules they share with live spans of LiveSize bytes,
// and how many such live spans there are. A VMM device's FreeEndsBeside
// lists them, the most bytes first: which live memory pins the free ends
// (HeldSplit's FreeShared) that hold memory beyond live.
type FreeEnds struct {
	LiveSize  uint64 `json:"live_size"`
	LiveSpans int    `json:"live_spans"`
	Bytes     uint64 `json:"bytes"`
}

// freeEndsBeside walks every span for FreeEnds: an end shared with two
// live spans (a free span inside one granule) counts beside the first.
// Ends beside no live span (a pending one) are left out.
func (e *vmmSegments) freeEndsBeside() []FreeEnds {
	bySize := map[uint64]*FreeEnds{}
	seen := map[segRef]bool{}
	add := func(g *vmmSegment, end sharedEnd) {
		n := end.beside
		if n == noSpan || g.span(n).state != spanLive {
			n = end.also
		}
		if end.bytes == 0 || n == noSpan || g.span(n).state != spanLive {
			return
		}
		size := g.span(n).size
		fe := bySize[size]
		if fe == nil {
			fe = &FreeEnds{LiveSize: size}
			bySize[size] = fe
		}
		fe.Bytes += end.bytes
		if ref := (segRef{g, n}); !seen[ref] {
			seen[ref] = true
			fe.LiveSpans++
		}
	}
	for _, g := range e.segs {
		if g.asleep {
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.state == spanFree {
				lo, hi := e.whole(sp)
				head, tail := e.endsOf(g, id, lo, hi)
				add(g, head)
				add(g, tail)
			}
		}
	}
	out := make([]FreeEnds, 0, len(bySize))
	for _, fe := range bySize {
		out = append(out, *fe)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Bytes != out[j].Bytes {
			return out[i].Bytes > out[j].Bytes
		}
		return out[i].LiveSize < out[j].LiveSize
	})
	return out
}
