package replay

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/require"
)

const testHeader = `{"workload": "synthetic", "torch": "2.11.0", "gpu": "Sim", "max_allocated": 3072, "max_reserved": 4096, "events": %d, "seconds": 1.5}`

// ev writes one event line in the recorded layout.
func ev(action string, addr, size uint64) string {
	return fmt.Sprintf(`{"a": "%s", "addr": %d, "size": %d, "stream": 0, "t": 1000}`, action, addr, size)
}

// traceText is a header (with the right event count) and lines.
func traceText(lines ...string) string {
	return fmt.Sprintf(testHeader, len(lines)) + "\n" + strings.Join(lines, "\n") + "\n"
}

// writeFile writes text to name in a fresh directory, gzipped when name
// ends in .gz.
func writeFile(t testing.TB, name, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	data := []byte(text)
	if strings.HasSuffix(name, ".gz") {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		_, err := zw.Write(data)
		require.NoError(t, err)
		require.NoError(t, zw.Close())
		data = b.Bytes()
	}
	require.NoError(t, os.WriteFile(path, data, 0o644))
	return path
}

func TestOpenSmallTrace(t *testing.T) {
	text := traceText(
		ev("segment_alloc", 100, 2048),
		ev("alloc", 100, 1024),
		ev("alloc", 200, 2048),
		ev("free_requested", 100, 1024),
		ev("free_completed", 100, 1024),
		ev("alloc", 300, 512),
		ev("free_requested", 200, 2048),
		ev("free_completed", 200, 2048),
	)
	for _, name := range []string{"t.jsonl.gz", "t.jsonl", "no-extension"} {
		tr, err := Open(writeFile(t, name, text))
		require.NoError(t, err, name)
		require.Equal(t, "synthetic", tr.Header.Workload)
		require.Equal(t, uint64(3072), tr.Header.MaxAllocated)
		require.InDelta(t, 4096.0/3072, tr.Header.NativeRatio(), 1e-12)
		require.Equal(t, 8, tr.Lines)
		require.Equal(t, 1, tr.SegmentAllocs())
		require.Equal(t, []Event{
			{Size: 1024, Slot: 0, Line: 3, Op: OpAlloc, T: 1000},
			{Size: 2048, Slot: 1, Line: 4, Op: OpAlloc, T: 1000},
			{Size: 1024, Slot: 0, Line: 6, Op: OpFree, T: 1000},
			{Size: 512, Slot: 0, Line: 7, Op: OpAlloc, T: 1000}, // slot 0 reused
			{Size: 2048, Slot: 1, Line: 9, Op: OpFree, T: 1000},
		}, tr.Events)
		require.Equal(t, 2, tr.Slots)
		require.Equal(t, uint64(3072), tr.PeakLive)
		require.Equal(t, 1, tr.PeakEvent)
		require.Empty(t, tr.Warnings)
	}
}

func TestOpenTolerates(t *testing.T) {
	// CRLF line ends, blank lines, fields in another order, extra fields.
	text := fmt.Sprintf(testHeader, 2) + "\r\n\r\n" +
		`{"t": 5, "size": 512, "stream": 9, "a": "alloc", "addr": 1, "context": {"frames": []}}` + "\r\n" +
		"\n" +
		`{"a":"free_completed","addr":1,"size":512,"stream":9}`
	tr, err := Open(writeFile(t, "t.jsonl", text))
	require.NoError(t, err)
	require.Equal(t, []Event{
		{Size: 512, Stream: 9, Line: 3, Op: OpAlloc, T: 5},
		{Size: 512, Stream: 9, Line: 5, Op: OpFree}, // no "t": 0
	}, tr.Events)
}

func TestOpenWarnsOnEventCount(t *testing.T) {
	text := fmt.Sprintf(testHeader, 10) + "\n" + ev("alloc", 1, 512) + "\n"
	tr, err := Open(writeFile(t, "t.jsonl", text))
	require.NoError(t, err)
	require.Equal(t, []string{"the header says 10 events, the file has 1 (truncated or edited?)"}, tr.Warnings)
}

func TestOpenErrors(t *testing.T) {
	good := traceText(ev("alloc", 1, 512), ev("free_completed", 1, 512))
	gz := func(s string) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Write([]byte(s))
		zw.Close()
		return b.Bytes()
	}
	big := traceText(strings.Repeat(ev("alloc", 1, 512)+"\n"+ev("free_completed", 1, 512)+"\n", 2000))
	truncated := gz(big)
	truncated = truncated[:len(truncated)/2]
	corrupt := gz(big)
	for i := 40; i < 60; i++ {
		corrupt[i] ^= 0x55
	}
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"plain-named-gz.jsonl.gz", []byte(good), "unreadable gzip: the name ends in .gz but the file does not start with the gzip magic number"},
		{"truncated.jsonl.gz", truncated, "unreadable gzip: the file is truncated"},
		{"corrupt.jsonl.gz", corrupt, "unreadable gzip"},
		{"bad-header.jsonl.gz", gz(big)[:5], "unreadable gzip"},
		{"empty.jsonl", nil, "empty trace: no header line"},
		{"empty.jsonl.gz", gz(""), "empty trace: no header line"},
		{"no-header.jsonl", []byte(ev("alloc", 1, 512) + "\n"), "line 1: the first line is an event, not the header"},
		{"bad-header.jsonl", []byte("{\"workload\": \n"), "line 1: malformed header"},
		{"header-types.jsonl", []byte(`{"max_allocated": "lots"}` + "\n"), "line 1: malformed header"},
		{"malformed.jsonl", []byte(traceText(ev("alloc", 1, 512), `{"a": "alloc", "addr": 2, "size": 512, "stream": 0`)), "line 3: malformed JSON at column 51: want ',' or '}'"},
		{"malformed.jsonl.gz", gz(traceText(ev("alloc", 1, 512), `{"a": "alloc", "addr": 2, "size": 512, "stream": 0`)), "malformed.jsonl.gz: line 3: malformed JSON"},
		{"unknown-action.jsonl", []byte(traceText(ev("explode", 1, 512))), `line 2: unknown action "explode" (want alloc, free_requested, free_completed or segment_alloc)`},
		// A name PyTorch's snapshots use that the trace recorder never writes.
		{"snapshot-only-action.jsonl", []byte(traceText(ev("segment_free", 1, 512))), `line 2: unknown action "segment_free" (want alloc, free_requested, free_completed or segment_alloc)`},
		{"missing-field.jsonl", []byte(traceText(`{"a": "alloc", "addr": 1, "stream": 0}`)), `line 2: missing field "size"`},
		{"missing-fields.jsonl", []byte(traceText(`{"t": 1}`)), `line 2: missing field "a", "addr", "size", "stream"`},
		{"never-allocated.jsonl", []byte(traceText(ev("alloc", 1, 512), ev("free_completed", 77, 512))), "line 3: free_completed of id 77, which is not live (never allocated, or already freed)"},
		{"double-free.jsonl", []byte(traceText(ev("alloc", 1, 512), ev("free_completed", 1, 512), ev("free_completed", 1, 512))), "line 4: free_completed of id 1, which is not live"},
		{"requested-unknown.jsonl", []byte(traceText(ev("free_requested", 5, 512))), "line 2: free_requested of id 5, which is not live"},
		{"double-alloc.jsonl", []byte(traceText(ev("alloc", 1, 512), ev("alloc", 1, 512))), "line 3: alloc of id 1, which is already live (allocated on line 2, not freed since)"},
		{"bad-type.jsonl", []byte(traceText(`{"a": "alloc", "addr": 1, "size": "12", "stream": 0}`)), `line 2: field size: want a non-negative integer, got "\"12\""`},
	} {
		path := filepath.Join(t.TempDir(), c.name)
		require.NoError(t, os.WriteFile(path, c.data, 0o644))
		_, err := Open(path)
		require.ErrorContains(t, err, c.want, c.name)
		require.ErrorContains(t, err, path, c.name)
	}
	_, err := Open(filepath.Join(t.TempDir(), "missing.jsonl.gz"))
	require.ErrorContains(t, err, "no such file or directory")
	require.ErrorIs(t, err, os.ErrNotExist)
}

// TestOpenAcrossChunks parses a trace several chunks long with a line longer
// than a chunk in it, and checks every event survived the cuts.
func TestOpenAcrossChunks(t *testing.T) {
	var lines []string
	long := `{"a": "segment_alloc", "addr": 9, "size": 512, "stream": 0, "note": "` + strings.Repeat("x", 3*chunkSize) + `"}`
	n := 0
	for i := 0; len(lines) < 60000; i++ {
		if i == 20000 {
			lines = append(lines, long)
		}
		lines = append(lines, ev("alloc", uint64(i), uint64(512*(i%7+1))), ev("free_completed", uint64(i), uint64(512*(i%7+1))))
		n++
	}
	tr, err := Open(writeFile(t, "long.jsonl.gz", traceText(lines...)))
	require.NoError(t, err)
	require.Len(t, tr.Events, 2*n)
	require.Equal(t, len(lines), tr.Lines)
	for i, e := range tr.Events {
		require.Equal(t, uint64(512*(i/2%7+1)), e.Size, "event %d", i)
	}
	require.Empty(t, tr.Warnings)
}

// TestBundledTraces pins what the bundled traces hold (counted
// independently with Python's json module).
func TestBundledTraces(t *testing.T) {
	for _, c := range []struct {
		path                          string
		lines, allocs, frees, segs    int
		peakLive, maxAlloc, maxReserv uint64
	}{
		{"../traces/gpt2-train.jsonl.gz", 171694, 57461, 57012, 209, 25379906248, 25396953088, 28091351040},
		{"../traces/resnet50-train.jsonl.gz", 94474, 31768, 31281, 144, 5940124432, 5953995776, 7625244672},
	} {
		tr, err := Open(c.path)
		require.NoError(t, err)
		require.Equal(t, c.lines, tr.Lines)
		require.Equal(t, int64(c.lines), tr.Header.Events)
		require.Equal(t, c.allocs, tr.Actions[caching.ActionAlloc])
		require.Equal(t, c.frees, tr.Actions[caching.ActionFreeCompleted])
		require.Equal(t, c.frees, tr.Actions[caching.ActionFreeRequested])
		require.Equal(t, c.segs, tr.SegmentAllocs())
		require.Len(t, tr.Events, c.allocs+c.frees)
		require.Equal(t, c.peakLive, tr.PeakLive)
		require.Equal(t, c.maxAlloc, tr.Header.MaxAllocated)
		require.Equal(t, c.maxReserv, tr.Header.MaxReserved)
		require.Empty(t, tr.Warnings)
		for _, e := range tr.Events {
			require.Equal(t, arena.Stream(0), e.Stream)
		}
	}
}

// Damage inside a gzip trace's compressed data often decompresses into
// garbage lines before gzip's checksum, at the end, catches it: the error
// names the damaged file, not a bad address on some line.
func TestDamagedGzipIsReportedAsDamage(t *testing.T) {
	data, err := os.ReadFile("../traces/resnet50-train.jsonl.gz")
	require.NoError(t, err)
	for _, off := range []int{1000, 100000, 500000} {
		c := bytes.Clone(data)
		c[off] ^= 0x10
		_, err := Read(bytes.NewReader(c), "damaged.jsonl.gz")
		require.Error(t, err)
		require.ErrorContains(t, err, "unreadable gzip", "offset %d", off)
		require.ErrorContains(t, err, "the file is damaged", "offset %d", off)
	}
}

// A field of megabytes (on a line let past the line limit) is quoted by a
// short preview in the message, whichever parser (the fast scan,
// encoding/json for an unusual line, the header's) refuses it.
func TestErrorsQuoteAPreview(t *testing.T) {
	digits := strings.Repeat("7", 2<<20)
	name := strings.Repeat("x", 5<<20)
	for _, c := range []struct {
		name, text, want string
	}{
		{"big-size.jsonl", traceText(`{"a": "alloc", "addr": 1, "size": ` + digits + `, "stream": 0}`), `line 2: field size: "77777`},
		{"big-size-slow.jsonl", traceText(`{"a": "al\u006coc", "addr": 1, "size": ` + digits + `, "stream": 0}`), `line 2: field size: want a non-negative integer, got "77777`},
		{"big-action.jsonl", traceText(`{"a": "` + name + `", "addr": 1, "size": 1, "stream": 0}`), `line 2: unknown action "xxxx`},
		{"big-key.jsonl", traceText(`{"a": "alloc", "` + name + `" 1}`), `line 2: malformed JSON at column 5242899: want ':' after field name "xxxx`},
		{"big-header.jsonl", `{"workload": "w", "max_allocated": ` + digits + "}\n", `line 1: malformed header: field max_allocated: want uint64, got "77777`},
	} {
		_, err := OpenWith(writeFile(t, c.name, c.text), ReadOptions{Device: -1, MaxLineBytes: 16 << 20})
		require.ErrorContains(t, err, c.want, c.name)
		require.Less(t, len(err.Error()), 500, "%s: %.300s", c.name, err)
	}
}

// gzipped is text compressed as gzip.
func gzipped(t testing.TB, text []byte) []byte {
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, err := zw.Write(text)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return b.Bytes()
}

// A small gzip file that expands past the input limit is refused once
// reading passes the limit, snapshot or JSON lines.
func TestInputLimit(t *testing.T) {
	opt := ReadOptions{Device: -1, MaxInputBytes: 1 << 20}
	snapshot := append([]byte{pickleProto, 2}, make([]byte, 16<<20)...)
	lines := []byte(traceText(strings.Repeat(ev("segment_alloc", 1, 512)+"\n", 200000)))
	for name, text := range map[string][]byte{"bomb.pickle.gz": snapshot, "bomb.jsonl.gz": lines} {
		compressed := gzipped(t, text)
		require.Less(t, len(compressed), 1<<20, name)
		_, err := ReadWith(bytes.NewReader(compressed), name, opt)
		require.ErrorContains(t, err, name+": the trace is larger than 1.00 MiB after gunzip, the most this reader takes (--max-input-bytes raises it)")
		// At the limit exactly, it is read.
		if name == "bomb.jsonl.gz" {
			tr, err := ReadWith(bytes.NewReader(compressed), name, ReadOptions{Device: -1, MaxInputBytes: uint64(len(text))})
			require.NoError(t, err, name)
			require.Equal(t, 200000, tr.Lines)
		}
	}
}

// endlessStream is a stream that starts with head and never ends, the
// rest bytes it never writes: as large a stream as a test wants, at no
// cost. Read counts what was read.
type endlessStream struct {
	head []byte
	read uint64
}

func (s *endlessStream) Read(p []byte) (int, error) {
	copy(p, s.head)
	s.head = s.head[min(len(s.head), len(p)):]
	s.read += uint64(len(p))
	return len(p), nil
}

// With the default limit, a stream larger than the limit is refused once
// reading passes it: the reader does not go on to read it all.
func TestDefaultInputLimit(t *testing.T) {
	s := &endlessStream{head: []byte{pickleProto, 2}}
	_, err := ReadWith(s, "endless.pickle", ReadOptions{Device: -1})
	require.ErrorContains(t, err, "endless.pickle: the trace is larger than 2.00 GiB after gunzip")
	require.Greater(t, s.read, uint64(DefaultMaxInputBytes))
	require.Less(t, s.read, uint64(DefaultMaxInputBytes+1<<20))
}

// A line past the line limit is refused without the reader holding more
// of it than about twice the limit, with the default limit too: a stream of
// zeros, gzipped, has no newline in it.
func TestLineLimit(t *testing.T) {
	line := strings.Repeat("x", 3<<20)
	for _, c := range []struct {
		name, text string
		limit      uint64
		want       string
	}{
		{"one-line.jsonl", line + "\n", 64 << 10, "one-line.jsonl: line 1: longer than 64.00 KiB, the longest line this reader takes (--max-line-bytes raises it)"},
		{"short-lines.jsonl", traceText(ev("alloc", 1, 512), `{"a": "alloc", "addr": 2, "size": 512, "stream": 0, "pad": "`+strings.Repeat(" ", 200)+`"}`), 150, "short-lines.jsonl: line 3: longer than 150 B"},
		{"header.jsonl", `{"workload": "` + line + `"}` + "\n", 0, "header.jsonl: line 1: longer than 1.00 MiB"},
	} {
		_, err := ReadWith(strings.NewReader(c.text), c.name, ReadOptions{Device: -1, MaxLineBytes: c.limit})
		require.ErrorContains(t, err, c.want, c.name)
	}

	pr, pw := io.Pipe()
	go func() {
		zw := gzip.NewWriter(pw)
		zeros := make([]byte, 1<<20)
		for i := 0; i < 64; i++ {
			if _, err := zw.Write(zeros); err != nil {
				return // the reader stopped, as it should
			}
		}
		pw.CloseWithError(zw.Close())
	}()
	counted := &countingReader{r: pr}
	_, err := ReadWith(counted, "zeros.jsonl.gz", ReadOptions{Device: -1})
	pr.Close()
	require.ErrorContains(t, err, "zeros.jsonl.gz: line 1: longer than 1.00 MiB")
	require.Less(t, counted.n, int64(1<<20), "a few megabytes of zeros compress to kilobytes")
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// A header's event count only sizes the events' slice up to a bound: a
// two-line trace that claims a quarter of a billion events does not
// reserve memory for them.
func TestHeaderEventCountIsAHintOnly(t *testing.T) {
	text := `{"workload": "w", "events": 268435455}` + "\n" + ev("alloc", 1, 512) + "\n"
	tr, err := ReadWith(strings.NewReader(text), "claims.jsonl", ReadOptions{Device: -1})
	require.NoError(t, err)
	require.Len(t, tr.Events, 1)
	require.LessOrEqual(t, cap(tr.Events), maxEventsHint)
	require.Contains(t, tr.Warnings, "the header says 268435455 events, the file has 1 (truncated or edited?)")
}
