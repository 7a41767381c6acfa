package main

import (
	"encoding/json"
	"go/build"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"unsafe"

	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The whole C ABI against NULL, negative and huge arguments: one row per
// //export function, called as C calls it (the exported functions are Go
// functions with C types, named through ctypes.go). Each row makes its bad
// calls and asserts what the function documents: a refusal (-1 or NULL,
// the calling thread's last error of the kind and message it should have,
// counted as bad input where it is bad input), or a NULL out-parameter
// skipped and the call done. No row may panic. After every row the library
// must still allocate, free and agree with itself (requireLibraryWorks).
// Every exported name of the files this build compiles must have a row.

// badDevices are device numbers no call may take: negative, one past the
// two simulated devices, one past the library's table (maxDevices), and
// the ends of C's int.
var badDevices = []cInt{-1, 2, maxDevices, math.MaxInt32, math.MinInt32}

// everyDeviceOrBad are the bad device numbers of a call that takes -1 for
// every device.
var everyDeviceOrBad = []cInt{-2, 2, maxDevices, math.MaxInt32, math.MinInt32}

// abiBuildTags are the build tags this test binary was built with, as far
// as the package's files depend on them: a test file built only under a
// tag adds it, with its rows (bench_test.go).
var abiBuildTags []string

// abiRows holds each exported function's bad calls.
var abiRows = map[string]func(t *testing.T){
	"goalloc_malloc": func(t *testing.T) {
		for _, size := range []cSSize{-1, math.MinInt64} {
			wantRefused(t, "negative_size", "negative size", func() { assert.Nil(t, goalloc_malloc(size, 0, nil)) })
		}
		wantFailed(t, errOutOfMemory, "out of memory", func() { assert.Nil(t, goalloc_malloc(math.MaxInt64, 0, nil)) })
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, goalloc_malloc(1, d, nil)) })
		}
	},
	"my_free": func(t *testing.T) {
		wantRefused(t, "null_pointer", "NULL pointer", func() { my_free(nil, 0, 0, nil) })
		p := goalloc_malloc(0, 0, nil) // requested 0: a size of 0 on free is no mismatch
		require.NotNil(t, p)
		for _, d := range badDevices {
			wantRefused(t, "unknown_pointer", "goalloc allocated nothing", func() { my_free(p, 0, d, nil) })
		}
		wantWarned(t, "negative_size", func() { my_free(p, -1, 0, nil) }) // freed by pointer
		q := goalloc_malloc(1000, 0, nil)
		require.NotNil(t, q)
		wantWarned(t, "size_mismatch", func() { my_free(q, math.MaxInt64, 0, nil) })
		assert.Zero(t, goalloc_stat(0, cInt(caching.ScalarAllocatedBytes)), "both freed")
	},
	"goalloc_init": func(t *testing.T) {
		for _, n := range []cInt{-1, math.MinInt32} {
			wantRefused(t, "invalid_argument", "device count of", func() { goalloc_init(n) })
		}
		wantAccepted(t, func() { goalloc_init(math.MaxInt32) }) // more than there are: every device
		assert.EqualValues(t, 2, goalloc_device_count())
		wantRefused(t, "invalid_argument", "device count of -1", func() { goalloc_init(-1) })
	},
	"goalloc_init_checked": func(t *testing.T) {
		wantRefused(t, "invalid_argument", "device count of", func() { assert.EqualValues(t, -1, goalloc_init_checked(math.MinInt32)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_init_checked(math.MaxInt32)) })
		// Initialised, the library still does not answer a negative count with success.
		wantRefused(t, "invalid_argument", "device count of -1", func() { assert.EqualValues(t, -1, goalloc_init_checked(-1)) })
	},
	"goalloc_empty_cache": func(t *testing.T) {
		wantAccepted(t, func() { goalloc_empty_cache() })
	},
	"goalloc_set_memory_fraction": func(t *testing.T) {
		for _, f := range badFractions() {
			wantRefused(t, "invalid_fraction", "memory fraction", func() { goalloc_set_memory_fraction(f, 0) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { goalloc_set_memory_fraction(0.5, d) })
		}
		assert.Empty(t, configOf(t)["fractions"], "no fraction was recorded")
	},
	"goalloc_set_fraction": func(t *testing.T) {
		for _, f := range badFractions() {
			wantRefused(t, "invalid_fraction", "memory fraction", func() { assert.EqualValues(t, -1, goalloc_set_fraction(0, f)) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_set_fraction(d, 0.5)) })
		}
		assert.Empty(t, configOf(t)["fractions"], "no fraction was recorded")
	},
	"goalloc_record_stream": func(t *testing.T) {
		wantRefused(t, "null_pointer", "NULL pointer", func() { goalloc_record_stream(nil, nil) })
		wantRefused(t, "unknown_pointer", "did not allocate", func() { goalloc_record_stream(devicePointer(0x1234), nil) })
		p := goalloc_malloc(1000, 0, nil)
		require.NotNil(t, p)
		wantAccepted(t, func() { goalloc_record_stream(p, nil) }) // NULL: the default stream
		my_free(p, 1000, 0, nil)
	},
	"goalloc_begin_allocate_to_pool": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { goalloc_begin_allocate_to_pool(d, 0, 7, nil) })
		}
		// A NULL filter: goalloc never calls it.
		wantAccepted(t, func() { goalloc_begin_allocate_to_pool(0, math.MaxUint64, math.MaxUint64, nil) })
		wantAccepted(t, func() { goalloc_end_allocate_to_pool(0, math.MaxUint64, math.MaxUint64) })
		wantAccepted(t, func() { goalloc_release_pool(0, math.MaxUint64, math.MaxUint64) })
	},
	"goalloc_end_allocate_to_pool": func(t *testing.T) {
		for _, d := range append(badDevices, 0, 1) { // 0 and 1 exist, but goalloc holds nothing there yet
			wantRefused(t, "invalid_pool", "where goalloc holds nothing", func() { goalloc_end_allocate_to_pool(d, 0, 7) })
		}
	},
	"goalloc_release_pool": func(t *testing.T) {
		for _, d := range append(badDevices, 0, 1) {
			wantRefused(t, "invalid_pool", "where goalloc holds nothing", func() { goalloc_release_pool(d, 0, 7) })
		}
	},
	"goalloc_configure": func(t *testing.T) {
		t.Setenv("GOALLOC_CONF", "fraction:0.5")
		wantRefused(t, "null_pointer", "goalloc_configure: conf is NULL", func() { assert.EqualValues(t, -1, goalloc_configure(nil)) })
		// GOALLOC_CONF is still the configuration: its cap of 4 GiB holds.
		wantFailed(t, errOutOfMemory, "out of memory", func() { assert.Nil(t, goalloc_malloc(5<<30, 0, nil)) })
		bogus := cString("bogus:1")
		defer goalloc_string_free(bogus)
		wantFailed(t, errBadConfig, "bogus", func() { assert.EqualValues(t, -1, goalloc_configure(bogus)) })
	},
	"goalloc_check_device": func(t *testing.T) {
		for _, d := range badDevices { // a question: not counted as bad input
			wantFailed(t, errBadArgument, "does not exist", func() { assert.EqualValues(t, -1, goalloc_check_device(d)) })
		}
		wantAccepted(t, func() { assert.Zero(t, goalloc_check_device(1)) })
	},
	"goalloc_device_count": func(t *testing.T) {
		wantAccepted(t, func() { assert.EqualValues(t, 2, goalloc_device_count()) })
	},
	"goalloc_stats_json":         jsonRow(goalloc_stats_json, badDevices),
	"goalloc_fragmentation_json": jsonRow(goalloc_fragmentation_json, badDevices),
	// -1 is every device.
	"goalloc_snapshot_json": jsonRow(goalloc_snapshot_json, []cInt{-2, 2, maxDevices, math.MaxInt32, math.MinInt32}),
	"goalloc_config_json": func(t *testing.T) {
		wantAccepted(t, func() { assert.NotEmpty(t, configOf(t)) })
	},
	"goalloc_reset_peak_stats":        statusRow(goalloc_reset_peak_stats),
	"goalloc_reset_accumulated_stats": statusRow(goalloc_reset_accumulated_stats),
	"goalloc_empty_cache_device":      statusRow(goalloc_empty_cache_device),
	"goalloc_check_invariants":        statusRow(goalloc_check_invariants),
	"goalloc_record_history": func(t *testing.T) {
		for _, n := range []cInt{-1, math.MinInt32, math.MaxInt32, cInt(caching.MaxHistoryEntries + 1)} {
			wantRefused(t, "invalid_argument", "history of", func() { assert.EqualValues(t, -1, goalloc_record_history(n)) })
		}
		wantAccepted(t, func() { assert.Zero(t, goalloc_record_history(0)) })
	},
	"goalloc_last_error": func(t *testing.T) {
		kind, msg := lastError()
		assert.Equal(t, errNone, kind)
		assert.Empty(t, msg, "no call of this thread failed: an empty string, not NULL")
		wantRefused(t, "invalid_argument", "history of -1", func() { goalloc_record_history(-1) })
	},
	"goalloc_last_error_kind": func(t *testing.T) {
		assert.EqualValues(t, errNone, goalloc_last_error_kind())
		goalloc_malloc(-1, 0, nil)
		assert.EqualValues(t, errBadArgument, goalloc_last_error_kind())
	},
	"goalloc_string_free": func(t *testing.T) {
		wantAccepted(t, func() { goalloc_string_free(nil) }) // as free(3)
		wantAccepted(t, func() { goalloc_string_free(goalloc_config_json()) })
	},
	"goalloc_pool_malloc": func(t *testing.T) {
		poolMallocRows(t, func(size cSize, d cInt, id1 cULongLong, oom *cInt, msg **cChar) unsafe.Pointer {
			return goalloc_pool_malloc(size, d, nil, 0, id1, oom, msg)
		})
	},
	"goalloc_pool_malloc_ctx": func(t *testing.T) {
		poolMallocRows(t, func(size cSize, d cInt, id1 cULongLong, oom *cInt, msg **cChar) unsafe.Pointer {
			return goalloc_pool_malloc_ctx(size, 0, d, nil, 0, id1, math.MaxUint64, oom, msg)
		})
		// The caller's rounding, beyond any device or a negative size.
		wantFailed(t, errOutOfMemory, "out of memory", func() {
			assert.Nil(t, goalloc_pool_malloc_ctx(1, 1<<62, 0, nil, 0, 0, 0, nil, nil))
		})
		for _, block := range []cSize{1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "a negative size?", func() {
				assert.Nil(t, goalloc_pool_malloc_ctx(1, block, 0, nil, 0, 0, 0, nil, nil))
			})
		}
	},
	"goalloc_free_ptr": func(t *testing.T) {
		wantAccepted(t, func() { assert.Zero(t, goalloc_free_ptr(nil)) }) // an empty tensor's deleter
		wantRefused(t, "unknown_pointer", "did not allocate on any device", func() {
			assert.EqualValues(t, -1, goalloc_free_ptr(devicePointer(0x1234)))
		})
	},
	"goalloc_free_ptr_ctx": func(t *testing.T) {
		d := cInt(7)
		wantAccepted(t, func() { assert.Zero(t, goalloc_free_ptr_ctx(nil, math.MaxUint64, &d)) })
		assert.EqualValues(t, -1, d, "a NULL pointer was on no device")
		wantAccepted(t, func() { assert.Zero(t, goalloc_free_ptr_ctx(nil, 0, nil)) })
		p := goalloc_pool_malloc(1000, 1, nil, 0, 0, nil, nil)
		require.NotNil(t, p)
		wantAccepted(t, func() { assert.Zero(t, goalloc_free_ptr_ctx(p, 0, nil)) }) // the device not wanted
		wantRefused(t, "double_free", "double free", func() { assert.EqualValues(t, -1, goalloc_free_ptr_ctx(p, 0, nil)) })
	},
	"goalloc_empty_cache_ctx": func(t *testing.T) {
		wantAccepted(t, func() { assert.Zero(t, goalloc_empty_cache_ctx(math.MaxUint64)) })
	},
	"goalloc_record_history_opts": func(t *testing.T) {
		for _, n := range []cInt{-1, math.MinInt32, math.MaxInt32} {
			wantRefused(t, "invalid_argument", "history of", func() { assert.EqualValues(t, -1, goalloc_record_history_opts(n, nil, 0)) })
		}
		frees := cString("frees")
		defer goalloc_string_free(frees)
		wantRefused(t, "invalid_argument", "skip_actions", func() { assert.EqualValues(t, -1, goalloc_record_history_opts(100, frees, 0)) })
		// NULL skips no action.
		wantAccepted(t, func() { assert.Zero(t, goalloc_record_history_opts(100, nil, math.MinInt32)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_record_history_opts(0, nil, 0)) })
	},
	"goalloc_set_trace_labels": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_set_trace_labels(d, nil, nil)) })
		}
		wantAccepted(t, func() { assert.Zero(t, goalloc_set_trace_labels(0, nil, nil)) }) // NULL: no label
	},
	"goalloc_torch_device_stats": func(t *testing.T) {
		wantRefused(t, "null_pointer", "goalloc_torch_device_stats: out is NULL", func() {
			assert.EqualValues(t, -1, goalloc_torch_device_stats(0, nil, torchStatFigures))
		})
		out := make([]cLongLong, torchStatFigures)
		for _, n := range []cInt{-1, 0, torchStatFigures - 1, math.MaxInt32, math.MinInt32} {
			wantRefused(t, "invalid_argument", "goalloc_torch_device_stats: n is", func() { assert.EqualValues(t, -1, goalloc_torch_device_stats(0, &out[0], n)) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_torch_device_stats(d, &out[0], torchStatFigures)) })
		}
	},
	"goalloc_largest_cached_block": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_largest_cached_block(d)) })
		}
	},
	"goalloc_create_or_incref_pool": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_create_or_incref_pool(d, 0, 7)) })
		}
		wantRefused(t, "invalid_pool", "names no pool", func() { assert.EqualValues(t, -1, goalloc_create_or_incref_pool(0, 0, 0)) })
	},
	"goalloc_pool_use_count": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_pool_use_count(d, 0, 7)) })
		}
		wantAccepted(t, func() { assert.Zero(t, goalloc_pool_use_count(0, math.MaxUint64, math.MaxUint64)) })
	},
	"goalloc_pool_live_blocks": jsonRow(func(d cInt) *cChar { return goalloc_pool_live_blocks(d, 0, 7) }, badDevices),
	"goalloc_restore_pool": func(t *testing.T) {
		for _, d := range append(badDevices, 0) { // device 0 exists, but goalloc holds nothing there yet
			wantRefused(t, "invalid_pool", "where goalloc holds nothing", func() { assert.Nil(t, goalloc_restore_pool(d, 0, 7, nil, 0)) })
		}
		require.Zero(t, goalloc_create_or_incref_pool(0, 0, 7))
		for _, n := range []cInt{1, math.MaxInt32} {
			wantRefused(t, "null_pointer", "goalloc_restore_pool: blocks is NULL", func() { assert.Nil(t, goalloc_restore_pool(0, 0, 7, nil, n)) })
		}
		for _, n := range []cInt{-1, math.MinInt32} {
			wantRefused(t, "invalid_argument", "goalloc_restore_pool: n is", func() { assert.Nil(t, goalloc_restore_pool(0, 0, 7, nil, n)) })
		}
		// A checkpoint row asking more than its block holds is refused
		// before anything is freed: the pool's block stays allocated.
		goalloc_begin_allocate_to_pool(0, 0, 7, nil)
		p := goalloc_pool_malloc(1<<20, 0, nil, 0, 7, nil, nil)
		require.NotNil(t, p)
		goalloc_end_allocate_to_pool(0, 0, 7)
		goalloc_release_pool(0, 0, 7)
		rows := []cULongLong{cULongLong(uintptr(p)), 1 << 20, math.MaxUint64, 0}
		wantRefused(t, "invalid_size", "has 18446744073709551615 requested", func() { assert.Nil(t, goalloc_restore_pool(0, 0, 7, &rows[0], 1)) })
		assert.EqualValues(t, 1<<20, goalloc_stat(0, cInt(caching.ScalarAllocatedBytes)))
		rows[2] = 1 << 20
		wantAccepted(t, func() {
			res := goalloc_restore_pool(0, 0, 7, &rows[0], 1)
			assert.Contains(t, goString(res), `"error":""`)
			goalloc_string_free(res)
		})
		require.Zero(t, goalloc_free_ptr(p))
		goalloc_release_pool(0, 0, 7)
	},
	"goalloc_front_log": func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, goalloc_front_log(d)) })
		}
		wantAccepted(t, func() { assert.NotNil(t, goalloc_front_log(0)) })
	},
	"goalloc_front_drain": statusRow(goalloc_front_drain),
	"goalloc_complete_recorded_free": func(t *testing.T) {
		// Nothing waits for a NULL pointer, nor on a device goalloc holds nothing on.
		for _, d := range append(badDevices, 0) {
			wantAccepted(t, func() { assert.Zero(t, goalloc_complete_recorded_free(d, nil)) })
		}
	},
	"goalloc_external_claim": func(t *testing.T) {
		for _, size := range []cSize{1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "a negative size?", func() { assert.EqualValues(t, -1, goalloc_external_claim(0, size, nil)) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_external_claim(d, 1, nil)) })
		}
		require.Zero(t, goalloc_set_fraction(0, 0.5))
		wantFailed(t, errOutOfMemory, "out of memory", func() { assert.EqualValues(t, -1, goalloc_external_claim(0, 5<<30, nil)) })
		var msg *cChar
		wantFailed(t, errOutOfMemory, "out of memory", func() { assert.EqualValues(t, -1, goalloc_external_claim(0, 5<<30, &msg)) })
		assert.Contains(t, goString(msg), "out of memory", "the message, when it is wanted")
		goalloc_string_free(msg)
	},
	"goalloc_external_unclaim": func(t *testing.T) {
		for _, d := range append(badDevices, 0, 1) {
			wantRefused(t, "bad_device", "goalloc_external_unclaim on device", func() { goalloc_external_unclaim(d, 1) })
		}
		require.Zero(t, goalloc_external_claim(0, 1<<20, nil))
		for _, size := range []cSize{1<<20 + 1, 1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "claimed for segments not made", func() { goalloc_external_unclaim(0, size) })
		}
		wantAccepted(t, func() { goalloc_external_unclaim(0, 1<<20) })
		// The cap's count did not wrap around: a capped device still serves.
		require.Zero(t, goalloc_set_fraction(0, 0.5))
		p := goalloc_malloc(1<<30, 0, nil)
		assert.NotNil(t, p)
		my_free(p, 1<<30, 0, nil)
	},
	"goalloc_external_segment": func(t *testing.T) {
		seg := devicePointer(0x7f0000000000)
		wantRefused(t, "null_pointer", "goalloc_external_segment: addr is NULL", func() {
			assert.EqualValues(t, -1, goalloc_external_segment(0, 1, nil, 20<<20, 1, nil))
		})
		for _, d := range append(badDevices, 0) {
			wantRefused(t, "bad_device", "where goalloc holds nothing", func() { assert.EqualValues(t, -1, goalloc_external_segment(d, 1, seg, 20<<20, 1, nil)) })
		}
		require.Zero(t, goalloc_external_claim(0, 20<<20, nil))
		for _, size := range []cSize{20<<20 + 1, 1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "claimed for segments not made", func() { assert.EqualValues(t, -1, goalloc_external_segment(0, 1, seg, size, 1, nil)) })
		}
		wantRefused(t, "invalid_size", "freed on device 0", func() { assert.EqualValues(t, -1, goalloc_external_segment(0, 0, seg, 20<<20, 1, nil)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_external_segment(0, 1, seg, 20<<20, 1, nil)) })
		assert.EqualValues(t, 20<<20, goalloc_stat(0, cInt(caching.ScalarReservedBytes)))
		for _, size := range []cSize{20<<20 + 1, 1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "freed on device 0", func() { assert.EqualValues(t, -1, goalloc_external_segment(0, 0, seg, size, 1, nil)) })
		}
		wantRefused(t, "invalid_size", "0 small segments", func() { assert.EqualValues(t, -1, goalloc_external_segment(0, 0, seg, 20<<20, 0, nil)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_external_segment(0, 0, seg, 20<<20, 1, nil)) })
		assert.Zero(t, goalloc_stat(0, cInt(caching.ScalarReservedBytes)))
	},
	"goalloc_external_block": func(t *testing.T) {
		blk := devicePointer(0x7f0000000000)
		wantRefused(t, "null_pointer", "goalloc_external_block: addr is NULL", func() {
			assert.EqualValues(t, -1, goalloc_external_block(0, 1, nil, 1<<20, 1<<20, 1, nil))
		})
		for _, d := range append(badDevices, 0) {
			wantRefused(t, "bad_device", "where goalloc holds nothing", func() { assert.EqualValues(t, -1, goalloc_external_block(d, 1, blk, 1<<20, 1<<20, 1, nil)) })
		}
		require.Zero(t, goalloc_external_claim(0, 20<<20, nil))
		require.Zero(t, goalloc_external_segment(0, 1, blk, 20<<20, 1, nil))
		for _, sz := range [][2]cSize{{1 << 63, 1 << 63}, {math.MaxUint64, 0}, {1000, math.MaxUint64}} {
			wantRefused(t, "invalid_size", "own-allocator block", func() { assert.EqualValues(t, -1, goalloc_external_block(0, 1, blk, sz[0], sz[1], 1, nil)) })
		}
		wantRefused(t, "invalid_size", "freed on device 0", func() { assert.EqualValues(t, -1, goalloc_external_block(0, 0, blk, 1<<20, 1000, 1, nil)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_external_block(0, 1, blk, 1<<20, 1000, 1, nil)) })
		for _, sz := range [][2]cSize{{2 << 20, 1000}, {1 << 20, 1 << 20}} {
			wantRefused(t, "invalid_size", "freed on device 0", func() { assert.EqualValues(t, -1, goalloc_external_block(0, 0, blk, sz[0], sz[1], 1, nil)) })
		}
		wantRefused(t, "invalid_size", "0 small blocks", func() { assert.EqualValues(t, -1, goalloc_external_block(0, 0, blk, 1<<20, 1000, 0, nil)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_external_block(0, 0, blk, 1<<20, 1000, 1, nil)) })
		require.Zero(t, goalloc_external_segment(0, 0, blk, 20<<20, 1, nil))
		assert.Zero(t, goalloc_stat(0, cInt(caching.ScalarAllocatedBytes)))
	},
	"goalloc_set_memory_tag": func(t *testing.T) {
		defer goalloc_set_memory_tag(nil)
		for _, bad := range []string{"a,b", "two words", strings.Repeat("x", caching.MaxTagName+1)} {
			name := cString(bad)
			wantFailed(t, errBadArgument, "memory tag", func() { assert.EqualValues(t, -1, goalloc_set_memory_tag(name)) })
			goalloc_string_free(name)
		}
		wantAccepted(t, func() { assert.Zero(t, goalloc_set_memory_tag(nil)) }) // NULL: untagged
		empty := cString("")
		defer goalloc_string_free(empty)
		wantAccepted(t, func() { assert.Zero(t, goalloc_set_memory_tag(empty)) })
	},
	"goalloc_memory_tag": func(t *testing.T) {
		defer goalloc_set_memory_tag(nil)
		wantAccepted(t, func() { assert.Empty(t, takeString(goalloc_memory_tag())) })
		name := cString("abi-row")
		defer goalloc_string_free(name)
		require.Zero(t, goalloc_set_memory_tag(name))
		wantAccepted(t, func() { assert.Equal(t, "abi-row", takeString(goalloc_memory_tag())) })
	},
	"goalloc_ipc_export": func(t *testing.T) {
		var fds [64]cInt
		wantRefused(t, "null_pointer", "NULL pointer", func() { assert.EqualValues(t, -1, goalloc_ipc_export(nil, nil, nil, nil, nil, &fds[0], 64)) })
		wantRefused(t, "unknown_pointer", "did not allocate", func() {
			assert.EqualValues(t, -1, goalloc_ipc_export(devicePointer(0x1234), nil, nil, nil, nil, &fds[0], 64))
		})
		p := goalloc_malloc(1<<20, 0, nil)
		require.NotNil(t, p)
		wantRefused(t, "null_pointer", "fds", func() { assert.EqualValues(t, -1, goalloc_ipc_export(p, nil, nil, nil, nil, nil, 64)) })
		wantRefused(t, "invalid_argument", "cap of -1", func() { assert.EqualValues(t, -1, goalloc_ipc_export(p, nil, nil, nil, nil, &fds[0], -1)) })
		// No room: the count, and no share held.
		wantAccepted(t, func() { assert.EqualValues(t, 1, goalloc_ipc_export(p, nil, nil, nil, nil, &fds[0], 0)) })
		wantRefused(t, "unknown_pointer", "no share", func() { assert.EqualValues(t, -1, goalloc_ipc_release(p)) })
		var pid, dev cInt
		var gran, off cULongLong
		wantAccepted(t, func() { assert.EqualValues(t, 1, goalloc_ipc_export(p, &pid, &dev, &gran, &off, &fds[0], 64)) })
		assert.EqualValues(t, os.Getpid(), pid)
		assert.EqualValues(t, 0, dev)
		assert.NotZero(t, gran)
		assert.Less(t, uint64(off), uint64(gran))
		assert.GreaterOrEqual(t, int(fds[0]), 3)
		my_free(p, 1<<20, 0, nil) // held for the share
		wantAccepted(t, func() { assert.Zero(t, goalloc_ipc_release(p)) })
		assert.Zero(t, goalloc_stat(0, cInt(caching.ScalarAllocatedBytes)), "freed at the release")
	},
	"goalloc_ipc_release": func(t *testing.T) {
		wantRefused(t, "null_pointer", "NULL pointer", func() { assert.EqualValues(t, -1, goalloc_ipc_release(nil)) })
		wantRefused(t, "unknown_pointer", "did not allocate", func() { assert.EqualValues(t, -1, goalloc_ipc_release(devicePointer(0x1234))) })
		p := goalloc_malloc(1000, 0, nil)
		require.NotNil(t, p)
		wantRefused(t, "unknown_pointer", "no share", func() { assert.EqualValues(t, -1, goalloc_ipc_release(p)) })
		my_free(p, 1000, 0, nil)
	},
	"goalloc_ipc_import": func(t *testing.T) {
		fds := []cConstInt{3}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, goalloc_ipc_import(d, 1, 1<<21, &fds[0], 1)) })
		}
		wantRefused(t, "null_pointer", "fds", func() { assert.Nil(t, goalloc_ipc_import(0, 1, 1<<21, nil, 1)) })
		wantRefused(t, "invalid_argument", "of 0 handles", func() { assert.Nil(t, goalloc_ipc_import(0, 1, 1<<21, &fds[0], 0)) })
		p := goalloc_malloc(1<<20, 0, nil)
		require.NotNil(t, p)
		var got [4]cInt
		var pid cInt
		var gran cULongLong
		require.EqualValues(t, 1, goalloc_ipc_export(p, &pid, nil, &gran, nil, &got[0], 4))
		fds[0] = cConstInt(got[0])
		wantFailed(t, errFailed, "memory of device 0", func() { assert.Nil(t, goalloc_ipc_import(1, pid, gran, &fds[0], 1)) })
		wantFailed(t, errFailed, "not a multiple", func() { assert.Nil(t, goalloc_ipc_import(0, pid, gran+512, &fds[0], 1)) })
		stale := []cConstInt{9999}
		wantFailed(t, errFailed, "bad file descriptor", func() { assert.Nil(t, goalloc_ipc_import(0, pid, gran, &stale[0], 1)) })
		var base unsafe.Pointer
		wantAccepted(t, func() { base = goalloc_ipc_import(0, pid, gran, &fds[0], 1) })
		require.NotNil(t, base)
		wantAccepted(t, func() { assert.Zero(t, goalloc_ipc_close(0, base)) })
		require.Zero(t, goalloc_ipc_release(p))
		my_free(p, 1<<20, 0, nil)
	},
	"goalloc_ipc_close": func(t *testing.T) {
		wantRefused(t, "null_pointer", "NULL pointer", func() { assert.EqualValues(t, -1, goalloc_ipc_close(0, nil)) })
		wantFailed(t, errBadArgument, "holds nothing", func() { assert.EqualValues(t, -1, goalloc_ipc_close(-1, devicePointer(0x1234))) })
		my_free(goalloc_malloc(1000, 0, nil), 1000, 0, nil) // device 0 made
		wantFailed(t, errFailed, "no open import", func() { assert.EqualValues(t, -1, goalloc_ipc_close(0, devicePointer(0x1234))) })
	},
	"goalloc_record_stream_held": func(t *testing.T) {
		// Not goalloc's: nothing done, nothing said.
		wantAccepted(t, func() { assert.Zero(t, goalloc_record_stream_held(nil, nil)) })
		wantAccepted(t, func() { assert.Zero(t, goalloc_record_stream_held(devicePointer(0x1234), nil)) })
		p := goalloc_malloc(1000, 0, nil)
		require.NotNil(t, p)
		wantAccepted(t, func() { assert.EqualValues(t, 1, goalloc_record_stream_held(p, nil)) })
		my_free(p, 1000, 0, nil)
	},
	"goalloc_sleep": func(t *testing.T) {
		for _, d := range everyDeviceOrBad {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, goalloc_sleep(d, nil)) })
		}
		unknown := cString("never-set-by-anyone")
		defer goalloc_string_free(unknown)
		wantFailed(t, errBadArgument, "is unknown", func() { assert.Nil(t, goalloc_sleep(-1, unknown)) })
		tag := cString("abi-sleep")
		defer goalloc_string_free(tag)
		require.Zero(t, goalloc_set_memory_tag(tag))
		p := goalloc_malloc(1<<20, 0, nil)
		require.Zero(t, goalloc_set_memory_tag(nil))
		require.NotNil(t, p)
		wantAccepted(t, func() { assert.Contains(t, takeString(goalloc_sleep(0, tag)), `"offloaded_bytes":1048576`) })
		wantFailed(t, errBadState, "wake_up them first", func() { assert.Nil(t, goalloc_sleep(-1, nil)) })
		wantAccepted(t, func() { assert.NotNil(t, goalloc_wake_up(-1, nil)) })
		my_free(p, 1<<20, 0, nil)
	},
	"goalloc_wake_up": func(t *testing.T) {
		for _, d := range everyDeviceOrBad {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, goalloc_wake_up(d, nil)) })
		}
		wantFailed(t, errBadState, "nothing is asleep", func() { assert.Nil(t, goalloc_wake_up(-1, nil)) })
		wantFailed(t, errBadState, "nothing is asleep", func() { assert.Nil(t, goalloc_wake_up(1, nil)) })
		empty := cString("")
		defer goalloc_string_free(empty)
		wantFailed(t, errBadArgument, "no memory tag named", func() { assert.Nil(t, goalloc_wake_up(0, empty)) })
		unknown := cString("kv,never-set-by-anyone")
		defer goalloc_string_free(unknown)
		wantFailed(t, errBadArgument, "is unknown", func() { assert.Nil(t, goalloc_wake_up(0, unknown)) })
	},
	"goalloc_prepare_sleep": func(t *testing.T) {
		for _, d := range everyDeviceOrBad {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_prepare_sleep(d, 1<<20)) })
		}
		wantFailed(t, errBadArgument, "more than any request", func() {
			assert.EqualValues(t, -1, goalloc_prepare_sleep(1, math.MaxUint64))
		})
		// A device named is made, and its area pinned in whole 64 MiB steps.
		wantAccepted(t, func() { assert.Zero(t, goalloc_prepare_sleep(1, 1<<20)) })
		assert.Contains(t, takeString(goalloc_sleep_state_json(1)), `"host_area_bytes":67108864`)
		wantAccepted(t, func() { assert.Zero(t, goalloc_prepare_sleep(-1, 0)) })
	},
	"goalloc_sleep_state_json": jsonRow(goalloc_sleep_state_json, badDevices),
	"goalloc_sched_yield": func(t *testing.T) {
		wantAccepted(t, func() { goalloc_sched_yield() })
	},
	"goalloc_yield_every_ns": func(t *testing.T) {
		wantAccepted(t, func() { assert.EqualValues(t, -1, goalloc_yield_every_ns(), "not initialised yet") })
	},
	"goalloc_stat": func(t *testing.T) {
		for _, key := range []cInt{-1, cInt(caching.NumScalars), math.MaxInt32, math.MinInt32} {
			wantRefused(t, "invalid_argument", "does not exist", func() { assert.EqualValues(t, -1, goalloc_stat(0, key)) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_stat(d, 0)) })
		}
	},
	"goalloc_stat_scalars": func(t *testing.T) {
		wantRefused(t, "null_pointer", "goalloc_stat_scalars: out is NULL", func() { assert.EqualValues(t, -1, goalloc_stat_scalars(0, nil, 4)) })
		out := make([]cInt64, caching.NumScalars+10)
		for _, n := range []cInt{-1, math.MinInt32} {
			wantRefused(t, "invalid_argument", "goalloc_stat_scalars: n is", func() { assert.EqualValues(t, -1, goalloc_stat_scalars(0, &out[0], n)) })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, goalloc_stat_scalars(d, &out[0], 4)) })
		}
		wantAccepted(t, func() { assert.EqualValues(t, caching.NumScalars, goalloc_stat_scalars(0, nil, 0)) })
		wantAccepted(t, func() { assert.EqualValues(t, caching.NumScalars, goalloc_stat_scalars(0, &out[0], cInt(len(out)))) })
	},
	"goalloc_stat_keys_json": func(t *testing.T) {
		wantAccepted(t, func() {
			p := goalloc_stat_keys_json()
			assert.Contains(t, goString(p), "allocated_bytes.all.current")
			goalloc_string_free(p)
		})
	},
	"goalloc_warnings_capture": func(t *testing.T) {
		defer goalloc_warnings_capture(0)
		for _, on := range []cInt{-1, math.MinInt32, math.MaxInt32} { // not 0: on
			wantAccepted(t, func() { assert.Zero(t, goalloc_warnings_capture(on)) })
		}
		goalloc_malloc(-1, 0, nil)
		p := goalloc_warnings_take()
		assert.Contains(t, goString(p), "negative_size", "captured")
		goalloc_string_free(p)
		wantAccepted(t, func() { assert.Zero(t, goalloc_warnings_capture(0)) })
	},
	"goalloc_warnings_take": func(t *testing.T) {
		wantAccepted(t, func() { assert.Nil(t, goalloc_warnings_take(), "none queued") })
	},
	"goalloc_warnings_notify": func(t *testing.T) {
		wantAccepted(t, func() { assert.Zero(t, goalloc_warnings_notify(nil)) }) // NULL: none
	},
}

// takeString is the string p and frees it ("" for NULL).
func takeString(p *cChar) string {
	defer goalloc_string_free(p)
	return goString(p)
}

// jsonRow is the row of a function of one device that returns a string:
// NULL for each device of bad, a string for device 0.
func jsonRow(fn func(cInt) *cChar, bad []cInt) func(t *testing.T) {
	return func(t *testing.T) {
		for _, d := range bad {
			wantRefused(t, "bad_device", "does not exist", func() { assert.Nil(t, fn(d)) })
		}
		wantAccepted(t, func() {
			p := fn(0)
			assert.NotNil(t, p)
			goalloc_string_free(p)
		})
	}
}

// statusRow is the row of a function of one device that returns a status.
func statusRow(fn func(cInt) cInt) func(t *testing.T) {
	return func(t *testing.T) {
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { assert.EqualValues(t, -1, fn(d)) })
		}
		wantAccepted(t, func() { assert.Zero(t, fn(0)) })
	}
}

// poolMallocRows are the rows of goalloc_pool_malloc and its _ctx form:
// each refusal with the out-parameters NULL (not wanted) and given.
func poolMallocRows(t *testing.T, pm func(size cSize, d cInt, id1 cULongLong, oom *cInt, msg **cChar) unsafe.Pointer) {
	for _, outs := range []bool{false, true} {
		call := func(size cSize, d cInt, id1 cULongLong, wantOOM bool, want string) {
			oom, msg := cInt(-1), (*cChar)(nil)
			oomOut, msgOut := &oom, &msg
			if !outs {
				oomOut, msgOut = nil, nil
			}
			assert.Nil(t, pm(size, d, id1, oomOut, msgOut))
			if outs {
				assert.Equal(t, wantOOM, oom == 1, "*oom %d", oom)
				assert.Contains(t, goString(msg), want)
				goalloc_string_free(msg)
			}
		}
		wantFailed(t, errOutOfMemory, "out of memory", func() { call(1<<40, 0, 0, true, "out of memory") })
		for _, size := range []cSize{1 << 63, math.MaxUint64} {
			wantRefused(t, "invalid_size", "a negative size?", func() { call(size, 0, 0, false, "a negative size?") })
		}
		for _, d := range badDevices {
			wantRefused(t, "bad_device", "does not exist", func() { call(1, d, 0, false, "does not exist") })
		}
		wantRefused(t, "invalid_pool", "not in use", func() { call(64, 0, math.MaxUint64, false, "not in use") })
	}
}

// badFractions are memory fractions outside [0, 1], as C doubles.
func badFractions() []cDouble {
	return []cDouble{cDouble(math.NaN()), cDouble(math.Inf(1)), cDouble(math.Inf(-1)), -0.5, 1.5, math.MaxFloat64}
}

// configOf is goalloc_config_json, decoded.
func configOf(t *testing.T) map[string]any {
	p := goalloc_config_json()
	require.NotNil(t, p)
	defer goalloc_string_free(p)
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(goString(p)), &m))
	return m
}

// abiLibrary makes the library the C ABI calls a fresh one, not yet
// initialised, on two simulated devices of 8 GiB, with the C ABI's last
// error of the OS thread; the test's library comes back at the end.
func abiLibrary(t *testing.T) {
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_DEVICES", "2")
	t.Setenv("GOALLOC_SIM_MEMORY", "8G")
	t.Setenv("GOALLOC_CONF", "")
	captureLibraryOutput(t) // the warnings the rows provoke are expected
	old := lib
	lib = newLibrary()
	lib.setLastError = setThreadError
	t.Cleanup(func() { lib = old })
	setThreadError(errNone, "")
}

// lastError is the calling thread's last error, read through the C ABI.
func lastError() (errorKind, string) {
	p := goalloc_last_error()
	defer goalloc_string_free(p)
	return errorKind(goalloc_last_error_kind()), goString(p)
}

// badInput is how many calls were counted as bad input of kind (every
// kind for ""), by the library and by the allocators of its devices.
func badInput(kind string) int64 {
	var n int64
	count := func(m map[string]int64) {
		for k, v := range m {
			if kind == "" || k == kind {
				n += v
			}
		}
	}
	count(lib.badInputCounts())
	for _, a := range lib.existing() {
		count(a.Stats().BadInput)
	}
	return n
}

// wantRefused runs call, which must be refused as bad input: counted once,
// as kind counter, and the calling thread's last error of kind
// bad_argument, its message containing msg.
func wantRefused(t *testing.T, counter, msg string, call func()) {
	t.Helper()
	wantOutcome(t, errBadArgument, counter, msg, call)
}

// wantFailed runs call, which must fail with kind and msg without being
// counted as bad input.
func wantFailed(t *testing.T, kind errorKind, msg string, call func()) {
	t.Helper()
	wantOutcome(t, kind, "", msg, call)
}

// wantAccepted runs call, which must neither fail nor count bad input.
func wantAccepted(t *testing.T, call func()) {
	t.Helper()
	wantOutcome(t, errNone, "", "", call)
}

// wantWarned runs call, which must be done all the same with one warning
// counted as counter: the calling thread's last error stays none.
func wantWarned(t *testing.T, counter string, call func()) {
	t.Helper()
	wantOutcome(t, errNone, counter, "", call)
}

// wantOutcome runs call on a thread with no last error and checks what it
// left: the last error's kind and message, and the bad input counted (one
// as counter, or none for "").
func wantOutcome(t *testing.T, kind errorKind, counter, msg string, call func()) {
	t.Helper()
	setThreadError(errNone, "")
	total, n := badInput(""), badInput(counter)
	call()
	gotKind, gotMsg := lastError()
	assert.Equal(t, kind, gotKind, "last error kind (%q)", gotMsg)
	if msg != "" {
		assert.Contains(t, gotMsg, msg)
	}
	if counter == "" {
		assert.Equal(t, total, badInput(""), "bad input counted: %q", gotMsg)
	} else {
		assert.Equal(t, n+1, badInput(counter), "goalloc.bad_input.%s (%q)", counter, gotMsg)
		assert.Equal(t, total+1, badInput(""), "counted once (%q)", gotMsg)
	}
}

// requireLibraryWorks: the library allocates and frees on both devices,
// and its figures agree: the allocator's self-check, and goalloc_stat,
// goalloc_torch_device_stats and goalloc_stats_json report the same bytes.
func requireLibraryWorks(t *testing.T) {
	t.Helper()
	for d := cInt(0); d < 2; d++ {
		before := goalloc_stat(d, cInt(caching.ScalarAllocatedBytes))
		require.GreaterOrEqual(t, int64(before), int64(0), "device %d", d)
		p := goalloc_malloc(1<<20, d, nil)
		require.NotNil(t, p, "device %d", d)
		now := goalloc_stat(d, cInt(caching.ScalarAllocatedBytes))
		assert.EqualValues(t, before+1<<20, now, "device %d", d)
		figures := make([]cLongLong, torchStatFigures)
		require.Zero(t, goalloc_torch_device_stats(d, &figures[0], torchStatFigures))
		assert.Equal(t, now, figures[4*3*4], "device %d: DeviceStats's allocated_bytes.all.current", d)
		js := goalloc_stats_json(d)
		var m map[string]int64
		require.NoError(t, json.Unmarshal([]byte(goString(js)), &m))
		goalloc_string_free(js)
		assert.EqualValues(t, now, m["allocated_bytes.all.current"], "device %d: memory_stats", d)
		my_free(p, 1<<20, d, nil)
		assert.Equal(t, before, goalloc_stat(d, cInt(caching.ScalarAllocatedBytes)), "device %d", d)
		if goalloc_check_invariants(d) != 0 {
			_, msg := lastError()
			t.Fatalf("device %d: the self-check failed: %s", d, msg)
		}
	}
}

// exportedNames is every //export name of the package's files that this
// build compiles (go/build's rules, with abiBuildTags).
func exportedNames(t *testing.T) map[string]bool {
	ctxt := build.Default
	ctxt.CgoEnabled = true // the package is cgo: this test would not run otherwise
	ctxt.BuildTags = abiBuildTags
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	names := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		if ok, err := ctxt.MatchFile(".", f); err != nil || !ok {
			require.NoError(t, err)
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, line := range strings.Split(string(src), "\n") {
			if name, ok := strings.CutPrefix(line, "//export "); ok {
				names[strings.TrimSpace(name)] = true
			}
		}
	}
	require.NotEmpty(t, names)
	return names
}

func TestEveryExportTakesNullNegativeAndHugeArguments(t *testing.T) {
	names := exportedNames(t)
	for name := range names {
		if abiRows[name] == nil {
			t.Errorf("%s has no row in abiRows: give it its NULL, negative and huge arguments", name)
		}
	}
	var rows []string
	for name := range abiRows {
		if !names[name] {
			t.Errorf("abiRows has a row for %s, which no file of this build exports", name)
		}
		rows = append(rows, name)
	}
	sort.Strings(rows)
	for _, name := range rows {
		t.Run(name, func(t *testing.T) {
			// The last error is the OS thread's: the row, its checks and
			// the health check below read it on one thread.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			abiLibrary(t)
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Errorf("%s panicked: %v", name, r)
					}
				}()
				abiRows[name](t)
			}()
			requireLibraryWorks(t)
		})
	}
}
