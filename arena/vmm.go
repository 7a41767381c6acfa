// The VMM backend's placement: where a VMM device puts each allocation, in
// plain Go over a small physical-memory driver (PhysDriver), so that all of
// its policy is testable without CUDA. vmm_cuda.go drives the real thing
// (cuMemCreate, cuMemMap, ...); vmm_fake.go is an in-memory driver for
// tests and the simulated device; vmm_source.go is the MemorySource over
// the placement. This file is the overview, and holds the driver's
// interface and the layout; the placement's code is in its siblings:
//
//	vmm_segments.go  the placement's state, its entry points (Alloc, Free)
//	                 and step 1
//	vmm_spans.go     spans, their list per segment, coalescing, and the
//	                 free index
//	vmm_grow.go      growth, steps 2 to 4: where a miss goes, and the pay,
//	                 lend and map steps, with what maps and unmaps granules
//	vmm_events.go    events, fences, polling and synchronisation marks
//	vmm_trim.go      trimming, giving VA back, and Close
//	vmm_check.go     the invariant checks
//	vmm_sleep.go     memory tags and sleep (Note [Sleep and wake]); wake
//	                 in vmm_wake.go, the host copies in vmm_offload.go
//	vmm_ipc.go       CUDA IPC: a block's handles exported as descriptors,
//	                 other processes' handles imported (Note [CUDA IPC]);
//	                 the fake driver's half in vmm_fake_ipc.go
//
// BENCHMARKS.md has the figures behind the choices below ("The VMM
// backend's placement").
//
// # Why own the placement
//
// With a stream-ordered pool the driver decides where memory lies and how
// much it keeps, and it keeps memory goalloc never asked for. With the
// virtual memory management API, goalloc holds physical memory as handles,
// maps them where it likes, and its reserved figure is, exactly, the
// physical bytes it holds.
//
// # Glossary
//
//	granule  The placement's unit: the size of every handle, the layout's
//	         (VMMLayout.Handle, DefaultVMMHandle when none is named), a
//	         power of two and a multiple of the driver's allocation
//	         granularity (cuMemGetAllocationGranularity).
//	handle   A piece of physical memory (cuMemCreate) of one granule,
//	         always mapped whole.
//	VA       Virtual addresses, reserved (cuMemAddressReserve) a segment at
//	         a time; nothing there costs physical memory until a handle is
//	         mapped.
//	segment  A stream's VA reservation, into which handles are mapped on
//	         demand (see "Segments and spans").
//	span     A run of bytes of a segment's mapped granules, live, free,
//	         pending or draining.
//	hole     Unmapped granules of a segment, between spans or at its end.
//	held     Bytes of all handles, each counted once. This is the reserved
//	         figure, and the cap bounds it.
//	tag      A memory tag (Tag): a segment belongs to a stream and a tag,
//	         so memory of two tags never shares a handle, and a tag's
//	         segments can sleep (handles released, VA kept) and wake.
//
// # What the driver costs
//
// The driver's calls cost per handle, whatever its size, not per byte:
// mapping a range of many small handles costs many times what one handle
// of the same bytes costs, and cuMemSetAccess costs the most. And no call
// waits for the device: the driver does not order cuMemUnmap or cuMemMap
// after the work queued on any stream, so unmapping memory that queued work
// still uses would be a fault, and avoiding it is the placement's job. So:
//
//   - This layer is reached only on a miss of the cache above it.
//   - A miss must usually make no driver call at all. The first placement,
//     a fresh VA range per miss backed by whatever handles were free
//     ("ranges", now retired), made several calls a miss; a segment per
//     stream, carved and grown in place, makes most misses with none.
//   - Handles are larger than the driver's granularity (DefaultVMMHandle):
//     fewer of them, so fewer calls, for the price of memory wasted where
//     free memory meets live memory, since only whole handles move.
//   - Events are polled, never waited on by the host: memory whose last
//     use may still run is never unmapped, and another stream gets it
//     only by waiting for it on the device (step 3).
//
// # Segments and spans
//
// Each stream gets a segment: one large VA reservation (the device's
// memory size, reserved at the stream's first request and given back once
// the segment holds nothing, see "VA and streams"), into which physical
// memory is mapped on demand, one handle per granule, in the manner of
// PyTorch's expandable segments. The mapped granules of a segment are
// tiled by spans, runs of bytes in steps of segQuantum (512 bytes), so
// that neighbours share the granule between them:
//
//	live     handed out to the layer above.
//	free     given back on the segment's own stream (or complete): the
//	         segment's stream may reuse it at once, since the stream's later
//	         work is ordered after its earlier work (the stream-ordered
//	         pool's own rule). It carries an event recorded on that stream
//	         after its free, which says when its last use has completed (0:
//	         it has), or none yet (see "Events").
//	pending  given back on another stream: nobody else may use it until
//	         the event recorded there at the free completes, or the
//	         segment's stream waits for that event (step 3); then it is
//	         free. The stream of the free may take it back (step 3).
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
// stream s is placed in s's segments, or in another stream's free span:
//
//  1. The smallest free span of s's own of at least S bytes is split: no
//     driver call. A request of a granule or more starts on the span's
//     first granule boundary where it touches a granule fewer there and
//     the span has a granule to spare (see "What it wastes"). Else, once
//     every segment's unrecorded frees have an event (a fence each, see
//     "Events"), the smallest free span of at
//     least S bytes of another stream (of the same tag; not anyStream's,
//     see "VA and streams") whose last use has completed is split where
//     it lies: no map either, only its event asked. Nothing runs on it any
//     more, so it may serve any stream; its free, on a stream other than
//     its segment's, is pending like any other. The other stream loses
//     that span, as it would lose the granules if they paid for s's
//     growth (step 3), but whole and with no call: without this half,
//     memory freed on one stream and asked for on another (FSDP's
//     all-gather and compute streams) moved between their segments a
//     granule at a time, an unmap and a map each.
//  2. Else a hole is filled: the free span before a hole is extended into
//     it, or the free span after it extended back, or both joined through
//     it, mapping only the missing granules (expandable segments' trick);
//     or new granules go into the first hole large enough (the end of the
//     segment is a hole). The choice maps the fewest granules, the lowest
//     address on a tie. Access is set once over the new granules. What
//     they hold beyond the request, less than a granule, is a free span
//     that the next request of s starts in: complete, unless a handle of
//     the new granules was lent (step 3), whose last use at its old place
//     only s is ordered after; then it is as after a free on s.
//  3. Before mapping, the new granules are paid for by free memory, s's
//     own first: its free spans (of its stream and tag) whose last use
//     has completed give up their whole granules from the tail, unmapped,
//     their handles mapped at the new place; then those whose last use
//     may still run (on a GPU the host runs ahead, so this step's earlier
//     frees usually do), the largest first, lend the handles of their
//     whole granules' tail: mapped at the new place too (a handle may be
//     mapped at several VAs), the tail draining at the old. This is safe
//     because the request's work is queued on s after the free, so after
//     every use of the old VA; the pieces of a span left free (before the
//     lent granules, and its end in a granule it shares) each get an event
//     recorded now on s. Next, other streams' complete free spans pay,
//     whatever their tag; last, other streams' free spans of the same tag
//     still in use lend, once s waits for the event of their free
//     (StreamWaitEvent), as a stream-ordered pool reuses another stream's
//     frees by adding a dependency (the pieces left free there are
//     unrecorded, as after a free on their segment's stream, since only an
//     event of that stream covers the frees they coalesce with later):
//     that wait holds s's later work back
//     until the other stream has run up to the free, which only a miss
//     that would otherwise create memory pays. Own memory goes first
//     because a stream whose complete memory is taken while its own frees
//     still run can only create more: FSDP's all-gather stream did so for
//     every layer while the compute stream's frees sat free. If memory
//     must still be created, a pending span that s itself freed (one it
//     took from another stream's segment in step 1) of at least S bytes
//     serves the request instead, the smallest: s's later work is
//     ordered after its own free, so it needs no wait; FSDP's logits,
//     placed in another stream's segment, freed and asked for again
//     every step, were otherwise created again beside their pending
//     predecessor while the GPU ran behind. The pending spans s freed
//     itself then lend the handles of their whole granules for what is
//     still missing, the largest first, as its own free spans still in
//     use do, with no wait either (unless s is being captured): the tail
//     drains where it lies and the pieces beside it stay pending (the
//     next step's logits, larger than the pending ones, were created
//     beside them). If some is still missing while s's segments hold
//     pending spans, s waits for the events of their frees, they become
//     its free spans, and the request starts again at step 1: FSDP's
//     all-gather stream, whose work waits for the compute stream's, may
//     run far behind it, and the compute stream's segments held its frees
//     pending while the compute stream created memory beside them. Only
//     what nothing free can pay for is created, so held memory grows only
//     when nothing held is free. A span whose last use may still run is
//     never unmapped.
//  4. When the cap cannot be met even after that, or held would pass the
//     device's memory, a fill that extended free spans (step 2) gives way
//     to new granules alone, which those spans' whole granules may then
//     pay for: more maps, but every complete granule that no live span
//     touches can then pay. If that too would pass the cap or the device, Alloc
//     fails with ErrOutOfMemory before any driver call. When the device
//     says no (cuMemCreate), what was unmapped to pay is released, which
//     leaves a consistent state; the layer above synchronises (completing
//     every free) and asks again.
//
// A segment with no hole large enough (fragmentation) gets a sibling: the
// stream reserves another segment.
//
// # What a miss costs
//
// A miss served by step 1 from s's own memory makes no driver call, and
// neither does a free on the segment's own stream but one in fenceEvery
// (see "Events"); it is a binary search in the stream's index of free
// spans (freeIndex). Its second half searches each other share's index
// once and asks the events of the spans it passes (one per fence).
// A segment's spans are a list in address order (spanNode), each named by
// its node (spanID), so splitting a span or coalescing it with its
// neighbours moves no other span, and whatever refers to a span holds its
// name rather than searching for it. Only the rarer step 2, Trim and the
// fences walk a segment's spans, and those that look for free memory
// (paying, trimming, fencing) walk only segments with a free span
// (nfree). Step 2 costs a map per new granule and one set-access; paying
// costs an unmap per granule moved, and creates only for growth.
// Handles are one granule each, so any free granule can be given up
// without splitting a handle; the price is a call per granule, paid only
// when memory moves or grows, which large granules keep rare. Unmapped
// handles are not kept: what step 3 unmaps maps again at once, and Trim
// releases what it unmaps, so held is exactly the mapped granules,
// draining ones left out, between calls. A draining granule costs one
// more unmap, when its free has completed.
//
// # What it wastes
//
// Held memory beyond live is free spans: those too small for the requests
// that came (a request larger than every free span of its stream maps new
// granules, paid for by the whole granules of free spans anywhere), and
// the ends of free spans in granules shared with a live neighbour. A
// granule is wasted only in part, and only where a free span meets a live
// one: packing at 512 bytes pays the granule's rounding once per run of
// spans, where rounding each request up to the granule, as the first
// version of this placement did, wasted about half a granule per live
// request. On a GPU draining is what keeps held from growing while a
// step's own frees are still queued (the simulated device completes events
// at once, so no span drains in its replays). HeldSplit (vmm_held.go)
// measures this, span by span; the device keeps the split of the moment
// held last rose to a new high, and the replay tool reports it at the peak.
//
// Serving is where such ends gathered: a generate loop places its KV
// cache's tensors between activations that die soon after, so at the peak
// each tensor of the cache sits between two free ends (FreeEndsBeside,
// vmm_held.go, groups the free ends by the live span beside them). The
// placement cannot tell, when it places a request, whether it stays, but a
// live span holds every granule it touches: a tensor of 2.9 granules
// started at a free span's head touches 4 where 3 would do. So step 1
// starts a request of a granule or more on a granule boundary when that
// saves a granule and the span has one to spare (granuleStart); the head
// before the boundary, under a granule, stays free for smaller requests.
// What remains are the ends of spans under a granule and of those placed
// by step 2, which maps the fewest granules wherever that puts them;
// smaller handles (vmm_handle) shrink each end in proportion, for more
// driver calls where memory grows and more handles to sleep, wake and
// share.
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
// segment goes. Memory taken outside a capture (AllocUncaptured) is
// anyStream's, in segments of its own, whose spans no other stream takes
// where they lie (step 1): any stream may have used them, and no one
// stream's order covers that.
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
// empty_cache and the last round before an out-of-memory call make)
// completes every span freed before it began (syncMark, synchronized): it
// records nothing. Nothing is recorded on a stream being captured, and a
// refused record leaves its spans unrecorded: their memory then neither
// pays nor is trimmed until a later fence or synchronisation, which is
// safe. While a capture is underway on the device, the capture gate
// (capturegate.go) refuses every record and answers every query "not
// done". Coalesced spans keep the newer of their events, by seq, as
// before: an unrecorded span is newer than every event recorded on its
// segment's stream before its free, and older than every one after. This
// rests on every free span's event being recorded on its segment's stream
// (the random-ops test checks it): of two events of one stream the newer
// covers both, of two streams neither. Events are recycled (spare events), since creating one is a driver call.
//
// # Invariants
//
// CheckInvariants (vmm_check.go) verifies, after every step of the
// random-ops test: the spans of a segment are linked both ways in address
// order, and every node is a span or unused, once; they are in steps of
// 512 bytes, inside the segment, and do not overlap; a span next to a hole
// ends on a granule, and a draining span is whole granules; the granules
// the spans touch are exactly the segment's mapped ones; each mapped
// granule's handle is owned once, by the spans that are not draining
// there, and a handle in a draining span is also owned so (mapped there
// too; counted per handle); no two free spans touch; held is the granules
// the spans that are not draining touch (plus handles between unmap and
// map, none between calls) x the granule, so a handle mapped twice counts
// once; live is the bytes of live spans, each indexed by its base; pending and draining
// spans are exactly those listed for polling; each stream's free index
// holds exactly its free spans, in step 1's order; an event is held by one
// span, or by as many as holders counts for it, and never by a span and
// the spare list at once; an unrecorded event is only on free spans; a
// segment counts its free spans (nfree); every stream's share has a
// segment, and the streams' segments are exactly the placement's. A
// handle is released only once no draining span maps it (a complete free
// span whose handles still drain elsewhere neither pays nor is trimmed;
// the drain's free came first, so this lasts only until the next poll).
// Held grows only by what step 4 creates, which the cap bounds, so it
// never grows above the cap (the random-ops test checks it); lowering the
// cap releases what is free and complete at once (vmmSource.setCap), and
// what is in use stays until freed.

package arena

import "fmt"

// PhysHandle is a physical allocation (CUmemGenericAllocationHandle).
type PhysHandle uint64

// PhysDriver is what the VMM placement needs of a device's virtual
// memory management, one driver call per method. Sizes and addresses are
// multiples of Granularity. Calls are made under the placement's lock.
type PhysDriver interface {
	// Granularity is the allocation granularity, a power of two.
	Granularity() uint64
	// ReserveVA reserves size bytes of virtual addresses.
	ReserveVA(size uint64) (uintptr, error)
	// FreeVA gives back a range ReserveVA returned.
	FreeVA(base uintptr, size uint64) error
	// CreateHandle makes size bytes of physical memory; an error wrapping
	// ErrOutOfMemory when the device has no more.
	CreateHandle(size uint64) (PhysHandle, error)
	// ReleaseHandle frees h, which is mapped nowhere.
	ReleaseHandle(h PhysHandle) error
	// Map maps all of h (size bytes) at va.
	Map(va uintptr, size uint64, h PhysHandle) error
	// Unmap drops the mapping of one whole handle at va.
	Unmap(va uintptr, size uint64) error
	// SetAccess grants read-write access to [va, va+size), all mapped, to
	// the device and every peer device that can reach it.
	SetAccess(va uintptr, size uint64) error
	// Events, as Runtime has them.
	NewEvent() (Event, error)
	RecordEvent(e Event, s Stream) error
	EventDone(e Event) (bool, error)
	DestroyEvent(e Event) error
	// CaptureStatus, as Runtime has it: an event is never recorded on a
	// stream being captured (it would join the graph).
	CaptureStatus(s Stream) (CaptureStatus, error)
	// StreamWaitEvent makes the work queued on s from now on wait for e
	// (cuStreamWaitEvent): another stream's memory then serves s before
	// its last use has run (step 3).
	StreamWaitEvent(s Stream, e Event) error
}

// anyStream is the stream of memory taken outside a capture
// (AllocUncaptured), which any stream may use at once: it has segments of
// its own, and a free of its memory is never one on its segment's stream.
const anyStream = Stream(^uintptr(0) - 1)

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
// calls cost per handle, not per byte, cuMemSetAccess most of all, so
// larger handles make fewer calls; but larger handles waste more where
// free memory meets live memory, since only whole handles move: a tensor
// that outlives the activations placed around it keeps the free ends of
// its first and last handles, so a serving loop's KV cache, a tensor per
// layer, holds up to two handles' ends per layer. 4 MiB keeps those ends
// small for four times the maps of 16 MiB where memory grows
// (BENCHMARKS.md, "Harsh workloads", has the figures behind the choice).
const DefaultVMMHandle = 4 << 20

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
