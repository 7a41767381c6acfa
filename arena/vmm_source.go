package arena

import (
	"errors"
	"fmt"
	"sync"

	"github.com/goalloc/goalloc/internal/addrmap"
)

// vmmSource is the VMM backend's MemorySource, in plain Go over a
// PhysDriver: the CUDA VMM device (vmm_cuda.go) and the simulated one
// (SimVMM) are this over their drivers.
//
// Requests go to the placement the device was made with (segments,
// vmm_segments.go, or ranges, vmm_placement.go). The segments placement
// packs every request at 512 bytes, so it takes them all. The ranges
// placement rounds up to the granule, so under it smaller requests (the
// caching layer's segments and its blocks under 2 MiB), which would waste
// most of a granule each, are packed into pages: one-granule ranges, each
// owned by the stream it was taken for, carved first fit at 512 bytes. A
// piece freed on its page's stream is reusable by that stream at once (the
// stream's later work is ordered after it); one freed on another stream, or
// taken outside a capture (any stream may use it), waits for an event. An
// empty page goes back to the engine, ordered on its stream.
type vmmSource struct {
	mu       sync.Mutex
	eng      vmmPlacer
	drv      *captureGate // the driver, gated while a capture is underway (capturegate.go)
	profile  *timedPhys   // the driver under the gate, every call counted and timed
	gran     uint64
	pages    map[uintptr]*vmmPage  // by base
	owned    map[Stream][]*vmmPage // pages by owner stream
	small    addrmap.Map[uint64]   // live pieces: address -> rounded size
	wait     []vmmPiece            // pieces freed on another stream, not yet complete
	used     uint64                // rounded bytes of live allocations
	usedHigh uint64
	closed   bool
}

type vmmPage struct {
	base  uintptr
	owner Stream   // anyStream: taken outside a capture
	free  []vaSpan // unused pieces, sorted by base, coalesced
	live  uint64   // bytes of live pieces
	wait  int      // pieces waiting for an event
}

type vmmPiece struct {
	page  *vmmPage
	base  uintptr
	size  uint64
	event Event
}

const pieceAlign = 512

// newVMMSource makes a source placing large requests with placement p.
// mem is the device's memory: the ranges placement reserves VA in steps of
// twice that, the segments placement that much per segment.
func newVMMSource(phys PhysDriver, p VMMPlacement, mem, limit uint64) (*vmmSource, error) {
	profile := &timedPhys{PhysDriver: phys}
	drv := &captureGate{PhysDriver: profile}
	p, err := ParseVMMPlacement(string(p)) // "": the default
	if err != nil {
		return nil, err
	}
	var eng vmmPlacer
	if p == VMMRanges {
		eng, err = newVMMEngine(drv, 2*mem, limit)
	} else {
		eng, err = newVMMSegments(drv, mem, limit)
	}
	if err != nil {
		return nil, err
	}
	return &vmmSource{eng: eng, drv: drv, profile: profile, gran: eng.granule(), pages: map[uintptr]*vmmPage{},
		owned: map[Stream][]*vmmPage{}}, nil
}

// DriverCalls is the profile of the driver calls made so far.
func (v *vmmSource) DriverCalls() []DriverCallStat { return v.profile.DriverCalls() }

// setCaptureUnderway opens or closes the gate between the placement and
// the driver's events (CaptureAware).
func (v *vmmSource) setCaptureUnderway(underway bool) { v.drv.underway.Store(underway) }

var errVMMClosed = errors.New("arena: VMM device is closed")

func (v *vmmSource) alloc(size uint64, s Stream) (uintptr, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return 0, errVMMClosed
	}
	n := (size + pieceAlign - 1) &^ (pieceAlign - 1)
	if n == 0 {
		n = pieceAlign
	}
	if n < v.gran && v.eng.quantum() == v.gran {
		p, err := v.allocSmall(n, s)
		if err == nil {
			v.count(int64(n))
		}
		return p, err
	}
	p, err := v.eng.Alloc(n, s)
	if err == nil {
		v.count(int64(v.eng.round(n)))
	}
	return p, err
}

// synchronize runs sync, a device-wide synchronisation (the device's
// Synchronize), and then tells the placement that what was freed before it
// began is no longer in use (frees on their own stream record no event:
// see "Events" in vmm_segments.go).
func (v *vmmSource) synchronize(sync func() error) error {
	v.mu.Lock()
	mark := v.eng.syncMark()
	v.mu.Unlock()
	if err := sync(); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.closed {
		v.eng.synchronized(mark)
	}
	return nil
}

func (v *vmmSource) count(d int64) {
	v.used = uint64(int64(v.used) + d)
	if v.used > v.usedHigh {
		v.usedHigh = v.used
	}
}

func (v *vmmSource) allocSmall(n uint64, s Stream) (uintptr, error) {
	if err := v.pollPieces(); err != nil {
		return 0, err
	}
	var best *vmmPage
	bi := -1
	for _, pg := range v.owned[s] {
		for i, sp := range pg.free {
			if sp.size >= n && (bi < 0 || sp.size < best.free[bi].size) {
				best, bi = pg, i
			}
		}
	}
	if best == nil {
		base, err := v.eng.Alloc(v.gran, s)
		if err != nil {
			return 0, err
		}
		best = &vmmPage{base: base, owner: s, free: []vaSpan{{base, v.gran}}}
		v.pages[base] = best
		v.owned[s] = append(v.owned[s], best)
		bi = 0
	}
	sp := &best.free[bi]
	p := sp.base
	sp.base += uintptr(n)
	sp.size -= n
	if sp.size == 0 {
		best.free = append(best.free[:bi], best.free[bi+1:]...)
	}
	best.live += n
	v.small.Put(p, n)
	return p, nil
}

// pollPieces returns the waiting pieces whose events completed to their pages.
func (v *vmmSource) pollPieces() error {
	keep := v.wait[:0]
	var err error
	for _, pc := range v.wait {
		if err == nil {
			done, qerr := v.drv.EventDone(pc.event)
			if qerr != nil {
				err = qerr
			} else if done {
				v.eng.putEvent(pc.event)
				pc.page.wait--
				if perr := v.putPiece(pc.page, pc.base, pc.size); perr != nil {
					err = perr
				}
				continue
			}
		}
		keep = append(keep, pc)
	}
	v.wait = keep
	return err
}

// putPiece makes [base, base+size) of pg unused, and gives pg back to the
// engine when it is all unused.
func (v *vmmSource) putPiece(pg *vmmPage, base uintptr, size uint64) error {
	pg.free = insertSpan(pg.free, base, size)
	if pg.live > 0 || pg.wait > 0 {
		return nil
	}
	delete(v.pages, pg.base)
	list := v.owned[pg.owner]
	for i, x := range list {
		if x == pg {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(v.owned, pg.owner)
	} else {
		v.owned[pg.owner] = list
	}
	// The page's last uses were on its own stream (pieces freed there) or
	// have completed (pieces that waited): a free ordered on the owner
	// covers them all. A page taken outside a capture has only the latter.
	return v.eng.Free(pg.base, pg.owner, pg.owner == anyStream)
}

func (v *vmmSource) free(ptr uintptr, size uint64, s Stream) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return errVMMClosed
	}
	if n, ok := v.small.Get(ptr); ok {
		want := (size + pieceAlign - 1) &^ (pieceAlign - 1)
		if want == 0 {
			want = pieceAlign
		}
		if want != n {
			return fmt.Errorf("arena: VMM: free of %#x with size %d, allocated with %d", ptr, size, n)
		}
		pg := v.pages[ptr&^uintptr(v.gran-1)]
		if pg.owner == s && s != anyStream {
			v.small.Delete(ptr)
			pg.live -= n
			v.count(-int64(n))
			return v.putPiece(pg, ptr, n)
		}
		ev, err := v.eng.event()
		if err != nil {
			return err
		}
		if err := v.drv.RecordEvent(ev, s); err != nil {
			v.eng.putEvent(ev)
			return err
		}
		v.small.Delete(ptr)
		pg.live -= n
		pg.wait++
		v.count(-int64(n))
		v.wait = append(v.wait, vmmPiece{page: pg, base: ptr, size: n, event: ev})
		return nil
	}
	rsize, ok := v.eng.Owns(ptr)
	if !ok {
		return fmt.Errorf("arena: VMM: free of %#x, which this device did not allocate", ptr)
	}
	if want := v.eng.round(size); want != rsize {
		return fmt.Errorf("arena: VMM: free of %#x with size %d, allocated with %d", ptr, size, rsize)
	}
	if err := v.eng.Free(ptr, s, false); err != nil {
		return err
	}
	v.count(-int64(rsize))
	return nil
}

func (v *vmmSource) trim(keep uint64) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return errVMMClosed
	}
	return errors.Join(v.pollPieces(), v.eng.Trim(keep))
}

func (v *vmmSource) usage() PoolUsage {
	v.mu.Lock()
	defer v.mu.Unlock()
	return PoolUsage{ReservedCurrent: v.eng.Held(), ReservedHigh: v.eng.HeldHigh(), UsedCurrent: v.used, UsedHigh: v.usedHigh}
}

func (v *vmmSource) resetHigh() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.eng.resetHigh()
	v.usedHigh = v.used
}

// setCap bounds held memory; when it is above the new cap, what is free
// and complete is released at once (what is live, or freed and still in
// use, stays until then: held then never grows until it is under the cap).
func (v *vmmSource) setCap(limit uint64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.eng.SetCap(limit)
	if limit > 0 && v.eng.Held() > limit && !v.closed {
		_ = v.eng.Trim(limit)
	}
}

func (v *vmmSource) held() uint64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.eng.Held()
}

func (v *vmmSource) close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return nil
	}
	v.closed = true
	var errs []error
	for _, pc := range v.wait {
		errs = append(errs, v.drv.DestroyEvent(pc.event))
	}
	v.wait = nil
	errs = append(errs, v.eng.Close())
	return errors.Join(errs...)
}

// checkInvariants verifies the engine's invariants and the pages'.
func (v *vmmSource) checkInvariants() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.eng.CheckInvariants(); err != nil {
		return err
	}
	var used uint64
	var err error
	v.small.Range(func(p uintptr, n uint64) bool {
		used += n
		pg := v.pages[p&^uintptr(v.gran-1)]
		if pg == nil {
			err = fmt.Errorf("piece %#x lies in no page", p)
			return false
		}
		for _, sp := range pg.free {
			if p < sp.base+uintptr(sp.size) && sp.base < p+uintptr(n) {
				err = fmt.Errorf("live piece %#x+%d overlaps unused %#x+%d", p, n, sp.base, sp.size)
				return false
			}
		}
		return true
	})
	if err != nil {
		return err
	}
	for _, pg := range v.pages {
		if _, ok := v.eng.Owns(pg.base); !ok {
			return fmt.Errorf("page %#x is not a live range", pg.base)
		}
		var unused uint64
		for _, sp := range pg.free {
			unused += sp.size
		}
		var waiting uint64
		for _, pc := range v.wait {
			if pc.page == pg {
				waiting += pc.size
			}
		}
		if unused+pg.live+waiting != v.gran {
			return fmt.Errorf("page %#x: %d unused + %d live + %d waiting != %d", pg.base, unused, pg.live, waiting, v.gran)
		}
	}
	v.eng.eachLive(func(base uintptr, size uint64) {
		if v.pages[base] == nil {
			used += size
		}
	})
	if used != v.used {
		return fmt.Errorf("used %d, live allocations add up to %d", v.used, used)
	}
	return nil
}
