package main

// The functions behind goalloc's C++ allocator class for PyTorch
// (python/goalloc/csrc/goalloc_torch.cpp), which implements PyTorch's
// c10::cuda::CUDACachingAllocator::CUDAAllocator over this library:
//
//	void* goalloc_pool_malloc(size_t size, int device, cudaStream_t stream,
//	                          unsigned long long id0, unsigned long long id1,
//	                          int* oom, char** err);
//	int   goalloc_free_ptr(void* ptr);
//	void* goalloc_pool_malloc_ctx(size_t size, size_t block, int device, cudaStream_t stream,
//	                              unsigned long long id0, unsigned long long id1,
//	                              unsigned long long ctx, int* oom, char** err);
//	int   goalloc_free_ptr_ctx(void* ptr, unsigned long long ctx, int* device);
//	int   goalloc_empty_cache_ctx(unsigned long long ctx);
//	int   goalloc_record_history_opts(int max_entries, const char* skip_actions, int clear);
//	int   goalloc_set_trace_labels(int device, const char* compile_context, const char* user_metadata);
//	int   goalloc_torch_device_stats(int device, long long* out, int n);
//	long long goalloc_largest_cached_block(int device);
//	int   goalloc_create_or_incref_pool(int device, unsigned long long id0, unsigned long long id1);
//	int   goalloc_pool_use_count(int device, unsigned long long id0, unsigned long long id1);
//	char* goalloc_pool_live_blocks(int device, unsigned long long id0, unsigned long long id1);
//	char* goalloc_restore_pool(int device, unsigned long long id0, unsigned long long id1,
//	                           const unsigned long long* blocks, int n);
//	void* goalloc_front(int device);
//	int   goalloc_front_drain(int device);
//	int   goalloc_complete_recorded_free(int device, void* ptr);
//	int   goalloc_external_claim(int device, size_t size, char** err);
//	void  goalloc_external_unclaim(int device, size_t size);
//	int   goalloc_external_segment(int device, int alloc, void* addr, size_t size, int large, cudaStream_t stream);
//	int   goalloc_external_block(int device, int alloc, void* addr, size_t size, size_t requested,
//	                             int large, cudaStream_t stream);
//
// The _ctx calls name the call with the class's context id, which goalloc
// keeps in its history and gives back in the snapshot (caching/history.go,
// "Context ids"); the class keeps what the ids stand for (PyTorch's stack
// traces; python/goalloc/csrc/goalloc_contexts.h).
//
// The class evaluates PyTorch's pool filters itself and names the pool of
// each allocation (caching/pools.go); a failed allocation hands back its
// message directly, so that the class can throw it (as
// c10::OutOfMemoryError for an out-of-memory) after this call has returned:
// a C++ exception must never unwind through Go frames.

/*
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef void *cudaStream_t;
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

// goalloc_pool_malloc is goalloc_pool_malloc_ctx with no context id, the
// rounding left to goalloc.
//
//export goalloc_pool_malloc
func goalloc_pool_malloc(size C.size_t, device C.int, stream C.cudaStream_t, id0, id1 C.ulonglong,
	oom *C.int, errOut **C.char) unsafe.Pointer {
	return goalloc_pool_malloc_ctx(size, 0, device, stream, id0, id1, 0, oom, errOut)
}

// goalloc_pool_malloc_ctx is goalloc_pool_malloc for a call whose context
// id is ctx (0: none), of a request the caller rounded to a block of block
// bytes (PyTorch's roundup_power2_divisions; 0: goalloc rounds it). On
// failure *oom is 1 for an out-of-memory (else untouched) and *err the
// message; both are optional out-parameters (NULL: not wanted), and the
// calling thread's last error says the same.
//
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

// goalloc_free_ptr_ctx is goalloc_free_ptr for a call whose context id is
// ctx (0: none). It writes the device the block was on to *device (may be
// NULL; -1 for a NULL ptr, which frees nothing, and on failure), so that
// the caller can file the id with that device's history.
//
//export goalloc_free_ptr_ctx
func goalloc_free_ptr_ctx(ptr unsafe.Pointer, ctx C.ulonglong, device *C.int) C.int {
	d, err := lib.freeOwnedCtx(uintptr(ptr), uint64(ctx))
	putOut(device, C.int(d))
	return status(err)
}

// goalloc_empty_cache_ctx is goalloc_empty_cache for a call whose context
// id is ctx: 0, or -1 when a device failed (goalloc_last_error says why).
//
//export goalloc_empty_cache_ctx
func goalloc_empty_cache_ctx(ctx C.ulonglong) C.int { return status(lib.emptyCacheCtx(uint64(ctx))) }

// goalloc_record_history_opts turns history recording on, keeping the last
// maxEntries entries, or off (0), on every device, present and future, as
// torch's _record_memory_history does: skipActions names the actions not
// to record, comma-separated (NULL or empty: none; an unknown name is
// refused); clear drops what was recorded, which recording on again
// otherwise keeps (turning it off always drops it).
//
//export goalloc_record_history_opts
func goalloc_record_history_opts(maxEntries C.int, skipActions *C.char, clear C.int) C.int {
	var skip []string
	if skipActions != nil {
		if s := C.GoString(skipActions); s != "" {
			skip = strings.Split(s, ",")
		}
	}
	return status(lib.recordHistoryWith(int(maxEntries), skip, clear != 0))
}

// goalloc_set_trace_labels sets the labels of device's history entries
// from now on, torch's compile_context and user_metadata (NULL: empty); a
// device not used yet gets them when it is.
//
//export goalloc_set_trace_labels
func goalloc_set_trace_labels(device C.int, compileContext, userMetadata *C.char) C.int {
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
// c10's DeviceStats in its declaration order, nine StatArrays of (all,
// small pool, large pool) x (current, peak, allocated, freed), then
// num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc and
// num_device_free.
const torchStatFigures = 9*3*4 + 5

// goalloc_torch_device_stats writes device's torchStatFigures figures into
// out, which must hold n of them: n must be torchStatFigures, and out is
// not NULL.
//
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
	torchStats(&st, unsafe.Slice((*int64)(unsafe.Pointer(out)), torchStatFigures))
	return 0
}

// torchStats writes st into dst in the order of torchStatFigures.
func torchStats(st *caching.Stats, dst []int64) {
	k := 0
	for _, arr := range [...]*[3]caching.Stat{(*[3]caching.Stat)(&st.Allocation), (*[3]caching.Stat)(&st.Segment),
		(*[3]caching.Stat)(&st.Active), (*[3]caching.Stat)(&st.InactiveSplit), (*[3]caching.Stat)(&st.AllocatedBytes),
		(*[3]caching.Stat)(&st.ReservedBytes), (*[3]caching.Stat)(&st.ActiveBytes),
		(*[3]caching.Stat)(&st.InactiveSplitBytes), (*[3]caching.Stat)(&st.RequestedBytes)} {
		for _, s := range arr {
			dst[k], dst[k+1], dst[k+2], dst[k+3] = s.Current, s.Peak, s.Allocated, s.Freed
			k += 4
		}
	}
	copy(dst[k:], []int64{st.NumAllocRetries, st.NumOOMs, st.NumSyncAllStreams, st.NumDeviceAlloc, st.NumDeviceFree})
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

// goalloc_pool_live_blocks lists the allocated blocks of a pool as JSON,
// [[address, size, requested size, stream], ...] by address; the pool
// (0, 0) is the general cache.
//
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

// goalloc_restore_pool sets a pool back to a checkpoint: blocks holds n
// rows of goalloc_pool_live_blocks (4n numbers; NULL when n is 0). It
// returns JSON, {"freed": [addresses freed], "error": "" or what could not
// be restored}, or NULL when the pool or device does not exist or the
// arguments are refused.
//
//export goalloc_restore_pool
func goalloc_restore_pool(device C.int, id0, id1 C.ulonglong, blocks *C.ulonglong, n C.int) *C.char {
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

// goalloc_front is device's front log (caching/front.go), which the C++
// class's front (python/goalloc/csrc/goalloc_front.h) shares, made at the
// first call: Go memory pinned for as long as the process runs. NULL when
// the configuration has no front (front:false) or the device cannot be
// used. The class asks once per device.
//
//export goalloc_front
func goalloc_front(device C.int) unsafe.Pointer {
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

// goalloc_front_drain applies what device's front log holds, for the C++
// side when the log is full: 0, or -1 for a device that does not exist
// (the message in goalloc_last_error). A device not used yet has nothing
// to drain.
//
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
	switch {
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
// carves them; these count what they hold, under the cap. A size beyond
// what the pools claimed or hold is refused by caching (invalid_size), so
// that neither the cap's count nor the statistics wrap around.

// goalloc_external_claim claims size bytes under device's cap for a
// segment an own-allocator pool is about to take: 0, or -1 with *err the
// message (an optional out-parameter: NULL, not wanted), which the calling
// thread's last error says too.
//
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

// goalloc_external_unclaim gives back a claim whose segment was not made;
// a refusal (a device goalloc holds nothing on, more than was claimed)
// changes nothing and sets the calling thread's last error.
//
//export goalloc_external_unclaim
func goalloc_external_unclaim(device C.int, size C.size_t) {
	if a := externalDevice(device, "goalloc_external_unclaim"); a != nil {
		_ = lib.reportErr(a.UnclaimExternal(uint64(size)))
	}
}

// goalloc_external_segment counts a segment at addr (not NULL) made
// (alloc) or freed: 0, or -1.
//
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

// goalloc_external_block counts a block at addr (not NULL) carved from a
// segment, handed out (alloc) or freed: 0, or -1.
//
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

// goalloc_complete_recorded_free completes a free made during a capture
// that waits for other streams, once the caller proved them done
// (caching.CompleteRecordedFree): 1 if one was waiting, 0 if not, as for
// a NULL ptr or a device goalloc holds nothing on.
//
//export goalloc_complete_recorded_free
func goalloc_complete_recorded_free(device C.int, ptr unsafe.Pointer) C.int {
	if a := lib.existingDevice(int(device)); a != nil && a.CompleteRecordedFree(uintptr(ptr)) {
		return 1
	}
	return 0
}
