package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ipcProcess is a VMM source over a FakePhys standing for device dev of
// process pid of kernel k (nil: not attached, its handles unexportable).
func ipcProcess(t *testing.T, k *FakeKernel, pid int32, dev int) (*vmmSource, *FakePhys) {
	return ipcProcessGran(t, k, pid, dev, 2*mib)
}

// ipcProcessGran is ipcProcess with handles of gran bytes.
func ipcProcessGran(t *testing.T, k *FakeKernel, pid int32, dev int, gran uint64) (*vmmSource, *FakePhys) {
	t.Helper()
	phys := NewFakePhys(NewSim(dev, 1<<30), 1<<30, gran)
	base := uintptr(0x7f0000000000) + uintptr(pid)<<36
	phys.SetVAWindow(base, base+1<<36)
	if k != nil {
		phys.Attach(k, pid, dev)
	}
	src, err := newVMMSource(phys, 1<<30, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.close() })
	return src, phys
}

func ipcAlloc(t *testing.T, v *vmmSource, n uint64) uintptr {
	t.Helper()
	p, err := v.alloc(n, Stream(1))
	require.NoError(t, err)
	return p
}

// A block that starts inside a granule and spans three: the export names
// the handles of the granules under it and the offset from the first, as
// torch's 'e' handle does; the receiver maps them in a range of its own
// and sees the sender's bytes, and the sender sees the receiver's.
func TestIPCExportImportRoundTrip(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	rcv, rp := ipcProcess(t, k, 200, 0)
	_ = ipcAlloc(t, snd, 1*mib) // the block below starts mid-granule
	p := ipcAlloc(t, snd, 4*mib+512)
	require.NotZero(t, uint64(p)%(2*mib))
	want := cookie(t, sp, p, 4*mib+512)

	x, err := snd.exportIPC(p, 4*mib+512)
	require.NoError(t, err)
	assert.Equal(t, int32(100), x.PID)
	assert.Equal(t, uint64(2*mib), x.Granule)
	assert.Equal(t, uint64(p)%(2*mib), x.Offset)
	assert.Len(t, x.FDs, 3, "granules [floor(p), ceil(p+size))")

	base, err := rcv.importIPC(x)
	require.NoError(t, err)
	assert.Equal(t, want, readBack(t, rp, base+uintptr(x.Offset), 4*mib+512))
	back := cookie(t, rp, base+uintptr(x.Offset)+4096, 512)
	assert.Equal(t, back, readBack(t, sp, p+4096, 512), "the receiver's writes reach the sender")
	assert.Zero(t, rp.Used(), "imported memory is the sender's, not counted by the receiver")
	assert.Zero(t, rcv.eng.Held())
	require.NoError(t, rcv.checkInvariants())
	require.NoError(t, snd.checkInvariants())
}

// A range inside a live span (the caching layer's small slot of a slab)
// exports, with the free rest of the segment after it: the span is the
// one that holds the address, not the next one up (PyTorch's
// test_cuda_simple sent a 512-byte slot of a slab that ended its segment,
// and the export was refused on the H200).
func TestIPCExportInsideASpan(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	rcv, rp := ipcProcess(t, k, 200, 0)
	slab := ipcAlloc(t, snd, 256<<10)
	slot := slab + 3*512
	want := cookie(t, sp, slot, 512)

	x, err := snd.exportIPC(slot, 512)
	require.NoError(t, err)
	assert.Equal(t, uint64(slot)%(2*mib), x.Offset)
	base, err := rcv.importIPC(x)
	require.NoError(t, err)
	assert.Equal(t, want, readBack(t, rp, base+uintptr(x.Offset), 512))

	_, err = snd.exportIPC(slab+(256<<10)-256, 512)
	assert.ErrorContains(t, err, "not inside one live allocation", "a range past its span's end")
	_, err = snd.exportIPC(slab+(256<<10)+4096, 512)
	assert.ErrorContains(t, err, "not inside one live allocation", "free space")
	require.NoError(t, snd.checkInvariants())
}

// Descriptors are exported once per handle (the same block shared twice
// gives the same handle string, which receivers cache by), and closed as
// their handles are released: without sharePhys's close, Trim would leave
// them open, keeping the memory allocated.
func TestIPCDescriptorsLiveAsLongAsTheirHandles(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	p := ipcAlloc(t, snd, 6*mib)
	x1, err := snd.exportIPC(p, 6*mib)
	require.NoError(t, err)
	x2, err := snd.exportIPC(p, 6*mib)
	require.NoError(t, err)
	assert.Equal(t, x1, x2)
	assert.Equal(t, 3, k.OpenFDs(100))
	assert.Equal(t, 3, sp.Calls["cuMemExportToShareableHandle"])

	require.NoError(t, snd.free(p, 6*mib, Stream(1)))
	require.NoError(t, snd.synchronize(func() error { return nil }))
	require.NoError(t, snd.trim(0))
	assert.Zero(t, sp.Handles())
	assert.Zero(t, k.OpenFDs(100), "released handles' descriptors are closed")
}

// A receiver's import outlives the sender's handles: the memory stays
// while either holds it, and closing the import releases the receiver's
// handles and gives its VA back.
func TestIPCImportOutlivesSenderRelease(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	rcv, rp := ipcProcess(t, k, 200, 0)
	p := ipcAlloc(t, snd, 2*mib)
	want := cookie(t, sp, p, 2*mib)
	x, err := snd.exportIPC(p, 2*mib)
	require.NoError(t, err)
	va := rp.ReservedVA()
	base, err := rcv.importIPC(x)
	require.NoError(t, err)

	require.NoError(t, snd.free(p, 2*mib, Stream(1)))
	require.NoError(t, snd.synchronize(func() error { return nil }))
	require.NoError(t, snd.trim(0))
	k.Exit(100)
	assert.Equal(t, want, readBack(t, rp, base, 2*mib))

	require.NoError(t, rcv.closeIPC(base))
	assert.Zero(t, rp.Handles())
	assert.Equal(t, va, rp.ReservedVA())
	assert.ErrorContains(t, rcv.closeIPC(base), "no open import")
}

// Bad input is refused with its reason, and a failed import leaves nothing
// behind (no handle, no VA) in the receiver.
func TestIPCBadInput(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	rcv, rp := ipcProcess(t, k, 200, 0)
	other, op := ipcProcess(t, k, 300, 1)
	p := ipcAlloc(t, snd, 4*mib)
	x, err := snd.exportIPC(p, 4*mib)
	require.NoError(t, err)

	_, err = snd.exportIPC(p+uintptr(8*mib), 512)
	assert.ErrorContains(t, err, "not inside one live allocation")
	_, err = snd.exportIPC(p+512, 4*mib)
	assert.ErrorContains(t, err, "not inside one live allocation", "past the block's end")

	_, err = other.importIPC(x)
	assert.ErrorContains(t, err, "memory of device 0", "a device mismatch")
	assert.Zero(t, op.Handles(), "the handle of the other device is released again")

	bad := x
	bad.Granule = 3 * mib
	_, err = rcv.importIPC(bad)
	assert.ErrorContains(t, err, "not a multiple of the device's allocation granularity")
	bad.Granule = 4 * mib // the descriptors name 2 MiB handles
	_, err = rcv.importIPC(bad)
	assert.ErrorContains(t, err, "a handle is mapped whole")
	assert.Zero(t, rp.Handles())

	va := rp.ReservedVA()
	stale := x
	stale.FDs = append([]int32{}, x.FDs...)
	stale.FDs[1] = 99
	_, err = rcv.importIPC(stale)
	assert.ErrorContains(t, err, "bad file descriptor")
	assert.Zero(t, rp.Handles(), "the first handle, imported, is released again")
	assert.Equal(t, va, rp.ReservedVA())

	k.Exit(100)
	_, err = rcv.importIPC(x)
	assert.ErrorContains(t, err, "no such process")
	assert.Zero(t, rp.Handles())
	_ = sp
}

// Handles created before the driver could export (no POSIX descriptor
// type requested) are refused with the driver's reason.
func TestIPCUnexportableHandles(t *testing.T) {
	snd, sp := ipcProcess(t, nil, 100, 0)
	p := ipcAlloc(t, snd, 2*mib)
	sp.Attach(NewFakeKernel(), 100, 0)
	_, err := snd.exportIPC(p, 2*mib)
	assert.ErrorContains(t, err, "POSIX_FILE_DESCRIPTOR")
}

// A block of a tag asleep has no handles to share.
func TestIPCExportAsleepRefused(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcess(t, k, 100, 0)
	snd.eng.copier = sp
	snd.setAllocTag(1)
	p := ipcAlloc(t, snd, 2*mib)
	_, err := snd.sleep(SleepRequest{Tags: []Tag{1}})
	require.NoError(t, err)
	_, err = snd.exportIPC(p, 2*mib)
	assert.ErrorContains(t, err, "asleep")
}

// The simulated VMM devices are one process: a block of device 0 opens on
// device 0, and device 1 refuses it.
func TestIPCSimVMM(t *testing.T) {
	d0, err := NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	defer d0.Close()
	d1, err := NewSimVMM(1, 1<<30)
	require.NoError(t, err)
	defer d1.Close()
	p, err := d0.Alloc(3*mib, Stream(1))
	require.NoError(t, err)
	want := cookie(t, d0.Phys(), p, 3*mib)
	x, err := d0.ExportIPC(p, 3*mib)
	require.NoError(t, err)
	base, err := d0.ImportIPC(x)
	require.NoError(t, err)
	assert.NotEqual(t, p-uintptr(x.Offset), base, "a range of its own")
	assert.Equal(t, want, readBack(t, d0.Phys(), base+uintptr(x.Offset), 3*mib))
	require.NoError(t, d0.CloseIPC(base))
	_, err = d1.ImportIPC(x)
	assert.ErrorContains(t, err, "memory of device 0")
}

// A sender whose handles are larger than the receiver's granule (a native
// sender's expandable segments, or another vmm_handle) is opened all the
// same: imports map any multiple of the driver's granularity; a sender
// whose handles are finer than it is refused.
func TestIPCImportOtherHandleSizes(t *testing.T) {
	k := NewFakeKernel()
	snd, sp := ipcProcessGran(t, k, 100, 0, 8*mib)
	rcv, rp := ipcProcess(t, k, 200, 0)
	p := ipcAlloc(t, snd, 12*mib)
	want := cookie(t, sp, p, 12*mib)
	x, err := snd.exportIPC(p, 12*mib)
	require.NoError(t, err)
	assert.Len(t, x.FDs, 2)
	base, err := rcv.importIPC(x)
	require.NoError(t, err)
	assert.Equal(t, want, readBack(t, rp, base+uintptr(x.Offset), 12*mib))
	require.NoError(t, rcv.closeIPC(base))
	assert.Zero(t, rp.Handles())

	fine, _ := ipcProcess(t, k, 300, 0)
	q := ipcAlloc(t, fine, 2*mib)
	y, err := fine.exportIPC(q, 2*mib)
	require.NoError(t, err)
	_, err = snd.importIPC(y)
	assert.ErrorContains(t, err, "not a multiple")
}

// One descriptor stays open per handle shared: a process at its open-files
// limit cannot share more, and the error says how many it holds and what
// to raise; the block, the pool and the descriptors already open stay as
// they were, and go with the handles.
func TestIPCExportPastTheOpenFilesLimit(t *testing.T) {
	k := NewFakeKernel()
	k.SetOpenLimit(3 + 4) // the standard streams and four descriptors
	snd, sp := ipcProcess(t, k, 100, 0)
	p := ipcAlloc(t, snd, 6*mib)
	_, err := snd.exportIPC(p, 6*mib) // three handles
	require.NoError(t, err)
	q := ipcAlloc(t, snd, 6*mib)
	_, err = snd.exportIPC(q, 6*mib) // three more: the second is refused
	require.ErrorContains(t, err, "too many open files")
	require.ErrorContains(t, err, "holds 4 descriptors of shared handles")
	require.ErrorContains(t, err, "ulimit -n")
	assert.Equal(t, 4, k.OpenFDs(100))
	require.NoError(t, snd.checkInvariants())

	k.SetOpenLimit(0)
	_, err = snd.exportIPC(q, 6*mib)
	require.NoError(t, err, "shared once descriptors are available")
	for _, b := range []uintptr{p, q} {
		require.NoError(t, snd.free(b, 6*mib, Stream(1)))
	}
	require.NoError(t, snd.synchronize(func() error { return nil }))
	require.NoError(t, snd.trim(0))
	assert.Zero(t, sp.Handles())
	assert.Zero(t, k.OpenFDs(100), "every descriptor closed with its handle")
}
