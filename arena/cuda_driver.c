//go:build linux && cgo

// The driver's entry points, resolved once with dlopen/dlsym: see
// cuda_driver.h for what they are and cuda.go for why dlopen.

#include <dlfcn.h>
#include <stdio.h>

#include "cuda_driver.h"

CUresult (*p_cuInit)(unsigned int);
CUresult (*p_cuDeviceGet)(CUdevice *, int);
CUresult (*p_cuDeviceGetCount)(int *);
CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
CUresult (*p_cuCtxGetCurrent)(CUcontext *);
CUresult (*p_cuCtxSetCurrent)(CUcontext);
CUresult (*p_cuCtxSynchronize)(void);
CUresult (*p_cuMemPoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
CUresult (*p_cuMemPoolDestroy)(CUmemoryPool);
CUresult (*p_cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
CUresult (*p_cuMemPoolGetAttribute)(CUmemoryPool, int, void *);
CUresult (*p_cuMemPoolTrimTo)(CUmemoryPool, size_t);
CUresult (*p_cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult (*p_cuMemFreeAsync)(CUdeviceptr, CUstream);
CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
CUresult (*p_cuEventRecord)(CUevent, CUstream);
CUresult (*p_cuEventQuery)(CUevent);
CUresult (*p_cuEventDestroy)(CUevent);
CUresult (*p_cuStreamIsCapturing)(CUstream, int *);
CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
CUresult (*p_cuStreamDestroy)(CUstream);
CUresult (*p_cuStreamSynchronize)(CUstream);
// Optional: looked up, but their absence only disables what uses them.
CUresult (*p_cuThreadExchangeStreamCaptureMode)(int *);
CUresult (*p_cuGetErrorName)(CUresult, const char **);
// Optional: without them no pool is opened to peer devices, and an event is
// always recorded in its own device's context.
CUresult (*p_cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
CUresult (*p_cuMemPoolSetAccess)(CUmemoryPool, const CUmemAccessDesc *, size_t);
CUresult (*p_cuMemPoolGetAccess)(int *, CUmemoryPool, CUmemLocation *);
CUresult (*p_cuStreamGetCtx)(CUstream, CUcontext *);
// Optional: without them there is no VMM device.
CUresult (*p_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
CUresult (*p_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);
CUresult (*p_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult (*p_cuMemAddressFree)(CUdeviceptr, size_t);
CUresult (*p_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult (*p_cuMemUnmap)(CUdeviceptr, size_t);
CUresult (*p_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
// Optional: without them a VMM device cannot sleep (gx_sleep_available).
CUresult (*p_cuMemHostAlloc)(void **, size_t, unsigned int);
CUresult (*p_cuMemFreeHost)(void *);
CUresult (*p_cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
CUresult (*p_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
CUresult (*p_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
CUresult (*p_cuEventSynchronize)(CUevent);
// Optional: without them a VMM device shares nothing (gx_ipc_available).
CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
CUresult (*p_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult (*p_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
CUresult (*p_cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);

static char gx_loaderr[512];
static void *gx_lib;

// gx_load opens libcuda.so.1 and resolves every symbol. It returns 0 on
// success, 1 when the library cannot be opened and 2 when a required symbol
// is missing; gx_loaderr then says why. Called once, under Go's sync.Once.
int gx_load(void) {
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
		{ (void **)&p_cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 0 },
		{ (void **)&p_cuGetErrorName, "cuGetErrorName", 0 },
		{ (void **)&p_cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", 0 },
		{ (void **)&p_cuMemPoolSetAccess, "cuMemPoolSetAccess", 0 },
		{ (void **)&p_cuMemPoolGetAccess, "cuMemPoolGetAccess", 0 },
		{ (void **)&p_cuStreamGetCtx, "cuStreamGetCtx", 0 },
		{ (void **)&p_cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0 },
		{ (void **)&p_cuMemCreate, "cuMemCreate", 0 },
		{ (void **)&p_cuMemRelease, "cuMemRelease", 0 },
		{ (void **)&p_cuMemAddressReserve, "cuMemAddressReserve", 0 },
		{ (void **)&p_cuMemAddressFree, "cuMemAddressFree", 0 },
		{ (void **)&p_cuMemMap, "cuMemMap", 0 },
		{ (void **)&p_cuMemUnmap, "cuMemUnmap", 0 },
		{ (void **)&p_cuMemSetAccess, "cuMemSetAccess", 0 },
		{ (void **)&p_cuMemHostAlloc, "cuMemHostAlloc", 0 },
		{ (void **)&p_cuMemFreeHost, "cuMemFreeHost", 0 },
		{ (void **)&p_cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", 0 },
		{ (void **)&p_cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", 0 },
		{ (void **)&p_cuStreamWaitEvent, "cuStreamWaitEvent", 0 },
		{ (void **)&p_cuEventSynchronize, "cuEventSynchronize", 0 },
		{ (void **)&p_cuDeviceGetAttribute, "cuDeviceGetAttribute", 0 },
		{ (void **)&p_cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 0 },
		{ (void **)&p_cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 0 },
		{ (void **)&p_cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle", 0 },
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
	gx_lib = lib; // stays open for the life of the process
	return 0;
}

const char *gx_loaderror(void) { return gx_loaderr; }

void *gx_sym(const char *name) { return gx_lib == NULL ? NULL : dlsym(gx_lib, name); }
