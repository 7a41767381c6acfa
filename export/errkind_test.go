package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/goalloc/goalloc/caching"
)

// Every failure path sets the kind of its failure beside its message, and
// the kind is the one kindOf gives the returned error.
func TestEveryFailureSetsItsKind(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string // over simLibrary's
		call func(l *library) error
		want errorKind
	}{
		{"negative size", nil, func(l *library) error { l.malloc(-1, 0, 0); return nil }, errBadArgument},
		{"device that does not exist", nil, func(l *library) error { _, err := l.statsJSON(7); return err }, errBadArgument},
		{"malloc on a device that does not exist", nil, func(l *library) error { l.malloc(1, 7, 0); return nil }, errBadArgument},
		{"asking for a device that does not exist", nil, func(l *library) error { return l.deviceExists(2) }, errBadArgument},
		{"fraction outside [0, 1]", nil, func(l *library) error { return l.setFraction(1.5, 0) }, errBadArgument},
		{"fraction for a device that does not exist", nil, func(l *library) error { return l.setFraction(0.5, 9) }, errBadArgument},
		{"statistic that does not exist", nil, func(l *library) error { _, err := l.stat(0, 99); return err }, errBadArgument},
		{"history too long", nil, func(l *library) error { return l.recordHistory(caching.MaxHistoryEntries + 1) }, errBadArgument},
		{"free of NULL", nil, func(l *library) error { l.free(0, 0, 0, 0); return nil }, errBadArgument},
		{"double free (refused by the cache)", nil, func(l *library) error {
			p := l.malloc(1000, 0, 0)
			l.free(p, 1000, 0, 0)
			l.free(p, 1000, 0, 0)
			return nil
		}, errBadArgument},
		{"graph pool goalloc does not hold", nil, func(l *library) error { return l.releasePool(0, [2]uint64{3, 4}) }, errBadArgument},
		{"record_stream of a pointer goalloc did not allocate", nil, func(l *library) error { return l.recordStream(0x1234, 0) }, errBadArgument},
		{"record_stream of a freed block", nil, func(l *library) error {
			p := l.malloc(1000, 0, 0)
			l.free(p, 1000, 0, 0)
			return l.recordStream(p, 0x10)
		}, errBadArgument},
		{"end of a graph pool on a device never used", nil, func(l *library) error { return l.endAllocateToPool(1, [2]uint64{1, 1}) }, errBadArgument},
		{"free of a pointer no device holds (the C++ class)", nil, func(l *library) error { return l.freeOwned(0x1234) }, errBadArgument},
		{"bad configure string", nil, func(l *library) error { return l.configure("bogus:1") }, errBadConfig},
		{"impossible configure string", nil, func(l *library) error { return l.configure("reserve:0.5,fraction:0.25") }, errBadConfig},
		{"configure after the first allocation", nil, func(l *library) error {
			require.NotZero(t, l.malloc(1000, 0, 0))
			return l.configure("fraction:0.5")
		}, errTooLate},
		{"out of memory", nil, func(l *library) error { l.malloc(9<<30, 0, 0); return nil }, errOutOfMemory},
		{"out of memory under a cap", nil, func(l *library) error {
			require.NoError(t, l.setFraction(0.5, 0))
			l.malloc(5<<30, 0, 0)
			return nil
		}, errOutOfMemory},
		{"bad GOALLOC_CONF", map[string]string{"GOALLOC_CONF": "fraction:2"}, func(l *library) error { return l.init(0) }, errBadConfig},
		{"bad GOALLOC_CONF, at a later call", map[string]string{"GOALLOC_CONF": "fraction:2"}, func(l *library) error {
			_ = l.init(0)
			_, err := l.statsJSON(0)
			return err
		}, errBadConfig},
		{"bad GOALLOC_DEVICE", map[string]string{"GOALLOC_DEVICE": "tpu"}, func(l *library) error { return l.init(0) }, errBadConfig},
		{"bad GOALLOC_SIM_DEVICES", map[string]string{"GOALLOC_SIM_DEVICES": "0"}, func(l *library) error { return l.init(0) }, errBadConfig},
		{"bad GOALLOC_SIM_MEMORY", map[string]string{"GOALLOC_SIM_MEMORY": "lots"}, func(l *library) error { return l.init(0) }, errBadConfig},
		{"negative device count", nil, func(l *library) error { return l.init(-5) }, errBadArgument},
		// The driver has no room for the pre-warmed reserve: the device
		// cannot be set up, for lack of memory.
		{"device too small for its reserve", map[string]string{"GOALLOC_CONF": "reserve:0.9", "GOALLOC_SIM_MEMORY": "1M"},
			func(l *library) error { l.malloc(1, 0, 0); return nil }, errOutOfMemory},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			captureLibraryOutput(t) // the lines it provokes are expected
			t.Setenv("GOALLOC_DEVICE", "sim")
			t.Setenv("GOALLOC_SIM_DEVICES", "2")
			t.Setenv("GOALLOC_SIM_MEMORY", "8G")
			t.Setenv("GOALLOC_CONF", "")
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			l := newLibrary()
			err := c.call(l)
			require.NotEmpty(t, l.lastError(), "the call failed")
			assert.Equal(t, errorKindNames[c.want], errorKindNames[l.lastErrorKind()], "kind of %q", l.lastError())
			if err != nil {
				assert.Equal(t, c.want, kindOf(err), "the returned error's kind")
				assert.Equal(t, err.Error(), l.lastError(), "the message is the error's, unchanged")
			}
		})
	}
}

// No CUDA driver is a failure of the platform, not a bad setting. Where
// there is a CUDA device (the GPU machine), there is nothing to check.
func TestNoCUDADeviceIsAFailure(t *testing.T) {
	captureLibraryOutput(t)
	t.Setenv("GOALLOC_DEVICE", "cuda")
	t.Setenv("GOALLOC_CONF", "")
	l := newLibrary()
	if l.init(0) == nil {
		t.Skip("this machine has a CUDA device")
	}
	assert.Equal(t, errFailed, l.lastErrorKind(), l.lastError())
}

// A warning (a call done all the same) changes neither the last error nor
// its kind, and a call that succeeds leaves both as they were.
func TestWarningDoesNotReplaceTheLastErrorKind(t *testing.T) {
	captureLibraryOutput(t)
	l := simLibrary(t, "1")
	p := l.malloc(1000, 0, 0x10)
	require.NotZero(t, p)
	assert.Zero(t, l.malloc(9<<30, 0, 0x10))
	require.Equal(t, errOutOfMemory, l.lastErrorKind())
	oom := l.lastError()
	l.free(p, 999, 0, 0x20) // wrong size and wrong stream: freed by pointer
	q := l.malloc(1000, 0, 0x10)
	require.NotZero(t, q)
	l.free(q, 1000, 0, 0x10)
	assert.Equal(t, errOutOfMemory, l.lastErrorKind())
	assert.Equal(t, oom, l.lastError())
}

// Every kind has a name; the names are goalloc_config_json's "error_kinds".
func TestErrorKindsAreNamed(t *testing.T) {
	for k, name := range errorKindNames {
		assert.NotEmpty(t, name, "kind %d", k)
	}
	assert.Len(t, errorKindNames, int(errBadState)+1)
	assert.Equal(t, errNone, kindOf(nil))
}

// Asking whether a device exists is the same rule and message as using it,
// but it is a question: not counted or warned of as bad input.
func TestCheckDeviceIsAQuestion(t *testing.T) {
	out := captureLibraryOutput(t)
	l := simLibrary(t, "2")
	require.NoError(t, l.configure("")) // not quiet: a warning would show
	require.NoError(t, l.deviceExists(1))
	err := l.deviceExists(2)
	require.EqualError(t, err, "goalloc: device 2 does not exist (2 sim devices: 0 to 1)")
	assert.Zero(t, stats(t, l, 0)["goalloc.bad_input.bad_device"])
	assert.Empty(t, out.b.String())
	_, used := l.statsJSON(2)
	assert.Equal(t, err.Error(), used.Error(), "one rule, one message")
	assert.EqualValues(t, 1, stats(t, l, 0)["goalloc.bad_input.bad_device"])
	assert.Contains(t, out.b.String(), "device 2 does not exist", "the use is warned of")
}
