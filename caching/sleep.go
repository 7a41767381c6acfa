package caching

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/goalloc/goalloc/arena"
)

// Sleep and wake: the caching layer's half. The placement's half, and the
// note that explains the whole (rationale, approach, limitations), is
// arena's vmm_sleep.go, Note [Sleep and wake].
//
// Memory tags. An allocation carries a memory tag (Tag; 0: untagged),
// which the library takes from the calling thread (goalloc.memory_tag).
// Tagged memory comes from a cache pool of its tag's own (tagPool: one
// per tag and device, made at the tag's first allocation), with its own
// per-stream caches, so that no cached block and no small segment ever
// holds memory of two tags, or of a tag and untagged memory; under it the
// placement keeps each tag's memory in segments of its own, so no handle
// does either. A tag's pool keeps the general cache's rule (its budgets,
// its miss release), and its cached memory goes back with the general
// cache's when memory is reclaimed or empty_cache is called. The tag
// applies where the general cache would serve: an allocation of a CUDA
// graph capture comes from its graph's private pool, untagged, as the
// pool must keep its memory for the graph's replays; so does one that
// names a pool (MemPool).
//
// Sleep (Allocator.Sleep) puts every tag pool of the device to sleep,
// those named to offload first copied to the host:
//
//   - refused during a capture window, while anything is asleep (one sleep
//     at a time), and on a device that cannot sleep (backend:async: its
//     pool places memory itself, so nothing here could keep the addresses);
//   - the tags' cached blocks and empty segments go back to the device
//     first (their memory would otherwise sleep, and be restored, for
//     nothing);
//   - the device is told what must complete before the memory goes: the
//     other streams that use live tagged blocks (record_stream) and the
//     events of tagged frees waiting for other streams; it waits for those
//     and for the tags' own streams, never for the whole device;
//   - the pools asleep keep nothing freed into them (their limits are
//     keepNothing), and their bytes leave the cap's count (arena.Limited's
//     Suspend): they hold nothing on the device, and the cap bounds what
//     it holds;
//   - then the free cache goes: the general cache's cached blocks and empty
//     segments, and the device trims its free memory.
//
// memory_reserved() (what the device holds) drops by what was released;
// goalloc's own segments and blocks stay counted as they were (their
// addresses are kept, and the tensors in them live on), and
// goalloc.sleep.asleep_bytes says how much of them is asleep.
//
// While a tag is asleep an allocation in it is refused (StateError): the
// caller wakes it first. A free of one of its blocks is allowed: the block
// goes back to the device at once (its pool keeps nothing), and takes
// effect on wake, which does not map it again; a free waiting for other
// streams completes as usual, and then goes back the same way.
//
// Wake (Allocator.Wake) wakes the named tags that are asleep, in order,
// each whole or not at all: whatever of its pool is cached goes back
// first, its bytes are counted under the cap again (refused: out of
// memory), and the device maps and restores them. Out of memory, from the
// cap or the device, reclaims as a refused allocation does (the caches,
// then, as the last round, a device synchronisation) and tries again; if
// it still does not fit, the tag and those after it stay asleep, and the
// error is an OOMError, for the caller to free memory and call again.
//
// CUDA graphs. A private pool is never put to sleep, so a graph captured
// before a sleep replays after it, over its own pool's memory and the
// tagged memory it read, both at their addresses; a capture window may not
// open over a sleeping tag's work, as sleep and wake are refused during
// one.

// Tag is a memory tag (arena.Tag): 0 is untagged memory.
type Tag = arena.Tag

// MaxTags bounds the memory tags a process names, and MaxTagName a tag's
// name in bytes.
const (
	MaxTags    = 1024
	MaxTagName = 64
)

// tags is the process's memory tags, by name: a tag is the same number on
// every device.
var tags = struct {
	sync.Mutex
	byName map[string]Tag
	names  []string // by Tag - 1
}{byName: map[string]Tag{}}

// InternTag is the tag named name, made on first use. A name is 1 to
// MaxTagName printable ASCII characters, neither a space nor a comma (the
// C ABI lists tags comma-separated).
func InternTag(name string) (Tag, error) {
	if err := checkTagName(name); err != nil {
		return 0, err
	}
	tags.Lock()
	defer tags.Unlock()
	if t, ok := tags.byName[name]; ok {
		return t, nil
	}
	if len(tags.names) >= MaxTags {
		return 0, &InputError{Kind: "invalid_tag", Msg: fmt.Sprintf("memory tag %q: a process names at most %d tags", name, MaxTags)}
	}
	tags.names = append(tags.names, name)
	t := Tag(len(tags.names))
	tags.byName[name] = t
	return t, nil
}

func checkTagName(name string) error {
	bad := len(name) == 0 || len(name) > MaxTagName
	for i := 0; i < len(name) && !bad; i++ {
		c := name[i]
		bad = c <= ' ' || c > '~' || c == ','
	}
	if bad {
		return &InputError{Kind: "invalid_tag", Msg: fmt.Sprintf("memory tag %q: a tag's name is 1 to %d printable ASCII characters, without spaces or commas", name, MaxTagName)}
	}
	return nil
}

// LookupTag is the tag named name, if a tag has that name.
func LookupTag(name string) (Tag, bool) {
	tags.Lock()
	defer tags.Unlock()
	t, ok := tags.byName[name]
	return t, ok
}

// TagName is tag's name ("" for 0 and unknown tags).
func TagName(t Tag) string {
	tags.Lock()
	defer tags.Unlock()
	if t == 0 || int(t) > len(tags.names) {
		return ""
	}
	return tags.names[t-1]
}

// StateError is a call the allocator's state refuses now: sleep while
// anything is asleep or during a capture, wake_up with nothing asleep, an
// allocation in a tag that is asleep. Nothing was changed.
type StateError struct{ Msg string }

func (e *StateError) Error() string { return "goalloc: " + e.Msg }

// ErrNeedsVMM is the error of sleep and wake on a device whose memory comes
// from the driver's stream-ordered pool (backend:async).
var ErrNeedsVMM = errors.New("sleep and wake_up need backend:vmm (goalloc's own placement, the default), not backend:async")

// SleepResult is what Sleep did: the bytes copied to the host, and what the
// device holds less (memory_reserved's drop); the times of the device's
// steps (arena.SleepReport).
type SleepResult struct {
	Offloaded, Released uint64
	Prepare, Offload    time.Duration
}

// WakeResult is what Wake did: the tags woken, the bytes mapped again for
// them and the bytes copied back; the times of the device's steps, over
// the tags (arena.WakeReport).
type WakeResult struct {
	Woken            []Tag
	Mapped, Restored uint64
	Map, Restore     time.Duration
}

// tagRetention is a memory tag's pool's rule: the general cache's, but
// that it keeps nothing while asleep, and takes its memory in its tag.
type tagRetention struct {
	generalRetention
	pool *cachePool
	dev  arena.Sleeper // nil where the device cannot sleep: its memory is untagged below
}

func (r tagRetention) limits() limits {
	if r.pool.asleep {
		return keepNothing
	}
	return r.generalRetention.limits()
}

// alloc takes n bytes in the pool's tag: the device places them in
// segments of that tag.
func (r tagRetention) alloc(mem arena.MemorySource, n uint64, s arena.Stream) (uintptr, error) {
	if r.dev == nil {
		return mem.Alloc(n, s)
	}
	r.dev.SetAllocTag(r.pool.tag)
	defer r.dev.SetAllocTag(0)
	return mem.Alloc(n, s)
}

// tagPool is the cache pool of tag (the general cache for 0), made on its
// first use; one asleep refuses. Called with a.mu held.
func (a *Allocator) tagPool(tag Tag) (*cachePool, error) {
	if tag == 0 {
		return a.general, nil
	}
	p := a.tags[tag]
	if p == nil {
		var perStream uint64
		if g, ok := a.dev.(arena.StreamGranular); ok {
			perStream = g.StreamGranule()
		}
		p = &cachePool{tag: tag, retained: newRetained()}
		p.emptySegs.perStream = perStream
		dev, _ := a.dev.(arena.Sleeper)
		p.rule = tagRetention{generalRetention: generalRetention{largeCache: a.cfg.LargeCache, missRelease: a.cfg.MissRelease, perStream: perStream}, pool: p, dev: dev}
		p.limits = p.rule.limits()
		if a.tags == nil {
			a.tags = map[Tag]*cachePool{}
		}
		a.tags[tag] = p
	}
	if p.asleep {
		return nil, &StateError{Msg: fmt.Sprintf("allocation in memory tag %q on device %d, which is asleep: wake_up it first", TagName(tag), a.dev.Ordinal())}
	}
	return p, nil
}

// tagPools is the memory tags' pools, by tag.
func (a *Allocator) tagPools() []*cachePool {
	out := make([]*cachePool, 0, len(a.tags))
	for _, t := range slices.Sorted(mapKeys(a.tags)) {
		out = append(out, a.tags[t])
	}
	return out
}

func mapKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// MallocTagged is Malloc in memory tag tag (0: Malloc itself).
func (a *Allocator) MallocTagged(tag Tag, size uint64, s arena.Stream) (uintptr, error) {
	return a.malloc(tag, size, s)
}

// SetTagsInUse says that memory tags are in use in the process: the C++
// class's front, which hands a freed block to the next request of its
// stream and size before Go sees the request, and so cannot see the
// request's tag, stays off for good (front.go).
func (a *Allocator) SetTagsInUse() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.tagsInUse = true
	a.publishFront()
}

// sleeper is the device's sleep and wake, or ErrNeedsVMM.
func (a *Allocator) sleeper(what string) (arena.Sleeper, error) {
	sl, ok := a.dev.(arena.Sleeper)
	if !ok {
		return nil, fmt.Errorf("goalloc: %s on device %d: %w", what, a.dev.Ordinal(), ErrNeedsVMM)
	}
	if a.capturing() {
		return nil, &StateError{Msg: fmt.Sprintf("%s on device %d during a CUDA graph capture: call it outside the capture", what, a.dev.Ordinal())}
	}
	return sl, nil
}

// PrepareSleep pins at least size bytes of host memory for a later sleep's
// offload now (arena.Sleeper.PrepareOffload), so that the first sleep does
// not pay for it. The mutex is not held while it pins: allocations and
// frees go on meanwhile, from other threads. It returns the size of the
// host memory kept for offloads.
func (a *Allocator) PrepareSleep(size uint64) (uint64, error) {
	a.mu.Lock()
	sl, err := a.sleeper("prepare_sleep")
	a.mu.Unlock()
	if err != nil {
		return 0, err
	}
	n, err := sl.PrepareOffload(size)
	if err != nil {
		return n, fmt.Errorf("goalloc: prepare_sleep on device %d: %w", a.dev.Ordinal(), err)
	}
	return n, nil
}

// Asleep says whether anything of the device is asleep.
func (a *Allocator) Asleep() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.asleepTags() != nil
}

// asleepTags is the tags asleep, in order (nil: none).
func (a *Allocator) asleepTags() []Tag {
	var out []Tag
	for _, p := range a.tagPools() {
		if p.asleep {
			out = append(out, p.tag)
		}
	}
	return out
}

// tagNames is the tags' names, for messages.
func tagNames(ts []Tag) string {
	var names []string
	for _, t := range ts {
		names = append(names, fmt.Sprintf("%q", TagName(t)))
	}
	return strings.Join(names, ", ")
}

// asleepBytes is the bytes of goalloc's blocks and segments asleep.
func (a *Allocator) asleepBytes() uint64 {
	var n uint64
	for _, p := range a.tags {
		if p.asleep {
			n += p.reserved
		}
	}
	return n
}

// Sleep puts every memory tag's pool of the device to sleep, the contents
// of those in offload first copied to the host, and then gives the free
// cache back to the device (see the note above). A tag in offload that
// holds nothing here offloads nothing.
func (a *Allocator) Sleep(offload []Tag) (SleepResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	sl, err := a.sleeper("sleep")
	if err != nil {
		return SleepResult{}, err
	}
	if asleep := a.asleepTags(); asleep != nil {
		return SleepResult{}, &StateError{Msg: fmt.Sprintf("sleep on device %d, where memory tags %s are asleep: wake_up them first", a.dev.Ordinal(), tagNames(asleep))}
	}
	a.refreshHeld()
	before, _ := a.mu.held.get()
	a.pollDeferred()
	req := arena.SleepRequest{}
	for _, p := range a.tagPools() {
		a.releaseLRU(p, 0)
		a.releaseEmptyOf(p)
		req.Tags = append(req.Tags, p.tag)
		if slices.Contains(offload, p.tag) {
			req.Offload = append(req.Offload, p.tag)
		}
	}
	var sync bool
	req.Streams, req.Events, sync = a.sleepWaits()
	if sync {
		// A free waiting for other streams whose event could not be
		// recorded: only a synchronisation proves it done.
		if err := a.dev.Synchronize(); err != nil {
			return SleepResult{}, err
		}
		a.stats.NumSyncAllStreams++
	}
	var rep arena.SleepReport
	if len(req.Tags) > 0 {
		rep, err = sl.Sleep(req)
	}
	// The device says what is asleep, also after a failure midway.
	for _, t := range sl.SleepState().Asleep {
		if p := a.tags[t]; p != nil && !p.asleep {
			p.asleep = true
			p.limits = p.rule.limits()
			a.limited.Suspend(p.reserved)
		}
	}
	if err != nil {
		a.refreshHeld()
		return SleepResult{}, fmt.Errorf("goalloc: sleep on device %d: %w", a.dev.Ordinal(), err)
	}
	a.releaseLRU(a.general, 0)
	a.releaseEmptyOf(a.general)
	err = a.mem.Trim(a.reserveBytes)
	a.refreshHeld()
	after, _ := a.mu.held.get()
	return SleepResult{Offloaded: rep.Offloaded, Released: uint64(max(0, before-after)), Prepare: rep.Prepare, Offload: rep.Offload}, err
}

// sleepWaits is what must complete before tagged memory goes, beyond its
// own streams' work: the other streams that use live tagged blocks
// (record_stream), and the events of tagged frees waiting for other
// streams; sync says one of those has no event (a failed record).
func (a *Allocator) sleepWaits() (streams []arena.Stream, events []arena.Event, sync bool) {
	for ptr, used := range a.recorded {
		if a.tagOf(ptr) != 0 {
			streams = append(streams, used...)
		}
	}
	for _, ptr := range a.deferred.Pending() {
		if a.tagOf(ptr) == 0 {
			continue
		}
		evs, ok := a.deferred.Events(ptr)
		events = append(events, evs...)
		sync = sync || !ok
	}
	slices.Sort(streams)
	return slices.Compact(streams), events, sync
}

// tagOf is the tag of the block or segment at ptr (0: untagged, or none).
func (a *Allocator) tagOf(ptr uintptr) Tag {
	if id, ok := a.largeByAddr.Get(ptr); ok {
		return a.blocks[id].list.pool.tag
	}
	if seg := a.findSegment(ptr); seg != nil {
		return seg.list.pool.tag
	}
	return 0
}

// Wake wakes the tags named that are asleep (all of them for nil), in
// order, each whole or not at all (see the note above). Out of memory is
// an OOMError, and leaves the tag that did not fit and those after it
// asleep; what woke before it stays awake (Woken).
func (a *Allocator) Wake(tags []Tag) (WakeResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	sl, err := a.sleeper("wake_up")
	if err != nil {
		return WakeResult{}, err
	}
	asleep := a.asleepTags()
	if asleep == nil {
		return WakeResult{}, &StateError{Msg: fmt.Sprintf("wake_up on device %d, where nothing is asleep: sleep first", a.dev.Ordinal())}
	}
	if tags == nil {
		tags = asleep
	}
	var res WakeResult
	for _, t := range tags {
		if !slices.Contains(asleep, t) {
			continue
		}
		rep, err := a.wakePool(sl, a.tags[t])
		if err != nil {
			a.refreshHeld()
			return res, err
		}
		res.Woken = append(res.Woken, t)
		res.Mapped += rep.Mapped
		res.Restored += rep.Restored
		res.Map += rep.Map
		res.Restore += rep.Restore
	}
	if res.Woken == nil {
		return res, &StateError{Msg: fmt.Sprintf("wake_up on device %d of memory tags %s, none of which is asleep (asleep: %s)", a.dev.Ordinal(), tagNames(tags), tagNames(asleep))}
	}
	a.refreshHeld()
	return res, nil
}

// wakePool wakes the sleeping pool p: what it caches goes back first, then
// its bytes are counted under the cap again and the device maps them. Out
// of memory reclaims as a refused allocation does, twice, before it is an
// OOMError.
func (a *Allocator) wakePool(sl arena.Sleeper, p *cachePool) (arena.WakeReport, error) {
	a.releaseLRU(p, 0)
	a.releaseEmptyOf(p)
	for attempt := 0; ; attempt++ {
		cause := error(arena.ErrCapReached)
		if a.limited.Resume(p.reserved, false) {
			rep, err := sl.Wake(p.tag)
			if err == nil {
				p.asleep = false
				p.limits = p.rule.limits()
				return rep, nil
			}
			a.limited.Suspend(p.reserved)
			if !errors.Is(err, arena.ErrOutOfMemory) {
				return rep, fmt.Errorf("goalloc: wake_up of memory tag %q on device %d: %w", TagName(p.tag), a.dev.Ordinal(), err)
			}
			cause = err
		}
		if attempt == 2 {
			return arena.WakeReport{}, fmt.Errorf("goalloc: wake_up of memory tag %q on device %d (%d bytes): %w",
				TagName(p.tag), a.dev.Ordinal(), p.reserved, a.outOfMemory(p.reserved, cause))
		}
		a.stats.NumAllocRetries++
		a.reclaim(attempt == 1)
	}
}

// AsleepTags is the memory tags asleep on the device, in order (nil: none).
func (a *Allocator) AsleepTags() []Tag {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.asleepTags()
}

// TagState is a memory tag's pool on a device: the bytes of its blocks and
// segments, and whether it is asleep.
type TagState struct {
	Tag      Tag
	Reserved uint64
	Asleep   bool
}

// SleepInfo is what a device holds per memory tag, and the host memory
// kept for what is asleep: the host copies, and the offload area they lie
// in (arena.SleepState).
type SleepInfo struct {
	Tags                []TagState
	Offloaded, HostArea uint64
}

// SleepInfo says what the device holds per memory tag, and for sleep.
func (a *Allocator) SleepInfo() SleepInfo {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out SleepInfo
	for _, p := range a.tagPools() {
		out.Tags = append(out.Tags, TagState{Tag: p.tag, Reserved: p.reserved, Asleep: p.asleep})
	}
	if sl, ok := a.dev.(arena.Sleeper); ok {
		st := sl.SleepState()
		out.Offloaded, out.HostArea = st.Offloaded, st.HostArea
	}
	return out
}
