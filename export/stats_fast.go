package main

// The per-step statistics: memory_allocated() and its family as single
// numbers, read without the allocator's mutex and without JSON (goalloc.h,
// "the per-step statistics"; caching.Scalar numbers the figures).

/*
#include "cgo.h"
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/goalloc/goalloc/caching"
)

//export goalloc_stat
func goalloc_stat(device C.int, key C.int) C.longlong {
	v, err := lib.stat(int(device), int(key))
	if err != nil {
		return -1
	}
	return C.longlong(v)
}

//export goalloc_stat_scalars
func goalloc_stat_scalars(device C.int, out *C.int64_t, n C.int) C.int {
	if n < 0 {
		_ = lib.bad("invalid_argument", fmt.Sprintf("goalloc: goalloc_stat_scalars: n is %d; give the size of out (0 or more)", int(n)))
		return -1
	}
	if n > 0 && out == nil {
		_ = lib.nullArg("goalloc_stat_scalars", "out", fmt.Sprintf("give a buffer of %d figures, or n = 0 to ask how many there are", int(n)))
		return -1
	}
	var buf []int64
	if n > 0 {
		buf = unsafe.Slice((*int64)(unsafe.Pointer(out)), int(n))
	}
	if err := lib.statScalars(int(device), buf); err != nil {
		return -1
	}
	return C.int(caching.NumScalars)
}

//export goalloc_stat_keys_json
func goalloc_stat_keys_json() *C.char { return cstring(json.Marshal(caching.ScalarKeys())) }

// stat is one published figure of device d. A device in use is read with
// atomic loads only: no mutex, neither the allocator's nor the library's.
func (l *library) stat(d, key int) (int64, error) {
	if key < 0 || key >= int(caching.NumScalars) {
		return -1, l.bad("invalid_argument", fmt.Sprintf("goalloc: statistic %d does not exist; goalloc_stat takes 0 to %d (goalloc_stat_keys_json names them)", key, caching.NumScalars-1))
	}
	if a := l.existingDevice(d); a != nil {
		return a.Scalar(caching.Scalar(key)), nil
	}
	if err := l.checkDevice(d); err != nil {
		return -1, err
	}
	return 0, nil
}

// statScalars fills out with the published figures of device d, as many
// as fit.
func (l *library) statScalars(d int, out []int64) error {
	if a := l.existingDevice(d); a != nil {
		a.Scalars(out)
		return nil
	}
	if err := l.checkDevice(d); err != nil {
		return err
	}
	clear(out[:min(len(out), int(caching.NumScalars))])
	return nil
}
