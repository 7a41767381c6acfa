package main

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// simLibrary is a fresh library on simulated devices, apart from the
// process-wide one the C ABI uses.
func simLibrary(t *testing.T, devices string) *library {
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_DEVICES", devices)
	t.Setenv("GOALLOC_SIM_MEMORY", "8G")
	t.Setenv("GOALLOC_CONF", "quiet:true")
	l := newLibrary()
	require.NoError(t, l.init(0))
	return l
}

func stats(t *testing.T, l *library, d int) map[string]int64 {
	b, err := l.statsJSON(d)
	require.NoError(t, err)
	var m map[string]int64
	require.NoError(t, json.Unmarshal(b, &m))
	return m
}

func TestDevicesAreSeparatePools(t *testing.T) {
	l := simLibrary(t, "4")
	// Devices are made on first use only: a rank touches only its GPU.
	assert.Nil(t, l.existingDevice(2))
	p := l.malloc(1<<20, 2, 0)
	require.NotZero(t, p)
	assert.NotNil(t, l.existingDevice(2))
	assert.Nil(t, l.existingDevice(0))
	q := l.malloc(1<<20, 3, 0)
	require.NotZero(t, q)
	assert.EqualValues(t, 1<<20, stats(t, l, 2)["allocated_bytes.all.current"])
	assert.EqualValues(t, 1<<20, stats(t, l, 3)["allocated_bytes.all.current"])
	assert.Zero(t, stats(t, l, 0)["allocated_bytes.all.current"], "an untouched device reads zero")
	// Freeing on the wrong device does not touch the right one's block.
	l.free(p, 1<<20, 3, 0)
	assert.EqualValues(t, 1<<20, stats(t, l, 2)["allocated_bytes.all.current"])
	assert.EqualValues(t, 1, stats(t, l, 3)["goalloc.bad_input.unknown_pointer"])
	l.free(p, 1<<20, 2, 0)
	l.free(q, 1<<20, 3, 0)
	assert.Zero(t, stats(t, l, 2)["allocated_bytes.all.current"])
	assert.Zero(t, l.malloc(1, 4, 0), "device 4 does not exist")
	assert.Zero(t, l.malloc(1, -1, 0))
	assert.EqualValues(t, 2, stats(t, l, 0)["goalloc.bad_input.bad_device"])
}

func TestPerDeviceCaps(t *testing.T) {
	out := captureLibraryOutput(t)
	l := simLibrary(t, "2")
	// A cap set before the device is first used applies when it is made.
	require.NoError(t, l.setFraction(0.25, 1)) // 2 GiB of 8
	assert.Zero(t, l.malloc(3<<30, 1, 0), "over device 1's cap")
	p := l.malloc(3<<30, 0, 0)
	require.NotZero(t, p, "device 0 has no cap")
	assert.EqualValues(t, 1, stats(t, l, 1)["num_ooms"])
	assert.Zero(t, stats(t, l, 0)["num_ooms"])
	require.Len(t, out.lines(), 1)
	assert.Contains(t, out.lines()[0], "goalloc: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 1 has a total capacity of 8.00 GiB of which 8.00 GiB is free. goalloc on device 1: reserved 0 B (cap 2.00 GiB)")
	require.NoError(t, l.setFraction(0, 1), "0 is a cap, as in PyTorch")
	assert.Zero(t, l.malloc(512, 1, 0), "that refuses everything")
	require.Error(t, l.setFraction(-0.5, 0))
	require.Error(t, l.setFraction(1.5, 0))
	require.Error(t, l.setFraction(0.5, 7), "no device 7")
	l.free(p, 3<<30, 0, 0)
}

func TestConcurrentDevicesAndThreads(t *testing.T) {
	l := simLibrary(t, "4")
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			d := g % 4
			s := uintptr(0x100 * (g + 1))
			var live []uintptr
			for i := 0; i < 2000; i++ {
				if len(live) > 8 {
					l.free(live[0], int64(4096*(1+i%3)), d, s)
					live = live[1:]
				}
				p := l.malloc(int64(4096*(1+(i+1)%3)), d, s)
				if p == 0 {
					t.Error("malloc failed")
					return
				}
				live = append(live, p)
			}
			for _, p := range live {
				l.free(p, 0, d, s)
			}
		}(g)
	}
	wg.Wait()
	for d := 0; d < 4; d++ {
		require.NoError(t, l.existingDevice(d).CheckInvariants())
		assert.Zero(t, stats(t, l, d)["allocation.all.current"], "device %d", d)
	}
}

func TestBadConfigIsAnErrorAtInit(t *testing.T) {
	out := captureLibraryOutput(t)
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_CONF", "fraction:2")
	l := newLibrary()
	err := l.init(0)
	require.ErrorContains(t, err, "fraction")
	assert.Zero(t, l.malloc(100, 0, 0), "no allocation with a bad configuration")
	assert.Contains(t, l.lastError(), "GOALLOC_CONF")
	t.Setenv("GOALLOC_DEVICE", "tpu")
	t.Setenv("GOALLOC_CONF", "")
	require.ErrorContains(t, newLibrary().init(0), "GOALLOC_DEVICE")
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_MEMORY", "lots")
	require.ErrorContains(t, newLibrary().init(0), "GOALLOC_SIM_MEMORY")
	t.Setenv("GOALLOC_SIM_MEMORY", "2048T") // 64 devices of it would not fit apart in 64 bits
	require.ErrorContains(t, newLibrary().init(0), "outside [1 MiB, 1 PiB]")
	assert.Equal(t, []string{
		"goalloc: not initialised: GOALLOC_CONF: fraction: 2 is outside [0, 1] (cap on reserved memory as a share of the device, in (0, 1]; no cap without it)",
		`goalloc: not initialised: GOALLOC_DEVICE="tpu"; use cuda or sim`,
		`goalloc: not initialised: GOALLOC_SIM_MEMORY="lots": "lots" is not a byte size`,
		`goalloc: not initialised: GOALLOC_SIM_MEMORY="2048T": 2251799813685248 bytes is outside [1 MiB, 1 PiB]`,
	}, out.lines(), "each initialisation error is printed once")
}

func TestConfigureBeforeAndAfterUse(t *testing.T) {
	out := captureLibraryOutput(t)
	l := simLibrary(t, "1")
	require.Error(t, l.configure("bogus:1"))
	require.NoError(t, l.configure("fraction:0.5"))
	p := l.malloc(5<<30, 0, 0)
	assert.Zero(t, p, "over the configured cap of 4 GiB")
	assert.Contains(t, out.lines()[0], "goalloc: CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of 8.00 GiB")
	require.ErrorContains(t, l.configure("fraction:0.9"), "before any tensor")
}

func TestGraphHooksNeedAKnownPool(t *testing.T) {
	l := simLibrary(t, "1")
	require.Error(t, l.endAllocateToPool(0, [2]uint64{1, 1}), "nothing on the device yet")
	require.NoError(t, l.beginAllocateToPool(0, [2]uint64{1, 1}))
	require.NoError(t, l.endAllocateToPool(0, [2]uint64{1, 1}))
	require.NoError(t, l.releasePool(0, [2]uint64{1, 1}))
	require.Error(t, l.releasePool(0, [2]uint64{1, 1}), "released twice")
}

// record_stream names no device: the pointer's own device takes it, and no
// other device counts it as bad input.
func TestRecordStreamFindsTheDevice(t *testing.T) {
	l := simLibrary(t, "2")
	require.NotZero(t, l.malloc(1<<20, 0, 0)) // device 0 exists and holds other memory
	p := l.malloc(1<<20, 1, 0x10)
	require.NotZero(t, p)
	require.NoError(t, l.recordStream(p, 0x20))
	assert.Zero(t, stats(t, l, 0)["goalloc.bad_input.unknown_pointer"])
	assert.Zero(t, stats(t, l, 1)["goalloc.bad_input.unknown_pointer"])
	l.free(p, 1<<20, 1, 0x10)
	assert.EqualValues(t, 1, stats(t, l, 1)["goalloc.deferred_frees"], "the free waited for stream 0x20")
	require.Error(t, l.recordStream(0xdead000, 0x20))
	assert.EqualValues(t, 1, stats(t, l, 0)["goalloc.bad_input.unknown_pointer"], "counted once, at the library")
}

// A fraction so small that it rounds to 0 bytes is still a cap, whichever
// way it arrives, and a fraction set before the device exists shows in
// the configuration.
func TestTinyFractionIsACapThroughTheLibrary(t *testing.T) {
	captureLibraryOutput(t) // the lines it provokes are expected
	l := simLibrary(t, "2")
	require.NoError(t, l.setFraction(5e-324, 0)) // before device 0 exists
	var cfg struct {
		Fractions map[string]float64 `json:"fractions"`
	}
	b, err := l.configJSON()
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &cfg))
	assert.Equal(t, 5e-324, cfg.Fractions["0"], "the pending fraction is shown")
	assert.Zero(t, l.malloc(1<<30, 0, 0), "a 1 GiB allocation under a 5e-324 cap")
	require.NotZero(t, l.malloc(1<<20, 1, 0))
	require.NoError(t, l.setFraction(1e-12, 1)) // on a device that exists
	assert.Zero(t, l.malloc(1<<30, 1, 0))

	t.Setenv("GOALLOC_CONF", "fraction:1e-11")
	l2 := newLibrary()
	require.NoError(t, l2.init(0))
	assert.Zero(t, l2.malloc(1<<30, 0, 0), "fraction:1e-11 in GOALLOC_CONF")
}

// An impossible configuration is refused when it is read, naming both
// keys; and a device that cannot be set up says so on stderr.
func TestImpossibleConfigurationIsRefused(t *testing.T) {
	captureLibraryOutput(t) // the lines it provokes are expected
	l := simLibrary(t, "1")
	err := l.configure("reserve:0.5,fraction:0.25")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "reserve")
	assert.Contains(t, err.Error(), "fraction")

	t.Setenv("GOALLOC_CONF", "reserve:0.5,fraction:0.25")
	l = newLibrary()
	require.ErrorContains(t, l.init(0), "reserve:0.5 is above fraction:0.25")

	// The pre-warm of 0.9 of a 1 MiB device rounds up to 2 MiB: the
	// device cannot be made, and every attempt says why.
	t.Setenv("GOALLOC_CONF", "reserve:0.9")
	t.Setenv("GOALLOC_SIM_MEMORY", "1M")
	out := captureLibraryOutput(t)
	l = newLibrary()
	assert.Zero(t, l.malloc(1, 0, 0))
	assert.Contains(t, out.b.String(), "pre-warming")
}

// The last error is that of the last call that failed: a call done all the
// same with a warning (a free with the wrong size) does not replace it.
func TestWarningDoesNotReplaceTheLastError(t *testing.T) {
	captureLibraryOutput(t) // the lines it provokes are expected
	l := simLibrary(t, "1")
	p := l.malloc(1000, 0, 0x10)
	require.NotZero(t, p)
	assert.Zero(t, l.malloc(-1, 0, 0x10))
	l.free(p, 999, 0, 0x20) // wrong size and wrong stream: freed by pointer
	assert.Contains(t, l.lastError(), "malloc of a negative size")
	st := stats(t, l, 0)
	assert.EqualValues(t, 1, st["goalloc.bad_input.size_mismatch"])
	assert.EqualValues(t, 1, st["goalloc.bad_input.stream_mismatch"])
	assert.Zero(t, st["allocation.all.current"])
}

// goalloc_init with a negative device count is bad input, not a success.
func TestInitWithANegativeCountIsRefused(t *testing.T) {
	captureLibraryOutput(t) // the lines it provokes are expected
	t.Setenv("GOALLOC_DEVICE", "sim")
	l := newLibrary()
	require.Error(t, l.init(-5))
	assert.Contains(t, l.lastError(), "device count of -5")
	require.NoError(t, l.init(0), "the refused call initialised nothing")
}

// The history ring is bounded so that a snapshot of it fits in memory.
func TestHistoryIsBounded(t *testing.T) {
	captureLibraryOutput(t) // the lines it provokes are expected
	l := simLibrary(t, "1")
	require.Error(t, l.recordHistory(caching.MaxHistoryEntries+1))
	require.Error(t, l.recordHistory(1<<26))
	require.NoError(t, l.recordHistory(caching.MaxHistoryEntries))
	require.NoError(t, l.recordHistory(0))
}

// No entry point counts a call before goalloc_init (it initialises from the
// environment): the allocation path used to count it and the others not.
func TestNoEntryPointCountsACallBeforeInit(t *testing.T) {
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_DEVICES", "1")
	t.Setenv("GOALLOC_CONF", "")
	out := captureLibraryOutput(t)
	l := newLibrary()
	p := l.malloc(1000, 0, 0)
	require.NotZero(t, p)
	l.free(p, 1000, 0, 0)
	for k, v := range stats(t, l, 0) {
		if strings.HasPrefix(k, "goalloc.bad_input.") {
			assert.Zero(t, v, k)
		}
	}
	assert.Empty(t, out.b.String())
}

// The fraction the library records (config's "fractions", what
// get_per_process_memory_fraction reads) and the cap in force agree, however
// two threads race to set it.
func TestConcurrentFractionsAgreeWithTheCap(t *testing.T) {
	l := simLibrary(t, "1")
	require.NotZero(t, l.malloc(512, 0, 0)) // the device exists: setFraction applies it at once
	a := l.existingDevice(0)
	require.NotNil(t, a)
	for round := 0; round < 200000; round++ {
		var wg sync.WaitGroup
		for _, f := range []float64{0.25, 0.75} {
			wg.Add(1)
			go func(f float64) {
				defer wg.Done()
				_ = l.setFraction(f, 0)
			}(f)
		}
		wg.Wait()
		l.mu.Lock()
		recorded := l.fractions[0]
		l.mu.Unlock()
		want := uint64(recorded * float64(a.Total()))
		if got := a.Limit(); got != want {
			t.Fatalf("round %d: the recorded fraction %v means a cap of %d bytes, but %d is in force", round, recorded, want, got)
		}
	}
}
