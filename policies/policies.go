// Package policies holds reference allocators over an arena.Device, so that
// the replay tool can put measured numbers on classic strategies next to
// goalloc's own on the same trace and the same simulated (or real) pool.
//
// Each one takes memory from the device with Alloc and gives it back with
// Free; what differs is what it keeps cached above the device and how it
// carves that up:
//
//   - goalloc: the real caching.Allocator, configured by a GOALLOC_CONF
//     string (caching.ParseConfig). *caching.Allocator implements Allocator
//     as it is; Goalloc only adds its reserved-bytes peak.
//   - native: PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp,
//     expandable segments off, no max_split_size): requests rounded up to 512
//     bytes; those of at most 1 MiB come from a small pool of 2 MiB segments,
//     larger ones from a large pool where a request under 10 MiB maps a 20 MiB
//     segment and a bigger one a segment of its own size rounded up to 2 MiB;
//     best fit over the free blocks of the request's pool and stream by
//     (size, address); a block is split when the rest would be at least 512
//     bytes (small pool) or more than 1 MiB (large pool), and freed blocks
//     merge with free neighbours of the same segment. Everything is cached:
//     segments go back to the device only when a device allocation fails, and
//     then every fully free one does before the one retry (release_cached_blocks).
//   - buddy: a binary buddy allocator. Arenas of 1 GiB (or, for a larger
//     request, of the request's power of two; or, when the device has no room
//     for a whole arena, of just the request's block) come from the device; blocks
//     are powers of two from 512 bytes, split in halves on the way down and
//     merged with their buddy on free. Best fit by block order, lowest
//     address first.
//   - fixed: power-of-two size classes from 512 bytes, nothing split and
//     nothing merged. Every block is taken from the device at its class size
//     and, once freed, cached in its class's free list for its stream.
//   - passthrough: no caching at all; every request goes to the device and
//     every free straight back. It measures the pool on its own.
//
// Like PyTorch, every caching policy keeps memory per stream: a block freed on
// stream s is handed out again only to s, so reuse never races with work still
// queued on another stream. And like PyTorch, when the device says out of
// memory, each gives back what it holds fully free, trims the pool and tries
// once more before failing: caching forever must not turn into an
// out-of-memory that the same program would not hit without the cache.
//
// The policies are not safe for concurrent use: the replay drives them from
// one goroutine. (caching.Allocator is, but need not be here.)
package policies

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

// Allocator is what every policy implements and what the replay engine
// drives. *caching.Allocator implements it as it is.
type Allocator interface {
	// Malloc returns size bytes for work on stream s.
	Malloc(size uint64, s arena.Stream) (uintptr, error)
	// Free gives back ptr, which Malloc returned for size bytes on s.
	Free(ptr uintptr, size uint64, s arena.Stream) error
	// Fragmentation describes the free memory the policy holds right now.
	Fragmentation() Fragmentation
	// Close gives everything back and closes the device, which the policy owns.
	Close() error
}

// PeakReserver is implemented by policies that count the bytes they hold
// from the device, and reports the most they held at once.
type PeakReserver interface {
	PeakReserved() uint64
}

// SegmentHolder is implemented by the policies modelled on cudaMalloc
// (native, buddy, fixed): each device allocation stands for a segment the
// driver maps on its own, so the bytes they hold are what the device
// reserves, whatever a stream-ordered pool would have packed them into.
type SegmentHolder interface {
	HoldsSegments()
}

// PeakAllocator is implemented by policies that count the bytes they hand
// out, requests rounded up to their blocks, and reports the most at once:
// PyTorch's allocated_bytes.all.peak.
type PeakAllocator interface {
	PeakAllocated() uint64
}

// Fragmentation is caching's description of cached free memory, shared so
// that goalloc and the reference policies report the same figures: FreeBytes
// is memory held from the device but not handed out, LargestFreeBlock the
// largest request it could serve without the device, Ratio
// 1 - LargestFreeBlock/FreeBytes.
type Fragmentation = caching.Fragmentation

var _ Allocator = (*caching.Allocator)(nil)

// Names lists the policies in the order a comparison shows them.
var Names = []string{"goalloc", "native", "buddy", "fixed", "passthrough"}

// ErrUnknownPointer is wrapped by the error a reference policy returns for a
// free of a pointer it did not hand out or already took back.
var ErrUnknownPointer = errors.New("pointer not allocated by this policy")

// New makes the named policy over dev, which it then owns. conf is a
// GOALLOC_CONF string; only goalloc takes one.
func New(name string, dev arena.Device, conf string) (Allocator, error) {
	if name != "goalloc" && strings.TrimSpace(conf) != "" {
		return nil, fmt.Errorf("policy %q takes no configuration (GOALLOC_CONF applies to goalloc only)", name)
	}
	switch name {
	case "goalloc":
		cfg, err := caching.ParseConfig(conf)
		if err != nil {
			return nil, err
		}
		return NewGoalloc(dev, cfg)
	case "native":
		return NewNative(dev), nil
	case "buddy":
		return NewBuddy(dev, DefaultArenaSize), nil
	case "fixed":
		return NewFixed(dev), nil
	case "passthrough":
		return NewPassthrough(dev), nil
	}
	return nil, fmt.Errorf("unknown policy %q (known: %s)", name, strings.Join(Names, ", "))
}

// ConfKeys lists the keys of goalloc's configuration (GOALLOC_CONF), sorted.
func ConfKeys() []string {
	keys := make([]string, 0, len(caching.ConfigKeys()))
	for k := range caching.ConfigKeys() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Backend checks conf, a GOALLOC_CONF string, and returns the memory
// backend it names: "vmm" (the default) or "async", with the layout
// backend:vmm uses (vmm_handle). A replay reads them apart from the
// goalloc policy because the backend serves every policy.
func Backend(conf string) (backend string, layout arena.VMMLayout, err error) {
	cfg, err := caching.ParseConfig(conf)
	if err != nil {
		return "", arena.VMMLayout{}, err
	}
	return cfg.Backend, cfg.VMM, nil
}

// Goalloc is goalloc's caching allocator as a policy.
type Goalloc struct {
	*caching.Allocator
}

// NewGoalloc makes goalloc's caching allocator over dev with cfg.
func NewGoalloc(dev arena.Device, cfg caching.Config) (*Goalloc, error) {
	a, err := caching.New(dev, cfg)
	if err != nil {
		return nil, err
	}
	return &Goalloc{a}, nil
}

// PeakReserved is goalloc's own reserved peak: what it held from its memory
// source (goalloc.own_reserved_bytes.peak; with backend:vmm
// reserved_bytes.all is the device's physical figure, which the replay
// reports as the device's peak).
func (g *Goalloc) PeakReserved() uint64 {
	st := g.Stats()
	return uint64(st.OwnReserved.Peak)
}

// PeakAllocated is goalloc's own allocated_bytes.all.peak.
func (g *Goalloc) PeakAllocated() uint64 {
	st := g.Stats()
	return uint64(st.AllocatedBytes[caching.StatAll].Peak)
}

// minBlock is the smallest block any reference policy hands out and the
// granularity of every request, as in PyTorch and the CUDA pool.
const minBlock = 512

// checkSize rejects requests no device could hold before they overflow a
// policy's size arithmetic (a negative size cast to unsigned, say).
func checkSize(policy string, size uint64) error {
	if size > caching.MaxRequest {
		return fmt.Errorf("%s: malloc of %d bytes: larger than any device", policy, size)
	}
	return nil
}

// reserve tracks the bytes a policy holds from the device and their peak.
type reserve struct{ cur, peak uint64 }

func (r *reserve) add(n uint64) { r.cur += n; r.peak = max(r.peak, r.cur) }
func (r *reserve) sub(n uint64) { r.cur -= n }

// deviceAlloc takes n bytes from dev for a policy that caches. When the
// device is out of memory it calls release, which gives back every fully free
// piece the policy caches, then synchronises and trims the pool so that those
// bytes really leave it, and tries once more: PyTorch's release_cached_blocks.
func deviceAlloc(dev arena.Device, n uint64, s arena.Stream, release func() error) (uintptr, error) {
	p, err := dev.Alloc(n, s)
	if err == nil || !errors.Is(err, arena.ErrOutOfMemory) {
		return p, err
	}
	if rerr := release(); rerr != nil {
		return 0, errors.Join(err, rerr)
	}
	if serr := dev.Synchronize(); serr != nil {
		return 0, errors.Join(err, serr)
	}
	if terr := dev.Trim(0); terr != nil {
		return 0, errors.Join(err, terr)
	}
	return dev.Alloc(n, s)
}

// fragmentation fills in a Fragmentation from a policy's free bytes and
// largest free piece, with the pool's own figures.
func fragmentation(dev arena.Device, free, largest uint64) Fragmentation {
	f := Fragmentation{FreeBytes: free, LargestFreeBlock: largest}
	if free > 0 {
		f.Ratio = 1 - float64(largest)/float64(free)
	}
	if u, err := dev.PoolUsage(); err == nil {
		f.PoolReserved, f.PoolUsed = u.ReservedCurrent, u.UsedCurrent
	}
	return f
}
