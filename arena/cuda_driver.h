// The CUDA driver as goalloc's arena sees it: the few driver types, structs
// and enum values it uses (declared here, with static asserts on their
// layout, so no CUDA header is needed to build), the driver's entry points as
// function pointers resolved by gx_load (cuda_driver.c), and one small static
// inline wrapper per operation. Each wrapper makes the device's context
// current for its driver call in the same C call (see "the context dance" in
// cuda.go) and returns a gx_ret: the CUresult, which call it came from, and
// up to four values.
//
// Versioned symbol names (cuMemGetInfo_v2, cuEventDestroy_v2, ...) are the
// names the CUDA 13 driver (580) exports; the header's unversioned macros map
// to them.

#ifndef GOALLOC_CUDA_DRIVER_H
#define GOALLOC_CUDA_DRIVER_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
	GX_CAN_ACCESS_PEER = 7,
	GX_POOL_SET_ACCESS = 8,
	GX_STREAM_GET_CTX = 9,
};

// CU_MEM_ACCESS_FLAGS_PROT_READWRITE, for CUmemAccessDesc.flags.
enum { GX_MEM_ACCESS_READWRITE = 3 };

typedef struct {
	CUmemLocation location;
	int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc must be 12 bytes, as in cuda.h");
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation must be 8 bytes, as in cuda.h");

// Virtual memory management (the VMM device, vmm_cuda.go).
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
	int type;                 // CU_MEM_ALLOCATION_TYPE_PINNED = 1
	int requestedHandleTypes; // 0: none (no sharing with other processes)
	CUmemLocation location;   // { CU_MEM_LOCATION_TYPE_DEVICE, ordinal }
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp must be 32 bytes, as in cuda.h");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location offset");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp.win32HandleMetaData offset");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp.allocFlags offset");

extern CUresult (*p_cuInit)(unsigned int);
extern CUresult (*p_cuDeviceGet)(CUdevice *, int);
extern CUresult (*p_cuDeviceGetCount)(int *);
extern CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
extern CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
extern CUresult (*p_cuCtxGetCurrent)(CUcontext *);
extern CUresult (*p_cuCtxSetCurrent)(CUcontext);
extern CUresult (*p_cuCtxSynchronize)(void);
extern CUresult (*p_cuMemPoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
extern CUresult (*p_cuMemPoolDestroy)(CUmemoryPool);
extern CUresult (*p_cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
extern CUresult (*p_cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
extern CUresult (*p_cuMemPoolTrimTo)(CUmemoryPool, size_t);
extern CUresult (*p_cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
extern CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
extern CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
extern CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
extern CUresult (*p_cuEventRecord)(CUevent, CUstream);
extern CUresult (*p_cuEventQuery)(CUevent);
extern CUresult (*p_cuEventDestroy)(CUevent);
extern CUresult (*p_cuStreamIsCapturing)(CUstream, int *);
extern CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
extern CUresult (*p_cuStreamDestroy)(CUstream);
extern CUresult (*p_cuStreamSynchronize)(CUstream);
// Optional: looked up, but their absence only disables what uses them.
extern CUresult (*p_cuThreadExchangeStreamCaptureMode)(int *);
extern CUresult (*p_cuGetErrorName)(CUresult, const char **);
// Optional: without them no pool is opened to peer devices, and an event is
// always recorded in its own device's context.
extern CUresult (*p_cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
extern CUresult (*p_cuMemPoolSetAccess)(CUmemoryPool, const CUmemAccessDesc *, size_t);
extern CUresult (*p_cuMemPoolGetAccess)(int *, CUmemoryPool, CUmemLocation *);
extern CUresult (*p_cuStreamGetCtx)(CUstream, CUcontext *);
// Optional: without them there is no VMM device (gx_vmm_available says so).
extern CUresult (*p_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
extern CUresult (*p_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
extern CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);
extern CUresult (*p_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
extern CUresult (*p_cuMemAddressFree)(CUdeviceptr, size_t);
extern CUresult (*p_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
extern CUresult (*p_cuMemUnmap)(CUdeviceptr, size_t);
extern CUresult (*p_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
// Optional: without them a VMM device cannot sleep (gx_sleep_available says so).
extern CUresult (*p_cuMemHostAlloc)(void **, size_t, unsigned int);
extern CUresult (*p_cuMemFreeHost)(void *);
extern CUresult (*p_cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
extern CUresult (*p_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
extern CUresult (*p_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
extern CUresult (*p_cuEventSynchronize)(CUevent);

// gx_load opens libcuda.so.1 and resolves every symbol. It returns 0 on
// success, 1 when the library cannot be opened and 2 when a required symbol
// is missing; gx_loaderror then says why. Called once, under Go's sync.Once.
int gx_load(void);
const char *gx_loaderror(void);
// gx_sym looks up an optional symbol of the opened driver (NULL if absent or
// not loaded), for entry points only tests use.
void *gx_sym(const char *name);

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

// gx_peers_of: bit i set for each device i (below count, other than
// ordinal) that can access ordinal's memory (cuDeviceCanAccessPeer). A
// failed call sets out's res and stage and ends the scan.
static inline unsigned long long gx_peers_of(int ordinal, int count, gx_ret *out) {
	unsigned long long mask = 0;
	for (int peer = 0; peer < count && peer < 64; peer++) {
		int can = 0;
		CUdevice self = 0, other = 0;
		if (peer == ordinal) {
			continue;
		}
		if ((out->res = p_cuDeviceGet(&self, ordinal)) != 0 || (out->res = p_cuDeviceGet(&other, peer)) != 0) {
			out->stage = GX_DEVICE_GET;
			break;
		}
		if ((out->res = p_cuDeviceCanAccessPeer(&can, other, self)) != 0) {
			out->stage = GX_CAN_ACCESS_PEER;
			break;
		}
		if (can) {
			mask |= 1ull << peer;
		}
	}
	return mask;
}

// gx_pool_open_to_peers gives every other device that can access this
// device's memory read-write access to the pool (cuMemPoolSetAccess). Memory
// of a private pool is reachable from its own device only until then, even
// where peer access between the contexts is enabled: a peer copy from it, or
// a kernel on a peer reading it, fails with "invalid argument". Access is per
// device, not per context, so it can be granted before the peer has a
// context or a pool of its own. v[0] = bit i set when device i was granted.
// res = -1 when the driver lacks the entry points (nothing granted).
static inline gx_ret gx_pool_open_to_peers(uintptr_t ctx, uintptr_t pool, int ordinal, int count) {
	if (p_cuDeviceCanAccessPeer == NULL || p_cuMemPoolSetAccess == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	unsigned long long peers = gx_peers_of(ordinal, count, &out);
	for (int peer = 0; peer < 64 && out.res == 0; peer++) {
		if (!(peers & (1ull << peer))) {
			continue;
		}
		CUmemAccessDesc desc = { { GX_MEM_LOCATION_TYPE_DEVICE, peer }, GX_MEM_ACCESS_READWRITE };
		if ((out.res = p_cuMemPoolSetAccess((CUmemoryPool)pool, &desc, 1)) != 0) {
			out.stage = GX_POOL_SET_ACCESS;
			break;
		}
		out.v[0] |= 1ull << peer;
	}
	GX_END()
}

// gx_pool_access: v[0] = the CUmemAccess_flags device peer has on the pool
// (0 none, 3 read-write). res = -1 when the driver lacks cuMemPoolGetAccess.
static inline gx_ret gx_pool_access(uintptr_t ctx, uintptr_t pool, int peer) {
	if (p_cuMemPoolGetAccess == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, -1, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	int flags = 0;
	CUmemLocation loc = { GX_MEM_LOCATION_TYPE_DEVICE, peer };
	out.res = p_cuMemPoolGetAccess(&flags, (CUmemoryPool)pool, &loc);
	out.v[0] = (unsigned long long)flags;
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

// gx_free_uncaptured gives back an allocation of gx_alloc_uncaptured at
// once: in relaxed capture mode, as that call allocates, it frees on the
// side stream and waits for that stream, so that the pool may release the
// memory (a trim cannot release a free whose completion it has not seen).
static inline gx_ret gx_free_uncaptured(uintptr_t ctx, unsigned long long ptr, uintptr_t side) {
	GX_BEGIN(ctx)
	int mode = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
	int have_mode = p_cuThreadExchangeStreamCaptureMode != NULL &&
		p_cuThreadExchangeStreamCaptureMode(&mode) == 0;
	out.res = p_cuMemFreeAsync((CUdeviceptr)ptr, (CUstream)side);
	if (out.res == 0) {
		out.res = p_cuStreamSynchronize((CUstream)side);
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

// gx_event_record records ev, an event made in ctx, on stream. An event can
// be recorded only on a stream of its own context, and Tensor.record_stream
// may name a stream of another device; so the stream's context is looked up
// first, and when it is not ctx nothing is recorded: v[0] = 1 and v[1] = the
// stream's context, for the caller to record an event made there. The null
// and per-thread stream handles (0, 1, 2) carry no device: they are taken as
// ctx's own, as every other wrapper takes them.
static inline gx_ret gx_event_record(uintptr_t ctx, uintptr_t ev, uintptr_t stream) {
	if (stream > 2 && p_cuStreamGetCtx != NULL) {
		CUcontext sctx = NULL;
		CUresult r = p_cuStreamGetCtx((CUstream)stream, &sctx);
		if (r != 0) {
			gx_ret bad = { { 0, 0, 0, 0 }, r, GX_STREAM_GET_CTX };
			return bad;
		}
		if (sctx != (CUcontext)ctx) {
			gx_ret other = { { 1, (unsigned long long)(uintptr_t)sctx, 0, 0 }, 0, GX_MAIN };
			return other;
		}
	}
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

// ---- Virtual memory management ----

// The VMM calls are not stream-ordered, but a thread in the global capture
// mode may be refused calls the driver deems unsafe during a capture: each
// wrapper below runs its call in the relaxed mode and puts the thread's
// mode back, in the same C call (the mode belongs to the OS thread), as
// gx_alloc_uncaptured does and as PyTorch's allocator does around cudaMalloc.
#define GX_RELAXED_BEGIN                                               \
	int gx_mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */              \
	int gx_have_mode = p_cuThreadExchangeStreamCaptureMode != NULL &&  \
		p_cuThreadExchangeStreamCaptureMode(&gx_mode) == 0;
#define GX_RELAXED_END                                                 \
	if (gx_have_mode) {                                                \
		p_cuThreadExchangeStreamCaptureMode(&gx_mode);                 \
	}

// gx_vmm_available is 1 when the driver has every VMM entry point.
static inline int gx_vmm_available(void) {
	return p_cuMemGetAllocationGranularity != NULL && p_cuMemCreate != NULL && p_cuMemRelease != NULL &&
		p_cuMemAddressReserve != NULL && p_cuMemAddressFree != NULL && p_cuMemMap != NULL &&
		p_cuMemUnmap != NULL && p_cuMemSetAccess != NULL;
}

static inline CUmemAllocationProp gx_vmm_prop(int ordinal) {
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	prop.type = GX_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = GX_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = ordinal;
	return prop;
}

// gx_vmm_granularity: v[0] = the recommended allocation granularity of
// pinned memory on device ordinal.
static inline gx_ret gx_vmm_granularity(uintptr_t ctx, int ordinal) {
	GX_BEGIN(ctx)
	CUmemAllocationProp prop = gx_vmm_prop(ordinal);
	size_t g = 0;
	out.res = p_cuMemGetAllocationGranularity(&g, &prop, 1); // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
	out.v[0] = g;
	GX_END()
}

// gx_vmm_peers: v[0] = bit i set for each device i other than ordinal that
// can access ordinal's memory (cuDeviceCanAccessPeer); 0 when the driver
// cannot say.
static inline gx_ret gx_vmm_peers(uintptr_t ctx, int ordinal, int count) {
	if (p_cuDeviceCanAccessPeer == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, 0, GX_MAIN };
		return none;
	}
	GX_BEGIN(ctx)
	out.v[0] = gx_peers_of(ordinal, count, &out);
	GX_END()
}

// gx_vmm_reserve: v[0] = the base of size bytes of reserved virtual
// addresses, aligned to align.
static inline gx_ret gx_vmm_reserve(uintptr_t ctx, size_t size, size_t align) {
	GX_BEGIN(ctx)
	CUdeviceptr p = 0;
	GX_RELAXED_BEGIN
	out.res = p_cuMemAddressReserve(&p, size, align, 0, 0);
	GX_RELAXED_END
	out.v[0] = p;
	GX_END()
}

static inline gx_ret gx_vmm_address_free(uintptr_t ctx, unsigned long long ptr, size_t size) {
	GX_BEGIN(ctx)
	GX_RELAXED_BEGIN
	out.res = p_cuMemAddressFree((CUdeviceptr)ptr, size);
	GX_RELAXED_END
	GX_END()
}

// gx_vmm_create: v[0] = a handle to size bytes of pinned memory on ordinal,
// exportable as the handle types named (CUmemAllocationHandleType bits; 0:
// none, see cuda_ipc.h).
static inline gx_ret gx_vmm_create(uintptr_t ctx, int ordinal, size_t size, int handle_types) {
	GX_BEGIN(ctx)
	CUmemAllocationProp prop = gx_vmm_prop(ordinal);
	prop.requestedHandleTypes = handle_types;
	CUmemGenericAllocationHandle h = 0;
	GX_RELAXED_BEGIN
	out.res = p_cuMemCreate(&h, size, &prop, 0);
	GX_RELAXED_END
	out.v[0] = h;
	GX_END()
}

static inline gx_ret gx_vmm_release(uintptr_t ctx, unsigned long long h) {
	GX_BEGIN(ctx)
	GX_RELAXED_BEGIN
	out.res = p_cuMemRelease((CUmemGenericAllocationHandle)h);
	GX_RELAXED_END
	GX_END()
}

// gx_vmm_map maps all of handle h (size bytes; offset 0) at va.
static inline gx_ret gx_vmm_map(uintptr_t ctx, unsigned long long va, size_t size, unsigned long long h) {
	GX_BEGIN(ctx)
	GX_RELAXED_BEGIN
	out.res = p_cuMemMap((CUdeviceptr)va, size, 0, (CUmemGenericAllocationHandle)h, 0);
	GX_RELAXED_END
	GX_END()
}

static inline gx_ret gx_vmm_unmap(uintptr_t ctx, unsigned long long va, size_t size) {
	GX_BEGIN(ctx)
	GX_RELAXED_BEGIN
	out.res = p_cuMemUnmap((CUdeviceptr)va, size);
	GX_RELAXED_END
	GX_END()
}

// gx_vmm_set_access grants read-write access to [va, va+size) to device
// ordinal and to every device whose bit is set in peers, in one call.
static inline gx_ret gx_vmm_set_access(uintptr_t ctx, unsigned long long va, size_t size, int ordinal,
	unsigned long long peers) {
	GX_BEGIN(ctx)
	CUmemAccessDesc desc[65];
	size_t n = 0;
	desc[n].location.type = GX_MEM_LOCATION_TYPE_DEVICE;
	desc[n].location.id = ordinal;
	desc[n].flags = GX_MEM_ACCESS_READWRITE;
	n++;
	for (int i = 0; i < 64; i++) {
		if (peers & (1ull << i)) {
			desc[n].location.type = GX_MEM_LOCATION_TYPE_DEVICE;
			desc[n].location.id = i;
			desc[n].flags = GX_MEM_ACCESS_READWRITE;
			n++;
		}
	}
	GX_RELAXED_BEGIN
	out.res = p_cuMemSetAccess((CUdeviceptr)va, size, desc, n);
	GX_RELAXED_END
	GX_END()
}

// ---- Sleep and wake (vmm_sleep.go): pinned host memory, copies ----

// gx_sleep_available is 1 when the driver has every entry point sleep and
// wake use.
static inline int gx_sleep_available(void) {
	return p_cuMemHostAlloc != NULL && p_cuMemFreeHost != NULL && p_cuMemcpyDtoHAsync != NULL &&
		p_cuMemcpyHtoDAsync != NULL && p_cuStreamWaitEvent != NULL && p_cuEventSynchronize != NULL;
}

// gx_host_alloc: v[0] = size bytes of page-locked host memory, pinned for
// every context (CU_MEMHOSTALLOC_PORTABLE), so that any device's copies
// reach it at full speed.
static inline gx_ret gx_host_alloc(uintptr_t ctx, size_t size) {
	GX_BEGIN(ctx)
	void *p = NULL;
	out.res = p_cuMemHostAlloc(&p, size, 1); // CU_MEMHOSTALLOC_PORTABLE
	out.v[0] = (unsigned long long)(uintptr_t)p;
	gx_leave(&sv, &out);
	if (out.res != 0 && p != NULL) {
		// Restoring the caller's context failed: do not leak the memory.
		p_cuMemFreeHost(p);
		out.v[0] = 0;
	}
	return out;
}

static inline gx_ret gx_host_free(uintptr_t ctx, uintptr_t p) {
	GX_BEGIN(ctx)
	out.res = p_cuMemFreeHost((void *)p);
	GX_END()
}

// gx_stream_wait_event makes stream wait for ev (made in ectx, which may be
// another device's context: a stream may wait for any context's event).
static inline gx_ret gx_stream_wait_event(uintptr_t ctx, uintptr_t stream, uintptr_t ev) {
	if (p_cuStreamWaitEvent == NULL) {
		gx_ret none = { { 0, 0, 0, 0 }, 801, GX_MAIN }; // CUDA_ERROR_NOT_SUPPORTED: a driver without it
		return none;
	}
	GX_BEGIN(ctx)
	out.res = p_cuStreamWaitEvent((CUstream)stream, (CUevent)ev, 0);
	GX_END()
}

// gx_copy_dtoh queues a copy of size bytes from device address va to host
// memory host (page-locked) on stream.
static inline gx_ret gx_copy_dtoh(uintptr_t ctx, uintptr_t host, unsigned long long va, size_t size, uintptr_t stream) {
	GX_BEGIN(ctx)
	out.res = p_cuMemcpyDtoHAsync((void *)host, (CUdeviceptr)va, size, (CUstream)stream);
	GX_END()
}

// gx_copy_htod queues a copy of size bytes from host memory host
// (page-locked) to device address va on stream.
static inline gx_ret gx_copy_htod(uintptr_t ctx, unsigned long long va, uintptr_t host, size_t size, uintptr_t stream) {
	GX_BEGIN(ctx)
	out.res = p_cuMemcpyHtoDAsync((CUdeviceptr)va, (const void *)host, size, (CUstream)stream);
	GX_END()
}

// gx_event_synchronize waits until ev, made in ctx, has completed.
static inline gx_ret gx_event_synchronize(uintptr_t ctx, uintptr_t ev) {
	GX_BEGIN(ctx)
	out.res = p_cuEventSynchronize((CUevent)ev);
	GX_END()
}

#endif
