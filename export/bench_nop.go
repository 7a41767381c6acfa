//go:build goalloc_bench

package main

// The floor of BenchmarkCABIPair: a pair of exported Go functions that do
// nothing, entered from C the same way, so that the benchmark reports the
// cost of the C-to-Go crossing itself side by side with goalloc's pair.

// #include <sys/types.h>
import "C"

import "unsafe"

var benchNopCount uintptr

//export goalloc_bench_nop_malloc
func goalloc_bench_nop_malloc(size C.ssize_t, device C.int, stream unsafe.Pointer) unsafe.Pointer {
	benchNopCount++
	return nil
}

//export goalloc_bench_nop_free
func goalloc_bench_nop_free(ptr unsafe.Pointer, size C.ssize_t, device C.int, stream unsafe.Pointer) {
	benchNopCount--
}
