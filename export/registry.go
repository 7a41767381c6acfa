package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/goalloc/goalloc/units"
)

// getenv reads the process environment. main.go points it at C's getenv:
// Go's own copy of the environment is taken when the library loads, and a
// Python program that sets os.environ["GOALLOC_CONF"] afterwards (through
// putenv) must still be heard.
var getenv = os.Getenv

// maxDevices bounds device ordinals; PyTorch hosts have at most a few dozen.
const maxDevices = 64

// The library's one piece of global state: which device kind it runs on,
// the configuration, and one caching allocator per device, made on the
// device's first use so that a rank of a multi-GPU job touches only its GPU.
var lib = newLibrary()

type library struct {
	// devices[i] is device i's allocator once made. Read without a lock on
	// the hot path; written once, under mu.
	devices [maxDevices]atomic.Pointer[caching.Allocator]

	mu sync.Mutex // guards everything below
	// initErr, once set, makes every allocation fail with it: a bad
	// GOALLOC_CONF or a missing driver is reported, not papered over.
	initialized bool
	initErr     error
	configured  bool // goalloc_configure was called: GOALLOC_CONF is not read
	cfg         caching.Config
	kind        string // "cuda" or "sim"
	count       int    // devices there are
	simMemory   uint64
	// fractions holds the memory fraction set for each device by
	// set_memory_fraction, applied when the device is made if it was not
	// made yet, and shown by config.
	fractions map[int]float64
	// history is how devices made from now on record history; its
	// MaxEntries is 0 while recording is off.
	history caching.HistoryOptions
	// labels holds the trace labels set for each device
	// (setTraceLabels), applied when the device is made if it was not made
	// yet.
	labels map[int]caching.TraceLabels

	// tagsUsed: a thread set a memory tag (sleep.go); from then on each
	// allocation reads its thread's tag, and the front stays off.
	tagsUsed atomic.Bool

	// warned says which kinds of bad input have printed their one warning.
	warned map[string]bool
	// badInput counts bad calls caught here, before any device is involved.
	badInput map[string]int64

	// setLastError records the kind and message of a failed call for the
	// calling thread's goalloc_last_error_kind and goalloc_last_error. The
	// library of the C ABI (main.go) keeps them per OS thread in C; a
	// library made by a Go test keeps them in lastKind and lastErr, one
	// pair for the process.
	setLastError func(kind errorKind, msg string)
	lastKind     errorKind
	lastErr      string
}

func newLibrary() *library {
	l := &library{fractions: map[int]float64{}, labels: map[int]caching.TraceLabels{}, warned: map[string]bool{}, badInput: map[string]int64{}}
	// Callers hold l.mu or are alone.
	l.setLastError = func(kind errorKind, msg string) { l.lastKind, l.lastErr = kind, msg }
	return l
}

// configure sets the configuration before initialisation, replacing
// GOALLOC_CONF. After devices exist it is an error: their caches are built.
func (l *library) configure(conf string) error {
	cfg, err := caching.ParseConfig(conf)
	if err != nil {
		return l.fail(withKind(errBadConfig, err))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range l.devices {
		if l.devices[i].Load() != nil {
			return l.failLocked(withKind(errTooLate, errors.New("goalloc: configure after the first allocation; set the configuration before any tensor is made")))
		}
	}
	l.cfg, l.configured = cfg, true
	if l.initErr != nil {
		l.initialized, l.initErr = false, nil // a bad GOALLOC_CONF is overridden: try again
	}
	return nil
}

// init is goalloc_init: it reads the environment and finds the devices.
// Called by torch with its device count; called lazily by the first
// allocation if torch did not. A negative count is refused before and
// after initialisation alike: afterwards it would change nothing, but
// goalloc_init_checked must not answer it with success.
func (l *library) init(torchCount int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if torchCount < 0 {
		return l.badLocked("invalid_argument", fmt.Sprintf("goalloc: init with a device count of %d; give torch's count, or 0 to use every device", torchCount))
	}
	return l.initLocked(torchCount)
}

// initLocked initialises the library once, with torch's device count
// (0: every device); l.mu is held and torchCount is not negative.
func (l *library) initLocked(torchCount int) error {
	if !l.initialized {
		l.initialized = true
		l.initErr = l.setup(torchCount)
		if l.initErr != nil {
			warnings.print(l.initErr.Error())
		}
	}
	if l.initErr != nil {
		// Every call that fails for it says why, on whatever thread.
		l.setLastError(kindOf(l.initErr), l.initErr.Error())
	}
	return l.initErr
}

func (l *library) setup(torchCount int) error {
	if !l.configured {
		cfg, err := caching.ParseConfig(getenv("GOALLOC_CONF"))
		if err != nil {
			return withKind(errBadConfig, fmt.Errorf("goalloc: not initialised: %v", err))
		}
		l.cfg = cfg
	}
	l.kind = getenv("GOALLOC_DEVICE")
	switch l.kind {
	case "", "cuda":
		l.kind = "cuda"
		n, err := arena.CUDADeviceCount()
		if err != nil {
			return withKind(errFailed, fmt.Errorf("goalloc: not initialised: no CUDA device: %v (set GOALLOC_DEVICE=sim to run on the simulated device)", err))
		}
		l.count = n
	case "sim":
		l.count = 8
		if v := getenv("GOALLOC_SIM_DEVICES"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > maxDevices {
				return withKind(errBadConfig, fmt.Errorf("goalloc: not initialised: GOALLOC_SIM_DEVICES=%q is not a device count in [1, %d]", v, maxDevices))
			}
			l.count = n
		}
		l.simMemory = arena.DefaultSimMemory
		if v := getenv("GOALLOC_SIM_MEMORY"); v != "" {
			n, err := units.ParseBytes(v)
			if err == nil {
				err = arena.CheckSimMemory(n)
			}
			if err != nil {
				return withKind(errBadConfig, fmt.Errorf("goalloc: not initialised: GOALLOC_SIM_MEMORY=%q: %v", v, err))
			}
			l.simMemory = n
		}
	default:
		return withKind(errBadConfig, fmt.Errorf("goalloc: not initialised: GOALLOC_DEVICE=%q; use cuda or sim", l.kind))
	}
	if torchCount > 0 && torchCount < l.count {
		l.count = torchCount // torch may see fewer (CUDA_VISIBLE_DEVICES)
	}
	return nil
}

// device returns the allocator of device d, making it on first use.
func (l *library) device(d int) (*caching.Allocator, error) {
	if d >= 0 && d < maxDevices {
		if a := l.devices[d].Load(); a != nil {
			return a, nil
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.initLocked(0); err != nil {
		return nil, err
	}
	if err := l.noDeviceLocked(d); err != nil {
		return nil, err
	}
	if a := l.devices[d].Load(); a != nil {
		return a, nil
	}
	dev, err := arena.NewDevice(l.cfg.DeviceSpec(l.kind, l.simMemory), d)
	if err != nil {
		return nil, l.setupFailedLocked(fmt.Errorf("goalloc: device %d: %w", d, err))
	}
	if p, ok := dev.(interface{ PeersGranted() ([]int, error) }); ok {
		if _, err := p.PeersGranted(); err != nil {
			// The device works; only copies to and from peers will fail.
			fmt.Fprintf(os.Stderr, "goalloc: warning: %v\n", err)
		}
	}
	a, err := caching.New(dev, l.cfg)
	if err != nil {
		_ = dev.Close()
		return nil, l.setupFailedLocked(err)
	}
	if f, ok := l.fractions[d]; ok {
		_ = a.SetFraction(f)
	}
	if lb, ok := l.labels[d]; ok {
		a.SetTraceLabels(lb)
	}
	if l.history.MaxEntries > 0 {
		a.RecordHistoryWith(l.history)
	}
	if l.tagsUsed.Load() {
		a.SetTagsInUse()
	}
	l.devices[d].Store(a)
	return a, nil
}

// setupFailedLocked reports a device that could not be made. It is printed
// every time, like an out-of-memory: the call that needed the device fails
// (an allocation, for torch a NULL it says nothing useful about), and the
// next one tries again.
func (l *library) setupFailedLocked(err error) error {
	warnings.print(fmt.Sprintf("%v (the device is not set up; the call fails)", err))
	return l.failLocked(err)
}

// missingDeviceLocked is the one rule of which devices exist: nil if
// device d does, else the error that says it does not. The library is
// initialised.
func (l *library) missingDeviceLocked(d int) *caching.InputError {
	if d >= 0 && d < l.count {
		return nil
	}
	return &caching.InputError{Kind: "bad_device", Msg: fmt.Sprintf("device %d does not exist (%d %s devices: 0 to %d)", d, l.count, l.kind, l.count-1)}
}

// noDeviceLocked refuses a call on a device that does not exist, counting
// it as bad input; nil if the device exists.
func (l *library) noDeviceLocked(d int) error {
	if e := l.missingDeviceLocked(d); e != nil {
		return l.badLocked(e.Kind, e.Error())
	}
	return nil
}

// deviceExists is goalloc_check_device: whether device d exists, as a
// question rather than a use, so not counted or warned of as bad input.
// The Python package asks it before it uses a device, so that the rule
// has one home and a user's mistake is an exception, not also a warning.
func (l *library) deviceExists(d int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.initLocked(0); err != nil {
		return err
	}
	if e := l.missingDeviceLocked(d); e != nil {
		return l.failLocked(e)
	}
	return nil
}

// existing returns the allocators made so far, by device.
func (l *library) existing() map[int]*caching.Allocator {
	out := map[int]*caching.Allocator{}
	for i := range l.devices {
		if a := l.devices[i].Load(); a != nil {
			out[i] = a
		}
	}
	return out
}

// malloc is goalloc_malloc. It returns 0 on failure, having said why on stderr.
func (l *library) malloc(size int64, d int, s uintptr) uintptr {
	if size < 0 {
		l.bad("negative_size", fmt.Sprintf("goalloc: malloc of a negative size (%d) on device %d", size, d))
		return 0
	}
	a, err := l.device(d)
	if err != nil {
		return 0
	}
	p, err := a.MallocTagged(l.allocTag(), uint64(size), arena.Stream(s))
	if err != nil {
		l.report(err)
		return 0
	}
	return p
}

// free is my_free.
func (l *library) free(p uintptr, size int64, d int, s uintptr) {
	if size < 0 {
		l.warn("negative_size", fmt.Sprintf("goalloc: free of %#x with a negative size (%d) on device %d; freed by pointer", p, size, d))
		size = 0
	}
	if p == 0 {
		// free(NULL) is a no-op in C; counted, since torch never does it.
		l.bad("null_pointer", fmt.Sprintf("goalloc: free of a NULL pointer on device %d; ignored", d))
		return
	}
	a := l.existingDevice(d)
	if a == nil {
		l.bad("unknown_pointer", fmt.Sprintf("goalloc: free of %#x on device %d, where goalloc allocated nothing", p, d))
		return
	}
	if err := a.Free(p, uint64(size), arena.Stream(s)); err != nil {
		l.report(err)
	}
}

func (l *library) existingDevice(d int) *caching.Allocator {
	if d < 0 || d >= maxDevices {
		return nil
	}
	return l.devices[d].Load()
}

// recordStream is goalloc_record_stream: torch gives no device, so the
// pointer is looked up on every device made so far.
func (l *library) recordStream(p uintptr, s uintptr) error {
	if p == 0 {
		return l.bad("null_pointer", "goalloc: record_stream of a NULL pointer")
	}
	// Find the device first: asking every device would count a pointer of
	// device 1 as bad input on device 0.
	for _, a := range l.existing() {
		if a.Holds(p) {
			return l.reportErr(a.RecordStream(p, arena.Stream(s)))
		}
	}
	return l.bad("unknown_pointer", fmt.Sprintf("goalloc: record_stream of %#x, which goalloc did not allocate", p))
}

// emptyCache is goalloc_empty_cache: every device made so far.
func (l *library) emptyCache() error { return l.emptyCacheCtx(0) }

// emptyCacheCtx is emptyCache for a call whose context id is ctx (0: none).
func (l *library) emptyCacheCtx(ctx uint64) error {
	var errs []error
	for _, a := range l.existing() {
		errs = append(errs, a.EmptyCacheCtx(ctx))
	}
	return l.fail(errors.Join(errs...))
}

// setFraction is goalloc_set_memory_fraction. The fraction is recorded and
// applied under l.mu, so that the one recorded (what config() and
// get_per_process_memory_fraction read) is the one in force, however
// threads race to set it.
func (l *library) setFraction(f float64, d int) error {
	if err := caching.CheckFraction(f); err != nil {
		return l.bad("invalid_fraction", fmt.Sprintf("goalloc: device %d: memory fraction %v", d, err))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.initLocked(0); err != nil {
		return err
	}
	if err := l.noDeviceLocked(d); err != nil {
		return err
	}
	l.fractions[d] = f
	if a := l.devices[d].Load(); a != nil {
		return l.reportErr(a.SetFraction(f))
	}
	return nil
}

// recordHistory turns history recording on (entries > 0) or off on every
// device, present and future, starting afresh.
func (l *library) recordHistory(entries int) error {
	return l.recordHistoryWith(entries, nil, true)
}

// recordHistoryWith turns history recording on (entries > 0) or off on
// every device, present and future, not recording the actions named in
// skip, and dropping what was recorded if clear (caching.HistoryOptions).
func (l *library) recordHistoryWith(entries int, skip []string, clear bool) error {
	if entries < 0 || entries > caching.MaxHistoryEntries {
		return l.bad("invalid_argument", fmt.Sprintf("goalloc: history of %d entries (max_entries); give 0 (off) to %d", entries, caching.MaxHistoryEntries))
	}
	set, err := caching.ParseActions(skip)
	if err != nil {
		return l.bad("invalid_argument", "goalloc: skip_actions: "+err.Error())
	}
	o := caching.HistoryOptions{MaxEntries: entries, Skip: set, Clear: clear}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.history = o
	for _, a := range l.existing() {
		a.RecordHistoryWith(o)
	}
	return nil
}

// setTraceLabels sets device d's trace labels, now if the device is made,
// else when it is.
func (l *library) setTraceLabels(d int, lb caching.TraceLabels) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.initLocked(0); err != nil {
		return err
	}
	if err := l.noDeviceLocked(d); err != nil {
		return err
	}
	l.labels[d] = lb
	if a := l.devices[d].Load(); a != nil {
		a.SetTraceLabels(lb)
	}
	return nil
}

// report prints err: every out-of-memory (one line each, the allocator's
// only chance to explain a NULL to the user) and the first of each kind of
// bad input. The calling thread's last error becomes err's message, unless
// err is only warnings (the call was done all the same): a warning never
// replaces the error of a failed call.
func (l *library) report(err error) {
	var oom *caching.OOMError
	if errors.As(err, &oom) {
		// PyTorch's words open the message; on stderr it says whose it is.
		warnings.print("goalloc: " + err.Error())
		_ = l.fail(err)
		return
	}
	if ies := caching.InputErrors(err); len(ies) > 0 {
		l.mu.Lock()
		defer l.mu.Unlock()
		refused := ""
		for _, ie := range ies {
			l.warnLocked(ie.Kind, ie.Error())
			if !ie.Handled && refused == "" {
				refused = ie.Error()
			}
		}
		if refused != "" {
			l.setLastError(errBadArgument, refused)
		}
		return
	}
	_ = l.fail(err)
	warnings.print(err.Error())
}

// bad counts and reports bad input caught before any device is involved:
// the call is refused.
func (l *library) bad(kind, msg string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.badLocked(kind, msg)
}

func (l *library) badLocked(kind, msg string) error {
	l.badInput[kind]++
	l.warnLocked(kind, msg)
	l.setLastError(errBadArgument, msg)
	return &caching.InputError{Kind: kind, Msg: strings.TrimPrefix(msg, "goalloc: ")}
}

// warn counts and reports bad input the call handled all the same; the
// last error stays what it was.
func (l *library) warn(kind, msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.badInput[kind]++
	l.warnLocked(kind, msg)
}

// warnLocked prints the first message of each kind of bad input.
func (l *library) warnLocked(kind, msg string) {
	if l.warned[kind] || (l.cfg.Quiet && l.initialized) {
		return
	}
	l.warned[kind] = true
	warnings.warn(kind, fmt.Sprintf("%s (goalloc warns once per kind; counter goalloc.bad_input.%s)", msg, kind))
}

func (l *library) fail(err error) error {
	if err == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.failLocked(err)
}

func (l *library) failLocked(err error) error {
	l.setLastError(kindOf(err), err.Error())
	return err
}

// lastError is the last error of a library made by a Go test (the C ABI's
// goalloc_last_error reads the calling thread's, in C).
func (l *library) lastError() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lastErr
}

// lastErrorKind is the kind of lastError.
func (l *library) lastErrorKind() errorKind {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lastKind
}

// badInputCounts is a copy of the library-level counters.
func (l *library) badInputCounts() map[string]int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]int64, len(l.badInput))
	for k, v := range l.badInput {
		out[k] = v
	}
	return out
}

// beginAllocateToPool, endAllocateToPool and releasePool are torch's CUDA
// graph hooks (caching/graphs.go).
func (l *library) beginAllocateToPool(d int, id caching.PoolID) error {
	a, err := l.device(d)
	if err != nil {
		return err
	}
	return l.reportErr(a.BeginAllocateToPool(id))
}

func (l *library) endAllocateToPool(d int, id caching.PoolID) error {
	a := l.existingDevice(d)
	if a == nil {
		return l.bad("invalid_pool", fmt.Sprintf("goalloc: end_allocate_to_pool on device %d, where goalloc holds nothing", d))
	}
	return l.reportErr(a.EndAllocateToPool(id))
}

func (l *library) releasePool(d int, id caching.PoolID) error {
	a := l.existingDevice(d)
	if a == nil {
		return l.bad("invalid_pool", fmt.Sprintf("goalloc: release_pool on device %d, where goalloc holds nothing", d))
	}
	return l.reportErr(a.ReleasePool(id))
}

// reportErr reports err, if any, and returns it.
func (l *library) reportErr(err error) error {
	if err != nil {
		l.report(err)
	}
	return err
}
