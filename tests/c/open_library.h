/* How the C and C++ test programs of tests/c/ load the library under test:
 * the one argument is the path of libgoalloc.so, opened with dlopen as
 * PyTorch opens it. A wrong command line exits with 2, a library that does
 * not load with 1. Its functions are taken with GOALLOC_SYMBOL, typed as
 * goalloc.h declares them (compile with -Ipython/goalloc/csrc). */
#ifndef GOALLOC_TESTS_OPEN_LIBRARY_H
#define GOALLOC_TESTS_OPEN_LIBRARY_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "goalloc.h"

/* GOALLOC_SYMBOL(lib, fn) is the library's function fn (NULL if it lacks
 * it), of the type of fn's declaration in goalloc.h; GOALLOC_FN(fn) is that
 * type. (__typeof__: a GNU extension that gcc, g++ and clang take.) */
#define GOALLOC_FN(fn) __typeof__(&fn)
#define GOALLOC_SYMBOL(lib, fn) ((GOALLOC_FN(fn))dlsym(lib, #fn))

/* STAT_FIGURE(name) is where statistic name's figures start among
 * goalloc_torch_device_stats's (goalloc.h's table): its "all" pool's
 * current value. */
enum stat_array_index {
#define STAT_ARRAY_INDEX(name, ...) stat_index_##name,
	GOALLOC_STAT_ARRAYS(STAT_ARRAY_INDEX)
#undef STAT_ARRAY_INDEX
};
#define STAT_FIGURE(name) \
	(stat_index_##name * GOALLOC_STAT_COUNT(GOALLOC_STAT_POOLS) * GOALLOC_STAT_COUNT(GOALLOC_STAT_VALUES))

static inline void *open_library(int argc, char **argv) {
	if (argc != 2) {
		fprintf(stderr, "usage: %s path/to/libgoalloc.so\n", argv[0]);
		exit(2);
	}
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		fprintf(stderr, "%s\n", dlerror());
		exit(1);
	}
	return lib;
}

#endif
