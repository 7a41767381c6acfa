// FakePhys's CUDA IPC half (PhysSharer): exported handles as descriptors in
// simulated processes' tables. See vmm_ipc.go, Note [CUDA IPC].

package arena

import (
	"fmt"
	"os"
	"sync"
)

// FakeKernel is what the kernel does for CUDA IPC, for FakePhys drivers
// standing for several processes: each process has a table of descriptors,
// an exported handle is a descriptor there naming the handle's memory (its
// contents, shared), and a receiver duplicates a descriptor by process id
// and number, as pidfd_getfd does, which fails once the process exited or
// closed it.
type FakeKernel struct {
	mu    sync.Mutex
	procs map[int32]*fakeProc
	// openLimit is the most descriptors a process may have open, the
	// standard streams included (RLIMIT_NOFILE); 0: no limit.
	openLimit int
}

type fakeProc struct {
	fds    map[int32]*fakeShared
	nextFD int32
}

// fakeShared is the memory an exported descriptor names.
type fakeShared struct {
	size uint64
	data fakeBytes
	dev  int
}

// NewFakeKernel makes a kernel with no process.
func NewFakeKernel() *FakeKernel { return &FakeKernel{procs: map[int32]*fakeProc{}} }

// simKernel is the kernel of every simulated VMM device of this process:
// they are one process, pid os.Getpid().
var simKernel = NewFakeKernel()

// Exit ends process pid: its descriptors close.
func (k *FakeKernel) Exit(pid int32) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.procs, pid)
}

// SetOpenLimit makes every process's open descriptors, the standard
// streams included, at most n (RLIMIT_NOFILE); 0 lifts the limit.
func (k *FakeKernel) SetOpenLimit(n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.openLimit = n
}

// OpenFDs is how many descriptors process pid has open.
func (k *FakeKernel) OpenFDs(pid int32) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if p := k.procs[pid]; p != nil {
		return len(p.fds)
	}
	return 0
}

func (k *FakeKernel) proc(pid int32) *fakeProc {
	p := k.procs[pid]
	if p == nil {
		// Descriptors 0-2 are the standard streams.
		p = &fakeProc{fds: map[int32]*fakeShared{}, nextFD: 3}
		k.procs[pid] = p
	}
	return p
}

func (k *FakeKernel) open(pid int32, s *fakeShared) (int32, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	p := k.proc(pid)
	if k.openLimit > 0 && 3+len(p.fds) >= k.openLimit {
		return 0, fmt.Errorf("fakephys: process %d: too many open files (%d)", pid, k.openLimit)
	}
	// The lowest free number, as the kernel gives: a closed number is
	// given again, which is what makes a stale handle name other memory.
	fd := int32(3)
	for p.fds[fd] != nil {
		fd++
	}
	p.fds[fd] = s
	return fd, nil
}

func (k *FakeKernel) close(pid, fd int32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	p := k.procs[pid]
	if p == nil || p.fds[fd] == nil {
		return fmt.Errorf("fakephys: close of descriptor %d of process %d: bad file descriptor", fd, pid)
	}
	delete(p.fds, fd)
	return nil
}

// lookup is pidfd_open and pidfd_getfd: what descriptor fd of pid names.
func (k *FakeKernel) lookup(pid, fd int32) (*fakeShared, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	p := k.procs[pid]
	if p == nil {
		return nil, fmt.Errorf("pidfd_open(%d): no such process (the sender exited?)", pid)
	}
	s := p.fds[fd]
	if s == nil {
		return nil, fmt.Errorf("pidfd_getfd(%d, %d): bad file descriptor (a stale handle: the sender closed it)", pid, fd)
	}
	return s, nil
}

// Attach makes f the driver of device dev in process pid of k: the
// handles it creates from now on are exportable (requestedHandleTypes
// POSIX_FILE_DESCRIPTOR), those made before are not.
func (f *FakePhys) Attach(k *FakeKernel, pid int32, dev int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.kernel, f.pid, f.dev = k, pid, dev
	k.mu.Lock()
	k.proc(pid)
	k.mu.Unlock()
}

// attachSim attaches f to the simulated devices' kernel, as this process.
func (f *FakePhys) attachSim(dev int) { f.Attach(simKernel, int32(os.Getpid()), dev) }

// Kernel is the kernel f is attached to (nil: none) and its process id.
func (f *FakePhys) Kernel() (*FakeKernel, int32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.kernel, f.pid
}

func (f *FakePhys) ProcessID() int32 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pid
}

func (f *FakePhys) Device() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.dev
}

// ExportHandle opens a descriptor for h's memory in f's process.
func (f *FakePhys) ExportHandle(h PhysHandle) (int32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemExportToShareableHandle"]++
	fh, ok := f.handles[h]
	switch {
	case !ok:
		return 0, fmt.Errorf("fakephys: export of unknown handle %d", h)
	case !fh.exportable:
		return 0, fmt.Errorf("fakephys: cuMemExportToShareableHandle of handle %d: created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (not permitted)", h)
	}
	if fh.data == nil {
		fh.data = fakeBytes{}
	}
	return f.kernel.open(f.pid, &fakeShared{size: fh.size, data: fh.data, dev: fh.dev})
}

// CloseExported closes a descriptor of f's process.
func (f *FakePhys) CloseExported(fd int32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.kernel == nil {
		return fmt.Errorf("fakephys: close of descriptor %d: no kernel attached", fd)
	}
	return f.kernel.close(f.pid, fd)
}

// ImportHandle makes a handle of f to the memory descriptor fd of process
// pid names. Its memory is the exporter's: f's Used does not count it.
func (f *FakePhys) ImportHandle(pid, fd int32) (PhysHandle, int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemImportFromShareableHandle"]++
	if f.kernel == nil {
		return 0, 0, fmt.Errorf("fakephys: import: no kernel attached")
	}
	s, err := f.kernel.lookup(pid, fd)
	if err != nil {
		return 0, 0, err
	}
	f.nextH++
	f.handles[f.nextH] = &fakeHandle{size: s.size, data: s.data, imported: true, dev: s.dev}
	return f.nextH, s.dev, nil
}
