// The virtual-memory placement engine: where the VMM backend puts each
// allocation, in plain Go over a small physical-memory driver (PhysDriver),
// so that all of its policy is testable without CUDA. vmm_cuda.go drives the
// real thing (cuMemCreate, cuMemMap, ...); vmm_fake.go is an in-memory driver
// for tests and the simulated device.
//
// This is the "ranges" placement (GOALLOC_CONF's vmm_placement:ranges): a
// fresh VA range per request. The default, "segments", carves and grows a
// segment per stream instead (vmm_segments.go), so that most misses make no
// driver call; the source (vmm_source.go) runs either.
//
// # Why own the placement
//
// With a stream-ordered pool the driver decides where memory lies and how
// much it keeps: on GPT-2 training the device held 1.10x the live bytes
// while goalloc's own reserved figure said 1.00x, and the pool kept hundreds
// of MiB goalloc never asked for. With the virtual memory management API,
// goalloc holds physical memory as handles, maps them where it likes, and
// its reserved figure is, exactly, the physical bytes it holds.
//
// # Glossary
//
//	granule  The driver's allocation granularity (cuMemGetAllocationGranularity;
//	         2 MiB on an H200, minimum and recommended alike). Every size
//	         below is a multiple of it.
//	handle   A piece of physical memory (cuMemCreate), of any multiple of
//	         the granule. It is always mapped whole: a mapping's offset into
//	         its handle is 0.
//	VA       Virtual addresses. One large range is reserved per device up
//	         front (cuMemAddressReserve), twice the device's memory, and
//	         further ranges are reserved if it ever runs out; nothing there
//	         costs physical memory until a handle is mapped.
//	range    A granule-aligned piece of VA handed out by Alloc, backed by
//	         one or more handles mapped back to back (vmmRange).
//	live     A range in use by the layer above.
//	freed    A range given back with Free(ptr, s): still mapped, until the
//	         work queued on s before the free has completed (an event
//	         recorded on s at the free says when).
//	free handle A handle mapped nowhere and owned by no range: physical
//	         memory held for the next miss, in any range, at any VA.
//	held     Bytes of all handles: live, freed and free. This is the
//	         reserved figure, and the cap bounds it.
//
// # Placement
//
// Physical memory is fungible: a request of S bytes (a multiple of the
// granule) gets a fresh VA range, backed by whatever physical memory is
// available, wherever it came from:
//
//  1. A freed range of S bytes (or up to 1/reviveSlack more) whose free
//     has completed, or was made on the requesting stream, is handed back
//     as it is: no driver call. On the same stream this is safe before the free completes,
//     because the stream's later work is ordered after its earlier work
//     (the stream-ordered pool's own rule).
//  2. Otherwise handles are gathered: free handles first, the largest that
//     fit first (fewest handles); then whole freed ranges of the requesting
//     stream, whose handles are mapped at the new VA while still mapped at
//     the old one (a handle may be mapped at several VAs; the old mapping is
//     dropped once the free completes); then freed ranges of other streams
//     whose frees have completed, unmapped now.
//  3. What is still missing is created as one new handle. Before that, free
//     memory not used for this request (free handles, and completed freed
//     ranges, unmapped) is released, smallest first, until it pays for the
//     new handle: held memory grows only when nothing held is free and
//     complete, and a request never gathers more than maxGather handles, so
//     many small handles coalesce into one large handle at the next miss.
//  4. When the cap still says no, Alloc fails with ErrOutOfMemory before
//     any driver call; when the device says no (cuMemCreate), after
//     releasing what step 3 paid with, which leaves a consistent state. The
//     layer above then synchronises the device, as its last resort, which
//     completes every freed range, and asks again.
//
// # Invariants
//
// Each field says what holds of it; CheckInvariants (vmm_placement_test.go
// drives it after every step) verifies all of them. In short: no two
// ranges share VA; a live or freed range is mapped over its whole size by
// the handles it lists; every handle is owned by exactly one live or freed
// range, or is free; held is the sum of the handles' sizes and never grows
// above the cap (lowering the cap releases what is free at once; what is in
// use stays until freed); a mapping is dropped, and a handle mapped for
// another stream, only once the work queued before its free has completed
// (an event): only the stream of the free gets the memory earlier (steps 1
// and 2).
//
// # What it costs
//
// Measured on an H200 (driver 580, CUDA 13.0, from Python through ctypes, one
// run on a shared machine, so orders of magnitude): cuMemCreate 11-13 us,
// cuMemMap 2-5 us, cuMemSetAccess about 30 us per call (50 us over a range
// of 200 handles at once), cuMemUnmap about 18 us, cuMemRelease 11-18 us,
// per handle, whatever its size. A 1 GiB range built from 512 handles of
// 2 MiB took 15.7 ms to map and 8.7 ms to unmap; as one handle, 0.14 ms and
// 0.045 ms: the cost follows the number of handles, not the bytes. Hence:
//
//   - This layer is reached only on a miss of the cache above it.
//   - Access is set once per new range, over the whole range, for this
//     device and every peer that can reach it.
//   - A range has at most maxGather+1 handles (gathered, plus one new), so
//     a miss costs at most about maxGather+1 maps, one set-access, one
//     create and a few releases: under half a millisecond.
//   - Free handles are never split: a miss that cannot use one whole leaves
//     it, and the release in step 3 turns small free handles into one large
//     new one. The number of free handles is bounded by maxFree (past it,
//     the smallest are released), so held handles number at most
//     (maxGather+1) per live or freed range plus maxFree.
//   - No call waits for the device: the driver does not synchronise on
//     cuMemUnmap or cuMemMap (an unmap of an idle range took 141 us while
//     0.5 s of matrix products were queued, and did not wait for them), so
//     unmapping memory that queued work still uses would be a fault, and
//     avoiding it is this engine's job: freed ranges are polled, never
//     waited on.

package arena

import (
	"errors"
	"fmt"
	"sort"
)

// PhysHandle is a physical allocation (CUmemGenericAllocationHandle).
type PhysHandle uint64

// PhysDriver is what the placement engine needs of a device's virtual
// memory management, one driver call per method. Sizes and addresses are
// multiples of Granularity. Calls are made under the engine's lock.
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
}

const (
	// maxGather bounds how many existing handles back one new range.
	maxGather = 8
	// maxFree bounds how many free handles are kept; past it, the smallest
	// are released.
	maxFree = 32
	// anyStream marks a free whose completion lets any stream reuse the
	// range at once (nothing can still use it).
	anyStream = Stream(^uintptr(0) - 1)
	// reviveSlack: a freed range up to 1/reviveSlack larger than a request
	// is handed back whole for it (step 1).
	reviveSlack = 16
)

// vmmHandle is one handle. owner is the index in ranges of the live or
// freed range it backs, or -1 when free; a handle is mapped at its owner's
// VA, and possibly also at the VA of freed ranges that listed it before
// (stale mappings, dropped when those frees complete).
type vmmHandle struct {
	h     PhysHandle
	size  uint64
	owner int32
	// stale counts the freed ranges, taken over by owner, that still map
	// it. A handle is released only with no mapping at all: the driver
	// would keep the memory of a released handle until its last unmap.
	stale int32
}

// vmmRange is a live or freed range: VA [base, base+size) is mapped by its
// handles, in order, back to back. A freed range's handles may have been
// taken over by a later range of the same stream (owner no longer this
// range): the mappings here stay until the free completes, then go.
type vmmRange struct {
	base    uintptr
	size    uint64
	asked   uint64  // live: the bytes asked for (granules), at most reviveSlack less than size
	handles []int32 // indices into engine.handles, in VA order
	live    bool
	stream  Stream // freed: the stream of the free (anyStream: completed)
	event   Event  // freed: recorded on stream at the free; 0 once completed
	taken   bool   // freed: its handles went to a later range
}

// vmmEngine places ranges. It is not safe for concurrent use: vmmSource
// holds a lock around it.
type vmmEngine struct {
	drv  PhysDriver
	gran uint64
	cap  uint64 // most bytes held; 0: no cap but the device

	handles    []vmmHandle // by index; released ones have size 0
	freeIdx    []int32     // indices of released slots of handles, to reuse
	freeHandle []int32     // free handles (owner -1, size > 0), unordered
	ranges     []vmmRange  // by index; unused slots have size 0
	freeRange  []int32     // unused slots of ranges
	byBase     map[uintptr]int32
	freed      []int32 // freed ranges, oldest first

	vaRes  []vaSpan // reserved VA ranges, as the driver returned them
	vaFree []vaSpan // unused VA, sorted by base, coalesced
	vaStep uint64   // size of each VA reservation

	events []Event // spare events

	held, live    uint64 // bytes of all handles; bytes of live ranges
	heldHigh      uint64
	nCreate, nMap uint64 // driver calls made, for tests
	nUnmap, nRel  uint64
	nAccess       uint64
}

type vaSpan struct {
	base uintptr
	size uint64
}

// newVMMEngine makes an engine that reserves VA in steps of vaStep bytes
// (rounded up to the granule) and holds at most limit bytes (0: no cap).
func newVMMEngine(drv PhysDriver, vaStep, limit uint64) (*vmmEngine, error) {
	g := drv.Granularity()
	if g == 0 || g&(g-1) != 0 {
		return nil, fmt.Errorf("arena: VMM granularity %d is not a power of two", g)
	}
	e := &vmmEngine{drv: drv, gran: g, cap: limit, byBase: map[uintptr]int32{}}
	e.vaStep = e.round(vaStep)
	if err := e.reserveVA(e.vaStep); err != nil {
		return nil, err
	}
	return e, nil
}

// syncMark and synchronized: the ranges placement records an event at
// every free, so a synchronisation tells it nothing its polls do not.
func (e *vmmEngine) syncMark() uint64    { return 0 }
func (e *vmmEngine) synchronized(uint64) {}

func (e *vmmEngine) round(n uint64) uint64 {
	if n == 0 {
		return e.gran
	}
	return (n + e.gran - 1) &^ (e.gran - 1)
}

func (e *vmmEngine) reserveVA(size uint64) error {
	base, err := e.drv.ReserveVA(size)
	if err != nil {
		return err
	}
	e.vaRes = append(e.vaRes, vaSpan{base, size})
	e.putVA(base, size)
	return nil
}

// takeVA finds size bytes of unused VA (first fit), reserving more when
// none is left.
func (e *vmmEngine) takeVA(size uint64) (uintptr, error) {
	for {
		for i := range e.vaFree {
			sp := &e.vaFree[i]
			if sp.size >= size {
				base := sp.base
				sp.base += uintptr(size)
				sp.size -= size
				if sp.size == 0 {
					e.vaFree = append(e.vaFree[:i], e.vaFree[i+1:]...)
				}
				return base, nil
			}
		}
		step := e.vaStep
		if size > step {
			step = size
		}
		if err := e.reserveVA(step); err != nil {
			return 0, err
		}
	}
}

// putVA returns [base, base+size) to the unused VA, coalescing with its
// neighbours.
func (e *vmmEngine) putVA(base uintptr, size uint64) {
	e.vaFree = insertSpan(e.vaFree, base, size)
}

// Held, Live and HeldHigh are the engine's byte figures.
func (e *vmmEngine) Held() uint64      { return e.held }
func (e *vmmEngine) resetHigh()        { e.heldHigh = e.held }
func (e *vmmEngine) granule() uint64   { return e.gran }
func (e *vmmEngine) quantum() uint64   { return e.gran }
func (e *vmmEngine) putEvent(ev Event) { e.events = append(e.events, ev) }

func (e *vmmEngine) eachLive(f func(va uintptr, size uint64)) {
	for va, ri := range e.byBase {
		if r := &e.ranges[ri]; r.live {
			f(va, r.asked)
		}
	}
}
func (e *vmmEngine) Live() uint64     { return e.live }
func (e *vmmEngine) HeldHigh() uint64 { return e.heldHigh }

// SetCap changes the cap on held bytes (0: none). Memory already held above
// it stays until freed and trimmed.
func (e *vmmEngine) SetCap(limit uint64) { e.cap = limit }

// poll checks the events of freed ranges, without waiting, and retires
// every range whose free has completed and whose handles went elsewhere.
// Completed ranges still owning their handles stay mapped (step 1 may hand
// them back whole); they are marked completed.
func (e *vmmEngine) poll() error {
	keep := e.freed[:0]
	var err error
	for _, ri := range e.freed {
		r := &e.ranges[ri]
		if r.event != 0 && err == nil {
			done, qerr := e.drv.EventDone(r.event)
			if qerr != nil {
				err = qerr
			} else if done {
				e.events = append(e.events, r.event)
				r.event, r.stream = 0, anyStream
			}
		}
		if r.event == 0 && r.taken {
			if uerr := e.unmapRange(ri); uerr != nil && err == nil {
				err = uerr
			}
			continue
		}
		keep = append(keep, ri)
	}
	e.freed = keep
	return err
}

// unmapRange drops every mapping of freed range ri, frees its VA and its
// slot; handles it still owns become free. The range must have completed.
func (e *vmmEngine) unmapRange(ri int32) error {
	r := &e.ranges[ri]
	va := r.base
	var err error
	for _, hi := range r.handles {
		h := &e.handles[hi]
		if uerr := e.drv.Unmap(va, h.size); uerr != nil && err == nil {
			err = uerr
		}
		e.nUnmap++
		va += uintptr(h.size)
		if h.owner == ri {
			h.owner = -1
			e.freeHandle = append(e.freeHandle, hi)
		} else {
			h.stale--
		}
	}
	delete(e.byBase, r.base)
	e.putVA(r.base, r.size)
	*r = vmmRange{}
	e.freeRange = append(e.freeRange, ri)
	return err
}

// Alloc places a range of size bytes (rounded up to the granule) for work
// on stream s, which may use it at once (s = anyStream: any stream may).
func (e *vmmEngine) Alloc(size uint64, s Stream) (uintptr, error) {
	n := e.round(size)
	if err := e.poll(); err != nil {
		return 0, err
	}
	// Step 1: the smallest freed range of n bytes up to reviveSlack more,
	// usable on s as it is.
	best := -1
	for i, ri := range e.freed {
		r := &e.ranges[ri]
		if r.size >= n && r.size <= n+e.slack(n) && !r.taken && (r.event == 0 || (r.stream == s && s != anyStream)) &&
			(best < 0 || r.size < e.ranges[e.freed[best]].size) {
			best = i
		}
	}
	if best >= 0 {
		ri := e.freed[best]
		r := &e.ranges[ri]
		if r.event != 0 {
			e.events = append(e.events, r.event)
		}
		r.live, r.event, r.stream, r.asked = true, 0, 0, n
		e.freed = append(e.freed[:best], e.freed[best+1:]...)
		e.live += r.size
		return r.base, nil
	}
	return e.place(n, s)
}

// place is steps 2-4 of the placement.
func (e *vmmEngine) place(n uint64, s Stream) (uintptr, error) {
	var pick []int32    // handles, in mapping order
	var steal []int32   // freed ranges whose handles are taken over
	var unmapIt []int32 // completed freed ranges to unmap for their handles
	need := n

	// Free handles, largest that fits first.
	sort.Slice(e.freeHandle, func(i, j int) bool {
		return e.handles[e.freeHandle[i]].size > e.handles[e.freeHandle[j]].size
	})
	used := make([]bool, len(e.freeHandle))
	for i, hi := range e.freeHandle {
		if len(pick) == maxGather || need == 0 {
			break
		}
		if sz := e.handles[hi].size; sz <= need {
			pick = append(pick, hi)
			used[i] = true
			need -= sz
		}
	}
	// Whole freed ranges: first this stream's (even before their frees
	// complete), then completed ones of any stream; largest that fits first.
	for pass := 0; pass < 2 && need > 0; pass++ {
		cands := make([]int32, 0, len(e.freed))
		for _, ri := range e.freed {
			r := &e.ranges[ri]
			if r.taken || r.size > need {
				continue
			}
			if (pass == 0 && r.stream == s && s != anyStream && r.event != 0) || (pass == 1 && r.event == 0) {
				cands = append(cands, ri)
			}
		}
		sort.SliceStable(cands, func(i, j int) bool { return e.ranges[cands[i]].size > e.ranges[cands[j]].size })
		for _, ri := range cands {
			r := &e.ranges[ri]
			if r.size > need || len(pick)+len(r.handles) > maxGather {
				continue
			}
			pick = append(pick, r.handles...)
			need -= r.size
			if r.event == 0 {
				unmapIt = append(unmapIt, ri)
			} else {
				steal = append(steal, ri)
			}
		}
	}
	// Step 3: pay for what is missing with free memory not picked (free
	// handles, and completed freed ranges, unmapped), smallest first, then
	// create it as one handle.
	var pay []payUnit
	if need > 0 {
		var spare []payUnit
		for i, hi := range e.freeHandle {
			if !used[i] && e.handles[hi].stale == 0 {
				spare = append(spare, payUnit{hi: hi, ri: -1, size: e.handles[hi].size})
			}
		}
		for _, ri := range e.freed {
			if r := &e.ranges[ri]; r.event == 0 && !r.taken && !contains(unmapIt, ri) {
				spare = append(spare, payUnit{hi: -1, ri: ri, size: r.size})
			}
		}
		sort.SliceStable(spare, func(i, j int) bool { return spare[i].size < spare[j].size })
		var paid uint64
		for _, u := range spare {
			if paid >= need {
				break
			}
			pay = append(pay, u)
			paid += u.size
		}
		if after := e.held - paid + need; e.cap > 0 && after > e.cap {
			// Freed ranges not usable here (other streams, not complete)
			// hold the rest; the layer above synchronises and asks again.
			return 0, fmt.Errorf("arena: VMM: %d bytes more would hold %d bytes, above the cap of %d: %w",
				need, after, e.cap, ErrOutOfMemory)
		}
	}
	// From here on the driver is called; a failure leaves the state
	// consistent (handles made or released are accounted as they go).
	for _, u := range pay {
		if err := e.payWith(u); err != nil {
			return 0, err
		}
	}
	if need > 0 {
		hi, err := e.createHandle(need)
		if err != nil {
			return 0, err
		}
		pick = append(pick, hi)
	}
	va, err := e.takeVA(n)
	if err != nil {
		return 0, err
	}
	ri := e.newRange()
	r := &e.ranges[ri]
	*r = vmmRange{base: va, size: n, asked: n, live: true}
	// Ranges completed: unmap them now, so their handles can map here.
	for _, fi := range unmapIt {
		e.removeFreed(fi)
		if err := e.unmapRange(fi); err != nil {
			e.abortRange(ri)
			return 0, err
		}
	}
	at := va
	for _, hi := range pick {
		h := &e.handles[hi]
		if err := e.drv.Map(at, h.size, h.h); err != nil {
			e.abortRange(ri)
			return 0, err
		}
		e.nMap++
		r = &e.ranges[ri]
		r.handles = append(r.handles, hi)
		at += uintptr(h.size)
	}
	if err := e.drv.SetAccess(va, n); err != nil {
		e.abortRange(ri)
		return 0, err
	}
	e.nAccess++
	// Commit: handles move to the new range.
	for _, hi := range pick {
		e.handles[hi].owner = ri
	}
	e.dropOwned()
	for _, fi := range steal {
		e.ranges[fi].taken = true
		for _, hi := range e.ranges[fi].handles {
			e.handles[hi].stale++
		}
	}
	e.byBase[va] = ri
	e.live += n
	e.trimFree()
	return va, nil
}

// payUnit is free memory released to pay for a new handle: a free handle
// (hi), or a completed freed range (ri) whose handles are unmapped and
// released.
type payUnit struct {
	hi, ri int32
	size   uint64
}

func (e *vmmEngine) payWith(u payUnit) error {
	if u.ri < 0 {
		return e.releaseHandle(u.hi)
	}
	hs := append([]int32(nil), e.ranges[u.ri].handles...)
	e.removeFreed(u.ri)
	if err := e.unmapRange(u.ri); err != nil {
		return err
	}
	for _, hi := range hs {
		if e.handles[hi].owner != -1 || e.handles[hi].stale != 0 {
			continue
		}
		if err := e.releaseHandle(hi); err != nil {
			return err
		}
	}
	return nil
}

func contains(xs []int32, x int32) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// abortRange undoes a range that could not be mapped: its mappings go (no
// work can use them yet) and its VA is given back; the handles stay where
// they were (free, or with the freed range they would have been taken from).
func (e *vmmEngine) abortRange(ri int32) {
	r := &e.ranges[ri]
	va := r.base
	for _, hi := range r.handles {
		_ = e.drv.Unmap(va, e.handles[hi].size)
		va += uintptr(e.handles[hi].size)
	}
	// Handles that were free before stay free; those of completed ranges
	// unmapped for this request are free now too (unmapRange made them so).
	e.putVA(r.base, r.size)
	*r = vmmRange{}
	e.freeRange = append(e.freeRange, ri)
}

func (e *vmmEngine) newRange() int32 {
	if k := len(e.freeRange); k > 0 {
		ri := e.freeRange[k-1]
		e.freeRange = e.freeRange[:k-1]
		return ri
	}
	e.ranges = append(e.ranges, vmmRange{})
	return int32(len(e.ranges) - 1)
}

func (e *vmmEngine) removeFreed(ri int32) {
	for i, x := range e.freed {
		if x == ri {
			e.freed = append(e.freed[:i], e.freed[i+1:]...)
			return
		}
	}
}

// dropOwned removes handles that a range now owns from the free list.
func (e *vmmEngine) dropOwned() {
	keep := e.freeHandle[:0]
	for _, hi := range e.freeHandle {
		if e.handles[hi].owner == -1 {
			keep = append(keep, hi)
		}
	}
	e.freeHandle = keep
}

func (e *vmmEngine) createHandle(size uint64) (int32, error) {
	h, err := e.drv.CreateHandle(size)
	if err != nil {
		return 0, err
	}
	e.nCreate++
	hi := reuseOrAppend(&e.handles, &e.freeIdx)
	// Free until a range takes it: if mapping fails, it stays free.
	e.handles[hi] = vmmHandle{h: h, size: size, owner: -1}
	e.freeHandle = append(e.freeHandle, hi)
	e.held += size
	if e.held > e.heldHigh {
		e.heldHigh = e.held
	}
	return hi, nil
}

// releaseHandle releases free handle hi.
func (e *vmmEngine) releaseHandle(hi int32) error {
	h := &e.handles[hi]
	if err := e.drv.ReleaseHandle(h.h); err != nil {
		return err
	}
	e.nRel++
	e.held -= h.size
	*h = vmmHandle{owner: -1}
	e.freeIdx = append(e.freeIdx, hi)
	for i, x := range e.freeHandle {
		if x == hi {
			e.freeHandle = append(e.freeHandle[:i], e.freeHandle[i+1:]...)
			break
		}
	}
	return nil
}

// trimFree releases the smallest free handles past maxFree.
func (e *vmmEngine) trimFree() {
	for len(e.freeHandle) > maxFree {
		small := -1
		for i, hi := range e.freeHandle {
			if e.handles[hi].stale == 0 && (small < 0 || e.handles[hi].size < e.handles[e.freeHandle[small]].size) {
				small = i
			}
		}
		if small < 0 || e.releaseHandle(e.freeHandle[small]) != nil {
			return
		}
	}
}

// Free gives back the live range at va, ordered on stream s: its mappings
// stay until the work queued on s so far has completed. done says that work
// is known to be complete already (nothing can use the range).
func (e *vmmEngine) Free(va uintptr, s Stream, done bool) error {
	ri, ok := e.byBase[va]
	if !ok || !e.ranges[ri].live {
		return fmt.Errorf("arena: VMM: free of %#x, which is not a live range", va)
	}
	r := &e.ranges[ri]
	if !done {
		ev, err := e.event()
		if err != nil {
			return err
		}
		if err := e.drv.RecordEvent(ev, s); err != nil {
			e.events = append(e.events, ev)
			return err
		}
		r.event, r.stream = ev, s
	} else {
		r.stream = anyStream
	}
	r.live = false
	e.live -= r.size
	e.freed = append(e.freed, ri)
	return nil
}

// Owns says whether va is the base of a live range, and the size asked for it.
func (e *vmmEngine) Owns(va uintptr) (uint64, bool) {
	ri, ok := e.byBase[va]
	if !ok || !e.ranges[ri].live {
		return 0, false
	}
	return e.ranges[ri].asked, true
}

// slack is how much larger than n bytes a freed range handed back whole
// may be: a sixteenth, in whole granules. Handing back a range costs no
// driver call, where placing a new one costs a map per handle, a
// set-access and, most often, a create.
func (e *vmmEngine) slack(n uint64) uint64 { return (n / reviveSlack) &^ (e.gran - 1) }

func (e *vmmEngine) event() (Event, error) { return takeEvent(&e.events, e.drv) }

// takeEvent takes a spare event of a placement, or a new one from drv when
// none is spare: events are recycled, since creating one is a driver call.
func takeEvent(spare *[]Event, drv PhysDriver) (Event, error) {
	if k := len(*spare); k > 0 {
		ev := (*spare)[k-1]
		*spare = (*spare)[:k-1]
		return ev, nil
	}
	return drv.NewEvent()
}

// Trim unmaps every completed freed range and releases free handles,
// largest first (fewest calls), until at most keep bytes are held or none
// is free. Frees not yet complete keep their memory.
func (e *vmmEngine) Trim(keep uint64) error {
	if err := e.poll(); err != nil {
		return err
	}
	keepFreed := e.freed[:0]
	var errs []error
	for _, ri := range e.freed {
		if e.ranges[ri].event == 0 {
			errs = append(errs, e.unmapRange(ri))
			continue
		}
		keepFreed = append(keepFreed, ri)
	}
	e.freed = keepFreed
	sort.Slice(e.freeHandle, func(i, j int) bool {
		return e.handles[e.freeHandle[i]].size > e.handles[e.freeHandle[j]].size
	})
	for i := 0; e.held > keep && i < len(e.freeHandle); {
		if e.handles[e.freeHandle[i]].stale != 0 {
			i++
			continue
		}
		if err := e.releaseHandle(e.freeHandle[i]); err != nil {
			errs = append(errs, err)
			break
		}
	}
	return errors.Join(errs...)
}

// Close unmaps and releases everything and gives the VA back. Live ranges
// are lost.
func (e *vmmEngine) Close() error {
	var errs []error
	for ri := range e.ranges {
		r := &e.ranges[ri]
		if r.size == 0 {
			continue
		}
		va := r.base
		for _, hi := range r.handles {
			errs = append(errs, e.drv.Unmap(va, e.handles[hi].size))
			va += uintptr(e.handles[hi].size)
		}
	}
	for i := range e.handles {
		if e.handles[i].size > 0 {
			errs = append(errs, e.drv.ReleaseHandle(e.handles[i].h))
		}
	}
	for _, sp := range e.vaRes {
		errs = append(errs, e.drv.FreeVA(sp.base, sp.size))
	}
	for _, r := range e.freed {
		if ev := e.ranges[r].event; ev != 0 {
			errs = append(errs, e.drv.DestroyEvent(ev))
		}
	}
	for _, ev := range e.events {
		errs = append(errs, e.drv.DestroyEvent(ev))
	}
	*e = vmmEngine{drv: e.drv, gran: e.gran}
	return errors.Join(errs...)
}

// CheckInvariants verifies the invariants of the package comment; tests
// call it after every step.
func (e *vmmEngine) CheckInvariants() error {
	var held, live uint64
	owned := map[int32]int32{}
	for i, h := range e.handles {
		if h.size == 0 {
			continue
		}
		held += h.size
		if h.size%e.gran != 0 {
			return fmt.Errorf("handle %d: size %d not a multiple of the granule", i, h.size)
		}
		if h.owner >= 0 {
			r := e.ranges[h.owner]
			if r.size == 0 {
				return fmt.Errorf("handle %d owned by unused range %d", i, h.owner)
			}
			owned[int32(i)] = h.owner
		}
	}
	if held != e.held {
		return fmt.Errorf("held %d, handles add up to %d", e.held, held)
	}
	nFree := 0
	for _, hi := range e.freeHandle {
		if e.handles[hi].owner != -1 || e.handles[hi].size == 0 {
			return fmt.Errorf("free list holds handle %d, which is not free", hi)
		}
		nFree++
	}
	for i, h := range e.handles {
		if h.size > 0 && h.owner == -1 {
			nFree--
		}
		_ = i
	}
	if nFree != 0 {
		return fmt.Errorf("free list and free handles disagree (%d)", nFree)
	}
	type span struct {
		base uintptr
		size uint64
	}
	var spans []span
	freedSet := map[int32]bool{}
	for _, ri := range e.freed {
		freedSet[ri] = true
	}
	for ri, r := range e.ranges {
		if r.size == 0 {
			continue
		}
		spans = append(spans, span{r.base, r.size})
		var mapped uint64
		for _, hi := range r.handles {
			mapped += e.handles[hi].size
			if e.handles[hi].size == 0 {
				return fmt.Errorf("range %d maps released handle %d", ri, hi)
			}
		}
		if mapped != r.size {
			return fmt.Errorf("range %#x: %d bytes, %d mapped", r.base, r.size, mapped)
		}
		if r.live {
			live += r.size
			if freedSet[int32(ri)] {
				return fmt.Errorf("range %#x live and freed", r.base)
			}
			for _, hi := range r.handles {
				if e.handles[hi].owner != int32(ri) {
					return fmt.Errorf("live range %#x maps handle %d owned by %d", r.base, hi, e.handles[hi].owner)
				}
			}
		} else if !freedSet[int32(ri)] {
			return fmt.Errorf("range %#x neither live nor freed", r.base)
		} else if !r.taken {
			for _, hi := range r.handles {
				if e.handles[hi].owner != int32(ri) {
					return fmt.Errorf("freed range %#x maps handle %d owned by %d", r.base, hi, e.handles[hi].owner)
				}
			}
		}
	}
	if live != e.live {
		return fmt.Errorf("live %d, ranges add up to %d", e.live, live)
	}
	for _, sp := range e.vaFree {
		spans = append(spans, span{sp.base, sp.size})
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].base < spans[j].base })
	var total uint64
	for i, sp := range spans {
		total += sp.size
		if i > 0 && spans[i-1].base+uintptr(spans[i-1].size) > sp.base {
			return fmt.Errorf("VA %#x+%d overlaps %#x", spans[i-1].base, spans[i-1].size, sp.base)
		}
	}
	var reserved uint64
	for _, sp := range e.vaRes {
		reserved += sp.size
	}
	if total != reserved {
		return fmt.Errorf("VA: ranges and unused add up to %d of %d reserved", total, reserved)
	}
	unstale := 0
	for _, hi := range e.freeHandle {
		if e.handles[hi].stale == 0 {
			unstale++
		}
	}
	if unstale > maxFree {
		return fmt.Errorf("%d free handles, above %d", unstale, maxFree)
	}
	stale := map[int32]int32{}
	for _, ri := range e.freed {
		if r := e.ranges[ri]; r.taken {
			for _, hi := range r.handles {
				stale[hi]++
			}
		}
	}
	for i, h := range e.handles {
		if h.size > 0 && h.stale != stale[int32(i)] {
			return fmt.Errorf("handle %d: stale %d, %d taken ranges map it", i, h.stale, stale[int32(i)])
		}
	}
	return nil
}

// insertSpan adds [base, base+size) to spans, a list sorted by address of
// non-overlapping spans, merging it with the neighbours it touches.
func insertSpan(spans []vaSpan, base uintptr, size uint64) []vaSpan {
	i := sort.Search(len(spans), func(i int) bool { return spans[i].base > base })
	spans = append(spans, vaSpan{})
	copy(spans[i+1:], spans[i:])
	spans[i] = vaSpan{base, size}
	if i+1 < len(spans) && spans[i].base+uintptr(spans[i].size) == spans[i+1].base {
		spans[i].size += spans[i+1].size
		spans = append(spans[:i+1], spans[i+2:]...)
	}
	if i > 0 && spans[i-1].base+uintptr(spans[i-1].size) == spans[i].base {
		spans[i-1].size += spans[i].size
		spans = append(spans[:i], spans[i+1:]...)
	}
	return spans
}
