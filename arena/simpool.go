package arena

import (
	"fmt"
	"sort"
)

// simPool models a CUDA stream-ordered memory pool (cuMemPool) closely
// enough that its reserved high-water mark tracks the real one on real
// traces. The model comes from tests/gpu/probe_pool.py, run on an H200 with
// driver 580 (its output is summarised in BENCHMARKS.md):
//
//   - The pool hands out addresses from one contiguous virtual range, packing
//     allocations at 512-byte granularity: a run of 3 MiB allocations sat at
//     offsets 0, 3, 6, ... 33 MiB, straddling physical chunks.
//   - Physical memory backs that range in 32 MiB chunks, mapped when any byte
//     in them is first used: one 512-byte allocation reserved 32 MiB, a 32 MiB
//     one 32 MiB, 32 MiB + 512 bytes 64 MiB, 1 GiB + 512 bytes 1056 MiB.
//     Chunks stay mapped (the release threshold is at its maximum) until
//     Trim, which unmaps chunks with nothing allocated or pending in them.
//   - Freed ranges coalesce with free neighbours (10 MiB + 10 MiB freed, then
//     a 20 MiB request, took the same address and reserved nothing) and are
//     split for smaller requests. A request takes the best fit among the free
//     ranges (smallest that holds it, lowest address on ties); if none holds
//     it, it goes at the end of the range in use, reusing a free tail.
//   - Stream order: a range freed on stream s is at once reusable by s, and by
//     other streams only once s has completed the free (the pool's
//     opportunistic reuse). Until then it sits in s's pending list and still
//     pins its chunks.
//
// Replaying the shipped traces straight onto this model gives the reserved
// high-water marks BENCHMARKS.md compares with the GPU's.
type simPool struct {
	base       uint64 // the first address of the virtual range (chunk aligned)
	capacity   uint64 // device memory; reserved never exceeds it
	chunkSize  uint64 // physical mapping granularity
	allocAlign uint64

	// top is the end of the highest range ever allocated: [base, top) is
	// the part of the virtual range the pool has used.
	top uint64
	// chunkUsed[i] counts the bytes of chunk i allocated or pending;
	// mapped[i] says whether chunk i is backed by physical memory.
	chunkUsed []uint64
	mapped    []bool

	// free holds settled free ranges inside [base, top) sorted by
	// (size, start): the best fit for n bytes is the first with size >= n.
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

type simRange struct {
	start, size uint64
	// A pending range was freed on stream at position seq and that free has
	// not completed; it still pins its chunks.
	pending bool
	stream  Stream
	seq     uint64
}

// simChunkSize is the real pool's physical granularity (probe_pool.py).
const simChunkSize = 32 << 20

// simBase is where device 0's addresses start; device d's start d TiB
// further, so that no two simulated devices share an address, as no two
// GPUs do under CUDA's unified addressing.
const simBase = 0x100000000000

func newSimPool(ordinal int, capacity uint64) *simPool {
	base := uint64(simBase) + uint64(ordinal)<<40
	return &simPool{
		base:       base,
		capacity:   capacity,
		chunkSize:  simChunkSize,
		allocAlign: 512,
		top:        base,
		byStart:    map[uint64]*simRange{},
		byEnd:      map[uint64]*simRange{},
		pending:    map[Stream][]*simRange{},
		used:       map[uint64]*simRange{},
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
				p.pin(r.start, r.size, false)
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
	r := p.takeFree(n)
	if r == nil {
		r = p.takePending(n, s)
	}
	if r == nil {
		// Nothing holds it: extend the used range, from a free tail if any.
		start := p.top
		if tail, ok := p.byEnd[p.top]; ok {
			start = tail.start
		}
		if need := p.mapCost(start, n); p.reserved+need > p.capacity {
			return 0, fmt.Errorf("sim: pool of %d bytes cannot map %d more (capacity %d): %w",
				p.reserved, need, p.capacity, ErrOutOfMemory)
		}
		if tail, ok := p.byEnd[p.top]; ok {
			p.removeFree(tail)
		}
		r = &simRange{start: start, size: n}
		p.top = start + n
	} else if need := p.mapCost(r.start, n); p.reserved+need > p.capacity {
		// The range lies over unmapped chunks (after a trim) that would not
		// fit: put it back and fail.
		if r.pending {
			p.pending[r.stream] = append(p.pending[r.stream], r)
		} else {
			p.insertFree(r)
		}
		return 0, fmt.Errorf("sim: pool of %d bytes cannot map %d more (capacity %d): %w",
			p.reserved, need, p.capacity, ErrOutOfMemory)
	}
	return p.use(r, n), nil
}

// chunkRange returns the chunk indices [lo, hi) that [start, start+n) touches.
func (p *simPool) chunkRange(start, n uint64) (lo, hi int) {
	return int((start - p.base) / p.chunkSize), int((start+n-1-p.base)/p.chunkSize + 1)
}

// mapCost is how many bytes of new mappings using [start, start+n) needs.
func (p *simPool) mapCost(start, n uint64) uint64 {
	lo, hi := p.chunkRange(start, n)
	var need uint64
	for i := lo; i < hi; i++ {
		if i >= len(p.mapped) || !p.mapped[i] {
			need += p.chunkSize
		}
	}
	return need
}

// pin adds (or, with add false, removes) [start, start+n) to the bytes in
// use of every chunk it touches, mapping chunks as they are first used.
func (p *simPool) pin(start, n uint64, add bool) {
	lo, hi := p.chunkRange(start, n)
	for len(p.chunkUsed) < hi {
		p.chunkUsed = append(p.chunkUsed, 0)
		p.mapped = append(p.mapped, false)
	}
	for i := lo; i < hi; i++ {
		cs := p.base + uint64(i)*p.chunkSize
		part := min(start+n, cs+p.chunkSize) - max(start, cs)
		if !add {
			p.chunkUsed[i] -= part
			continue
		}
		p.chunkUsed[i] += part
		if !p.mapped[i] {
			p.mapped[i] = true
			p.reserved += p.chunkSize
			p.reservedHigh = max(p.reservedHigh, p.reserved)
		}
	}
}

// use carves n bytes off the front of the range r, which is free, pending on
// the requesting stream, or new, and marks them used. The rest of a pending
// range stays pending: only its own stream may use it before the free
// completes.
func (p *simPool) use(r *simRange, n uint64) uint64 {
	if r.size > n {
		rest := &simRange{start: r.start + n, size: r.size - n}
		if r.pending {
			rest.pending, rest.stream, rest.seq = true, r.stream, r.seq
			p.pending[r.stream] = append(p.pending[r.stream], rest)
		} else {
			p.insertFree(rest)
		}
		r.size = n
	}
	if r.pending {
		r.pending = false // its bytes are pinned already
	} else {
		p.pin(r.start, n, true)
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
		p.pin(r.start, r.size, false)
		p.insertFree(r)
		return nil
	}
	r.pending, r.stream, r.seq = true, s, seq // still pins its chunks
	p.pending[s] = append(p.pending[s], r)
	return nil
}

// insertFree coalesces r with its free neighbours and indexes the result.
func (p *simPool) insertFree(r *simRange) {
	if left, ok := p.byEnd[r.start]; ok {
		p.removeFree(left)
		r.start, r.size = left.start, left.size+r.size
	}
	if right, ok := p.byStart[r.start+r.size]; ok {
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

// takeFree removes and returns the best-fit free range for n bytes.
func (p *simPool) takeFree(n uint64) *simRange {
	i := p.searchFree(n, 0)
	if i == len(p.free) {
		return nil
	}
	if firstFit {
		for j := i + 1; j < len(p.free); j++ {
			if p.free[j].start < p.free[i].start {
				i = j
			}
		}
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

// trim unmaps chunks with nothing used or pending in them, highest address
// first, until reserved is at most keep.
func (p *simPool) trim(keep uint64, completed func(Stream) uint64) {
	p.settle(completed)
	for i := len(p.mapped) - 1; i >= 0 && p.reserved > keep; i-- {
		if p.mapped[i] && p.chunkUsed[i] == 0 {
			p.mapped[i] = false
			p.reserved -= p.chunkSize
		}
	}
}

var firstFit = false
