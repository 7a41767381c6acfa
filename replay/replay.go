package replay

import (
	"errors"
	"fmt"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/goalloc/goalloc/replay/reference"
)

// Options says what to replay a trace on.
type Options struct {
	// Policy names a policy of package reference (reference.Names); "" is goalloc.
	Policy string
	// Conf is a GOALLOC_CONF string for the goalloc policy.
	Conf string
	// DeviceLag is how far, in microseconds of the trace's clock, the
	// simulated device runs behind the host (deviceLag); 0: none.
	DeviceLag int64
	// StreamLag is, for the streams it names (the trace's numbers), a lag
	// of their own in place of DeviceLag: one stream may run far behind
	// the others (FSDP's all-gathers, queued behind the compute stream's
	// events).
	StreamLag map[arena.Stream]int64
}

// Result is what one replay of one trace on one policy measured.
type Result struct {
	Trace    string `json:"trace"`
	Workload string `json:"workload"`
	Policy   string `json:"policy"`
	Conf     string `json:"conf,omitempty"`
	Device   string `json:"device"` // "sim" or "cuda"
	// DeviceLagMicros is Options.DeviceLag: how far the simulated device
	// ran behind the trace's clock.
	DeviceLagMicros int64 `json:"device_lag_us,omitempty"`
	// StreamLagMicros is Options.StreamLag.
	StreamLagMicros map[arena.Stream]int64 `json:"stream_lag_us,omitempty"`

	// Events is the number of event lines in the trace; Replayed those
	// acted on (alloc and free_completed).
	Events   int `json:"events"`
	Replayed int `json:"events_replayed"`

	// PeakLiveBytes is the most bytes the trace held allocated at once (the
	// sum of its alloc sizes), as replayed: allocations that failed for lack
	// of memory do not count.
	PeakLiveBytes uint64 `json:"peak_live_bytes"`
	// PeakReservedBytes is the device pool's reserved high-water mark (for
	// the cudaMalloc-style policies, reference.SegmentHolder, the most bytes
	// of segments they held, which is what cudaMalloc would have mapped)
	// (PoolUsage().ReservedHigh): memory the driver really mapped, the same
	// measure on the simulated pool and on a GPU.
	PeakReservedBytes uint64 `json:"peak_reserved_bytes"`
	// AllocatorPeakReservedBytes is the policy's own count of the most bytes
	// it held from the device (or, for a policy with no count of its own,
	// the device wrapper's).
	AllocatorPeakReservedBytes uint64 `json:"allocator_peak_reserved_bytes"`
	// AllocatorPeakAllocatedBytes is the policy's peak of the bytes it
	// handed out, requests rounded up to its blocks (PyTorch's
	// allocated_bytes.all.peak); 0 when the policy does not count them.
	AllocatorPeakAllocatedBytes uint64 `json:"allocator_peak_allocated_bytes,omitempty"`
	// Ratio is PeakReservedBytes / PeakLiveBytes.
	Ratio float64 `json:"ratio"`

	// FragmentationAtPeak is Fragmentation.Ratio.
	FragmentationAtPeak float64 `json:"fragmentation_at_peak"`
	// Fragmentation is the policy's free memory right after the event at
	// which live bytes first reach their peak in the trace (PeakEvent).
	Fragmentation reference.Fragmentation `json:"fragmentation"`
	// PeakLiveEvent and PeakReservedEvent are the indexes of the replayed
	// events after which live bytes, and the pool's reserved bytes, first
	// reached their peaks.
	PeakLiveEvent     int `json:"peak_live_event"`
	PeakReservedEvent int `json:"peak_reserved_event"`
	// HeldAtPeak is what a VMM device held right after PeakReservedEvent,
	// span by span (arena.HeldSplit): where the peak's bytes beyond live
	// lie. Absent for other devices.
	HeldAtPeak *arena.HeldSplit `json:"held_at_peak,omitempty"`
	// FreeEndsAtPeak is, at the same moment, which live spans the free
	// ends (HeldAtPeak's FreeShared) lie beside, by their size, the most
	// bytes first (arena.FreeEnds).
	FreeEndsAtPeak []arena.FreeEnds `json:"free_ends_at_peak,omitempty"`

	// DeviceAllocs and DeviceFrees count the calls that reached the device.
	DeviceAllocs uint64 `json:"device_allocs"`
	DeviceFrees  uint64 `json:"device_frees"`
	// DriverCalls is the VMM device's profile of its driver calls (count
	// and time per driver function, the most time first): where a miss's
	// time goes on a GPU. Absent for a device that keeps none.
	DriverCalls []arena.DriverCallStat `json:"driver_calls,omitempty"`
	// OOMs counts allocations that failed for lack of memory; the replay
	// goes on without them (and skips their frees). OOMError is the first.
	OOMs     int    `json:"ooms"`
	OOMError string `json:"oom_error,omitempty"`
	// InputWarnings counts the calls the policy found wrong but carried out
	// all the same (caching.InputError with Handled: goalloc frees a block
	// freed on another stream than its allocation's in the allocation
	// stream's order); the replay goes on past them. InputWarning is the
	// first.
	InputWarnings int    `json:"input_warnings"`
	InputWarning  string `json:"input_warning,omitempty"`

	// NsPerOp is the wall time of the replay loop over Replayed, and
	// EventsPerSecond its inverse. EndToEndEventsPerSecond counts every event
	// line over the time to read and parse the trace plus the replay loop.
	NsPerOp                 float64 `json:"ns_per_op"`
	EventsPerSecond         float64 `json:"events_per_second"`
	EndToEndEventsPerSecond float64 `json:"end_to_end_events_per_second"`
	ParseSeconds            float64 `json:"parse_seconds"`
	ReplaySeconds           float64 `json:"replay_seconds"`

	// The native allocator's own figures, from the trace header: what
	// PyTorch reported at the end of the recorded run.
	NativeMaxReserved   uint64  `json:"native_max_reserved"`
	NativeMaxAllocated  uint64  `json:"native_max_allocated"`
	NativeRatio         float64 `json:"native_ratio"`
	NativeSegmentAllocs int     `json:"native_segment_allocs"`

	// Snapshot describes the memory snapshot replayed; absent for a JSON
	// lines trace.
	Snapshot *SnapshotInfo `json:"snapshot,omitempty"`

	// Timeline is the memory over the replay, for plots.
	Timeline Timeline `json:"-"`
}

// Timeline is a replay's memory over its events. Live bytes change at every
// event and are kept per event; reserved bytes change only when memory
// crosses the device, and are kept as steps.
type Timeline struct {
	Live              []uint64 // after each replayed event
	AllocatorReserved Steps    // bytes the policy held from the device
	PoolReserved      Steps    // the pool's reserved bytes
}

// Steps is a series that holds Bytes[k] from event At[k] up to At[k+1].
type Steps struct {
	At    []int
	Bytes []uint64
}

func (s *Steps) set(at int, v uint64) {
	if n := len(s.Bytes); n > 0 && s.Bytes[n-1] == v {
		return
	}
	s.At = append(s.At, at)
	s.Bytes = append(s.Bytes, v)
}

// Peak is the largest value and the first event at which it holds.
func (s *Steps) Peak() (at int, v uint64) {
	for k, b := range s.Bytes {
		if b > v {
			at, v = s.At[k], b
		}
	}
	return at, v
}

// DeviceName names dev's kind as its Name method does ("sim", "cuda"), or by
// its Go type for a device without one, so that replay need not know every
// kind of device there is.
func DeviceName(dev arena.Device) string {
	if named, ok := dev.(interface{ Name() string }); ok {
		return named.Name()
	}
	return fmt.Sprintf("%T", dev)
}

// Replay runs the trace's allocations and frees through a policy over dev.
// dev must be fresh (nothing allocated, the pool's high-water marks at zero),
// and it belongs to the replay: it is closed when Replay returns.
//
// An allocation that fails for lack of memory is counted and skipped, with
// its free; a call the policy carries out despite bad input is counted as a
// warning (InputWarnings); any other error stops the replay, naming the
// trace line.
func Replay(t *Trace, dev arena.Device, opt Options) (res *Result, err error) {
	name := opt.Policy
	if name == "" {
		name = "goalloc"
	}
	res = &Result{
		Trace: t.Path, Workload: t.Header.Workload, Policy: name, Device: DeviceName(dev),
		Events: t.Lines, Replayed: len(t.Events),
		NativeMaxReserved: t.Header.MaxReserved, NativeMaxAllocated: t.Header.MaxAllocated,
		NativeRatio: t.Header.NativeRatio(), NativeSegmentAllocs: t.SegmentAllocs(),
		ParseSeconds: t.Elapsed.Seconds(), Snapshot: t.Snapshot,
	}
	if name == "goalloc" {
		res.Conf = opt.Conf
	}
	res.DeviceLagMicros, res.StreamLagMicros = opt.DeviceLag, opt.StreamLag
	lag, err := newDeviceLag(dev, t, opt.DeviceLag, opt.StreamLag)
	if err != nil {
		dev.Close()
		return nil, err
	}
	cd := newCountingDevice(dev)
	a, err := reference.New(name, cd.asDevice(), opt.Conf)
	if err != nil {
		dev.Close()
		return nil, err
	}
	defer func() {
		if cerr := a.Close(); cerr != nil && err == nil {
			res, err = nil, fmt.Errorf("closing policy %s: %w", name, cerr)
		}
	}()

	tl := &res.Timeline
	tl.Live = make([]uint64, len(t.Events))
	ptrs := make([]uintptr, t.Slots)
	var live, peakLive uint64
	var fragCost time.Duration
	split := peakSplit{}
	split.dev, _ = dev.(arena.HeldSplitter)
	start := time.Now()
	for i := range t.Events {
		ev := &t.Events[i]
		if lag != nil {
			lag.before(ev.T)
		}
		switch ev.Op {
		case OpAlloc:
			p, err := a.Malloc(ev.Size, ev.Stream)
			if err != nil {
				if !errors.Is(err, arena.ErrOutOfMemory) {
					return nil, replayError(t, ev, name, err)
				}
				if res.OOMs == 0 {
					res.OOMError = fmt.Sprintf("%s: %v", t.where(ev.Line), err)
				}
				res.OOMs++
				p = 0 // its free is skipped too
			} else {
				live += ev.Size
			}
			ptrs[ev.Slot] = p
		case OpFree:
			p := ptrs[ev.Slot]
			if p == 0 {
				break
			}
			if err := a.Free(p, ev.Size, ev.Stream); err != nil {
				if !handledInput(err) {
					return nil, replayError(t, ev, name, err)
				}
				if res.InputWarnings == 0 {
					res.InputWarning = fmt.Sprintf("%s: %v", t.where(ev.Line), err)
				}
				res.InputWarnings++
			}
			live -= ev.Size
		}
		if lag != nil {
			lag.after(ev.Stream, ev.T)
		}
		tl.Live[i] = live
		if live > peakLive {
			peakLive, res.PeakLiveEvent = live, i
		}
		tl.AllocatorReserved.set(i, cd.counts.Held())
		tl.PoolReserved.set(i, cd.poolReserved)
		split.see(cd.poolReserved)
		if i == t.PeakEvent {
			// Once per replay; its cost is not the policy's speed.
			f0 := time.Now()
			res.Fragmentation = a.Fragmentation()
			fragCost = time.Since(f0)
		}
	}
	elapsed := time.Since(start) - fragCost - split.cost
	res.HeldAtPeak, res.FreeEndsAtPeak = split.at, split.ends

	res.PeakLiveBytes = peakLive
	res.FragmentationAtPeak = res.Fragmentation.Ratio
	u, err := dev.PoolUsage()
	if err != nil {
		return nil, fmt.Errorf("reading the pool's figures after the replay: %w", err)
	}
	if cd.poolErr != nil {
		return nil, fmt.Errorf("reading the pool's figures during the replay: %w", cd.poolErr)
	}
	res.PeakReservedBytes = u.ReservedHigh
	res.PeakReservedEvent, _ = tl.PoolReserved.Peak()
	res.takePeaks(a, peakLive)
	res.DeviceAllocs, res.DeviceFrees = cd.counts.Allocs(), cd.counts.Frees()
	if p, ok := dev.(arena.DriverProfiler); ok {
		res.DriverCalls = p.DriverCalls()
	}
	res.takeSpeed(t, elapsed)
	return res, nil
}

// takePeaks fills in the policy's own peaks, and the ratio.
func (res *Result) takePeaks(a reference.Allocator, peakLive uint64) {
	if pr, ok := a.(reference.PeakReserver); ok {
		res.AllocatorPeakReservedBytes = pr.PeakReserved()
	} else {
		_, res.AllocatorPeakReservedBytes = res.Timeline.AllocatorReserved.Peak()
	}
	if _, ok := a.(reference.SegmentHolder); ok {
		// A cudaMalloc-style policy's segments are mapped one by one: the
		// device's own peak, and its split, are not its figure.
		res.PeakReservedBytes = res.AllocatorPeakReservedBytes
		res.HeldAtPeak, res.FreeEndsAtPeak = nil, nil
	}
	if pa, ok := a.(reference.PeakAllocator); ok {
		res.AllocatorPeakAllocatedBytes = pa.PeakAllocated()
	}
	if peakLive > 0 {
		res.Ratio = float64(res.PeakReservedBytes) / float64(peakLive)
	}
}

// takeSpeed fills in the replay's speed: elapsed is the replay loop's time.
func (res *Result) takeSpeed(t *Trace, elapsed time.Duration) {
	res.ReplaySeconds = elapsed.Seconds()
	if n := len(t.Events); n > 0 && elapsed > 0 {
		res.NsPerOp = float64(elapsed.Nanoseconds()) / float64(n)
		res.EventsPerSecond = float64(n) / elapsed.Seconds()
	}
	if total := t.Elapsed + elapsed; total > 0 {
		res.EndToEndEventsPerSecond = float64(t.Lines) / total.Seconds()
	}
}

// peakSplit keeps what a VMM device held, span by span (arena.HeldSplit),
// and which live spans its free ends lie beside, at each new peak of its
// reserved bytes: walks over the spans, whose time (cost) is not the
// policy's speed.
type peakSplit struct {
	dev  arena.HeldSplitter // nil: a device that says nothing of it
	high uint64
	at   *arena.HeldSplit
	ends []arena.FreeEnds
	cost time.Duration
}

func (p *peakSplit) see(reserved uint64) {
	if p.dev == nil || reserved <= p.high {
		return
	}
	t0 := time.Now()
	s := p.dev.HeldSplit()
	p.at, p.ends, p.high = &s, p.dev.FreeEndsBeside(), reserved
	p.cost += time.Since(t0)
}

// InputWarningNote says, for the report, how many calls the policy carried
// out despite bad input and what the first was; "" when there were none.
func (r *Result) InputWarningNote() string {
	if r.InputWarnings == 0 {
		return ""
	}
	return fmt.Sprintf("%s: calls carried out despite bad input (a warning each): %s; the first at %s",
		r.Policy, fmtCount(uint64(r.InputWarnings)), r.InputWarning)
}

// handledInput says err only reports input the policy found wrong and
// acted on all the same (caching.InputError.Handled, as goalloc's library
// front treats it too): the call did its work, so the replay counts it and
// goes on.
func handledInput(err error) bool {
	ies := caching.InputErrors(err)
	for _, ie := range ies {
		if !ie.Handled {
			return false
		}
	}
	return len(ies) > 0
}

func replayError(t *Trace, ev *Event, policy string, err error) error {
	what := "alloc"
	if ev.Op == OpFree {
		what = "free_completed"
	}
	return fmt.Errorf("%s: %s: %s of %d bytes on stream %#x: policy %s: %w",
		t.Path, t.where(ev.Line), what, ev.Size, uint64(ev.Stream), policy, err)
}
