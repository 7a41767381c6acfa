//go:build linux && cgo && goalloc_cudatest

package arena

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// openFDs is how many descriptors this process has open.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// CUDA IPC within one process (pidfd_getfd of its own descriptors, which
// the kernel allows): a block's handles exported and imported at another
// range show the same bytes both ways; the descriptors close as the
// handles are released; a stale descriptor and a process that exited are
// refused with the system call's reason. NOT YET RUN ON A GPU.
func TestVMMCUDAIPCInProcess(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	fds := openFDs(t)
	const n = 5<<20 + 512
	_, _ = d.Alloc(1<<20, 0) // the block below starts inside a granule
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

	if err := d.Free(p, n, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := d.Trim(0); err != nil {
		t.Fatal(err)
	}
	if got := openFDs(t); got > fds+1 { // the 1 MiB block's handle may stay
		t.Errorf("%d descriptors open after the release, %d before: exported descriptors leak", got, fds)
	}
}
