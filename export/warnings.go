package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"
)

// Where the library's words go. By default every line goes to stderr, where
// the user of a C or C++ program reads it. A Python program wants goalloc's
// warnings (the first bad input of each kind) as Python warnings, which its
// user can filter, turn into errors or log; so the Python package asks for
// them: goalloc_warnings_capture(1) stops printing warnings and queues them
// instead, goalloc_warnings_take hands the queue over, and
// goalloc_warnings_notify registers a function that is called when the
// queue gains a warning. Warnings raised inside torch's calls (my_free of a
// pointer goalloc never made, ...) reach Python that way without waiting
// for Python's next call into the library.
//
// The notifier runs on a goroutine of its own, never on the thread that
// raised the warning and never under any lock of the allocator: the
// warning may come from an allocation made while the caller holds Python's
// interpreter lock, which the notifier needs in turn.
//
// Out-of-memory lines and initialisation errors are not warnings: they
// explain a NULL or a failed call as it happens, so they always go to
// stderr (Python also gets them as the exception's message).

// maxQueuedWarnings bounds the queue when nothing takes it: warnings are
// once per kind, so a full queue means a reader that stopped reading.
const maxQueuedWarnings = 256

type warning struct {
	Kind    string `json:"kind"`
	Message string `json:"message"`
}

type warningSink struct {
	mu      sync.Mutex
	out     io.Writer // stderr; tests swap it
	capture bool
	queue   []warning
	dropped int

	// notifyMu is held while the notifier runs, so that unregistering it
	// waits for a call in flight (its C function may be about to go away).
	notifyMu sync.Mutex
	notify   func()
	wake     chan struct{} // one pending wake-up is enough
	started  bool          // the notifier goroutine runs
}

var warnings = &warningSink{out: os.Stderr, wake: make(chan struct{}, 1)}

// print writes a line the user must see now, whatever captures warnings.
func (s *warningSink) print(line string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fmt.Fprintln(s.out, line)
}

// warn prints a warning or, while captured, queues it and wakes the notifier.
func (s *warningSink) warn(kind, msg string) {
	s.mu.Lock()
	if !s.capture {
		fmt.Fprintln(s.out, msg)
		s.mu.Unlock()
		return
	}
	if len(s.queue) < maxQueuedWarnings {
		s.queue = append(s.queue, warning{kind, msg})
	} else {
		s.dropped++
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// setCapture turns queueing on or off. Turning it off prints what is still
// queued, so that no warning is lost.
func (s *warningSink) setCapture(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.capture = on
	if !on {
		for _, w := range s.takeLocked() {
			fmt.Fprintln(s.out, w.Message)
		}
	}
}

// take empties the queue; nil when there is nothing.
func (s *warningSink) take() []warning {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.takeLocked()
}

func (s *warningSink) takeLocked() []warning {
	q := s.queue
	if s.dropped > 0 {
		q = append(q, warning{"dropped", fmt.Sprintf("goalloc: %d more warnings were dropped: nothing took them from the queue", s.dropped)})
	}
	s.queue, s.dropped = nil, 0
	return q
}

// takeJSON is take as a JSON array, or nil when there is nothing.
func (s *warningSink) takeJSON() []byte {
	q := s.take()
	if len(q) == 0 {
		return nil
	}
	b, err := json.Marshal(q)
	if err != nil {
		panic(err) // strings only: cannot fail
	}
	return b
}

// setNotify registers f (nil: none), called on the notifier goroutine when
// the queue gains a warning. It returns once a call of the previous
// notifier in flight has returned.
func (s *warningSink) setNotify(f func()) {
	s.notifyMu.Lock()
	s.notify = f
	start := f != nil && !s.started
	s.started = s.started || start
	s.notifyMu.Unlock()
	if start {
		go s.notifier()
	}
	if f != nil {
		s.mu.Lock()
		pending := len(s.queue) > 0
		s.mu.Unlock()
		if pending {
			select {
			case s.wake <- struct{}{}:
			default:
			}
		}
	}
}

func (s *warningSink) notifier() {
	for range s.wake {
		s.notifyMu.Lock()
		s.mu.Lock()
		pending := len(s.queue) > 0 || s.dropped > 0
		s.mu.Unlock()
		if f := s.notify; f != nil && pending {
			f()
		}
		s.notifyMu.Unlock()
	}
}
