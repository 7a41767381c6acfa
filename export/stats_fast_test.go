package main

import (
	"encoding/json"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/require"
)

// requireFastEqualsJSON checks every figure of goalloc_stat and
// goalloc_stat_scalars against goalloc_stats_json's.
func requireFastEqualsJSON(t *testing.T, l *library, d int, msg string) {
	t.Helper()
	m := stats(t, l, d)
	out := make([]int64, caching.NumScalars)
	require.NoError(t, l.statScalars(d, out), msg)
	for k, key := range caching.ScalarKeys() {
		v, err := l.stat(d, k)
		require.NoError(t, err, msg)
		require.Equal(t, m[key], v, "%s: goalloc_stat %d (%s)", msg, k, key)
		require.Equal(t, m[key], out[k], "%s: goalloc_stat_scalars[%d] (%s)", msg, k, key)
	}
}

// The fast path and the JSON path give the same figures after a random
// sequence of the calls torch makes, on two devices.
func TestStatEqualsStatsJSONAfterRandomCalls(t *testing.T) {
	l := simLibrary(t, "3")
	rng := rand.New(rand.NewPCG(7, 8))
	type block struct {
		p    uintptr
		size int64
		d    int
	}
	var live []block
	for i := 0; i < 800; i++ {
		d := 1 + rng.IntN(2)
		switch r := rng.IntN(100); {
		case r < 45 || len(live) == 0:
			size := []int64{0, 100, 4000, 70000, 1 << 20, 3 << 20, 100 << 20, 1 << 30}[rng.IntN(8)]
			if p := l.malloc(size, d, uintptr(rng.IntN(3))); p != 0 {
				live = append(live, block{p, size, d})
			}
		case r < 90:
			j := rng.IntN(len(live))
			b := live[j]
			live = append(live[:j], live[j+1:]...)
			l.free(b.p, b.size, b.d, 0)
		case r < 93:
			require.NoError(t, l.emptyCacheDevice(d))
		case r < 95:
			require.NoError(t, l.resetPeak(d))
		case r < 97:
			require.NoError(t, l.resetAccumulated(d))
		default:
			require.NoError(t, l.setFraction(0.05+rng.Float64()*0.95, d))
		}
		for d := 0; d < 3; d++ {
			requireFastEqualsJSON(t, l, d, "")
		}
	}
}

func TestStatBadInput(t *testing.T) {
	l := simLibrary(t, "2")
	_, err := l.stat(2, 0)
	require.ErrorContains(t, err, "device 2 does not exist")
	_, err = l.stat(-1, 0)
	require.ErrorContains(t, err, "device -1 does not exist")
	_, err = l.stat(0, int(caching.NumScalars))
	require.ErrorContains(t, err, "statistic 4 does not exist")
	_, err = l.stat(0, -1)
	require.ErrorContains(t, err, "statistic -1 does not exist")
	require.ErrorContains(t, l.statScalars(5, make([]int64, 4)), "device 5 does not exist")
	// An untouched device reads zeros; a short buffer gets what fits.
	out := []int64{9, 9}
	require.NoError(t, l.statScalars(1, out))
	require.Equal(t, []int64{0, 0}, out)
	require.NoError(t, l.statScalars(1, nil))
	m := stats(t, l, 0)
	require.EqualValues(t, 3, m["goalloc.bad_input.bad_device"])
	require.EqualValues(t, 2, m["goalloc.bad_input.invalid_argument"])
}

// Reading a device in use takes neither the library's mutex nor (see
// caching's TestScalarsAreReadWithoutTheMutex) the allocator's.
func TestStatTakesNoLibraryLock(t *testing.T) {
	l := simLibrary(t, "2")
	p := l.malloc(5<<20, 1, 0)
	require.NotZero(t, p)
	l.mu.Lock()
	got := make(chan int64)
	go func() {
		v, _ := l.stat(1, int(caching.ScalarAllocatedBytes))
		out := make([]int64, caching.NumScalars)
		_ = l.statScalars(1, out)
		got <- v + out[caching.ScalarReservedBytes]
	}()
	select {
	case v := <-got:
		handles := (5<<20 + arena.DefaultVMMHandle - 1) / arena.DefaultVMMHandle * arena.DefaultVMMHandle
		require.EqualValues(t, 5<<20+handles, v, "allocated, and the whole handles the VMM device maps for it")
	case <-time.After(5 * time.Second):
		t.Fatal("goalloc_stat waited for the library's mutex")
	}
	l.mu.Unlock()
	l.free(p, 5<<20, 1, 0)
}

// The order is the C ABI's (stats_fast.go lists it); it only ever grows.
func TestStatKeysOrder(t *testing.T) {
	b, err := json.Marshal(caching.ScalarKeys())
	require.NoError(t, err)
	var keys []string
	require.NoError(t, json.Unmarshal(b, &keys))
	require.Equal(t, []string{"allocated_bytes.all.current", "allocated_bytes.all.peak",
		"reserved_bytes.all.current", "reserved_bytes.all.peak"}, keys)
}
