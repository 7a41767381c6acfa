package replay

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/goalloc/goalloc/caching"
)

// This file reads the memory snapshots PyTorch writes,
//
//	torch.cuda.memory._record_memory_history(max_entries=1000000)
//	... the work ...
//	torch.cuda.memory._dump_snapshot("snapshot.pickle")
//
// which is pickle.dump(torch.cuda.memory._snapshot()): a dict with
//
//	segments       every segment of every device at the moment of the dump:
//	               device, address, total_size, stream, segment_pool_id,
//	               is_expandable, and blocks (address, size,
//	               requested_size, state: active_allocated,
//	               active_pending_free or inactive)
//	device_traces  per device, the history: a ring of the last max_entries
//	               events, oldest first, each a dict of action, addr (for
//	               an oom: device_free), size, stream, time_us and, when
//	               stacks were recorded, frames
//	allocator_settings  the caching allocator's configuration
//	               (PYTORCH_CUDA_ALLOC_CONF, expandable_segments, ...)
//
// (the keys of torch 2.11's THCPModule_memorySnapshot). goalloc's own
// snapshots (goalloc.dump_snapshot, or torch's functions after
// goalloc.install()) have the same segments and device_traces, and no
// allocator_settings.
//
// The actions: alloc (size is the request), free_requested (the tensor
// died), free_completed (the block is reusable: after the streams that used
// it are done), segment_alloc and segment_free (cudaMalloc and cudaFree of
// a segment), segment_map and segment_unmap (expandable segments growing
// and shrinking), oom, and snapshot (a marker). The replay takes alloc and
// free_completed, as for a JSON lines trace.
//
// A history need not start from an empty allocator: recording may have
// begun after the model was built, and the ring drops its oldest events
// once it holds max_entries. Both leave the same mark: blocks the history
// frees but never allocates, and blocks live in the snapshot that it never
// touches. Nothing in the file tells the two apart, and nothing needs to:
// either way the history is exact from its first event on, given the state
// it implies at that event. So the replay allocates those blocks first, in
// address order (how an allocator carving fresh segments lays them out),
// then replays the history.

// ReadOptions says how to read a trace.
type ReadOptions struct {
	// Device picks the device of a memory snapshot to replay; -1 takes the
	// first with events. A JSON lines trace has one device and takes -1
	// only.
	Device int
	// MaxInputBytes bounds the trace's text, after gunzip; 0 is
	// DefaultMaxInputBytes. MaxLineBytes bounds a line of a JSON lines
	// trace; 0 is DefaultMaxLineBytes.
	MaxInputBytes, MaxLineBytes uint64
}

// The default input limits. A snapshot is held in memory whole, with its
// decoded values several times its size besides, and a compressed file can
// expand without end, so the text read is bounded; the default leaves room
// for long recordings, and --max-input-bytes raises it. A JSON lines
// trace's line is one event or the header, a few hundred bytes at most.
const (
	DefaultMaxInputBytes = 2 << 30
	DefaultMaxLineBytes  = 1 << 20
)

// SnapshotInfo is what a memory snapshot said beyond its events: which
// device was replayed, the state its history starts from, and the recorded
// run's own figures.
type SnapshotInfo struct {
	// Device is the device replayed; DevicesWithEvents every device whose
	// history has events.
	Device            int   `json:"device"`
	DevicesWithEvents []int `json:"devices_with_events"`
	// Recorder is "pytorch" for a snapshot of PyTorch's caching allocator
	// (it has allocator_settings), "goalloc" for one torch wrote through
	// goalloc's C++ allocator class (its settings start with "goalloc "),
	// else "unknown" (goalloc's own snapshots have no settings).
	Recorder string `json:"recorder"`
	// Entries is the number of events in the device's history, Actions
	// their count per action.
	Entries int            `json:"entries"`
	Actions map[string]int `json:"actions"`
	// InitialBlocks are the blocks live before the first event (allocated
	// before recording began, or before the ring wrapped), replayed as
	// allocations before it; InitialBlockBytes their bytes.
	InitialBlocks     int    `json:"initial_blocks"`
	InitialBlockBytes uint64 `json:"initial_block_bytes"`
	// InitialReservedBytes is what the recorded allocator held at the first
	// event: the segments of the snapshot, less those the history allocates,
	// plus those it frees.
	InitialReservedBytes uint64 `json:"initial_reserved_bytes"`
	// RecordedPeakReservedBytes is the recorded allocator's peak of
	// reserved bytes over the history, from InitialReservedBytes and its
	// segment events; 0 when the snapshot and its history disagree.
	RecordedPeakReservedBytes uint64 `json:"recorded_peak_reserved_bytes"`
	// ExpandableSegments says the recorded allocator ran with
	// expandable_segments (or the history maps and unmaps segments).
	ExpandableSegments bool `json:"expandable_segments"`
	// AllocConf is PyTorch's PYTORCH_CUDA_ALLOC_CONF in the recorded run.
	AllocConf string `json:"pytorch_cuda_alloc_conf,omitempty"`
	// Notes say what the replay can and cannot reproduce of this snapshot.
	Notes []string `json:"notes,omitempty"`
}

// Summary is the snapshot's description for the replay's table, a line
// each, each starting with a label in a column of nine.
func (s *SnapshotInfo) Summary() []string {
	var acts []string
	for a := range caching.NumActions {
		if n := s.Actions[a.String()]; n > 0 {
			acts = append(acts, fmt.Sprintf("%s %s", fmtCount(uint64(n)), a))
		}
	}
	who := "PyTorch's caching allocator"
	switch s.Recorder {
	case "goalloc":
		who = "goalloc (its allocator class in torch)"
	case "unknown":
		who = "an allocator other than PyTorch's (no allocator_settings)"
	}
	others := ""
	if len(s.DevicesWithEvents) > 1 {
		others = fmt.Sprintf(" (devices with events: %s)", joinInts(s.DevicesWithEvents))
	}
	lines := []string{
		fmt.Sprintf("snapshot %s; device %d%s: %s events (%s)", who, s.Device, others, fmtCount(uint64(s.Entries)), strings.Join(acts, ", ")),
	}
	start := "start    an empty allocator"
	if s.InitialBlocks > 0 || s.InitialReservedBytes > 0 {
		start = fmt.Sprintf("start    %s blocks (%s) live before the first event, replayed first; %s reserved then",
			fmtCount(uint64(s.InitialBlocks)), fmtBytes(s.InitialBlockBytes), fmtBytes(s.InitialReservedBytes))
	}
	lines = append(lines, start)
	if s.RecordedPeakReservedBytes > 0 {
		lines = append(lines, fmt.Sprintf("recorded peak reserved %s (the segments at the start and the segment events)", fmtBytes(s.RecordedPeakReservedBytes)))
	}
	return lines
}

func joinInts(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, ", ")
}

// actionNames lists the actions PyTorch's snapshots name, in caching's order.
func actionNames() []string {
	names := make([]string, 0, caching.NumActions)
	for a := range caching.NumActions {
		names = append(names, a.String())
	}
	return names
}

// snapEvent is one device trace entry.
type snapEvent struct {
	act        caching.Action
	addr, size uint64
	stream     uint64
	timeUs     int64
}

// sniffSnapshot says whether r starts like a pickle of protocol 2 or later
// (a JSON lines trace starts with '{'), and returns r to read from: r itself
// when it is buffered already, else r buffered.
func sniffSnapshot(r io.Reader) (io.Reader, bool) {
	br, ok := r.(*bufio.Reader)
	if !ok {
		br = bufio.NewReaderSize(r, 64<<10)
	}
	first, _ := br.Peek(1)
	return br, len(first) > 0 && first[0] == pickleProto
}

// readSnapshot reads a memory snapshot pickle from r and makes the Trace of
// one of its devices.
func readSnapshot(r io.Reader, name string, opt ReadOptions, start time.Time) (*Trace, error) {
	data, err := readAll(r)
	if err != nil {
		return nil, &ParseError{Path: name, Err: readError(err)}
	}
	fail := func(format string, args ...any) error {
		return &ParseError{Path: name, Err: fmt.Errorf(format, args...)}
	}
	v, err := unpickle(data)
	if err != nil {
		return nil, fail("not a readable memory snapshot: %w", err)
	}
	top, ok := v.(*pyDict)
	if !ok {
		return nil, fail("a pickle of a %s, not a memory snapshot (torch.cuda.memory._snapshot() is a dict of segments and device_traces)", pyTypeName(v))
	}
	s := &snapshotReader{name: name, top: top, size: len(data), elements: len(data)}
	tr, err := s.trace(opt)
	if err != nil {
		var pe *ParseError
		if errors.As(err, &pe) {
			return nil, err
		}
		return nil, &ParseError{Path: name, Err: err}
	}
	tr.Elapsed = time.Since(start)
	return tr, nil
}

// readAll reads r to its end. It fills chunks that double in size up to a
// bound and joins them once at the end, where a slice grown as it fills
// would copy the data several times and hold it twice while growing: a
// snapshot costs one copy, and a stream refused at the input limit
// (limitedInput) none, holding no more than the limit.
func readAll(r io.Reader) ([]byte, error) {
	const first, most = 64 << 10, 64 << 20
	var chunks [][]byte
	total := 0
	for size := first; ; size = min(2*size, most) {
		c := make([]byte, 0, size)
		var err error
		for len(c) < cap(c) && err == nil {
			var n int
			n, err = r.Read(c[len(c):cap(c)])
			c = c[:len(c)+n]
		}
		chunks = append(chunks, c)
		total += len(c)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if len(chunks) == 1 {
		return chunks[0], nil
	}
	data := make([]byte, 0, total)
	for _, c := range chunks {
		data = append(data, c...)
	}
	return data, nil
}

// snapshotReader turns a decoded snapshot into a Trace.
type snapshotReader struct {
	name string
	top  *pyDict
	info SnapshotInfo
	// size is the pickle's length in bytes; elements how many more list
	// elements the reader may walk (walk).
	size, elements int
}

// walk charges the n elements of a list the reader is about to walk against
// the snapshot's size. Every element of every list was pushed by an opcode
// of its own, a byte at least, and went into one list, so the lists of a
// pickle hold at most as many elements as it has bytes, and a reader that
// walks each list once stays within that. Only a list walked again can go
// past it: the memo (or DUP) hands out the same list or dict as often as a
// two-byte reference is written, so a small file can name one segment or
// block so many times over that walking it would take time and memory far
// beyond the file's. That is refused here, before the walk.
func (s *snapshotReader) walk(n int, what string) error {
	if n > s.elements {
		return fmt.Errorf("%s: the snapshot holds more list elements than its %d bytes can without repeating objects: its pickle memo refers to the same list or dict over and over "+
			"(torch writes each segment, block and event once), which would make reading it take work far beyond the file's size; a crafted or damaged file", what, s.size)
	}
	s.elements -= n
	return nil
}

// segment is what the replay needs of one of the snapshot's segments.
type segment struct {
	device    int
	address   uint64
	totalSize uint64
	stream    uint64
	private   bool // in a CUDA graph's private pool
	live      []liveBlock
}

// liveBlock is a block the snapshot shows in use (active_allocated or
// active_pending_free: a pending block waits for its free_completed), or
// one the history frees without allocating it.
type liveBlock struct {
	// size is the request, as the history's alloc events record it (torch's,
	// and goalloc's since its history records requests too).
	addr, size, stream uint64
}

func (s *snapshotReader) trace(opt ReadOptions) (*Trace, error) {
	tracesV, ok := s.top.get("device_traces")
	if !ok {
		return nil, errors.New("a dict without device_traces: not a memory snapshot of torch.cuda.memory._snapshot()'s structure")
	}
	traces, err := asList(tracesV, "device_traces")
	if err != nil {
		return nil, err
	}
	if err := s.walk(len(traces), "device_traces"); err != nil {
		return nil, err
	}
	segments, err := s.segments()
	if err != nil {
		return nil, err
	}
	s.settings()

	for d, tv := range traces {
		entries, err := asList(tv, fmt.Sprintf("device_traces[%d]", d))
		if err != nil {
			return nil, err
		}
		if len(entries) > 0 {
			s.info.DevicesWithEvents = append(s.info.DevicesWithEvents, d)
		}
	}
	if len(s.info.DevicesWithEvents) == 0 {
		return nil, noHistoryError(segments)
	}
	dev := s.info.DevicesWithEvents[0]
	if opt.Device >= 0 {
		if !slices.Contains(s.info.DevicesWithEvents, opt.Device) {
			return nil, fmt.Errorf("device %d has no events in this snapshot; devices with events: %s", opt.Device, joinInts(s.info.DevicesWithEvents))
		}
		dev = opt.Device
	} else if len(s.info.DevicesWithEvents) > 1 {
		s.note("replaying device %d, the first with events; other devices with events: %s (pick one with --device-index N)", dev, joinInts(s.info.DevicesWithEvents[1:]))
	}
	s.info.Device = dev
	entries, _ := asList(traces[dev], "")
	if err := s.walk(len(entries), fmt.Sprintf("device_traces[%d]", dev)); err != nil {
		return nil, err
	}
	events, err := s.decodeEvents(entries, dev)
	if err != nil {
		return nil, err
	}
	var own []*segment
	for _, sg := range segments {
		if sg.device == dev {
			own = append(own, sg)
		}
	}
	return s.build(events, own)
}

// noHistoryError says why a snapshot without events cannot be replayed, and
// what it does hold.
func noHistoryError(segments []*segment) error {
	var reserved, live uint64
	for _, sg := range segments {
		reserved += sg.totalSize
		for _, b := range sg.live {
			live += b.size
		}
	}
	return fmt.Errorf("a memory snapshot without allocation history: every device_traces list is empty, so there is nothing to replay "+
		"(it holds %d segments, %s reserved, %s in live blocks, at the moment it was taken). Record the history before the work: "+
		"torch.cuda.memory._record_memory_history(max_entries=1000000), then torch.cuda.memory._dump_snapshot(PATH) "+
		"(with enabled=\"state\", torch keeps no history)", len(segments), fmtBytes(reserved), fmtBytes(live))
}

// segments reads the snapshot's segments (all devices).
func (s *snapshotReader) segments() ([]*segment, error) {
	v, ok := s.top.get("segments")
	if !ok {
		return nil, errors.New("a dict without segments: not a memory snapshot of torch.cuda.memory._snapshot()'s structure")
	}
	list, err := asList(v, "segments")
	if err != nil {
		return nil, err
	}
	if err := s.walk(len(list), "segments"); err != nil {
		return nil, err
	}
	out := make([]*segment, 0, len(list))
	for i, sv := range list {
		what := fmt.Sprintf("segments[%d]", i)
		d, err := asDict(sv, what)
		if err != nil {
			return nil, err
		}
		sg := &segment{}
		var dev uint64
		if dev, err = uintField(d, "device", what); err != nil {
			return nil, err
		}
		sg.device = int(dev)
		if sg.address, err = uintField(d, "address", what); err != nil {
			return nil, err
		}
		if sg.totalSize, err = uintField(d, "total_size", what); err != nil {
			return nil, err
		}
		if sg.stream, err = streamField(d, what); err != nil {
			return nil, err
		}
		if pid, ok := d.get("segment_pool_id"); ok {
			if t, ok := pid.(pyTuple); ok {
				for _, x := range t {
					if n, ok := x.(int64); ok && n != 0 {
						sg.private = true
					}
				}
			}
		}
		if e, ok := d.get("is_expandable"); ok && e == true {
			s.info.ExpandableSegments = true
		}
		bv, ok := d.get("blocks")
		if !ok {
			return nil, fmt.Errorf("%s has no blocks", what)
		}
		blocks, err := asList(bv, what+".blocks")
		if err != nil {
			return nil, err
		}
		if err := s.walk(len(blocks), what+".blocks"); err != nil {
			return nil, err
		}
		for j, b := range blocks {
			bwhat := fmt.Sprintf("%s.blocks[%d]", what, j)
			bd, err := asDict(b, bwhat)
			if err != nil {
				return nil, err
			}
			state, _ := bd.get("state")
			if state != "active_allocated" && state != "active_pending_free" {
				continue
			}
			addrKey := "address"
			if _, ok := bd.get(addrKey); !ok {
				addrKey = "addr" // snapshots of torch before 2.1
			}
			lb := liveBlock{stream: sg.stream}
			if lb.addr, err = uintField(bd, addrKey, bwhat); err != nil {
				return nil, err
			}
			held, err := uintField(bd, "size", bwhat)
			if err != nil {
				return nil, err
			}
			if rs, ok := bd.get("requested_size"); ok {
				lb.size, _ = asUint(rs)
			}
			if lb.size == 0 {
				lb.size = held
			}
			sg.live = append(sg.live, lb)
		}
		out = append(out, sg)
	}
	return out, nil
}

// settings reads allocator_settings: who recorded the snapshot, and with
// what configuration.
func (s *snapshotReader) settings() {
	s.info.Recorder = "unknown"
	v, ok := s.top.get("allocator_settings")
	d, isDict := v.(*pyDict)
	if !ok || !isDict {
		return
	}
	s.info.Recorder = "pytorch"
	if c, ok := d.get("PYTORCH_CUDA_ALLOC_CONF"); ok {
		s.info.AllocConf, _ = c.(string)
	}
	if strings.HasPrefix(s.info.AllocConf, "goalloc ") {
		s.info.Recorder = "goalloc"
	}
	if e, ok := d.get("expandable_segments"); ok && e == true {
		s.info.ExpandableSegments = true
	}
}

// decodeEvents reads a device's trace entries.
func (s *snapshotReader) decodeEvents(entries []any, dev int) ([]snapEvent, error) {
	events := make([]snapEvent, 0, len(entries))
	unknown := map[string]int{}
	for i, ev := range entries {
		what := fmt.Sprintf("device_traces[%d][%d]", dev, i)
		d, err := asDict(ev, what)
		if err != nil {
			return nil, err
		}
		av, ok := d.get("action")
		if !ok {
			return nil, fmt.Errorf("%s has no action", what)
		}
		name, ok := av.(string)
		if !ok {
			return nil, fmt.Errorf("%s: action is a %s, not a str", what, pyTypeName(av))
		}
		act, known := caching.ActionNamed(name)
		if !known {
			unknown[name]++
			continue
		}
		e := snapEvent{act: act}
		if act != caching.ActionOOM && act != caching.ActionSnapshot {
			if e.addr, err = uintField(d, "addr", what); err != nil {
				return nil, err
			}
		}
		if act != caching.ActionSnapshot {
			if e.size, err = uintField(d, "size", what); err != nil {
				return nil, err
			}
			if e.stream, err = streamField(d, what); err != nil {
				return nil, err
			}
		}
		if t, ok := d.get("time_us"); ok {
			e.timeUs, _ = t.(int64)
		}
		events = append(events, e)
	}
	if len(unknown) > 0 {
		names := slices.Sorted(maps.Keys(unknown))
		for i, n := range names {
			names[i] = fmt.Sprintf("%s (%d)", preview(n), unknown[n])
		}
		s.note("device_traces[%d] has events of actions this reader does not know, left out: %s (it knows %s)",
			dev, strings.Join(names, ", "), strings.Join(actionNames(), ", "))
	}
	return events, nil
}

func (s *snapshotReader) note(format string, args ...any) {
	s.info.Notes = append(s.info.Notes, fmt.Sprintf(format, args...))
}

// build finds the state the history starts from, checks the history
// against it, and makes the Trace: the initial blocks' allocations, then
// the events.
func (s *snapshotReader) build(events []snapEvent, segments []*segment) (*Trace, error) {
	w, err := s.walkHistory(events)
	if err != nil {
		return nil, err
	}
	mismatch, reservedAtEnd, private := s.liveAtSnapshot(w, segments)
	consistentReserved := reservedAtEnd+w.shrunk >= w.grown
	if consistentReserved {
		s.recordedReserved(events, reservedAtEnd+w.shrunk-w.grown)
	}
	t, err := s.replayTrace(events, w.initial)
	if err != nil {
		return nil, err
	}
	h := &t.Header
	h.Workload = fmt.Sprintf("memory snapshot, device %d", s.info.Device)
	h.Events = int64(len(events))
	if n := len(events); n > 1 && events[n-1].timeUs > events[0].timeUs {
		h.Seconds = float64(events[n-1].timeUs-events[0].timeUs) / 1e6
	}
	if s.info.Recorder == "pytorch" && s.info.RecordedPeakReservedBytes > 0 && len(mismatch) == 0 {
		// The native figures the replay compares with: the recorded run's
		// peak reserved, over the peak of the bytes its allocs asked for
		// (a snapshot does not have torch's allocated_bytes peak, which
		// counts whole blocks), so that "vs native" compares reserved
		// bytes with reserved bytes.
		h.MaxReserved = s.info.RecordedPeakReservedBytes
		h.MaxAllocated = t.PeakLive
	}
	s.notes(mismatch, consistentReserved, private, w.grown)
	return t, nil
}

// where names event i of the snapshot's device in a message.
func (s *snapshotReader) where(i int) string {
	return fmt.Sprintf("device_traces[%d][%d]", s.info.Device, i)
}

// historyWalk is what one walk of the history found: the addresses it
// leaves live (with the event that allocated each, -1 for one live before
// it began), the last event naming each address, the blocks it frees
// without allocating them (live at its start), and the segment bytes it
// takes and gives back.
type historyWalk struct {
	live          map[uint64]int
	touched       map[uint64]int
	initial       []liveBlock
	grown, shrunk uint64
}

// walkHistory walks the history once, counting its actions, and refuses
// one that allocates a live address or frees one twice.
func (s *snapshotReader) walkHistory(events []snapEvent) (*historyWalk, error) {
	w := &historyWalk{live: map[uint64]int{}, touched: map[uint64]int{}}
	s.info.Actions = map[string]int{}
	for i, e := range events {
		s.info.Actions[e.act.String()]++
		switch e.act {
		case caching.ActionAlloc:
			if at, ok := w.live[e.addr]; ok {
				when := "before the history began"
				if at >= 0 {
					when = "at " + s.where(at)
				}
				return nil, fmt.Errorf("%s: alloc of address %#x, which is live (allocated %s, not freed since): the history is inconsistent", s.where(i), e.addr, when)
			}
			w.live[e.addr] = i
			w.touched[e.addr] = i
		case caching.ActionFreeRequested, caching.ActionFreeCompleted:
			if _, ok := w.live[e.addr]; !ok {
				if last, seen := w.touched[e.addr]; seen {
					return nil, fmt.Errorf("%s: %s of address %#x, which %s already freed and did not allocate again: the history is inconsistent",
						s.where(i), e.act, e.addr, s.where(last))
				}
				// Freed, never allocated: live before the first event.
				w.initial = append(w.initial, liveBlock{addr: e.addr, size: e.size, stream: e.stream})
				w.live[e.addr] = -1
			}
			w.touched[e.addr] = i
			if e.act == caching.ActionFreeCompleted {
				delete(w.live, e.addr)
			}
		case caching.ActionSegmentAlloc, caching.ActionSegmentMap:
			w.grown += e.size
		case caching.ActionSegmentFree, caching.ActionSegmentUnmap:
			w.shrunk += e.size
		}
	}
	return w, nil
}

// liveAtSnapshot adds to w.initial the blocks live at the snapshot that
// the history never names (live all along), and lists where the segments
// and the history disagree; it also sums the segments' bytes and counts
// the private pools' segments.
func (s *snapshotReader) liveAtSnapshot(w *historyWalk, segments []*segment) (mismatch []string, reservedAtEnd uint64, private int) {
	seen := map[uint64]bool{}
	for _, sg := range segments {
		reservedAtEnd += sg.totalSize
		if sg.private {
			private++
		}
		for _, b := range sg.live {
			seen[b.addr] = true
			if _, ok := w.live[b.addr]; ok {
				continue
			}
			if last, ok := w.touched[b.addr]; ok {
				mismatch = append(mismatch, fmt.Sprintf("block %#x is live in the segments but %s freed it", b.addr, s.where(last)))
				continue
			}
			// Replayed as its request, what the alloc events record.
			// (goalloc's history recorded the slot or block it handed out
			// before it recorded requests, as torch's does; such a
			// snapshot's initial blocks replay a little smaller than its
			// events would have them.)
			w.initial = append(w.initial, b)
		}
	}
	for addr, at := range w.live {
		if !seen[addr] && at >= 0 {
			mismatch = append(mismatch, fmt.Sprintf("%s allocates %#x, which the history never frees and the segments do not show live", s.where(at), addr))
		}
	}
	slices.Sort(mismatch)
	slices.SortFunc(w.initial, func(a, b liveBlock) int { return cmp.Compare(a.addr, b.addr) })
	return mismatch, reservedAtEnd, private
}

// recordedReserved is the recorded run's reserved bytes, from what they
// were at its start, walked through the segment events: its peak.
func (s *snapshotReader) recordedReserved(events []snapEvent, initial uint64) {
	s.info.InitialReservedBytes = initial
	r, peak := initial, initial
	for _, e := range events {
		switch e.act {
		case caching.ActionSegmentAlloc, caching.ActionSegmentMap:
			r += e.size
		case caching.ActionSegmentFree, caching.ActionSegmentUnmap:
			r -= e.size
		}
		peak = max(peak, r)
	}
	s.info.RecordedPeakReservedBytes = peak
}

// replayTrace is the trace the replay runs: the initial blocks first,
// then the history.
func (s *snapshotReader) replayTrace(events []snapEvent, initial []liveBlock) (*Trace, error) {
	p := &parser{name: s.name, t: &Trace{Path: s.name}, ids: map[uint64]liveID{}}
	t := p.t
	t.Snapshot = &s.info
	t.Events = make([]Event, 0, len(initial)+len(events))
	for k, b := range initial {
		p.line = -(k + 1)
		if err := p.apply(&rawEvent{act: caching.ActionAlloc, addr: b.addr, size: b.size, stream: b.stream}); err != nil {
			return nil, fmt.Errorf("initial block %d: %w", k+1, err)
		}
		s.info.InitialBlockBytes += b.size
	}
	s.info.InitialBlocks = len(initial)
	for i, e := range events {
		p.line = i + 1
		t.Lines++
		if !slices.Contains(lineActions[:], e.act) {
			continue
		}
		t.Actions[e.act]++
		if err := p.apply(&rawEvent{act: e.act, addr: e.addr, size: e.size, stream: e.stream, t: e.timeUs}); err != nil {
			return nil, fmt.Errorf("%s: %w", s.where(i), err)
		}
	}
	s.info.Entries = len(events)
	return t, nil
}

// notes says what the replay of this snapshot can and cannot reproduce.
func (s *snapshotReader) notes(mismatch []string, consistentReserved bool, private int, grown uint64) {
	in := &s.info
	if in.InitialBlocks > 0 {
		s.note("the history does not start from an empty allocator: %s blocks (%s) allocated before its first event were live then. "+
			"Recording began after they were allocated, or the ring buffer (max_entries) wrapped and dropped the oldest events; "+
			"the replay allocates them first, in address order. What happened before the first event is not in the file, "+
			"so where the recorded run had placed them (and so the recorded segments) cannot be reproduced exactly",
			fmtCount(uint64(in.InitialBlocks)), fmtBytes(in.InitialBlockBytes))
	}
	if in.InitialReservedBytes > in.InitialBlockBytes && consistentReserved && in.InitialBlocks == 0 {
		s.note("the recorded allocator held %s of cached segments at the first event, which the replay starts without", fmtBytes(in.InitialReservedBytes))
	}
	if in.Entries == 1 {
		s.note("the history holds one event: torch keeps a ring of one when recording with enabled=\"state\"; " +
			"record with torch.cuda.memory._record_memory_history(max_entries=1000000) to replay the run")
	}
	if len(mismatch) > 0 {
		shown := mismatch[:min(3, len(mismatch))]
		s.note("the snapshot's segments disagree with the end of its history in %d blocks (%s): the snapshot was taken after recording stopped, "+
			"or the history is damaged. The replay follows the history; the recorded run's figures are not reported",
			len(mismatch), strings.Join(shown, "; "))
	}
	if !consistentReserved {
		s.note("the history takes %s more segment memory than the snapshot's segments hold: recorded figures are unknown (was the snapshot taken after recording stopped?)",
			fmtBytes(grown))
	}
	if in.ExpandableSegments {
		s.note("recorded with expandable_segments: the recorded run's reserved memory grew and shrank by segment_map and segment_unmap, " +
			"and its peak reserved counts those; the native policy models the default allocator (whole 2 MiB, 20 MiB and larger segments), " +
			"so its peak is not the recorded run's. The allocations replay as usual")
	}
	if in.AllocConf != "" && in.Recorder == "pytorch" {
		s.note("recorded with PYTORCH_CUDA_ALLOC_CONF=%s; the native policy models the default settings, so its figures may differ from the recorded run's", preview(in.AllocConf))
	}
	if n := in.Actions["oom"]; n > 0 {
		s.note("the recorded run ran out of memory (%d oom events); the requests that failed are not in the history and are not replayed", n)
	}
	if private > 0 {
		s.note("%d segments belong to private pools (CUDA graphs, MemPool); the replay does not keep pools apart", private)
	}
	switch in.Recorder {
	case "goalloc":
		s.note("recorded by goalloc (through its allocator class in torch, settings %s): its peak reserved, %s, is goalloc's",
			preview(strings.TrimPrefix(in.AllocConf, "goalloc ")), fmtBytes(in.RecordedPeakReservedBytes))
	case "unknown":
		s.note("no allocator_settings: not written by PyTorch's caching allocator (goalloc's snapshots have none). Its alloc sizes are what that allocator recorded "+
			"(goalloc, like torch, records the requests), and its peak reserved, %s, is that allocator's", fmtBytes(in.RecordedPeakReservedBytes))
	}
}
