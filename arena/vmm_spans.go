// Spans: their list per segment, coalescing, and the free index.
// See vmm.go for the overview.

package arena

import "fmt"

// spanID names a span of a segment: its node among the segment's nodes,
// which stays the span's while the span lasts (splitting or coalescing
// changes a span's bytes, not its node). So whatever refers to a span, the
// free index, the live spans by base, the polling lists, a miss's plan,
// holds its node and never searches for it.
type spanID int32

// noSpan is no span: before the first one, after the last.
const noSpan spanID = -1

// spanNode is a span and its neighbours in address order: a segment's
// spans form a list, so that splitting and coalescing them, a cache miss's
// work, moves no other span (a slice sorted by address would shift on
// every split and merge: BENCHMARKS.md has the figures).
type spanNode struct {
	segSpan
	prev, next spanID
}

// vmmSegment is one stream's VA reservation, for one memory tag.
type vmmSegment struct {
	stream Stream
	tag    Tag
	// asleep: the segment's tag is asleep (vmm_sleep.go): it holds only
	// live spans and no handle, but where a failed release left some.
	asleep bool
	// offloads are the host copies of its live spans' contents, by base,
	// while asleep.
	offloads map[uintptr]offloadCopy
	order    int32 // its place among its share's segments, in creation order
	base     uintptr
	size     uint64
	// nodes holds the spans, linked in address order from first to last
	// (noSpan: none), and the nodes of no span, listed in unused for
	// reuse. Invariant: every node is in exactly one of the two.
	nodes       []spanNode
	first, last spanID
	unused      []spanID
	// free is its stream's free index (segStream.free), kept here so that
	// a change to a free span costs no map lookup.
	free *freeIndex
	// nfree counts its free spans (kept by index and unindex): the walks
	// for free memory (paying, trimming, fences) skip a segment with none.
	nfree int32
	// unfenced counts the frees left unrecorded since the last fence.
	unfenced int
	// handles, by granule from base, up to the highest granule mapped so
	// far: the handle mapped there, 0 where nothing is.
	handles []PhysHandle
	mapped  []bool
}

func (g *vmmSegment) end() uintptr { return g.base + uintptr(g.size) }

// key is the share g belongs to.
func (g *vmmSegment) key() shareKey { return shareKey{g.stream, g.tag} }

// span is the span id names; the pointer lasts until the next insert.
func (g *vmmSegment) span(id spanID) *segSpan { return &g.nodes[id].segSpan }

func (g *vmmSegment) next(id spanID) spanID { return g.nodes[id].next }
func (g *vmmSegment) prev(id spanID) spanID { return g.nodes[id].prev }

// insert links sp in before the span next (noSpan: after the last) and
// names it. It may move the nodes, so pointers from span do not survive
// it; names do.
func (g *vmmSegment) insert(next spanID, sp segSpan) spanID {
	id := reuseOrAppend(&g.nodes, &g.unused)
	prev := g.last
	if next != noSpan {
		prev = g.nodes[next].prev
	}
	g.nodes[id] = spanNode{segSpan: sp, prev: prev, next: next}
	if prev == noSpan {
		g.first = id
	} else {
		g.nodes[prev].next = id
	}
	if next == noSpan {
		g.last = id
	} else {
		g.nodes[next].prev = id
	}
	return id
}

// reuseOrAppend is the index of a slot of *items for a new element: the
// last of *unused, which it takes, or else a zero one appended. (Spans'
// nodes are kept so, their indexes stable while in use.)
func reuseOrAppend[T any, I ~int32](items *[]T, unused *[]I) I {
	if k := len(*unused); k > 0 {
		i := (*unused)[k-1]
		*unused = (*unused)[:k-1]
		return i
	}
	var zero T
	*items = append(*items, zero)
	return I(len(*items) - 1)
}

// unlink takes span id out of the list; its node goes to unused.
func (g *vmmSegment) unlink(id spanID) {
	n := &g.nodes[id]
	if n.prev == noSpan {
		g.first = n.next
	} else {
		g.nodes[n.prev].next = n.next
	}
	if n.next == noSpan {
		g.last = n.prev
	} else {
		g.nodes[n.next].prev = n.prev
	}
	*n = spanNode{prev: noSpan, next: noSpan}
	g.unused = append(g.unused, id)
}

// spanAt is the first span at or above va, or noSpan: a walk, for grow,
// which walks every span anyway.
func (g *vmmSegment) spanAt(va uintptr) spanID {
	id := g.first
	for id != noSpan && g.nodes[id].base < va {
		id = g.nodes[id].next
	}
	return id
}

// spanHolding is the span whose range holds va, or noSpan: a walk, for
// IPC exports, which name an address inside a span (a small slot of a
// slab) as often as its start.
func (g *vmmSegment) spanHolding(va uintptr) spanID {
	for id := g.first; id != noSpan && g.nodes[id].base <= va; id = g.nodes[id].next {
		if va < g.span(id).end() {
			return id
		}
	}
	return noSpan
}

// ordered is the spans in address order, and their names (for checks and
// tests).
func (g *vmmSegment) ordered() ([]segSpan, []spanID) {
	var spans []segSpan
	var ids []spanID
	for id := g.first; id != noSpan && len(ids) <= len(g.nodes); id = g.next(id) {
		spans = append(spans, *g.span(id))
		ids = append(ids, id)
	}
	return spans, ids
}

// whole is the part of sp made of whole granules, [lo, hi): the granules
// it covers alone, which it may unmap or lend. Its ends beyond them share
// a granule with the neighbouring span.
func (e *vmmSegments) whole(sp *segSpan) (lo, hi uintptr) {
	g := uintptr(e.gran)
	lo, hi = (sp.base+g-1)&^(g-1), sp.end()&^(g-1)
	if hi < lo {
		hi = lo
	}
	return lo, hi
}

// wholeBytes is the bytes of the whole granules of the span ref names:
// what it can pay, lend or trim.
func (e *vmmSegments) wholeBytes(ref segRef) uint64 {
	lo, hi := e.whole(ref.g.span(ref.id))
	return uint64(hi - lo)
}

// setFree makes span id of g free with event ev (0: complete), recorded at
// seq, and coalesces it with free neighbours: the newer event covers both,
// as both were recorded on the segment's stream.
func (e *vmmSegments) setFree(g *vmmSegment, id spanID, ev Event, seq uint64) {
	if ev == 0 {
		seq = 0
	}
	sp := g.span(id)
	*sp = segSpan{base: sp.base, size: sp.size, state: spanFree, event: ev, seq: seq}
	if next := g.next(id); next != noSpan {
		if nx := g.span(next); nx.state == spanFree && sp.end() == nx.base {
			e.unindex(g, next)
			e.merge(g, id, next)
		}
	}
	if prev := g.prev(id); prev != noSpan {
		if pv := g.span(prev); pv.state == spanFree && pv.end() == sp.base {
			e.unindex(g, prev)
			e.merge(g, prev, id)
			id = prev
		}
	}
	e.index(g, id)
}

// merge coalesces the free span b of g into a, its neighbour: the newer
// event covers both, as both were recorded on the segment's stream.
func (e *vmmSegments) merge(g *vmmSegment, a, b spanID) {
	x, y := g.span(a), g.span(b)
	switch {
	case y.event == 0:
	case x.event == 0 || y.seq > x.seq:
		e.dropEvent(x.event)
		x.event, x.seq = y.event, y.seq
	default:
		e.dropEvent(y.event)
	}
	if y.base < x.base {
		x.base = y.base
	}
	x.size += y.size
	g.unlink(b)
}

// freeKey orders a stream's free spans as step 1 chooses among them: the
// smallest first, then the earlier segment, then the lower address. id
// names the span, and takes no part in the order.
type freeKey struct {
	size  uint64
	base  uintptr
	order int32
	id    spanID
}

func (k freeKey) less(o freeKey) bool {
	if k.size != o.size {
		return k.size < o.size
	}
	if k.order != o.order {
		return k.order < o.order
	}
	return k.base < o.base
}

// freeIndex is a stream's free spans in freeKey order, so that step 1
// finds the smallest that fits by binary search instead of a scan of every
// span of the stream (BENCHMARKS.md has the figures).
type freeIndex []freeKey

// search is the first position whose key is not below k. It is written
// out rather than through sort.Search, which makes a closure call per
// probe.
func (x freeIndex) search(k freeKey) int {
	lo, hi := 0, len(x)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if x[m].less(k) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

func (x *freeIndex) add(k freeKey) {
	i := x.search(k)
	*x = append(*x, freeKey{})
	copy((*x)[i+1:], (*x)[i:])
	(*x)[i] = k
}

func (x *freeIndex) remove(k freeKey) {
	if i := x.search(k); i < len(*x) && (*x)[i] == k {
		*x = append((*x)[:i], (*x)[i+1:]...)
	}
}

// replace puts k in the place of old, which it holds: the keys between
// the two places shift by one, where a remove and an add would each shift
// everything after their place. Step 1 makes k smaller than old, so the
// shift is over the spans between the two sizes.
func (x freeIndex) replace(old, k freeKey) {
	i := x.search(old)
	if i == len(x) || x[i] != old {
		panic(fmt.Sprintf("arena: VMM: free index has no key %v", old))
	}
	j := x.search(k)
	if j > i {
		j-- // old's place, above k's, is vacated
		copy(x[i:j], x[i+1:j+1])
	} else {
		copy(x[j+1:i+1], x[j:i])
	}
	x[j] = k
}

// index and unindex add a span of g to its stream's free index, or take
// it out, when it is free; every change to a free span goes through them.
func (e *vmmSegments) index(g *vmmSegment, id spanID) {
	if sp := g.span(id); sp.state == spanFree {
		g.free.add(freeKey{size: sp.size, base: sp.base, order: g.order, id: id})
		g.nfree++
	}
}

func (e *vmmSegments) unindex(g *vmmSegment, id spanID) {
	if sp := g.span(id); sp.state == spanFree {
		g.free.remove(freeKey{size: sp.size, base: sp.base, order: g.order, id: id})
		g.nfree--
	}
}
