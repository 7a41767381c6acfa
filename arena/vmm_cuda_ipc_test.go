//go:build linux && cgo && goalloc_cudatest

package arena

import (
	"os"
	"os/exec"
	"sort"
	"strings"
	"testing"
)

// openFDs is what this process's descriptors point at, by number.
func openFDs(t *testing.T) map[string]string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	fds := make(map[string]string, len(ents))
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		fds[e.Name()] = target
	}
	return fds
}

// newFDs lists the descriptors of after that before did not have.
func newFDs(before, after map[string]string) []string {
	var added []string
	for fd, target := range after {
		if before[fd] != target {
			added = append(added, fd+" -> "+target)
		}
	}
	sort.Strings(added)
	return added
}

// ipcRound exports a block of n bytes that starts 1 MiB into a granule,
// imports it at another range, checks the bytes both ways, closes the
// import and frees and trims everything.
func ipcRound(t *testing.T, d *VMM, n uint64) IPCExport {
	t.Helper()
	first, err := d.Alloc(1<<20, 0) // the block below starts inside a granule
	if err != nil {
		t.Fatal(err)
	}
	p, err := d.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.memset(p, 0x5a, n, 0); err != nil {
		t.Fatal(err)
	}
	x, err := d.ExportIPC(p, n)
	if err != nil {
		t.Fatalf("export (is CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED set?): %v", err)
	}
	if len(x.FDs) != 4 || x.Offset != 1<<20 || x.PID != int32(os.Getpid()) {
		t.Errorf("export %+v: want 4 handles at offset 1 MiB of this process", x)
	}
	base, err := d.ImportIPC(x)
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	q := base + uintptr(x.Offset)
	expectBytes(t, d, q, n, 0x5a, "the import shows the block")
	if err := d.memset(q, 0x33, n, 0); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, p, n, 0x33, "the block shows the import's writes")
	if err := d.CloseIPC(base); err != nil {
		t.Fatal(err)
	}
	for _, b := range []struct {
		p uintptr
		n uint64
	}{{p, n}, {first, 1 << 20}} {
		if err := d.Free(b.p, b.n, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := d.Trim(0); err != nil {
		t.Fatal(err)
	}
	return x
}

// CUDA IPC within one process (pidfd_getfd of its own descriptors, which
// the kernel allows): a block's handles exported and imported at another
// range show the same bytes both ways; a stale descriptor and a process
// that exited are refused with the system call's reason; and a second
// round leaves no more descriptors open than the first (the first may
// open the driver's own, once).
func TestVMMCUDAIPCInProcess(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	const n = 5<<20 + 512
	x := ipcRound(t, d, n)

	stale := x
	stale.FDs = []int32{1 << 20}
	if _, err := d.ImportIPC(stale); err == nil || !strings.Contains(err.Error(), "pidfd_getfd") {
		t.Errorf("a stale descriptor: %v", err)
	}
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	exited := x
	exited.PID = int32(gone.ProcessState.Pid())
	if _, err := d.ImportIPC(exited); err == nil || !strings.Contains(err.Error(), "pidfd_open") {
		t.Errorf("a process that exited: %v", err)
	}

	before := openFDs(t)
	ipcRound(t, d, n)
	if added := newFDs(before, openFDs(t)); len(added) > 0 {
		t.Errorf("a second round left %d descriptors open: %v", len(added), added)
	}
}
