// Sleep and wake: the VMM placement's half. See vmm.go for the overview of
// the placement, and caching/sleep.go for the caching layer's half.
//
// # Note [Sleep and wake]
//
// Rationale. Reinforcement-learning post-training runs an inference engine
// and a trainer on the same GPUs, in turns. Between turns one side must
// give its memory back to the other (its KV cache discarded, its weights
// copied to the host) and later take it back at the very same virtual
// addresses, so that the CUDA graphs it captured and the pointers it holds
// stay valid. The VMM placement owns every virtual range and every
// physical handle behind goalloc's memory, so it can release the handles
// and keep the ranges, which PyTorch's expandable segments and vLLM's
// CuMemAllocator do over a handle per allocation; here the placement's own
// segments and spans do it, with memory packed as before.
//
// Approach. Allocations carry a memory tag (Tag; 0 is untagged, and sleep
// never touches untagged memory). The placement keeps memory of each tag
// in segments of its own: a share of the placement is a stream and a tag
// (shareKey), and since a handle is only ever mapped in one segment (or,
// while it drains, in another of the same share), memory of two tags
// never shares a handle, and neither does tagged with untagged memory.
// Sleep puts every segment of the tags it is given to sleep: the live
// spans of the tags to offload are copied to pinned host memory, then
// every handle of those segments is unmapped and released. The segments
// keep their VA and their live spans, which are the records of the
// allocations above, so that wake maps fresh handles at the same
// addresses, under the live spans only, and copies back what was
// offloaded. Memory of a tag that is not offloaded comes back with
// undefined contents.
//
// Implementation. Sleep(req):
//
//  1. Refuses while any tag is asleep (one sleep at a time: the host copies
//     of one sleep are kept until their tags wake), and without a driver
//     that can copy (HostCopier).
//  2. Fences: every segment with unrecorded free spans gets its event
//     (fenceAll); then an event is recorded on each stream of the tags'
//     segments, on each other stream a live span of theirs serves (step 1
//     places a request in another stream's free span), and on each stream
//     the caller names (other users of live blocks: record_stream), after
//     all the work queued there so far.
//  3. Offload: the live spans of the tags to offload, in address order, are
//     copied to the offload area (offloadArea, vmm_offload.go): pinned host
//     memory prepared at the first sleep that needs it and kept for the
//     next, grown when one needs more. The copies are pieces of at most
//     copyChunk bytes, queued round robin on copyStreams streams of the
//     driver's own, each of which first waits (on the device, not the
//     host) for the fences and for the events the caller names; an event
//     recorded after its pieces says when each stream is done. No copy is
//     synchronous, and the host waits once per stream.
//  4. The host waits for the fences, the copies, the caller's events and
//     the events of the tags' pending, draining and free spans: every use
//     of the memory queued before the sleep has then completed. It waits
//     for those events alone, never for the whole device; a failure here
//     gives back what sleep took and changes nothing.
//  5. Release: draining mappings of the tags' segments are unmapped, their
//     pending spans become free, every granule they map is unmapped and
//     its handle released (held drops by that much), and their free spans
//     are dropped: a sleeping segment holds only its live spans. A segment
//     left with none gives its VA back.
//
// While a tag is asleep, an allocation in it is refused (ErrTagAsleep):
// its free spans are gone and it may map nothing. A free of one of its
// live spans is complete at once (nothing maps it, and no work may use it
// after the sleep): the span goes, with its host copy, and wake maps
// nothing for it. No walk for free memory (paying, trimming, fencing)
// visits a sleeping segment.
//
// Wake(tag) maps, for each sleeping segment of the tag, fresh handles on
// every granule its live spans touch, after making room: where the cap or
// the device's memory would be passed, complete free memory elsewhere is
// trimmed first, and if that does not make room, the wake fails with
// ErrOutOfMemory before any driver call. A refusal of the driver midway
// unmaps and releases what this wake mapped, so a tag wakes whole or not
// at all, and stays asleep for another try. Then the parts of the mapped
// granules that no live span covers become free spans (complete), the tag
// is awake, and the host copies are queued back, as in step 3, and waited
// for before Wake returns, so that any work queued afterwards reads them.
//
// Invariants (vmm_check.go): a sleeping segment's spans are live (or free
// and complete where the driver failed a release); each host copy is of one
// of its live spans; it maps nothing but what such a release left, which
// held counts. No segment of an awake tag keeps a host copy.
//
// Limitations. One sleep at a time: sleep is refused until every tag has
// woken. Sleep and wake block the calling thread until the copies and the
// work queued on the tags' streams complete, and they are refused while a
// CUDA graph capture is underway (the events they record and wait for
// would join or break the capture). The offload area stays pinned between
// cycles, as large as the largest offload so far, until the device closes.
// A tag wakes whole or not at all: a tag larger than what the device can
// hold at once cannot wake. Memory taken outside a capture
// (AllocUncaptured, CUDA graph pools) is untagged, and so never sleeps.

package arena

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Tag names memory that can be put to sleep together (goalloc.memory_tag):
// 0 is untagged memory, which sleep never touches.
type Tag uint32

// The placement's refusals of sleep and wake.
var (
	// ErrTagAsleep: an allocation in a tag that is asleep, or a sleep
	// while a tag is asleep.
	ErrTagAsleep = errors.New("the memory tag is asleep")
	// ErrNotAsleep: a wake of a tag that is not asleep.
	ErrNotAsleep = errors.New("the memory tag is not asleep")
	// ErrNoSleep: a device whose driver cannot copy to the host.
	ErrNoSleep = errors.New("the device's driver has no copies between device and host, which sleep and wake need")
)

// HostCopier is what sleep and wake need of a VMM device's driver beyond
// mapping: pinned host memory for the offload area, streams of the
// driver's own for the copies, copies between device memory and that host
// memory queued on a stream, a stream's wait for an event, and the host's.
// Host addresses are uintptr, never Go pointers.
type HostCopier interface {
	// AllocHost makes size bytes of page-locked host memory.
	AllocHost(size uint64) (uintptr, error)
	// FreeHost frees an allocation of AllocHost.
	FreeHost(p uintptr, size uint64) error
	// NewCopyStream makes a stream for copies; DestroyCopyStream ends it.
	NewCopyStream() (Stream, error)
	DestroyCopyStream(s Stream) error
	// StreamWaitEvent makes the work queued on s from now on wait for e.
	StreamWaitEvent(s Stream, e Event) error
	// CopyToHost queues a copy of size bytes from device address va to
	// host address host on s; CopyToDevice the other way.
	CopyToHost(host, va uintptr, size uint64, s Stream) error
	CopyToDevice(va, host uintptr, size uint64, s Stream) error
	// WaitEvent blocks the host until e has completed.
	WaitEvent(e Event) error
}

// SleepRequest is what Sleep puts to sleep.
type SleepRequest struct {
	// Tags are the tags to put to sleep (never 0), and Offload those of
	// them whose live contents are copied to the host first.
	Tags, Offload []Tag
	// Streams are more streams whose work queued so far must complete
	// before the memory goes (other users of live blocks, record_stream),
	// and Events more events (frees waiting for other streams).
	Streams []Stream
	Events  []Event
}

// SleepReport is what a sleep did: the bytes copied to the host, and the
// bytes of physical memory released; Prepare is the time spent making the
// offload area (pinning host memory: the first sleep that offloads, or one
// that needs more), Offload the time from the first copy queued to the
// last complete (the work queued on the memory before the sleep included).
type SleepReport struct {
	Offloaded, Released uint64
	Prepare, Offload    time.Duration
}

// WakeReport is what a wake did: the bytes of physical memory mapped, and
// the bytes copied back from the host; Map and Restore the time each took.
type WakeReport struct {
	Mapped, Restored uint64
	Map, Restore     time.Duration
}

// SleepState is what a device holds asleep.
type SleepState struct {
	// Asleep lists the tags asleep, in order.
	Asleep []Tag
	// Offloaded is the bytes of host copies kept for memory asleep;
	// HostArea the pinned host memory kept for them (the offload area).
	Offloaded, HostArea uint64
}

// Sleeper is a device whose tagged memory can sleep: the VMM devices.
type Sleeper interface {
	// SetAllocTag makes the allocations that follow carry tag (0:
	// untagged), until the next call. The caller serialises it with its
	// allocations (the caching layer holds its mutex across both).
	SetAllocTag(tag Tag)
	// Sleep puts the tags of req to sleep (Note [Sleep and wake]).
	Sleep(req SleepRequest) (SleepReport, error)
	// Wake maps tag's memory again, restoring what was offloaded; an
	// error wrapping ErrOutOfMemory leaves the tag asleep.
	Wake(tag Tag) (WakeReport, error)
	// SleepState says what is asleep.
	SleepState() SleepState
	// PrepareOffload makes the offload area hold at least size bytes now,
	// pinning host memory without blocking allocations meanwhile, so that
	// a later sleep offloading that much pins nothing; it returns the
	// area's size.
	PrepareOffload(size uint64) (uint64, error)
}

// Sleep puts the tags of req to sleep (Note [Sleep and wake], steps 1-5).
func (e *vmmSegments) Sleep(req SleepRequest) (SleepReport, error) {
	offload, err := e.checkSleep(req)
	if err != nil {
		return SleepReport{}, err
	}
	held := e.held
	e.fenceAll()
	segs := e.segmentsOf(req.Tags, false)
	var streams []Stream
	for _, g := range segs {
		streams = append(streams, g.stream)
	}
	fences, err := e.recordNow(append(append(streams, e.liveStreams(segs)...), req.Streams...))
	if err != nil {
		return SleepReport{}, err
	}
	items, total := e.offloadItems(segs, offload)
	var rep SleepReport
	start := time.Now()
	if total > 0 {
		err = e.host.prepare(e.copier, total)
	}
	rep.Prepare = time.Since(start)
	start = time.Now()
	var copies []Event
	if err == nil {
		copies, err = e.host.copyOut(e, items, total, append(append([]Event(nil), fences...), req.Events...))
	}
	own := append(fences, copies...)
	if err == nil {
		err = e.waitAll(append(append(append([]Event(nil), own...), req.Events...), e.spanEvents(segs)...))
	}
	rep.Offload = time.Since(start)
	e.events = append(e.events, own...)
	if err != nil {
		return SleepReport{}, err
	}
	for _, t := range req.Tags {
		e.sleeping[t] = true
	}
	for _, it := range items {
		if it.g.offloads == nil {
			it.g.offloads = map[uintptr]offloadCopy{}
		}
		it.g.offloads[it.va] = offloadCopy{host: it.host, size: it.size}
	}
	e.host.used += total
	err = e.releaseAsleep(segs)
	rep.Offloaded, rep.Released = total, held-e.held
	return rep, err
}

// checkSleep refuses a sleep the placement cannot make, and gives the tags
// to offload as a set.
func (e *vmmSegments) checkSleep(req SleepRequest) (map[Tag]bool, error) {
	if e.copier == nil {
		return nil, ErrNoSleep
	}
	if len(e.sleeping) > 0 {
		return nil, fmt.Errorf("arena: VMM: sleep while memory tags %v are asleep: %w", e.asleepTags(), ErrTagAsleep)
	}
	tags := map[Tag]bool{}
	for _, t := range req.Tags {
		if t == 0 || tags[t] {
			return nil, fmt.Errorf("arena: VMM: sleep of tag %d: tags are not 0 and named once", t)
		}
		tags[t] = true
	}
	offload := map[Tag]bool{}
	for _, t := range req.Offload {
		if !tags[t] {
			return nil, fmt.Errorf("arena: VMM: offload of tag %d, which the sleep does not put to sleep", t)
		}
		offload[t] = true
	}
	return offload, nil
}

// asleepTags is the tags asleep, in order.
func (e *vmmSegments) asleepTags() []Tag {
	var out []Tag
	for t := range e.sleeping {
		out = append(out, t)
	}
	slices.Sort(out)
	return out
}

// segmentsOf is the segments of the tags, in creation order: those asleep
// or those awake.
func (e *vmmSegments) segmentsOf(tags []Tag, asleep bool) []*vmmSegment {
	var out []*vmmSegment
	for _, g := range e.segs {
		if g.asleep == asleep && slices.Contains(tags, g.tag) && g.tag != 0 {
			out = append(out, g)
		}
	}
	return out
}

// recordNow records an event now on each of the streams (each once), after
// the work queued there so far. On an error the events go back.
func (e *vmmSegments) recordNow(streams []Stream) ([]Event, error) {
	var out []Event
	seen := map[Stream]bool{}
	for _, s := range streams {
		if seen[s] {
			continue
		}
		seen[s] = true
		ev, err := e.event()
		if err == nil {
			if err = e.drv.RecordEvent(ev, s); err != nil {
				e.events = append(e.events, ev)
			}
		}
		if err != nil {
			e.events = append(e.events, out...)
			return nil, fmt.Errorf("arena: VMM: recording an event on stream %#x: %w", s, err)
		}
		out = append(out, ev)
	}
	return out, nil
}

// liveStreams is the streams the live spans of segs serve, each once: a
// request may lie in another stream's segment (step 1).
func (e *vmmSegments) liveStreams(segs []*vmmSegment) []Stream {
	var out []Stream
	for _, g := range segs {
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.state == spanLive && sp.stream != g.stream && !slices.Contains(out, sp.stream) {
				out = append(out, sp.stream)
			}
		}
	}
	return out
}

// spanEvents is the recorded events of the spans of segs that are not
// live: what their last uses wait for.
func (e *vmmSegments) spanEvents(segs []*vmmSegment) []Event {
	var out []Event
	for _, g := range segs {
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.state != spanLive && sp.event != 0 && sp.event != unrecorded {
				out = append(out, sp.event)
			}
		}
	}
	return out
}

// waitAll makes the host wait for each event (each once).
func (e *vmmSegments) waitAll(events []Event) error {
	seen := map[Event]bool{}
	for _, ev := range events {
		if seen[ev] {
			continue
		}
		seen[ev] = true
		if err := e.copier.WaitEvent(ev); err != nil {
			return fmt.Errorf("arena: VMM: waiting for the work queued on the memory: %w", err)
		}
	}
	return nil
}

// releaseAsleep is step 5: segs sleep, holding their live spans and no
// handle. Every use of their memory has completed (step 4). A driver
// failure stops it, leaving what it did not release mapped and counted.
func (e *vmmSegments) releaseAsleep(segs []*vmmSegment) error {
	for _, g := range segs {
		g.asleep, g.unfenced = true, 0
	}
	// Draining mappings first: their handles are owned by spans of the
	// same share, so asleep too, whose release needs them mapped nowhere.
	var errs []error
	e.draining = slices.DeleteFunc(e.draining, func(r segRef) bool {
		if !r.g.asleep {
			return false
		}
		if err := e.unmapDraining(r.g, r.id); err != nil {
			errs = append(errs, err)
			return false
		}
		return true
	})
	e.pending = slices.DeleteFunc(e.pending, func(r segRef) bool {
		if r.g.asleep {
			e.dropEvent(r.g.span(r.id).event)
			e.setFree(r.g, r.id, 0, 0)
		}
		return r.g.asleep
	})
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, g := range segs {
		if err := e.releaseSegment(g); err != nil {
			return err
		}
	}
	for _, g := range segs {
		if err := e.dropIfEmpty(g); err != nil {
			return err
		}
	}
	return nil
}

// releaseSegment unmaps every granule of the sleeping segment g and
// releases its handle, then drops its free spans (complete, after step 4).
func (e *vmmSegments) releaseSegment(g *vmmSegment) error {
	for id := g.first; id != noSpan; id = g.next(id) {
		if sp := g.span(id); sp.state == spanFree {
			e.dropEvent(sp.event)
			sp.event, sp.seq = 0, 0
		}
	}
	for k, m := range g.mapped {
		if !m {
			continue
		}
		if err := e.unmapGranule(g, g.base+uintptr(k)*uintptr(e.gran)); err != nil {
			return err
		}
		if err := e.releaseSpare(); err != nil {
			return err
		}
	}
	e.dropFreeSpans(g)
	return nil
}

// holdsHandles says whether g maps any granule.
func (g *vmmSegment) holdsHandles() bool { return slices.Contains(g.mapped, true) }

// freeAsleep is Free of the live span id of the sleeping segment g: it
// goes, with its host copy; a segment left with nothing gives its VA back.
func (e *vmmSegments) freeAsleep(g *vmmSegment, id spanID) {
	sp := g.span(id)
	e.byBase.Delete(sp.base)
	e.live -= sp.size
	if c, ok := g.offloads[sp.base]; ok {
		e.host.used -= c.size
		delete(g.offloads, sp.base)
	}
	g.unlink(id)
	// A segment the driver would not free stays, empty, for a later Trim.
	_ = e.dropIfEmpty(g)
}

// state is what SleepState reports.
func (e *vmmSegments) sleepState() SleepState {
	return SleepState{Asleep: e.asleepTags(), Offloaded: e.host.used, HostArea: e.host.size}
}

// dropFreeSpans unlinks every free span of g (a sleeping segment keeps its
// live spans alone).
func (e *vmmSegments) dropFreeSpans(g *vmmSegment) {
	for id := g.first; id != noSpan; {
		next := g.next(id)
		if g.span(id).state == spanFree {
			e.unindex(g, id)
			g.unlink(id)
		}
		id = next
	}
}
