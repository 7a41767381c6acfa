package main

import (
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The simulated device gives each device the simulated VMM backend by
// default, and the stream-ordered pool with backend:async.
func TestBackendSelection(t *testing.T) {
	l := simLibrary(t, "2")
	require.NotZero(t, l.malloc(1<<20, 0, 0))
	_, isVMM := l.existingDevice(0).Device().(*arena.SimVMM)
	assert.True(t, isVMM, "the default backend is vmm")

	t.Setenv("GOALLOC_CONF", "quiet:true,backend:async")
	l = newLibrary()
	require.NoError(t, l.init(0))
	require.NotZero(t, l.malloc(1<<20, 0, 0))
	_, isPool := l.existingDevice(0).Device().(*arena.Sim)
	assert.True(t, isPool, "backend:async gives the stream-ordered pool")

	t.Setenv("GOALLOC_CONF", "quiet:true,backend:vmm")
	l = newLibrary()
	require.NoError(t, l.init(0))
	p := l.malloc(3<<20, 1, 0)
	require.NotZero(t, p)
	dev, isVMM := l.existingDevice(1).Device().(*arena.SimVMM)
	require.True(t, isVMM, "backend:vmm gives the VMM device")
	u, err := dev.PoolUsage()
	require.NoError(t, err)
	assert.EqualValues(t, arena.DefaultVMMHandle, u.ReservedCurrent, "3 MiB is held as one handle (4 MiB, the default)")
	l.free(p, 3<<20, 1, 0)
	require.NoError(t, dev.CheckInvariants())

	t.Setenv("GOALLOC_CONF", "backend:cudaMalloc")
	l = newLibrary()
	require.ErrorContains(t, l.init(0), "backend")
}
