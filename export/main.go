// Command export is libgoalloc.so: the C ABI PyTorch and the Python package
// call, built with go build -buildmode=c-shared. It holds every //export
// function and nothing else of substance; each one converts C types and
// calls the library state in registry.go, which calls package caching. The
// design is explained in caching/doc.go.
//
// The C ABI is declared, with what each function does and its rules for
// errors and NULL, in python/goalloc/csrc/goalloc.h, which every preamble
// here includes (cgo.h): cgo's compiler refuses an //export whose signature
// differs from its declaration there, and header_test.go checks that the
// library exports exactly what the header declares. The comments here say
// how the functions do what the header says.
package main

/*
#cgo CPPFLAGS: -I${SRCDIR}/../python/goalloc/csrc
#include <stdlib.h>
#include "cgo.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

func main() {}

func init() {
	getenv = cGetenv
	lib.setLastError = setThreadError
}

// cGetenv is getenv(3): the environment as it is now, not as it was when
// the library was loaded.
func cGetenv(name string) string {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	if v := C.getenv(cs); v != nil {
		return C.GoString(v)
	}
	return ""
}

//export goalloc_malloc
func goalloc_malloc(size C.ssize_t, device C.int, stream C.cudaStream_t) unsafe.Pointer {
	return devicePointer(lib.malloc(int64(size), int(device), uintptr(stream)))
}

// devicePointer hands a device address to C as a void*. The address is not
// Go memory and the collector never sees it; the conversion goes through
// memory rather than a cast only so that vet's unsafe.Pointer check, which
// is about Go memory, stays quiet. A call into C to do the cast cost a
// third of the cache-hit pair (BenchmarkCABIPair).
func devicePointer(p uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&p))
}

//export my_free
func my_free(ptr unsafe.Pointer, size C.ssize_t, device C.int, stream C.cudaStream_t) {
	lib.free(uintptr(ptr), int64(size), int(device), uintptr(stream))
}

//export goalloc_init
func goalloc_init(deviceCount C.int) { _ = lib.init(int(deviceCount)) }

//export goalloc_empty_cache
func goalloc_empty_cache() { _ = lib.emptyCache() }

//export goalloc_set_memory_fraction
func goalloc_set_memory_fraction(fraction C.double, device C.int) {
	_ = lib.setFraction(float64(fraction), int(device))
}

//export goalloc_record_stream
func goalloc_record_stream(ptr unsafe.Pointer, stream C.cudaStream_t) {
	_ = lib.recordStream(uintptr(ptr), uintptr(stream))
}

// The CUDA graph hooks: goalloc.h says how torch's C++ arguments arrive
// as these.

//export goalloc_begin_allocate_to_pool
func goalloc_begin_allocate_to_pool(device C.int, id0, id1 C.ulonglong, filter unsafe.Pointer) {
	_ = lib.beginAllocateToPool(int(device), [2]uint64{uint64(id0), uint64(id1)})
}

//export goalloc_end_allocate_to_pool
func goalloc_end_allocate_to_pool(device C.int, id0, id1 C.ulonglong) {
	_ = lib.endAllocateToPool(int(device), [2]uint64{uint64(id0), uint64(id1)})
}

//export goalloc_release_pool
func goalloc_release_pool(device C.int, id0, id1 C.ulonglong) {
	_ = lib.releasePool(int(device), [2]uint64{uint64(id0), uint64(id1)})
}

// status turns an error into the C convention: 0 ok, -1 failed.
func status(err error) C.int {
	if err != nil {
		return -1
	}
	return 0
}

// cstring hands out a malloc'd copy of b, or NULL on error.
func cstring(b []byte, err error) *C.char {
	if err != nil {
		return nil
	}
	return C.CString(string(b))
}

// NULL in the C ABI (goalloc.h, "Conventions"): an optional out-parameter
// is written with putOut or putMessage, which skip a NULL; any other NULL
// pointer is refused with nullArg.

// putOut writes v to the optional out-parameter out, unless it is NULL.
func putOut[T any](out *T, v T) {
	if out != nil {
		*out = v
	}
}

// putMessage hands err's message to the optional out-parameter out, a
// string the caller frees with goalloc_string_free; none is made when out
// is NULL.
func putMessage(out **C.char, err error) {
	if out != nil {
		*out = C.CString(err.Error())
	}
}

// nullArg refuses a call of fn whose argument arg is NULL where it must
// not be; need says what the argument must be.
func (l *library) nullArg(fn, arg, need string) error {
	return l.bad("null_pointer", fmt.Sprintf("goalloc: %s: %s is NULL; %s", fn, arg, need))
}

//export goalloc_configure
func goalloc_configure(conf *C.goalloc_const_char) C.int {
	if conf == nil {
		return status(lib.nullArg("goalloc_configure", "conf", `give a GOALLOC_CONF string ("" for the defaults)`))
	}
	return status(lib.configure(C.GoString(conf)))
}

//export goalloc_init_checked
func goalloc_init_checked(deviceCount C.int) C.int { return status(lib.init(int(deviceCount))) }

//export goalloc_check_device
func goalloc_check_device(device C.int) C.int { return status(lib.deviceExists(int(device))) }

//export goalloc_device_count
func goalloc_device_count() C.int {
	if lib.checkDevice(0) != nil {
		return -1
	}
	lib.mu.Lock()
	defer lib.mu.Unlock()
	return C.int(lib.count)
}

//export goalloc_stats_json
func goalloc_stats_json(device C.int) *C.char { return cstring(lib.statsJSON(int(device))) }

//export goalloc_fragmentation_json
func goalloc_fragmentation_json(device C.int) *C.char {
	return cstring(lib.fragmentationJSON(int(device)))
}

//export goalloc_snapshot_json
func goalloc_snapshot_json(device C.int) *C.char { return cstring(lib.snapshotJSON(int(device))) }

//export goalloc_config_json
func goalloc_config_json() *C.char { return cstring(lib.configJSON()) }

//export goalloc_reset_peak_stats
func goalloc_reset_peak_stats(device C.int) C.int { return status(lib.resetPeak(int(device))) }

//export goalloc_reset_accumulated_stats
func goalloc_reset_accumulated_stats(device C.int) C.int {
	return status(lib.resetAccumulated(int(device)))
}

//export goalloc_set_fraction
func goalloc_set_fraction(device C.int, fraction C.double) C.int {
	return status(lib.setFraction(float64(fraction), int(device)))
}

//export goalloc_empty_cache_device
func goalloc_empty_cache_device(device C.int) C.int {
	return status(lib.emptyCacheDevice(int(device)))
}

//export goalloc_record_history
func goalloc_record_history(maxEntries C.int) C.int {
	return status(lib.recordHistory(int(maxEntries)))
}

//export goalloc_check_invariants
func goalloc_check_invariants(device C.int) C.int { return status(lib.checkInvariants(int(device))) }

// goalloc_last_error: the thread's error is kept in C (lasterror.go).
//
//export goalloc_last_error
func goalloc_last_error() *C.char { return threadError() }

//export goalloc_last_error_kind
func goalloc_last_error_kind() C.int { return C.int(threadErrorKind()) }

//export goalloc_string_free
func goalloc_string_free(s *C.char) { C.free(unsafe.Pointer(s)) }
