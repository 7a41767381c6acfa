package main

import (
	"errors"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/caching"
)

// errorKind says what kind of failure a call met: goalloc.h's
// GOALLOC_ERROR_KINDS, which says what each kind means and keeps the
// numbers (export/header_test.go holds this copy to it). Every failed call
// sets it together with the message (lasterror.go); goalloc_last_error_kind
// reads the calling thread's.
type errorKind int32

const (
	errNone errorKind = iota
	errBadArgument
	errBadConfig
	errOutOfMemory
	errFailed
	errTooLate
	errBadState
)

// errorKindNames names the kinds, by number: goalloc.h's names, and
// goalloc_config_json's "error_kinds".
var errorKindNames = [...]string{
	errNone:        "none",
	errBadArgument: "bad_argument",
	errBadConfig:   "bad_config",
	errOutOfMemory: "out_of_memory",
	errFailed:      "failed",
	errTooLate:     "too_late",
	errBadState:    "bad_state",
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
	var se *caching.StateError
	switch {
	case err == nil:
		return errNone
	case errors.As(err, &ke):
		return ke.kind
	case errors.As(err, &se):
		return errBadState
	case errors.Is(err, caching.ErrNeedsVMM), errors.Is(err, arena.ErrNoIPC):
		return errBadConfig
	case errors.Is(err, arena.ErrOutOfMemory): // a *caching.OOMError is one
		return errOutOfMemory
	case errors.As(err, &ie):
		return errBadArgument
	default:
		return errFailed
	}
}
