// The segments placement: the VMM backend's second placement of large
// requests, in the manner of PyTorch's expandable segments, chosen with
// GOALLOC_CONF's vmm_placement:segments (the ranges placement of
// vmm_placement.go is the other). Read vmm_placement.go's essay first: the
// glossary, the costs and the stream-ordered rules are the same here.
//
// # Why a second placement
//
// The ranges placement gives almost every miss a fresh VA range and maps
// handles there: replaying traces/gpt2-train.jsonl.gz on the simulated
// device, 28,447 misses made 22,037 cuMemCreate, 38,998 cuMemMap and as
// many cuMemUnmap, 24,055 cuMemSetAccess and 22,037 cuMemRelease. At the
// H200's prices (create 11-13 us, map 2-5 us, set access about 30 us,
// unmap about 18 us, release 11-18 us, per call) a miss cost 115 us at the
// median and 1 ms at p99, against 2 us for the stream-ordered pool, and
// GPT-2 trained at 0.45x the native allocator's speed. A miss must usually
// make no driver call at all.
//
// # Segments and spans
//
// Each stream gets a segment: one large VA reservation (the device's
// memory size, reserved at the stream's first request and given back once
// the segment holds nothing, see "VA and streams"), into which physical
// memory is mapped on demand, one handle per granule.
// The mapped granules of a segment are tiled by spans, runs of bytes in
// steps of segQuantum (512 bytes), so that neighbours share the granule
// between them:
//
//	live     handed out to the layer above.
//	free     given back on the segment's own stream (or complete): the
//	         segment's stream may reuse it at once, since the stream's later
//	         work is ordered after its earlier work (the stream-ordered
//	         pool's own rule). It carries an event recorded on that stream
//	         after its free, which says when its last use has completed (0:
//	         it has), or none yet (see "Events").
//	pending  given back on another stream: nobody may use it until the
//	         event recorded there at the free completes; then it is free.
//	draining a free span whose handles paid for a later request of the
//	         segment's stream (step 3) while its last use could still run:
//	         still mapped, its VA handed to nobody, until the event of its
//	         free completes; then it is unmapped and becomes a hole.
//
// Unmapped granules are the holes between spans: a span next to a hole
// ends on a granule. A span's whole granules are those it covers alone;
// its ends beyond them share a granule with its neighbours. Adjacent free
// spans are coalesced (their events were recorded on the same stream, so
// the newer one covers both). A request of S bytes (rounded to 512) on
// stream s is placed in s's segment:
//
//  1. The smallest free span of at least S bytes is split: no driver call.
//  2. Else a hole is filled: the free span before a hole is extended into
//     it, or the free span after it extended back, or both joined through
//     it, mapping only the missing granules (expandable segments' trick);
//     or new granules go into the first hole large enough (the end of the
//     segment is a hole). The choice maps the fewest granules, the lowest
//     address on a tie. Access is set once over the new granules. What
//     they hold beyond the request, less than a granule, is a free span
//     that the next request of s starts in.
//  3. Before mapping, the new granules are paid for: complete free spans
//     elsewhere (other segments, or this one where not part of the
//     request), the largest first, give up their whole granules from the
//     tail, unmapped; their handles map at the new place. Then s's own
//     free spans whose last use may still run (on a GPU the CPU runs
//     ahead, so this step's earlier frees usually have), the largest
//     first, lend the handles of their whole granules' tail: mapped at the
//     new place too (a handle may be mapped at several VAs), the tail
//     draining at the old. This is safe because the request's work is
//     queued on s after the free, so after every use of the old VA; the
//     pieces of a span left free (before the lent granules, and its end in
//     a shared granule) each get an event recorded now on s. Only what
//     nothing free can pay for is
//     created, so held memory grows only when nothing held is free (and
//     complete, but for s's own). Events are polled, never waited on: a
//     span whose last use may still run is never unmapped (the driver does
//     not order cuMemUnmap after queued work). Other streams' spans in use
//     stay untouched.
//  4. When the cap cannot be met even after that, or held would pass the
//     device's memory, Alloc fails with ErrOutOfMemory before any driver
//     call. When the device says no
//     (cuMemCreate), what was unmapped to pay is released, which leaves a
//     consistent state; the layer above synchronises (completing every
//     free) and asks again.
//
// A segment with no hole large enough (fragmentation) gets a sibling: the
// stream reserves another segment.
//
// # What it costs
//
// A miss served by step 1 makes no driver call, and neither does a free
// on the segment's own stream but one in fenceEvery (see "Events"); step
// 1 is a binary search in the stream's index of free spans (freeIndex).
// A segment's spans are a list in address order (spanNode), each named by
// its node (spanID), so splitting a span or coalescing it with its
// neighbours moves no other span, and whatever refers to a span holds its
// name rather than searching for it. Only the rarer step 2, Trim and the
// fences walk a segment's spans, and those that look for free memory
// (paying, trimming, fencing) walk only segments with a free span
// (nfree). Step 2 costs a map per new granule and one set-access; paying
// costs an unmap per granule moved, and creates only for growth.
// Handles are one granule each, so any free granule can be given up
// without splitting a handle; the price is a call per granule where the
// ranges placement makes one call per handle of any size, paid only when
// memory moves or grows. Unmapped handles are not kept: what step 3
// unmaps maps again at once, and Trim releases what it unmaps, so held is
// exactly the mapped granules, draining ones left out, between calls. A
// draining granule costs one more unmap, when its free has completed.
//
// The granule is the layout's handle size (VMMLayout.Handle, 16 MiB by
// default), not the driver's 2 MiB: the driver's calls cost per handle,
// whatever its size, and cuMemSetAccess most of all. The device's own
// profile of its calls (DriverCalls), replaying traces/gpt2-train.jsonl.gz
// on an H200 with 2 MiB handles, spent 709 ms in the driver: 470 ms in 334
// cuMemSetAccess calls over 14,342 handles (33 us a handle), 147 ms in
// 12,122 cuMemCreate, 47 ms in 2,220 cuMemUnmap, 30 ms in 14,342
// cuMemMap; the replay took 7.0 us an event, against 1.3 us on the
// stream-ordered pool. At those prices the simulated device's calls cost
// 24.4 us per miss on GPT-2 and 12.8 us on ResNet-50 with 2 MiB handles,
// and 3.4 us and 1.5 us with 16 MiB ones (go test ./arena -run
// TestVMMPlacementReplay -v).

// # What it wastes
//
// Held memory beyond live is free spans: those too small for the requests
// that came (a request larger than every free span of its stream maps new
// granules, paid for by the whole granules of free spans anywhere), and
// the ends of free spans in granules shared with a live neighbour. A
// granule is wasted only in part, and only where a free span meets a live
// one: packing at 512 bytes pays the granule's rounding once per run of
// spans. Rounding each request up to the granule, as the first version of
// this placement did, wasted about half a granule per live request: in
// GPT-2 training on the H200 (bench/, goalloc-vmm), 401 large blocks were
// live at the peak, and the physical peak was 366 MiB (3.2% of live) above
// goalloc's own reserved peak.
//
// Replaying the bundled traces on the simulated device (go test ./arena
// -run TestVMMPlacementReplay -v, 16 MiB handles): on GPT-2, 28,447
// misses made 0.146 driver calls each (ranges, with 2 MiB handles: 5.11),
// 99.3% of them none, and not one cuMemRelease; on ResNet-50, 11,059
// misses made 0.080 calls each, 98.4% none. The creates are the peak
// held, once: held grows only at the peak. Peak physical over peak live:
// 1.0054 on GPT-2 (2 MiB handles: 1.0016; rounding each request to a 2 MiB
// granule: 1.0100; ranges: 1.0100), 1.0027 on ResNet-50 (2 MiB handles:
// 1.0027; ranges: 1.0083). Hence segments are the default placement. The
// simulated device completes events at once, so no span drains in these
// replays; on a GPU it is what keeps held from growing while the step's
// own frees are still queued.
//
// # VA and streams
//
// Like PyTorch's expandable segments, a segment reserves the device's
// memory size of VA. VA costs no memory, but it is not boundless: the
// process's address space holds a bounded number of reservations of the
// device's size, and every segment kept is a record (its spans, handles
// and free keys) that the walks above pass over. Streams are often
// short-lived (one per request in some servers), so neither may grow with
// the streams ever seen. A segment that holds nothing (no span: nothing
// mapped, live, pending or draining) gives its VA back (dropIfEmpty):
// when its last granules pay for growth elsewhere, when its last drain
// ends, and at Trim (empty_cache), which drops every such segment. A
// stream's share of the placement (segStream) goes with its last segment,
// so the placement keeps state only for streams that hold memory. Free
// memory of a stream that is gone stays mapped until growth elsewhere
// takes it or a Trim releases it, as any free memory does; then its
// segment goes.
//
// # Events
//
// An event says when a free span's last use has completed, which only
// moving its memory needs to know: paying for another request's granules,
// lending them (a draining span is polled), trimming. Reusing it on its
// own stream needs none. So a free on the segment's own stream records
// none: the span is unrecorded, its seq the free's. Recorded later on the
// same stream, an event still covers it, as that stream queued the span's
// last use before the free; so one event, a fence, covers every span of
// the segment freed unrecorded since the last, shared (holders counts its
// spans). A segment fences every fenceEvery such frees, so memory freed on
// one stream is known complete for another at most that many frees late;
// grow and Trim fence every segment first, so what they move is known
// complete as soon as its stream is idle; a draining tail fences its
// segment. A device-wide synchronisation (the device's Synchronize, which
// empty_cache and the last round before an out-of-memory call) completes
// every span freed before it began (syncMark, synchronized): it records
// nothing. Nothing is recorded on a stream being captured, and a refused
// record leaves its spans unrecorded: their memory then neither pays nor
// is trimmed until a later fence or synchronisation, which is safe.
// Coalesced spans keep the newer of their events, by seq, as before: an
// unrecorded span is newer than every event recorded on its segment's
// stream before its free, and older than every one after.
//
// Recording an event cost 1.75 us on the H200 (cuEventRecord, measured by
// the device's profile of its calls in ResNet-50 training, bench/steady.py:
// 11,319 records in 19.8 ms), one per free to this placement, about 390
// frees a ResNet-50 step. Replaying the bundled traces on the simulated
// device, the fences recorded 913 events where the frees recorded 28,227
// (GPT-2), and 432 where they recorded 10,895 (ResNet-50), with the same
// peaks and the same creates, maps and unmaps (goalloc replay --conf
// backend:vmm --json, driver_calls).
//
// # Invariants
//
// CheckInvariants verifies, after every step of the random-ops test: the
// spans of a segment are linked both ways in address order, and every node
// is a span or unused, once; they are in steps of 512 bytes, inside the
// segment, and do not overlap; a span next to a hole ends on a granule, and a draining
// span is whole granules; the granules the spans touch are exactly the
// segment's mapped ones; each mapped granule's handle is owned once, by
// the spans that are not draining there, and a handle in a draining span
// is also owned so (mapped there too; counted per handle); no two free
// spans touch; held is the granules the spans that are not draining touch
// (plus handles between unmap and map, none between calls) x the granule,
// so a handle mapped twice counts once; live is the bytes of live spans,
// each indexed by its base; pending and draining spans are exactly those
// listed for polling; each stream's free index holds exactly its free
// spans, in step 1's order; an event is held by one span, or by as many as
// holders counts for it, and never by a span and the spare list at once;
// an unrecorded event is only on free spans; a segment counts its free
// spans (nfree); every stream's share has a segment, and the streams'
// segments are exactly the placement's. A handle is released only once no
// draining span maps it (a complete free span whose handles still drain
// elsewhere neither pays nor is trimmed; the drain's free came first, so
// this lasts only until the next poll).

package arena

import (
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/goalloc/goalloc/internal/addrmap"
)

// VMMLayout is how a VMM device lays out physical memory: the size of the
// physical handles it maps.
type VMMLayout struct {
	// Handle is the bytes of each physical handle: the placement's
	// granule, the unit in which it maps, moves and releases memory. A
	// power of two, at least the device's own allocation granularity
	// (raised to it where smaller). 0: DefaultVMMHandle.
	Handle uint64
}

// DefaultVMMHandle is the handle size when none is named. The driver's
// calls cost per handle, not per byte: on an H200, cuMemSetAccess took
// 33 us per 2 MiB handle of the range it opened (GPT-2's trace replayed on
// the GPU: 334 calls over 14,342 handles, 470 ms, two thirds of all the
// driver's time), about what one 20 MiB handle costs. Replaying the
// bundled traces on the simulated device, 16 MiB handles made 7x fewer
// driver calls than 2 MiB ones, and held 1.0054x the live peak on GPT-2
// (2 MiB: 1.0016; 64 MiB: 1.0127) and 1.0027x on ResNet-50 (the same as 2
// MiB): larger handles waste more where free memory meets live memory,
// since only whole handles move.
const DefaultVMMHandle = 16 << 20

// Check is the one check of a layout.
func (l VMMLayout) Check() error {
	if h := l.Handle; h&(h-1) != 0 {
		return fmt.Errorf("VMM handle size %d is not a power of two", h)
	}
	return nil
}

// granule is the placement's granule on a device of mem bytes whose
// allocation granularity is driver (a power of two): the handle size, at
// least driver, so a multiple of it. The default shrinks on a device
// smaller than it (a small simulated one); a handle named larger than the
// device is refused, since not one would fit.
func (l VMMLayout) granule(driver, mem uint64) (uint64, error) {
	if err := l.Check(); err != nil {
		return 0, err
	}
	h := l.Handle
	if h == 0 {
		h = DefaultVMMHandle
		for h > driver && h > mem {
			h /= 2
		}
	}
	h = max(h, driver)
	if l.Handle != 0 && h > mem {
		return 0, fmt.Errorf("VMM handles of %d bytes are larger than the device's %d bytes of memory (vmm_handle)", h, mem)
	}
	return h, nil
}

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
}

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

func (sp *segSpan) end() uintptr { return sp.base + uintptr(sp.size) }

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
// work, moves no other span. They were a slice sorted by address, and
// shifting it on every split and merge was a fifth of a miss's simulated
// first-level cache misses (tests/misspath_compare.sh).
type spanNode struct {
	segSpan
	prev, next spanID
}

// vmmSegment is one stream's VA reservation.
type vmmSegment struct {
	stream Stream
	order  int32 // its place among its stream's segments, in creation order
	base   uintptr
	size   uint64
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
// nodes and the ranges placement's handles are kept so, their indexes
// stable while in use.)
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
// span of the stream. The scan was a third of the time of a replay of the
// bundled traces on the simulated device; with the index, the replays
// take 468 ns an event instead of 533 (GPT-2) and 302 instead of 391
// (ResNet-50), medians of 3 (go test ./replay -bench ReplayVMM -count 3).
type freeIndex []freeKey

// search is the first position whose key is not below k. It is written
// out rather than through sort.Search, whose closure call per probe was a
// fifth of the index's cost on a cache miss.
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

// vmmSegments is the segments placement.
type vmmSegments struct {
	drv   PhysDriver
	gran  uint64
	cap   uint64 // most bytes held; 0: no cap but the device
	segVA uint64 // VA reserved per segment: the device's memory, rounded
	mem   uint64 // the device's memory: more can never be held

	segs    []*vmmSegment // in creation order
	streams map[Stream]*segStream
	// last is the segStream of lastStream, the stream of the latest
	// request (nil: none yet): a run of requests on one stream finds its
	// share without a map lookup.
	last       *segStream
	lastStream Stream
	byBase     addrmap.Map[segRef] // live spans by base
	pending    []segRef            // pending spans, oldest first
	draining   []segRef            // draining spans, oldest first
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

	held, heldHigh, live, mapped uint64
}

// segStream is a stream's share of the placement, found with one lookup:
// its segments, in creation order (a segment's order is its place here),
// and the index of their free spans.
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
	e := &vmmSegments{drv: drv, gran: g, cap: limit, mem: mem, streams: map[Stream]*segStream{},
		drainMaps: map[PhysHandle]int32{}}
	e.segVA = e.roundGranule(mem)
	return e, nil
}

// segQuantum is the alignment of spans: requests are packed at this step,
// so the granule's rounding is paid once per run of spans, not once per
// request.
const segQuantum = pieceAlign

func (e *vmmSegments) round(n uint64) uint64 {
	if n == 0 {
		return segQuantum
	}
	return (n + segQuantum - 1) &^ (segQuantum - 1)
}

func (e *vmmSegments) roundGranule(n uint64) uint64 { return (n + e.gran - 1) &^ (e.gran - 1) }

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

func (e *vmmSegments) granule() uint64     { return e.gran }
func (e *vmmSegments) quantum() uint64     { return segQuantum }
func (e *vmmSegments) Held() uint64        { return e.held }
func (e *vmmSegments) HeldHigh() uint64    { return e.heldHigh }
func (e *vmmSegments) Live() uint64        { return e.live }
func (e *vmmSegments) SetCap(limit uint64) { e.cap = limit }
func (e *vmmSegments) resetHigh()          { e.heldHigh = e.held }
func (e *vmmSegments) putEvent(ev Event)   { e.events = append(e.events, ev) }

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

func (e *vmmSegments) Owns(va uintptr) (uint64, bool) {
	r, ok := e.byBase.Get(va)
	if !ok {
		return 0, false
	}
	return r.g.span(r.id).size, true
}

func (e *vmmSegments) eachLive(f func(va uintptr, size uint64)) {
	e.byBase.Range(func(va uintptr, r segRef) bool {
		f(va, r.g.span(r.id).size)
		return true
	})
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

// Alloc places n bytes for stream s (steps 1-4 of the essay).
func (e *vmmSegments) Alloc(size uint64, s Stream) (uintptr, error) {
	n := e.round(size)
	if err := e.pollPending(); err != nil {
		return 0, err
	}
	if err := e.pollDraining(); err != nil {
		return 0, err
	}
	// Step 1: the first free span of at least n bytes in step 1's order.
	if st := e.stream(s); st != nil {
		if j := st.free.search(freeKey{size: n}); j < len(st.free) {
			return e.take(st, st.free[j], n), nil
		}
	}
	return e.grow(n, s)
}

// stream is s's share of the placement, or nil before its first segment.
func (e *vmmSegments) stream(s Stream) *segStream {
	if e.last != nil && e.lastStream == s {
		return e.last
	}
	st := e.streams[s]
	if st != nil {
		e.last, e.lastStream = st, s
	}
	return st
}

// take places n bytes at the head of the free span k of the stream st
// (step 1): the rest stays free, with the event of its last use.
func (e *vmmSegments) take(st *segStream, k freeKey, n uint64) uintptr {
	g := st.segs[k.order]
	sp := g.span(k.id)
	if sp.size > n {
		// The rest keeps the span's place in the index, moved to its size.
		rest := segSpan{base: k.base + uintptr(n), size: sp.size - n, state: spanFree, event: sp.event, seq: sp.seq}
		*sp = segSpan{base: k.base, size: n, state: spanLive}
		r := g.insert(g.next(k.id), rest)
		g.free.replace(k, freeKey{size: rest.size, base: rest.base, order: g.order, id: r})
	} else {
		e.unindex(g, k.id)
		e.dropEvent(sp.event)
		*sp = segSpan{base: k.base, size: n, state: spanLive}
	}
	e.byBase.Put(k.base, segRef{g, k.id})
	e.live += n
	return k.base
}

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

// bestFill finds the fill of n bytes in s's segments that maps the fewest
// granules (the lowest address on a tie); ok false when no hole fits.
func (e *vmmSegments) bestFill(n uint64, s Stream) (best fill, ok bool) {
	consider := func(f fill) {
		if !ok || f.need < best.need || (f.need == best.need && f.start < best.start) {
			best, ok = f, true
		}
	}
	st := e.stream(s)
	if st == nil {
		return best, false
	}
	for _, g := range st.segs {
		// The hole between prev and next, each noSpan at the segment's
		// ends: before every span, and after the last.
		prev, next := noSpan, g.first
		for {
			holeBase, holeEnd := g.base, g.end()
			if prev != noSpan {
				holeBase = g.span(prev).end()
			}
			if next != noSpan {
				holeEnd = g.span(next).base
			}
			if hole := uint64(holeEnd - holeBase); hole > 0 {
				var l, r uint64
				if prev != noSpan && g.span(prev).state == spanFree {
					l = g.span(prev).size
				}
				if next != noSpan && g.span(next).state == spanFree {
					r = g.span(next).size
				}
				// Step 1 failed: l < n and r < n. A hole's ends are on
				// granules, so need (whole granules) starts at one.
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
			if next == noSpan {
				break
			}
			prev, next = next, g.next(next)
		}
	}
	return best, ok
}

// segPay: bytes from the tail of the whole granules of the free span at
// base of g that pay for new granules: unmapped now when its last use has
// completed; else (drain) mapped at the new place too, and left mapped
// here, draining, until the event of its free completes.
type segPay struct {
	g     *vmmSegment
	id    spanID
	bytes uint64
	drain bool
	// A drain leaves up to two free pieces of the span, before and after
	// the draining granules; each takes an event recorded now.
	events [2]Event
}

// grow is steps 2-4: map what is missing, paid for with free memory.
func (e *vmmSegments) grow(n uint64, s Stream) (uintptr, error) {
	// Free memory pays only once known complete: unrecorded spans get
	// their event now (one per segment), which on a stream with nothing
	// left to run completes at once.
	e.fenceAll()
	f, ok := e.bestFill(n, s)
	newSeg := !ok
	if newSeg {
		f = fill{need: e.roundGranule(n), left: noSpan, right: noSpan}
	}
	// Step 3: what pays for the new granules.
	cands := e.payCandidates(f)
	wholeBytes := func(c segRef) uint64 {
		lo, hi := e.whole(c.g.span(c.id))
		return uint64(hi - lo)
	}
	var pays []segPay
	var later []segRef // s's own free spans still in use, largest first
	paid := uint64(len(e.spare)) * e.gran
	for _, c := range cands {
		if paid >= f.need {
			break
		}
		sp := c.g.span(c.id)
		done, err := e.spanDone(sp)
		if err != nil {
			return 0, err
		}
		if !done {
			if c.g.stream == s && s != anyStream {
				later = append(later, c)
			}
			continue
		}
		if e.drainMapped(c.g, sp) {
			continue
		}
		take := min(wholeBytes(c), f.need-paid)
		pays = append(pays, segPay{g: c.g, id: c.id, bytes: take})
		paid += take
	}
	// Then s's own free spans whose last use may still run: their work
	// and the request's are ordered on s, so their handles serve it at
	// once, mapped at both places until the free completes.
	var borrowed []PhysHandle
	unpay := func() {
		for _, p := range pays {
			for _, ev := range p.events {
				if ev != 0 {
					e.events = append(e.events, ev)
				}
			}
		}
	}
lend:
	for _, c := range later {
		if paid >= f.need {
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
		take := min(wholeBytes(c), f.need-paid)
		p := segPay{g: c.g, id: c.id, bytes: take, drain: true}
		// The pieces left free need events of their own: ones recorded
		// now on s come after the free's.
		pieces := 0
		if hi-uintptr(take) > sp.base {
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
				for _, ev := range p.events {
					if ev != 0 {
						e.events = append(e.events, ev)
					}
				}
				if errors.Is(err, ErrCaptureUnderway) {
					break lend // no lending while a capture is underway: what is missing is created
				}
				unpay()
				return 0, err
			}
			p.events[k] = ev
		}
		for va := hi - uintptr(take); va < hi; va += uintptr(e.gran) {
			borrowed = append(borrowed, c.g.handles[(va-c.g.base)/uintptr(e.gran)])
		}
		pays = append(pays, p)
		paid += take
	}
	var create uint64
	if paid < f.need {
		create = f.need - paid
	}
	// Held grows by what is created; above a lowered cap, a request that
	// needs nothing created still goes through (held does not grow).
	if after := e.held + create; e.cap > 0 && create > 0 && after > e.cap {
		unpay()
		return 0, fmt.Errorf("arena: VMM: %d bytes more would hold %d bytes, above the cap of %d: %w",
			create, after, e.cap, ErrOutOfMemory)
	}
	// Nor more than the device has: that would create handles until the
	// driver refuses one, holding the device's memory for a moment, and
	// give them all back.
	if after := e.held + create; create > 0 && e.mem > 0 && after > e.mem {
		unpay()
		return 0, fmt.Errorf("arena: VMM: %d bytes more would hold %d bytes, more than the device's %d: %w",
			create, after, e.mem, ErrOutOfMemory)
	}
	// From here on the driver is called; each failure leaves the state
	// consistent and gives back what was unmapped to pay.
	if newSeg {
		g, err := e.newSegment(s, max(e.segVA, f.need))
		if err != nil {
			unpay()
			return 0, err
		}
		f.g, f.start, f.run = g, g.base, g.base
	}
	for _, p := range pays {
		if p.drain {
			continue
		}
		if err := e.unmapWhole(p.g, p.id, p.bytes, false); err != nil {
			unpay()
			return 0, errors.Join(err, e.releaseSpare())
		}
	}
	g := f.g
	// Borrowed handles map first, so that a failure knows which of the
	// new granules are theirs.
	nb := uint64(len(borrowed)) * e.gran
	for off := uint64(0); off < f.need; off += e.gran {
		var h PhysHandle
		switch k := len(e.spare); {
		case off < nb:
			h = borrowed[off/e.gran]
		case k > 0:
			h = e.spare[k-1]
			e.spare = e.spare[:k-1]
		default:
			var err error
			if h, err = e.drv.CreateHandle(e.gran); err != nil {
				unpay()
				return 0, errors.Join(err, e.unmapRun(g, f.run, off, nb), e.releaseSpare())
			}
			e.held += e.gran
			e.heldHigh = max(e.heldHigh, e.held)
		}
		va := f.run + uintptr(off)
		if err := e.drv.Map(va, e.gran, h); err != nil {
			if off >= nb {
				e.spare = append(e.spare, h)
			}
			unpay()
			return 0, errors.Join(err, e.unmapRun(g, f.run, off, nb), e.releaseSpare())
		}
		e.setHandle(g, va, h)
	}
	if err := e.drv.SetAccess(f.run, f.need); err != nil {
		unpay()
		return 0, errors.Join(err, e.unmapRun(g, f.run, f.need, nb), e.releaseSpare())
	}
	return e.commit(f, n, pays), nil
}

// payCandidates is what may pay for f's new granules (step 3): the free
// spans with whole granules, but for those f itself joins, the largest
// first (in creation order of their segments, then address, on a tie).
// Only segments with a free span are walked, so segments of streams that
// hold only live memory cost nothing here.
func (e *vmmSegments) payCandidates(f fill) []segRef {
	var cands []segRef
	for _, g := range e.segs {
		if g.nfree == 0 {
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
	wholeBytes := func(c segRef) uint64 {
		lo, hi := e.whole(c.g.span(c.id))
		return uint64(hi - lo)
	}
	sort.SliceStable(cands, func(a, b int) bool { return wholeBytes(cands[a]) > wholeBytes(cands[b]) })
	return cands
}

// newSegment reserves a segment of size bytes of VA for stream s, the
// last of its stream's; the stream's share is made with its first.
func (e *vmmSegments) newSegment(s Stream, size uint64) (*vmmSegment, error) {
	base, err := e.drv.ReserveVA(size)
	if err != nil {
		return nil, err
	}
	st := e.streams[s]
	if st == nil {
		st = &segStream{}
		e.streams[s] = st
	}
	g := &vmmSegment{stream: s, order: int32(len(st.segs)), base: base, size: size, free: &st.free, first: noSpan, last: noSpan}
	e.segs = append(e.segs, g)
	st.segs = append(st.segs, g)
	return g, nil
}

// commit ends a grow whose driver calls all succeeded: the borrowed tails
// drain, the region's spans become one live span of n bytes, and a
// segment that paid with its last granules gives its VA back.
func (e *vmmSegments) commit(f fill, n uint64, pays []segPay) uintptr {
	for _, p := range pays {
		if p.drain {
			e.drain(p)
		}
	}
	e.placeLive(f, n)
	for _, p := range pays {
		// The request is served: a segment the driver would not free
		// stays, empty, for the next Trim to try again.
		_ = e.dropIfEmpty(p.g)
	}
	return f.start
}

// placeLive makes f's region one live span of n bytes: the free spans it
// joins go into it, and what the new granules hold beyond it is free.
func (e *vmmSegments) placeLive(f fill, n uint64) {
	g := f.g
	live := segSpan{base: f.start, size: n, state: spanLive}
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
		// The new granules' rest: free, complete, joined to a free span
		// after it.
		rest := g.insert(g.next(at), segSpan{base: end, size: uint64(mapped - end)})
		e.setFree(g, rest, 0, 0)
	}
	e.byBase.Put(f.start, segRef{g, at})
	e.live += n
}

// drain makes the tail of the whole granules of p's free span draining:
// still mapped, its handles now owned by the span they were just mapped
// into as well. The draining granules keep the free's event; the pieces
// of the span before and after them, if any, stay free with p.events.
func (e *vmmSegments) drain(p segPay) {
	g := p.g
	sp := *g.span(p.id)
	_, hi := e.whole(&sp)
	tail := segSpan{base: hi - uintptr(p.bytes), size: p.bytes, state: spanDraining, event: sp.event, seq: sp.seq}
	var pieces [3]segSpan
	np, k, at := 0, 0, 0 // at: the tail's place among the pieces
	if tail.base > sp.base {
		e.seq++
		pieces[np] = segSpan{base: sp.base, size: uint64(tail.base - sp.base), state: spanFree, event: p.events[k], seq: e.seq}
		np, k, at = np+1, k+1, 1
	}
	pieces[np] = tail
	np++
	if hi < sp.end() {
		e.seq++
		pieces[np] = segSpan{base: hi, size: uint64(sp.end() - hi), state: spanFree, event: p.events[k], seq: e.seq}
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

// Free gives back the live span at va, ordered on s. On the segment's own
// stream it is free at once for that stream, its event recorded later (a
// fence, see "Events"); on another, it is pending until the event recorded
// there now completes.
func (e *vmmSegments) Free(va uintptr, s Stream, done bool) error {
	r, ok := e.byBase.Get(va)
	if !ok {
		return fmt.Errorf("arena: VMM: free of %#x, which is not a live range", va)
	}
	g := r.g
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
		e.seq++
		e.setFree(g, r.id, unrecorded, e.seq)
		if g.unfenced++; g.unfenced >= fenceEvery {
			e.fence(g, true)
		}
		return nil
	}
	sp.state, sp.event = spanPending, ev
	e.pending = append(e.pending, r)
	return nil
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
// not asked (cuStreamIsCapturing cost 8 us a call on the H200).
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
		if g.nfree == 0 {
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
		if g.nfree == 0 {
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
		if g.nfree == 0 {
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if g.span(id).state == spanFree {
				free = append(free, segRef{g, id})
			}
		}
	}
	wholeBytes := func(ref segRef) uint64 {
		lo, hi := e.whole(ref.g.span(ref.id))
		return uint64(hi - lo)
	}
	sort.SliceStable(free, func(a, b int) bool { return wholeBytes(free[a]) > wholeBytes(free[b]) })
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
		bytes := min(wholeBytes(ref), e.roundGranule(e.held-keep))
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
// mapped, live, pending or draining (see "VA and streams"). Its stream's
// share goes with its last segment. A segment already dropped (order -1)
// is left alone; one the driver would not free stays, as it was.
func (e *vmmSegments) dropIfEmpty(g *vmmSegment) error {
	if g.first != noSpan || g.order < 0 {
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
	st := e.streams[g.stream]
	st.remove(g)
	if len(st.segs) == 0 {
		delete(e.streams, g.stream)
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
	*e = vmmSegments{drv: e.drv, gran: e.gran, segVA: e.segVA, mem: e.mem, streams: map[Stream]*segStream{},
		drainMaps: map[PhysHandle]int32{}}
	return errors.Join(errs...)
}

// CheckInvariants verifies the invariants of the essay.
func (e *vmmSegments) CheckInvariants() error {
	var mapped, live uint64
	handles := map[PhysHandle]bool{}
	drained := map[PhysHandle]int32{}
	held := map[Event]int32{} // spans holding each event
	nLive, nPending, nDraining := 0, 0, 0
	for _, g := range e.segs {
		if g.base%uintptr(e.gran) != 0 || g.size%e.gran != 0 {
			return fmt.Errorf("segment %#x+%d is not granule-aligned", g.base, g.size)
		}
		if err := g.checkList(); err != nil {
			return err
		}
		spans, ids := g.ordered()
		// covered: per granule, 1 when spans cover it, 2 when a draining
		// span does (alone: a draining span is whole granules).
		covered := make([]uint8, len(g.mapped))
		for i, sp := range spans {
			if sp.size == 0 || sp.size%segQuantum != 0 || sp.base%segQuantum != 0 {
				return fmt.Errorf("span %#x+%d is not whole quanta", sp.base, sp.size)
			}
			if sp.state == spanDraining && (sp.size%e.gran != 0 || sp.base%uintptr(e.gran) != 0) {
				return fmt.Errorf("draining span %#x+%d is not whole granules", sp.base, sp.size)
			}
			if sp.base < g.base || sp.end() > g.end() {
				return fmt.Errorf("span %#x+%d lies outside its segment %#x+%d", sp.base, sp.size, g.base, g.size)
			}
			// Spans tile runs of mapped granules: next to a hole, a
			// span ends on a granule.
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
			first := int((sp.base - g.base) / uintptr(e.gran))
			last := int((sp.end() - 1 - g.base) / uintptr(e.gran))
			for k := first; k <= last; k++ {
				if k >= len(g.mapped) || !g.mapped[k] {
					return fmt.Errorf("span %#x+%d: granule %d is not mapped", sp.base, sp.size, k)
				}
				if sp.state == spanDraining {
					covered[k] = 2
					drained[g.handles[k]]++
					continue
				}
				if covered[k] == 2 {
					return fmt.Errorf("span %#x+%d shares a draining granule", sp.base, sp.size)
				}
				if covered[k] == 0 {
					covered[k] = 1
					if handles[g.handles[k]] {
						return fmt.Errorf("handle %d is mapped twice", g.handles[k])
					}
					handles[g.handles[k]] = true
					mapped += e.gran
				}
			}
			switch sp.state {
			case spanLive:
				live += sp.size
				nLive++
				if r, _ := e.byBase.Get(sp.base); r.g != g || r.id != ids[i] {
					return fmt.Errorf("live span %#x is not indexed", sp.base)
				}
				if sp.event != 0 {
					return fmt.Errorf("live span %#x holds an event", sp.base)
				}
			case spanPending:
				nPending++
				if sp.event == 0 || sp.event == unrecorded {
					return fmt.Errorf("pending span %#x has no event", sp.base)
				}
				held[sp.event]++
			case spanFree:
				if (sp.event == 0) != (sp.seq == 0) {
					return fmt.Errorf("free span %#x: event %d at %d", sp.base, sp.event, sp.seq)
				}
				if sp.event != 0 && sp.event != unrecorded {
					held[sp.event]++
				}
			case spanDraining:
				nDraining++
				if sp.event == 0 || sp.event == unrecorded {
					return fmt.Errorf("draining span %#x has no event", sp.base)
				}
				held[sp.event]++
			default:
				return fmt.Errorf("span %#x in state %d", sp.base, sp.state)
			}
		}
		for k, m := range g.mapped {
			if m && covered[k] == 0 {
				return fmt.Errorf("segment %#x: granule %d is mapped, in no span", g.base, k)
			}
		}
	}
	// A draining mapping's handle is owned by exactly one other span,
	// which held counts.
	for h, n := range drained {
		if !handles[h] {
			return fmt.Errorf("handle %d is mapped only by draining spans", h)
		}
		if e.drainMaps[h] != n {
			return fmt.Errorf("handle %d: %d draining mappings, %d counted", h, n, e.drainMaps[h])
		}
	}
	if len(drained) != len(e.drainMaps) {
		return fmt.Errorf("%d handles in draining spans, %d counted", len(drained), len(e.drainMaps))
	}
	// Each stream's free index is exactly its free spans, in step 1's order.
	want := map[Stream]freeIndex{}
	for _, g := range e.segs {
		if st := e.streams[g.stream]; st == nil || g.order < 0 || int(g.order) >= len(st.segs) || st.segs[g.order] != g {
			return fmt.Errorf("segment %#x is not at its place %d among its stream's", g.base, g.order)
		}
		spans, ids := g.ordered()
		nfree := int32(0)
		for i, sp := range spans {
			if sp.state == spanFree {
				want[g.stream] = append(want[g.stream], freeKey{size: sp.size, base: sp.base, order: g.order, id: ids[i]})
				nfree++
			}
		}
		if nfree != g.nfree {
			return fmt.Errorf("segment %#x has %d free spans, counts %d", g.base, nfree, g.nfree)
		}
	}
	// A stream's share lasts while it has a segment, and lists only
	// segments of the placement.
	nsegs := 0
	for s, st := range e.streams {
		if len(st.segs) == 0 {
			return fmt.Errorf("stream %#x has a share and no segment", s)
		}
		nsegs += len(st.segs)
	}
	if nsegs != len(e.segs) {
		return fmt.Errorf("streams list %d segments, the placement %d", nsegs, len(e.segs))
	}
	for s, st := range e.streams {
		w := want[s]
		sort.Slice(w, func(i, j int) bool { return w[i].less(w[j]) })
		if !slices.Equal(st.free, w) {
			return fmt.Errorf("stream %#x: free index %v, free spans %v", s, st.free, w)
		}
		delete(want, s)
	}
	for s, w := range want {
		return fmt.Errorf("stream %#x has %d free spans and no free index", s, len(w))
	}
	// An event is held by one span, or by the spans holders counts.
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
	if mapped != e.mapped {
		return fmt.Errorf("mapped %d, spans add up to %d", e.mapped, mapped)
	}
	if held := mapped + uint64(len(e.spare))*e.gran; held != e.held {
		return fmt.Errorf("held %d, mapped and spare handles add up to %d", e.held, held)
	}
	if len(e.spare) != 0 {
		return fmt.Errorf("%d spare handles between calls", len(e.spare))
	}
	if live != e.live || live > e.held {
		return fmt.Errorf("live %d, live spans add up to %d, held %d", e.live, live, e.held)
	}
	if nLive != e.byBase.Len() {
		return fmt.Errorf("%d live spans, %d indexed", nLive, e.byBase.Len())
	}
	if nPending != len(e.pending) {
		return fmt.Errorf("%d pending spans, %d listed", nPending, len(e.pending))
	}
	for _, ref := range e.pending {
		if !ref.g.linked(ref.id) || ref.g.span(ref.id).state != spanPending {
			return fmt.Errorf("listed pending span %d is not a pending span", ref.id)
		}
	}
	if nDraining != len(e.draining) {
		return fmt.Errorf("%d draining spans, %d listed", nDraining, len(e.draining))
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
