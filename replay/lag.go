// The device's lag behind the host, for a replay on the simulated device
// (Options.DeviceLag); replay.go holds the replay itself (see doc.go).

package replay

import (
	"fmt"

	"github.com/goalloc/goalloc/arena"
)

// laggingDevice is what a device needs for a replay that lags: its streams
// run work only when told (arena.Sim's manual mode).
type laggingDevice interface {
	SetManual(manual bool)
	Launch(s arena.Stream)
	Enqueued(s arena.Stream) uint64
	CompleteThrough(s arena.Stream, pos uint64)
}

// deviceLag makes a simulated device run lag microseconds of the trace's
// time behind the host that recorded it: every call is a piece of work
// put on its stream, finished once the trace's clock has moved lag past
// it. On a GPU the host runs ahead of the device, so an event the
// allocator records completes a while after it is recorded, and what its
// placement does with memory whose last use may still run shows only
// then; with no lag (the default) every event completes at once. It is
// checked against the GPU for the VMM device (replay/gpu_traces_test.go);
// the simulated stream-ordered pool (backend:async, arena/simpool.go) does
// not model the driver's reuse of another stream's frees behind an added
// dependency, so its figures behind the host run high. A stream may have
// a lag of its own (Options.StreamLag): one stream far behind the others,
// as FSDP's all-gather stream can be, leaves its frees in the others'
// segments pending far longer.
type deviceLag struct {
	dev laggingDevice
	lag int64
	// streamLag is the lag of the streams that have their own.
	streamLag map[arena.Stream]int64
	// queued holds, per stream, the positions of its unfinished work and
	// when the host put each there, oldest first.
	queued map[arena.Stream][]lagMark
}

type lagMark struct {
	pos uint64
	t   int64
}

func newDeviceLag(dev arena.Device, t *Trace, lagMicros int64, streamLag map[arena.Stream]int64) (*deviceLag, error) {
	if lagMicros < 0 {
		return nil, fmt.Errorf("a device lag of %d µs: a lag is 0 or more", lagMicros)
	}
	lags := lagMicros
	for s, v := range streamLag {
		if v < 0 {
			return nil, fmt.Errorf("a lag of %d µs for stream %d: a lag is 0 or more", v, s)
		}
		lags += v
	}
	if lags == 0 {
		return nil, nil
	}
	ld, ok := dev.(laggingDevice)
	if !ok {
		return nil, fmt.Errorf("a device lag needs the simulated device, not %s", DeviceName(dev))
	}
	if len(t.Events) > 0 && t.Events[0].T == 0 && t.Events[len(t.Events)-1].T == 0 {
		return nil, fmt.Errorf("a device lag needs the trace's times (\"t\"), which %s lacks", t.Path)
	}
	ld.SetManual(true)
	return &deviceLag{dev: ld, lag: lagMicros, streamLag: streamLag, queued: map[arena.Stream][]lagMark{}}, nil
}

// before finishes the work the device has run by the time the host makes
// the call at t.
func (l *deviceLag) before(t int64) {
	for s, q := range l.queued {
		lag, own := l.streamLag[s]
		if !own {
			lag = l.lag
		}
		n := 0
		for n < len(q) && q[n].t+lag <= t {
			n++
		}
		if n > 0 {
			l.dev.CompleteThrough(s, q[n-1].pos)
			l.queued[s] = q[n:]
		}
	}
}

// after puts the call's work on its stream.
func (l *deviceLag) after(s arena.Stream, t int64) {
	l.dev.Launch(s)
	l.queued[s] = append(l.queued[s], lagMark{pos: l.dev.Enqueued(s), t: t})
}
