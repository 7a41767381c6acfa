package caching

import (
	"errors"
	"fmt"
	"sort"

	"github.com/goalloc/goalloc/arena"
)

// Private pools as PyTorch's own caching allocator exposes them to a C++
// allocator class (python/goalloc/csrc): torch.cuda.MemPool, use_mem_pool,
// and the pool checkpoints of torch.compile's CUDA graph trees.
//
// There the caller decides which pool an allocation comes from: PyTorch
// hands the allocator a filter with each BeginAllocateToPool (this thread,
// this stream, or this capture), and the class evaluates it, so MallocIn
// names the pool instead of asking the driver whether the stream is being
// captured, as Malloc does for the C ABI.

// MallocIn is Malloc from the private pool id, or from the general cache
// when id is the zero PoolID, whatever capture is in progress.
func (a *Allocator) MallocIn(id PoolID, size uint64, s arena.Stream) (uintptr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mallocInPool(id, 0, size, s)
}

// MallocInCtx is MallocIn for a call whose context id is ctx (history.go,
// "Context ids").
func (a *Allocator) MallocInCtx(id PoolID, size uint64, s arena.Stream, ctx uint64) (uintptr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.callCtx = ctx
	defer a.endCall()
	return a.mallocInPool(id, 0, size, s)
}

// MallocInTagged is MallocInRounded in memory tag tag: the zero id's
// allocation comes from the tag's pool (sleep.go).
func (a *Allocator) MallocInTagged(tag Tag, id PoolID, size, block uint64, s arena.Stream, ctx uint64) (uintptr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if block > MaxRequest {
		return 0, a.checkRequest(block)
	}
	a.callCtx = ctx
	if block > size {
		a.callBlock = block
	}
	defer a.endCall()
	return a.mallocInPool(id, tag, size, s)
}

// MallocInRounded is MallocInCtx for a request of size bytes that the
// caller rounded to a block of block bytes (PyTorch's
// roundup_power2_divisions, which goalloc's C++ class reads from torch's
// settings): the block is at least that large, and requested_bytes counts
// size. A block of 0, or one not above size, leaves the rounding to goalloc.
func (a *Allocator) MallocInRounded(id PoolID, size, block uint64, s arena.Stream, ctx uint64) (uintptr, error) {
	return a.MallocInTagged(0, id, size, block, s, ctx)
}

// endCall ends a call with a context id or a rounding of its own: what the
// allocator does later under another call is not this one's.
func (a *Allocator) endCall() { a.callCtx, a.callBlock = 0, 0 }

// mallocInPool is MallocIn with a.mu held, in memory tag tag where id is
// the zero PoolID.
func (a *Allocator) mallocInPool(id PoolID, tag Tag, size uint64, s arena.Stream) (uintptr, error) {
	if size > MaxRequest {
		return 0, a.checkRequest(size)
	}
	cp := a.general
	if id == (PoolID{}) && tag != 0 {
		var err error
		if cp, err = a.tagPool(tag); err != nil {
			return 0, err
		}
	} else if id != (PoolID{}) {
		cp = a.private[id]
		if cp == nil || cp.users == 0 {
			return 0, a.badInput("invalid_pool", fmt.Sprintf("malloc in pool (%d, %d) on device %d, which is not in use", id[0], id[1], a.dev.Ordinal()))
		}
	}
	return a.mallocIn(cp, size, s)
}

// FreeOwned frees ptr with the size and stream it was allocated with, for
// callers that know only the pointer (PyTorch's DataPtr deleter). held is
// false, and nothing is counted, when ptr is not a block of this device.
func (a *Allocator) FreeOwned(ptr uintptr) (held bool, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.freeOwned(ptr)
}

// FreeOwnedCtx is FreeOwned for a call whose context id is ctx (history.go,
// "Context ids").
func (a *Allocator) FreeOwnedCtx(ptr uintptr, ctx uint64) (held bool, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.callCtx = ctx
	defer a.endCall()
	return a.freeOwned(ptr)
}

func (a *Allocator) freeOwned(ptr uintptr) (held bool, err error) {
	if id, ok := a.largeByAddr.Get(ptr); ok {
		b := &a.blocks[id]
		return true, a.freeBlock(id, ptr, b.requested, b.stream)
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 {
			return true, a.freeSlot(seg, i, ptr, uint64(seg.requested[i]), seg.stream)
		}
	}
	return false, nil
}

// IncrefPool makes the private pool id, or adds a user to it: PyTorch's
// createOrIncrefPool, called when a torch.cuda.MemPool is made. Each user
// is given back by one ReleasePool.
func (a *Allocator) IncrefPool(id PoolID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id == (PoolID{}) {
		return a.badInput("invalid_pool", fmt.Sprintf("create_or_incref_pool on device %d with pool id (0, 0), which names no pool", a.dev.Ordinal()))
	}
	p := a.private[id]
	if p == nil {
		p = newGraphPool(id)
		a.private[id] = p
	}
	p.setReleased(false)
	p.users++
	return nil
}

// PoolUseCount is the number of users of the private pool id (0 if none).
func (a *Allocator) PoolUseCount(id PoolID) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if p := a.private[id]; p != nil {
		return p.users
	}
	return 0
}

// LiveBlock is one allocated block of a pool.
type LiveBlock struct {
	Addr      uintptr
	Size      uint64 // the block or slot size
	Requested uint64
	Stream    arena.Stream
}

// PoolLive lists the allocated blocks of pool id (the general cache for the
// zero PoolID), by address. Blocks freed but waiting for other streams are
// not allocated, as in PyTorch's checkPoolLiveAllocations.
func (a *Allocator) PoolLive(id PoolID) []LiveBlock {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.poolLive(id)
}

func (a *Allocator) poolLive(id PoolID) []LiveBlock {
	var out []LiveBlock
	for i := range a.blocks {
		b := &a.blocks[i]
		if b.state == blockLive && b.list.pool.id == id {
			out = append(out, LiveBlock{b.addr, b.size, b.requested, b.stream})
		}
	}
	for _, seg := range a.segments {
		if seg.list.pool.id != id || seg.used == 0 {
			continue
		}
		for i := int32(0); i < seg.nslots; i++ {
			if seg.state[i] == slotLive {
				out = append(out, LiveBlock{seg.slotAddr(i), seg.slotSize, uint64(seg.requested[i]), seg.stream})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr < out[j].Addr })
	return out
}

// RestorePool sets the private pool id back to a checkpoint taken with
// PoolLive: every block allocated in it now is freed (freed lists them),
// then every block of the checkpoint is allocated again at its address.
// PyTorch's setCheckpointPoolState does the same, so that CUDA graph trees
// can record a new graph after replaying others, whose replays allocated
// nothing. The pool keeps its memory until released, so each checkpointed
// block is still there, cached; if one is not, RestorePool says so and the
// pool is left with the blocks it could restore.
func (a *Allocator) RestorePool(id PoolID, checkpoint []LiveBlock) (freed []uintptr, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	p := a.private[id]
	if id == (PoolID{}) || p == nil || p.users == 0 {
		return nil, a.badInput("invalid_pool", fmt.Sprintf("set_checkpoint_pool_state on device %d for pool (%d, %d), which is not in use", a.dev.Ordinal(), id[0], id[1]))
	}
	for _, b := range checkpoint {
		// A row of PoolLive never asks more than its block holds: the
		// statistics would count more requested than allocated, and a slot
		// keeps its request in 32 bits. Refused before anything is freed.
		if b.Requested > b.Size {
			return nil, a.badInput("invalid_size", fmt.Sprintf("set_checkpoint_pool_state on device %d for pool (%d, %d): the block at %#x of %d bytes has %d requested", a.dev.Ordinal(), id[0], id[1], b.Addr, b.Size, b.Requested))
		}
	}
	var errs []error
	for _, b := range a.poolLive(id) {
		freed = append(freed, b.Addr)
		if _, err := a.freeOwned(b.Addr); err != nil {
			errs = append(errs, err)
		}
	}
	for _, b := range checkpoint {
		if err := a.claim(p, b); err != nil {
			errs = append(errs, err)
		}
	}
	return freed, errors.Join(errs...)
}

// claim allocates the free block of pool p at b.Addr again, for b.Requested bytes.
func (a *Allocator) claim(p *cachePool, b LiveBlock) error {
	if id, ok := a.largeByAddr.Get(b.Addr); ok {
		blk := &a.blocks[id]
		if blk.state != blockCached || blk.list.pool != p || blk.size != b.Size {
			return fmt.Errorf("goalloc: restoring pool (%d, %d) on device %d: the block at %#x is not free in the pool", p.id[0], p.id[1], a.dev.Ordinal(), b.Addr)
		}
		a.takeBlock(id, nil, b.Requested)
		return nil
	}
	seg := a.findSegment(b.Addr)
	if seg == nil || seg.list.pool != p || seg.slotSize != b.Size {
		return fmt.Errorf("goalloc: restoring pool (%d, %d) on device %d: no free slot of the pool at %#x", p.id[0], p.id[1], a.dev.Ordinal(), b.Addr)
	}
	i := seg.slotOf(b.Addr)
	if i < 0 || seg.state[i] != slotFree {
		return fmt.Errorf("goalloc: restoring pool (%d, %d) on device %d: the slot at %#x is not free", p.id[0], p.id[1], a.dev.Ordinal(), b.Addr)
	}
	for k, j := range seg.freeSlots {
		if j == i {
			last := len(seg.freeSlots) - 1
			seg.freeSlots[k] = seg.freeSlots[last]
			seg.freeSlots = seg.freeSlots[:last]
			break
		}
	}
	a.liveSlot(seg.list, seg, i, b.Requested)
	return nil
}
