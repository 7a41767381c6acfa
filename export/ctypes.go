package main

// The C types of the exported functions under Go names, and the two string
// conversions, for this package's tests: go test refuses import "C" in a
// _test.go file, so abi_test.go calls the //export functions, which are
// plain Go functions, through these. The library itself uses none of them
// (the linker leaves them out of libgoalloc.so).

/*
#include "cgo.h"
*/
import "C"

type (
	cInt       = C.int
	cLongLong  = C.longlong
	cULongLong = C.ulonglong
	cInt64     = C.int64_t
	cSize      = C.size_t
	cSSize     = C.ssize_t
	cDouble    = C.double
	cChar      = C.char
	cConstInt  = C.goalloc_const_int
)

// cString is a malloc'd copy of s, freed with goalloc_string_free.
func cString(s string) *C.char { return C.CString(s) }

// goString is a copy of the C string p ("" for NULL).
func goString(p *C.char) string {
	if p == nil {
		return ""
	}
	return C.GoString(p)
}
