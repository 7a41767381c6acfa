package reference

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/units"
)

// PyTorch's constants, named as in CUDACachingAllocator.cpp.
const (
	nativeSmallSize   = 1 << 20  // kSmallSize: largest request served by the small pool
	nativeSmallBuffer = 2 << 20  // kSmallBuffer: segment size of the small pool
	nativeLargeBuffer = 20 << 20 // kLargeBuffer: segment for requests between 1 and 10 MiB
	nativeMinLarge    = 10 << 20 // kMinLargeAlloc: from here a request gets its own segment
	nativeRoundLarge  = 2 << 20  // kRoundLarge: what such a segment is rounded up to
)

// Native is PyTorch's CUDACachingAllocator with its default configuration
// (see the package doc for the rules it follows).
type Native struct {
	dev     arena.Device
	streams map[arena.Stream]*nativeStream
	last    *nativeStream // the stream used most recently, checked first
	// live finds a handed-out block by its address.
	live      map[uintptr]*nblock
	reserved  reserve // segment bytes held from the device
	allocated reserve // block bytes handed out: PyTorch's allocated_bytes
}

// nativeStream holds one stream's two pools of free blocks, each indexed by
// (size, address) for best fit: PyTorch's BlockComparatorSize.
type nativeStream struct {
	stream       arena.Stream
	small, large ordered[*nblock]
}

// An nblock is a piece of a segment, free or handed out. The blocks of a
// segment are linked in address order, so a freed block finds its neighbours.
type nblock struct {
	addr       uintptr
	size       uint64
	stream     arena.Stream
	small      bool // in the small pool
	free       bool // in its pool's free index
	prev, next *nblock
}

// NewNative makes PyTorch's native allocator over dev.
func NewNative(dev arena.Device) *Native {
	return &Native{dev: dev, streams: map[arena.Stream]*nativeStream{}, live: map[uintptr]*nblock{}}
}

func (a *Native) stream(s arena.Stream) *nativeStream {
	if a.last != nil && a.last.stream == s {
		return a.last
	}
	st, ok := a.streams[s]
	if !ok {
		st = &nativeStream{stream: s, small: ordered[*nblock]{rng: uint64(s)}, large: ordered[*nblock]{rng: ^uint64(s)}}
		a.streams[s] = st
	}
	a.last = st
	return st
}

func (st *nativeStream) pool(small bool) *ordered[*nblock] {
	if small {
		return &st.small
	}
	return &st.large
}

// nativeSegmentSize is get_allocation_size: what a miss of n bytes maps.
func nativeSegmentSize(n uint64) uint64 {
	switch {
	case n <= nativeSmallSize:
		return nativeSmallBuffer
	case n < nativeMinLarge:
		return nativeLargeBuffer
	}
	return units.RoundUp(n, nativeRoundLarge)
}

// nativeShouldSplit is should_split: whether a free block of size bytes
// serving n of them keeps the rest as a block of its own.
func nativeShouldSplit(size, n uint64, small bool) bool {
	rest := size - n
	if small {
		return rest >= minBlock
	}
	return rest > nativeSmallSize
}

// Malloc is the native allocator's malloc: best fit in the request's pool
// and stream, a new segment on a miss, then the split.
func (a *Native) Malloc(size uint64, s arena.Stream) (uintptr, error) {
	if err := checkSize("native", size); err != nil {
		return 0, err
	}
	n := units.RoundUp(max(size, 1), minBlock)
	small := n <= nativeSmallSize
	pool := a.stream(s).pool(small)
	var b *nblock
	if nd := pool.ceil(n, 0); nd != nil {
		b = nd.val
		pool.remove(b.size, uint64(b.addr))
	} else {
		seg := nativeSegmentSize(n)
		p, err := deviceAlloc(a.dev, seg, s, a.releaseCached)
		if err != nil {
			return 0, fmt.Errorf("native: malloc of %d bytes on stream %#x: %w", size, s, err)
		}
		a.reserved.add(seg)
		b = &nblock{addr: p, size: seg, stream: s, small: small}
	}
	if nativeShouldSplit(b.size, n, small) {
		// The block keeps the low addresses; the rest stays free after it.
		rest := &nblock{addr: b.addr + uintptr(n), size: b.size - n, stream: s, small: small,
			free: true, prev: b, next: b.next}
		if b.next != nil {
			b.next.prev = rest
		}
		b.next, b.size = rest, n
		pool.insert(rest.size, uint64(rest.addr), rest)
	}
	b.free = false
	a.live[b.addr] = b
	a.allocated.add(b.size)
	return b.addr, nil
}

// Free takes the block back by its pointer alone, as PyTorch does: size and
// stream are the block's own.
func (a *Native) Free(ptr uintptr, size uint64, s arena.Stream) error {
	b, ok := a.live[ptr]
	if !ok {
		return fmt.Errorf("native: free of %#x: %w", ptr, ErrUnknownPointer)
	}
	delete(a.live, ptr)
	a.allocated.sub(b.size)
	pool := a.stream(b.stream).pool(b.small)
	if p := b.prev; p != nil && p.free {
		pool.remove(p.size, uint64(p.addr))
		p.size += b.size
		p.next = b.next
		if b.next != nil {
			b.next.prev = p
		}
		b = p
	}
	if nx := b.next; nx != nil && nx.free {
		pool.remove(nx.size, uint64(nx.addr))
		b.size += nx.size
		b.next = nx.next
		if nx.next != nil {
			nx.next.prev = b
		}
	}
	b.free = true
	pool.insert(b.size, uint64(b.addr), b)
	return nil
}

// releaseCached gives every fully free segment back to the device: the
// blocks that are free and were never split, or have merged back whole.
func (a *Native) releaseCached() error {
	var whole []*nblock
	for _, st := range a.streams {
		for _, pool := range []*ordered[*nblock]{&st.small, &st.large} {
			pool.each(func(_, _ uint64, b *nblock) {
				if b.prev == nil && b.next == nil {
					whole = append(whole, b)
				}
			})
		}
	}
	for _, b := range whole {
		if err := a.dev.Free(b.addr, b.size, b.stream); err != nil {
			return err
		}
		a.stream(b.stream).pool(b.small).remove(b.size, uint64(b.addr))
		a.reserved.sub(b.size)
	}
	return nil
}

// Fragmentation reports the free blocks of every pool of every stream.
func (a *Native) Fragmentation() Fragmentation {
	var free, largest uint64
	for _, st := range a.streams {
		for _, pool := range []*ordered[*nblock]{&st.small, &st.large} {
			pool.each(func(size, _ uint64, _ *nblock) {
				free += size
				largest = max(largest, size)
			})
		}
	}
	return fragmentation(a.dev, free, largest)
}

// PeakReserved is PyTorch's reserved_bytes.all.peak: the most segment bytes held.
func (a *Native) PeakReserved() uint64 { return a.reserved.peak }

// PeakAllocated is PyTorch's allocated_bytes.all.peak: block sizes, so a
// request counts with the unsplit rest of its block (up to 1 MiB more).
func (a *Native) PeakAllocated() uint64 { return a.allocated.peak }

// Close closes the device; the segments go with its pool.
func (a *Native) Close() error { return a.dev.Close() }

// HoldsSegments: Native takes whole segments, as cudaMalloc would (SegmentHolder).
func (a *Native) HoldsSegments() {}
