package arena

import "errors"

// OnOutOfMemory is called when an allocation of size bytes failed for lack
// of memory (err wraps ErrOutOfMemory), after attempt earlier retries of the
// same allocation (0 on the first failure). It may free memory, and says
// whether to try again.
type OnOutOfMemory func(size uint64, attempt int, err error) (retry bool)

// Retrying is a MemorySource that, when an allocation runs out of memory,
// calls a hook that can free memory and asks again while the hook says so,
// in the manner of RMM's failure_callback_resource_adaptor. Other failures
// are returned at once: freeing memory cannot cure a broken driver.
//
// The hook runs on the allocating goroutine, with whatever locks the caller
// holds, so it may free through the same stack (Retrying holds no lock of
// its own) but must not take the caller's locks again.
type Retrying struct {
	MemorySource
	onOOM OnOutOfMemory
}

// NewRetrying calls onOOM on every out-of-memory of src's allocations.
func NewRetrying(src MemorySource, onOOM OnOutOfMemory) *Retrying {
	return &Retrying{MemorySource: src, onOOM: onOOM}
}

func (r *Retrying) Alloc(size uint64, s Stream) (uintptr, error) {
	for attempt := 0; ; attempt++ {
		p, err := r.MemorySource.Alloc(size, s)
		if err == nil || !errors.Is(err, ErrOutOfMemory) || !r.onOOM(size, attempt, err) {
			return p, err
		}
	}
}

func (r *Retrying) AllocUncaptured(size uint64) (uintptr, error) {
	for attempt := 0; ; attempt++ {
		p, err := r.MemorySource.AllocUncaptured(size)
		if err == nil || !errors.Is(err, ErrOutOfMemory) || !r.onOOM(size, attempt, err) {
			return p, err
		}
	}
}
