package main

import (
	"encoding/json"
	"sync"
	"testing"

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
	assert.Contains(t, out.lines()[0], "goalloc: out of memory on device 1: 3.00 GiB requested; cap 2.00 GiB")
	require.Error(t, l.setFraction(0, 0))
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
	assert.Equal(t, []string{
		"goalloc: not initialised: GOALLOC_CONF: fraction: 2 is outside (0, 1] (cap on reserved memory as a share of the device, in (0, 1])",
		`goalloc: not initialised: GOALLOC_DEVICE="tpu"; use cuda or sim`,
		`goalloc: not initialised: GOALLOC_SIM_MEMORY="lots" is not a size of at least 1M`,
	}, out.lines(), "each initialisation error is printed once")
}

func TestConfigureBeforeAndAfterUse(t *testing.T) {
	out := captureLibraryOutput(t)
	l := simLibrary(t, "1")
	require.Error(t, l.configure("bogus:1"))
	require.NoError(t, l.configure("fraction:0.5"))
	p := l.malloc(5<<30, 0, 0)
	assert.Zero(t, p, "over the configured cap of 4 GiB")
	assert.Contains(t, out.lines()[0], "goalloc: out of memory on device 0: 5.00 GiB requested; cap 4.00 GiB")
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
