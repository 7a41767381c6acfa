package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// While a capture is underway the VMM placement neither records nor queries
// an event nor gives VA back (the simulated device counts each as a
// violation and spoils the capture, as the driver does for the first two);
// what it could not do then it does once the capture is over.
func TestCaptureGateKeepsThePlacementAwayFromEventsAndVA(t *testing.T) {
	dev, err := NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	const X, Y, C = Stream(0x11), Stream(0x22), Stream(0xc0)
	q, err := dev.Alloc(4<<20, Y)
	require.NoError(t, err)
	p, err := dev.Alloc(8<<20, X)
	require.NoError(t, err)
	require.NoError(t, dev.Free(p, 8<<20, X))
	require.NoError(t, dev.Synchronize()) // X's free is complete: Trim may take it, and the segment's VA

	dev.SetCaptureUnderway(true)
	dev.SetCapture(C, CaptureActive)
	va := dev.Phys().ReservedVA()
	require.NoError(t, dev.Trim(0))
	assert.Equal(t, va, dev.Phys().ReservedVA(), "X's emptied segment keeps its VA during the capture")
	require.ErrorIs(t, dev.Free(q, 4<<20, X), ErrCaptureUnderway, "a free on another stream needs an event: refused, nothing changed")
	require.NoError(t, dev.CheckInvariants())
	assert.Zero(t, dev.CaptureViolations, "no event recorded or queried, no VA given back during the capture")
	dev.SetCapture(C, CaptureNone)
	dev.SetCaptureUnderway(false)

	require.NoError(t, dev.Free(q, 4<<20, X), "after the capture the free is made")
	require.NoError(t, dev.Synchronize())
	require.NoError(t, dev.Trim(0))
	u, err := dev.PoolUsage()
	require.NoError(t, err)
	assert.Zero(t, u.ReservedCurrent, "after the capture everything goes back")
	assert.Zero(t, dev.Phys().ReservedVA())
	require.NoError(t, dev.CheckInvariants())
}
