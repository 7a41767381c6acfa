//go:build linux && cgo

// The VMM device: physical memory from cuMemCreate, mapped by goalloc where
// it likes (the segments placement, vmm.go), instead of a
// stream-ordered pool. The runtime half (context, events, capture status,
// synchronisation, memory info) is the CUDA device's own (cudaRuntime); the
// C wrappers are the gx_vmm_* ones in cuda_driver.h.
//
// Layouts, as cuda.h of CUDA 13 has them and cuda_driver.h asserts:
// CUmemAllocationProp is 32 bytes (type, requestedHandleTypes, location,
// win32HandleMetaData, allocFlags), CUmemAccessDesc 12 (location, flags),
// CUmemLocation 8 (type, id). The VMM entry points are plain exports of the
// 580 driver (no _v2 names); each is looked up optionally, so a driver
// without them still loads and only NewVMM fails.

package arena

/*
#include "cuda_driver.h"
*/
import "C"

import (
	"errors"
	"fmt"
)

// VMM is one GPU whose memory goalloc places itself: a vmmSource over the
// CUDA driver. Create it with NewVMM; it is safe for concurrent use.
type VMM struct {
	cudaRuntime
	src   *vmmSource
	peers uint64 // bit i: device i can access this device's memory, and was granted it
}

var (
	_ Device         = (*VMM)(nil)
	_ DriverProfiler = (*VMM)(nil)
	_ CaptureAware   = (*VMM)(nil)
	_ StreamGranular = (*VMM)(nil)
	_ Sleeper        = (*VMM)(nil)
	_ Sharer         = (*VMM)(nil)
	_ HeldSplitter   = (*VMM)(nil)
)

// Name says what kind of device d is, as the replay tool's results do: a
// GPU, whichever backend serves its memory.
func (d *VMM) Name() string { return "cuda" }

// cudaPhys is the PhysDriver of a VMM device: one gx_vmm_* call per method.
type cudaPhys struct {
	rt         *cudaRuntime
	gran       uint64
	driverGran uint64 // cuMemGetAllocationGranularity's
	peers      uint64
	ipc        bool // handles are created exportable (vmm_cuda_ipc.go)
}

func (p *cudaPhys) Granularity() uint64 { return p.gran }

// MinGranule is the driver's own granularity, of which handles other
// processes export may be any multiple (vmm_ipc.go).
func (p *cudaPhys) MinGranule() uint64 { return p.driverGran }

func (p *cudaPhys) ReserveVA(size uint64) (uintptr, error) {
	r := C.gx_vmm_reserve(p.rt.ctx, C.size_t(size), C.size_t(p.gran))
	if err := check("cuMemAddressReserve", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

func (p *cudaPhys) FreeVA(base uintptr, size uint64) error {
	return check("cuMemAddressFree", C.gx_vmm_address_free(p.rt.ctx, C.ulonglong(base), C.size_t(size)))
}

func (p *cudaPhys) CreateHandle(size uint64) (PhysHandle, error) {
	r := C.gx_vmm_create(p.rt.ctx, C.int(p.rt.ordinal), C.size_t(size), p.handleTypes())
	if err := check("cuMemCreate", r); err != nil {
		return 0, err
	}
	return PhysHandle(r.v[0]), nil
}

func (p *cudaPhys) ReleaseHandle(h PhysHandle) error {
	return check("cuMemRelease", C.gx_vmm_release(p.rt.ctx, C.ulonglong(h)))
}

func (p *cudaPhys) Map(va uintptr, size uint64, h PhysHandle) error {
	return check("cuMemMap", C.gx_vmm_map(p.rt.ctx, C.ulonglong(va), C.size_t(size), C.ulonglong(h)))
}

func (p *cudaPhys) Unmap(va uintptr, size uint64) error {
	return check("cuMemUnmap", C.gx_vmm_unmap(p.rt.ctx, C.ulonglong(va), C.size_t(size)))
}

func (p *cudaPhys) SetAccess(va uintptr, size uint64) error {
	return check("cuMemSetAccess", C.gx_vmm_set_access(p.rt.ctx, C.ulonglong(va), C.size_t(size),
		C.int(p.rt.ordinal), C.ulonglong(p.peers)))
}

func (p *cudaPhys) NewEvent() (Event, error)            { return p.rt.NewEvent() }
func (p *cudaPhys) RecordEvent(e Event, s Stream) error { return p.rt.RecordEvent(e, s) }
func (p *cudaPhys) EventDone(e Event) (bool, error)     { return p.rt.EventDone(e) }
func (p *cudaPhys) CaptureStatus(s Stream) (CaptureStatus, error) {
	return p.rt.CaptureStatus(s)
}

// StreamWaitEvent is cuStreamWaitEvent, of e or of its stand-in in another
// context (cudaRuntime.standIns).
func (p *cudaPhys) StreamWaitEvent(s Stream, e Event) error {
	ev, _ := p.rt.lookupStandIn(e)
	return check("cuStreamWaitEvent", C.gx_stream_wait_event(p.rt.ctx, C.uintptr_t(s), ev))
}

// DestroyEvent is also called by the source's close, after VMM.Close has
// marked the device closed.
func (p *cudaPhys) DestroyEvent(e Event) error { return p.rt.destroyEvent(e) }

// cudaCopier is cudaPhys with the sleep and wake half (HostCopier), one
// gx_* call per method; NewVMMWith gives the source one only where the
// driver has every entry point they use (gx_sleep_available).
type cudaCopier struct{ *cudaPhys }

var _ HostCopier = cudaCopier{}

// AllocHost is cuMemHostAlloc, pinned for every context.
func (p cudaCopier) AllocHost(size uint64) (uintptr, error) {
	r := C.gx_host_alloc(p.rt.ctx, C.size_t(size))
	if err := check("cuMemHostAlloc", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

// FreeHost is cuMemFreeHost (the driver knows the size).
func (p cudaCopier) FreeHost(host uintptr, _ uint64) error {
	return check("cuMemFreeHost", C.gx_host_free(p.rt.ctx, C.uintptr_t(host)))
}

// NewCopyStream is a non-blocking stream of the device's context, so that
// the copies on it never wait for the legacy default stream.
func (p cudaCopier) NewCopyStream() (Stream, error) {
	r := C.gx_stream_create(p.rt.ctx)
	if err := check("cuStreamCreate", r); err != nil {
		return 0, err
	}
	return Stream(r.v[0]), nil
}

func (p cudaCopier) DestroyCopyStream(s Stream) error {
	return check("cuStreamDestroy", C.gx_stream_destroy(p.rt.ctx, C.uintptr_t(s)))
}

// CopyToHost is cuMemcpyDtoHAsync_v2 into pinned memory, queued on s.
func (p cudaCopier) CopyToHost(host, va uintptr, size uint64, s Stream) error {
	return check("cuMemcpyDtoHAsync_v2", C.gx_copy_dtoh(p.rt.ctx, C.uintptr_t(host), C.ulonglong(va), C.size_t(size), C.uintptr_t(s)))
}

// CopyToDevice is cuMemcpyHtoDAsync_v2 from pinned memory, queued on s.
func (p cudaCopier) CopyToDevice(va, host uintptr, size uint64, s Stream) error {
	return check("cuMemcpyHtoDAsync_v2", C.gx_copy_htod(p.rt.ctx, C.ulonglong(va), C.uintptr_t(host), C.size_t(size), C.uintptr_t(s)))
}

// WaitEvent is cuEventSynchronize, of e or of its stand-in, in the
// context the event was made in.
func (p cudaCopier) WaitEvent(e Event) error {
	ev, ctx := p.rt.lookupStandIn(e)
	return check("cuEventSynchronize", C.gx_event_synchronize(ctx, ev))
}

// NewVMM opens device ordinal with the VMM backend: it retains the
// device's primary context, reads the allocation granularity, finds the
// peer devices that can access this one (each mapping is opened to all of
// them), and lays memory out as the default layout says.
func NewVMM(ordinal int) (*VMM, error) { return NewVMMWith(ordinal, VMMLayout{}) }

// NewVMMWith is NewVMM with memory laid out as l says.
func NewVMMWith(ordinal int, l VMMLayout) (*VMM, error) {
	d := &VMM{}
	if err := d.retain(ordinal); err != nil {
		return nil, err
	}
	fail := func(err error) (*VMM, error) {
		_ = d.release()
		return nil, fmt.Errorf("arena: device %d: VMM backend: %w", ordinal, err)
	}
	if C.gx_vmm_available() == 0 {
		return fail(errors.New("libcuda.so.1 lacks the virtual memory management entry points (cuMemCreate, cuMemMap, ...); use backend:async"))
	}
	r := C.gx_vmm_granularity(d.ctx, C.int(ordinal))
	if err := check("cuMemGetAllocationGranularity", r); err != nil {
		return fail(err)
	}
	driverGran := uint64(r.v[0])
	n, _ := CUDADeviceCount()
	r = C.gx_vmm_peers(d.ctx, C.int(ordinal), C.int(n))
	if err := check("cuDeviceCanAccessPeer", r); err != nil {
		return fail(err)
	}
	d.peers = uint64(r.v[0])
	_, total, err := d.MemInfo()
	if err != nil {
		return fail(err)
	}
	gran, err := l.granule(driverGran, total)
	if err != nil {
		return fail(err)
	}
	var phys PhysDriver = &cudaPhys{rt: &d.cudaRuntime, gran: gran, driverGran: driverGran, peers: d.peers, ipc: ipcSupported(d.dev)}
	if C.gx_sleep_available() != 0 {
		phys = cudaCopier{phys.(*cudaPhys)}
	}
	d.src, err = newVMMSource(phys, total, 0)
	if err != nil {
		return fail(err)
	}
	return d, nil
}

// PeersGranted lists the devices every mapping of this device is opened to.
func (d *VMM) PeersGranted() ([]int, error) {
	var out []int
	for i := 0; i < 64; i++ {
		if d.peers&(1<<i) != 0 {
			out = append(out, i)
		}
	}
	return out, nil
}

// DriverCalls is DriverProfiler's method: how often, and how long, this
// device called each driver function.
func (d *VMM) DriverCalls() []DriverCallStat { return d.src.DriverCalls() }

// HeldSplit is HeldSplitter's method (vmm_held.go): a walk over every span.
func (d *VMM) HeldSplit() HeldSplit { return d.src.heldSplit() }

// HeldSplitAtPeak is HeldSplitter's: the split when held last rose above
// its high-water mark.
func (d *VMM) HeldSplitAtPeak() HeldSplit { return d.src.heldSplitAtPeak() }

// FreeEndsBeside is HeldSplitter's (vmm_held.go): a walk over every span.
func (d *VMM) FreeEndsBeside() []FreeEnds { return d.src.freeEndsBeside() }

// Granularity is the driver's allocation granularity for this device.
func (d *VMM) Granularity() uint64 { return d.src.gran }

// StreamGranule is StreamGranular's method: the placement's handle.
func (d *VMM) StreamGranule() uint64 { return d.src.gran }

// Synchronize waits for all work on the device, and then tells the
// placement (vmmSource.synchronize).
func (d *VMM) Synchronize() error { return d.src.synchronize(d.cudaRuntime.Synchronize) }

func (d *VMM) Alloc(size uint64, s Stream) (uintptr, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	return d.src.alloc(size, s)
}

// AllocUncaptured places memory any stream may use at once. VMM calls are
// not stream-ordered, so nothing is added to a graph being captured; only
// memory whose frees have completed is used.
func (d *VMM) AllocUncaptured(size uint64) (uintptr, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	return d.src.alloc(size, anyStream)
}

// Free gives ptr back, ordered on s by an event recorded there.
func (d *VMM) Free(ptr uintptr, size uint64, s Stream) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return d.src.free(ptr, size, s)
}

// Trim unmaps completed frees and releases free physical memory until at
// most keep bytes are held.
func (d *VMM) Trim(keep uint64) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return d.src.trim(keep)
}

// SetReleaseThreshold does nothing: the VMM backend gives memory back only
// when trimmed, never behind goalloc's back.
func (d *VMM) SetReleaseThreshold(uint64) error { return nil }

// PoolUsage: reserved is the physical memory held (mapped and free
// handles), used the bytes of live allocations (rounded as placed).
func (d *VMM) PoolUsage() (PoolUsage, error) {
	if d.closed.Load() {
		return PoolUsage{}, errCUDAClosed
	}
	return d.src.usage(), nil
}

func (d *VMM) ResetPoolHigh() error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	d.src.resetHigh()
	return nil
}

// SetCap bounds the physical memory held (0: no bound but the device).
func (d *VMM) SetCap(limit uint64) { d.src.setCap(limit) }

// SetCaptureUnderway is CaptureAware's method.
func (d *VMM) SetCaptureUnderway(underway bool) { d.src.setCaptureUnderway(underway) }

// SetAllocTag is Sleeper's method.
func (d *VMM) SetAllocTag(tag Tag) { d.src.setAllocTag(tag) }

// Sleep is Sleeper's method: the placement's sleep over the driver's
// copies (cudaCopier); ErrNoSleep where the driver lacks them.
func (d *VMM) Sleep(req SleepRequest) (SleepReport, error) {
	if d.closed.Load() {
		return SleepReport{}, errCUDAClosed
	}
	return d.src.sleep(req)
}

// Wake is Sleeper's method.
func (d *VMM) Wake(tag Tag) (WakeReport, error) {
	if d.closed.Load() {
		return WakeReport{}, errCUDAClosed
	}
	return d.src.wake(tag)
}

// SleepState is Sleeper's method.
func (d *VMM) SleepState() SleepState { return d.src.sleepState() }

// PrepareOffload is Sleeper's method.
func (d *VMM) PrepareOffload(size uint64) (uint64, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	return d.src.prepareOffload(size)
}

// ExportIPC is Sharer's method: the handles under a live block, as
// descriptors of this process (Note [CUDA IPC]).
func (d *VMM) ExportIPC(ptr uintptr, size uint64) (IPCExport, error) {
	if d.closed.Load() {
		return IPCExport{}, errCUDAClosed
	}
	return d.src.exportIPC(ptr, size)
}

// ImportIPC is Sharer's method: another process's handles mapped here.
func (d *VMM) ImportIPC(x IPCExport) (uintptr, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	return d.src.importIPC(x)
}

// CloseIPC is Sharer's method.
func (d *VMM) CloseIPC(base uintptr) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return d.src.closeIPC(base)
}

// Close unmaps and releases everything (memory still allocated is lost)
// and releases the primary context.
func (d *VMM) Close() error {
	if !d.closed.CompareAndSwap(false, true) {
		return nil
	}
	return errors.Join(d.src.close(), d.release())
}
