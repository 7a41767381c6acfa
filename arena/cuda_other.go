//go:build !(linux && cgo)

// Without cgo on Linux there is no way to reach libcuda.so.1: this file keeps
// the CUDA API so everything compiles, and every entry point says why it
// cannot work. The real implementation is cuda.go.

package arena

import "errors"

var errNoCUDA = errors.New("goalloc was built without cgo/linux; the CUDA device is unavailable; use GOALLOC_DEVICE=sim")

// CUDA is unavailable in this build; see cuda.go for the real device.
type CUDA struct{}

var _ Device = (*CUDA)(nil)

// CUDADeviceCount always fails in this build.
func CUDADeviceCount() (int, error) { return 0, errNoCUDA }

// NewCUDA always fails in this build.
func NewCUDA(ordinal int, releaseThreshold uint64) (*CUDA, error) { return nil, errNoCUDA }

func (d *CUDA) Ordinal() int                                  { return 0 }
func (d *CUDA) Name() string                                  { return "cuda" }
func (d *CUDA) Alloc(size uint64, s Stream) (uintptr, error)  { return 0, errNoCUDA }
func (d *CUDA) Free(ptr uintptr, size uint64, s Stream) error { return errNoCUDA }
func (d *CUDA) AllocUncaptured(size uint64) (uintptr, error)  { return 0, errNoCUDA }
func (d *CUDA) FreeUncaptured(ptr uintptr, size uint64) error { return errNoCUDA }
func (d *CUDA) Trim(keep uint64) error                        { return errNoCUDA }
func (d *CUDA) SetReleaseThreshold(bytes uint64) error        { return errNoCUDA }
func (d *CUDA) PoolUsage() (PoolUsage, error)                 { return PoolUsage{}, errNoCUDA }
func (d *CUDA) ResetPoolHigh() error                          { return errNoCUDA }
func (d *CUDA) MemInfo() (free, total uint64, err error)      { return 0, 0, errNoCUDA }
func (d *CUDA) NewEvent() (Event, error)                      { return 0, errNoCUDA }
func (d *CUDA) RecordEvent(e Event, s Stream) error           { return errNoCUDA }
func (d *CUDA) EventDone(e Event) (bool, error)               { return false, errNoCUDA }
func (d *CUDA) DestroyEvent(e Event) error                    { return errNoCUDA }
func (d *CUDA) Synchronize() error                            { return errNoCUDA }
func (d *CUDA) CaptureStatus(s Stream) (CaptureStatus, error) { return CaptureNone, errNoCUDA }
func (d *CUDA) Close() error                                  { return nil }

// PeersGranted lists no device in this build.
func (d *CUDA) PeersGranted() ([]int, error) { return nil, errNoCUDA }

// PeerAccess always fails in this build.
func (d *CUDA) PeerAccess(peer int) (bool, error) { return false, errNoCUDA }

// VMM is unavailable in this build; see vmm_cuda.go for the real device.
type VMM struct{}

var _ Device = (*VMM)(nil)

// NewVMM always fails in this build.
func NewVMM(ordinal int) (*VMM, error) { return nil, errNoCUDA }

// NewVMMWith always fails in this build.
func NewVMMWith(ordinal int, l VMMLayout) (*VMM, error) { return nil, errNoCUDA }

func (d *VMM) Ordinal() int                                  { return 0 }
func (d *VMM) Name() string                                  { return "cuda" }
func (d *VMM) Alloc(size uint64, s Stream) (uintptr, error)  { return 0, errNoCUDA }
func (d *VMM) Free(ptr uintptr, size uint64, s Stream) error { return errNoCUDA }
func (d *VMM) AllocUncaptured(size uint64) (uintptr, error)  { return 0, errNoCUDA }
func (d *VMM) Trim(keep uint64) error                        { return errNoCUDA }
func (d *VMM) SetReleaseThreshold(bytes uint64) error        { return errNoCUDA }
func (d *VMM) PoolUsage() (PoolUsage, error)                 { return PoolUsage{}, errNoCUDA }
func (d *VMM) ResetPoolHigh() error                          { return errNoCUDA }
func (d *VMM) MemInfo() (free, total uint64, err error)      { return 0, 0, errNoCUDA }
func (d *VMM) NewEvent() (Event, error)                      { return 0, errNoCUDA }
func (d *VMM) RecordEvent(e Event, s Stream) error           { return errNoCUDA }
func (d *VMM) EventDone(e Event) (bool, error)               { return false, errNoCUDA }
func (d *VMM) DestroyEvent(e Event) error                    { return errNoCUDA }
func (d *VMM) Synchronize() error                            { return errNoCUDA }
func (d *VMM) CaptureStatus(s Stream) (CaptureStatus, error) { return CaptureNone, errNoCUDA }
func (d *VMM) Close() error                                  { return nil }
func (d *VMM) SetCap(limit uint64)                           {}
func (d *VMM) SetAllocTag(tag Tag)                           {}
func (d *VMM) Sleep(SleepRequest) (SleepReport, error)       { return SleepReport{}, errNoCUDA }
func (d *VMM) Wake(Tag) (WakeReport, error)                  { return WakeReport{}, errNoCUDA }
func (d *VMM) SleepState() SleepState                        { return SleepState{} }
func (d *VMM) PrepareOffload(uint64) (uint64, error)         { return 0, errNoCUDA }

// PeersGranted lists no device in this build.
func (d *VMM) PeersGranted() ([]int, error) { return nil, errNoCUDA }
