/* What every cgo preamble of this package includes: the C ABI's one
 * declaration, goalloc.h (python/goalloc/csrc; main.go puts its folder on
 * the include path), so that cgo's compiler checks each //export against
 * it, and the C types of the Go side that goalloc.h does not name.
 *
 * cgo writes a Go parameter's C type by its name and drops a const, so the
 * functions that take const pointers take these typedefs in Go; their
 * declarations in cgo's header are then const char* and const unsigned
 * long long*, as goalloc.h has them. cudaStream_t is the void* of
 * goalloc.h's streams, named for the Go code that reads them. */
#ifndef GOALLOC_EXPORT_CGO_H
#define GOALLOC_EXPORT_CGO_H

#include "goalloc.h"

typedef const char goalloc_const_char;
typedef const unsigned long long goalloc_const_ull;
typedef void *cudaStream_t;

#endif
