package caching

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"
)

// The front: a log shared with goalloc's C++ allocator class for PyTorch,
// through which the class passes frees to Go without a call of their own,
// and serves a request right after a free of the same size on the same
// stream without calling Go at all.
//
// Glossary:
//
//   - front: the C++ class's part (python/goalloc/csrc/goalloc_front.h). It
//     knows the stream and requested size of every live block of the general
//     cache it handed out, and nothing else.
//   - front log (FrontLog): one per device, Go memory pinned for the C++
//     side, guarded by a spinlock both sides take. It holds up to FrontCap
//     entries in the order they were made.
//   - pending free: an entry the front wrote when the user freed a block. Go
//     has not seen the free yet: the block is still live in Go's structures
//     and statistics.
//   - recycled entry: a pending free that the front handed out again, to a
//     request of the same stream and the same requested size, before Go saw
//     it. The block never left the user's side of Go's structures.
//   - drain: Go taking the entries out and applying them in order, a pending
//     free as the free it stands for (freeOwned), a recycled entry as the
//     statistics of a free and a cache hit of the same block
//     (countRecycled).
//
// Why: a PyTorch tensor's allocation and free crossed from C into Go
// twice, plus Go's work, which put the torch.empty pair above PyTorch's own
// allocator's (BENCHMARKS.md, "The alloc+free pair through torch.empty"). Through the front a recycled pair crosses
// never, and pending frees ride on the next call into Go, or cross once
// for FrontCap of them.
//
// Why it stays exact. Every operation on the allocator takes its mutex,
// and statsMutex.Lock drains the log before anything else, so Go applies a
// pending free before any later request, statistic, snapshot or
// empty_cache sees the device: everything Go reports is what it would
// report had each free come to Go when it was made. A recycled pair moves
// no current figure: the free lowers allocated bytes by what the request
// raises them again, with nothing in between but other frees, so no peak
// can move either. Its cumulative figures (allocation counts, freed bytes,
// the inactive split of a slot's segment) are applied at its place in the
// log, against the segment as it was then.
//
// Who may use it. The front writes only while enabled is set, which Go
// publishes whenever it changes (publishFront): not while history is recorded
// (each event must be timed as it happens) and not while a capture window
// is open (a capture's frees have their own rules). The front itself
// leaves out blocks of private pools and blocks that record_stream handed
// to another stream: their frees go to Go as before.

// FrontCap is how many entries a front log holds.
const FrontCap = 64

// FrontEntry is one entry of a front log. The layout is shared with C++:
// four 64-bit words.
type FrontEntry struct {
	Ptr       uint64 // the block's address
	Stream    uint64 // the stream it was allocated on
	Requested uint64 // the size the user asked for
	Recycled  uint64 // 1: the front handed the block out again
}

// FrontLog is a device's front log. The layout is shared with C++ (16
// bytes, then the entries); Size lets the C++ side check it.
type FrontLog struct {
	// lock is a spinlock, 1 while held; both sides hold it for a handful of
	// loads and stores, never across a call.
	lock atomic.Uint32
	// enabled: 1 while the front may add entries and recycle them.
	enabled atomic.Uint32
	// n is how many entries are in use. Invariant: n <= FrontCap, and
	// entries[:n] are in the order the front made them. Read without the
	// lock to know whether a drain is due.
	n       atomic.Uint32
	size    uint32
	entries [FrontCap]FrontEntry
}

// FrontLogSize is unsafe.Sizeof(FrontLog{}), which the C++ side checks.
const FrontLogSize = 16 + FrontCap*32

var _ = [1]struct{}{}[unsafe.Sizeof(FrontLog{})-FrontLogSize] // the layout above, checked at compile time

func newFrontLog() *FrontLog { return &FrontLog{size: FrontLogSize} }

func (f *FrontLog) acquire() {
	for !f.lock.CompareAndSwap(0, 1) {
		runtime.Gosched()
	}
}

func (f *FrontLog) release() { f.lock.Store(0) }

// EnableFront makes the device's front log, once, and returns it: nil when
// GOALLOC_CONF turned the front off. goalloc's C++ class asks for it
// (goalloc_front_log), so that an allocator no class uses pays nothing for it.
// The caller keeps it at a fixed address for the C++ side (runtime.Pinner)
// as long as the Allocator lives.
func (a *Allocator) EnableFront() *FrontLog {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.cfg.Front {
		return nil
	}
	if f := a.mu.front.Load(); f != nil {
		return f
	}
	f := newFrontLog()
	a.mu.front.Store(f)
	a.publishFront()
	return f
}

// Front is the device's front log, nil until EnableFront made it.
func (a *Allocator) Front() *FrontLog { return a.mu.front.Load() }

// Pending is how many entries wait in the front log, read without a lock.
func (a *Allocator) Pending() int {
	if f := a.Front(); f != nil {
		return int(f.n.Load())
	}
	return 0
}

// DrainFront applies the front log's entries now (the C++ side asks when
// its log is full).
func (a *Allocator) DrainFront() {
	a.mu.Lock()
	a.mu.Unlock() //nolint:staticcheck // taking the mutex is the drain
}

// publishFront tells the front whether it may serve and take frees: not
// while history is recorded or a capture window is open, and never once
// the process uses memory tags (SetTagsInUse). Called with a.mu held by
// whatever changes one of them (RecordHistory, BeginAllocateToPool,
// EndAllocateToPool, SetTagsInUse) and when the log is made;
// CheckInvariants checks that the flag agrees.
func (a *Allocator) publishFront() {
	f := a.Front()
	if f == nil {
		return
	}
	var on uint32
	if a.frontAllowed() {
		on = 1
	}
	f.enabled.Store(on)
}

// frontAllowed says whether the front may serve and take frees now.
func (a *Allocator) frontAllowed() bool {
	return a.history == nil && !a.capturing() && !a.tagsInUse
}

// drainFront applies the front log's entries in their order. Called by
// statsMutex.Lock, first thing under the mutex, when the log is not empty.
func (a *Allocator) drainFront() {
	f := a.Front()
	var buf [FrontCap]FrontEntry
	f.acquire()
	n := f.n.Load()
	if n > FrontCap { // never written so; a count past the entries would crash the copy
		_ = a.badInput("invalid_argument", fmt.Sprintf("front log of device %d claims %d entries, more than its %d; the extra ones are dropped", a.dev.Ordinal(), n, FrontCap))
		n = FrontCap
	}
	copy(buf[:n], f.entries[:n])
	f.n.Store(0)
	f.release()
	// Applied outside the spinlock: a free may call the device.
	a.stats.FrontFrees += int64(n)
	for _, e := range buf[:n] {
		if e.Recycled != 0 {
			a.stats.FrontRecycled++
			a.countRecycled(uintptr(e.Ptr))
			continue
		}
		if held, _ := a.freeOwned(uintptr(e.Ptr)); !held {
			_ = a.badInput("unknown_pointer", fmt.Sprintf("free of %#x through the front log on device %d: goalloc did not allocate it on this device", e.Ptr, a.dev.Ordinal()))
		}
	}
}

// countRecycled counts what a free of the live block at ptr and a cache hit
// on the same block, with the same requested size, change: every current
// figure ends where it was, the cumulative ones move as the two calls
// would have moved them (releaseSlot, liveSlot; freeBlock, takeBlock).
func (a *Allocator) countRecycled(ptr uintptr) {
	if id, ok := a.largeByAddr.Get(ptr); ok && a.blocks[id].state == blockLive {
		b := &a.blocks[id]
		a.countFree(StatLarge, int64(b.size), b.requested)
		a.cells.sub(StatLarge, statActive, 1)
		a.cells.sub(StatLarge, statActiveBytes, int64(b.size))
		a.countAlloc(StatLarge, int64(b.size), b.requested)
		a.cells.hit()
		return
	}
	if seg := a.findSegment(ptr); seg != nil {
		if i := seg.slotOf(ptr); i >= 0 && seg.state[i] == slotLive {
			slot, req := int64(seg.slotSize), uint64(seg.requested[i])
			a.countFree(StatSmall, slot, req)
			a.cells.sub(StatSmall, statActive, 1)
			a.cells.sub(StatSmall, statActiveBytes, slot)
			if seg.used > 1 { // the free splits a slot off, the hit takes it back
				a.cells.add(StatSmall, statInactiveSplit, 1)
				a.cells.add(StatSmall, statInactiveSplitBytes, slot)
				a.cells.sub(StatSmall, statInactiveSplit, 1)
				a.cells.sub(StatSmall, statInactiveSplitBytes, slot)
			} else { // the free empties the segment, the hit splits it again
				others := int64(seg.nslots - 1)
				a.cells.sub(StatSmall, statInactiveSplit, others)
				a.cells.sub(StatSmall, statInactiveSplitBytes, int64(seg.size)-slot)
				a.cells.add(StatSmall, statInactiveSplit, others)
				a.cells.add(StatSmall, statInactiveSplitBytes, int64(seg.size)-slot)
			}
			a.countAlloc(StatSmall, slot, req)
			a.cells.hit()
			return
		}
	}
	_ = a.badInput("unknown_pointer", fmt.Sprintf("recycled %#x through the front log on device %d: not a live block of this device", ptr, a.dev.Ordinal()))
}
