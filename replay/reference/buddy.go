package reference

import (
	"errors"
	"fmt"
	"math/bits"

	"github.com/goalloc/goalloc/arena"
)

// DefaultArenaSize is what the buddy policy takes from the device at a time.
const DefaultArenaSize = 1 << 30

// Buddy is a binary buddy allocator (see the package doc).
type Buddy struct {
	dev        arena.Device
	arenaOrder uint8 // order of a default arena: its size is minBlock << arenaOrder
	streams    map[arena.Stream]*buddyStream
	last       *buddyStream
	// free and live find a block by its address: free ones so that a freed
	// block can look its buddy up, live ones so that Free knows the block.
	free      map[uintptr]buddyBlock
	live      map[uintptr]buddyBlock
	reserved  reserve // arena bytes held from the device
	allocated reserve // block bytes handed out
}

// buddyStream indexes the free blocks of one stream's arenas by
// (order, address): the smallest order that fits, lowest address first.
type buddyStream struct {
	stream arena.Stream
	index  ordered[*buddyArena]
}

type buddyArena struct {
	base   uintptr
	order  uint8
	stream arena.Stream
}

type buddyBlock struct {
	arena *buddyArena
	order uint8
}

// NewBuddy makes a buddy allocator over dev that takes arenas of arenaSize
// bytes (rounded up to a power of two) from it.
func NewBuddy(dev arena.Device, arenaSize uint64) *Buddy {
	return &Buddy{dev: dev, arenaOrder: orderOf(arenaSize), streams: map[arena.Stream]*buddyStream{},
		free: map[uintptr]buddyBlock{}, live: map[uintptr]buddyBlock{}}
}

// orderOf is the order of the smallest power-of-two block, from minBlock
// bytes up, that holds n bytes.
func orderOf(n uint64) uint8 {
	if n <= minBlock {
		return 0
	}
	return uint8(bits.Len64((n - 1) / minBlock))
}

func blockSize(order uint8) uint64 { return minBlock << order }

func (a *Buddy) stream(s arena.Stream) *buddyStream {
	if a.last != nil && a.last.stream == s {
		return a.last
	}
	st, ok := a.streams[s]
	if !ok {
		st = &buddyStream{stream: s, index: ordered[*buddyArena]{rng: uint64(s)}}
		a.streams[s] = st
	}
	a.last = st
	return st
}

func (a *Buddy) addFree(st *buddyStream, addr uintptr, order uint8, ar *buddyArena) {
	a.free[addr] = buddyBlock{ar, order}
	st.index.insert(uint64(order), uint64(addr), ar)
}

func (a *Buddy) removeFree(st *buddyStream, addr uintptr, order uint8) {
	delete(a.free, addr)
	st.index.remove(uint64(order), uint64(addr))
}

// Malloc takes the smallest free block of the request's order or above,
// lowest address first, from the stream's arenas (a new arena on a miss), and
// halves it down to the request's order.
func (a *Buddy) Malloc(size uint64, s arena.Stream) (uintptr, error) {
	if err := checkSize("buddy", size); err != nil {
		return 0, err
	}
	k := orderOf(size)
	st := a.stream(s)
	nd := st.index.ceil(uint64(k), 0)
	if nd == nil {
		order := max(a.arenaOrder, k)
		p, err := deviceAlloc(a.dev, blockSize(order), s, a.releaseCached)
		if order > k && errors.Is(err, arena.ErrOutOfMemory) {
			// No room for a whole arena: take an arena of just this block.
			order = k
			p, err = deviceAlloc(a.dev, blockSize(order), s, a.releaseCached)
		}
		if err != nil {
			return 0, fmt.Errorf("buddy: malloc of %d bytes on stream %#x: %w", size, s, err)
		}
		a.reserved.add(blockSize(order))
		a.addFree(st, p, order, &buddyArena{base: p, order: order, stream: s})
		nd = st.index.ceil(uint64(k), 0)
	}
	order, addr, ar := uint8(nd.k1), uintptr(nd.k2), nd.val
	a.removeFree(st, addr, order)
	// Split down to order k, keeping the low half each time.
	for order > k {
		order--
		a.addFree(st, addr+uintptr(blockSize(order)), order, ar)
	}
	a.live[addr] = buddyBlock{ar, k}
	a.allocated.add(blockSize(k))
	return addr, nil
}

// Free takes the block back by its pointer; its size and stream are known.
func (a *Buddy) Free(ptr uintptr, size uint64, s arena.Stream) error {
	b, ok := a.live[ptr]
	if !ok {
		return fmt.Errorf("buddy: free of %#x: %w", ptr, ErrUnknownPointer)
	}
	delete(a.live, ptr)
	a.allocated.sub(blockSize(b.order))
	ar, addr, order := b.arena, ptr, b.order
	st := a.stream(ar.stream)
	for order < ar.order {
		buddy := ar.base + ((addr - ar.base) ^ uintptr(blockSize(order)))
		if f, ok := a.free[buddy]; !ok || f.order != order {
			break // the buddy, or part of it, is in use
		}
		a.removeFree(st, buddy, order)
		addr = min(addr, buddy)
		order++
	}
	a.addFree(st, addr, order, ar)
	return nil
}

// releaseCached gives every wholly free arena back to the device.
func (a *Buddy) releaseCached() error {
	var whole []*buddyArena
	for _, st := range a.streams {
		st.index.each(func(order, addr uint64, ar *buddyArena) {
			if uint8(order) == ar.order {
				whole = append(whole, ar)
			}
		})
	}
	for _, ar := range whole {
		if err := a.dev.Free(ar.base, blockSize(ar.order), ar.stream); err != nil {
			return err
		}
		a.removeFree(a.stream(ar.stream), ar.base, ar.order)
		a.reserved.sub(blockSize(ar.order))
	}
	return nil
}

// Fragmentation reports the free blocks of every arena. Rounding waste
// inside handed-out blocks is not free memory and does not show here; it
// shows as reserved against live.
func (a *Buddy) Fragmentation() Fragmentation {
	var free, largest uint64
	for _, st := range a.streams {
		st.index.each(func(order, _ uint64, _ *buddyArena) {
			free += blockSize(uint8(order))
			largest = max(largest, blockSize(uint8(order)))
		})
	}
	return fragmentation(a.dev, free, largest)
}

// PeakReserved is the most arena bytes held at once.
func (a *Buddy) PeakReserved() uint64 { return a.reserved.peak }

// PeakAllocated is the most block bytes (powers of two) handed out at once.
func (a *Buddy) PeakAllocated() uint64 { return a.allocated.peak }

// Close closes the device; the arenas go with its pool.
func (a *Buddy) Close() error { return a.dev.Close() }

// HoldsSegments: Buddy takes whole segments, as cudaMalloc would (SegmentHolder).
func (a *Buddy) HoldsSegments() {}
