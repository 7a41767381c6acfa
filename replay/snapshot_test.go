package replay

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

// The fixtures in testdata/snapshots are written by mksnapshots.py there,
// in the structure of torch 2.11's _dump_snapshot.
func fixture(name string) string { return filepath.Join("testdata", "snapshots", name) }

// render turns a decoded value into what mksnapshots.py's render writes
// for the same Python value, as encoding/json reads it back.
func render(t *testing.T, v any) any {
	switch x := v.(type) {
	case nil, bool, string:
		return x
	case int64:
		if x > -(1<<53) && x < 1<<53 {
			return float64(x)
		}
		return map[string]any{"int": fmt.Sprint(x)}
	case *big.Int:
		return map[string]any{"int": x.String()}
	case float64:
		return map[string]any{"float": x}
	case []byte:
		return map[string]any{"bytes": fmt.Sprintf("%x", x)}
	case *pyList:
		out := []any{}
		for _, e := range x.items {
			out = append(out, render(t, e))
		}
		return out
	case pyTuple:
		out := []any{}
		for _, e := range x {
			out = append(out, render(t, e))
		}
		return map[string]any{"tuple": out}
	case *pyDict:
		out := []any{}
		for i := range x.keys {
			out = append(out, []any{render(t, x.keys[i]), render(t, x.vals[i])})
		}
		return map[string]any{"dict": out}
	}
	t.Fatalf("unexpected decoded type %T", v)
	return nil
}

func TestUnpickleEveryProtocol(t *testing.T) {
	for p := 2; p <= 5; p++ {
		data, err := os.ReadFile(fixture(fmt.Sprintf("values-p%d.pickle", p)))
		require.NoError(t, err)
		text, err := os.ReadFile(fixture(fmt.Sprintf("values-p%d.json", p)))
		require.NoError(t, err)
		var want any
		require.NoError(t, json.Unmarshal(text, &want))
		v, err := unpickle(data)
		require.NoError(t, err, "protocol %d", p)
		require.Equal(t, want, render(t, v), "protocol %d", p)

		// The memo hands out the same list twice, as Python shares it.
		shared, ok := v.(*pyDict).get("shared")
		require.True(t, ok)
		l := shared.(*pyList).items
		require.Same(t, l[0], l[1], "protocol %d", p)
	}
}

func TestUnpickleRefuses(t *testing.T) {
	good, err := os.ReadFile(fixture("values-p4.pickle"))
	require.NoError(t, err)
	for _, c := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "ends before"},
		{"truncated", good[:len(good)/2], "truncated"},
		{"no STOP", []byte{0x80, 2, 'N'}, "ends before"},
		{"protocol 6", []byte{0x80, 6, 'N', '.'}, "protocol 6"},
		{"GLOBAL", []byte("\x80\x02cos\nsystem\nq\x00."), "GLOBAL"},
		{"REDUCE", []byte{0x80, 2, 'N', ')', 'R', '.'}, "REDUCE"},
		{"STACK_GLOBAL", []byte{0x80, 4, 0x93, '.'}, "plain data"},
		{"protocol 0 text", []byte("I1\n."), "protocol 0"},
		{"unknown opcode", []byte{0x80, 2, 0xff}, "unknown opcode 0xff"},
		{"memo never stored", []byte{0x80, 2, 'h', 7, '.'}, "memo index 7"},
		{"huge string length", []byte{0x80, 4, 0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, "only 0 bytes follow"},
		{"SETITEMS on a list", []byte{0x80, 2, ']', '(', 'N', 'N', 'u', '.'}, "not a dict"},
		{"odd SETITEMS", []byte{0x80, 2, '}', '(', 'N', 'u', '.'}, "pairs"},
		{"list as a key", []byte{0x80, 2, '}', ']', 'N', 's', '.'}, "dict key of type list"},
		// Each SETITEM hashes or compares its key: one long key memoized
		// and set again and again would cost its length per two-byte
		// reference.
		{"long key", append(append([]byte{0x80, 2, '}', 'X', 0, 1, 0, 0}, bytes.Repeat([]byte("k"), 256)...),
			'q', 0, 'N', 's', 'h', 0, 'N', 's', '.'), "a dict key of 256 bytes"},
		{"two values at STOP", []byte{0x80, 2, 'N', 'N', '.'}, "STOP with 2 values"},
		{"APPEND without list", []byte{0x80, 2, 'N', 'a', '.'}, "APPEND"},
	} {
		_, err := unpickle(c.data)
		require.ErrorContains(t, err, c.want, c.name)
		var pe *PickleError
		require.ErrorAs(t, err, &pe, c.name)
	}
}

func TestUnpickleScalars(t *testing.T) {
	// BINBYTES, BINSTRING (Python 2's str, read as latin-1), LONG4, POP,
	// POP_MARK and DUP, which the fixtures do not use.
	long4 := []byte{0x8b, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80} // -2**71
	var b bytes.Buffer
	b.Write([]byte{0x80, 2, '(', 'N', 'N', '1'}) // a mark, two Nones, all dropped
	b.Write([]byte{'('})
	b.Write([]byte{'B', 2, 0, 0, 0, 'h', 'i'})
	b.Write([]byte{'U', 1, 0xe9})
	b.Write(long4)
	b.Write([]byte{'K', 5, '2'}) // 5, twice
	b.Write([]byte{'N', '0'})    // None, popped
	b.Write([]byte{'t', '.'})
	v, err := unpickle(b.Bytes())
	require.NoError(t, err)
	tup := v.(pyTuple)
	require.Len(t, tup, 5)
	require.Equal(t, []byte("hi"), tup[0])
	require.Equal(t, "é", tup[1])
	require.Equal(t, new(big.Int).Neg(new(big.Int).Lsh(big.NewInt(1), 71)), tup[2])
	require.Equal(t, int64(5), tup[3])
	require.Equal(t, int64(5), tup[4])
}

func FuzzUnpickle(f *testing.F) {
	// Small seeds: the fuzzer minimizes every new input it finds, which
	// takes long for large ones.
	for _, name := range []string{"torch-two-devices.pickle", "torch-expandable.pickle", "other-allocator.pickle"} {
		data, err := os.ReadFile(fixture(name))
		require.NoError(f, err)
		f.Add(data)
	}
	f.Add(pickled(map[string]any{"a": []any{pyTuple{1, "x"}, true, nil, -7}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		// Any input: a value or an error, never a panic or a hang; and a
		// snapshot reader on top that does the same.
		if _, err := unpickle(data); err != nil {
			return
		}
		_, _ = ReadWith(bytes.NewReader(data), "fuzz", ReadOptions{Device: -1})
	})
}

// gpt2Head is the bundled GPT-2 trace cut to its header and first n events,
// the same events mksnapshots.py put in the snapshot fixtures.
func gpt2Head(t *testing.T, n int) string {
	f, err := os.Open(filepath.Join("..", "traces", "gpt2-train.jsonl.gz"))
	require.NoError(t, err)
	defer f.Close()
	zr, err := gzip.NewReader(f)
	require.NoError(t, err)
	sc := bufio.NewScanner(zr)
	var lines []string
	for len(lines) <= n && sc.Scan() {
		lines = append(lines, sc.Text())
	}
	require.NoError(t, sc.Err())
	lines[0] = strings.Replace(lines[0], `"events": 171694`, fmt.Sprintf(`"events": %d`, n), 1)
	return writeFile(t, "head.jsonl", strings.Join(lines, "\n")+"\n")
}

// liveSeries is the live bytes after each replayed event, from the trace
// alone.
func liveSeries(tr *Trace) []uint64 {
	var live uint64
	out := make([]uint64, len(tr.Events))
	for i, e := range tr.Events {
		if e.Op == OpAlloc {
			live += e.Size
		} else {
			live -= e.Size
		}
		out[i] = live
	}
	return out
}

// segmentBytes sums the segment_alloc sizes of lines [from, to) of a trace.
func segmentBytes(t *testing.T, path string, from, to int) uint64 {
	text, err := os.ReadFile(path)
	require.NoError(t, err)
	var sum uint64
	for i, line := range strings.Split(strings.TrimSpace(string(text)), "\n")[1:] {
		var e struct {
			A    string `json:"a"`
			Size uint64 `json:"size"`
		}
		require.NoError(t, json.Unmarshal([]byte(line), &e))
		if e.A == "segment_alloc" && i >= from && i < to {
			sum += e.Size
		}
	}
	return sum
}

// TestSnapshotIsTheTrace reads a snapshot of torch's structure holding the
// first events of the GPT-2 run and the same events as a JSON lines trace:
// the replay must get the same events, and the native policy must land on
// the recorded run's peak reserved.
func TestSnapshotIsTheTrace(t *testing.T) {
	const n = 12000
	jsonl := gpt2Head(t, n)
	want, err := Open(jsonl)
	require.NoError(t, err)
	got, err := Open(fixture("torch-gpt2-head.pickle"))
	require.NoError(t, err)

	// The same events; a line of the JSON lines file is one more than the
	// entry's position (the header is line 1).
	require.Equal(t, len(want.Events), len(got.Events))
	for i := range want.Events {
		w, g := want.Events[i], got.Events[i]
		w.Line--
		require.Equal(t, w, g, "event %d", i)
	}
	require.Equal(t, want.Lines, got.Lines)
	require.Equal(t, want.Actions, got.Actions)
	require.Equal(t, want.PeakLive, got.PeakLive)
	require.Equal(t, want.PeakEvent, got.PeakEvent)
	require.Equal(t, want.Slots, got.Slots)

	s := got.Snapshot
	require.NotNil(t, s)
	require.Nil(t, want.Snapshot)
	require.Equal(t, 0, s.Device)
	require.Equal(t, []int{0}, s.DevicesWithEvents)
	require.Equal(t, "pytorch", s.Recorder)
	require.Equal(t, n, s.Entries)
	require.Zero(t, s.InitialBlocks)
	require.Zero(t, s.InitialReservedBytes)
	require.Empty(t, s.Notes)
	// The run only grew in these events: its peak is every segment it took.
	recorded := segmentBytes(t, jsonl, 0, n)
	require.Equal(t, recorded, s.RecordedPeakReservedBytes)
	require.Equal(t, recorded, got.Header.MaxReserved)
	require.Equal(t, got.PeakLive, got.Header.MaxAllocated)
	require.Equal(t, "memory snapshot, device 0", got.Header.Workload)
	require.Positive(t, got.Header.Seconds)

	r, err := Replay(got, arena.NewSim(0, 0), Options{Policy: "native"})
	require.NoError(t, err)
	require.InEpsilon(t, float64(recorded), float64(r.PeakReservedBytes), 0.02,
		"native %d, recorded %d", r.PeakReservedBytes, recorded)
	require.Same(t, s, r.Snapshot)
}

// TestSnapshotWrapped reads the same run from a ring that kept only its
// last 8000 events: the replay starts from the blocks live at the first of
// them, so from there on live bytes are exactly the whole run's.
func TestSnapshotWrapped(t *testing.T) {
	const n, kept = 12000, 8000
	jsonl := gpt2Head(t, n)
	whole, err := Open(jsonl)
	require.NoError(t, err)
	tr, err := Open(fixture("torch-gpt2-wrapped.pickle"))
	require.NoError(t, err)
	s := tr.Snapshot

	// The replayed events of the window are the whole run's last ones.
	window := 0
	for _, e := range whole.Events {
		if int(e.Line) > 1+n-kept { // line 1 is the header
			window++
		}
	}
	require.Equal(t, len(tr.Events), s.InitialBlocks+window)
	wholeLive := liveSeries(whole)
	require.Equal(t, wholeLive[len(wholeLive)-window:], liveSeries(tr)[s.InitialBlocks:])

	require.Positive(t, s.InitialBlocks)
	require.Equal(t, wholeLive[len(wholeLive)-window-1], s.InitialBlockBytes)
	require.Equal(t, segmentBytes(t, jsonl, 0, n-kept), s.InitialReservedBytes)
	require.Equal(t, segmentBytes(t, jsonl, 0, n), s.RecordedPeakReservedBytes)
	require.Len(t, s.Notes, 1)
	require.Contains(t, s.Notes[0], "does not start from an empty allocator")
	require.Contains(t, s.Notes[0], "ring buffer (max_entries) wrapped")

	// The initial blocks come first, in address order, and errors name them.
	require.Equal(t, "initial block 1 (live before the history began)", tr.where(tr.Events[0].Line))
	require.Equal(t, "device_traces[0][0]", tr.where(1))
	r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: "native"})
	require.NoError(t, err)
	require.Equal(t, whole.PeakLive, r.PeakLiveBytes)
}

func TestSnapshotWithoutHistory(t *testing.T) {
	_, err := Open(fixture("torch-no-history.pickle"))
	require.ErrorContains(t, err, "without allocation history")
	require.ErrorContains(t, err, "184 segments")
	require.ErrorContains(t, err, "torch.cuda.memory._record_memory_history(max_entries=1000000)")
	var pe *ParseError
	require.ErrorAs(t, err, &pe)
}

func TestSnapshotDevices(t *testing.T) {
	path := fixture("torch-two-devices.pickle")
	tr, err := Open(path)
	require.NoError(t, err)
	require.Equal(t, 1, tr.Snapshot.Device)
	require.Equal(t, []int{1, 2}, tr.Snapshot.DevicesWithEvents)
	require.Equal(t, uint64(1000+3000), tr.PeakLive)
	require.Contains(t, tr.Snapshot.Notes[0], "replaying device 1, the first with events; other devices with events: 2")
	require.Contains(t, tr.Snapshot.Summary()[0], "device 1 (devices with events: 1, 2)")

	tr, err = OpenWith(path, ReadOptions{Device: 2})
	require.NoError(t, err)
	require.Equal(t, 2, tr.Snapshot.Device)
	require.Equal(t, uint64(1000+6000), tr.PeakLive)
	require.Empty(t, tr.Snapshot.Notes)
	require.Equal(t, "memory snapshot, device 2", tr.Header.Workload)

	for _, d := range []int{0, 3} {
		_, err = OpenWith(path, ReadOptions{Device: d})
		require.ErrorContains(t, err, fmt.Sprintf("device %d has no events in this snapshot; devices with events: 1, 2", d))
	}
	_, err = OpenWith(filepath.Join("..", "traces", "resnet50-train.jsonl.gz"), ReadOptions{Device: 0})
	require.ErrorContains(t, err, "JSON lines trace")
}

func TestSnapshotExpandableSegments(t *testing.T) {
	tr, err := Open(fixture("torch-expandable.pickle"))
	require.NoError(t, err)
	s := tr.Snapshot
	require.True(t, s.ExpandableSegments)
	require.Equal(t, "expandable_segments:True", s.AllocConf)
	require.Equal(t, uint64(40*MiB), s.RecordedPeakReservedBytes)
	require.Zero(t, s.InitialReservedBytes)
	require.Equal(t, map[string]int{"alloc": 2, "free_requested": 1, "free_completed": 1, "segment_map": 2, "segment_unmap": 1, "oom": 1}, s.Actions)
	notes := strings.Join(s.Notes, "\n")
	require.Contains(t, notes, "expandable_segments")
	require.Contains(t, notes, "segment_map and segment_unmap")
	require.Contains(t, notes, `PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"`)
	require.Contains(t, notes, "1 oom events")
	require.Equal(t, uint64(32*MiB), tr.PeakLive)
}

func TestSnapshotOfAnotherAllocator(t *testing.T) {
	tr, err := Open(fixture("other-allocator.pickle"))
	require.NoError(t, err)
	require.Equal(t, "unknown", tr.Snapshot.Recorder)
	require.Zero(t, tr.Header.MaxReserved, "its figures are not the native allocator's")
	require.Equal(t, uint64(2*MiB), tr.Snapshot.RecordedPeakReservedBytes)
	require.Contains(t, strings.Join(tr.Snapshot.Notes, "\n"), "no allocator_settings")
}

func TestSnapshotInconsistent(t *testing.T) {
	_, err := Open(fixture("torch-inconsistent.pickle"))
	require.ErrorContains(t, err, "device_traces[0][5]: free_completed of address 0x7f0000000000, which device_traces[0][4] already freed")
}

func TestSnapshotGzipped(t *testing.T) {
	data, err := os.ReadFile(fixture("torch-two-devices.pickle"))
	require.NoError(t, err)
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, err = zw.Write(data)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	path := filepath.Join(t.TempDir(), "s.pickle.gz")
	require.NoError(t, os.WriteFile(path, b.Bytes(), 0o644))
	tr, err := Open(path)
	require.NoError(t, err)
	require.Equal(t, 1, tr.Snapshot.Device)
}

// pickled writes v as a protocol 2 pickle, for snapshots the fixtures do
// not cover: maps (string keys, in sorted order), slices, tuples, strings,
// ints (and positive *big.Int), bools and nil.
func pickled(v any) []byte {
	var b bytes.Buffer
	b.Write([]byte{0x80, 2})
	var put func(v any)
	put = func(v any) {
		switch x := v.(type) {
		case nil:
			b.WriteByte('N')
		case bool:
			b.WriteByte(map[bool]byte{true: 0x88, false: 0x89}[x])
		case int:
			var le [8]byte
			binary.LittleEndian.PutUint64(le[:], uint64(x))
			b.Write([]byte{0x8a, 8})
			b.Write(le[:])
		case *big.Int:
			// LONG4: little-endian two's complement, here of a positive
			// number, with a zero byte above a set top bit.
			be := x.Bytes()
			le := make([]byte, len(be), len(be)+1)
			for i, c := range be {
				le[len(be)-1-i] = c
			}
			if len(le) > 0 && le[len(le)-1]&0x80 != 0 {
				le = append(le, 0)
			}
			b.WriteByte(0x8b)
			_ = binary.Write(&b, binary.LittleEndian, uint32(len(le)))
			b.Write(le)
		case string:
			b.WriteByte('X')
			_ = binary.Write(&b, binary.LittleEndian, uint32(len(x)))
			b.WriteString(x)
		case pyTuple:
			b.WriteByte('(')
			for _, e := range x {
				put(e)
			}
			b.WriteByte('t')
		case []any:
			b.WriteByte(']')
			for _, e := range x {
				put(e)
				b.WriteByte('a')
			}
		case map[string]any:
			b.WriteByte('}')
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			for _, k := range keys {
				put(k)
				put(x[k])
				b.WriteByte('s')
			}
		default:
			panic(fmt.Sprintf("pickled: %T", v))
		}
	}
	put(v)
	b.WriteByte('.')
	return b.Bytes()
}

func te(action string, addr, size int) map[string]any {
	return map[string]any{"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1}
}

func seg(addr, size int, blocks ...map[string]any) map[string]any {
	bl := []any{}
	for _, b := range blocks {
		bl = append(bl, b)
	}
	return map[string]any{"device": 0, "address": addr, "total_size": size, "stream": 0,
		"segment_pool_id": pyTuple{0, 0}, "is_expandable": false, "blocks": bl}
}

func blk(addr, size int, state string) map[string]any {
	return map[string]any{"address": addr, "size": size, "requested_size": size, "state": state}
}

func openPickled(t *testing.T, snap map[string]any) (*Trace, error) {
	path := filepath.Join(t.TempDir(), "s.pickle")
	require.NoError(t, os.WriteFile(path, pickled(snap), 0o644))
	return Open(path)
}

func TestSnapshotInitialState(t *testing.T) {
	// A history that starts mid-run: block 0x1000 was live (freed by the
	// history in two steps), block 0x3000 is live all along (only the
	// segments show it), a segment of 20 MiB was there already.
	settings := map[string]any{"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": false}
	snap := map[string]any{
		"allocator_settings": settings,
		"segments": []any{
			seg(0x0, 20*MiB, blk(0x0, 0x1000, "inactive"), blk(0x1000, 0x1000, "inactive"),
				blk(0x2000, 0x1000, "active_pending_free"), blk(0x3000, 0x1000, "active_allocated")),
		},
		"device_traces": []any{[]any{
			te("free_requested", 0x1000, 0x1000),
			te("alloc", 0x2000, 0x1000),
			te("free_completed", 0x1000, 0x1000),
			te("free_requested", 0x2000, 0x1000),
			te("snapshot", 0, 0),
		}},
	}
	tr, err := openPickled(t, snap)
	require.NoError(t, err)
	s := tr.Snapshot
	require.Equal(t, 2, s.InitialBlocks)
	require.Equal(t, uint64(0x2000), s.InitialBlockBytes)
	require.Equal(t, uint64(20*MiB), s.InitialReservedBytes)
	require.Equal(t, uint64(20*MiB), s.RecordedPeakReservedBytes)
	require.Equal(t, []uint64{0x1000, 0x2000, 0x3000, 0x2000}, liveSeries(tr))
	require.Equal(t, int32(-1), tr.Events[0].Line)
	require.Equal(t, 5, tr.Lines)

	// The segments disagree with the history: the replay follows the
	// history and says so, and reports no recorded figures.
	snap["segments"] = []any{seg(0x0, 20*MiB, blk(0x1000, 0x1000, "active_allocated"))}
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Zero(t, tr.Header.MaxReserved)
	notes := strings.Join(tr.Snapshot.Notes, "\n")
	require.Contains(t, notes, "disagree with the end of its history in 2 blocks")
	require.Contains(t, notes, "block 0x1000 is live in the segments but device_traces[0][2] freed it")

	// An initial block from the segments replays as its request, what the
	// alloc events record, whoever recorded it (goalloc records requests
	// too); as its size where it has no request.
	b := blk(0x3000, 0x1000, "active_allocated")
	b["requested_size"] = 0x800
	snap["segments"] = []any{seg(0x0, 20*MiB, b)}
	snap["device_traces"] = []any{[]any{te("alloc", 0x5000, 0x100)}}
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Equal(t, uint64(0x800), tr.Snapshot.InitialBlockBytes)
	delete(snap, "allocator_settings")
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Equal(t, uint64(0x800), tr.Snapshot.InitialBlockBytes)
	delete(b, "requested_size")
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Equal(t, uint64(0x1000), tr.Snapshot.InitialBlockBytes)
	snap["allocator_settings"] = settings

	// Actions from a later torch are left out, and said so.
	snap["device_traces"] = []any{[]any{te("teleport", 1, 1), te("teleport", 2, 1), te("alloc", 0x3000, 0x1000)}}
	snap["segments"] = []any{seg(0x0, 20*MiB, blk(0x3000, 0x1000, "active_allocated"))}
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Equal(t, uint64(0x1000), tr.PeakLive)
	require.Contains(t, strings.Join(tr.Snapshot.Notes, "\n"), "actions this reader does not know, left out: \"teleport\" (2)")

	// One event: what torch's enabled="state" keeps.
	snap["device_traces"] = []any{[]any{te("alloc", 0x5000, 0x100)}}
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Contains(t, strings.Join(tr.Snapshot.Notes, "\n"), `the history holds one event: torch keeps a ring of one when recording with enabled="state"`)

	// A history that takes more segment memory than the segments hold.
	snap["device_traces"] = []any{[]any{te("segment_alloc", 0x4000000, 40*MiB), te("alloc", 0x4000000, 100)}}
	snap["segments"] = []any{}
	tr, err = openPickled(t, snap)
	require.NoError(t, err)
	require.Zero(t, tr.Snapshot.RecordedPeakReservedBytes)
	require.Contains(t, strings.Join(tr.Snapshot.Notes, "\n"), "40.00 MiB more segment memory than the snapshot's segments hold")
}

func TestSnapshotBadStructure(t *testing.T) {
	for _, c := range []struct {
		snap any
		want string
	}{
		{[]any{}, "a pickle of a list, not a memory snapshot"},
		{map[string]any{"segments": []any{}}, "without device_traces"},
		{map[string]any{"device_traces": []any{}}, "without segments"},
		{map[string]any{"segments": []any{}, "device_traces": "x"}, "device_traces is a str, not a list"},
		{map[string]any{"segments": []any{}, "device_traces": []any{[]any{map[string]any{"action": "alloc"}}}}, "device_traces[0][0] has no addr"},
		{map[string]any{"segments": []any{}, "device_traces": []any{[]any{te("alloc", -5, 1)}}}, "addr is -5, not a non-negative integer"},
		{map[string]any{"segments": []any{}, "device_traces": []any{[]any{te("alloc", 1, 1), te("alloc", 1, 1)}}}, "device_traces[0][1]: alloc of address 0x1, which is live (allocated at device_traces[0][0]"},
		{map[string]any{"segments": []any{map[string]any{"device": 0}}, "device_traces": []any{}}, "segments[0] has no address"},
	} {
		path := filepath.Join(t.TempDir(), "s.pickle")
		require.NoError(t, os.WriteFile(path, pickled(c.snap), 0o644))
		_, err := Open(path)
		require.ErrorContains(t, err, c.want)
	}
}

// TestRecordedSnapshot replays a snapshot torch itself wrote on a GPU: the
// native-snapshot.pickle that `tests/gpu/run_gpu.sh snapshot` leaves in its
// output folder (tests/gpu/snapshot_check.py), committed here as
// testdata/snapshots/h200-native.pickle. Skipped until it is.
func TestRecordedSnapshot(t *testing.T) {
	path := fixture("h200-native.pickle")
	if _, err := os.Stat(path); err != nil {
		t.Skip("no recorded snapshot yet: run tests/gpu/run_gpu.sh snapshot on a GPU and commit its native-snapshot.pickle as " + path)
	}
	tr, err := Open(path)
	require.NoError(t, err)
	s := tr.Snapshot
	require.Equal(t, "pytorch", s.Recorder)
	require.Zero(t, s.InitialBlocks)
	require.Empty(t, s.Notes)
	require.Positive(t, s.RecordedPeakReservedBytes)
	for _, name := range []string{"native", "goalloc", "passthrough"} {
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: name})
		require.NoError(t, err, name)
		require.Zero(t, r.OOMs, name)
		if name == "native" {
			require.InEpsilon(t, float64(s.RecordedPeakReservedBytes), float64(r.PeakReservedBytes), 0.02)
		}
	}
}

// A snapshot torch wrote through goalloc's C++ allocator class carries
// goalloc's settings ("goalloc <GOALLOC_CONF>"): it is goalloc's record, not
// one of PyTorch's allocator with odd settings.
func TestSnapshotThroughGoallocsClass(t *testing.T) {
	snap := map[string]any{
		"allocator_settings": map[string]any{"PYTORCH_CUDA_ALLOC_CONF": "goalloc fraction:0,large_cache:256M", "expandable_segments": false},
		"segments":           []any{seg(0x0, 2*MiB, blk(0x0, 2*MiB, "inactive"))},
		"device_traces": []any{[]any{
			te("segment_alloc", 0x0, 2*MiB),
			te("alloc", 0x0, 0x1000),
			te("free_requested", 0x0, 0x1000),
			te("free_completed", 0x0, 0x1000),
		}},
	}
	tr, err := openPickled(t, snap)
	require.NoError(t, err)
	require.Equal(t, "goalloc", tr.Snapshot.Recorder)
	notes := strings.Join(tr.Snapshot.Notes, "\n")
	require.Contains(t, notes, `recorded by goalloc (through its allocator class in torch, settings "fraction:0,large_cache:256M")`)
	require.NotContains(t, notes, "PYTORCH_CUDA_ALLOC_CONF")
	require.Zero(t, tr.Header.MaxReserved, "goalloc's figures are not the native allocator's")
}

// A value of megabytes in a field the reader refuses is named by a short
// preview in the message, and a huge int by its size: converting it to
// decimal would cost time that grows faster than the file.
func TestSnapshotErrorsQuoteAPreview(t *testing.T) {
	huge := new(big.Int).Lsh(big.NewInt(1), 16<<20) // 2 MiB of bytes
	for _, c := range []struct {
		event map[string]any
		want  string
	}{
		{map[string]any{"action": "alloc", "addr": 1, "size": huge, "stream": 0}, "size is an int of 16777217 bits, not a non-negative integer"},
		{map[string]any{"action": "alloc", "addr": 1, "size": 1, "stream": strings.Repeat("s", 5<<20)}, `stream is "ssss`},
	} {
		_, err := openPickled(t, map[string]any{"segments": []any{}, "device_traces": []any{[]any{c.event}}})
		require.ErrorContains(t, err, c.want)
		require.Less(t, len(err.Error()), 500, "%.300s", err)
	}
}

// sharedSnapshot is a pickle of a few tens of kilobytes whose one segment,
// with one block, is listed n times, and whose block is listed n times in
// that segment, each repeat a memo reference (BINGET) to the one object:
// n² blocks for the reader to walk, from 4n bytes.
func sharedSnapshot(n int) []byte {
	var b bytes.Buffer
	str := func(s string) {
		b.WriteByte('X')
		_ = binary.Write(&b, binary.LittleEndian, uint32(len(s)))
		b.WriteString(s)
	}
	num := func(v int32) {
		b.WriteByte('J')
		_ = binary.Write(&b, binary.LittleEndian, v)
	}
	b.Write([]byte{0x80, 2, '}'})
	str("device_traces")
	b.WriteString("]]as") // [[]]: one device, no events
	str("segments")
	b.WriteString("](")
	b.WriteString("}q\x00(") // the segment, memo 0
	str("device")
	num(0)
	str("address")
	num(0)
	str("total_size")
	num(2 << 20)
	str("stream")
	num(0)
	str("blocks")
	b.WriteString("](")
	b.WriteString("}q\x01(") // the block, memo 1
	str("address")
	num(0)
	str("size")
	num(512)
	str("state")
	str("active_allocated")
	b.WriteString("u")
	b.WriteString(strings.Repeat("h\x01", n-1))
	b.WriteString("eu") // the block list, then the segment's items
	b.WriteString(strings.Repeat("h\x00", n-1))
	b.WriteString("es.")
	return b.Bytes()
}

// A snapshot whose memo shares objects over and over is refused, with a
// message that says so, after work of the order of the file's size, not of
// the n² elements the references stand for.
func TestSnapshotSharedObjects(t *testing.T) {
	data := sharedSnapshot(10000)
	require.Less(t, len(data), 50<<10)
	v, err := unpickle(data)
	require.NoError(t, err, "the pickle itself is well formed")
	segs, _ := v.(*pyDict).get("segments")
	require.Len(t, segs.(*pyList).items, 10000)

	path := filepath.Join(t.TempDir(), "shared.pickle")
	require.NoError(t, os.WriteFile(path, data, 0o644))
	_, err = Open(path)
	require.ErrorContains(t, err, "more list elements than its")
	require.ErrorContains(t, err, "refers to the same list or dict")
}
