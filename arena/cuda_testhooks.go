//go:build linux && cgo && goalloc_cudatest

// Test hooks of the CUDA device, built only with the goalloc_cudatest tag (the
// CUDA tests in cuda_test.go use them; the library never does): reading and
// setting the calling thread's context, a second context on a device, a
// stream's capture id, the thread's capture mode.
//
//	go test -tags goalloc_cudatest ./arena        (on a machine with a GPU)
//	go test -c -tags goalloc_cudatest -o build/arena.test ./arena

package arena

/*
#include "cuda_driver.h"

// gx_capture_info: v[0] = capture status, v[1] = capture id. res is -1 when
// the driver has neither cuStreamGetCaptureInfo_v3 nor _v2.
static inline gx_ret gx_capture_info(uintptr_t ctx, uintptr_t stream) {
	CUresult (*p_cuStreamGetCaptureInfo_v3)(CUstream, int *, cuuint64_t *, CUgraph *,
		const CUgraphNode **, const CUgraphEdgeData **, size_t *) = gx_sym("cuStreamGetCaptureInfo_v3");
	CUresult (*p_cuStreamGetCaptureInfo_v2)(CUstream, int *, cuuint64_t *, CUgraph *,
		const CUgraphNode **, size_t *) = gx_sym("cuStreamGetCaptureInfo_v2");
	if (p_cuStreamGetCaptureInfo_v3 == NULL && p_cuStreamGetCaptureInfo_v2 == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	int status = 0;
	cuuint64_t id = 0;
	if (p_cuStreamGetCaptureInfo_v3 != NULL) {
		out.res = p_cuStreamGetCaptureInfo_v3((CUstream)stream, &status, &id, NULL, NULL, NULL, NULL);
	} else {
		out.res = p_cuStreamGetCaptureInfo_v2((CUstream)stream, &status, &id, NULL, NULL, NULL);
	}
	out.v[0] = (unsigned long long)status;
	out.v[1] = id;
	GX_END()
}

// gx_exchange_capture_mode: v[0] = the thread's previous mode. res is -1 when
// the driver lacks cuThreadExchangeStreamCaptureMode.
static inline gx_ret gx_exchange_capture_mode(uintptr_t ctx, int mode) {
	if (p_cuThreadExchangeStreamCaptureMode == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	int m = mode;
	out.res = p_cuThreadExchangeStreamCaptureMode(&m);
	out.v[0] = (unsigned long long)m;
	GX_END()
}

// The calling thread's current context, and setting it.
static inline gx_ret gx_current_context(void) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	CUcontext cur = NULL;
	out.res = p_cuCtxGetCurrent(&cur);
	out.v[0] = (unsigned long long)(uintptr_t)cur;
	return out;
}

static inline CUresult gx_set_current_context(uintptr_t ctx) {
	return p_cuCtxSetCurrent((CUcontext)ctx);
}

// A new, non-primary context on dev, pushed on this thread (v[0]),
// and destroying it. res is -1 when the driver lacks the legacy entry points.
static inline gx_ret gx_test_ctx_create(int dev) {
	gx_ret out = { { 0, 0, 0, 0 }, -1, GX_MAIN };
	CUcontext c = NULL;
	CUresult (*p_cuCtxCreate)(CUcontext *, unsigned int, CUdevice) = gx_sym("cuCtxCreate_v2");
	if (p_cuCtxCreate == NULL) {
		return out;
	}
	out.res = p_cuCtxCreate(&c, 0, (CUdevice)dev);
	out.v[0] = (unsigned long long)(uintptr_t)c;
	return out;
}

static inline CUresult gx_test_ctx_destroy(uintptr_t ctx) {
	CUresult (*p_cuCtxDestroy)(CUcontext) = gx_sym("cuCtxDestroy_v2");
	return p_cuCtxDestroy == NULL ? -1 : p_cuCtxDestroy((CUcontext)ctx);
}

// Device memory from the host side, for the VMM tests: fill (stream-ordered,
// so a test can keep a stream busy), copy to the host, copy between devices.
// res is -1 when the driver lacks the entry point.
static inline gx_ret gx_test_memset(uintptr_t ctx, unsigned long long p, unsigned char v, size_t n, uintptr_t stream) {
	CUresult (*fn)(CUdeviceptr, unsigned char, size_t, CUstream) = gx_sym("cuMemsetD8Async");
	if (fn == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	out.res = fn((CUdeviceptr)p, v, n, (CUstream)stream);
	GX_END()
}

static inline gx_ret gx_test_dtoh(uintptr_t ctx, void *dst, unsigned long long src, size_t n) {
	CUresult (*fn)(void *, CUdeviceptr, size_t) = gx_sym("cuMemcpyDtoH_v2");
	if (fn == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	out.res = fn(dst, (CUdeviceptr)src, n);
	GX_END()
}

static inline gx_ret gx_test_dtod(uintptr_t ctx, unsigned long long dst, unsigned long long src, size_t n) {
	CUresult (*fn)(CUdeviceptr, CUdeviceptr, size_t) = gx_sym("cuMemcpyDtoD_v2");
	if (fn == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	out.res = fn((CUdeviceptr)dst, (CUdeviceptr)src, n);
	GX_END()
}

static inline gx_ret gx_test_stream_sync(uintptr_t ctx, uintptr_t stream) {
	GX_BEGIN(ctx)
	out.res = p_cuStreamSynchronize((CUstream)stream);
	GX_END()
}
*/
import "C"

import (
	"errors"
	"unsafe"
)

var errNoTestEntry = errors.New("arena: libcuda.so.1 lacks an entry point this test needs")

// memset fills n bytes at p with v, ordered on s (cuMemsetD8Async).
func (d *cudaRuntime) memset(p uintptr, v byte, n uint64, s Stream) error {
	r := C.gx_test_memset(d.ctx, C.ulonglong(p), C.uchar(v), C.size_t(n), C.uintptr_t(s))
	if r.res == -1 {
		return errNoTestEntry
	}
	return check("cuMemsetD8Async", r)
}

// copyToHost copies len(dst) bytes from p (cuMemcpyDtoH_v2, synchronous).
func (d *cudaRuntime) copyToHost(dst []byte, p uintptr) error {
	r := C.gx_test_dtoh(d.ctx, unsafe.Pointer(&dst[0]), C.ulonglong(p), C.size_t(len(dst)))
	if r.res == -1 {
		return errNoTestEntry
	}
	return check("cuMemcpyDtoH_v2", r)
}

// copyDevice copies n bytes from src to dst, which may lie on another
// device (cuMemcpyDtoD_v2 in this device's context).
func (d *cudaRuntime) copyDevice(dst, src uintptr, n uint64) error {
	r := C.gx_test_dtod(d.ctx, C.ulonglong(dst), C.ulonglong(src), C.size_t(n))
	if r.res == -1 {
		return errNoTestEntry
	}
	return check("cuMemcpyDtoD_v2", r)
}

// newStream makes a non-blocking stream on the device; streamSync waits
// for one; destroyStream frees it.
func (d *cudaRuntime) newStream() (Stream, error) {
	r := C.gx_stream_create(d.ctx)
	if err := check("cuStreamCreate", r); err != nil {
		return 0, err
	}
	return Stream(r.v[0]), nil
}

func (d *cudaRuntime) streamSync(s Stream) error {
	return check("cuStreamSynchronize", C.gx_test_stream_sync(d.ctx, C.uintptr_t(s)))
}

func (d *cudaRuntime) destroyStream(s Stream) error {
	return check("cuStreamDestroy", C.gx_stream_destroy(d.ctx, C.uintptr_t(s)))
}

// engineCounts reads the VMM device's driver-call counters.
func (d *VMM) engineCounts() (create, mapped, unmapped, released, access uint64) {
	c := &d.src.profile.calls
	return c[callCreate].n.Load(), c[callMap].n.Load(), c[callUnmap].n.Load(), c[callRelease].n.Load(),
		c[callSetAccess].n.Load()
}

// CaptureID is cuStreamGetCaptureInfo_v3 (or _v2 on a driver without it):
// the capture status of s and, while a capture is active, its unique id.
func (d *CUDA) CaptureID(s Stream) (status CaptureStatus, id uint64, err error) {
	if d.closed.Load() {
		return CaptureNone, 0, errCUDAClosed
	}
	r := C.gx_capture_info(d.ctx, C.uintptr_t(s))
	if r.res == -1 {
		return CaptureNone, 0, errors.New("arena: libcuda.so.1 has neither cuStreamGetCaptureInfo_v3 nor _v2")
	}
	if err := check("cuStreamGetCaptureInfo_v3", r); err != nil {
		return CaptureNone, 0, err
	}
	return CaptureStatus(r.v[0]), uint64(r.v[1]), nil
}

// ExchangeCaptureMode is cuThreadExchangeStreamCaptureMode: it sets the
// calling OS thread's stream-capture interaction mode (0 global, 1 thread
// local, 2 relaxed) and returns the previous one.
//
// The mode belongs to the OS thread, and a cgo call runs on whatever thread
// the calling goroutine's M is at that moment: between two calls a goroutine
// may move to another thread. So an exchange and its matching restore mean
// something only when both run on one locked thread: inside a C-to-Go
// callback (the exported my_malloc and friends, where the goroutine runs on
// PyTorch's calling thread until it returns), or in a goroutine that called
// runtime.LockOSThread.
func (d *CUDA) ExchangeCaptureMode(mode int) (int, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	r := C.gx_exchange_capture_mode(d.ctx, C.int(mode))
	if r.res == -1 {
		return 0, errors.New("arena: libcuda.so.1 has no cuThreadExchangeStreamCaptureMode")
	}
	if err := check("cuThreadExchangeStreamCaptureMode", r); err != nil {
		return 0, err
	}
	return int(r.v[0]), nil
}

// primaryContext is the device's primary context handle, for tests.
func (d *CUDA) primaryContext() uintptr { return uintptr(d.ctx) }

// currentContext is cuCtxGetCurrent on the calling OS thread, for tests; the
// caller must hold the thread (runtime.LockOSThread) for it to mean anything.
func currentContext() (uintptr, error) {
	if err := load(); err != nil {
		return 0, err
	}
	r := C.gx_current_context()
	if err := check("cuCtxGetCurrent", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

// setCurrentContext is cuCtxSetCurrent on the calling OS thread, for tests.
func setCurrentContext(ctx uintptr) error {
	if err := load(); err != nil {
		return err
	}
	if r := C.gx_set_current_context(C.uintptr_t(ctx)); r != 0 {
		return driverError("cuCtxSetCurrent", r)
	}
	return nil
}

// newTestContext creates a context on d's device that is not its primary
// context, pushed on the calling OS thread, for tests of the context
// save/restore; destroy it with destroyTestContext.
func (d *CUDA) newTestContext() (uintptr, error) {
	r := C.gx_test_ctx_create(d.dev)
	if r.res == -1 {
		return 0, errors.New("arena: libcuda.so.1 has no cuCtxCreate_v2/cuCtxDestroy_v2")
	}
	if err := check("cuCtxCreate_v2", r); err != nil {
		return 0, err
	}
	return uintptr(r.v[0]), nil
}

func destroyTestContext(ctx uintptr) error {
	if r := C.gx_test_ctx_destroy(C.uintptr_t(ctx)); r != 0 {
		return driverError("cuCtxDestroy_v2", r)
	}
	return nil
}
