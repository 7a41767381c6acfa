package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// The C++ class's keeper learns the yield interval from yieldEvery: unknown
// (-1) until the configuration is read, then yield_every in nanoseconds (0
// by default, and 0 when initialisation failed: nothing will be allocated).
func TestYieldEveryFollowsTheConfiguration(t *testing.T) {
	captureLibraryOutput(t)
	t.Setenv("GOALLOC_DEVICE", "sim")
	t.Setenv("GOALLOC_SIM_MEMORY", "8G")
	t.Setenv("GOALLOC_CONF", "yield_every:9ms")
	l := newLibrary()
	assert.EqualValues(t, -1, l.yieldEvery())
	assert.NoError(t, l.init(0))
	assert.EqualValues(t, 9_000_000, l.yieldEvery())

	t.Setenv("GOALLOC_CONF", "")
	l = newLibrary()
	assert.NoError(t, l.configure("yield_every:2ms"))
	assert.EqualValues(t, -1, l.yieldEvery(), "configured, not yet read by init")
	assert.NoError(t, l.init(0))
	assert.EqualValues(t, 2_000_000, l.yieldEvery())

	assert.EqualValues(t, 0, simLibrary(t, "1").yieldEvery(), "off by default")

	t.Setenv("GOALLOC_CONF", "yield_every:20ms")
	l = newLibrary()
	assert.ErrorContains(t, l.init(0), "yield_every")
	assert.EqualValues(t, 0, l.yieldEvery())
}
