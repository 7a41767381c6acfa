// CUDA IPC on the VMM backend: the physical handles behind a live block
// exported as POSIX file descriptors, and handles another process exported
// imported and mapped here. See vmm.go for the overview.

package arena

import (
	"errors"
	"fmt"
)

// Note [CUDA IPC]
//
// What PyTorch does (torch 2.11, c10/cuda/CUDACachingAllocator.cpp,
// torch/csrc/StorageSharing.cpp, torch/csrc/CudaIPCTypes.cpp,
// torch/multiprocessing/reductions.py):
//
// Sending. reduce_tensor calls storage._share_cuda_(), which calls the
// allocator's shareIpcHandle(ptr) and sends, with the tensor's geometry:
// the handle's bytes, the storage's size, the handle's offset (where the
// storage starts in the memory the handle maps), a reference counter (a
// shared-memory file's name and an offset in it) and an interprocess event
// recorded on the current stream. The handle is a string:
//
//	byte 0   SHAREABLE_HANDLE_VERSION (2)
//	byte 1   the type: 'c' or 'e'
//	'c'      a cudaIpcMemHandle_t (64 bytes) of the block's whole
//	         cudaMalloc segment; the offset is the block's from the
//	         segment's base (cudaIpcGetMemHandle shares whole allocations).
//	'e'      an expandable segment's range: a ShareHeader {pid_t pid;
//	         size_t segment_size; size_t num_handles} (24 bytes: 4 of pid,
//	         4 of zero padding, 8, 8; zeroed first, so that the same range
//	         gives the same bytes), then num_handles ints, each the number
//	         of a file descriptor open in the sender (pid) that
//	         cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) made for
//	         one physical handle of segment_size bytes. The handles are
//	         those of the granules [floor(ptr), ceil(ptr+size)) of the
//	         block; the offset is ptr less the first granule's address.
//	         (With the fabric handle type, 64-byte CUmemFabricHandles
//	         instead of ints: not used here.)
//
// A string of exactly 64 bytes is an older torch's raw 'c' handle. The
// sender exports a handle's descriptor once, keeps it open (the same
// block shared twice gives the same string) and closes it when it
// releases the handle. Native expandable segments create their handles
// with requestedHandleTypes POSIX_FILE_DESCRIPTOR unless
// TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0 (or in fbcode builds).
//
// Receiving. rebuild_cuda_tensor calls getIpcDevPtr(handle) on the
// receiver's current device, which caches one mapping per distinct
// handle string (a weak pointer: the mapping goes when the last storage
// over it does). 'c': cudaIpcOpenMemHandle (lazy peer access),
// cudaIpcCloseMemHandle at the end. 'e': ExpandableSegment::fromShared:
// pidfd_open(pid), then for each descriptor pidfd_getfd(pidfd, fd) (the
// sender must still be alive, and the receiver allowed to ptrace it: the
// kernel's check for pidfd_getfd), cuMemImportFromShareableHandle, close
// of the duplicate; a fresh VA range of num_handles x segment_size, each
// handle mapped in order, access set for the device and its peers. At the
// end: unmap, release, free the VA. The storage starts at the mapping's
// base plus the offset that came beside the handle.
//
// Lifetime. _share_cuda_ replaces the storage's DataPtr by one whose
// context is a CudaIPCSentData holding the original DataPtr and a counter
// in the shared file, which each receiver increments when it rebuilds and
// decrements when its storage dies. When the sender's storage dies while
// the counter is above zero, the CudaIPCSentData goes to a limbo, and the
// original DataPtr (so the allocator's block) is freed only when
// CudaIPCCollect (torch.cuda.ipc_collect, and the allocator's free-memory
// callback) finds its counter at zero. So under torch the allocator's
// free of a shared block already comes after every receiver let go.
//
// What goalloc does. Every handle goes to one granule of a segment (vmm.go)
// and is the same size, so a live block's granules are exactly an
// expandable segment's range: Export gives the handles of the granules
// under [ptr, ptr+size), their descriptors (exported once per handle,
// cached, closed when the handle is released: sharePhys), the granule and
// the offset, which is torch's 'e' format field for field; a native
// receiver opens it. Handles are created exportable where the device
// supports POSIX descriptors (the driver's flag; FakePhys models it).
// Import maps handles another process exported into a fresh VA range of
// this device, apart from every segment (they are not this device's
// memory: held does not count them), and Close unmaps and releases them
// and gives the VA back. A handle moves between VAs of the sender while it
// lives (step 3 of the placement) but it is the same physical memory, so
// a receiver's mapping stays valid whatever the sender does with its VA;
// the sender's release of a handle does not free memory a receiver has
// imported (the driver counts both).
//
// What is pinned. A block's bytes are reused only after it is freed; a
// handle's other bytes (the granule a shared block shares with its
// neighbours) may be reused by the sender at once, as under torch, since
// a receiver uses only its block's bytes. The caching layer keeps a shared
// block out of its free cache until every share of it is released
// (caching/ipc.go): the guarantee for callers that free before their
// receivers let go; under torch the counter above already orders it.
//
// Limitations. Sleep releases a tag's handles and wake maps new ones: a
// receiver that imported a block of a tag before a sleep keeps the old
// memory, and sees no later write of the sender (torch's reference counting
// does not know of sleep; sharing and sleeping one block is unsupported).
// Fabric handles (multi-node NVLink) are not exported.
//
// Bad input is refused with a reason: a pointer that is no live block, a
// block asleep (no handles), handles created unexportable, a process that
// exited or a descriptor it no longer has (the kernel's answer), a handle
// of another device, a handle whose size is not the one named or not a
// multiple of the driver's granularity (a native sender's segment size
// differs from goalloc's granule: any such multiple is mapped).

// ErrNoIPC is the error of a device or driver that cannot share memory
// between processes.
var ErrNoIPC = errors.New("CUDA IPC needs backend:vmm and a driver that exports POSIX file descriptors")

// PhysSharer is the half of a PhysDriver that shares handles between
// processes, one driver or system call per method.
type PhysSharer interface {
	// ExportHandle is cuMemExportToShareableHandle of h as a POSIX file
	// descriptor, open in this process until CloseExported.
	ExportHandle(h PhysHandle) (fd int32, err error)
	// CloseExported closes a descriptor ExportHandle made.
	CloseExported(fd int32) error
	// ImportHandle duplicates descriptor fd of process pid into this one
	// (pidfd_open, pidfd_getfd), imports it
	// (cuMemImportFromShareableHandle) and closes the duplicate: a handle
	// of this process to the same memory, and the device that memory is
	// on.
	ImportHandle(pid, fd int32) (h PhysHandle, device int, err error)
	// ProcessID is this process's id, as receivers name it.
	ProcessID() int32
	// Device is the ordinal of the device the driver places memory on.
	Device() int
}

// IPCExport is what a receiver needs to map a block's memory: torch's 'e'
// handle's fields (Note [CUDA IPC]).
type IPCExport struct {
	PID     int32   // the process whose descriptors FDs are
	Granule uint64  // bytes of each handle
	FDs     []int32 // one per granule, in address order
	Offset  uint64  // the block's start from the first granule's
}

// Sharer is a device that shares memory between processes.
type Sharer interface {
	// ExportIPC exports the handles under the live block [ptr, ptr+size).
	ExportIPC(ptr uintptr, size uint64) (IPCExport, error)
	// ImportIPC maps the handles of x into a fresh VA range of this device:
	// its base (x.Offset is the caller's to add).
	ImportIPC(x IPCExport) (uintptr, error)
	// CloseIPC unmaps and releases an import, by the base ImportIPC gave.
	CloseIPC(base uintptr) error
}

// sharePhys is the driver under a placement whose driver can share: it
// exports a handle's descriptor once, and closes it as the handle is
// released, so descriptors live exactly as long as the handles they name.
type sharePhys struct {
	PhysDriver
	sharer PhysSharer
	fds    map[PhysHandle]int32
}

func newSharePhys(d PhysDriver, s PhysSharer) *sharePhys {
	return &sharePhys{PhysDriver: d, sharer: s, fds: map[PhysHandle]int32{}}
}

// export is h's descriptor, exported at its first share. A failure names
// the descriptors this process already holds for shared handles: one stays
// open per handle shared, so a process that shares many GiB can run out of
// open files, which the driver's error does not say.
func (p *sharePhys) export(h PhysHandle) (int32, error) {
	if fd, ok := p.fds[h]; ok {
		return fd, nil
	}
	fd, err := p.sharer.ExportHandle(h)
	if err != nil {
		return 0, fmt.Errorf("%w (this process holds %d descriptors of shared handles, one per handle until "+
			"it is released; if that is its open-files limit, raise it (ulimit -n) or vmm_handle)", err, len(p.fds))
	}
	p.fds[h] = fd
	return fd, nil
}

// ReleaseHandle closes h's descriptor, if it was exported, then releases
// it: a descriptor left open would keep the memory allocated.
func (p *sharePhys) ReleaseHandle(h PhysHandle) error {
	if fd, ok := p.fds[h]; ok {
		if err := p.sharer.CloseExported(fd); err != nil {
			return err
		}
		delete(p.fds, h)
	}
	return p.PhysDriver.ReleaseHandle(h)
}

// minGranular is a driver whose allocation granularity is finer than the
// placement's granule: the CUDA driver's, under goalloc's larger handles.
// Handles another process exported may be any multiple of it.
type minGranular interface{ MinGranule() uint64 }

// ipcImport is a mapping of handles another process exported.
type ipcImport struct {
	size    uint64
	gran    uint64       // bytes of each handle
	handles []PhysHandle // mapped in order from the base
}

// granulesOf is the handles of the granules under [ptr, ptr+size), which
// must lie in one live span, and the first granule's address.
func (e *vmmSegments) granulesOf(ptr uintptr, size uint64) ([]PhysHandle, uintptr, error) {
	for _, g := range e.segs {
		if ptr < g.base || ptr >= g.end() {
			continue
		}
		id := g.spanHolding(ptr)
		if id == noSpan {
			break
		}
		sp := g.span(id)
		if sp.state != spanLive || ptr+uintptr(size) > sp.end() {
			break
		}
		if g.asleep {
			return nil, 0, fmt.Errorf("arena: VMM: IPC export of %#x: its memory tag is asleep (no physical memory to share): wake it first", ptr)
		}
		lo := ptr &^ uintptr(e.gran-1)
		hi := (ptr + uintptr(max(size, 1)) + uintptr(e.gran) - 1) &^ uintptr(e.gran-1)
		var hs []PhysHandle
		for va := lo; va < hi; va += uintptr(e.gran) {
			hs = append(hs, g.handles[(va-g.base)/uintptr(e.gran)])
		}
		return hs, lo, nil
	}
	return nil, 0, fmt.Errorf("arena: VMM: IPC export of %#x+%d, which is not inside one live allocation of this device", ptr, size)
}

// exportIPC is Sharer's ExportIPC over the placement.
func (v *vmmSource) exportIPC(ptr uintptr, size uint64) (IPCExport, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return IPCExport{}, errVMMClosed
	}
	if v.share == nil {
		return IPCExport{}, fmt.Errorf("arena: VMM: IPC export of %#x: %w", ptr, ErrNoIPC)
	}
	hs, lo, err := v.eng.granulesOf(ptr, size)
	if err != nil {
		return IPCExport{}, err
	}
	x := IPCExport{PID: v.share.sharer.ProcessID(), Granule: v.gran, Offset: uint64(ptr - lo), FDs: make([]int32, len(hs))}
	for i, h := range hs {
		if x.FDs[i], err = v.share.export(h); err != nil {
			return IPCExport{}, fmt.Errorf("arena: VMM: IPC export of %#x: %w", ptr, err)
		}
	}
	return x, nil
}

// importIPC is Sharer's ImportIPC over the placement's driver; a failure
// undoes what was done.
func (v *vmmSource) importIPC(x IPCExport) (uintptr, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	switch {
	case v.closed:
		return 0, errVMMClosed
	case v.share == nil:
		return 0, fmt.Errorf("arena: VMM: IPC import: %w", ErrNoIPC)
	case len(x.FDs) == 0:
		return 0, errors.New("arena: VMM: IPC import of no handle")
	case x.Granule == 0 || x.Granule%v.importGran != 0:
		// A native sender's handles are its segment size, not goalloc's
		// granule: any multiple of the driver's granularity maps.
		return 0, fmt.Errorf("arena: VMM: IPC import of handles of %d bytes: not a multiple of the device's allocation granularity, %d bytes", x.Granule, v.importGran)
	}
	size := uint64(len(x.FDs)) * x.Granule
	base, err := v.drv.ReserveVA(size)
	if err != nil {
		return 0, fmt.Errorf("arena: VMM: IPC import: %w", err)
	}
	im := &ipcImport{size: size, gran: x.Granule}
	undo := func(err error) (uintptr, error) {
		return 0, errors.Join(err, v.unmapImport(base, im))
	}
	for i, fd := range x.FDs {
		h, dev, err := v.share.sharer.ImportHandle(x.PID, fd)
		if err != nil {
			return undo(fmt.Errorf("arena: VMM: IPC import of descriptor %d of process %d: %w", fd, x.PID, err))
		}
		if own := v.share.sharer.Device(); dev != own {
			err := fmt.Errorf("arena: VMM: IPC import on device %d of memory of device %d: open it with device %d current", own, dev, dev)
			return undo(errors.Join(err, v.drv.ReleaseHandle(h)))
		}
		if err := v.drv.Map(base+uintptr(uint64(i)*x.Granule), x.Granule, h); err != nil {
			return undo(errors.Join(fmt.Errorf("arena: VMM: IPC import: %w", err), v.drv.ReleaseHandle(h)))
		}
		im.handles = append(im.handles, h)
	}
	if err := v.drv.SetAccess(base, size); err != nil {
		return undo(fmt.Errorf("arena: VMM: IPC import: %w", err))
	}
	v.imports[base] = im
	return base, nil
}

// unmapImport unmaps and releases im's handles and gives its VA back.
func (v *vmmSource) unmapImport(base uintptr, im *ipcImport) error {
	var errs []error
	for i, h := range im.handles {
		errs = append(errs, v.drv.Unmap(base+uintptr(uint64(i)*im.gran), im.gran), v.drv.ReleaseHandle(h))
	}
	errs = append(errs, v.drv.FreeVA(base, im.size))
	return errors.Join(errs...)
}

// closeIPC is Sharer's CloseIPC.
func (v *vmmSource) closeIPC(base uintptr) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return errVMMClosed
	}
	im, ok := v.imports[base]
	if !ok {
		return fmt.Errorf("arena: VMM: IPC close of %#x, which is no open import of this device", base)
	}
	delete(v.imports, base)
	return v.unmapImport(base, im)
}

// closeImports closes every import, at the device's close.
func (v *vmmSource) closeImports() error {
	var errs []error
	for base, im := range v.imports {
		errs = append(errs, v.unmapImport(base, im))
		delete(v.imports, base)
	}
	return errors.Join(errs...)
}
