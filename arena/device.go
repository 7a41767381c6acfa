// Package arena is where device memory comes from: one thin layer over every
// driver primitive goalloc uses, behind two narrow interfaces: a
// MemorySource (allocate, allocate outside a capture, free, trim, the pool's
// usage and high-water marks) and a Runtime (events, capture status,
// synchronisation, memory info). A Device is both, for one GPU.
//
// The implementations live here and nowhere else:
//
//   - CUDA (cuda.go; the C wrappers in cuda_driver.h/.c; test hooks in
//     cuda_testhooks.go behind the goalloc_cudatest build tag): libcuda.so.1 opened with dlopen at run time, so the
//     library builds on a machine with no CUDA toolkit. Memory comes from a
//     private stream-ordered memory pool per device (cuMemPoolCreate, release
//     threshold at its maximum) through cuMemAllocFromPoolAsync and
//     cuMemFreeAsync. Every call first makes the device's primary context
//     current when the calling thread has none: PyTorch's autograd thread
//     arrives with no context (a stream-ordered call there returns
//     CUDA_ERROR_INVALID_CONTEXT).
//   - VMM (vmm_cuda.go, over vmm_source.go and the segments placement,
//     whose overview is vmm.go): the same driver, but physical memory
//     comes as handles (cuMemCreate) that goalloc maps where it likes, so
//     what the device holds is exactly what goalloc says it holds. Chosen with
//     GOALLOC_CONF=backend:vmm; it shares the CUDA device's runtime half
//     (cudaRuntime).
//   - SimVMM (sim_vmm.go): the simulated device with the VMM backend, the
//     same engine over an in-memory driver (vmm_fake.go).
//   - Sim (sim.go, simpool.go): a simulated device for tests and the replay
//     tool. Addresses are fake, non-overlapping and 512-byte aligned; streams
//     and events complete when a test says so (or at once in auto mode); the
//     pool is modelled closely enough that its reserved high-water mark tracks
//     the real pool's (see simpool.go for the model and how it was checked).
//
// Behaviour that does not depend on the backend is stacked on a MemorySource
// as small adaptors, each a MemorySource itself (RAPIDS RMM's resource
// adaptors are the model): Limited (limit.go) refuses to hold more than a
// cap, PoolCapped (poolcap.go) bounds what a stream-ordered pool holds by
// that cap (the pool places memory itself, in chunks), Counting (counting.go) counts the calls that succeed and the bytes
// held, with their high-water mark, and Retrying (oomretry.go) calls a hook
// that can free memory when an allocation runs out of it. The caching layer
// builds its stack under its cache, so a cache hit never reaches one.
//
// Everything above this package (caching, streams, export) sees only Device,
// so all of it is plain Go, testable without CUDA. Device pointers are uintptr,
// never Go pointers: the Go garbage collector must never see or move them.
package arena

import (
	"errors"
	"fmt"
)

// Stream is a CUDA stream handle exactly as PyTorch passes it (cudaStream_t,
// which is CUstream). 0 is the legacy default stream.
type Stream uintptr

// Event is an opaque handle to an event that can be recorded on a stream.
type Event uintptr

// PoolUsage is the driver pool's own view of its memory, which may differ
// from the caching layer's accounting: the pool also holds memory that was
// freed to it and not yet released, and its own internal fragmentation.
type PoolUsage struct {
	ReservedCurrent uint64 // CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
	ReservedHigh    uint64 // CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
	UsedCurrent     uint64 // CU_MEMPOOL_ATTR_USED_MEM_CURRENT
	UsedHigh        uint64 // CU_MEMPOOL_ATTR_USED_MEM_HIGH
}

// CaptureStatus says whether a stream is being captured into a CUDA graph.
type CaptureStatus int

const (
	CaptureNone        CaptureStatus = 0 // CU_STREAM_CAPTURE_STATUS_NONE
	CaptureActive      CaptureStatus = 1 // CU_STREAM_CAPTURE_STATUS_ACTIVE
	CaptureInvalidated CaptureStatus = 2 // CU_STREAM_CAPTURE_STATUS_INVALIDATED
)

// MemorySource is where a device's memory comes from. Implementations are
// safe for concurrent use; the caching layer still calls them under its own
// lock, so they need not be fast under contention, only correct.
//
// Stream-ordered semantics, as the CUDA pool defines them: memory freed on
// stream s may be handed out again at once to work on s, and to other streams
// only once the free has completed on s (or the pool makes them wait for it).
type MemorySource interface {
	// Alloc takes size bytes from the device's pool, ordered on stream s.
	// It returns an error wrapping ErrOutOfMemory when the pool cannot grow.
	Alloc(size uint64, s Stream) (uintptr, error)
	// AllocUncaptured takes size bytes for a stream that is being captured
	// into a CUDA graph, without adding anything to the graph: the memory
	// is ready for any stream's work when it returns.
	AllocUncaptured(size uint64) (uintptr, error)
	// Free returns ptr, which Alloc returned for size bytes, to the pool,
	// ordered on stream s.
	Free(ptr uintptr, size uint64, s Stream) error
	// Trim releases pool memory that no allocation uses back to the driver,
	// keeping at least keep bytes reserved.
	Trim(keep uint64) error
	// SetReleaseThreshold sets how many unused bytes the pool may keep across
	// synchronisations before the driver releases them.
	SetReleaseThreshold(bytes uint64) error
	// PoolUsage reads the pool's own reserved and used figures.
	PoolUsage() (PoolUsage, error)
	// ResetPoolHigh resets the pool's two high-water marks to the current values.
	ResetPoolHigh() error
}

// Runtime is what the caching layer needs of the device besides memory:
// events to know when streams are done with a block, capture status, and
// device-wide synchronisation and memory figures.
type Runtime interface {
	// NewEvent creates an event with timing disabled.
	NewEvent() (Event, error)
	// RecordEvent records e on stream s.
	RecordEvent(e Event, s Stream) error
	// EventDone polls e without blocking.
	EventDone(e Event) (bool, error)
	// DestroyEvent releases e.
	DestroyEvent(e Event) error
	// Synchronize waits for all work on the device. Used only by explicit
	// user calls (empty_cache) and as the last step before declaring an
	// out-of-memory.
	Synchronize() error
	// CaptureStatus says whether s is being captured into a CUDA graph.
	CaptureStatus(s Stream) (CaptureStatus, error)
	// MemInfo is cuMemGetInfo: free and total bytes on the device.
	MemInfo() (free, total uint64, err error)
}

// Device is one GPU: its memory source and its runtime.
type Device interface {
	MemorySource
	Runtime
	// Ordinal is the device index, as PyTorch numbers devices.
	Ordinal() int
	// Close destroys the pool. Memory still allocated from it is lost.
	Close() error
}

// ErrOutOfMemory is wrapped by every error that means "the device or its pool
// could not provide the memory", as opposed to a broken driver or bad input.
var ErrOutOfMemory = errors.New("out of device memory")

// DriverError is a failed driver call with its CUresult.
type DriverError struct {
	Op   string // the driver function, e.g. "cuMemAllocFromPoolAsync"
	Code int    // CUresult
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY", when the driver can name it
}

// CUresult values goalloc reacts to.
const (
	cudaErrorOutOfMemory              = 2
	cudaErrorNotReady                 = 600
	cudaErrorStreamCaptureUnsupported = 900
)

func (e *DriverError) Error() string {
	if e.Name != "" {
		return fmt.Sprintf("%s failed: %s (%d)", e.Op, e.Name, e.Code)
	}
	return fmt.Sprintf("%s failed: CUresult %d", e.Op, e.Code)
}

// Is makes errors.Is(err, ErrOutOfMemory) true for CUDA_ERROR_OUT_OF_MEMORY.
func (e *DriverError) Is(target error) bool {
	return target == ErrOutOfMemory && e.Code == cudaErrorOutOfMemory
}
