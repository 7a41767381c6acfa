//go:build linux && cgo

// The VMM device's CUDA IPC half (PhysSharer): the gx_ipc_* wrappers of
// cuda_ipc.h. See vmm_ipc.go, Note [CUDA IPC].

package arena

/*
#include "cuda_ipc.h"
*/
import "C"

import (
	"fmt"
	"os"
	"syscall"
)

var _ PhysSharer = (*cudaPhys)(nil)

// ipcSupported says whether the driver has IPC's entry points and device
// dev exports POSIX file descriptors; then the device's handles are
// created exportable.
func ipcSupported(dev C.int) bool {
	r := C.gx_ipc_supported(dev)
	return r.res == 0 && r.v[0] != 0
}

// handleTypes is the handle types the device's handles are created with.
func (p *cudaPhys) handleTypes() C.int {
	if p.ipc {
		return C.GX_HANDLE_TYPE_POSIX_FD
	}
	return 0
}

// ExportHandle is cuMemExportToShareableHandle as a POSIX descriptor.
func (p *cudaPhys) ExportHandle(h PhysHandle) (int32, error) {
	if !p.ipc {
		return 0, fmt.Errorf("device %d: %w", p.rt.ordinal, ErrNoIPC)
	}
	r := C.gx_ipc_export(p.rt.ctx, C.ulonglong(h))
	if err := check("cuMemExportToShareableHandle", r); err != nil {
		return 0, err
	}
	return int32(int64(r.v[0])), nil
}

// CloseExported closes a descriptor ExportHandle made.
func (p *cudaPhys) CloseExported(fd int32) error {
	if r := C.gx_ipc_close(C.int(fd)); r.v[1] != 0 {
		return fmt.Errorf("close(%d): %w", fd, syscall.Errno(r.v[1]))
	}
	return nil
}

// ImportHandle duplicates and imports descriptor fd of process pid.
func (p *cudaPhys) ImportHandle(pid, fd int32) (PhysHandle, int, error) {
	if !p.ipc {
		return 0, 0, fmt.Errorf("device %d: %w", p.rt.ordinal, ErrNoIPC)
	}
	r := C.gx_ipc_import(p.rt.ctx, C.int(pid), C.int(fd))
	switch {
	case r.v[2] == 1:
		return 0, 0, fmt.Errorf("pidfd_open(%d): %w (the sender exited?)", pid, syscall.Errno(r.v[1]))
	case r.v[2] == 2:
		return 0, 0, fmt.Errorf("pidfd_getfd(%d, %d): %w (a stale handle, or this process may not ptrace the sender: see /proc/sys/kernel/yama/ptrace_scope)", pid, fd, syscall.Errno(r.v[1]))
	}
	if err := check("cuMemImportFromShareableHandle", r); err != nil {
		return 0, 0, err
	}
	return PhysHandle(r.v[0]), int(r.v[3]), nil
}

// ProcessID is this process's id.
func (p *cudaPhys) ProcessID() int32 { return int32(os.Getpid()) }

// Device is the device's ordinal.
func (p *cudaPhys) Device() int { return p.rt.ordinal }
