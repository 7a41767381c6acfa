package reference

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/units"
)

// Passthrough sends every request to the device and every free straight
// back: the pool on its own, with no cache above it.
type Passthrough struct {
	dev arena.Device
	// live maps a pointer to the size it was allocated with, which the
	// device wants back with the free.
	live     map[uintptr]uint64
	reserved reserve
}

// NewPassthrough makes the no-caching policy over dev.
func NewPassthrough(dev arena.Device) *Passthrough {
	return &Passthrough{dev: dev, live: map[uintptr]uint64{}}
}

// Malloc allocates from the device, ordered on s.
func (a *Passthrough) Malloc(size uint64, s arena.Stream) (uintptr, error) {
	if err := checkSize("passthrough", size); err != nil {
		return 0, err
	}
	n := units.RoundUp(max(size, 1), minBlock)
	// Nothing is cached to give back, but the pool may hold freed memory
	// that trimming returns to the driver, so the retry can still help.
	p, err := deviceAlloc(a.dev, n, s, func() error { return nil })
	if err != nil {
		return 0, fmt.Errorf("passthrough: malloc of %d bytes on stream %#x: %w", size, s, err)
	}
	a.live[p] = n
	a.reserved.add(n)
	return p, nil
}

// Free returns the block to the device, ordered on s.
func (a *Passthrough) Free(ptr uintptr, size uint64, s arena.Stream) error {
	n, ok := a.live[ptr]
	if !ok {
		return fmt.Errorf("passthrough: free of %#x: %w", ptr, ErrUnknownPointer)
	}
	if err := a.dev.Free(ptr, n, s); err != nil {
		return fmt.Errorf("passthrough: %w", err)
	}
	delete(a.live, ptr)
	a.reserved.sub(n)
	return nil
}

// Fragmentation is empty apart from the pool's figures: passthrough caches
// nothing. Its waste is inside the pool, where it shows as pool reserved
// against live.
func (a *Passthrough) Fragmentation() Fragmentation { return fragmentation(a.dev, 0, 0) }

// PeakReserved is the most bytes allocated from the device at once.
func (a *Passthrough) PeakReserved() uint64 { return a.reserved.peak }

// Close closes the device.
func (a *Passthrough) Close() error { return a.dev.Close() }
