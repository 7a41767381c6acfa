// The VMM backend's MemorySource, over the segments placement.
// See vmm.go for the overview.

package arena

import (
	"errors"
	"fmt"
	"sync"
)

// vmmSource is the VMM backend's MemorySource, in plain Go over a
// PhysDriver: the CUDA VMM device (vmm_cuda.go) and the simulated one
// (SimVMM) are this over their drivers. It places every request with the
// segments placement (vmmSegments), which packs them at 512 bytes, and
// keeps the byte counts the layer above reads.
type vmmSource struct {
	mu       sync.Mutex
	eng      *vmmSegments
	drv      *captureGate // the driver, gated while a capture is underway (capturegate.go)
	profile  *timedPhys   // the driver under the gate, every call counted and timed
	gran     uint64
	used     uint64 // rounded bytes of live allocations
	usedHigh uint64
	closed   bool
	// allocTag is the memory tag of the allocations that follow
	// (Sleeper.SetAllocTag).
	allocTag Tag
	// share exports and imports handles (vmm_ipc.go): nil where the
	// driver cannot; imports are the mappings of other processes' handles,
	// by base.
	share      *sharePhys
	imports    map[uintptr]*ipcImport
	importGran uint64 // imported handles are multiples of it
	// peakSplit is the held split (vmm_held.go) when held last reached a
	// new high: taken after the allocation or wake that raised it, so its
	// Held is the placement's HeldHigh. A walk over every span, made only
	// when memory is created above the high, so at most once per granule
	// of the high-water mark since the last reset.
	peakSplit HeldSplit
}

// pieceAlign is the alignment of what the source hands out: the caching
// layer's blocks are 512-byte aligned, and the placement packs at this
// step (segQuantum).
const pieceAlign = 512

// newVMMSource makes a source over phys for a device of mem bytes, whose
// placement holds at most limit bytes (0: no cap but the device).
func newVMMSource(phys PhysDriver, mem, limit uint64) (*vmmSource, error) {
	var share *sharePhys
	under := phys
	if s, ok := phys.(PhysSharer); ok {
		share = newSharePhys(phys, s)
		under = share
	}
	profile := &timedPhys{PhysDriver: under}
	drv := &captureGate{PhysDriver: profile}
	eng, err := newVMMSegments(drv, mem, limit)
	if err != nil {
		return nil, err
	}
	if c, ok := phys.(HostCopier); ok {
		eng.copier = c
	}
	v := &vmmSource{eng: eng, drv: drv, profile: profile, gran: eng.granule(), share: share, imports: map[uintptr]*ipcImport{}}
	v.importGran = v.gran
	if m, ok := phys.(minGranular); ok {
		v.importGran = m.MinGranule()
	}
	return v, nil
}

// DriverCalls is the profile of the driver calls made so far.
func (v *vmmSource) DriverCalls() []DriverCallStat { return v.profile.DriverCalls() }

// setCaptureUnderway opens or closes the gate between the placement and
// the driver's events (CaptureAware).
func (v *vmmSource) setCaptureUnderway(underway bool) { v.drv.underway.Store(underway) }

var errVMMClosed = errors.New("arena: VMM device is closed")

// alloc places size bytes for s, with the memory tag set last
// (setAllocTag); memory any stream may use (anyStream) is untagged.
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
	tag := v.allocTag
	if s == anyStream {
		tag = 0
	}
	p, err := v.eng.AllocTagged(n, s, tag)
	if err == nil {
		v.count(int64(v.eng.round(n)))
		v.notePeak()
	}
	return p, err
}

// notePeak takes the held split when held has passed the last one's.
func (v *vmmSource) notePeak() {
	if v.eng.HeldHigh() > v.peakSplit.Held {
		v.peakSplit = v.eng.heldSplit()
	}
}

// synchronize runs sync, a device-wide synchronisation (the device's
// Synchronize), and then tells the placement that what was freed before it
// began is no longer in use (frees on their own stream record no event:
// see "Events" in vmm.go).
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

func (v *vmmSource) free(ptr uintptr, size uint64, s Stream) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return errVMMClosed
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
	return v.eng.Trim(keep)
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
	v.peakSplit = v.eng.heldSplit()
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

func (v *vmmSource) close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return nil
	}
	v.closed = true
	return errors.Join(v.closeImports(), v.eng.Close())
}

func (v *vmmSource) setAllocTag(tag Tag) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.allocTag = tag
}

// prepareOffload is Sleeper.PrepareOffload. Pinning host memory is slow
// (it touches every page), so it runs without v.mu: allocations and frees
// go on meanwhile. The area is swapped in under v.mu, unless a sleep holds
// copies in it or another call made it large enough first; the memory
// pinned for nothing is freed.
func (v *vmmSource) prepareOffload(size uint64) (uint64, error) {
	v.mu.Lock()
	c, have, closed := v.eng.copier, v.eng.host.size, v.closed
	v.mu.Unlock()
	switch {
	case closed:
		return 0, errVMMClosed
	case c == nil:
		return 0, ErrNoSleep
	case size <= have:
		return have, nil
	}
	size = (size + hostAlign - 1) &^ (hostAlign - 1)
	p, err := c.AllocHost(size)
	if err != nil {
		return have, fmt.Errorf("arena: VMM: %d bytes of pinned host memory for the offload area: %w", size, err)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	a := &v.eng.host
	switch {
	case a.used > 0:
		err = fmt.Errorf("arena: VMM: the offload area holds %d bytes of memory asleep: prepare it before sleep or after wake", a.used)
	case a.size >= size:
	default:
		if a.size > 0 {
			if err := c.FreeHost(a.base, a.size); err != nil {
				return a.size, errors.Join(fmt.Errorf("arena: VMM: freeing the offload area: %w", err), c.FreeHost(p, size))
			}
		}
		a.base, a.size = p, size
		return a.size, nil
	}
	return a.size, errors.Join(err, c.FreeHost(p, size))
}

// errSleepInCapture refuses sleep and wake while a capture is underway:
// their events would join the capture, and their waits break it.
var errSleepInCapture = errors.New("arena: VMM: sleep and wake are refused while a CUDA graph capture is underway on the device")

func (v *vmmSource) sleep(req SleepRequest) (SleepReport, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.closed:
		return SleepReport{}, errVMMClosed
	case v.drv.underway.Load():
		return SleepReport{}, errSleepInCapture
	}
	return v.eng.Sleep(req)
}

func (v *vmmSource) wake(tag Tag) (WakeReport, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.closed:
		return WakeReport{}, errVMMClosed
	case v.drv.underway.Load():
		return WakeReport{}, errSleepInCapture
	}
	r, err := v.eng.Wake(tag)
	v.notePeak()
	return r, err
}

func (v *vmmSource) sleepState() SleepState {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.eng.sleepState()
}

// checkInvariants verifies the placement's invariants and the source's
// count of live bytes.
func (v *vmmSource) checkInvariants() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.eng.CheckInvariants(); err != nil {
		return err
	}
	var used uint64
	v.eng.eachLive(func(_ uintptr, size uint64) { used += size })
	if used != v.used {
		return fmt.Errorf("used %d, live allocations add up to %d", v.used, used)
	}
	return nil
}
