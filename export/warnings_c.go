package main

// The C ABI of warnings.go (goalloc.h, "warnings").

/*
#include "cgo.h"
static inline void goalloc_call_notify(goalloc_notify_fn f) { f(); }
*/
import "C"

//export goalloc_warnings_capture
func goalloc_warnings_capture(on C.int) C.int {
	warnings.setCapture(on != 0)
	return 0
}

//export goalloc_warnings_take
func goalloc_warnings_take() *C.char {
	b := warnings.takeJSON()
	if b == nil {
		return nil
	}
	return C.CString(string(b))
}

//export goalloc_warnings_notify
func goalloc_warnings_notify(fn C.goalloc_notify_fn) C.int {
	if fn == nil {
		warnings.setNotify(nil)
		return 0
	}
	warnings.setNotify(func() { C.goalloc_call_notify(fn) })
	return 0
}
