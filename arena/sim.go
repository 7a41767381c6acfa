package arena

import (
	"errors"
	"fmt"
	"sync"
)

// DefaultSimMemory is the simulated device's capacity when GOALLOC_SIM_MEMORY
// is not set: 80 GiB, an A100/H100-sized card.
const DefaultSimMemory = 80 << 30

// SimFaults injects driver failures into a Sim. Each hook, when set, is
// called before the operation it names; a non-nil return makes the operation
// fail with that error and change nothing.
type SimFaults struct {
	Alloc       func(size uint64, s Stream) error
	EventRecord func(s Stream) error
	EventQuery  func(e Event) error
}

// Sim is a simulated device. Its streams run work in order; an event recorded
// on a stream completes once the stream has run everything enqueued before
// the record. In auto mode (the default, used by the library and the replay
// tool) every stream completes its work at once. In manual mode (SetManual)
// work completes only when a test calls Complete, which lets tests hold a
// stream busy for as long as they like, or forever.
type Sim struct {
	mu      sync.Mutex
	ordinal int
	pool    *simPool
	manual  bool
	faults  SimFaults
	streams map[Stream]*simStream
	events  map[Event]*simEvent
	nextEv  Event
	capture map[Stream]CaptureStatus
	stalled map[Stream]bool
	closed  bool
	// releaseThreshold is the idle memory the pool keeps across a
	// synchronisation (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD); above it,
	// Synchronize trims the pool down to it, as the driver does.
	releaseThreshold uint64

	// Counters tests read: how often each primitive ran (UsageReads:
	// PoolUsage, a driver call on the GPU).
	Allocs, Frees, Syncs, Trims, UsageReads uint64
	// CaptureViolations counts the calls a capture forbids that were made
	// while one was underway (breakCaptures).
	CaptureViolations uint64
	// EventWaits counts the host's waits for one event (WaitEvent).
	EventWaits uint64
}

type simStream struct {
	enqueued  uint64 // position of the last operation put on the stream
	completed uint64 // position of the last operation that has finished
	// waits are the stream's waits for other streams' events
	// (StreamWaitEvent) not yet known met, oldest first: the work from a
	// wait's position on completes only after its event.
	waits []simWait
}

type simWait struct {
	pos    uint64 // the first operation that waits
	stream Stream // the event's stream, and its position there
	seq    uint64
}

type simEvent struct {
	recorded bool
	stream   Stream
	seq      uint64
}

// NewSim makes a simulated device with capacity bytes of memory.
func NewSim(ordinal int, capacity uint64) *Sim {
	if capacity == 0 {
		capacity = DefaultSimMemory
	}
	return &Sim{
		ordinal: ordinal,
		pool:    newSimPool(ordinal, capacity),
		streams: map[Stream]*simStream{},
		events:  map[Event]*simEvent{},
		capture: map[Stream]CaptureStatus{},
		stalled: map[Stream]bool{},
		// Never release on its own until told otherwise (the library sets
		// its Config.ReleaseThreshold, the maximum by default).
		releaseThreshold: ^uint64(0),
	}
}

// SetManual switches between auto mode (false: work completes at once) and
// manual mode (true: work completes only on Complete or Synchronize).
func (d *Sim) SetManual(manual bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.manual = manual
	if !manual {
		for s, st := range d.streams {
			if !d.stalled[s] {
				st.completed, st.waits = st.enqueued, nil
			}
		}
	}
}

// Stall makes s never complete its work again, not even on Synchronize (a
// hung kernel). The real cuCtxSynchronize would then hang; the simulation
// returns, so a test can see that the allocator survives it.
func (d *Sim) Stall(s Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stalled[s] = true
}

// SetFaults installs failure hooks; the zero SimFaults removes them.
func (d *Sim) SetFaults(f SimFaults) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.faults = f
}

// Launch enqueues one piece of work (a kernel, say) on s, as user code does
// between an allocation and its free. In manual mode it stays unfinished until
// Complete(s).
func (d *Sim) Launch(s Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.enqueue(s)
}

// Enqueued is the position of the last operation put on s: Complete
// through it finishes what was enqueued up to now.
func (d *Sim) Enqueued(s Stream) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stream(s).enqueued
}

// OrderedAfter says whether the work s runs from now on comes after
// stream x's work through position pos (Enqueued's): x has completed it,
// s is x, or s waits (StreamWaitEvent, directly or through the waits of
// the streams it waits for) for an event recorded on x at or after pos.
// The tests' check of stream order: memory x used up to pos may serve s.
func (d *Sim) OrderedAfter(s, x Stream, pos uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stream(x).completed >= pos || d.waitsFor(s, ^uint64(0), x, pos, 0)
}

// waitsFor says whether s's work through position through waits for x's
// work through pos; it follows waits at most 8 streams deep.
func (d *Sim) waitsFor(s Stream, through uint64, x Stream, pos uint64, depth int) bool {
	if s == x && through >= pos {
		return true
	}
	if depth > 8 {
		return false
	}
	for _, w := range d.stream(s).waits {
		if w.pos <= through && d.waitsFor(w.stream, w.seq, x, pos, depth+1) {
			return true
		}
	}
	return false
}

// CompleteThrough finishes the work enqueued on s up to position pos
// (Enqueued's), as a device running behind the host does.
func (d *Sim) CompleteThrough(s Stream, pos uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.stalled[s] {
		d.completeThrough(s, pos)
	}
}

// Complete finishes all work enqueued on s so far.
func (d *Sim) Complete(s Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if st := d.stream(s); !d.stalled[s] {
		d.completeThrough(s, st.enqueued)
	}
}

// SetCapture marks s as being captured (or not) into a CUDA graph.
func (d *Sim) SetCapture(s Stream, status CaptureStatus) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.capture[s] = status
}

func (d *Sim) stream(s Stream) *simStream {
	st, ok := d.streams[s]
	if !ok {
		st = &simStream{}
		d.streams[s] = st
	}
	return st
}

// enqueue puts one operation on s and returns its position.
func (d *Sim) enqueue(s Stream) uint64 {
	st := d.stream(s)
	st.enqueued++
	if !d.manual && !d.stalled[s] {
		d.completeThrough(s, st.enqueued)
	}
	return st.enqueued
}

// completeThrough finishes s's work up to pos, or up to its first wait for
// an event still to complete.
func (d *Sim) completeThrough(s Stream, pos uint64) {
	st := d.stream(s)
	for len(st.waits) > 0 {
		w := st.waits[0]
		if w.pos > pos || d.stream(w.stream).completed >= w.seq {
			if w.pos > pos {
				break
			}
			st.waits = st.waits[1:]
			continue
		}
		pos = w.pos - 1
		break
	}
	st.completed = max(st.completed, min(pos, st.enqueued))
}

// StreamWaitEvent makes the work put on s from now on complete only after
// e: on a device that runs behind its host (manual mode), a stream that
// waits for a busy one is held up by it.
func (d *Sim) StreamWaitEvent(s Stream, e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, ok := d.events[e]
	if !ok {
		return fmt.Errorf("sim: cuStreamWaitEvent on unknown event %d", e)
	}
	if d.capture[s] == CaptureActive {
		return d.breakCaptures("cuStreamWaitEvent on a stream being captured, for an event recorded outside it")
	}
	// The wait is an operation of s's, which an event recorded after it
	// covers, as cuEventRecord covers a stream's earlier waits.
	st := d.stream(s)
	st.enqueued++
	if ev.recorded && d.stream(ev.stream).completed < ev.seq {
		st.waits = append(st.waits, simWait{pos: st.enqueued, stream: ev.stream, seq: ev.seq})
	}
	if !d.manual && !d.stalled[s] {
		d.completeThrough(s, st.enqueued)
	}
	return nil
}

func (d *Sim) completed(s Stream) uint64 { return d.stream(s).completed }

var errClosed = errors.New("sim: device is closed")

func (d *Sim) Ordinal() int { return d.ordinal }

// Name says what kind of device d is, as the replay tool's results do.
func (d *Sim) Name() string { return "sim" }

func (d *Sim) Alloc(size uint64, s Stream) (uintptr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, errClosed
	}
	if d.capture[s] != CaptureNone {
		return 0, fmt.Errorf("sim: cuMemAllocFromPoolAsync on stream %#x, which is being captured: the allocation would become a graph node", s)
	}
	if d.faults.Alloc != nil {
		if err := d.faults.Alloc(size, s); err != nil {
			return 0, err
		}
	}
	ptr, err := d.pool.alloc(size, s, d.completed)
	if err != nil {
		return 0, err
	}
	d.Allocs++
	return uintptr(ptr), nil
}

// simSideStream is the stream AllocUncaptured orders its allocations on;
// work on it completes at once.
const simSideStream = Stream(^uintptr(0))

func (d *Sim) AllocUncaptured(size uint64) (uintptr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, errClosed
	}
	if d.faults.Alloc != nil {
		if err := d.faults.Alloc(size, simSideStream); err != nil {
			return 0, err
		}
	}
	ptr, err := d.pool.alloc(size, simSideStream, func(s Stream) uint64 {
		if s == simSideStream {
			return d.stream(s).enqueued
		}
		return d.completed(s)
	})
	if err != nil {
		return 0, err
	}
	d.Allocs++
	return uintptr(ptr), nil
}

func (d *Sim) Free(ptr uintptr, size uint64, s Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errClosed
	}
	if d.capture[s] != CaptureNone {
		return fmt.Errorf("sim: cuMemFreeAsync on stream %#x, which is being captured: the free would become a graph node", s)
	}
	if r, ok := d.pool.used[uint64(ptr)]; ok && r.size != d.pool.roundSize(size) {
		return fmt.Errorf("sim: cuMemFreeAsync of %#x with size %d, allocated with %d", ptr, size, r.size)
	}
	seq := d.enqueue(s)
	if err := d.pool.freeRange(uint64(ptr), s, seq, d.completed(s) >= seq); err != nil {
		return err
	}
	d.Frees++
	return nil
}

// FreeUncaptured gives back an AllocUncaptured allocation on the side
// stream AllocUncaptured uses, whose work completes at once.
func (d *Sim) FreeUncaptured(ptr uintptr, size uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errClosed
	}
	if r, ok := d.pool.used[uint64(ptr)]; ok && r.size != d.pool.roundSize(size) {
		return fmt.Errorf("sim: cuMemFreeAsync of %#x with size %d, allocated with %d", ptr, size, r.size)
	}
	seq := d.enqueue(simSideStream)
	d.stream(simSideStream).completed = seq
	if err := d.pool.freeRange(uint64(ptr), simSideStream, seq, true); err != nil {
		return err
	}
	d.Frees++
	return nil
}

func (d *Sim) Trim(keep uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.Trims++
	d.pool.trim(keep, d.completed)
	return nil
}

func (d *Sim) SetReleaseThreshold(bytes uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.releaseThreshold = bytes
	return nil
}

func (d *Sim) PoolUsage() (PoolUsage, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.UsageReads++
	p := d.pool
	return PoolUsage{ReservedCurrent: p.reserved, ReservedHigh: p.reservedHigh,
		UsedCurrent: p.usedBytes, UsedHigh: p.usedHigh}, nil
}

func (d *Sim) ResetPoolHigh() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.pool.reservedHigh, d.pool.usedHigh = d.pool.reserved, d.pool.usedBytes
	return nil
}

func (d *Sim) MemInfo() (free, total uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.pool.capacity - d.pool.reserved, d.pool.capacity, nil
}

func (d *Sim) NewEvent() (Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.nextEv++
	d.events[d.nextEv] = &simEvent{}
	return d.nextEv, nil
}

func (d *Sim) RecordEvent(e Event, s Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, ok := d.events[e]
	if !ok {
		return fmt.Errorf("sim: cuEventRecord on unknown event %d", e)
	}
	if d.faults.EventRecord != nil {
		if err := d.faults.EventRecord(s); err != nil {
			return err
		}
	}
	if d.capture[s] == CaptureActive {
		// The driver would make the record a node of the graph, an event
		// that no query may then ask about: the simulation refuses it, so
		// that a test sees the allocator try.
		return d.breakCaptures("cuEventRecord on a stream being captured")
	}
	ev.recorded, ev.stream, ev.seq = true, s, d.stream(s).enqueued
	return nil
}

func (d *Sim) EventDone(e Event) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, ok := d.events[e]
	if !ok {
		return false, fmt.Errorf("sim: cuEventQuery on unknown event %d", e)
	}
	if d.faults.EventQuery != nil {
		if err := d.faults.EventQuery(e); err != nil {
			return false, err
		}
	}
	for _, st := range d.capture {
		if st == CaptureActive {
			// In the default (global) capture mode the driver refuses a query
			// from any thread while a capture is underway, and the capture
			// is lost.
			return false, d.breakCaptures("cuEventQuery while a stream is being captured")
		}
	}
	// An event never recorded counts as complete, as in CUDA.
	return !ev.recorded || d.completed(ev.stream) >= ev.seq, nil
}

// WaitEvent is cuEventSynchronize: the host waits until e has completed,
// so the simulation completes the work of e's stream up to e (and no other
// stream's: a wait for one event synchronises nothing else). A stalled
// stream never gets there: the real call would hang, the simulation says
// so. An event never recorded is complete, as in CUDA.
func (d *Sim) WaitEvent(e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, ok := d.events[e]
	if !ok {
		return fmt.Errorf("sim: cuEventSynchronize on unknown event %d", e)
	}
	d.EventWaits++
	if !ev.recorded {
		return nil
	}
	st := d.stream(ev.stream)
	if st.completed >= ev.seq {
		return nil
	}
	if d.stalled[ev.stream] {
		return fmt.Errorf("sim: cuEventSynchronize would hang: stream %#x is stalled before event %d", ev.stream, e)
	}
	d.forceThrough(ev.stream, ev.seq)
	return nil
}

// forceThrough finishes s's work up to pos and, first, the work of the
// streams it waits for there, as the host's wait for it would.
func (d *Sim) forceThrough(s Stream, pos uint64) {
	st := d.stream(s)
	for _, w := range st.waits {
		if w.pos <= pos && !d.stalled[w.stream] && d.stream(w.stream).completed < w.seq {
			d.forceThrough(w.stream, w.seq)
		}
	}
	d.completeThrough(s, pos)
}

func (d *Sim) DestroyEvent(e Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.events[e]; !ok {
		return fmt.Errorf("sim: cuEventDestroy on unknown event %d", e)
	}
	delete(d.events, e)
	return nil
}

// Synchronize completes all work on every stream, as cuCtxSynchronize waits
// for it, and then, like the driver, releases the pool's idle memory above
// its release threshold. A stalled stream never completes: the real call would hang there,
// so the simulation completes every other stream and returns an error that
// says so, and the caller must not treat the device as idle.
func (d *Sim) Synchronize() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, st := range d.capture {
		if st == CaptureActive {
			return d.breakCaptures("cuCtxSynchronize while a stream is being captured")
		}
	}
	d.Syncs++
	hung := 0
	for s, st := range d.streams {
		if !d.stalled[s] {
			st.completed, st.waits = st.enqueued, nil
		} else if st.completed < st.enqueued {
			hung++
		}
	}
	if hung > 0 {
		return fmt.Errorf("sim: cuCtxSynchronize would hang: %d stalled stream(s) never complete", hung)
	}
	if d.pool.reserved > d.releaseThreshold {
		d.pool.trim(d.releaseThreshold, d.completed)
	}
	return nil
}

// forbiddenInCapture answers a call the simulation takes as forbidden while
// a capture is underway (the fake VMM driver's cuMemAddressFree: whether
// the real driver allows it is not known, so goalloc must not make it).
func (d *Sim) forbiddenInCapture(what string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, st := range d.capture {
		if st == CaptureActive {
			return d.breakCaptures(what + " while a stream is being captured")
		}
	}
	return nil
}

// breakCaptures is the driver's answer to a call a capture forbids: the
// error, and every capture underway invalidated. Called with d.mu held.
func (d *Sim) breakCaptures(what string) error {
	for s, st := range d.capture {
		if st == CaptureActive {
			d.capture[s] = CaptureInvalidated
		}
	}
	d.CaptureViolations++
	return &DriverError{Op: what, Code: cudaErrorStreamCaptureUnsupported, Name: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"}
}

func (d *Sim) CaptureStatus(s Stream) (CaptureStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.capture[s], nil
}

func (d *Sim) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	return nil
}

// Events is how many events exist; tests use it to find leaks.
func (d *Sim) Events() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.events)
}

// LiveAllocations is how many pool allocations are outstanding; tests use it
// to find leaks.
func (d *Sim) LiveAllocations() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.pool.used)
}
