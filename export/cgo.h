/* What every cgo preamble of this package includes: the C ABI's one
 * declaration, goalloc.h (python/goalloc/csrc; main.go puts its folder on
 * the include path), so that cgo's compiler checks each //export against
 * it, and the C types of the Go side that goalloc.h does not name.
 *
 * cgo writes an exported parameter's C type by its name, and a Go type
 * cannot say const: the functions that take const pointers take these
 * typedefs, which cgo's header then writes as goalloc.h declares them,
 * while Go sees a *C.char and a *C.ulonglong. cudaStream_t is the void* of
 * goalloc.h's streams, named for the Go code that reads them. */
#ifndef GOALLOC_EXPORT_CGO_H
#define GOALLOC_EXPORT_CGO_H

#include "goalloc.h"

typedef const char goalloc_const_char;
typedef const unsigned long long goalloc_const_ull;
typedef const int goalloc_const_int;
typedef void *cudaStream_t;

#endif
