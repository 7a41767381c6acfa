// CUDA IPC, the caching layer's half: a block shared with other processes
// stays out of the free cache until every share of it is released. The
// placement's half, and the note that explains the whole, is arena's
// vmm_ipc.go, Note [CUDA IPC].

package caching

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// ipcShare is a block exported to other processes: how many shares are
// not yet released, and the free that waits for them (freed).
type ipcShare struct {
	shares int
	freed  bool
	size   uint64
	stream arena.Stream
}

// ExportIPC exports the live block at ptr for other processes (its
// handles as descriptors of this process: arena.IPCExport) and counts a
// share of it: a free of the block waits for ReleaseIPC of every share
// before the block is cached or reused. Refused on a device that cannot
// share (backend:async: arena.ErrNoIPC) and for a pointer that is no live
// block's start.
func (a *Allocator) ExportIPC(ptr uintptr) (arena.IPCExport, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	sh, ok := a.dev.(arena.Sharer)
	if !ok {
		return arena.IPCExport{}, fmt.Errorf("goalloc: CUDA IPC export on device %d: %w (backend:async's pool is not shared)", a.dev.Ordinal(), arena.ErrNoIPC)
	}
	size, ok := a.liveSize(ptr)
	if !ok || a.ipc[ptr] != nil && a.ipc[ptr].freed {
		return arena.IPCExport{}, a.badInput("unknown_pointer", fmt.Sprintf("CUDA IPC export of %#x on device %d: not the start of a live block", ptr, a.dev.Ordinal()))
	}
	x, err := sh.ExportIPC(ptr, size)
	if err != nil {
		return arena.IPCExport{}, err
	}
	if a.ipc == nil {
		a.ipc = map[uintptr]*ipcShare{}
	}
	if a.ipc[ptr] == nil {
		a.ipc[ptr] = &ipcShare{}
	}
	a.ipc[ptr].shares++
	return x, nil
}

// ReleaseIPC releases one share of the block at ptr; after the last, a
// free that waited for it is made now.
func (a *Allocator) ReleaseIPC(ptr uintptr) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.ipc[ptr]
	if s == nil {
		return a.badInput("unknown_pointer", fmt.Sprintf("CUDA IPC release of %#x on device %d: no share of it is held", ptr, a.dev.Ordinal()))
	}
	if s.shares--; s.shares > 0 {
		return nil
	}
	delete(a.ipc, ptr)
	if s.freed {
		return a.freeLocked(ptr, s.size, s.stream)
	}
	return nil
}

// SharedIPC is how many shares of the block at ptr are held.
func (a *Allocator) SharedIPC(ptr uintptr) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if s := a.ipc[ptr]; s != nil {
		return s.shares
	}
	return 0
}

// holdIfShared keeps the free of ptr, shared with other processes, for the
// last ReleaseIPC; true when it did. A second free is a double free.
func (a *Allocator) holdIfShared(ptr uintptr, size uint64, s arena.Stream) (bool, error) {
	sh := a.ipc[ptr]
	if sh == nil {
		return false, nil
	}
	if sh.freed {
		return true, a.badInput("double_free", fmt.Sprintf("double free of %#x (%d bytes) on device %d, shared with other processes", ptr, size, a.dev.Ordinal()))
	}
	sh.freed, sh.size, sh.stream = true, size, s
	return true, nil
}

// ImportIPC maps another process's export on this device: the address of
// the block (the mapping's base plus x.Offset) and the base, which
// CloseIPC takes.
func (a *Allocator) ImportIPC(x arena.IPCExport) (ptr, base uintptr, err error) {
	sh, ok := a.dev.(arena.Sharer)
	if !ok {
		return 0, 0, fmt.Errorf("goalloc: CUDA IPC import on device %d: %w", a.dev.Ordinal(), arena.ErrNoIPC)
	}
	base, err = sh.ImportIPC(x)
	if err != nil {
		return 0, 0, err
	}
	return base + uintptr(x.Offset), base, nil
}

// CloseIPC unmaps an import ImportIPC made, by its base.
func (a *Allocator) CloseIPC(base uintptr) error {
	sh, ok := a.dev.(arena.Sharer)
	if !ok {
		return fmt.Errorf("goalloc: CUDA IPC close on device %d: %w", a.dev.Ordinal(), arena.ErrNoIPC)
	}
	return sh.CloseIPC(base)
}

// liveSize is the bytes of the live block or slot that starts at ptr.
func (a *Allocator) liveSize(ptr uintptr) (uint64, bool) {
	if id, ok := a.largeByAddr.Get(ptr); ok {
		b := &a.blocks[id]
		return b.size, b.state == blockLive
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			return seg.slotSize, seg.state[i] == slotLive
		}
	}
	return 0, false
}
