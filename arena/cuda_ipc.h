// CUDA IPC's driver and system calls for the VMM device (vmm_cuda_ipc.go):
// exporting a physical handle as a POSIX file descriptor, and importing
// another process's descriptor through pidfd_open and pidfd_getfd, as
// PyTorch's expandable segments do. See vmm_ipc.go, Note [CUDA IPC].

#ifndef GOALLOC_CUDA_IPC_H
#define GOALLOC_CUDA_IPC_H
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cuda_driver.h"

// Build setups older than the syscalls (2020) still run on kernels that
// have them.
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, and the device attribute that
// says a device can export it (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_
// DESCRIPTOR_SUPPORTED), as cuda.h of CUDA 13 has them.
enum { GX_HANDLE_TYPE_POSIX_FD = 1, GX_ATTR_POSIX_FD_SUPPORTED = 103 };

extern CUresult (*p_cuDeviceGetAttribute)(int *, int, CUdevice);
extern CUresult (*p_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
extern CUresult (*p_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
extern CUresult (*p_cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);

// gx_ipc_supported: v[0] = 1 when the driver has every entry point IPC
// uses and device dev (a CUdevice) exports POSIX file descriptors.
static inline gx_ret gx_ipc_supported(int dev) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	if (p_cuDeviceGetAttribute == NULL || p_cuMemExportToShareableHandle == NULL ||
		p_cuMemImportFromShareableHandle == NULL || p_cuMemGetAllocationPropertiesFromHandle == NULL) {
		return out;
	}
	int v = 0;
	out.res = p_cuDeviceGetAttribute(&v, GX_ATTR_POSIX_FD_SUPPORTED, (CUdevice)dev);
	out.v[0] = v != 0;
	return out;
}

// gx_ipc_export: v[0] = a file descriptor of this process for handle h.
static inline gx_ret gx_ipc_export(uintptr_t ctx, unsigned long long h) {
	GX_BEGIN(ctx)
	int fd = -1;
	out.res = p_cuMemExportToShareableHandle(&fd, (CUmemGenericAllocationHandle)h, GX_HANDLE_TYPE_POSIX_FD, 0);
	out.v[0] = (unsigned long long)(long long)fd;
	GX_END()
}

// gx_ipc_close closes a descriptor gx_ipc_export made: v[1] = errno where
// it failed (res stays 0: it is no driver error).
static inline gx_ret gx_ipc_close(int fd) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	if (close(fd) != 0) {
		out.v[1] = errno;
	}
	return out;
}

// gx_ipc_import duplicates descriptor fd of process pid and imports it:
// v[0] = the handle, v[3] = the ordinal of the device its memory is on.
// A system call that fails leaves res 0 and says which in v[2] (1:
// pidfd_open, 2: pidfd_getfd) and its errno in v[1]; nothing is left open.
static inline gx_ret gx_ipc_import(uintptr_t ctx, int pid, int fd) {
	gx_ret out = { { 0, 0, 0, 0 }, 0, GX_MAIN };
	long pidfd = syscall(SYS_pidfd_open, pid, 0);
	if (pidfd < 0) {
		out.v[1] = errno;
		out.v[2] = 1;
		return out;
	}
	long myfd = syscall(SYS_pidfd_getfd, (int)pidfd, fd, 0);
	if (myfd < 0) {
		out.v[1] = errno;
		out.v[2] = 2;
		close((int)pidfd);
		return out;
	}
	close((int)pidfd);
	gx_saved sv;
	if (!gx_enter((CUcontext)ctx, &sv, &out)) {
		close((int)myfd);
		return out;
	}
	CUmemGenericAllocationHandle h = 0;
	out.res = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)myfd, GX_HANDLE_TYPE_POSIX_FD);
	close((int)myfd);
	if (out.res == 0) {
		CUmemAllocationProp prop;
		memset(&prop, 0, sizeof prop);
		out.res = p_cuMemGetAllocationPropertiesFromHandle(&prop, h);
		if (out.res != 0) {
			p_cuMemRelease(h);
			h = 0;
		}
		out.v[3] = (unsigned long long)prop.location.id;
	}
	out.v[0] = h;
	gx_leave(&sv, &out);
	return out;
}

#endif
