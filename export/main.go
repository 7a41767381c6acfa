// Command export is libgoalloc.so: the C ABI PyTorch and the Python package
// call, built with go build -buildmode=c-shared. It holds every //export
// function and nothing else of substance; each one converts C types and
// calls the library state in registry.go, which calls package caching. The
// design is explained in caching/doc.go.
//
// Calls PyTorch makes (torch.cuda.memory.CUDAPluggableAllocator):
//
//	void* my_malloc(ssize_t size, int device, cudaStream_t stream);  // throws on failure (torch_malloc.cpp)
//	void  my_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
//	void  goalloc_init(int device_count);                       // set_init_fn
//	void  goalloc_empty_cache(void);                            // set_reset_fn
//	void  goalloc_set_memory_fraction(double fraction, int device); // set_memory_fraction_fn
//	void  goalloc_record_stream(void* ptr, cudaStream_t stream); // set_record_stream_fn
//
// and the three CUDA graph hooks (see "CUDA graphs and the C ABI" below):
//
//	void goalloc_begin_allocate_to_pool(int device, unsigned long long id0,
//	                                    unsigned long long id1, void* filter); // set_begin_allocate_to_pool
//	void goalloc_end_allocate_to_pool(int device, unsigned long long id0,
//	                                  unsigned long long id1);                // set_end_allocate_to_pool_fn
//	void goalloc_release_pool(int device, unsigned long long id0,
//	                          unsigned long long id1);                        // set_release_pool
//
// C callers allocate with goalloc_malloc, which returns NULL on failure.
// Control functions return 0 on success and -1 on error, or a string that
// the caller frees with goalloc_string_free (NULL on error); either way
// goalloc_last_error says what went wrong and goalloc_last_error_kind what
// kind of failure it was (errkind.go). See the README's C ABI table.
package main

/*
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>

typedef void *cudaStream_t;
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

// goalloc_malloc is the C entry point: NULL on failure, and
// goalloc_last_error says why. my_malloc, the name PyTorch's documentation
// gives the pluggable allocator, is the same call throwing a C++ exception
// instead (torch_malloc.cpp).
//
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

// CUDA graphs and the C ABI. torch calls these hooks as C++ functions of
// type void(int, MempoolId_t[, std::function<bool(cudaStream_t)>]), where
// MempoolId_t is std::pair<unsigned long long, unsigned long long>. On
// x86-64 (System V) a 16-byte trivially copyable pair of integers travels in
// two integer registers, exactly as two unsigned long long arguments do, and
// a std::function, which is not trivially copyable, is passed by a hidden
// reference: one more pointer argument. goalloc never calls the filter: it
// asks the driver whether the allocating stream is being captured instead
// (caching/graphs.go). tests/gpu/graphs_check.py checks on the GPU that the
// pool ids arriving here are the ones torch reports for the graph.

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

// NULL in the C ABI. A pointer argument is one of two things, and each
// function's comment says which:
//
//   - an optional out-parameter (int* oom, char** err, int* device): NULL
//     means the caller does not want that answer, and nothing is written
//     (putOut, putMessage);
//   - anything else (a string, a buffer, an address): NULL is refused before
//     the call does anything, as bad input of kind null_pointer, -1 or NULL
//     returned and goalloc_last_error naming the function and the argument
//     (nullArg).
//
// Device pointers and streams are values, not C memory: my_free and
// goalloc_record_stream refuse a NULL pointer as the same bad input
// (registry.go); goalloc_free_ptr takes it as an empty tensor's deleter
// and frees nothing, as free(3) does (and goalloc_string_free with a NULL
// string); a NULL stream is the default stream.

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

// goalloc_configure replaces GOALLOC_CONF with conf, before the first
// allocation; "" is the defaults. NULL is refused (nullArg): taken as ""
// it would drop the caps and settings of GOALLOC_CONF without a word.
//
//export goalloc_configure
func goalloc_configure(conf *C.char) C.int {
	if conf == nil {
		return status(lib.nullArg("goalloc_configure", "conf", `give a GOALLOC_CONF string ("" for the defaults)`))
	}
	return status(lib.configure(C.GoString(conf)))
}

//export goalloc_init_checked
func goalloc_init_checked(deviceCount C.int) C.int { return status(lib.init(int(deviceCount))) }

// goalloc_check_device is 0 if device exists, else -1 (bad argument, and
// goalloc_last_error names the devices there are); a question, not counted
// as bad input.
//
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

// goalloc_last_error is the message of the last call that failed on the
// calling OS thread (lasterror.go).
//
//export goalloc_last_error
func goalloc_last_error() *C.char { return threadError() }

// goalloc_last_error_kind is the kind of the last call that failed on the
// calling OS thread, set together with goalloc_last_error's message: 0
// none, 1 bad argument, 2 bad configuration, 3 out of memory, 4 the driver,
// the device or the allocator failed, 5 too late (errkind.go).
//
//export goalloc_last_error_kind
func goalloc_last_error_kind() C.int { return C.int(threadErrorKind()) }

// goalloc_string_free frees a string the library handed out; NULL, as
// with free(3), is nothing to free.
//
//export goalloc_string_free
func goalloc_string_free(s *C.char) { C.free(unsafe.Pointer(s)) }
