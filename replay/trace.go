package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/flate"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

// Header is a trace's first line: where and how it was recorded, and the
// native allocator's own peaks over the run.
type Header struct {
	Workload     string  `json:"workload"`
	Torch        string  `json:"torch"`
	GPU          string  `json:"gpu"`
	MaxAllocated uint64  `json:"max_allocated"` // PyTorch's allocated_bytes.all.peak
	MaxReserved  uint64  `json:"max_reserved"`  // PyTorch's reserved_bytes.all.peak
	Events       int64   `json:"events"`        // event lines that follow
	Seconds      float64 `json:"seconds"`
	// GoallocReservedPeak is, in a trace goalloc recorded, the most the
	// device held by the recording's end (goalloc_reserved_peak): what a
	// replay of a recording from the process's start predicts.
	GoallocReservedPeak uint64 `json:"goalloc_reserved_peak"`
}

// NativeRatio is the native allocator's max_reserved / max_allocated, 0 when
// the header does not have them.
func (h Header) NativeRatio() float64 {
	if h.MaxAllocated == 0 {
		return 0
	}
	return float64(h.MaxReserved) / float64(h.MaxAllocated)
}

// Op is what the replay does for an Event.
type Op uint8

const (
	OpAlloc Op = iota + 1 // Malloc(Size, Stream) into the pointer table at Slot
	OpFree                // Free the pointer at Slot, of Size bytes, on Stream
)

// Event is one alloc or free_completed line, ready to replay. The trace's
// address ids are gone: each live block has a slot in a dense pointer table,
// freed slots are reused, so the table is as large as the most blocks live at
// once and the replay needs no map.
type Event struct {
	Size   uint64 // the alloc's size, for its free too (the allocator wants it back)
	Stream arena.Stream
	Slot   int32
	Line   int32 // where in the file, for error messages (Trace.where)
	Op     Op
	// T is when the process made the call, in microseconds (the line's
	// "t"; 0 where the trace has none).
	T int64
}

// Trace is a parsed trace.
type Trace struct {
	Path   string
	Header Header
	// Events holds the alloc and free_completed events, in file order; the
	// segment_alloc and free_requested lines are checked and counted only.
	Events []Event
	// Lines is the number of event lines (every action), Actions their
	// count per action.
	Lines   int
	Actions [caching.NumActions]int
	// Slots is the size of the pointer table Events index.
	Slots int
	// PeakLive is the most bytes live at once (the sum of alloc sizes),
	// first reached after Events[PeakEvent].
	PeakLive  uint64
	PeakEvent int
	// Elapsed is how long reading and parsing took.
	Elapsed time.Duration
	// Warnings are oddities that do not stop the replay.
	Warnings []string
	// Snapshot describes the memory snapshot the trace came from; nil for a
	// JSON lines trace.
	Snapshot *SnapshotInfo
}

// where names the place of an event's Line in the file, for messages: a
// line of a JSON lines trace, an entry of a snapshot's device trace, or one
// of the blocks a snapshot's history starts with.
func (t *Trace) where(line int32) string {
	switch {
	case t.Snapshot == nil:
		return fmt.Sprintf("line %d", line)
	case line < 0:
		return fmt.Sprintf("initial block %d (live before the history began)", -line)
	}
	return fmt.Sprintf("device_traces[%d][%d]", t.Snapshot.Device, line-1)
}

// SegmentAllocs is how many segments the native allocator took from
// cudaMalloc in the recorded run.
func (t *Trace) SegmentAllocs() int { return t.Actions[caching.ActionSegmentAlloc] }

// ParseError is a trace that could not be read, at a line when Line > 0.
type ParseError struct {
	Path string
	Line int
	Err  error
}

func (e *ParseError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%s: line %d: %v", e.Path, e.Line, e.Err)
	}
	return fmt.Sprintf("%s: %v", e.Path, e.Err)
}

func (e *ParseError) Unwrap() error { return e.Err }

// Open reads and parses the trace at path: gzipped JSON lines, or plain JSON
// lines (told apart by the gzip magic number, not by the name), or a memory
// snapshot pickle of PyTorch's (snapshot.go; told by the pickle's first
// byte), gzipped or not. A snapshot's first device with events is taken,
// and the input limits are the defaults (ReadOptions).
func Open(path string) (*Trace, error) { return OpenWith(path, ReadOptions{Device: -1}) }

// OpenWith is Open with options.
func OpenWith(path string, opt ReadOptions) (*Trace, error) {
	start := time.Now()
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening trace: %w", err)
	}
	defer f.Close()
	t, err := ReadWith(f, path, opt)
	if err != nil {
		return nil, err
	}
	t.Elapsed = time.Since(start)
	return t, nil
}

// Read parses a trace from r; name is its path for messages.
func Read(r io.Reader, name string) (*Trace, error) {
	return ReadWith(r, name, ReadOptions{Device: -1})
}

// ReadWith is Read with options.
func ReadWith(r io.Reader, name string, opt ReadOptions) (*Trace, error) {
	start := time.Now()
	br := bufio.NewReaderSize(r, 64<<10)
	magic, _ := br.Peek(2)
	var src io.Reader = br
	gzipped := len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b
	if gzipped {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, &ParseError{Path: name, Err: fmt.Errorf("unreadable gzip: %w", err)}
		}
		defer zr.Close()
		src = zr
	} else if strings.HasSuffix(name, ".gz") {
		return nil, &ParseError{Path: name, Err: errors.New("unreadable gzip: the name ends in .gz but the file does not start with the gzip magic number")}
	}
	src = &limitedInput{r: src, max: cmp.Or(opt.MaxInputBytes, DefaultMaxInputBytes)}
	var snapshot bool
	if src, snapshot = sniffSnapshot(src); snapshot {
		return readSnapshot(src, name, opt, start)
	} else if opt.Device >= 0 {
		return nil, &ParseError{Path: name, Err: errors.New("a device index picks a device of a memory snapshot; this is a JSON lines trace, of one device")}
	}

	p := &parser{name: name, t: &Trace{Path: name}, ids: map[uint64]liveID{}, gzipped: gzipped,
		maxLine: int(min(cmp.Or(opt.MaxLineBytes, DefaultMaxLineBytes), math.MaxInt))}
	if err := p.run(src); err != nil {
		return nil, err
	}
	if !p.sawHeader {
		return nil, &ParseError{Path: name, Err: errors.New("empty trace: no header line")}
	}
	if h := p.t.Header.Events; h > 0 && h != int64(p.t.Lines) {
		p.t.Warnings = append(p.t.Warnings, fmt.Sprintf("the header says %d events, the file has %d (truncated or edited?)", h, p.t.Lines))
	}
	p.t.Elapsed = time.Since(start)
	return p.t, nil
}

// limitedInput is a trace's text, after gunzip, that fails with an
// inputTooLargeError once more than max bytes come through: how far a
// small compressed file may expand, and how much of a snapshot is held.
type limitedInput struct {
	r         io.Reader
	max, read uint64
}

func (l *limitedInput) Read(p []byte) (int, error) {
	if l.read > l.max {
		return 0, &inputTooLargeError{max: l.max}
	}
	// One byte past the limit is enough to tell a text longer than it.
	if left := l.max - l.read + 1; uint64(len(p)) > left {
		p = p[:left]
	}
	n, err := l.r.Read(p)
	l.read += uint64(n)
	if l.read > l.max {
		return n, &inputTooLargeError{max: l.max}
	}
	return n, err
}

// inputTooLargeError is a trace whose text passes ReadOptions.MaxInputBytes.
type inputTooLargeError struct{ max uint64 }

func (e *inputTooLargeError) Error() string {
	return fmt.Sprintf("the trace is larger than %s after gunzip, the most this reader takes (--max-input-bytes raises it)", fmtBytes(e.max))
}

// maxEventsHint bounds the events a header's count reserves room for: the
// count is the file's claim, not what it holds, and past the bound Events
// grows as the lines arrive.
const maxEventsHint = 1 << 20

// liveID is what the parser knows of a trace address id between its alloc
// and its free_completed.
type liveID struct {
	slot int32
	line int32
	size uint64
}

type parser struct {
	name string
	// gzipped: the text comes through gzip, whose checksum can tell a
	// damaged file from a bad trace.
	gzipped bool
	// maxLine is the longest line taken (ReadOptions.MaxLineBytes).
	maxLine   int
	t         *Trace
	line      int
	sawHeader bool
	ids       map[uint64]liveID
	freeSlots []int32
	live      uint64
}

// chunkSize is how much decompressed text goes to the parser at a time:
// small enough that the pipeline fills and drains quickly (the parser waits
// for the first chunk, and nothing overlaps the parsing of the last), large
// enough that handing chunks over costs nothing.
const chunkSize = 256 << 10

type chunk struct {
	buf []byte // whole lines, the last one possibly without its newline at the end of input
	err error
}

// run parses everything src holds. Decompressing and parsing take about the
// same time, so a goroutine reads and decompresses the next chunk while this
// one parses the last.
func (p *parser) run(src io.Reader) error {
	chunks := make(chan chunk, 2)
	spare := make(chan []byte, 4)
	done := make(chan struct{})
	defer close(done)
	go readChunks(src, p.maxLine, chunks, spare, done)
	for c := range chunks {
		// A read error says more than whatever the cut-off text it left
		// would fail to parse as.
		if c.err != nil && c.err != io.EOF {
			return &ParseError{Path: p.name, Err: readError(c.err)}
		}
		if err := p.parseChunk(c.buf); err != nil {
			if c.err == nil && p.gzipped {
				return p.damaged(err, chunks, spare)
			}
			return err
		}
		if c.err == io.EOF {
			return nil
		}
		select {
		case spare <- c.buf[:0]:
		default:
		}
	}
	return nil
}

// damaged tells a damaged gzip file from a bad trace after the text failed
// to parse (parseErr). Damage inside the compressed data often decompresses
// to garbage without an error: gzip checks its checksum only at the end. So
// the rest is read through; if gzip then reports damage, that is the error,
// with where the text first went wrong, and otherwise parseErr is.
func (p *parser) damaged(parseErr error, chunks <-chan chunk, spare chan<- []byte) error {
	for c := range chunks {
		var tooLarge *inputTooLargeError
		if c.err == io.EOF || errors.As(c.err, &tooLarge) {
			break
		}
		if c.err != nil {
			return &ParseError{Path: p.name, Err: fmt.Errorf("%w (the file is damaged; its text stopped making sense at line %d)", readError(c.err), p.line)}
		}
		select {
		case spare <- c.buf[:0]:
		default:
		}
	}
	return parseErr
}

// readError says what went wrong reading the (possibly compressed) text.
func readError(err error) error {
	var corrupt flate.CorruptInputError
	var tooLarge *inputTooLargeError
	switch {
	case errors.As(err, &tooLarge):
		return err
	case errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("unreadable gzip: the file is truncated (%w)", err)
	case errors.Is(err, gzip.ErrChecksum), errors.Is(err, gzip.ErrHeader), errors.As(err, &corrupt):
		return fmt.Errorf("unreadable gzip: %w", err)
	}
	return fmt.Errorf("reading: %w", err)
}

// readChunks cuts src into chunks of whole lines and sends them on out; a
// chunk that carries an error is the last. It stops early once done closes.
// A line longer than maxLine is sent, as far as it was read, as the last
// chunk, for the parser to refuse (parseChunk): the buffer never grows past
// about twice maxLine.
func readChunks(src io.Reader, maxLine int, out chan<- chunk, spare <-chan []byte, done <-chan struct{}) {
	defer close(out)
	var rest []byte // the start of a line the last chunk cut off
	for {
		var buf []byte
		select {
		case buf = <-spare:
		default:
			buf = make([]byte, 0, chunkSize)
		}
		buf = append(buf, rest...)
		var err error
		tooLong := false
		for err == nil {
			if len(buf) == cap(buf) {
				if bytes.IndexByte(buf, '\n') >= 0 {
					break
				}
				if tooLong = len(buf) > maxLine; tooLong {
					break
				}
				buf = append(buf, 0)[:len(buf)] // a line longer than the buffer: grow it
			}
			var n int
			n, err = src.Read(buf[len(buf):cap(buf)])
			buf = buf[:len(buf)+n]
		}
		c := chunk{buf: buf, err: err}
		if err == nil && !tooLong {
			cut := bytes.LastIndexByte(buf, '\n') + 1
			rest = append(rest[:0], buf[cut:]...)
			c.buf = buf[:cut]
		}
		select {
		case out <- c:
		case <-done:
			return
		}
		if err != nil || tooLong {
			return
		}
	}
}

// parseChunk parses the lines of buf.
func (p *parser) parseChunk(buf []byte) error {
	var ev rawEvent
	for len(buf) > 0 {
		line := buf
		if i := bytes.IndexByte(buf, '\n'); i >= 0 {
			line, buf = buf[:i], buf[i+1:]
		} else {
			buf = nil
		}
		p.line++
		if len(line) > p.maxLine {
			return &ParseError{Path: p.name, Line: p.line, Err: fmt.Errorf("longer than %s, the longest line this reader takes (--max-line-bytes raises it)", fmtBytes(uint64(p.maxLine)))}
		}
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		if !p.sawHeader {
			if err := p.header(line); err != nil {
				return &ParseError{Path: p.name, Line: p.line, Err: err}
			}
			p.sawHeader = true
			continue
		}
		if err := parseEvent(line, &ev); err != nil {
			return &ParseError{Path: p.name, Line: p.line, Err: err}
		}
		if err := p.event(&ev); err != nil {
			return &ParseError{Path: p.name, Line: p.line, Err: err}
		}
	}
	return nil
}

func (p *parser) header(line []byte) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(line, &fields); err != nil || fields == nil {
		if err == nil {
			err = errors.New("null")
		}
		return fmt.Errorf("malformed header: want a JSON object (workload, max_allocated, max_reserved, ...): %v", err)
	}
	if _, ok := fields["a"]; ok {
		return errors.New("the first line is an event, not the header: a trace starts with a header line (workload, torch, gpu, max_allocated, max_reserved, events, seconds)")
	}
	if err := json.Unmarshal(line, &p.t.Header); err != nil {
		// encoding/json's message quotes the whole value, however long.
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			got := ""
			if raw, ok := fields[typeErr.Field]; ok { // not when the key differs in case only
				got = ", got " + preview(raw)
			}
			return fmt.Errorf("malformed header: field %s: want %s%s", typeErr.Field, typeErr.Type, got)
		}
		return fmt.Errorf("malformed header: %v", err)
	}
	// About two thirds of the events are replayed (alloc and free_completed
	// of every block): sizing Events from the header saves growing it.
	if n := p.t.Header.Events; n > 0 {
		p.t.Events = make([]Event, 0, min(n/3*2+16, maxEventsHint))
	}
	return nil
}

// event checks one parsed event line against the trace so far and, for an
// alloc or a free_completed, appends it to the events to replay.
func (p *parser) event(ev *rawEvent) error {
	const required = hasA | hasAddr | hasSize | hasStream
	if missing := required &^ ev.has; missing != 0 {
		var names []string
		for i, n := range []string{"a", "addr", "size", "stream"} {
			if missing&(1<<i) != 0 {
				names = append(names, `"`+n+`"`)
			}
		}
		return fmt.Errorf("missing field %s (an event has a, addr, size, stream and t)", strings.Join(names, ", "))
	}
	if ev.act == actNone {
		return fmt.Errorf("unknown action %s (want %s)", preview(ev.badAction), lineActionList())
	}
	if p.line > math.MaxInt32 || p.line < math.MinInt32 {
		return errors.New("too many lines: a trace is limited to 2^31")
	}
	p.t.Lines++
	p.t.Actions[ev.act]++
	return p.apply(ev)
}

// apply checks an event against the ids live so far and, for an alloc or a
// free_completed, appends it to the events to replay.
func (p *parser) apply(ev *rawEvent) error {
	t := p.t
	switch ev.act {
	case caching.ActionAlloc:
		if prev, ok := p.ids[ev.addr]; ok {
			return fmt.Errorf("alloc of id %d, which is already live (allocated on line %d, not freed since)", ev.addr, prev.line)
		}
		var slot int32
		if n := len(p.freeSlots); n > 0 {
			slot, p.freeSlots = p.freeSlots[n-1], p.freeSlots[:n-1]
		} else {
			slot = int32(t.Slots)
			t.Slots++
		}
		p.ids[ev.addr] = liveID{slot: slot, line: int32(p.line), size: ev.size}
		t.Events = append(t.Events, Event{Size: ev.size, Stream: arena.Stream(ev.stream), Slot: slot, Line: int32(p.line), Op: OpAlloc, T: ev.t})
		p.live += ev.size
		if p.live > t.PeakLive {
			t.PeakLive, t.PeakEvent = p.live, len(t.Events)-1
		}
	case caching.ActionFreeRequested:
		if _, ok := p.ids[ev.addr]; !ok {
			return fmt.Errorf("free_requested of id %d, which is not live (never allocated, or already freed)", ev.addr)
		}
	case caching.ActionFreeCompleted:
		id, ok := p.ids[ev.addr]
		if !ok {
			return fmt.Errorf("free_completed of id %d, which is not live (never allocated, or already freed)", ev.addr)
		}
		delete(p.ids, ev.addr)
		p.freeSlots = append(p.freeSlots, id.slot)
		t.Events = append(t.Events, Event{Size: id.size, Stream: arena.Stream(ev.stream), Slot: id.slot, Line: int32(p.line), Op: OpFree, T: ev.t})
		p.live -= id.size
	}
	return nil
}
