/* How the C and C++ test programs of tests/c/ load the library under test:
 * the one argument is the path of libgoalloc.so, opened with dlopen as
 * PyTorch opens it. A wrong command line exits with 2, a library that does
 * not load with 1. */
#ifndef GOALLOC_TESTS_OPEN_LIBRARY_H
#define GOALLOC_TESTS_OPEN_LIBRARY_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

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
