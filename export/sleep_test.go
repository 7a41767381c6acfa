package main

import (
	"bytes"
	"encoding/json"
	"math/rand"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sleepLibrary makes the C ABI's library a fresh one on two simulated
// devices of 8 GiB (conf: GOALLOC_CONF), on this goroutine's OS thread,
// whose memory tag it clears now and at the end.
func sleepLibrary(t *testing.T, conf string) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	abiLibrary(t)
	t.Setenv("GOALLOC_CONF", conf)
	setThreadTag(0)
	t.Cleanup(func() { setThreadTag(0) })
}

// setTag is goalloc_set_memory_tag of name ("" untagged).
func setTag(t *testing.T, name string) {
	t.Helper()
	c := cString(name)
	defer goalloc_string_free(c)
	require.Zero(t, goalloc_set_memory_tag(c))
}

// callJSON decodes what a call returned, which must not be NULL.
func callJSON(t *testing.T, p *cChar) map[string]any {
	t.Helper()
	require.NotNil(t, p, "failed: %s", lastErrorText())
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(takeString(p)), &m))
	return m
}

func lastErrorText() string { _, msg := lastError(); return msg }

func sleepC(device cInt, offload string) *cChar {
	c := cString(offload)
	defer goalloc_string_free(c)
	return goalloc_sleep(device, c)
}

func wakeC(device cInt, tags string) *cChar {
	c := cString(tags)
	defer goalloc_string_free(c)
	return goalloc_wake_up(device, c)
}

// simDevice is device d's simulated VMM device.
func simDevice(t *testing.T, d int) *arena.SimVMM {
	a := lib.existingDevice(d)
	require.NotNil(t, a)
	dev, ok := a.Device().(*arena.SimVMM)
	require.True(t, ok)
	return dev
}

// Through the C ABI, as PyTorch's pluggable path (goalloc_malloc) and
// goalloc's C++ class (goalloc_pool_malloc_ctx) reach it: the thread's tag
// places each allocation, sleep releases the tags' memory (memory_reserved
// drops), wake brings the offloaded tag back byte for byte at its address.
func TestSleepAndWakeThroughTheCABI(t *testing.T) {
	sleepLibrary(t, "vmm_handle:2M")
	setTag(t, "weights")
	assert.Equal(t, "weights", takeString(goalloc_memory_tag()))
	w := goalloc_malloc(64<<20, 0, nil)
	setTag(t, "kv")
	kv := goalloc_pool_malloc_ctx(32<<20, 0, 0, nil, 0, 0, 0, nil, nil)
	setTag(t, "")
	u := goalloc_malloc(16<<20, 0, nil)
	require.NotNil(t, w)
	require.NotNil(t, kv)
	require.NotNil(t, u)
	cookie := make([]byte, 64<<20)
	rand.New(rand.NewSource(1)).Read(cookie)
	require.NoError(t, simDevice(t, 0).Phys().Write(uintptr(w), cookie))
	st := callJSON(t, goalloc_sleep_state_json(0))
	tags := st["tags"].(map[string]any)
	assert.EqualValues(t, 64<<20, tags["weights"].(map[string]any)["reserved_bytes"])
	assert.EqualValues(t, 32<<20, tags["kv"].(map[string]any)["reserved_bytes"])
	before := goalloc_stat(0, cInt(caching.ScalarReservedBytes))

	res := callJSON(t, sleepC(-1, "weights"))
	assert.EqualValues(t, 64<<20, res["offloaded_bytes"])
	after := goalloc_stat(0, cInt(caching.ScalarReservedBytes))
	assert.EqualValues(t, before-after, res["released_bytes"], "memory_reserved drops by what was released")
	assert.EqualValues(t, 16<<20, after, "to the untagged live memory")
	assert.Equal(t, []any{float64(0)}, res["devices"])
	st = callJSON(t, goalloc_sleep_state_json(0))
	assert.ElementsMatch(t, []any{"weights", "kv"}, st["asleep"])
	assert.EqualValues(t, 64<<20, st["offloaded_bytes"])
	require.Zero(t, goalloc_check_invariants(0), lastErrorText())

	res = callJSON(t, wakeC(0, "kv"))
	assert.Equal(t, []any{"kv"}, res["woken"])
	res = callJSON(t, goalloc_wake_up(-1, nil))
	assert.Equal(t, []any{"weights"}, res["woken"])
	assert.EqualValues(t, 64<<20, res["restored_bytes"])
	got, err := simDevice(t, 0).Phys().Read(uintptr(w), 64<<20)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(cookie, got), "the weights came back at their address")
	assert.EqualValues(t, before, goalloc_stat(0, cInt(caching.ScalarReservedBytes)), "memory_reserved comes back")
	require.Zero(t, goalloc_check_invariants(0), lastErrorText())
	my_free(w, 64<<20, 0, nil)
	require.Zero(t, goalloc_free_ptr(kv))
	my_free(u, 16<<20, 0, nil)
}

// Each refusal has its kind and a message that says what to do, and
// changes nothing.
func TestSleepErrorsHaveTheirKinds(t *testing.T) {
	sleepLibrary(t, "vmm_handle:2M")
	wantFailed(t, errBadState, "nothing is asleep on any device: sleep first", func() { assert.Nil(t, goalloc_wake_up(-1, nil)) })
	wantFailed(t, errBadArgument, `memory tag "nobody" is unknown`, func() { assert.Nil(t, sleepC(-1, "nobody")) })
	setTag(t, "weights")
	p := goalloc_malloc(1<<30, 0, nil)
	require.NotNil(t, p)
	setTag(t, "")

	// During a capture.
	sim := simDevice(t, 0)
	sim.Sim.SetCapture(0xc0, arena.CaptureActive)
	goalloc_begin_allocate_to_pool(0, 0, 5, nil)
	wantFailed(t, errBadState, "during a CUDA graph capture", func() { assert.Nil(t, sleepC(0, "")) })
	goalloc_end_allocate_to_pool(0, 0, 5)
	sim.Sim.SetCapture(0xc0, arena.CaptureNone)

	callJSON(t, sleepC(0, ""))
	wantFailed(t, errBadState, `memory tags "weights" are asleep: wake_up them first`, func() { assert.Nil(t, sleepC(-1, "")) })
	// An allocation in the sleeping tag: NULL, and its kind.
	setTag(t, "weights")
	wantFailed(t, errBadState, "is asleep: wake_up it first", func() { assert.Nil(t, goalloc_malloc(1<<20, 0, nil)) })
	setTag(t, "")
	wantFailed(t, errBadState, `memory tags "kv" are not asleep`, func() { assert.Nil(t, wakeC(0, "kv")) })

	// Out of memory on wake: the tag stays asleep until memory is freed.
	u := goalloc_malloc(15<<29, 0, nil) // 7.5 GiB of 8: no room for the 1 GiB asleep
	require.NotNil(t, u, lastErrorText())
	wantFailed(t, errOutOfMemory, `wake_up of memory tag "weights"`, func() { assert.Nil(t, goalloc_wake_up(0, nil)) })
	st := callJSON(t, goalloc_sleep_state_json(0))
	assert.Equal(t, []any{"weights"}, st["asleep"])
	require.Zero(t, goalloc_check_invariants(0), lastErrorText())
	my_free(u, 15<<29, 0, nil)
	callJSON(t, goalloc_wake_up(0, nil))
	my_free(p, 1<<30, 0, nil)
	require.Zero(t, goalloc_check_invariants(0), lastErrorText())
}

// backend:async has no placement that could keep the addresses: sleep and
// wake say they need backend:vmm, before anything is done.
func TestSleepNeedsTheVMMBackend(t *testing.T) {
	sleepLibrary(t, "backend:async")
	wantFailed(t, errBadConfig, "need backend:vmm", func() { assert.Nil(t, goalloc_sleep(-1, nil)) })
	wantFailed(t, errBadConfig, "need backend:vmm", func() { assert.Nil(t, goalloc_wake_up(0, nil)) })
	setTag(t, "weights")
	p := goalloc_malloc(1<<20, 0, nil)
	assert.NotNil(t, p, "tagged allocations still work there")
	setTag(t, "")
	my_free(p, 1<<20, 0, nil)
}

// A tag is the OS thread's own: two threads tagging differently place
// their memory apart; once a tag is set anywhere, every device's front is
// off, also a device made later.
func TestMemoryTagsArePerThread(t *testing.T) {
	sleepLibrary(t, "vmm_handle:2M")
	f := (*[2]uint32)(goalloc_front_log(0))
	require.NotNil(t, f)
	assert.EqualValues(t, 1, f[1], "the front is on before any tag")
	var wg sync.WaitGroup
	for i, name := range []string{"a", "b", ""} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			setTag(t, name)
			defer setThreadTag(0)
			assert.NotNil(t, goalloc_malloc(cSSize(i+1)<<20, 0, nil))
		}()
	}
	wg.Wait()
	assert.Empty(t, takeString(goalloc_memory_tag()), "this thread set none")
	st := callJSON(t, goalloc_sleep_state_json(0))
	tags := st["tags"].(map[string]any)
	assert.EqualValues(t, 1<<20, tags["a"].(map[string]any)["reserved_bytes"])
	assert.EqualValues(t, 2<<20, tags["b"].(map[string]any)["reserved_bytes"])
	assert.Len(t, tags, 2, "the untagged thread's memory is in no tag")
	assert.EqualValues(t, 0, f[1], "tags turned the front off")
	g := (*[2]uint32)(unsafe.Pointer(goalloc_front_log(1)))
	require.NotNil(t, g)
	assert.EqualValues(t, 0, g[1], "and a device made later has it off")
	require.Zero(t, goalloc_check_invariants(0), lastErrorText())
	require.Zero(t, goalloc_check_invariants(1), lastErrorText())
}
