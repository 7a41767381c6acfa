package arena

import (
	"fmt"
	"sort"
)

// simPool models a CUDA stream-ordered memory pool (cuMemPool) well enough
// that its reserved high-water mark tracks the real one on real traces.
//
// The model:
//   - Physical memory is reserved in chunks. A request that no free range can
//     hold maps a new chunk of roundUp(size, chunkGranularity), at least
//     minChunk bytes. Reserved is the sum of mapped chunks; Trim unmaps chunks
//     with nothing allocated in them.
//   - Requests are rounded up to allocAlign and placed best-fit (smallest free
//     range that holds them, lowest address on ties) inside the chunks. Freed
//     ranges coalesce with free neighbours of the same chunk; chunks never
//     coalesce with each other (each one is a separate physical mapping).
//   - Stream order: a range freed on stream s is at once reusable by s, and by
//     other streams only once s has completed the free (the pool's
//     "opportunistic reuse"). Until then it sits in s's pending list.
//
// The parameters are set in newSimPool; simpool_test.go and the replay tool's
// --device cuda comparison (BENCHMARKS.md) say how well they match the GPU.
type simPool struct {
	base             uint64 // first address handed out; chunks follow it
	capacity         uint64 // device memory; reserved never exceeds it
	chunkGranularity uint64
	minChunk         uint64
	allocAlign       uint64

	nextAddr uint64 // where the next chunk is mapped (addresses are never reused)

	chunks map[uint64]*simChunk // by start address

	// free holds settled free ranges sorted by (size, start): the best fit
	// for n bytes is the first entry with size >= n.
	free []*simRange
	// byStart and byEnd find a settled free range's neighbours for coalescing.
	byStart map[uint64]*simRange
	byEnd   map[uint64]*simRange
	// pending holds ranges freed on a stream whose free has not completed.
	pending map[Stream][]*simRange
	// used maps a live allocation's address to its range.
	used map[uint64]*simRange

	reserved, reservedHigh uint64
	usedBytes, usedHigh    uint64
}

type simChunk struct {
	start, size uint64
	usedRanges  int // live plus pending ranges inside the chunk
}

type simRange struct {
	start, size uint64
	chunk       *simChunk
	// A pending range was freed on stream at position seq and that free has
	// not completed; it still pins its chunk.
	pending bool
	stream  Stream
	seq     uint64
}

func newSimPool(capacity uint64) *simPool {
	return &simPool{
		base:             0x7f0000000000,
		capacity:         capacity,
		chunkGranularity: 2 << 20,
		minChunk:         2 << 20,
		allocAlign:       512,
		nextAddr:         0x7f0000000000,
		chunks:           map[uint64]*simChunk{},
		byStart:          map[uint64]*simRange{},
		byEnd:            map[uint64]*simRange{},
		pending:          map[Stream][]*simRange{},
		used:             map[uint64]*simRange{},
	}
}

func roundUp(n, align uint64) uint64 { return (n + align - 1) / align * align }

// settle moves every pending range whose free has completed into the free
// index. completed(s) is how far stream s has run.
func (p *simPool) settle(completed func(Stream) uint64) {
	if len(p.pending) == 0 {
		return
	}
	streams := make([]Stream, 0, len(p.pending))
	for s := range p.pending {
		streams = append(streams, s)
	}
	sort.Slice(streams, func(i, j int) bool { return streams[i] < streams[j] }) // deterministic
	for _, s := range streams {
		list := p.pending[s]
		done := completed(s)
		kept := list[:0]
		for _, r := range list {
			if r.seq <= done {
				r.pending = false
				r.chunk.usedRanges--
				p.insertFree(r)
			} else {
				kept = append(kept, r)
			}
		}
		if len(kept) == 0 {
			delete(p.pending, s)
		} else {
			p.pending[s] = kept
		}
	}
}

func (p *simPool) alloc(size uint64, s Stream, completed func(Stream) uint64) (uint64, error) {
	n := roundUp(max(size, 1), p.allocAlign)
	p.settle(completed)
	if r := p.takeFree(n); r != nil {
		return p.use(r, n), nil
	}
	if r := p.takePending(n, s); r != nil {
		return p.use(r, n), nil
	}
	csize := max(roundUp(n, p.chunkGranularity), p.minChunk)
	if p.reserved+csize > p.capacity {
		return 0, fmt.Errorf("sim: pool of %d bytes cannot map %d more (capacity %d): %w",
			p.reserved, csize, p.capacity, ErrOutOfMemory)
	}
	c := &simChunk{start: p.nextAddr, size: csize}
	p.nextAddr += csize + p.chunkGranularity // a gap, so chunks never touch
	p.chunks[c.start] = c
	p.reserved += csize
	p.reservedHigh = max(p.reservedHigh, p.reserved)
	return p.use(&simRange{start: c.start, size: csize, chunk: c}, n), nil
}

// use carves n bytes off the front of the range r, which is free or pending
// on the requesting stream, and marks them used. The rest of a pending range
// stays pending: only its own stream may use it before the free completes.
func (p *simPool) use(r *simRange, n uint64) uint64 {
	if r.size > n {
		rest := &simRange{start: r.start + n, size: r.size - n, chunk: r.chunk}
		if r.pending {
			rest.pending, rest.stream, rest.seq = true, r.stream, r.seq
			r.chunk.usedRanges++
			p.pending[r.stream] = append(p.pending[r.stream], rest)
		} else {
			p.insertFree(rest)
		}
		r.size = n
	}
	if r.pending {
		r.pending = false // it already counts in usedRanges
	} else {
		r.chunk.usedRanges++
	}
	p.used[r.start] = r
	p.usedBytes += n
	p.usedHigh = max(p.usedHigh, p.usedBytes)
	return r.start
}

func (p *simPool) freeRange(ptr uint64, s Stream, seq uint64, completedNow bool) error {
	r, ok := p.used[ptr]
	if !ok {
		return fmt.Errorf("sim: cuMemFreeAsync of %#x, which the pool did not allocate or already freed", ptr)
	}
	delete(p.used, ptr)
	p.usedBytes -= r.size
	if completedNow {
		r.chunk.usedRanges--
		p.insertFree(r)
		return nil
	}
	r.pending, r.stream, r.seq = true, s, seq // still pins its chunk
	p.pending[s] = append(p.pending[s], r)
	return nil
}

// insertFree coalesces r with its free neighbours and indexes the result.
func (p *simPool) insertFree(r *simRange) {
	if left, ok := p.byEnd[r.start]; ok && left.chunk == r.chunk {
		p.removeFree(left)
		r.start, r.size = left.start, left.size+r.size
	}
	if right, ok := p.byStart[r.start+r.size]; ok && right.chunk == r.chunk {
		p.removeFree(right)
		r.size += right.size
	}
	i := p.searchFree(r.size, r.start)
	p.free = append(p.free, nil)
	copy(p.free[i+1:], p.free[i:])
	p.free[i] = r
	p.byStart[r.start] = r
	p.byEnd[r.start+r.size] = r
}

func (p *simPool) searchFree(size, start uint64) int {
	return sort.Search(len(p.free), func(i int) bool {
		f := p.free[i]
		return f.size > size || (f.size == size && f.start >= start)
	})
}

func (p *simPool) removeFree(r *simRange) {
	i := p.searchFree(r.size, r.start)
	if i >= len(p.free) || p.free[i] != r {
		panic("sim: free index out of order")
	}
	p.free = append(p.free[:i], p.free[i+1:]...)
	delete(p.byStart, r.start)
	delete(p.byEnd, r.start+r.size)
}

func (p *simPool) takeFree(n uint64) *simRange {
	i := p.searchFree(n, 0)
	if i == len(p.free) {
		return nil
	}
	r := p.free[i]
	p.removeFree(r)
	return r
}

// takePending finds the best fit among ranges freed on s itself, which s may
// reuse before the free completes: its own later work is ordered after it.
func (p *simPool) takePending(n uint64, s Stream) *simRange {
	list := p.pending[s]
	best := -1
	for i, r := range list {
		if r.size >= n && (best < 0 || r.size < list[best].size) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	r := list[best]
	p.pending[s] = append(list[:best], list[best+1:]...)
	return r
}

// trim unmaps chunks with nothing used or pending in them, largest first,
// until reserved is at most keep.
func (p *simPool) trim(keep uint64, completed func(Stream) uint64) {
	p.settle(completed)
	var empty []*simChunk
	for _, c := range p.chunks {
		if c.usedRanges == 0 {
			empty = append(empty, c)
		}
	}
	sort.Slice(empty, func(i, j int) bool {
		if empty[i].size != empty[j].size {
			return empty[i].size > empty[j].size
		}
		return empty[i].start < empty[j].start
	})
	for _, c := range empty {
		if p.reserved <= keep {
			return
		}
		r := p.byStart[c.start]
		if r == nil || r.size != c.size {
			panic("sim: empty chunk is not one free range")
		}
		p.removeFree(r)
		delete(p.chunks, c.start)
		p.reserved -= c.size
	}
}
