package main

// CUDA IPC through the C ABI (goalloc.h, "CUDA IPC"): the caching layer's
// half is caching/ipc.go, the placement's arena's vmm_ipc.go, Note [CUDA
// IPC].

/*
#include "cgo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

//export goalloc_ipc_export
func goalloc_ipc_export(ptr unsafe.Pointer, pid, device *C.int, granule, offset *C.ulonglong, fds *C.int, capacity C.int) C.int {
	if fds == nil {
		return status(lib.bad("null_pointer", "goalloc: goalloc_ipc_export: fds is a NULL pointer"))
	}
	if capacity < 0 {
		return status(lib.bad("invalid_argument", fmt.Sprintf("goalloc: goalloc_ipc_export: cap of %d", capacity)))
	}
	d, x, err := lib.ipcExport(uintptr(ptr), int(capacity))
	if err != nil {
		return -1
	}
	if len(x.FDs) <= int(capacity) {
		copy(unsafe.Slice((*C.int)(fds), len(x.FDs)), cInts(x.FDs))
	}
	if pid != nil {
		*pid = C.int(x.PID)
	}
	if device != nil {
		*device = C.int(d)
	}
	if granule != nil {
		*granule = C.ulonglong(x.Granule)
	}
	if offset != nil {
		*offset = C.ulonglong(x.Offset)
	}
	return C.int(len(x.FDs))
}

//export goalloc_ipc_release
func goalloc_ipc_release(ptr unsafe.Pointer) C.int { return status(lib.ipcRelease(uintptr(ptr))) }

//export goalloc_ipc_import
func goalloc_ipc_import(device, pid C.int, granule C.ulonglong, fds *C.goalloc_const_int, n C.int) unsafe.Pointer {
	if fds == nil {
		_ = lib.bad("null_pointer", "goalloc: goalloc_ipc_import: fds is a NULL pointer")
		return nil
	}
	if n <= 0 {
		_ = lib.bad("invalid_argument", fmt.Sprintf("goalloc: goalloc_ipc_import of %d handles", n))
		return nil
	}
	x := arena.IPCExport{PID: int32(pid), Granule: uint64(granule), FDs: make([]int32, n)}
	for i, fd := range unsafe.Slice((*C.int)(unsafe.Pointer(fds)), int(n)) {
		x.FDs[i] = int32(fd)
	}
	base, err := lib.ipcImport(int(device), x)
	if err != nil {
		return nil
	}
	return devicePointer(base)
}

//export goalloc_ipc_close
func goalloc_ipc_close(device C.int, base unsafe.Pointer) C.int {
	if base == nil {
		return status(lib.bad("null_pointer", "goalloc: goalloc_ipc_close of a NULL pointer"))
	}
	return status(lib.ipcClose(int(device), uintptr(base)))
}

//export goalloc_record_stream_held
func goalloc_record_stream_held(ptr unsafe.Pointer, stream C.cudaStream_t) C.int {
	held, err := lib.recordStreamHeld(uintptr(ptr), uintptr(stream))
	switch {
	case err != nil:
		return -1
	case held:
		return 1
	}
	return 0
}

// recordStreamHeld is goalloc_record_stream_held: record_stream on the
// device that holds p, if any; a pointer goalloc does not hold is no bad
// input here (a tensor received from another process, another allocator's).
func (l *library) recordStreamHeld(p, s uintptr) (bool, error) {
	if p == 0 {
		return false, nil
	}
	for _, a := range l.existing() {
		if a.Holds(p) {
			return true, l.reportErr(a.RecordStream(p, arena.Stream(s)))
		}
	}
	return false, nil
}

func cInts(v []int32) []C.int {
	out := make([]C.int, len(v))
	for i, x := range v {
		out[i] = C.int(x)
	}
	return out
}

// ipcOwner is the allocator that holds the block at p, looked up on every
// device made so far, as record_stream's is.
func (l *library) ipcOwner(p uintptr, what string) (int, *caching.Allocator, error) {
	if p == 0 {
		return 0, nil, l.bad("null_pointer", fmt.Sprintf("goalloc: %s of a NULL pointer", what))
	}
	for d, a := range l.existing() {
		if a.Holds(p) {
			return d, a, nil
		}
	}
	return 0, nil, l.bad("unknown_pointer", fmt.Sprintf("goalloc: %s of %#x, which goalloc did not allocate", what, p))
}

// ipcExport is goalloc_ipc_export: a share counted only when the caller
// has room for the descriptors.
func (l *library) ipcExport(p uintptr, capacity int) (int, arena.IPCExport, error) {
	d, a, err := l.ipcOwner(p, "ipc_export")
	if err != nil {
		return 0, arena.IPCExport{}, err
	}
	x, err := a.ExportIPC(p)
	if err != nil {
		return 0, arena.IPCExport{}, l.fail(err)
	}
	if len(x.FDs) > capacity {
		if err := a.ReleaseIPC(p); err != nil {
			return 0, arena.IPCExport{}, l.fail(err)
		}
	}
	return d, x, nil
}

func (l *library) ipcRelease(p uintptr) error {
	_, a, err := l.ipcOwner(p, "ipc_release")
	if err != nil {
		return err
	}
	return l.fail(a.ReleaseIPC(p))
}

// ipcDevice is device d's allocator for an import, made on first use (a
// receiver may have allocated nothing yet).
func (l *library) ipcDevice(d int) (*caching.Allocator, error) {
	if err := l.checkDevice(d); err != nil {
		return nil, err
	}
	a, err := l.device(d)
	if err != nil {
		return nil, l.fail(err)
	}
	return a, nil
}

func (l *library) ipcImport(d int, x arena.IPCExport) (uintptr, error) {
	a, err := l.ipcDevice(d)
	if err != nil {
		return 0, err
	}
	_, base, err := a.ImportIPC(x)
	return base, l.fail(err)
}

func (l *library) ipcClose(d int, base uintptr) error {
	a := l.existingDevice(d)
	if a == nil {
		return l.fail(withKind(errBadArgument, errors.New("goalloc: ipc_close on a device where goalloc holds nothing")))
	}
	return l.fail(a.CloseIPC(base))
}
