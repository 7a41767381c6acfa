package arena

// PhysHandle is a physical allocation (CUmemGenericAllocationHandle).
type PhysHandle uint64

// PhysDriver is what the VMM placement needs of a device's virtual
// memory management, one driver call per method. Sizes and addresses are
// multiples of Granularity. Calls are made under the placement's lock.
type PhysDriver interface {
	// Granularity is the allocation granularity, a power of two.
	Granularity() uint64
	// ReserveVA reserves size bytes of virtual addresses.
	ReserveVA(size uint64) (uintptr, error)
	// FreeVA gives back a range ReserveVA returned.
	FreeVA(base uintptr, size uint64) error
	// CreateHandle makes size bytes of physical memory; an error wrapping
	// ErrOutOfMemory when the device has no more.
	CreateHandle(size uint64) (PhysHandle, error)
	// ReleaseHandle frees h, which is mapped nowhere.
	ReleaseHandle(h PhysHandle) error
	// Map maps all of h (size bytes) at va.
	Map(va uintptr, size uint64, h PhysHandle) error
	// Unmap drops the mapping of one whole handle at va.
	Unmap(va uintptr, size uint64) error
	// SetAccess grants read-write access to [va, va+size), all mapped, to
	// the device and every peer device that can reach it.
	SetAccess(va uintptr, size uint64) error
	// Events, as Runtime has them.
	NewEvent() (Event, error)
	RecordEvent(e Event, s Stream) error
	EventDone(e Event) (bool, error)
	DestroyEvent(e Event) error
	// CaptureStatus, as Runtime has it: an event is never recorded on a
	// stream being captured (it would join the graph).
	CaptureStatus(s Stream) (CaptureStatus, error)
}

// anyStream is the stream of memory taken outside a capture
// (AllocUncaptured), which any stream may use at once: it has segments of
// its own, and a free of its memory is never one on its segment's stream.
const anyStream = Stream(^uintptr(0) - 1)
