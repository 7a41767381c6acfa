package main

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay/reference"
	"github.com/stretchr/testify/require"
)

// goalloc runs the command in-process.
func goalloc(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

const MiB = 1 << 20

// synthetic writes a small trace in the recorder's format: a few training
// steps' worth of activations that grow and shrink, with a parameter block
// that stays live; extra lines go at the end. It is gzipped when name ends
// in .gz.
func synthetic(t *testing.T, name string, extra ...string) string {
	t.Helper()
	var lines []string
	ev := func(a string, addr, size uint64) {
		lines = append(lines, fmt.Sprintf(`{"a": "%s", "addr": %d, "size": %d, "stream": 0, "t": %d}`, a, addr, size, 1000+len(lines)))
	}
	ev("segment_alloc", 1, 64*MiB)
	ev("alloc", 1, 48*MiB) // parameters
	addr := uint64(100)
	for step := 0; step < 4; step++ {
		var live []uint64
		for i := 0; i < 12; i++ {
			addr++
			ev("alloc", addr, uint64(512*(1+(i*step)%9))+uint64(i%3)*MiB)
			live = append(live, addr)
		}
		for i := len(live) - 1; i >= 0; i-- {
			ev("free_requested", live[i], 0)
			ev("free_completed", live[i], 0)
		}
	}
	// Sizes of frees are the allocs': fix them up from the alloc lines.
	sizes := map[string]string{}
	for i, l := range lines {
		var e struct {
			A    string `json:"a"`
			Addr uint64 `json:"addr"`
			Size uint64 `json:"size"`
		}
		require.NoError(t, json.Unmarshal([]byte(l), &e))
		key := fmt.Sprint(e.Addr)
		if e.A == "alloc" {
			sizes[key] = fmt.Sprint(e.Size)
		} else if strings.HasPrefix(e.A, "free") {
			lines[i] = strings.Replace(l, `"size": 0`, `"size": `+sizes[key], 1)
		}
	}
	lines = append(lines, extra...)
	header := fmt.Sprintf(`{"workload": "synthetic", "torch": "2.11.0", "gpu": "Sim", "max_allocated": %d, "max_reserved": %d, "events": %d, "seconds": 0.5}`,
		52*MiB, 64*MiB, len(lines))
	text := header + "\n" + strings.Join(lines, "\n") + "\n"
	path := filepath.Join(t.TempDir(), name)
	data := []byte(text)
	if strings.HasSuffix(name, ".gz") {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Write(data)
		require.NoError(t, zw.Close())
		data = b.Bytes()
	}
	require.NoError(t, os.WriteFile(path, data, 0o644))
	return path
}

var resultKeys = []string{
	"trace", "workload", "policy", "device", "events", "peak_live_bytes", "peak_reserved_bytes",
	"allocator_peak_reserved_bytes", "ratio", "fragmentation_at_peak", "device_allocs", "device_frees",
	"ns_per_op", "events_per_second", "ooms", "native_max_reserved", "native_max_allocated", "native_ratio",
}

func TestReplayJSON(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	code, out, errOut := goalloc(t, "replay", trace, "--json", "--policy", "native")
	require.Equal(t, 0, code, errOut)
	var r map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &r), out)
	for _, k := range resultKeys {
		require.Contains(t, r, k)
	}
	require.Equal(t, trace, r["trace"])
	require.Equal(t, "synthetic", r["workload"])
	require.Equal(t, "native", r["policy"])
	require.Equal(t, "sim", r["device"])
	require.InDelta(t, 64.0/52, r["native_ratio"], 1e-9)
	require.Equal(t, float64(r["peak_reserved_bytes"].(float64))/r["peak_live_bytes"].(float64), r["ratio"])
	require.Empty(t, errOut)

	// Flags before the trace work as well as after it.
	code, out2, errOut := goalloc(t, "replay", "--json", "--policy=native", trace)
	require.Equal(t, 0, code, errOut)
	var r2 map[string]any
	require.NoError(t, json.Unmarshal([]byte(out2), &r2))
	require.Equal(t, r["peak_reserved_bytes"], r2["peak_reserved_bytes"])
}

func TestCompareJSON(t *testing.T) {
	trace := synthetic(t, "s.jsonl")
	code, out, errOut := goalloc(t, "replay", "--compare", "--json", trace, "--conf", "large_cache:0")
	require.Equal(t, 0, code, errOut)
	var rs []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rs), out)
	require.Len(t, rs, len(reference.Names))
	for i, r := range rs {
		require.Equal(t, reference.Names[i], r["policy"])
		for _, k := range resultKeys {
			require.Contains(t, r, k, r["policy"])
		}
		require.Equal(t, rs[0]["peak_live_bytes"], r["peak_live_bytes"], "every policy replays the same trace")
	}
	require.Equal(t, "large_cache:0", rs[0]["conf"], "--conf goes to goalloc")
	require.NotContains(t, rs[1], "conf")
}

func TestCompareTable(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	code, out, errOut := goalloc(t, "replay", "--compare", trace)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "trace    "+trace+": synthetic, torch 2.11.0 on Sim")
	require.Contains(t, out, "native   recorded run: max_reserved 64.00 MiB / max_allocated 52.00 MiB = 1.231, 1 segments")
	lines := strings.Split(out, "\n")
	var header int
	for i, l := range lines {
		if strings.HasPrefix(l, "policy ") {
			header = i
		}
	}
	require.NotZero(t, header, out)
	for _, col := range []string{"peak live", "peak reserved", "ratio", "frag@peak", "dev allocs", "ns/op"} {
		require.Contains(t, lines[header], col)
	}
	for i, name := range reference.Names {
		row := lines[header+1+i]
		require.True(t, strings.HasPrefix(row, name+" "), row)
		require.Len(t, row, len(lines[header]), "columns line up")
	}
}

func TestReplayHTML(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	report := filepath.Join(t.TempDir(), "report.html")
	code, out, errOut := goalloc(t, "replay", "--compare", trace, "--html", report)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "policy ")
	require.Contains(t, errOut, "wrote "+report)
	page, err := os.ReadFile(report)
	require.NoError(t, err)
	html := string(page)
	require.True(t, strings.HasPrefix(html, "<!DOCTYPE html>"))
	require.Contains(t, html, "<svg ")
	for _, name := range reference.Names {
		require.Contains(t, html, ">"+name+"<")
	}
	// Self-contained: no external resources, no script.
	require.NotContains(t, html, "http://")
	require.NotContains(t, html, "https://")
	require.NotContains(t, html, "<script")
	require.NotContains(t, html, "<link")
	require.NotContains(t, html, "src=")

	// With --json the JSON stays alone on stdout.
	code, out, errOut = goalloc(t, "replay", trace, "--json", "--html", report)
	require.Equal(t, 0, code, errOut)
	require.True(t, json.Valid([]byte(out)), out)

	code, _, errOut = goalloc(t, "replay", trace, "--html", filepath.Join(t.TempDir(), "no", "such", "dir.html"))
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "writing the report")
}

func TestReplayErrors(t *testing.T) {
	dir := t.TempDir()
	notGzip := filepath.Join(dir, "plain.jsonl.gz")
	require.NoError(t, os.WriteFile(notGzip, []byte("{}\n"), 0o644))
	truncated := filepath.Join(dir, "truncated.jsonl.gz")
	data, err := os.ReadFile(synthetic(t, "s.jsonl.gz"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(truncated, data[:len(data)/2], 0o644))
	malformed := synthetic(t, "m.jsonl.gz", `{"a": "alloc", "addr": 9999, "size": 512 "stream": 0, "t": 1}`)
	unknown := synthetic(t, "u.jsonl.gz", `{"a": "reticulate", "addr": 9999, "size": 512, "stream": 0, "t": 1}`)
	neverAllocated := synthetic(t, "n.jsonl", `{"a": "free_completed", "addr": 4242, "size": 512, "stream": 0, "t": 1}`)

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"replay", malformed}, 1, "m.jsonl.gz: line 148: malformed JSON at column 42: want ',' or '}' after the value of \"size\""},
		{[]string{"replay", unknown}, 1, `u.jsonl.gz: line 148: unknown action "reticulate"`},
		{[]string{"replay", neverAllocated}, 1, "n.jsonl: line 148: free_completed of id 4242, which is not live (never allocated, or already freed)"},
		{[]string{"replay", filepath.Join(dir, "missing.jsonl.gz")}, 1, "missing.jsonl.gz: no such file or directory"},
		{[]string{"replay", notGzip}, 1, "plain.jsonl.gz: unreadable gzip"},
		{[]string{"replay", truncated}, 1, "truncated.jsonl.gz: unreadable gzip: the file is truncated"},
		{[]string{"replay", "--policy", "slab", malformed}, 2, `unknown policy "slab" (known: goalloc, native, buddy, fixed, passthrough)`},
		{[]string{"replay", "--frobnicate"}, 2, `unknown flag "--frobnicate"`},
		{[]string{"replay", "--device", "tpu"}, 2, `unknown device "tpu" (want sim or cuda)`},
		{[]string{"replay", "--compare", "--policy", "native"}, 2, "--compare replays every policy; it takes no --policy"},
		{[]string{"replay", "--conf", "colour:blue"}, 2, `goalloc replay: --conf: unknown key "colour"`},
		{[]string{"replay", "--policy", "buddy", "--conf", "large_cache:0"}, 2, "--conf configures the goalloc policy; buddy takes none"},
		{[]string{"replay", "--sim-memory", "lots"}, 2, `--sim-memory: "lots" is not a byte size`},
		{[]string{"replay", "--sim-memory", "0"}, 2, "--sim-memory: 0 bytes is outside [1 MiB, 1 PiB]"},
		{[]string{"replay", "--sim-memory", "2048T"}, 2, "is outside [1 MiB, 1 PiB]"},
		{[]string{"replay", "--device", "cuda", "--sim-memory", "1G"}, 2, "--sim-memory sizes the simulated device; it does not apply to --device cuda"},
		{[]string{"replay", "--device-lag", "-1ms"}, 2, "--device-lag -1ms: a lag is 0 or more"},
		{[]string{"replay", "--device-lag", "soon"}, 2, "device-lag"},
		{[]string{"replay", "--device", "cuda", "--device-lag", "1ms"}, 2, "--device-lag delays the simulated device"},
		{[]string{"replay", "--stream-lag", "7"}, 2, `"7": want STREAM=DURATION`},
		{[]string{"replay", "--stream-lag", "x=1ms"}, 2, `"x=1ms": want STREAM=DURATION`},
		{[]string{"replay", "--stream-lag", "7=-1ms"}, 2, `"7=-1ms": a lag is a duration of 0 or more`},
		{[]string{"replay", "--device", "cuda", "--stream-lag", "7=1ms"}, 2, "--stream-lag delays the simulated device"},
		{[]string{"replay", "a.jsonl", "b.jsonl"}, 2, "one trace at a time, got 2: a.jsonl b.jsonl"},
		{[]string{"frobnicate"}, 2, `goalloc: unknown command "frobnicate"`},
		{nil, 2, "Usage:"},
	} {
		code, out, errOut := goalloc(t, c.args...)
		require.Equal(t, c.code, code, "%v: %s", c.args, errOut)
		require.Contains(t, errOut, c.want, "%v", c.args)
		require.Empty(t, out, "%v", c.args)
		if c.code == 2 && len(c.args) > 0 && c.args[0] == "replay" {
			require.Contains(t, errOut, `Run "goalloc help replay" for usage.`)
		}
	}
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"-h"}, {"--help"}} {
		code, out, _ := goalloc(t, args...)
		require.Equal(t, 0, code)
		require.Contains(t, out, "goalloc replay --compare [TRACE]")
	}
	for _, args := range [][]string{{"help", "replay"}, {"replay", "-h"}, {"replay", "--help"}, {"replay", "x.jsonl", "-help"}} {
		code, out, _ := goalloc(t, args...)
		require.Equal(t, 0, code, args)
		require.Contains(t, out, "--sim-memory BYTES")
		require.Contains(t, out, "goalloc, native, buddy, fixed, passthrough")
	}
}

func TestDeviceCUDA(t *testing.T) {
	if n, err := arena.CUDADeviceCount(); err == nil && n > 0 {
		t.Skip("a GPU is here; this test is about its absence")
	}
	trace := synthetic(t, "s.jsonl.gz")
	code, out, errOut := goalloc(t, "replay", trace, "--device", "cuda")
	require.Equal(t, 1, code)
	require.Empty(t, out)
	require.Contains(t, errOut, "goalloc replay: --device cuda: ")
	require.Contains(t, errOut, "use --device sim")
}

func TestSimMemory(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	// fixed rounds the 48 MiB parameter block up to a 64 MiB class: the
	// whole device, so every activation after it fails.
	// The results print all the same, and the exit status says the replay
	// did not get what the trace asked for, unless --allow-oom.
	code, out, errOut := goalloc(t, "replay", trace, "--policy", "fixed", "--sim-memory", "64M", "--json")
	require.Equal(t, 3, code, errOut)
	require.Contains(t, errOut, "goalloc replay: allocations failed for lack of memory: fixed:")
	var r map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	require.Positive(t, r["ooms"])
	code, _, errOut = goalloc(t, "replay", trace, "--policy", "fixed", "--sim-memory", "64M", "--json", "--allow-oom")
	require.Equal(t, 0, code, errOut)

	t.Setenv("GOALLOC_SIM_MEMORY", "64M")
	code, out, errOut = goalloc(t, "replay", trace, "--policy", "fixed", "--allow-oom")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "device   sim, 64.00 MiB")
	require.Contains(t, out, "allocations failed for lack of memory; the first at line")

	t.Setenv("GOALLOC_SIM_MEMORY", "nonsense")
	code, _, errOut = goalloc(t, "replay", trace)
	require.Equal(t, 2, code)
	require.Contains(t, errOut, `GOALLOC_SIM_MEMORY: "nonsense" is not a byte size`)
}

func TestConfFromEnvironment(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	t.Setenv("GOALLOC_CONF", "large_slack:0.25")
	code, out, errOut := goalloc(t, "replay", trace, "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"conf": "large_slack:0.25"`)
}

func TestDefaultTrace(t *testing.T) {
	// The test runs in cmd/goalloc, two folders below the bundled traces.
	code, out, errOut := goalloc(t, "replay", "--policy", "native", "--json")
	require.Equal(t, 0, code, errOut)
	var r map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	require.True(t, strings.HasSuffix(r["trace"].(string), filepath.Join("traces", "gpt2-train.jsonl.gz")), r["trace"])
	require.Equal(t, "gpt2", r["workload"])

	t.Chdir(t.TempDir())
	code, out, errOut = goalloc(t, "replay")
	require.Equal(t, 1, code)
	require.Empty(t, out)
	require.Contains(t, errOut, "no trace given, and the bundled traces/gpt2-train.jsonl.gz was not found in ")
	require.Contains(t, errOut, "give a trace: goalloc replay TRACE")
}

func TestTraceWarnings(t *testing.T) {
	path := filepath.Join(t.TempDir(), "short.jsonl")
	text := `{"workload": "w", "events": 5}` + "\n" + `{"a": "alloc", "addr": 1, "size": 512, "stream": 0, "t": 1}` + "\n"
	require.NoError(t, os.WriteFile(path, []byte(text), 0o644))
	code, out, errOut := goalloc(t, "replay", path)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, errOut, "warning: "+path+": the header says 5 events, the file has 1")
	require.NotContains(t, out, "native   recorded run", "no native figures in this header")
}

// snapshotFixture is one of the replay package's memory snapshot pickles
// (replay/testdata/snapshots, written in the structure of torch 2.11's
// _dump_snapshot).
func snapshotFixture(name string) string {
	return filepath.Join("..", "..", "replay", "testdata", "snapshots", name)
}

func TestReplaySnapshot(t *testing.T) {
	path := snapshotFixture("torch-gpt2-wrapped.pickle")
	code, out, errOut := goalloc(t, "replay", path, "--policy", "native", "--json")
	require.Equal(t, 0, code, errOut)
	var r map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &r), out)
	require.Equal(t, "memory snapshot, device 0", r["workload"])
	s, ok := r["snapshot"].(map[string]any)
	require.True(t, ok, out)
	require.Equal(t, "pytorch", s["recorder"])
	require.Equal(t, float64(0), s["device"])
	require.Equal(t, float64(8000), s["entries"])
	require.Positive(t, s["initial_blocks"])
	require.Positive(t, s["recorded_peak_reserved_bytes"])
	require.Equal(t, s["recorded_peak_reserved_bytes"], r["native_max_reserved"])
	// What cannot be reproduced goes to stderr, with --json too.
	require.Contains(t, errOut, "goalloc replay: note: "+path+": the history does not start from an empty allocator")

	code, out, errOut = goalloc(t, "replay", path, "--compare")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "trace    "+path+": memory snapshot, device 0")
	require.Contains(t, out, "snapshot PyTorch's caching allocator; device 0: 8,000 events (2,787 alloc, 2,587 free_requested, 2,587 free_completed, 39 segment_alloc)")
	require.Contains(t, out, "start    450 blocks")
	require.Contains(t, out, "recorded peak reserved 26.11 GiB")
	require.NotContains(t, out, "max_allocated", "a snapshot has no torch allocated peak")

	report := filepath.Join(t.TempDir(), "r.html")
	code, _, errOut = goalloc(t, "replay", path, "--policy", "goalloc", "--html", report)
	require.Equal(t, 0, code, errOut)
	require.FileExists(t, report)
}

func TestReplaySnapshotDevices(t *testing.T) {
	path := snapshotFixture("torch-two-devices.pickle")
	code, out, errOut := goalloc(t, "replay", path, "--json", "--policy", "native")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, errOut, "replaying device 1, the first with events; other devices with events: 2 (pick one with --device-index N)")
	require.Contains(t, out, `"device": 1`)

	code, out, errOut = goalloc(t, "replay", path, "--device-index", "2", "--json", "--policy", "native")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"device": 2`)
	require.Empty(t, errOut)

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"replay", path, "--device-index", "0"}, 1, "device 0 has no events in this snapshot; devices with events: 1, 2"},
		{[]string{"replay", path, "--device-index", "-3"}, 2, "--device-index -3: a device is 0 or more"},
		{[]string{"replay", synthetic(t, "s.jsonl"), "--device-index", "1"}, 1, "a device index picks a device of a memory snapshot; this is a JSON lines trace"},
		{[]string{"replay", snapshotFixture("torch-no-history.pickle")}, 1, "a memory snapshot without allocation history"},
		{[]string{"replay", snapshotFixture("values-p4.pickle")}, 1, "a dict without device_traces"},
	} {
		code, out, errOut := goalloc(t, c.args...)
		require.Equal(t, c.code, code, "%v: %s", c.args, errOut)
		require.Contains(t, errOut, c.want, "%v", c.args)
		require.Empty(t, out, "%v", c.args)
	}
}

// A free on another stream than its allocation's: goalloc handles it with a
// warning, which the table and the JSON count, and every policy replays
// the trace.
func TestReplayFreeOnAnotherStream(t *testing.T) {
	path := filepath.Join(t.TempDir(), "streams.jsonl")
	text := `{"workload": "w", "events": 3}` + "\n" +
		`{"a": "alloc", "addr": 1, "size": 4096, "stream": 7, "t": 1}` + "\n" +
		`{"a": "free_completed", "addr": 1, "size": 4096, "stream": 9, "t": 2}` + "\n" +
		`{"a": "alloc", "addr": 2, "size": 4096, "stream": 7, "t": 3}` + "\n"
	require.NoError(t, os.WriteFile(path, []byte(text), 0o644))
	code, out, errOut := goalloc(t, "replay", path, "--compare", "--json")
	require.Equal(t, 0, code, errOut)
	var results []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &results), out)
	require.Len(t, results, len(reference.Names))
	for _, r := range results {
		want := 0.0
		if r["policy"] == "goalloc" {
			want = 1
			require.Contains(t, r["input_warning"], "line 3: ")
		}
		require.Equal(t, want, r["input_warnings"], r["policy"])
	}
	code, out, errOut = goalloc(t, "replay", path)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "goalloc: calls carried out despite bad input (a warning each): 1; the first at line 3: ")
}

// --max-input-bytes and --max-line-bytes bound what is read of the trace,
// with a message that names the flag to raise.
func TestInputLimitFlags(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	code, _, errOut := goalloc(t, "replay", trace, "--max-input-bytes", "4K")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "s.jsonl.gz: the trace is larger than 4.00 KiB after gunzip, the most this reader takes (--max-input-bytes raises it)")
	code, _, errOut = goalloc(t, "replay", trace, "--max-line-bytes", "64")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "s.jsonl.gz: line 1: longer than 64 B, the longest line this reader takes (--max-line-bytes raises it)")
	code, _, errOut = goalloc(t, "replay", trace, "--max-input-bytes", "1M", "--max-line-bytes", "200", "--json")
	require.Equal(t, 0, code, errOut)

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--max-input-bytes", "lots"}, `--max-input-bytes: "lots" is not a byte size`},
		{[]string{"--max-line-bytes", "0"}, "--max-line-bytes: a limit is at least 1 byte"},
	} {
		code, out, errOut := goalloc(t, append([]string{"replay", trace}, c.args...)...)
		require.Equal(t, 2, code, "%v: %s", c.args, errOut)
		require.Contains(t, errOut, c.want, "%v", c.args)
		require.Empty(t, out)
	}
	_, out, _ := goalloc(t, "help", "replay")
	require.Contains(t, out, "--max-input-bytes BYTES")
	require.Contains(t, out, "(default 2.00 GiB)")
}

// A flag is quoted as the user typed it: Go's flag package writes every
// flag with one dash (-polcy for --polcy).
func TestMistypedFlagIsQuotedAsTyped(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"replay", "--polcy", "x", trace}, `unknown flag "--polcy" (did you mean --policy?)`},
		{[]string{"replay", trace, "-polcy=x"}, `unknown flag "-polcy" (did you mean --policy?)`},
		{[]string{"replay", "--frobnicate"}, `unknown flag "--frobnicate"`},
		{[]string{"replay", trace, "--policy"}, `flag "--policy" needs a value`},
		{[]string{"replay", "--device-index", "two", trace}, `invalid value "two" for flag "--device-index": parse error`},
		{[]string{"replay", "-device-index=-x", trace}, `invalid value "-x" for flag "-device-index": parse error`},
		{[]string{"replay", "--json=maybe", trace}, `invalid boolean value "maybe" for flag "--json": parse error`},
		{[]string{"replay", "---json", trace}, `bad flag syntax: ---json`},
	} {
		code, out, errOut := goalloc(t, c.args...)
		require.Equal(t, 2, code, "%v: %s", c.args, errOut)
		require.Empty(t, out)
		require.Contains(t, errOut, "goalloc replay: "+c.want+"\n", "%v", c.args)
		require.Contains(t, errOut, `Run "goalloc help replay" for usage.`)
	}
	// No suggestion where nothing is close.
	_, _, errOut := goalloc(t, "replay", "--frobnicate")
	require.NotContains(t, errOut, "did you mean")
}

// The configuration is reported under the name it came by: GOALLOC_CONF
// from the environment, --conf from the command line, which replaces it.
func TestConfErrorsNameWhereTheConfCameFrom(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	t.Setenv("GOALLOC_CONF", "colour:blue")
	code, out, errOut := goalloc(t, "replay", trace)
	require.Equal(t, 2, code, errOut)
	require.Empty(t, out)
	require.Contains(t, errOut, `goalloc replay: GOALLOC_CONF: unknown key "colour"`)
	require.NotContains(t, errOut, "--conf:")

	code, _, errOut = goalloc(t, "replay", trace, "--conf", "large_slack:2")
	require.Equal(t, 2, code, errOut)
	require.Contains(t, errOut, "goalloc replay: --conf: large_slack: ")
	require.NotContains(t, errOut, "GOALLOC_CONF")

	code, _, errOut = goalloc(t, "replay", trace, "--conf", "", "--json")
	require.Equal(t, 0, code, "--conf replaces GOALLOC_CONF: %s", errOut)

	t.Setenv("GOALLOC_CONF", "large_cache:0")
	code, _, errOut = goalloc(t, "replay", trace, "--policy", "buddy")
	require.Equal(t, 2, code, errOut)
	require.Contains(t, errOut, `goalloc replay: GOALLOC_CONF configures the goalloc policy; buddy takes none (give --conf "" to replay buddy without it)`)
	code, _, errOut = goalloc(t, "replay", trace, "--policy", "buddy", "--conf", "")
	require.Equal(t, 0, code, errOut)
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"-version"}, {"version"}} {
		code, out, errOut := goalloc(t, args...)
		require.Equal(t, 0, code, "%v: %s", args, errOut)
		require.Equal(t, "goalloc "+version+"\n", out, args)
	}
	require.NotEmpty(t, version)
	code, out, _ := goalloc(t, "help")
	require.Equal(t, 0, code)
	require.Contains(t, out, "goalloc --version")
}

func TestDeviceLag(t *testing.T) {
	trace := synthetic(t, "s.jsonl.gz")
	code, out, errOut := goalloc(t, "replay", trace, "--device-lag", "10ms")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "device   sim, 80.00 GiB, 10ms behind the host")
	code, out, errOut = goalloc(t, "replay", trace, "--device-lag", "10ms", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"device_lag_us": 10000`)
	code, out, errOut = goalloc(t, "replay", trace, "--device-lag", "10ms", "--stream-lag", "7=200ms",
		"--stream-lag", "3=1ms")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "device   sim, 80.00 GiB, 10ms behind the host, stream 3 1ms behind, stream 7 200ms behind")
	code, out, errOut = goalloc(t, "replay", trace, "--stream-lag", "7=200ms", "--json")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, `"stream_lag_us": {`)
}

// On vmm the report's last lines say what the device held at its peak and
// beside which live spans, by size, the free ends lay: at most three sizes
// and a count of the rest (with the 16 MiB handles the history was recorded
// under, whose ends the lines below name).
func TestPeakLines(t *testing.T) {
	code, out, errOut := goalloc(t, "replay", "../../traces/serving-vmm.jsonl.gz", "--device-lag", "10ms",
		"--conf", "vmm_handle:16M")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "goalloc: at the peak the device held 4.72 GiB: 4.63 GiB in live spans, 91.03 MiB free in the shared granules of 31 free spans")
	require.Contains(t, out, "goalloc: the free ends lie beside live spans of 46.59 MiB (23: 48.34 MiB); 32.00 MiB (1: 16.00 MiB); 186.38 MiB (3: 13.95 MiB); 2 sizes more\n")
}
