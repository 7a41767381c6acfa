package arena

import (
	"fmt"
	"slices"
	"sync"
)

// FakePhys is a PhysDriver in memory: the simulated device's VMM backend
// and the placement engine's tests run on it. It checks what the real
// driver would refuse (a map over mapped VA or outside a reservation, an
// unmap that is not one whole mapping, access set on unmapped VA, a handle
// released while mapped, more physical memory than the device has) and
// fails the call. Events come from a Runtime (a Sim's).
type FakePhys struct {
	mu       sync.Mutex
	rt       Runtime
	gran     uint64
	capacity uint64
	used     uint64 // bytes of live handles

	vaStart uintptr                // where reservations start
	nextVA  uintptr                // where the next one goes, while it fits below vaEnd
	vaEnd   uintptr                // where reservations stop (0: nowhere)
	res     map[uintptr]uint64     // reservations by base
	page    map[uintptr]PhysHandle // granule-aligned VA -> the handle mapped there
	pageOff map[uintptr]uint64     // granule-aligned VA -> its offset in that handle
	mapping map[uintptr]uint64     // mapping start -> its size
	handles map[PhysHandle]*fakeHandle
	nextH   PhysHandle

	// Pinned host memory and the driver's own streams (vmm_fake_data.go).
	hosts      map[uintptr]*fakeHost
	nextHost   uintptr
	hostUsed   uint64
	streams    map[Stream]bool
	nextStream uint64

	// OnUnmap and OnMap, when set, are called (without the lock) before a
	// mapping is dropped or made; a non-nil return fails the call. Tests
	// check stream order there.
	OnUnmap func(va uintptr, size uint64) error
	OnMap   func(va uintptr, size uint64, h PhysHandle) error
	// FailCreate, when set, is asked before each CreateHandle.
	FailCreate func(size uint64) error
	// FailHost, when set, is asked before each AllocHost; OnCopy, when
	// set, before each copy between device and host (toDevice: which way).
	FailHost func(size uint64) error
	OnCopy   func(va uintptr, size uint64, toDevice bool) error
	// FailStreamWait, when set, is asked before each StreamWaitEvent.
	FailStreamWait func(s Stream, e Event) error
	// CopiedBytes counts the bytes copied between device and host.
	CopiedBytes uint64

	// CUDA IPC (vmm_fake_ipc.go): the kernel f is attached to (nil: none),
	// as process pid, driving device dev.
	kernel *FakeKernel
	pid    int32
	dev    int

	// Calls counts every driver call by name.
	Calls map[string]int
	// AccessHandles counts the handles cuMemSetAccess opened, which is
	// what its cost follows on a GPU (not the calls).
	AccessHandles int
}

type fakeHandle struct {
	size uint64
	maps int
	// data is what was written to the handle (vmm_fake_data.go), made on
	// the first write: a new handle reads as zeros, as far as tests look.
	data fakeBytes
	// exportable: created while attached to a kernel (vmm_fake_ipc.go);
	// imported: another process's memory, which Used does not count; dev:
	// the device the memory is on.
	exportable, imported bool
	dev                  int
}

// NewFakePhys makes a fake driver with capacity bytes of physical memory and
// a granularity of gran bytes, taking events from rt.
func NewFakePhys(rt Runtime, capacity, gran uint64) *FakePhys {
	return &FakePhys{
		rt: rt, gran: gran, capacity: capacity, vaStart: 0x7f0000000000, nextVA: 0x7f0000000000,
		res: map[uintptr]uint64{}, page: map[uintptr]PhysHandle{}, pageOff: map[uintptr]uint64{}, mapping: map[uintptr]uint64{},
		handles: map[PhysHandle]*fakeHandle{}, Calls: map[string]int{},
	}
}

// Used is the physical memory held in handles.
func (f *FakePhys) Used() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.used
}

// ReservedVA is the bytes of VA reserved and not yet given back.
func (f *FakePhys) ReservedVA() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var n uint64
	for _, size := range f.res {
		n += size
	}
	return n
}

// Handles is how many handles exist.
func (f *FakePhys) Handles() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.handles)
}

// HandleAt is the handle mapped at va, if any.
func (f *FakePhys) HandleAt(va uintptr) (PhysHandle, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h, ok := f.page[va&^uintptr(f.gran-1)]
	return h, ok
}

func (f *FakePhys) Granularity() uint64 { return f.gran }

func (f *FakePhys) aligned(va uintptr, size uint64) error {
	if uint64(va)%f.gran != 0 || size == 0 || size%f.gran != 0 {
		return fmt.Errorf("fakephys: %#x+%d is not granule-aligned", va, size)
	}
	return nil
}

// SetVAWindow makes reservations lie in [start, end).
func (f *FakePhys) SetVAWindow(start, end uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.vaStart, f.nextVA, f.vaEnd = start, start, end
}

// ReserveVA reserves upwards from the window's start, a granule's gap after
// each reservation; once the window's end is reached, in the lowest gap
// that fits, as the driver reuses VA given back.
func (f *FakePhys) ReserveVA(size uint64) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemAddressReserve"]++
	if size == 0 || size%f.gran != 0 {
		return 0, fmt.Errorf("fakephys: reserve of %d bytes", size)
	}
	base := f.nextVA
	if f.fitsBelowEnd(base, size) {
		f.nextVA += uintptr(size) + uintptr(f.gran)
	} else if base = f.lowestGap(size); base == 0 {
		return 0, fmt.Errorf("fakephys: reserve of %d bytes: the device's VA window ends at %#x", size, f.vaEnd)
	}
	f.res[base] = size
	return base, nil
}

// fitsBelowEnd says whether size bytes at base, and the gap after them,
// lie below the window's end.
func (f *FakePhys) fitsBelowEnd(base uintptr, size uint64) bool {
	return f.vaEnd == 0 || base <= f.vaEnd && uint64(f.vaEnd-base) >= size && uint64(f.vaEnd-base)-size >= f.gran
}

// lowestGap is the lowest base in the window for size bytes and the gap
// after them, clear of every reservation and its gap; 0 when none fits.
func (f *FakePhys) lowestGap(size uint64) uintptr {
	bases := make([]uintptr, 0, len(f.res))
	for b := range f.res {
		bases = append(bases, b)
	}
	slices.Sort(bases)
	at := f.vaStart
	for _, b := range bases {
		if b >= at && uint64(b-at) >= size+f.gran {
			return at
		}
		at = max(at, b+uintptr(f.res[b])+uintptr(f.gran))
	}
	if f.fitsBelowEnd(at, size) {
		return at
	}
	return 0
}

func (f *FakePhys) FreeVA(base uintptr, size uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemAddressFree"]++
	if c, ok := f.rt.(interface{ forbiddenInCapture(string) error }); ok {
		if err := c.forbiddenInCapture("cuMemAddressFree"); err != nil {
			return err
		}
	}
	if f.res[base] != size {
		return fmt.Errorf("fakephys: free of VA %#x+%d, not a reservation", base, size)
	}
	// The mappings, not the granules, are walked: a reservation may span
	// the memory of a large simulated device many times over.
	for p := range f.mapping {
		if p >= base && p < base+uintptr(size) {
			return fmt.Errorf("fakephys: free of VA %#x+%d while %#x is mapped", base, size, p)
		}
	}
	delete(f.res, base)
	return nil
}

func (f *FakePhys) reserved(va uintptr, size uint64) bool {
	for b, s := range f.res {
		if va >= b && va+uintptr(size) <= b+uintptr(s) {
			return true
		}
	}
	return false
}

func (f *FakePhys) CreateHandle(size uint64) (PhysHandle, error) {
	if f.FailCreate != nil {
		if err := f.FailCreate(size); err != nil {
			return 0, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemCreate"]++
	if size == 0 || size%f.gran != 0 {
		return 0, fmt.Errorf("fakephys: handle of %d bytes", size)
	}
	if f.used+size > f.capacity {
		return 0, fmt.Errorf("fakephys: cuMemCreate of %d bytes with %d of %d used: %w", size, f.used, f.capacity, ErrOutOfMemory)
	}
	f.nextH++
	f.handles[f.nextH] = &fakeHandle{size: size, exportable: f.kernel != nil, dev: f.dev}
	f.used += size
	return f.nextH, nil
}

func (f *FakePhys) ReleaseHandle(h PhysHandle) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemRelease"]++
	fh, ok := f.handles[h]
	if !ok {
		return fmt.Errorf("fakephys: release of unknown handle %d", h)
	}
	if fh.maps != 0 {
		return fmt.Errorf("fakephys: release of handle %d, still mapped %d times", h, fh.maps)
	}
	delete(f.handles, h)
	if !fh.imported {
		f.used -= fh.size
	}
	return nil
}

func (f *FakePhys) Map(va uintptr, size uint64, h PhysHandle) error {
	if f.OnMap != nil {
		if err := f.OnMap(va, size, h); err != nil {
			return err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemMap"]++
	if err := f.aligned(va, size); err != nil {
		return err
	}
	fh, ok := f.handles[h]
	if !ok || fh.size != size {
		return fmt.Errorf("fakephys: map of handle %d with size %d (a handle is mapped whole)", h, size)
	}
	if !f.reserved(va, size) {
		return fmt.Errorf("fakephys: map at %#x+%d outside every reservation", va, size)
	}
	for p := va; p < va+uintptr(size); p += uintptr(f.gran) {
		if _, ok := f.page[p]; ok {
			return fmt.Errorf("fakephys: map at %#x over mapped VA", p)
		}
	}
	for p := va; p < va+uintptr(size); p += uintptr(f.gran) {
		f.page[p] = h
		f.pageOff[p] = uint64(p - va)
	}
	f.mapping[va] = size
	fh.maps++
	return nil
}

func (f *FakePhys) Unmap(va uintptr, size uint64) error {
	if f.OnUnmap != nil {
		if err := f.OnUnmap(va, size); err != nil {
			return err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemUnmap"]++
	if f.mapping[va] != size {
		return fmt.Errorf("fakephys: unmap of %#x+%d, not one whole mapping", va, size)
	}
	h := f.page[va]
	for p := va; p < va+uintptr(size); p += uintptr(f.gran) {
		delete(f.page, p)
		delete(f.pageOff, p)
	}
	delete(f.mapping, va)
	f.handles[h].maps--
	return nil
}

func (f *FakePhys) SetAccess(va uintptr, size uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemSetAccess"]++
	if err := f.aligned(va, size); err != nil {
		return err
	}
	for p := va; p < va+uintptr(size); p += uintptr(f.gran) {
		if _, ok := f.page[p]; !ok {
			return fmt.Errorf("fakephys: access set on unmapped %#x", p)
		}
		if _, head := f.mapping[p]; head {
			f.AccessHandles++
		}
	}
	return nil
}

func (f *FakePhys) NewEvent() (Event, error)            { return f.rt.NewEvent() }
func (f *FakePhys) RecordEvent(e Event, s Stream) error { return f.rt.RecordEvent(e, s) }
func (f *FakePhys) EventDone(e Event) (bool, error)     { return f.rt.EventDone(e) }
func (f *FakePhys) DestroyEvent(e Event) error          { return f.rt.DestroyEvent(e) }
func (f *FakePhys) CaptureStatus(s Stream) (CaptureStatus, error) {
	return f.rt.CaptureStatus(s)
}
