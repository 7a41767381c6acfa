// Command goalloc is goalloc's command-line tool. Its one command so far,
// replay, replays a recorded PyTorch allocation trace (goalloc's JSON lines,
// or the memory snapshot pickle torch.cuda.memory._dump_snapshot writes)
// through an allocation policy on the simulated device or a GPU and reports
// what memory it took:
//
//	goalloc replay [TRACE] [--device sim|cuda] [--policy NAME] [--conf GOALLOC_CONF]
//	               [--sim-memory BYTES] [--device-index N] [--json] [--html OUT.html]
//	               [--max-input-bytes BYTES] [--max-line-bytes BYTES]
//	goalloc replay --compare [TRACE] [--device sim|cuda] [--json] [--html OUT.html]
//
// See usage below for the flags, and package replay for how it measures.
//
// Exit status: 0 when all went well, 2 for a usage error (an unknown flag,
// policy or device), 1 for anything that failed while running (a missing or
// malformed trace, no GPU, a failing device), 3 when the replay ran but
// allocations failed for lack of memory (unless --allow-oom).
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay"
	"github.com/goalloc/goalloc/replay/reference"
	"github.com/goalloc/goalloc/units"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// version is goalloc's version, written once as the Python package's
// goalloc.__version__ (python/goalloc/__init__.py); the builds set it with
// -ldflags "-X main.version=..." (setup.py, the Makefile). "devel" is a
// build that did not.
var version = "devel"

const usageText = `goalloc is the command-line tool of goalloc, a CUDA memory allocator for PyTorch.

Usage:

	goalloc replay [TRACE] [flags]      replay a trace through one allocation policy
	goalloc replay --compare [TRACE]    replay it through every policy, side by side
	goalloc help [replay]               show this help
	goalloc --version                   print goalloc's version

Run "goalloc help replay" for the replay flags.
`

const replayUsageText = `Usage: goalloc replay [TRACE] [flags]
       goalloc replay --compare [TRACE] [flags]

Replays an allocation trace recorded from PyTorch through an allocation
policy, each policy on a fresh device, and reports the device pool's peak
reserved bytes against the trace's peak of live bytes, fragmentation at that
peak, device calls and speed. TRACE is goalloc's trace format (JSON lines,
gzipped or not; see traces/README.md) or a memory snapshot pickle as
torch.cuda.memory._record_memory_history() and _dump_snapshot() write it
(from PyTorch's allocator or goalloc's), told apart by their content.

TRACE defaults to the bundled traces/gpt2-train.jsonl.gz, looked for above the
current folder and above the executable.

Flags:
  --policy NAME        the policy to replay: %s (default goalloc)
  --compare            replay every policy and print them side by side
  --conf GOALLOC_CONF  goalloc's configuration, e.g. "large_cache:512M,large_slack:0.1"
                       (default: $GOALLOC_CONF); keys: %s
  --device sim|cuda    the simulated device (default) or GPU 0 through the CUDA driver
  --sim-memory BYTES   the simulated device's memory, e.g. 80G (default: $GOALLOC_SIM_MEMORY,
                       else %s)
  --device-index N     the device of a memory snapshot to replay (default: the first with events)
  --device-lag D       run the simulated device D (e.g. 10ms) of the trace's clock behind the
                       calls, as a GPU runs behind its host: frees complete that much later
                       (checked against the GPU on backend:vmm; backend:async's pool runs high)
  --stream-lag S=D     run the trace's stream S D behind the host instead of --device-lag
                       (repeatable): one stream far behind the others, as FSDP's all-gathers may be
  --max-input-bytes BYTES
                       the largest trace read, after gunzip (default %s); a larger one is refused
  --max-line-bytes BYTES
                       the longest line of a JSON lines trace read (default %s)
  --json               print the results as JSON (an array with --compare)
  --html OUT.html      also write a self-contained HTML report with plots
  --allow-oom          exit 0 even when allocations failed for lack of memory
  -h, --help           show this help

Exit status: 0 ok, 2 usage error, 1 runtime error, 3 allocations failed for
lack of memory (the results are printed all the same; --allow-oom makes it 0).
`

func replayUsage() string {
	return fmt.Sprintf(replayUsageText, strings.Join(reference.Names, ", "), strings.Join(reference.ConfKeys(), ", "),
		units.FormatBytes(arena.DefaultSimMemory), units.FormatBytes(replay.DefaultMaxInputBytes), units.FormatBytes(replay.DefaultMaxLineBytes))
}

// run is the whole command, writing to stdout and stderr and returning the
// exit status, so that tests run it in-process.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		if len(args) > 1 && args[1] == "replay" {
			fmt.Fprint(stdout, replayUsage())
		} else {
			fmt.Fprint(stdout, usageText)
		}
		return 0
	case "version", "-version", "--version":
		fmt.Fprintf(stdout, "goalloc %s\n", version)
		return 0
	case "replay":
		return runReplay(args[1:], stdout, stderr)
	}
	fmt.Fprintf(stderr, "goalloc: unknown command %q\n\n%s", args[0], usageText)
	return 2
}

// usageError is a mistake on the command line: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{fmt.Sprintf(format, args...)}
}

// replayFlags is what the replay command line asked for.
type replayFlags struct {
	trace  string
	device string
	policy string
	conf   string
	// spec is the device every policy runs on: --device, with the memory
	// backend conf names and its layout (vmm_handle).
	spec      arena.DeviceSpec
	compare   bool
	json      bool
	html      string
	simMemory uint64
	allowOOM  bool
	// deviceLag is --device-lag, in microseconds (replay.Options.DeviceLag);
	// streamLag the --stream-lag ones (replay.Options.StreamLag).
	deviceLag int64
	streamLag map[arena.Stream]int64
	// deviceIndex picks a snapshot's device; -1 the first with events.
	deviceIndex int
	// maxInputBytes and maxLineBytes bound what is read of the trace
	// (replay.ReadOptions).
	maxInputBytes, maxLineBytes uint64
}

// parseLimits sets the bounds on what is read of the trace from
// --max-input-bytes and --max-line-bytes ("" keeps the default).
func (f *replayFlags) parseLimits(maxInput, maxLine string) error {
	for _, limit := range []struct {
		flag  string
		value string
		to    *uint64
		def   uint64
	}{
		{"--max-input-bytes", maxInput, &f.maxInputBytes, replay.DefaultMaxInputBytes},
		{"--max-line-bytes", maxLine, &f.maxLineBytes, replay.DefaultMaxLineBytes},
	} {
		*limit.to = limit.def
		if limit.value == "" {
			continue
		}
		n, err := units.ParseBytes(limit.value)
		if err == nil && n == 0 {
			err = errors.New("a limit is at least 1 byte")
		}
		if err != nil {
			return usagef("%s: %v", limit.flag, err)
		}
		*limit.to = n
	}
	return nil
}

func runReplay(args []string, stdout, stderr io.Writer) int {
	f, err := parseReplayFlags(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, replayUsage())
		return 0
	}
	if err == nil {
		err = replayTrace(f, stdout, stderr)
	}
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "goalloc replay: %v\n", err)
	if errors.Is(err, errOOM) {
		return 3
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintln(stderr, `Run "goalloc help replay" for usage.`)
		return 2
	}
	return 1
}

func parseReplayFlags(args []string) (*replayFlags, error) {
	f := &replayFlags{}
	fs := flag.NewFlagSet("goalloc replay", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported once, by runReplay
	fs.StringVar(&f.device, "device", "sim", "")
	fs.StringVar(&f.policy, "policy", "", "")
	fs.StringVar(&f.conf, "conf", "", "")
	fs.BoolVar(&f.compare, "compare", false, "")
	fs.BoolVar(&f.json, "json", false, "")
	fs.StringVar(&f.html, "html", "", "")
	fs.BoolVar(&f.allowOOM, "allow-oom", false, "")
	fs.IntVar(&f.deviceIndex, "device-index", -1, "")
	deviceLag := fs.Duration("device-lag", 0, "")
	fs.Func("stream-lag", "", f.addStreamLag)
	simMemory := fs.String("sim-memory", "", "")
	maxInput := fs.String("max-input-bytes", "", "")
	maxLine := fs.String("max-line-bytes", "", "")

	// Flags may come before or after the trace: parse up to each
	// positional argument, set it aside, and go on.
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, flagError(err, fs, args, fs.Args())
		}
		if fs.NArg() == 0 {
			break
		}
		positional = append(positional, fs.Arg(0))
		args = fs.Args()[1:]
	}
	// The configuration is named as it came: --conf, or GOALLOC_CONF from
	// the environment, which --conf (even --conf "") replaces.
	confSource := "GOALLOC_CONF"
	if isSet(fs, "conf") {
		confSource = "--conf"
	} else {
		f.conf = os.Getenv("GOALLOC_CONF")
	}
	switch len(positional) {
	case 0:
	case 1:
		f.trace = positional[0]
	default:
		return nil, usagef("one trace at a time, got %d: %s", len(positional), strings.Join(positional, " "))
	}

	if f.deviceIndex < -1 {
		return nil, usagef("--device-index %d: a device is 0 or more", f.deviceIndex)
	}
	if !slices.Contains(arena.DeviceKinds, f.device) {
		return nil, usagef("unknown device %q (want %s)", f.device, strings.Join(arena.DeviceKinds, " or "))
	}
	if f.compare && f.policy != "" {
		return nil, usagef("--compare replays every policy; it takes no --policy")
	}
	if f.policy == "" {
		f.policy = "goalloc"
	}
	if !slices.Contains(reference.Names, f.policy) {
		return nil, usagef("unknown policy %q (known: %s)", f.policy, strings.Join(reference.Names, ", "))
	}
	if f.conf != "" && !f.compare && f.policy != "goalloc" {
		if confSource == "GOALLOC_CONF" {
			return nil, usagef(`GOALLOC_CONF configures the goalloc policy; %s takes none (give --conf "" to replay %s without it)`, f.policy, f.policy)
		}
		return nil, usagef("--conf configures the goalloc policy; %s takes none", f.policy)
	}
	if err := f.parseLimits(*maxInput, *maxLine); err != nil {
		return nil, err
	}
	switch {
	case *deviceLag < 0:
		return nil, usagef("--device-lag %v: a lag is 0 or more", *deviceLag)
	case *deviceLag > 0 && f.device != arena.KindSim:
		return nil, usagef("--device-lag delays the simulated device; a GPU runs at its own pace")
	case len(f.streamLag) > 0 && f.device != arena.KindSim:
		return nil, usagef("--stream-lag delays the simulated device; a GPU runs at its own pace")
	}
	f.deviceLag = deviceLag.Microseconds()

	f.simMemory = arena.DefaultSimMemory
	source := "--sim-memory"
	if *simMemory == "" {
		*simMemory, source = os.Getenv("GOALLOC_SIM_MEMORY"), "GOALLOC_SIM_MEMORY"
	} else if f.device != "sim" {
		return nil, usagef("--sim-memory sizes the simulated device; it does not apply to --device %s", f.device)
	}
	if *simMemory != "" {
		n, err := units.ParseBytes(*simMemory)
		if err == nil {
			err = arena.CheckSimMemory(n)
		}
		if err != nil {
			return nil, usagef("%s: %v", source, err)
		}
		f.simMemory = n
	}
	var deviceMemory uint64 // a GPU's is its own
	if f.device == arena.KindSim {
		deviceMemory = f.simMemory
	}
	spec, err := reference.DeviceSpec(f.device, deviceMemory, f.conf)
	if err != nil {
		// The parser's errors open with "GOALLOC_CONF: ".
		return nil, usagef("%s: %s", confSource, strings.TrimPrefix(err.Error(), "GOALLOC_CONF: "))
	}
	f.spec = spec
	return f, nil
}

// isSet says whether the command line gave flag name.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(fl *flag.Flag) { set = set || fl.Name == name })
	return set
}

// flagError rewrites an error of package flag, which writes every flag
// with one dash (-polcy for --polcy), so that it quotes the flag as the
// user typed it. args are what fs.Parse was given, rest what it left.
func flagError(err error, fs *flag.FlagSet, args, rest []string) error {
	msg := err.Error()
	consumed := args[:len(args)-len(rest)]
	// typed is flag name as typed, up to any "=value": the last argument
	// Parse took, or the one before it when that was the flag's value.
	typed := func(name string) string {
		for i := len(consumed) - 1; i >= 0 && i >= len(consumed)-2; i-- {
			arg, _, _ := strings.Cut(consumed[i], "=")
			bare := strings.TrimPrefix(arg, "-")
			bare = strings.TrimPrefix(bare, "-")
			if strings.HasPrefix(arg, "-") && bare == name {
				return arg
			}
		}
		return "-" + name
	}
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		if near := nearestFlag(fs, name); near != "" {
			return usagef("unknown flag %q (did you mean --%s?)", typed(name), near)
		}
		return usagef("unknown flag %q", typed(name))
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: -"); ok {
		return usagef("flag %q needs a value", typed(name))
	}
	// invalid value "v" for flag -name: why; invalid boolean value "v" for -name: why
	for _, prefix := range []string{"invalid value ", "invalid boolean value "} {
		rest, ok := strings.CutPrefix(msg, prefix)
		if !ok {
			continue
		}
		value, err := strconv.QuotedPrefix(rest)
		if err != nil {
			break
		}
		rest = rest[len(value):]
		rest, ok = strings.CutPrefix(rest, " for flag -")
		if !ok {
			rest, ok = strings.CutPrefix(rest, " for -")
		}
		name, why, found := strings.Cut(rest, ": ")
		if !ok || !found {
			break
		}
		return usagef("%s%s for flag %q: %s", prefix, value, typed(name), why)
	}
	return usagef("%s", msg) // bad flag syntax quotes the argument itself
}

// nearestFlag is the flag of fs closest to name, within two edits, or "".
func nearestFlag(fs *flag.FlagSet, name string) string {
	best, bestDist := "", 3
	fs.VisitAll(func(fl *flag.Flag) {
		if d := editDistance(name, fl.Name); d < bestDist && d < len(fl.Name) {
			best, bestDist = fl.Name, d
		}
	})
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// replayTrace runs what f asks for.
func replayTrace(f *replayFlags, stdout, stderr io.Writer) error {
	// Fail on a missing GPU before spending time on the trace.
	if f.device == "cuda" {
		dev, err := newDevice(f)
		if err != nil {
			return err
		}
		dev.Close()
	}
	path := f.trace
	if path == "" {
		var err error
		if path, err = bundledTrace(); err != nil {
			return err
		}
	}
	tr, err := replay.OpenWith(path, replay.ReadOptions{Device: f.deviceIndex, MaxInputBytes: f.maxInputBytes, MaxLineBytes: f.maxLineBytes})
	if err != nil {
		return err
	}
	for _, w := range tr.Warnings {
		fmt.Fprintf(stderr, "goalloc replay: warning: %s: %s\n", path, w)
	}
	if tr.Snapshot != nil {
		for _, n := range tr.Snapshot.Notes {
			fmt.Fprintf(stderr, "goalloc replay: note: %s: %s\n", path, n)
		}
	}

	names := []string{f.policy}
	if f.compare {
		names = reference.Names
	}
	var results []*replay.Result
	for _, name := range names {
		dev, err := newDevice(f)
		if err != nil {
			return err
		}
		opt := replay.Options{Policy: name, DeviceLag: f.deviceLag, StreamLag: f.streamLag}
		if name == "goalloc" {
			opt.Conf = f.conf
		}
		r, err := replay.Replay(tr, dev, opt)
		if err != nil {
			return err
		}
		results = append(results, r)
	}

	if f.html != "" {
		if err := writeHTML(f.html, tr, results); err != nil {
			return err
		}
	}
	if f.json {
		var v any = results
		if !f.compare {
			v = results[0]
		}
		out, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s\n", out)
	} else {
		printTable(stdout, f, tr, results)
	}
	if f.html != "" {
		fmt.Fprintf(stderr, "goalloc replay: wrote %s\n", f.html)
	}
	if !f.allowOOM {
		for _, r := range results {
			if r.OOMs > 0 {
				return fmt.Errorf("%w: %s: %d allocations (--allow-oom accepts that)", errOOM, r.Policy, r.OOMs)
			}
		}
	}
	return nil
}

// errOOM is a replay in which allocations failed for lack of memory: the
// replay does not measure what the trace asked for.
var errOOM = errors.New("allocations failed for lack of memory")

// newDevice makes a fresh device for one policy, as the library makes its
// devices (arena.NewDevice): the backend --conf names (backend:vmm, the
// default, or the stream-ordered pool) serves every policy, laid out as
// vmm_handle says.
func newDevice(f *replayFlags) (arena.Device, error) {
	d, err := arena.NewDevice(f.spec, 0)
	if err != nil && f.spec.Kind == arena.KindCUDA {
		return nil, fmt.Errorf("--device cuda: %w (use --device sim to replay on the simulated device)", err)
	}
	return d, err
}

func writeHTML(path string, tr *replay.Trace, results []*replay.Result) error {
	out, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("writing the report: %w", err)
	}
	err = replay.WriteHTML(out, tr, results)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing the report %s: %w", path, err)
	}
	return nil
}

// bundledTrace finds traces/gpt2-train.jsonl.gz in the current folder or one
// above it (a checkout of the repository), or above the executable (an
// installed build next to the traces).
func bundledTrace() (string, error) {
	const rel = "traces/gpt2-train.jsonl.gz"
	cwd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("no trace given, and the current folder is unknown: %w", err)
	}
	exeDir := "(unknown)"
	starts := []string{cwd}
	if exe, err := os.Executable(); err == nil {
		if exe, err = filepath.EvalSymlinks(exe); err == nil {
			exeDir = filepath.Dir(exe)
			starts = append(starts, exeDir)
		}
	}
	for _, dir := range starts {
		for {
			p := filepath.Join(dir, rel)
			if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
				if r, err := filepath.Rel(cwd, p); err == nil && !strings.HasPrefix(r, "..") {
					return r, nil
				}
				return p, nil
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("no trace given, and the bundled %s was not found in %s or any folder above it, nor above the executable's folder %s; give a trace: goalloc replay TRACE", rel, cwd, exeDir)
}

// printTable writes the results as an aligned table with the trace's own
// figures above it.
func printTable(w io.Writer, f *replayFlags, tr *replay.Trace, results []*replay.Result) {
	h := tr.Header
	fmt.Fprintf(w, "trace    %s", tr.Path)
	if h.Workload != "" {
		fmt.Fprintf(w, ": %s", h.Workload)
		if h.Torch != "" {
			fmt.Fprintf(w, ", torch %s", h.Torch)
		}
		if h.GPU != "" {
			fmt.Fprintf(w, " on %s", h.GPU)
		}
	}
	fmt.Fprintf(w, "\n         %s events, %s replayed (alloc, free_completed); read in %.0f ms (%.1f M lines/s)\n",
		units.FormatCount(uint64(tr.Lines)), units.FormatCount(uint64(len(tr.Events))), tr.Elapsed.Seconds()*1000, float64(tr.Lines)/tr.Elapsed.Seconds()/1e6)
	if f.device == "sim" {
		fmt.Fprintf(w, "device   sim, %s", units.FormatBytes(f.simMemory))
		if f.deviceLag > 0 {
			fmt.Fprintf(w, ", %v behind the host", time.Duration(f.deviceLag)*time.Microsecond)
		}
		for _, st := range slices.Sorted(maps.Keys(f.streamLag)) {
			fmt.Fprintf(w, ", stream %d %v behind", st, time.Duration(f.streamLag[st])*time.Microsecond)
		}
		fmt.Fprintln(w)
	} else {
		fmt.Fprintf(w, "device   cuda, GPU 0\n")
	}
	if tr.Snapshot != nil {
		for _, line := range tr.Snapshot.Summary() {
			fmt.Fprintln(w, line)
		}
	} else if h.NativeRatio() > 0 {
		fmt.Fprintf(w, "native   recorded run: max_reserved %s / max_allocated %s = %.3f, %d segments\n",
			units.FormatBytes(h.MaxReserved), units.FormatBytes(h.MaxAllocated), h.NativeRatio(), tr.SegmentAllocs())
	}
	if f.conf != "" {
		fmt.Fprintf(w, "conf     goalloc: %s\n", f.conf)
	}
	fmt.Fprintln(w)

	t := table{header: []string{"policy", "peak live", "peak reserved", "ratio", "vs native", "frag@peak",
		"dev allocs", "dev frees", "OOMs", "ns/op", "M ev/s", "e2e M ev/s"}}
	for _, r := range results {
		vs := "-"
		if r.NativeRatio > 0 {
			vs = fmt.Sprintf("%+.1f%%", (r.Ratio/r.NativeRatio-1)*100)
		}
		t.rows = append(t.rows, []string{r.Policy, units.FormatBytes(r.PeakLiveBytes), units.FormatBytes(r.PeakReservedBytes),
			fmt.Sprintf("%.3f", r.Ratio), vs, fmt.Sprintf("%.3f", r.FragmentationAtPeak),
			units.FormatCount(r.DeviceAllocs), units.FormatCount(r.DeviceFrees), units.FormatCount(uint64(r.OOMs)),
			fmt.Sprintf("%.0f", r.NsPerOp), fmt.Sprintf("%.2f", r.EventsPerSecond/1e6),
			fmt.Sprintf("%.2f", r.EndToEndEventsPerSecond/1e6)})
	}
	t.write(w)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "peak reserved: the device pool's reserved high-water mark; ratio: peak reserved / peak live;")
	fmt.Fprintln(w, "frag@peak: 1 - largest free block / free bytes held by the policy when live bytes peak;")
	fmt.Fprintln(w, "M ev/s: replayed events per second of the replay loop; e2e: every trace line over read + parse + replay.")
	for _, r := range results {
		if h := r.HeldAtPeak; h != nil {
			fmt.Fprintf(w, "%s: at the peak the device held %s: %s in live spans, %s free in the shared granules of %d free spans "+
				"(%s beside live spans under 1 MiB), %s of whole free granules, %s pending, %s draining\n", r.Policy,
				units.FormatBytes(h.Held), units.FormatBytes(h.Live), units.FormatBytes(h.FreeShared), h.FreeSpans,
				units.FormatBytes(h.FreeBesideSmall), units.FormatBytes(h.FreeWhole), units.FormatBytes(h.Pending),
				units.FormatBytes(h.Draining))
			if ends := r.FreeEndsAtPeak; len(ends) > 0 {
				var groups []string
				for _, fe := range ends[:min(len(ends), 3)] {
					groups = append(groups, fmt.Sprintf("%s (%d: %s)",
						units.FormatBytes(fe.LiveSize), fe.LiveSpans, units.FormatBytes(fe.Bytes)))
				}
				if len(ends) > 3 {
					groups = append(groups, fmt.Sprintf("%d sizes more", len(ends)-3))
				}
				fmt.Fprintf(w, "%s: the free ends lie beside live spans of %s\n", r.Policy, strings.Join(groups, "; "))
			}
		}
		if r.OOMs > 0 {
			fmt.Fprintf(w, "%s: %d allocations failed for lack of memory; the first at %s\n", r.Policy, r.OOMs, r.OOMError)
		}
		if note := r.InputWarningNote(); note != "" {
			fmt.Fprintln(w, note)
		}
	}
}

// table is a plain text table: the first column left-aligned, the others,
// numbers, right-aligned.
type table struct {
	header []string
	rows   [][]string
}

func (t *table) write(w io.Writer) {
	widths := make([]int, len(t.header))
	for _, r := range append([][]string{t.header}, t.rows...) {
		for i, c := range r {
			widths[i] = max(widths[i], len(c))
		}
	}
	for _, r := range append([][]string{t.header}, t.rows...) {
		var b strings.Builder
		for i, c := range r {
			if i == 0 {
				fmt.Fprintf(&b, "%-*s", widths[i], c)
			} else {
				fmt.Fprintf(&b, "  %*s", widths[i], c)
			}
		}
		fmt.Fprintln(w, b.String())
	}
}

// addStreamLag takes one --stream-lag S=D: the trace's stream S runs D of
// its clock behind the host.
func (f *replayFlags) addStreamLag(v string) error {
	name, dur, ok := strings.Cut(v, "=")
	st, err := strconv.ParseUint(name, 10, 64)
	if !ok || err != nil {
		return fmt.Errorf("%q: want STREAM=DURATION, the trace's stream number and a lag such as 200ms", v)
	}
	d, err := time.ParseDuration(dur)
	if err != nil || d < 0 {
		return fmt.Errorf("%q: a lag is a duration of 0 or more, such as 200ms", v)
	}
	if f.streamLag == nil {
		f.streamLag = map[arena.Stream]int64{}
	}
	f.streamLag[arena.Stream(st)] = d.Microseconds()
	return nil
}
