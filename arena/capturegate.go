package arena

// The capture gate: what a VMM device's placement may ask of the driver's
// events while a CUDA graph capture is underway (package doc: "arena").

import (
	"errors"

	"go.uber.org/atomic"
)

// ErrCaptureUnderway is the error of a driver call the gate refused
// because a capture is underway on the device.
var ErrCaptureUnderway = errors.New("arena: a CUDA graph capture is underway on the device")

// CaptureAware is a device whose memory source records and polls events
// of its own (the VMM devices, whose placement needs them to move memory
// between streams). The caching layer says when a capture is underway on
// the device, as PyTorch's allocator keeps its captures_underway: from the
// first BeginAllocateToPool to the last EndAllocateToPool.
//
// Why: in CUDA's default (global) capture mode the driver refuses
// cuEventQuery from any thread while a capture is underway, and the refusal
// invalidates the capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); an event
// recorded on a stream that joined the capture becomes a node of the graph.
// So while one is underway the device neither queries nor records.
type CaptureAware interface {
	SetCaptureUnderway(underway bool)
}

// captureGate is a PhysDriver adaptor that keeps the placement away from
// events (and from giving VA back) while a capture is underway: a record is refused with
// ErrCaptureUnderway (the placement then leaves what it would have covered
// unrecorded, as for any refused record), and a query answers "not done
// yet", which is the truth as far as anyone may ask: what waits for an
// event keeps waiting, and nothing is reused or unmapped on its strength.
type captureGate struct {
	PhysDriver
	underway atomic.Bool
}

func (g *captureGate) RecordEvent(e Event, s Stream) error {
	if g.underway.Load() {
		return ErrCaptureUnderway
	}
	return g.PhysDriver.RecordEvent(e, s)
}

// StreamWaitEvent is refused too: a stream being captured may not wait for
// an event recorded outside the capture, and which stream is captured is
// not known here.
func (g *captureGate) StreamWaitEvent(s Stream, e Event) error {
	if g.underway.Load() {
		return ErrCaptureUnderway
	}
	return g.PhysDriver.StreamWaitEvent(s, e)
}

// FreeVA is refused too: whether the driver allows cuMemAddressFree during
// a capture is not known here, and a segment that keeps its VA a while
// costs nothing (it is tried again at the next Trim).
func (g *captureGate) FreeVA(base uintptr, size uint64) error {
	if g.underway.Load() {
		return ErrCaptureUnderway
	}
	return g.PhysDriver.FreeVA(base, size)
}

func (g *captureGate) EventDone(e Event) (bool, error) {
	if g.underway.Load() {
		return false, nil
	}
	return g.PhysDriver.EventDone(e)
}
