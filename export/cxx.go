package main

// The functions behind goalloc's C++ allocator class for PyTorch
// (python/goalloc/csrc/goalloc_torch.cpp), which implements PyTorch's
// c10::cuda::CUDACachingAllocator::CUDAAllocator over this library; goalloc.h
// declares them ("goalloc's C++ allocator class").

/*
#include "cgo.h"
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

//export goalloc_pool_malloc
func goalloc_pool_malloc(size C.size_t, device C.int, stream C.cudaStream_t, id0, id1 C.ulonglong,
	oom *C.int, errOut **C.char) unsafe.Pointer {
	return goalloc_pool_malloc_ctx(size, 0, device, stream, id0, id1, 0, oom, errOut)
}

//export goalloc_pool_malloc_ctx
func goalloc_pool_malloc_ctx(size, block C.size_t, device C.int, stream C.cudaStream_t, id0, id1, ctx C.ulonglong,
	oom *C.int, errOut **C.char) unsafe.Pointer {
	p, err := lib.mallocInCtx(uint64(size), uint64(block), int(device), uintptr(stream), caching.PoolID{uint64(id0), uint64(id1)}, uint64(ctx))
	if err != nil {
		var o *caching.OOMError
		if errors.As(err, &o) {
			putOut(oom, 1)
		}
		putMessage(errOut, err)
		return nil
	}
	return devicePointer(p)
}

//export goalloc_free_ptr
func goalloc_free_ptr(ptr unsafe.Pointer) C.int { return status(lib.freeOwned(uintptr(ptr))) }

//export goalloc_free_ptr_ctx
func goalloc_free_ptr_ctx(ptr unsafe.Pointer, ctx C.ulonglong, device *C.int) C.int {
	d, err := lib.freeOwnedCtx(uintptr(ptr), uint64(ctx))
	putOut(device, C.int(d))
	return status(err)
}

//export goalloc_empty_cache_ctx
func goalloc_empty_cache_ctx(ctx C.ulonglong) C.int { return status(lib.emptyCacheCtx(uint64(ctx))) }

//export goalloc_record_history_opts
func goalloc_record_history_opts(maxEntries C.int, skipActions *C.goalloc_const_char, clear C.int) C.int {
	var skip []string
	if skipActions != nil {
		if s := C.GoString(skipActions); s != "" {
			skip = strings.Split(s, ",")
		}
	}
	return status(lib.recordHistoryWith(int(maxEntries), skip, clear != 0))
}

//export goalloc_set_trace_labels
func goalloc_set_trace_labels(device C.int, compileContext, userMetadata *C.goalloc_const_char) C.int {
	var l caching.TraceLabels
	if compileContext != nil {
		l.CompileContext = C.GoString(compileContext)
	}
	if userMetadata != nil {
		l.UserMetadata = C.GoString(userMetadata)
	}
	return status(lib.setTraceLabels(int(device), l))
}

// torchStatFigures is how many numbers goalloc_torch_device_stats writes:
// goalloc.h's count, which caching's table (Stats.TorchFigures) must give
// too, or this does not compile.
const torchStatFigures = C.GOALLOC_TORCH_STAT_FIGURES

var _ = [1]struct{}{}[torchStatFigures-caching.NumTorchFigures] // the two counts are equal

//export goalloc_torch_device_stats
func goalloc_torch_device_stats(device C.int, out *C.longlong, n C.int) C.int {
	if int(n) != torchStatFigures {
		return status(lib.bad("invalid_argument", fmt.Sprintf("goalloc: goalloc_torch_device_stats: n is %d; this library gives %d figures", n, torchStatFigures)))
	}
	if out == nil {
		return status(lib.nullArg("goalloc_torch_device_stats", "out", fmt.Sprintf("give a buffer of %d figures", torchStatFigures)))
	}
	st, err := lib.stats(int(device))
	if err != nil {
		return -1
	}
	st.TorchFigures((*[caching.NumTorchFigures]int64)(unsafe.Pointer(out)))
	return 0
}

//export goalloc_largest_cached_block
func goalloc_largest_cached_block(device C.int) C.longlong {
	if lib.checkDevice(int(device)) != nil {
		return -1
	}
	if a := lib.existingDevice(int(device)); a != nil {
		return C.longlong(a.Fragmentation().LargestFreeBlock)
	}
	return 0
}

//export goalloc_create_or_incref_pool
func goalloc_create_or_incref_pool(device C.int, id0, id1 C.ulonglong) C.int {
	a, err := lib.device(int(device))
	if err != nil {
		return -1
	}
	return status(lib.reportErr(a.IncrefPool(caching.PoolID{uint64(id0), uint64(id1)})))
}

//export goalloc_pool_use_count
func goalloc_pool_use_count(device C.int, id0, id1 C.ulonglong) C.int {
	if lib.checkDevice(int(device)) != nil {
		return -1
	}
	if a := lib.existingDevice(int(device)); a != nil {
		return C.int(a.PoolUseCount(caching.PoolID{uint64(id0), uint64(id1)}))
	}
	return 0
}

//export goalloc_pool_live_blocks
func goalloc_pool_live_blocks(device C.int, id0, id1 C.ulonglong) *C.char {
	if lib.checkDevice(int(device)) != nil {
		return nil
	}
	var live []caching.LiveBlock
	if a := lib.existingDevice(int(device)); a != nil {
		live = a.PoolLive(caching.PoolID{uint64(id0), uint64(id1)})
	}
	rows := make([][4]uint64, len(live))
	for i, b := range live {
		rows[i] = [4]uint64{uint64(b.Addr), b.Size, b.Requested, uint64(b.Stream)}
	}
	return cstring(json.Marshal(rows))
}

//export goalloc_restore_pool
func goalloc_restore_pool(device C.int, id0, id1 C.ulonglong, blocks *C.goalloc_const_ull, n C.int) *C.char {
	if n < 0 {
		_ = lib.bad("invalid_argument", fmt.Sprintf("goalloc: goalloc_restore_pool: n is %d; give the number of rows in blocks (0 or more)", n))
		return nil
	}
	if n > 0 && blocks == nil {
		_ = lib.nullArg("goalloc_restore_pool", "blocks", fmt.Sprintf("give the %d rows of the checkpoint (NULL only with n = 0)", n))
		return nil
	}
	a := lib.existingDevice(int(device))
	if a == nil {
		_ = lib.bad("invalid_pool", fmt.Sprintf("goalloc: restore_pool on device %d, where goalloc holds nothing", device))
		return nil
	}
	var rows []uint64
	if n > 0 {
		rows = unsafe.Slice((*uint64)(unsafe.Pointer(blocks)), 4*int(n))
	}
	checkpoint := make([]caching.LiveBlock, n)
	for i := range checkpoint {
		r := rows[4*i:]
		checkpoint[i] = caching.LiveBlock{Addr: uintptr(r[0]), Size: r[1], Requested: r[2], Stream: arena.Stream(r[3])}
	}
	freed, err := a.RestorePool(caching.PoolID{uint64(id0), uint64(id1)}, checkpoint)
	var ie *caching.InputError
	if errors.As(err, &ie) && freed == nil {
		lib.report(err)
		return nil
	}
	res := struct {
		Freed []uint64 `json:"freed"`
		Error string   `json:"error"`
	}{Freed: []uint64{}}
	for _, p := range freed {
		res.Freed = append(res.Freed, uint64(p))
	}
	if err != nil {
		res.Error = err.Error()
		lib.report(err)
	}
	return cstring(json.Marshal(res))
}

// goalloc_front_log hands out the log pinned (pinFront): the class keeps its
// address.
//
//export goalloc_front_log
func goalloc_front_log(device C.int) unsafe.Pointer {
	a, err := lib.device(int(device))
	if err != nil {
		return nil
	}
	if f := a.EnableFront(); f != nil {
		pinFront(f)
		return unsafe.Pointer(f)
	}
	return nil
}

//export goalloc_front_drain
func goalloc_front_drain(device C.int) C.int {
	d := int(device)
	if err := lib.checkDevice(d); err != nil {
		return -1
	}
	if a := lib.existingDevice(d); a != nil {
		a.DrainFront()
	}
	return 0
}

// frontPins keeps every device's front log at its address for the C++
// side. Allocators live as long as the process, so nothing is unpinned;
// a package variable, because a Pinner collected with pins held panics.
var (
	frontPinsMu sync.Mutex
	frontPins   runtime.Pinner
)

func pinFront(f *caching.FrontLog) {
	frontPinsMu.Lock()
	defer frontPinsMu.Unlock()
	frontPins.Pin(f) // pinning a pinned object again is allowed
}

// mallocIn allocates from the pool id (the general cache for the zero id).
func (l *library) mallocIn(size uint64, d int, s uintptr, id caching.PoolID) (uintptr, error) {
	return l.mallocInCtx(size, 0, d, s, id, 0)
}

// mallocInCtx is mallocIn for a call whose context id is ctx (0: none).
func (l *library) mallocInCtx(size, block uint64, d int, s uintptr, id caching.PoolID, ctx uint64) (uintptr, error) {
	a, err := l.device(d)
	if err != nil {
		return 0, err
	}
	var p uintptr
	switch tag := l.allocTag(); {
	case tag != 0:
		p, err = a.MallocInTagged(tag, id, size, block, arena.Stream(s), ctx)
	case block > size:
		p, err = a.MallocInRounded(id, size, block, arena.Stream(s), ctx)
	case ctx == 0:
		p, err = a.MallocIn(id, size, arena.Stream(s))
	default:
		p, err = a.MallocInCtx(id, size, arena.Stream(s), ctx)
	}
	if err != nil {
		return 0, l.refused(err)
	}
	return p, nil
}

// refused records why the C++ class's request for memory (an allocation,
// an own-allocator pool's claim) failed, and returns err. An out-of-memory
// only becomes the calling thread's last error: the class raises
// torch.OutOfMemoryError with its message, which is where PyTorch's
// allocator says it too, not on stderr. Anything else is reported as usual.
func (l *library) refused(err error) error {
	if err == nil {
		return nil
	}
	var oom *caching.OOMError
	if errors.As(err, &oom) {
		return l.fail(err)
	}
	l.report(err)
	return err
}

// lastFreeDevice is the device whose block was freed last: a pointer
// alone does not say its device, and a process mostly frees on one.
var lastFreeDevice atomic.Int32

// freeOwned frees ptr on whichever device holds it.
func (l *library) freeOwned(p uintptr) error {
	_, err := l.freeOwnedCtx(p, 0)
	return err
}

// freeOwnedCtx is freeOwned for a call whose context id is ctx (0: none),
// and says which device held p (-1: none, and for NULL).
func (l *library) freeOwnedCtx(p uintptr, ctx uint64) (int, error) {
	if p == 0 {
		return -1, nil // torch's deleter of an empty tensor
	}
	first := int(lastFreeDevice.Load())
	if a := l.devices[first].Load(); a != nil {
		if held, err := freeOn(a, p, ctx); held {
			return first, l.reportErr(err)
		}
	}
	for d := range l.devices {
		a := l.devices[d].Load()
		if d == first || a == nil {
			continue
		}
		if held, err := freeOn(a, p, ctx); held {
			lastFreeDevice.Store(int32(d))
			return d, l.reportErr(err)
		}
	}
	return -1, l.bad("unknown_pointer", fmt.Sprintf("goalloc: free of %#x, which goalloc did not allocate on any device", p))
}

// freeOn frees p on a if a holds it, under the context id ctx.
func freeOn(a *caching.Allocator, p uintptr, ctx uint64) (held bool, err error) {
	if ctx == 0 {
		return a.FreeOwned(p)
	}
	return a.FreeOwnedCtx(p, ctx)
}

// stats is device d's statistics, zero for a device not used yet.
func (l *library) stats(d int) (caching.Stats, error) {
	if err := l.checkDevice(d); err != nil {
		return caching.Stats{}, err
	}
	if a := l.existingDevice(d); a != nil {
		return a.Stats(), nil
	}
	return caching.Stats{}, nil
}

// Pools with an allocator of their own (caching/external.go): the class
// carves them; these count what they hold, under the cap.

//export goalloc_external_claim
func goalloc_external_claim(device C.int, size C.size_t, errOut **C.char) C.int {
	a, err := lib.device(int(device))
	if err == nil {
		err = lib.refused(a.ClaimExternal(uint64(size)))
	}
	if err != nil {
		putMessage(errOut, err)
		return -1
	}
	return 0
}

//export goalloc_external_unclaim
func goalloc_external_unclaim(device C.int, size C.size_t) {
	if a := externalDevice(device, "goalloc_external_unclaim"); a != nil {
		_ = lib.reportErr(a.UnclaimExternal(uint64(size)))
	}
}

//export goalloc_external_segment
func goalloc_external_segment(device C.int, alloc C.int, addr unsafe.Pointer, size C.size_t, large C.int, stream C.cudaStream_t) C.int {
	if addr == nil {
		return status(lib.nullArg("goalloc_external_segment", "addr", "give the address the pool's allocator gave"))
	}
	a := externalDevice(device, "goalloc_external_segment")
	if a == nil {
		return -1
	}
	return status(lib.reportErr(a.ExternalSegment(alloc != 0, uintptr(addr), uint64(size), large != 0, arena.Stream(uintptr(stream)))))
}

//export goalloc_external_block
func goalloc_external_block(device C.int, alloc C.int, addr unsafe.Pointer, size, requested C.size_t, large C.int, stream C.cudaStream_t) C.int {
	if addr == nil {
		return status(lib.nullArg("goalloc_external_block", "addr", "give the block's address in its segment"))
	}
	a := externalDevice(device, "goalloc_external_block")
	if a == nil {
		return -1
	}
	return status(lib.reportErr(a.ExternalBlock(alloc != 0, uintptr(addr), uint64(size), uint64(requested), large != 0, arena.Stream(uintptr(stream)))))
}

// externalDevice is the allocator of device for fn's own-allocator
// bookkeeping, or nil, refused as bad_device, where goalloc holds nothing:
// a segment is claimed (goalloc_external_claim) before anything is counted,
// and the claim makes the device.
func externalDevice(device C.int, fn string) *caching.Allocator {
	a := lib.existingDevice(int(device))
	if a == nil {
		_ = lib.bad("bad_device", fmt.Sprintf("goalloc: %s on device %d, where goalloc holds nothing", fn, int(device)))
	}
	return a
}

//export goalloc_complete_recorded_free
func goalloc_complete_recorded_free(device C.int, ptr unsafe.Pointer) C.int {
	if a := lib.existingDevice(int(device)); a != nil && a.CompleteRecordedFree(uintptr(ptr)) {
		return 1
	}
	return 0
}
