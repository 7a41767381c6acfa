package reference

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// Fixed caches power-of-two blocks per class and stream (see the package doc).
type Fixed struct {
	dev     arena.Device
	streams map[arena.Stream]*fixedStream
	last    *fixedStream
	// live maps a handed-out block to its class and stream.
	live      map[uintptr]fixedBlock
	reserved  reserve
	allocated reserve
}

// fixedClasses covers every order orderOf returns for a request up to
// caching.MaxRequest (2^48 bytes = minBlock << 39).
const fixedClasses = 40

type fixedStream struct {
	stream arena.Stream
	// free[c] is a stack of cached blocks of blockSize(c) bytes.
	free [fixedClasses][]uintptr
}

type fixedBlock struct {
	class  uint8
	stream arena.Stream
}

// NewFixed makes the fixed-size-class policy over dev.
func NewFixed(dev arena.Device) *Fixed {
	return &Fixed{dev: dev, streams: map[arena.Stream]*fixedStream{}, live: map[uintptr]fixedBlock{}}
}

func (a *Fixed) stream(s arena.Stream) *fixedStream {
	if a.last != nil && a.last.stream == s {
		return a.last
	}
	st, ok := a.streams[s]
	if !ok {
		st = &fixedStream{stream: s}
		a.streams[s] = st
	}
	a.last = st
	return st
}

// Malloc takes a cached block of the request's class on its stream, or a
// new one from the device.
func (a *Fixed) Malloc(size uint64, s arena.Stream) (uintptr, error) {
	if err := checkSize("fixed", size); err != nil {
		return 0, err
	}
	c := orderOf(size)
	st := a.stream(s)
	var p uintptr
	if list := st.free[c]; len(list) > 0 {
		p = list[len(list)-1]
		st.free[c] = list[:len(list)-1]
	} else {
		var err error
		p, err = deviceAlloc(a.dev, blockSize(c), s, a.releaseCached)
		if err != nil {
			return 0, fmt.Errorf("fixed: malloc of %d bytes on stream %#x: %w", size, s, err)
		}
		a.reserved.add(blockSize(c))
	}
	a.live[p] = fixedBlock{c, s}
	a.allocated.add(blockSize(c))
	return p, nil
}

// Free caches the block in its class's list for the stream it came from.
func (a *Fixed) Free(ptr uintptr, size uint64, s arena.Stream) error {
	b, ok := a.live[ptr]
	if !ok {
		return fmt.Errorf("fixed: free of %#x: %w", ptr, ErrUnknownPointer)
	}
	delete(a.live, ptr)
	a.allocated.sub(blockSize(b.class))
	st := a.stream(b.stream)
	st.free[b.class] = append(st.free[b.class], ptr)
	return nil
}

// releaseCached gives every cached block back to the device.
func (a *Fixed) releaseCached() error {
	for _, st := range a.streams {
		for c := range st.free {
			for len(st.free[c]) > 0 {
				list := st.free[c]
				if err := a.dev.Free(list[len(list)-1], blockSize(uint8(c)), st.stream); err != nil {
					return err
				}
				st.free[c] = list[:len(list)-1]
				a.reserved.sub(blockSize(uint8(c)))
			}
		}
	}
	return nil
}

// Fragmentation reports the cached blocks: the largest request they can
// serve is the largest class with a cached block.
func (a *Fixed) Fragmentation() Fragmentation {
	var free, largest uint64
	for _, st := range a.streams {
		for c, list := range st.free {
			if len(list) > 0 {
				free += uint64(len(list)) * blockSize(uint8(c))
				largest = max(largest, blockSize(uint8(c)))
			}
		}
	}
	return fragmentation(a.dev, free, largest)
}

// PeakReserved is the most block bytes held from the device at once.
func (a *Fixed) PeakReserved() uint64 { return a.reserved.peak }

// PeakAllocated is the most block bytes (powers of two) handed out at once.
func (a *Fixed) PeakAllocated() uint64 { return a.allocated.peak }

// Close closes the device; the cached blocks go with its pool.
func (a *Fixed) Close() error { return a.dev.Close() }

// HoldsSegments: Fixed takes whole segments, as cudaMalloc would (SegmentHolder).
func (a *Fixed) HoldsSegments() {}
