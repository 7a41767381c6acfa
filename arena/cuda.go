//go:build linux && cgo

// The real device: the CUDA driver API reached through cgo (see the package
// doc in device.go for where this sits).
//
// Why dlopen: libcuda.so.1 is opened with dlopen at run time and every entry
// point is looked up with dlsym into a static C function pointer, so goalloc
// builds and links on machines with no CUDA toolkit and no driver, and only
// fails, with a clear error, when a CUDA device is actually asked for. No CUDA
// header is used: the few types and the one struct (CUmemPoolProps) are
// declared below as the CUDA 13 driver API (driver 580) defines them, with the
// symbol names the driver really exports (some versioned: cuMemGetInfo_v2,
// cuEventDestroy_v2, ...). Go never touches a C function
// pointer: each driver call has its own static inline C wrapper, and handles
// (context, pool, stream, event) cross the boundary as uintptr_t, so no
// uintptr is ever turned into an unsafe.Pointer on the Go side.
//
// Why the context dance: every driver call needs a current context on the
// calling OS thread, and PyTorch's autograd thread has none (a stream-ordered
// call there fails with 201 CUDA_ERROR_INVALID_CONTEXT, as seen with PyTorch
// 2.11 on an H200).
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
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmemoryPool;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUgraph;
typedef void *CUgraphNode;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;

typedef struct {
	int type;
	int id;
} CUmemLocation;

typedef struct {
	int allocType;
	int handleTypes;
	CUmemLocation location;
	void *win32SecurityAttributes;
	size_t maxSize;
	unsigned short usage;
	unsigned char reserved[54];
} CUmemPoolProps;

_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps must be 88 bytes, as in cuda.h");
_Static_assert(offsetof(CUmemPoolProps, location) == 8, "CUmemPoolProps.location offset");
_Static_assert(offsetof(CUmemPoolProps, win32SecurityAttributes) == 16, "CUmemPoolProps.win32SecurityAttributes offset");
_Static_assert(offsetof(CUmemPoolProps, maxSize) == 24, "CUmemPoolProps.maxSize offset");
_Static_assert(offsetof(CUmemPoolProps, usage) == 32, "CUmemPoolProps.usage offset");
_Static_assert(offsetof(CUmemPoolProps, reserved) == 34, "CUmemPoolProps.reserved offset");

enum {
	GX_MEM_ALLOCATION_TYPE_PINNED = 1,
	GX_MEM_LOCATION_TYPE_DEVICE = 1,
	GX_ATTR_RELEASE_THRESHOLD = 4,
	GX_ATTR_RESERVED_MEM_CURRENT = 5,
	GX_ATTR_RESERVED_MEM_HIGH = 6,
	GX_ATTR_USED_MEM_CURRENT = 7,
	GX_ATTR_USED_MEM_HIGH = 8,
};

// Which call a wrapper's failure came from. GX_MAIN is the wrapper's own
// driver call (the Go side knows its name); the others are named in Go's
// stageOps table.
enum {
	GX_MAIN = 0,
	GX_CTX_GET = 1,
	GX_CTX_SET = 2,
	GX_CTX_RESTORE = 3,
	GX_DEVICE_GET = 4,
	GX_PRIMARY_RETAIN = 5,
	GX_POOL_SET_ATTR = 6,
};

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetCount)(int *);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuCtxGetCurrent)(CUcontext *);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuMemPoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
static CUresult (*p_cuMemPoolDestroy)(CUmemoryPool);
static CUresult (*p_cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
static CUresult (*p_cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
static CUresult (*p_cuMemPoolTrimTo)(CUmemoryPool, size_t);
static CUresult (*p_cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
static CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
static CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventQuery)(CUevent);
static CUresult (*p_cuEventDestroy)(CUevent);
static CUresult (*p_cuStreamIsCapturing)(CUstream, int *);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*p_cuStreamDestroy)(CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
// Optional: looked up, but their absence only disables what uses them.
static CUresult (*p_cuStreamGetCaptureInfo_v3)(CUstream, int *, cuuint64_t *, CUgraph *,
	const CUgraphNode **, const CUgraphEdgeData **, size_t *);
static CUresult (*p_cuStreamGetCaptureInfo_v2)(CUstream, int *, cuuint64_t *, CUgraph *,
	const CUgraphNode **, size_t *);
static CUresult (*p_cuThreadExchangeStreamCaptureMode)(int *);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);
// Optional, for tests only: a second context on one device.
static CUresult (*p_cuCtxCreate)(CUcontext *, unsigned int, CUdevice);
static CUresult (*p_cuCtxDestroy)(CUcontext);

static char gx_loaderr[512];

// gx_load opens libcuda.so.1 and resolves every symbol. It returns 0 on
// success, 1 when the library cannot be opened and 2 when a required symbol
// is missing; gx_loaderr then says why. Called once, under Go's sync.Once.
static int gx_load(void) {
	struct { void **dst; const char *name; int required; } syms[] = {
		{ (void **)&p_cuInit, "cuInit", 1 },
		{ (void **)&p_cuDeviceGet, "cuDeviceGet", 1 },
		{ (void **)&p_cuDeviceGetCount, "cuDeviceGetCount", 1 },
		{ (void **)&p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1 },
		{ (void **)&p_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1 },
		{ (void **)&p_cuCtxGetCurrent, "cuCtxGetCurrent", 1 },
		{ (void **)&p_cuCtxSetCurrent, "cuCtxSetCurrent", 1 },
		{ (void **)&p_cuCtxSynchronize, "cuCtxSynchronize", 1 },
		{ (void **)&p_cuMemPoolCreate, "cuMemPoolCreate", 1 },
		{ (void **)&p_cuMemPoolDestroy, "cuMemPoolDestroy", 1 },
		{ (void **)&p_cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 1 },
		{ (void **)&p_cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 1 },
		{ (void **)&p_cuMemPoolTrimTo, "cuMemPoolTrimTo", 1 },
		{ (void **)&p_cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 1 },
		{ (void **)&p_cuMemFreeAsync, "cuMemFreeAsync", 1 },
		{ (void **)&p_cuMemGetInfo, "cuMemGetInfo_v2", 1 },
		{ (void **)&p_cuEventCreate, "cuEventCreate", 1 },
		{ (void **)&p_cuEventRecord, "cuEventRecord", 1 },
		{ (void **)&p_cuEventQuery, "cuEventQuery", 1 },
		{ (void **)&p_cuEventDestroy, "cuEventDestroy_v2", 1 },
		{ (void **)&p_cuStreamIsCapturing, "cuStreamIsCapturing", 1 },
		{ (void **)&p_cuStreamCreate, "cuStreamCreate", 1 },
		{ (void **)&p_cuStreamDestroy, "cuStreamDestroy_v2", 1 },
		{ (void **)&p_cuStreamSynchronize, "cuStreamSynchronize", 1 },
		{ (void **)&p_cuStreamGetCaptureInfo_v3, "cuStreamGetCaptureInfo_v3", 0 },
		{ (void **)&p_cuStreamGetCaptureInfo_v2, "cuStreamGetCaptureInfo_v2", 0 },
		{ (void **)&p_cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 0 },
		{ (void **)&p_cuGetErrorName, "cuGetErrorName", 0 },
		{ (void **)&p_cuCtxCreate, "cuCtxCreate_v2", 0 },
		{ (void **)&p_cuCtxDestroy, "cuCtxDestroy_v2", 0 },
	};
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		const char *e = dlerror();
		snprintf(gx_loaderr, sizeof gx_loaderr, "%s", e ? e : "dlopen failed");
		return 1;
	}
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		dlerror();
		void *p = dlsym(lib, syms[i].name);
		if (p == NULL && syms[i].required) {
			const char *e = dlerror();
			snprintf(gx_loaderr, sizeof gx_loaderr, "libcuda.so.1 has no symbol %s (driver too old?): %s",
				syms[i].name, e ? e : "not found");
			dlclose(lib);
			return 2;
		}
		*syms[i].dst = p;
	}
	return 0; // lib stays open for the life of the process
}

static const char *gx_loaderror(void) { return gx_loaderr; }

static inline CUresult gx_init(void) { return p_cuInit(0); }

// gx_error_name is the driver's name for r, or NULL.
static inline const char *gx_error_name(CUresult r) {
	const char *s = NULL;
	if (p_cuGetErrorName == NULL || p_cuGetErrorName(r, &s) != 0) {
		return NULL;
	}
	return s;
}

// The result of a wrapper: up to four values, the CUresult and which call
// it came from.
typedef struct {
	unsigned long long v[4];
	int res;
	int stage;
} gx_ret;

typedef struct {
	CUcontext prev;
	int restore;
} gx_saved;

// gx_enter makes ctx current on this OS thread for the call. If the thread had
// no context, ctx stays current afterwards; if it had another one, gx_leave
// puts that one back.
static inline int gx_enter(CUcontext ctx, gx_saved *sv, gx_ret *out) {
	CUcontext cur = NULL;
	CUresult r;
	sv->prev = NULL;
	sv->restore = 0;
	r = p_cuCtxGetCurrent(&cur);
	if (r != 0) {
		out->res = r;
		out->stage = GX_CTX_GET;
		return 0;
	}
	if (cur == ctx) {
		return 1;
	}
	r = p_cuCtxSetCurrent(ctx);
	if (r != 0) {
		out->res = r;
		out->stage = GX_CTX_SET;
		return 0;
	}
	sv->prev = cur;
	sv->restore = cur != NULL;
	return 1;
}

// gx_leave restores the caller's context if gx_enter replaced one. A failure
// to restore is reported only when the call itself succeeded.
static inline void gx_leave(gx_saved *sv, gx_ret *out) {
	if (!sv->restore) {
		return;
	}
	CUresult r = p_cuCtxSetCurrent(sv->prev);
	if (r != 0 && out->res == 0) {
		out->res = r;
		out->stage = GX_CTX_RESTORE;
	}
}

#define GX_BEGIN(ctx)                                   \
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };        \
	gx_saved sv;                                        \
	if (!gx_enter((CUcontext)(ctx), &sv, &out)) {       \
		return out;                                     \
	}

#define GX_END()          \
	gx_leave(&sv, &out);  \
	return out;

static inline gx_ret gx_device_count(void) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	int n = 0;
	out.res = p_cuDeviceGetCount(&n);
	out.v[0] = (unsigned long long)n;
	return out;
}

// gx_retain retains ordinal's primary context (v[0] = CUdevice, v[1] = the
// context) and makes it current if the thread has no context.
static inline gx_ret gx_retain(int ordinal) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	CUdevice dev = 0;
	CUcontext ctx = NULL, cur = NULL;
	CUresult r = p_cuDeviceGet(&dev, ordinal);
	if (r != 0) {
		out.res = r;
		out.stage = GX_DEVICE_GET;
		return out;
	}
	r = p_cuDevicePrimaryCtxRetain(&ctx, dev);
	if (r != 0) {
		out.res = r;
		out.stage = GX_PRIMARY_RETAIN;
		return out;
	}
	r = p_cuCtxGetCurrent(&cur);
	if (r != 0) {
		out.res = r;
		out.stage = GX_CTX_GET;
	} else if (cur == NULL && (r = p_cuCtxSetCurrent(ctx)) != 0) {
		out.res = r;
		out.stage = GX_CTX_SET;
	}
	if (out.res != 0) {
		p_cuDevicePrimaryCtxRelease(dev);
		return out;
	}
	out.v[0] = (unsigned long long)dev;
	out.v[1] = (unsigned long long)(uintptr_t)ctx;
	return out;
}

static inline CUresult gx_primary_release(int dev) {
	return p_cuDevicePrimaryCtxRelease((CUdevice)dev);
}

// gx_pool_create makes a private pinned pool on device ordinal and sets its
// release threshold; v[0] = the pool.
static inline gx_ret gx_pool_create(uintptr_t ctx, int ordinal, unsigned long long threshold) {
	GX_BEGIN(ctx)
	CUmemPoolProps props = { 0 };
	CUmemoryPool pool = NULL;
	props.allocType = GX_MEM_ALLOCATION_TYPE_PINNED;
	props.handleTypes = 0;
	props.location.type = GX_MEM_LOCATION_TYPE_DEVICE;
	props.location.id = ordinal;
	out.res = p_cuMemPoolCreate(&pool, &props);
	if (out.res == 0) {
		cuuint64_t t = threshold;
		CUresult r = p_cuMemPoolSetAttribute(pool, GX_ATTR_RELEASE_THRESHOLD, &t);
		if (r != 0) {
			p_cuMemPoolDestroy(pool);
			out.res = r;
			out.stage = GX_POOL_SET_ATTR;
		} else {
			out.v[0] = (unsigned long long)(uintptr_t)pool;
		}
	}
	gx_leave(&sv, &out);
	if (out.res != 0 && out.v[0] != 0) {
		// Restoring the caller's context failed: report that, without the pool.
		p_cuMemPoolDestroy(pool);
		out.v[0] = 0;
	}
	return out;
}

static inline gx_ret gx_pool_destroy(uintptr_t ctx, uintptr_t pool) {
	GX_BEGIN(ctx)
	out.res = p_cuMemPoolDestroy((CUmemoryPool)pool);
	GX_END()
}

static inline gx_ret gx_alloc(uintptr_t ctx, uintptr_t pool, size_t size, uintptr_t stream) {
	GX_BEGIN(ctx)
	CUdeviceptr p = 0;
	out.res = p_cuMemAllocFromPoolAsync(&p, size, (CUmemoryPool)pool, (CUstream)stream);
	if (out.res == 0) {
		out.v[0] = p;
	}
	gx_leave(&sv, &out);
	if (out.res != 0 && out.v[0] != 0) {
		// Restoring the caller's context failed after the allocation
		// succeeded: give the memory back rather than lose it. A failed
		// restore leaves ctx current, which is what this free needs.
		p_cuMemFreeAsync(p, (CUstream)stream);
		out.v[0] = 0;
	}
	return out;
}

// gx_alloc_uncaptured allocates for a stream being captured into a CUDA
// graph without adding a node to the graph: with this thread in relaxed
// capture mode, it allocates ordered on goalloc's own side stream, which is
// never captured, and waits for that stream, so the memory is ready for any
// stream. PyTorch's own allocator also switches to relaxed mode around its
// cudaMalloc during capture. Capture mode is per thread, hence one C call.
static inline gx_ret gx_alloc_uncaptured(uintptr_t ctx, uintptr_t pool, size_t size, uintptr_t side) {
	GX_BEGIN(ctx)
	int mode = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
	int have_mode = p_cuThreadExchangeStreamCaptureMode != NULL &&
		p_cuThreadExchangeStreamCaptureMode(&mode) == 0;
	CUdeviceptr p = 0;
	out.res = p_cuMemAllocFromPoolAsync(&p, size, (CUmemoryPool)pool, (CUstream)side);
	if (out.res == 0) {
		out.res = p_cuStreamSynchronize((CUstream)side);
		if (out.res == 0) {
			out.v[0] = p;
		} else {
			p_cuMemFreeAsync(p, (CUstream)side);
		}
	}
	if (have_mode) {
		p_cuThreadExchangeStreamCaptureMode(&mode);
	}
	GX_END()
}

static inline gx_ret gx_stream_create(uintptr_t ctx) {
	GX_BEGIN(ctx)
	CUstream s = NULL;
	out.res = p_cuStreamCreate(&s, 1); // CU_STREAM_NON_BLOCKING
	out.v[0] = (unsigned long long)(uintptr_t)s;
	GX_END()
}

static inline gx_ret gx_stream_destroy(uintptr_t ctx, uintptr_t s) {
	GX_BEGIN(ctx)
	out.res = p_cuStreamDestroy((CUstream)s);
	GX_END()
}

static inline gx_ret gx_free(uintptr_t ctx, unsigned long long ptr, uintptr_t stream) {
	GX_BEGIN(ctx)
	out.res = p_cuMemFreeAsync((CUdeviceptr)ptr, (CUstream)stream);
	GX_END()
}

static inline gx_ret gx_trim(uintptr_t ctx, uintptr_t pool, size_t keep) {
	GX_BEGIN(ctx)
	out.res = p_cuMemPoolTrimTo((CUmemoryPool)pool, keep);
	GX_END()
}

static inline gx_ret gx_pool_set_u64(uintptr_t ctx, uintptr_t pool, int attr, unsigned long long value) {
	GX_BEGIN(ctx)
	cuuint64_t v = value;
	out.res = p_cuMemPoolSetAttribute((CUmemoryPool)pool, attr, &v);
	GX_END()
}

// gx_reset_high sets both high-water marks to 0, which resets them to the
// current values.
static inline gx_ret gx_reset_high(uintptr_t ctx, uintptr_t pool) {
	GX_BEGIN(ctx)
	cuuint64_t zero = 0;
	out.res = p_cuMemPoolSetAttribute((CUmemoryPool)pool, GX_ATTR_RESERVED_MEM_HIGH, &zero);
	if (out.res == 0) {
		zero = 0;
		out.res = p_cuMemPoolSetAttribute((CUmemoryPool)pool, GX_ATTR_USED_MEM_HIGH, &zero);
	}
	GX_END()
}

// gx_pool_usage reads attributes 5..8 into v[0..3].
static inline gx_ret gx_pool_usage(uintptr_t ctx, uintptr_t pool) {
	GX_BEGIN(ctx)
	for (int i = 0; i < 4 && out.res == 0; i++) {
		cuuint64_t v = 0;
		out.res = p_cuMemPoolGetAttribute((CUmemoryPool)pool, GX_ATTR_RESERVED_MEM_CURRENT + i, &v);
		out.v[i] = v;
	}
	GX_END()
}

static inline gx_ret gx_mem_info(uintptr_t ctx) {
	GX_BEGIN(ctx)
	size_t free = 0, total = 0;
	out.res = p_cuMemGetInfo(&free, &total);
	out.v[0] = free;
	out.v[1] = total;
	GX_END()
}

static inline gx_ret gx_event_create(uintptr_t ctx, unsigned int flags) {
	GX_BEGIN(ctx)
	CUevent ev = NULL;
	out.res = p_cuEventCreate(&ev, flags);
	out.v[0] = (unsigned long long)(uintptr_t)ev;
	gx_leave(&sv, &out);
	if (out.res != 0 && ev != NULL) {
		// Restoring the caller's context failed: do not leak the event.
		p_cuEventDestroy(ev);
		out.v[0] = 0;
	}
	return out;
}

static inline gx_ret gx_event_record(uintptr_t ctx, uintptr_t ev, uintptr_t stream) {
	GX_BEGIN(ctx)
	out.res = p_cuEventRecord((CUevent)ev, (CUstream)stream);
	GX_END()
}

static inline gx_ret gx_event_query(uintptr_t ctx, uintptr_t ev) {
	GX_BEGIN(ctx)
	out.res = p_cuEventQuery((CUevent)ev);
	GX_END()
}

static inline gx_ret gx_event_destroy(uintptr_t ctx, uintptr_t ev) {
	GX_BEGIN(ctx)
	out.res = p_cuEventDestroy((CUevent)ev);
	GX_END()
}

static inline gx_ret gx_ctx_synchronize(uintptr_t ctx) {
	GX_BEGIN(ctx)
	out.res = p_cuCtxSynchronize();
	GX_END()
}

static inline gx_ret gx_is_capturing(uintptr_t ctx, uintptr_t stream) {
	GX_BEGIN(ctx)
	int status = 0;
	out.res = p_cuStreamIsCapturing((CUstream)stream, &status);
	out.v[0] = (unsigned long long)status;
	GX_END()
}

// gx_capture_info: v[0] = capture status, v[1] = capture id. res is -1 when
// the driver has neither cuStreamGetCaptureInfo_v3 nor _v2.
static inline gx_ret gx_capture_info(uintptr_t ctx, uintptr_t stream) {
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

// For tests: the calling thread's current context, and setting it.
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

// For tests: a new, non-primary context on dev, pushed on this thread (v[0]),
// and destroying it. res is -1 when the driver lacks the legacy entry points.
static inline gx_ret gx_test_ctx_create(int dev) {
	gx_ret out = { { 0, 0, 0, 0 }, -1, GX_MAIN };
	CUcontext c = NULL;
	if (p_cuCtxCreate == NULL || p_cuCtxDestroy == NULL) {
		return out;
	}
	out.res = p_cuCtxCreate(&c, 0, (CUdevice)dev);
	out.v[0] = (unsigned long long)(uintptr_t)c;
	return out;
}

static inline CUresult gx_test_ctx_destroy(uintptr_t ctx) {
	return p_cuCtxDestroy((CUcontext)ctx);
}
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
	C.GX_CTX_GET:        "cuCtxGetCurrent",
	C.GX_CTX_SET:        "cuCtxSetCurrent",
	C.GX_CTX_RESTORE:    "cuCtxSetCurrent",
	C.GX_DEVICE_GET:     "cuDeviceGet",
	C.GX_PRIMARY_RETAIN: "cuDevicePrimaryCtxRetain",
	C.GX_POOL_SET_ATTR:  "cuMemPoolSetAttribute",
	C.GX_MAIN:           "",
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

// CUDA is one GPU, with memory from a private stream-ordered pool. Create it
// with NewCUDA; it is safe for concurrent use. It must not be used after
// Close.
type CUDA struct {
	ordinal int
	dev     C.int       // CUdevice
	ctx     C.uintptr_t // the device's primary CUcontext, retained
	pool    C.uintptr_t // CUmemoryPool
	// side is a non-blocking stream of goalloc's own, never captured, on
	// which AllocUncaptured allocates.
	side   C.uintptr_t
	closed atomic.Bool
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
	n, err := CUDADeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("arena: no CUDA device %d (the driver sees %d)", ordinal, n)
	}
	r := C.gx_retain(C.int(ordinal))
	if err := check("cuDevicePrimaryCtxRetain", r); err != nil {
		return nil, err
	}
	d := &CUDA{ordinal: ordinal, dev: C.int(r.v[0]), ctx: C.uintptr_t(r.v[1])}
	r = C.gx_pool_create(d.ctx, C.int(ordinal), C.ulonglong(releaseThreshold))
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
	return d, nil
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

// Ordinal is the device index.
func (d *CUDA) Ordinal() int { return d.ordinal }

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
func (d *CUDA) MemInfo() (free, total uint64, err error) {
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
func (d *CUDA) NewEvent() (Event, error) {
	if d.closed.Load() {
		return 0, errCUDAClosed
	}
	r := C.gx_event_create(d.ctx, cuEventDisableTiming)
	if err := check("cuEventCreate", r); err != nil {
		return 0, err
	}
	return Event(r.v[0]), nil
}

// RecordEvent is cuEventRecord.
func (d *CUDA) RecordEvent(e Event, s Stream) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuEventRecord", C.gx_event_record(d.ctx, C.uintptr_t(e), C.uintptr_t(s)))
}

// EventDone is cuEventQuery: true when e has completed, false while
// CUDA_ERROR_NOT_READY.
func (d *CUDA) EventDone(e Event) (bool, error) {
	if d.closed.Load() {
		return false, errCUDAClosed
	}
	r := C.gx_event_query(d.ctx, C.uintptr_t(e))
	if r.res == cudaErrorNotReady && r.stage == C.GX_MAIN {
		return false, nil
	}
	if err := check("cuEventQuery", r); err != nil {
		return false, err
	}
	return true, nil
}

// DestroyEvent is cuEventDestroy_v2.
func (d *CUDA) DestroyEvent(e Event) error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuEventDestroy_v2", C.gx_event_destroy(d.ctx, C.uintptr_t(e)))
}

// Synchronize is cuCtxSynchronize on the device's primary context.
func (d *CUDA) Synchronize() error {
	if d.closed.Load() {
		return errCUDAClosed
	}
	return check("cuCtxSynchronize", C.gx_ctx_synchronize(d.ctx))
}

// CaptureStatus is cuStreamIsCapturing.
func (d *CUDA) CaptureStatus(s Stream) (CaptureStatus, error) {
	if d.closed.Load() {
		return CaptureNone, errCUDAClosed
	}
	r := C.gx_is_capturing(d.ctx, C.uintptr_t(s))
	if err := check("cuStreamIsCapturing", r); err != nil {
		return CaptureNone, err
	}
	return CaptureStatus(r.v[0]), nil
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

// Close destroys the pool (memory still allocated from it is lost) and
// releases the primary context. Later calls to Close do nothing; other
// methods then return an error.
func (d *CUDA) Close() error {
	if !d.closed.CompareAndSwap(false, true) {
		return nil
	}
	err := check("cuStreamDestroy", C.gx_stream_destroy(d.ctx, d.side))
	err = errors.Join(err, check("cuMemPoolDestroy", C.gx_pool_destroy(d.ctx, d.pool)))
	if r := C.gx_primary_release(d.dev); r != 0 {
		err = errors.Join(err, driverError("cuDevicePrimaryCtxRelease_v2", r))
	}
	return err
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
