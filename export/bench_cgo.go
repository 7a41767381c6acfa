//go:build goalloc_bench

package main

// A C loop over goalloc_malloc/my_free, so that BenchmarkCABIPair measures a
// cache-hit pair the way PyTorch makes it: a C caller entering Go twice.
// Built only with -tags goalloc_bench, so the shipped library carries none
// of it.

/*
#include "cgo.h"

extern void *goalloc_bench_nop_malloc(ssize_t size, int device, void *stream);
extern void goalloc_bench_nop_free(void *ptr, ssize_t size, int device, void *stream);

static void goalloc_bench_pairs(long n, ssize_t size) {
	for (long i = 0; i < n; i++) {
		void *p = goalloc_malloc(size, 0, (void *)0);
		my_free(p, size, 0, (void *)0);
	}
}

// The pair as goalloc's C++ allocator class makes it (history off: no
// context id).
static void goalloc_bench_cxx_pairs(long n, size_t size) {
	int oom = 0, device = 0;
	char *err = NULL;
	for (long i = 0; i < n; i++) {
		void *p = goalloc_pool_malloc_ctx(size, 0, 0, (void *)0, 0, 0, 0, &oom, &err);
		goalloc_free_ptr_ctx(p, 0, &device);
	}
}

static void goalloc_bench_nop_pairs(long n, ssize_t size) {
	for (long i = 0; i < n; i++) {
		void *p = goalloc_bench_nop_malloc(size, 0, (void *)0);
		goalloc_bench_nop_free(p, size, 0, (void *)0);
	}
}
*/
import "C"

func benchPairs(n int, size int64) { C.goalloc_bench_pairs(C.long(n), C.ssize_t(size)) }

func benchCxxPairs(n int, size int64) { C.goalloc_bench_cxx_pairs(C.long(n), C.size_t(size)) }

func benchNopPairs(n int) { C.goalloc_bench_nop_pairs(C.long(n), 4096) }
