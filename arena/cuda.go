//go:build linux && cgo

// The real device: the CUDA driver API reached through cgo (see the package
// doc in device.go for where this sits).
//
// Why dlopen: libcuda.so.1 is opened with dlopen at run time and every entry
// point is looked up with dlsym into a static C function pointer, so goalloc
// builds and links on machines with no CUDA toolkit and no driver, and only
// fails, with a clear error, when a CUDA device is actually asked for. No CUDA
// header is used: the few types and structs are declared in cuda_driver.h as
// cuda.h of CUDA 13 lays them out (static asserts check the layouts), with the
// exported, sometimes versioned, symbol names the 580 driver really has; the
// driver is opened in cuda_driver.c. Go never touches a C function pointer:
// each driver call has its own static inline C wrapper, and handles
// (context, pool, stream, event) cross the boundary as uintptr_t, so no
// uintptr is ever turned into an unsafe.Pointer on the Go side.
//
// Why the context dance: every driver call needs a current context on the
// calling OS thread, and PyTorch's autograd thread has none (a stream-ordered
// call there failed with 201 CUDA_ERROR_INVALID_CONTEXT on an H200).
// So each C wrapper, in the same C call as the driver call (a goroutine may
// move to another OS thread between two cgo calls, never during one), reads
// cuCtxGetCurrent and then:
//   - the device's primary context is current: nothing to do (the usual case);
//   - no context is current: make the primary context current and leave it so,
//     which is what PyTorch itself would have done on that thread;
//   - another context is current (another device's, typically: multi-GPU code
//     calls my_malloc for device B from a thread whose current device is A):
//     make the primary context current for the call only and restore the
//     caller's context afterwards, so the caller's current device never
//     changes as a side effect.
//
// cuCtxSetCurrent replaces the top of the thread's context stack, so the
// restore puts back exactly what was there; nothing is pushed or popped.

package arena

/*
#cgo LDFLAGS: -ldl
#include "cuda_driver.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// CUDA event flag and pool attributes used from Go.
const (
	cuEventDisableTiming = 0x2
	cuPoolAttrRelease    = 4
	cuMemAccessReadWrite = 3
)

var (
	loadOnce sync.Once
	loadErr  error
)

// load opens libcuda.so.1, resolves its symbols and runs cuInit(0), once per
// process; every later call returns the first outcome.
func load() error {
	loadOnce.Do(func() {
		switch C.gx_load() {
		case 0:
		case 1:
			loadErr = fmt.Errorf("arena: cannot open the CUDA driver library libcuda.so.1 "+
				"(no NVIDIA driver on this machine?): %s", C.GoString(C.gx_loaderror()))
			return
		default:
			loadErr = fmt.Errorf("arena: %s", C.GoString(C.gx_loaderror()))
			return
		}
		if r := C.gx_init(); r != 0 {
			loadErr = driverError("cuInit", r)
		}
	})
	return loadErr
}

// driverError makes the DriverError for a failed call, with the driver's name
// for the code when it has one.
func driverError(op string, res C.CUresult) error {
	e := &DriverError{Op: op, Code: int(res)}
	if s := C.gx_error_name(res); s != nil {
		e.Name = C.GoString(s)
	}
	return e
}

// stageOps names the calls a wrapper makes besides its own driver call
// (the GX_* stage codes in the preamble).
var stageOps = [...]string{
	C.GX_CTX_GET:         "cuCtxGetCurrent",
	C.GX_CTX_SET:         "cuCtxSetCurrent",
	C.GX_CTX_RESTORE:     "cuCtxSetCurrent",
	C.GX_DEVICE_GET:      "cuDeviceGet",
	C.GX_PRIMARY_RETAIN:  "cuDevicePrimaryCtxRetain",
	C.GX_POOL_SET_ATTR:   "cuMemPoolSetAttribute",
	C.GX_CAN_ACCESS_PEER: "cuDeviceCanAccessPeer",
	C.GX_POOL_SET_ACCESS: "cuMemPoolSetAccess",
	C.GX_STREAM_GET_CTX:  "cuStreamGetCtx",
	C.GX_MAIN:            "",
}

// check turns a wrapper's result into nil or a *DriverError; op names the
// wrapper's own driver call.
func check(op string, r C.gx_ret) error {
	if r.res == 0 {
		return nil
	}
	if r.stage != C.GX_MAIN && int(r.stage) < len(stageOps) {
		op = stageOps[r.stage]
	}
	return driverError(op, r.res)
}

var errCUDAClosed = errors.New("arena: CUDA device is closed")

// cudaRuntime is what every CUDA device has whatever its memory comes from:
// the device's retained primary context, events (with their stand-ins in
// other contexts), capture status, synchronisation and memory info. CUDA
// (the stream-ordered pool) and VMM (handles goalloc maps) embed it.
type cudaRuntime struct {
	ordinal int
	dev     C.int       // CUdevice
	ctx     C.uintptr_t // the device's primary CUcontext, retained
	closed  atomic.Bool

	// standIns maps an event of this device that was last recorded on a
	// stream of another context (Tensor.record_stream with another device's
	// stream) to the event made in that context and recorded in its place.
	// EventDone and DestroyEvent follow the map; a later record on this
	// device's own streams drops the stand-in. nStandIns lets the usual
	// case, no stand-ins at all, skip the lock.
	standInMu sync.Mutex
	standIns  map[Event]standIn
	nStandIns atomic.Int32
}

// CUDA is one GPU, with memory from a private stream-ordered pool. Create it
// with NewCUDA; it is safe for concurrent use. It must not be used after
// Close.
type CUDA struct {
	cudaRuntime
	pool C.uintptr_t // CUmemoryPool
	// side is a non-blocking stream of goalloc's own, never captured, on
	// which AllocUncaptured allocates.
	side C.uintptr_t

	// peers has bit i set for each device i that was given read-write
	// access to the pool when it was created (every device that can access
	// this one's memory); peerErr is why granting stopped early, if it did.
	peers   uint64
	peerErr error
}

// Name says what kind of device d is, as the replay tool's results do.
func (d *CUDA) Name() string { return "cuda" }

// standIn is an event made in another device's context, ctx.
type standIn struct {
	ev  C.uintptr_t
	ctx C.uintptr_t
}

var _ Device = (*CUDA)(nil)

// CUDADeviceCount opens the driver (once per process), initialises it and
// returns how many CUDA devices it sees. The error says so clearly when
// libcuda.so.1 cannot be opened.
func CUDADeviceCount() (int, error) {
	if err := load(); err != nil {
		return 0, err
	}
	r := C.gx_device_count()
	if err := check("cuDeviceGetCount", r); err != nil {
		return 0, err
	}
	return int(r.v[0]), nil
}

// NewCUDA opens device ordinal: it retains the device's primary context
// (making it current on the calling thread if that thread has none), creates
// a private pinned memory pool on the device and sets the pool's release
// threshold to releaseThreshold bytes (^uint64(0): never release memory at
// synchronisation points).
func NewCUDA(ordinal int, releaseThreshold uint64) (*CUDA, error) {
	d := &CUDA{}
	if err := d.retain(ordinal); err != nil {
		return nil, err
	}
	n, _ := CUDADeviceCount()
	r := C.gx_pool_create(d.ctx, C.int(ordinal), C.ulonglong(releaseThreshold))
	if err := check("cuMemPoolCreate", r); err != nil {
		C.gx_primary_release(d.dev)
		return nil, err
	}
	d.pool = C.uintptr_t(r.v[0])
	r = C.gx_stream_create(d.ctx)
	if err := check("cuStreamCreate", r); err != nil {
		C.gx_pool_destroy(d.ctx, d.pool)
		C.gx_primary_release(d.dev)
		return nil, err
	}
	d.side = C.uintptr_t(r.v[0])
	r = C.gx_pool_open_to_peers(d.ctx, d.pool, C.int(ordinal), C.int(n))
	d.peers = uint64(r.v[0])
	if r.res != -1 {
		if err := check("cuMemPoolSetAccess", r); err != nil {
			d.peerErr = fmt.Errorf("arena: device %d: peer devices cannot use its memory: %w", ordinal, err)
		}
	}
	return d, nil
}

// retain opens device ordinal for d: it retains the device's primary
// context, making it current on the calling thread if that thread has none.
func (d *cudaRuntime) retain(ordinal int) error {
	n, err := CUDADeviceCount()
	if err != nil {
		return err
	}
	if ordinal < 0 || ordinal >= n {
		return fmt.Errorf("arena: no CUDA device %d (the driver sees %d)", ordinal, n)
	}
	r := C.gx_retain(C.int(ordinal))
	if err := check("cuDevicePrimaryCtxRetain", r); err != nil {
		return err
	}
	d.ordinal, d.dev, d.ctx = ordinal, C.int(r.v[0]), C.uintptr_t(r.v[1])
	return nil
}

// release destroys the stand-in events and releases the primary context.
func (d *cudaRuntime) release() error {
	d.standInMu.Lock()
	var err error
	for e, si := range d.standIns {
		err = errors.Join(err, d.destroyStandInLocked(e, si))
	}
	d.standInMu.Unlock()
	if r := C.gx_primary_release(d.dev); r != 0 {
		err = errors.Join(err, driverError("cuDevicePrimaryCtxRelease_v2", r))
	}
	return err
}

// PeersGranted lists the devices that were given access to this device's
// pool when it was created, and the error that stopped the granting early,
// if any: a copy from this device's memory to one not listed fails.
func (d *CUDA) PeersGranted() ([]int, error) {
	var out []int
	for i := 0; i < 64; i++ {
		if d.peers&(1<<i) != 0 {
			out = append(out, i)
		}
	}
	return out, d.peerErr
}

// PeerAccess asks the driver whether device peer can read and write this
// device's pool (cuMemPoolGetAccess).
func (d *CUDA) PeerAccess(peer int) (bool, error) {
	if d.closed.Load() {
		return false, errCUDAClosed
	}
	r := C.gx_pool_access(d.ctx, d.pool, C.int(peer))
	if r.res == -1 {
		return false, errors.New("arena: libcuda.so.1 has no cuMemPoolGetAccess")
	}
	if err := check("cuMemPoolGetAccess", r); err != nil {
		return false, err
	}
	return r.v[0] == cuMemAccessReadWrite, nil
}

// AllocUncaptured allocates size bytes for a stream that is being captured
// into a CUDA graph, adding nothing to the graph (see gx_alloc_uncaptured).
func (d *CUDA) AllocUncaptured(size uint64) (uintptr, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	r := C.gx_alloc_uncaptured(d.ctx, d.pool, C.size_t(size), d.side)
	if err := check("cuMemAllocFromPoolAsync", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

// FreeUncaptured gives back an allocation of AllocUncaptured at once, on
// the side stream and outside any capture (see gx_free_uncaptured): the
// pool's cap (PoolCapped) undoes an allocation that took it over the cap
// this way while a capture is open.
func (d *CUDA) FreeUncaptured(ptr uintptr, size uint64) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuMemFreeAsync", C.gx_free_uncaptured(d.ctx, C.ulonglong(ptr), d.side))
}

// Ordinal is the device index.
func (d *cudaRuntime) Ordinal() int { return d.ordinal }

// Alloc is cuMemAllocFromPoolAsync on the device's pool, ordered on s.
func (d *CUDA) Alloc(size uint64, s Stream) (uintptr, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	r := C.gx_alloc(d.ctx, d.pool, C.size_t(size), C.uintptr_t(s))
	if err := check("cuMemAllocFromPoolAsync", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

// Free is cuMemFreeAsync, ordered on s. The pool knows the size; size is
// unused.
func (d *CUDA) Free(ptr uintptr, size uint64, s Stream) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuMemFreeAsync", C.gx_free(d.ctx, C.ulonglong(ptr), C.uintptr_t(s)))
}

// Trim is cuMemPoolTrimTo.
func (d *CUDA) Trim(keep uint64) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuMemPoolTrimTo", C.gx_trim(d.ctx, d.pool, C.size_t(keep)))
}

// SetReleaseThreshold sets CU_MEMPOOL_ATTR_RELEASE_THRESHOLD.
func (d *CUDA) SetReleaseThreshold(bytes uint64) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuMemPoolSetAttribute",
		C.gx_pool_set_u64(d.ctx, d.pool, cuPoolAttrRelease, C.ulonglong(bytes)))
}

// PoolUsage reads CU_MEMPOOL_ATTR_{RESERVED,USED}_MEM_{CURRENT,HIGH}.
func (d *CUDA) PoolUsage() (PoolUsage, error) {
	if d.closed.Load() {
		return PoolUsage{}, errCUDAClosed
	}
	r := C.gx_pool_usage(d.ctx, d.pool)
	if err := check("cuMemPoolGetAttribute", r); err != nil {
		return PoolUsage{}, err
	}
	return PoolUsage{
		ReservedCurrent: uint64(r.v[0]),
		ReservedHigh:    uint64(r.v[1]),
		UsedCurrent:     uint64(r.v[2]),
		UsedHigh:        uint64(r.v[3]),
	}, nil
}

// ResetPoolHigh sets both high-water marks to 0, which the driver takes as
// "reset to the current value".
func (d *CUDA) ResetPoolHigh() error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuMemPoolSetAttribute", C.gx_reset_high(d.ctx, d.pool))
}

// MemInfo is cuMemGetInfo_v2, run in this device's context.
func (d *cudaRuntime) MemInfo() (free, total uint64, err error) {
	if d.closed.Load() {
		return 0, 0, errCUDAClosed
	}
	r := C.gx_mem_info(d.ctx)
	if err := check("cuMemGetInfo_v2", r); err != nil {
		return 0, 0, err
	}
	return uint64(r.v[0]), uint64(r.v[1]), nil
}

// NewEvent is cuEventCreate with CU_EVENT_DISABLE_TIMING.
func (d *cudaRuntime) NewEvent() (Event, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	r := C.gx_event_create(d.ctx, cuEventDisableTiming)
	if err := check("cuEventCreate", r); err != nil {
		return 0, err
	}
	return Event(r.v[0]), nil
}

// RecordEvent is cuEventRecord. When s belongs to another device's context,
// e is stood in for by an event made in that context (see standIns).
func (d *cudaRuntime) RecordEvent(e Event, s Stream) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	r := C.gx_event_record(d.ctx, C.uintptr_t(e), C.uintptr_t(s))
	if err := check("cuEventRecord", r); err != nil {
		return err
	}
	if r.v[0] == 0 {
		if d.nStandIns.Load() != 0 {
			return d.dropStandIn(e)
		}
		return nil
	}
	return d.recordStandIn(e, C.uintptr_t(r.v[1]), s)
}

// recordStandIn records, for e, an event made in ctx (the context of s),
// reusing e's stand-in when it was made there too.
func (d *cudaRuntime) recordStandIn(e Event, ctx C.uintptr_t, s Stream) error {
	d.standInMu.Lock()
	defer d.standInMu.Unlock()
	si, ok := d.standIns[e]
	if ok && si.ctx != ctx {
		if err := d.destroyStandInLocked(e, si); err != nil {
			return err
		}
		ok = false
	}
	if !ok {
		r := C.gx_event_create(ctx, cuEventDisableTiming)
		if err := check("cuEventCreate", r); err != nil {
			return err
		}
		si = standIn{ev: C.uintptr_t(r.v[0]), ctx: ctx}
		if d.standIns == nil {
			d.standIns = map[Event]standIn{}
		}
		d.standIns[e] = si
		d.nStandIns.Add(1)
	}
	r := C.gx_event_record(si.ctx, si.ev, C.uintptr_t(s))
	if err := check("cuEventRecord", r); err != nil {
		return err
	}
	if r.v[0] != 0 {
		return fmt.Errorf("arena: stream %#x changed context while an event was recorded on it", uintptr(s))
	}
	return nil
}

// dropStandIn destroys e's stand-in, if it has one.
func (d *cudaRuntime) dropStandIn(e Event) error {
	d.standInMu.Lock()
	defer d.standInMu.Unlock()
	if si, ok := d.standIns[e]; ok {
		return d.destroyStandInLocked(e, si)
	}
	return nil
}

func (d *cudaRuntime) destroyStandInLocked(e Event, si standIn) error {
	delete(d.standIns, e)
	d.nStandIns.Add(-1)
	return check("cuEventDestroy_v2", C.gx_event_destroy(si.ctx, si.ev))
}

// lookupStandIn returns the event to query for e and its context.
func (d *cudaRuntime) lookupStandIn(e Event) (C.uintptr_t, C.uintptr_t) {
	if d.nStandIns.Load() != 0 {
		d.standInMu.Lock()
		si, ok := d.standIns[e]
		d.standInMu.Unlock()
		if ok {
			return si.ev, si.ctx
		}
	}
	return C.uintptr_t(e), d.ctx
}

// EventDone is cuEventQuery: true when e (or its stand-in) has completed,
// false while CUDA_ERROR_NOT_READY.
func (d *cudaRuntime) EventDone(e Event) (bool, error) {
	if d.closed.Load() {
		return false, errCUDAClosed
	}
	ev, ctx := d.lookupStandIn(e)
	r := C.gx_event_query(ctx, ev)
	if r.res == cudaErrorNotReady && r.stage == C.GX_MAIN {
		return false, nil
	}
	if err := check("cuEventQuery", r); err != nil {
		return false, err
	}
	return true, nil
}

// DestroyEvent is cuEventDestroy_v2, of e and of its stand-in.
func (d *cudaRuntime) DestroyEvent(e Event) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return d.destroyEvent(e)
}

// destroyEvent is DestroyEvent for a backend's own Close, which marks the
// device closed first (so no other call starts) and then destroys the
// events it still holds, while the context is still retained.
func (d *cudaRuntime) destroyEvent(e Event) error {
	var err error
	if d.nStandIns.Load() != 0 {
		err = d.dropStandIn(e)
	}
	return errors.Join(err, check("cuEventDestroy_v2", C.gx_event_destroy(d.ctx, C.uintptr_t(e))))
}

// Synchronize is cuCtxSynchronize on the device's primary context.
func (d *cudaRuntime) Synchronize() error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuCtxSynchronize", C.gx_ctx_synchronize(d.ctx))
}

// CaptureStatus is cuStreamIsCapturing.
func (d *cudaRuntime) CaptureStatus(s Stream) (CaptureStatus, error) {
	if d.closed.Load() {
		return CaptureNone, errCUDAClosed
	}
	r := C.gx_is_capturing(d.ctx, C.uintptr_t(s))
	if err := check("cuStreamIsCapturing", r); err != nil {
		return CaptureNone, err
	}
	return CaptureStatus(r.v[0]), nil
}

// Close destroys the pool (memory still allocated from it is lost) and
// releases the primary context. Later calls to Close do nothing; other
// methods then return an error.
func (d *CUDA) Close() error {
	if !d.closed.CompareAndSwap(false, true) {
		return nil
	}
	err := check("cuStreamDestroy", C.gx_stream_destroy(d.ctx, d.side))
	err = errors.Join(err, check("cuMemPoolDestroy", C.gx_pool_destroy(d.ctx, d.pool)))
	return errors.Join(err, d.release())
}
