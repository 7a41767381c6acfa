package caching

import (
	"errors"
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// Bad input: the InputError every refused or questionable call gets, with
// its stable kind counted in Stats.BadInput, and the checks of a free's size
// and stream.

// InputError is a call with bad arguments. Kind is a stable name for the
// kind of mistake ("double_free", "unknown_pointer", ...), also the key of its
// counter in Stats.BadInput.
type InputError struct {
	Kind string
	Msg  string
	// Handled says the call did its work all the same (a free with a wrong
	// size is freed by pointer): the error is a warning, not a refusal.
	Handled bool
}

func (e *InputError) Error() string { return "goalloc: " + e.Msg }

// InputErrors lists the InputErrors in err, which may join several (a free
// with a wrong size and a wrong stream).
func InputErrors(err error) []*InputError {
	var out []*InputError
	var walk func(error)
	walk = func(err error) {
		if ie, ok := err.(*InputError); ok {
			out = append(out, ie)
		} else if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
		} else if e := errors.Unwrap(err); e != nil {
			walk(e)
		}
	}
	walk(err)
	return out
}

// badInput counts a refused call and returns its error. The caller holds a.mu.
func (a *Allocator) badInput(kind, msg string) error {
	a.stats.BadInput[kind]++
	return &InputError{Kind: kind, Msg: msg}
}

// warnInput counts a call that was wrong but done all the same.
func (a *Allocator) warnInput(kind, msg string) error {
	a.stats.BadInput[kind]++
	return &InputError{Kind: kind, Msg: msg, Handled: true}
}

// checkFree reports a free whose size or stream differ from the
// allocation's, each mistake under its own kind. The block is freed all the
// same: these are warnings (InputError.Handled).
func (a *Allocator) checkFree(ptr uintptr, size, requested uint64, s, owner arena.Stream) error {
	var errs []error
	if size != requested && !(size == 0 && requested == 0) {
		errs = append(errs, a.warnInput("size_mismatch", fmt.Sprintf("free of %#x with size %d, allocated with size %d, on device %d; freed by pointer", ptr, size, requested, a.dev.Ordinal())))
	}
	if s != owner {
		errs = append(errs, a.warnInput("stream_mismatch", fmt.Sprintf("free of %#x on stream %#x, allocated on stream %#x, on device %d; freed in the allocation stream's order", ptr, s, owner, a.dev.Ordinal())))
	}
	return errors.Join(errs...)
}
