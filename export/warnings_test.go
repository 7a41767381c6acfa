package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// libraryOutput collects what the library prints for the rest of the test,
// so that a test that provokes a line asserts it instead of letting it out.
type libraryOutput struct{ b bytes.Buffer }

func captureLibraryOutput(t *testing.T) *libraryOutput {
	o := &libraryOutput{}
	warnings.mu.Lock()
	old := warnings.out
	warnings.out = &o.b
	warnings.mu.Unlock()
	t.Cleanup(func() {
		warnings.mu.Lock()
		warnings.out = old
		warnings.mu.Unlock()
	})
	return o
}

func (o *libraryOutput) lines() []string {
	warnings.mu.Lock()
	defer warnings.mu.Unlock()
	return strings.Split(strings.TrimSpace(o.b.String()), "\n")
}

// newSink is a sink apart from the library's, printing into out.
func newSink(out *bytes.Buffer) *warningSink {
	return &warningSink{out: out, wake: make(chan struct{}, 1)}
}

func TestWarningsPrintUntilCaptured(t *testing.T) {
	var out bytes.Buffer
	s := newSink(&out)
	s.warn("double_free", "goalloc: double free")
	assert.Equal(t, "goalloc: double free\n", out.String())
	assert.Nil(t, s.takeJSON(), "printed, not queued")

	s.setCapture(true)
	s.warn("unknown_pointer", "goalloc: free of 0x1234")
	s.print("goalloc: out of memory")
	assert.Equal(t, "goalloc: double free\ngoalloc: out of memory\n", out.String(), "out-of-memory lines print anyway")
	var got []warning
	require.NoError(t, json.Unmarshal(s.takeJSON(), &got))
	assert.Equal(t, []warning{{"unknown_pointer", "goalloc: free of 0x1234"}}, got)
	assert.Nil(t, s.takeJSON(), "taking empties the queue")

	// Letting go prints what nobody took.
	s.warn("negative_size", "goalloc: malloc of a negative size")
	s.setCapture(false)
	assert.True(t, strings.HasSuffix(out.String(), "goalloc: malloc of a negative size\n"))
}

func TestWarningQueueIsBounded(t *testing.T) {
	var out bytes.Buffer
	s := newSink(&out)
	s.setCapture(true)
	for i := 0; i < maxQueuedWarnings+5; i++ {
		s.warn("k", "m")
	}
	q := s.take()
	require.Len(t, q, maxQueuedWarnings+1)
	assert.Equal(t, warning{"dropped", "goalloc: 5 more warnings were dropped: nothing took them from the queue"}, q[maxQueuedWarnings])
	assert.Empty(t, s.take())
}

// The notifier runs on its own goroutine, with no lock of the sink held:
// it can take the queue (as Python's does), and a warning raised while the
// raiser holds its own lock does not wait for it.
func TestNotifierIsCalledOffTheWarningThread(t *testing.T) {
	var out bytes.Buffer
	s := newSink(&out)
	s.setCapture(true)
	got := make(chan []warning, 4)
	release := make(chan struct{})
	s.setNotify(func() {
		<-release
		got <- s.take()
	})
	var raiser sync.Mutex
	raiser.Lock()
	s.warn("double_free", "goalloc: double free") // returns with the notifier blocked
	raiser.Unlock()
	close(release)
	select {
	case q := <-got:
		assert.Equal(t, []warning{{"double_free", "goalloc: double free"}}, q)
	case <-time.After(10 * time.Second):
		t.Fatal("the notifier was not called")
	}

	// Unregistering waits for a call in flight.
	block := make(chan struct{})
	entered := make(chan struct{})
	s.setNotify(func() { close(entered); <-block })
	s.warn("k", "m")
	<-entered
	unregistered := make(chan struct{})
	go func() { s.setNotify(nil); close(unregistered) }()
	select {
	case <-unregistered:
		t.Fatal("setNotify(nil) returned while the notifier ran")
	case <-time.After(50 * time.Millisecond):
	}
	close(block)
	<-unregistered
	s.warn("k", "after")
	time.Sleep(20 * time.Millisecond)
	assert.Len(t, s.take(), 2, "no notifier: the queue keeps them")
}

// A library's bad-input warning reaches the queue with its kind.
func TestLibraryWarningsGoThroughTheSink(t *testing.T) {
	out := captureLibraryOutput(t)
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_DEVICES", "1")
	t.Setenv("GOALLOC_CONF", "")
	l := newLibrary()
	require.NoError(t, l.init(0))
	l.free(0x1234, 512, 0, 0)
	require.Len(t, out.lines(), 1)
	assert.Contains(t, out.lines()[0], "free of 0x1234 on device 0")
	assert.True(t, strings.HasSuffix(out.lines()[0], "(goalloc warns once per kind; counter goalloc.bad_input.unknown_pointer)"))

	warnings.setCapture(true)
	t.Cleanup(func() { warnings.setCapture(false) })
	require.Zero(t, l.malloc(-1, 0, 0))
	q := warnings.take()
	require.Len(t, q, 1)
	assert.Equal(t, "negative_size", q[0].Kind)
	assert.Contains(t, q[0].Message, "malloc of a negative size (-1)")
	assert.Len(t, out.lines(), 1, "captured, not printed")
}
