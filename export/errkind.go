package main

import (
	"errors"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

// errorKind says what kind of failure a call met, so that a caller can
// choose its response (the Python package, its exception type) without
// reading the message, which is for people and may be reworded. Every
// failed call sets it together with the message (lasterror.go);
// goalloc_last_error_kind reads the calling thread's. The numbers are part
// of the C ABI: a kind keeps its number, and new kinds are appended.
//
//	0  none          no call of this thread has failed
//	1  bad_argument  an argument the call refuses: a negative or absurd size,
//	                 a device that does not exist, a fraction outside [0, 1],
//	                 a pointer or pool goalloc does not hold, ...
//	2  bad_config    a bad GOALLOC_CONF string (or goalloc_configure's), or a
//	                 bad GOALLOC_DEVICE, GOALLOC_SIM_DEVICES, GOALLOC_SIM_MEMORY
//	3  out_of_memory the device, or the cap on it, has no room for the request
//	4  failed        the driver or the device failed (no CUDA device, a
//	                 device that cannot be set up, a driver call that
//	                 failed), or the allocator found itself inconsistent
//	5  too_late      a call that must come before the first allocation came
//	                 after it (goalloc_configure)
//
// Kinds 1 and 2 are the caller's to fix (Python raises ValueError); the
// others are GoallocError.
type errorKind int32

const (
	errNone errorKind = iota
	errBadArgument
	errBadConfig
	errOutOfMemory
	errFailed
	errTooLate
)

// errorKindNames names the kinds, by number, for goalloc_config_json's
// "error_kinds" (the Python package checks its copy of the numbers against it).
var errorKindNames = [...]string{
	errNone:        "none",
	errBadArgument: "bad_argument",
	errBadConfig:   "bad_config",
	errOutOfMemory: "out_of_memory",
	errFailed:      "failed",
	errTooLate:     "too_late",
}

// kindError gives err a kind that its type does not say; its message is
// err's, unchanged.
type kindError struct {
	kind errorKind
	err  error
}

func (e *kindError) Error() string { return e.err.Error() }
func (e *kindError) Unwrap() error { return e.err }

// withKind marks err as of kind k.
func withKind(k errorKind, err error) error { return &kindError{kind: k, err: err} }

// kindOf is the kind of a failed call's error: given by withKind where the
// library knows it, else by caching's error types; any other error comes
// from the device, its driver or the allocator's own checks.
func kindOf(err error) errorKind {
	var ke *kindError
	var ie *caching.InputError
	switch {
	case err == nil:
		return errNone
	case errors.As(err, &ke):
		return ke.kind
	case errors.Is(err, arena.ErrOutOfMemory): // a *caching.OOMError is one
		return errOutOfMemory
	case errors.As(err, &ie):
		return errBadArgument
	default:
		return errFailed
	}
}
