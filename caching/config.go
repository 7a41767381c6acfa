package caching

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/units"
)

// Config is what GOALLOC_CONF sets. The zero Config is not valid; start from
// DefaultConfig.
type Config struct {
	// Fraction caps reserved bytes at Fraction x total device memory; 0 means
	// no cap. set_per_process_memory_fraction overrides it per device.
	Fraction float64
	// Reserve is the share of the device's memory pre-warmed into the pool
	// when the device is first used, so early allocations find it ready.
	Reserve float64
	// ReleaseThreshold is how many unused bytes the driver pool keeps across
	// synchronisations (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD). Max by default:
	// the pool is our cache of last resort and must not shrink behind our back.
	ReleaseThreshold uint64
	// LargeCache bounds the bytes of free large blocks kept cached above the
	// pool (per device). Past it, the oldest cached blocks go back to the
	// pool, where any size can reuse them. See doc.go, "Cache policy". Its
	// default depends on the backend (largeCacheDefault).
	LargeCache uint64
	// MissRelease: before a large request that missed the cache goes to the
	// pool, give the pool the cached block it will reuse in place (the
	// smallest of at least the request's size), or the least recently freed
	// blocks adding up to the request. The cache then never makes the pool
	// grow while it sits on memory the request could have used.
	MissRelease bool
	// LargeSlack lets a cached large block serve a request up to this share
	// smaller than the block (0.0625: a 16 MiB block serves 15.06 MiB and up).
	LargeSlack float64
	// Quiet turns off goalloc's own warnings on stderr (OOM lines still print).
	Quiet bool
	// Backend is where device memory comes from: "vmm" (the default),
	// physical handles goalloc maps itself (arena's VMM device), or
	// "async", a private stream-ordered pool per device. vmm is the
	// default because it holds the least in training, at least as fast
	// (BENCHMARKS.md, "Training on one GPU").
	Backend string
	// VMM is how the vmm backend lays memory out: the size of its
	// physical handles.
	VMM arena.VMMLayout
	// Front lets goalloc's C++ class for PyTorch serve a freed block again
	// to a request of the same size and stream, and pass frees to Go in
	// batches, through a log shared with Go (front.go).
	Front bool
	// YieldEvery is how often a thread that calls into goalloc through its
	// C++ class for PyTorch yields to Go's scheduler (0, the default:
	// never), so that the thread keeps its Go processor between calls; see
	// export/sched.go, which says why it is off: on the GPU machine the
	// crossing into Go was cheap in training without it. It must be below
	// 10 ms, the staleness after which Go takes the processor.
	YieldEvery time.Duration
}

// maxYieldEvery bounds Config.YieldEvery: Go's sysmon takes a processor
// whose scheduling tick has not moved for 10 ms (the runtime's
// forcePreemptNS), so yielding less often than that keeps nothing.
const maxYieldEvery = 10 * time.Millisecond

// defaultBackend is Config.Backend with no GOALLOC_CONF (see Backend).
const defaultBackend = arena.BackendVMM

// DeviceSpec is the device c asks for: kind (arena.KindSim or
// arena.KindCUDA) with c's backend and VMM layout, and, for the simulated
// device, simMemory bytes (0: arena.DefaultSimMemory). The library and the
// replay tool make their devices with arena.NewDevice(c.DeviceSpec(...), d).
func (c Config) DeviceSpec(kind string, simMemory uint64) arena.DeviceSpec {
	return arena.DeviceSpec{Kind: kind, Backend: c.Backend, Layout: c.VMM, SimMemory: simMemory}
}

// DefaultConfig is the configuration with no GOALLOC_CONF.
func DefaultConfig() Config {
	return Config{
		ReleaseThreshold: math.MaxUint64,
		LargeCache:       largeCacheDefault(defaultBackend),
		MissRelease:      true,
		LargeSlack:       1.0 / 16,
		Backend:          defaultBackend,
		Front:            true,
	}
}

// confKeys documents every key ParseConfig takes, for error messages and the README.
var confKeys = map[string]string{
	"fraction":          "cap on reserved memory as a share of the device, in (0, 1]; no cap without it",
	"reserve":           "share of the device pre-warmed into the pool at first use, in [0, 1)",
	"release_threshold": "bytes the driver pool keeps when idle: a size (512M, 2G) or max",
	"large_cache":       "most bytes of free large blocks cached above the pool: a size or 0 (default 256M on backend:vmm, 0 on backend:async, whose pool caches for itself)",
	"miss_release":      "true to give cached memory back to the pool before a cache miss asks it for more",
	"large_slack":       "how much larger than a request a cached large block may be, in [0, 1)",
	"quiet":             "true to silence warnings (OOM lines still print)",
	"backend":           "where memory comes from: async (a stream-ordered pool) or vmm (handles goalloc maps)",
	"vmm_placement":     "retired: backend:vmm places every request in segments (one per stream, grown in place); segments is still taken, for old configurations, and changes nothing; ranges, the other placement, was removed",
	"front":             "true to let goalloc's C++ class for PyTorch reuse a freed block for the next request of its size and stream without calling Go, and pass frees to Go in batches",
	"yield_every":       "how often a thread calling goalloc's C++ class for PyTorch yields to Go's scheduler, a duration below 10ms such as 9ms, or 0 for never (the default)",
	"vmm_handle":        "the size of backend:vmm's physical handles, a power of two such as 4M, the default (raised to the device's granularity where smaller)",
}

// ConfigKeys lists the keys GOALLOC_CONF takes with what each means.
func ConfigKeys() map[string]string { return confKeys }

// ParseConfig reads a GOALLOC_CONF string: key:value pairs separated by
// commas, like PYTORCH_CUDA_ALLOC_CONF ("fraction:0.5,reserve:0.1"). Keys not
// given keep their defaults. An unknown key or a bad value is an error that
// names it; nothing is silently defaulted.
func ParseConfig(s string) (Config, error) {
	c := DefaultConfig()
	seen := map[string]bool{}
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, ":")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" || v == "" {
			return c, fmt.Errorf("GOALLOC_CONF: %q is not key:value", item)
		}
		if _, known := confKeys[k]; !known {
			return c, fmt.Errorf("GOALLOC_CONF: unknown key %q (known: %s)", k, knownKeys())
		}
		if seen[k] {
			return c, fmt.Errorf("GOALLOC_CONF: key %q given twice", k)
		}
		seen[k] = true
		var err error
		switch k {
		case "fraction":
			if c.Fraction, err = parseNumber(v); err == nil {
				if err = CheckFraction(c.Fraction); err == nil && c.Fraction == 0 {
					// Config.Fraction 0 means no cap; a cap of nothing is
					// set_per_process_memory_fraction(0.0)'s, at run time.
					err = fmt.Errorf("0 would refuse every allocation; leave fraction out for no cap")
				}
			}
		case "reserve":
			c.Reserve, err = parseShare(v, true, false)
		case "release_threshold":
			if v == "max" {
				c.ReleaseThreshold = math.MaxUint64
			} else {
				c.ReleaseThreshold, err = units.ParseBytes(v)
			}
		case "large_cache":
			c.LargeCache, err = units.ParseBytes(v)
		case "large_slack":
			c.LargeSlack, err = parseShare(v, true, false)
		case "quiet":
			c.Quiet, err = strconv.ParseBool(v)
		case "miss_release":
			c.MissRelease, err = strconv.ParseBool(v)
		case "front":
			c.Front, err = strconv.ParseBool(v)
		case "yield_every":
			c.YieldEvery, err = parseYieldEvery(v)
		case "backend":
			if v != arena.BackendAsync && v != arena.BackendVMM {
				err = fmt.Errorf("%q is neither async nor vmm", v)
			} else {
				c.Backend = v
			}
		case "vmm_placement":
			err = retiredPlacement(v)
		case "vmm_handle":
			if c.VMM.Handle, err = units.ParseBytes(v); err == nil && c.VMM.Handle == 0 {
				err = fmt.Errorf("a handle of 0 bytes")
			} else if err == nil {
				err = c.VMM.Check()
			}
		}
		if err != nil {
			return c, fmt.Errorf("GOALLOC_CONF: %s: %v (%s)", k, err, confKeys[k])
		}
	}
	if !seen["large_cache"] {
		c.LargeCache = largeCacheDefault(c.Backend)
	}
	if c.Fraction > 0 && c.Reserve > c.Fraction {
		// The pre-warm would have to pass the cap: the device could never
		// be set up, and every allocation would fail.
		return c, fmt.Errorf("GOALLOC_CONF: reserve:%g is above fraction:%g; the reserve is pre-warmed under the cap, so it must not exceed it", c.Reserve, c.Fraction)
	}
	return c, nil
}

// largeCacheDefault is large_cache when GOALLOC_CONF does not give it.
//
// backend:vmm caches up to 256 MiB of large blocks: a hit then skips the
// placement's Go work, and the placement keeps the device close to the live
// peak with it.
//
// backend:async caches none: the stream-ordered pool below already keeps
// what is freed to it (release threshold at maximum) and hands it to any
// size, while a block cached above it stays allocated from the pool's view
// and splits the pool's chunks, so that the pool's high-water mark grows
// with the layout the cached blocks made it take. Without the cache, a large
// request costs a cuMemAllocFromPoolAsync and its free a cuMemFreeAsync, as
// under torch's own cudaMallocAsync backend. BENCHMARKS.md, "Trace replay on
// the GPU", has both measured.
func largeCacheDefault(backend string) uint64 {
	if backend == "async" {
		return 0
	}
	return 256 << 20
}

// CheckFraction is the one rule for a memory fraction, wherever it comes
// from (GOALLOC_CONF's fraction, set_per_process_memory_fraction, Python):
// a share of the device's memory in [0, 1], as PyTorch takes it. 0 is a cap
// that refuses every allocation (fractionLimit).
func CheckFraction(f float64) error {
	if math.IsNaN(f) || f < 0 || f > 1 {
		return fmt.Errorf("%v is outside [0, 1]", f)
	}
	return nil
}

// fractionLimit is the cap in bytes for fraction f of total bytes. It is at
// least one byte: a limit of 0 means no cap, and a fraction of 0, or one so
// small that f x total rounds to 0, is still a cap, one that refuses
// everything.
func fractionLimit(f float64, total uint64) uint64 {
	return max(1, uint64(f*float64(total)))
}

func knownKeys() string {
	keys := make([]string, 0, len(confKeys))
	for k := range confKeys {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return strings.Join(keys, ", ")
}

// retiredPlacement checks vmm_placement, a key kept so that configurations
// that name the placement still read: segments, the one placement left, is
// taken (and changes nothing); ranges, retired, is refused, saying so.
func retiredPlacement(v string) error {
	switch v {
	case "segments":
		return nil
	case "ranges":
		return fmt.Errorf("the ranges placement was retired; backend:vmm places every request in segments, so drop vmm_placement:ranges")
	}
	return fmt.Errorf("%q is not a placement; the key is retired and takes only segments, the one placement left", v)
}

// parseYieldEvery parses yield_every: a Go duration in [0, 10ms).
func parseYieldEvery(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v) // takes "0" too
	if err != nil {
		return 0, fmt.Errorf("%q is not a duration such as 8ms", v)
	}
	if d < 0 || d >= maxYieldEvery {
		return 0, fmt.Errorf("%v is outside [0, %v) (0: never yield)", d, maxYieldEvery)
	}
	return d, nil
}

// parseShare parses a float in (0,1) with the ends allowed as asked.
func parseShare(v string, zeroOK, oneOK bool) (float64, error) {
	f, err := parseNumber(v)
	if err != nil {
		return 0, err
	}
	if f < 0 || f > 1 || (f == 0 && !zeroOK) || (f == 1 && !oneOK) {
		lo, hi := "(", ")"
		if zeroOK {
			lo = "["
		}
		if oneOK {
			hi = "]"
		}
		return 0, fmt.Errorf("%v is outside %s0, 1%s", f, lo, hi)
	}
	return f, nil
}

func parseNumber(v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(f) {
		return 0, fmt.Errorf("%q is not a number", v)
	}
	return f, nil
}

// String renders c back in GOALLOC_CONF syntax: ParseConfig(c.String())
// gives c again.
func (c Config) String() string {
	rt := "max"
	if c.ReleaseThreshold != math.MaxUint64 {
		rt = strconv.FormatUint(c.ReleaseThreshold, 10)
	}
	out := fmt.Sprintf("reserve:%g,release_threshold:%s,large_cache:%d,miss_release:%t,large_slack:%g,quiet:%t,backend:%s",
		c.Reserve, rt, c.LargeCache, c.MissRelease, c.LargeSlack, c.Quiet, c.Backend)
	// No cap has no value in GOALLOC_CONF (fraction:0 is refused): it is the
	// key left out.
	if c.Fraction != 0 {
		out = fmt.Sprintf("fraction:%g,", c.Fraction) + out
	}
	if !c.Front {
		out += ",front:false"
	}
	if c.YieldEvery != 0 {
		out += ",yield_every:" + strconv.FormatInt(int64(c.YieldEvery), 10) + "ns"
	}
	// The VMM layout when it is not the default.
	if c.VMM.Handle != 0 {
		out += ",vmm_handle:" + strconv.FormatUint(c.VMM.Handle, 10)
	}
	return out
}
