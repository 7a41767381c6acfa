package arena

import (
	"sort"
	"time"

	"go.uber.org/atomic"
)

// timedPhys counts and times every call a VMM device makes to its driver,
// by driver function: the profile that says where a VMM miss's time goes on
// a GPU, and, on the simulated device, how many calls of each kind the same
// workload makes there (the simulator is meant to make the very same calls).
//
// It sits between the placement engine and the driver, so it sees exactly
// the calls the engine makes. A call costs two clock reads more (tens of
// nanoseconds) against the microseconds of a driver call; the cache-hit
// path never reaches it.
type timedPhys struct {
	PhysDriver
	calls [numDriverCalls]driverCallCounter
}

type driverCallCounter struct {
	n, ns atomic.Uint64
}

// The driver functions a VMM device calls, in driverCallNames' order.
const (
	callReserveVA = iota
	callFreeVA
	callCreate
	callRelease
	callMap
	callUnmap
	callSetAccess
	callEventCreate
	callEventRecord
	callEventQuery
	callEventDestroy
	callIsCapturing
	callStreamWait
	numDriverCalls
)

var driverCallNames = [numDriverCalls]string{
	"cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap",
	"cuMemUnmap", "cuMemSetAccess", "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventDestroy",
	"cuStreamIsCapturing", "cuStreamWaitEvent",
}

// DriverCallStat is how often one driver function was called, and the
// wall time spent in it.
type DriverCallStat struct {
	Name  string `json:"name"`
	Count uint64 `json:"count"`
	Nanos uint64 `json:"ns"`
}

// DriverProfiler is a device that profiles its driver calls: the VMM
// devices, simulated and CUDA.
type DriverProfiler interface {
	// DriverCalls lists the driver functions called since the device was
	// made, the most time first (by name on a tie); those never called are
	// left out.
	DriverCalls() []DriverCallStat
}

func (t *timedPhys) done(call int, start time.Time) {
	c := &t.calls[call]
	c.n.Inc()
	c.ns.Add(uint64(time.Since(start)))
}

// DriverCalls is DriverProfiler's method.
func (t *timedPhys) DriverCalls() []DriverCallStat {
	var out []DriverCallStat
	for i := range t.calls {
		if n := t.calls[i].n.Load(); n > 0 {
			out = append(out, DriverCallStat{Name: driverCallNames[i], Count: n, Nanos: t.calls[i].ns.Load()})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Nanos != out[j].Nanos {
			return out[i].Nanos > out[j].Nanos
		}
		return out[i].Name < out[j].Name
	})
	return out
}

func (t *timedPhys) ReserveVA(size uint64) (uintptr, error) {
	defer t.done(callReserveVA, time.Now())
	return t.PhysDriver.ReserveVA(size)
}

func (t *timedPhys) FreeVA(base uintptr, size uint64) error {
	defer t.done(callFreeVA, time.Now())
	return t.PhysDriver.FreeVA(base, size)
}

func (t *timedPhys) CreateHandle(size uint64) (PhysHandle, error) {
	defer t.done(callCreate, time.Now())
	return t.PhysDriver.CreateHandle(size)
}

func (t *timedPhys) ReleaseHandle(h PhysHandle) error {
	defer t.done(callRelease, time.Now())
	return t.PhysDriver.ReleaseHandle(h)
}

func (t *timedPhys) Map(va uintptr, size uint64, h PhysHandle) error {
	defer t.done(callMap, time.Now())
	return t.PhysDriver.Map(va, size, h)
}

func (t *timedPhys) Unmap(va uintptr, size uint64) error {
	defer t.done(callUnmap, time.Now())
	return t.PhysDriver.Unmap(va, size)
}

func (t *timedPhys) SetAccess(va uintptr, size uint64) error {
	defer t.done(callSetAccess, time.Now())
	return t.PhysDriver.SetAccess(va, size)
}

func (t *timedPhys) NewEvent() (Event, error) {
	defer t.done(callEventCreate, time.Now())
	return t.PhysDriver.NewEvent()
}

func (t *timedPhys) RecordEvent(e Event, s Stream) error {
	defer t.done(callEventRecord, time.Now())
	return t.PhysDriver.RecordEvent(e, s)
}

func (t *timedPhys) StreamWaitEvent(s Stream, e Event) error {
	defer t.done(callStreamWait, time.Now())
	return t.PhysDriver.StreamWaitEvent(s, e)
}

func (t *timedPhys) EventDone(e Event) (bool, error) {
	defer t.done(callEventQuery, time.Now())
	return t.PhysDriver.EventDone(e)
}

func (t *timedPhys) DestroyEvent(e Event) error {
	defer t.done(callEventDestroy, time.Now())
	return t.PhysDriver.DestroyEvent(e)
}

func (t *timedPhys) CaptureStatus(s Stream) (CaptureStatus, error) {
	defer t.done(callIsCapturing, time.Now())
	return t.PhysDriver.CaptureStatus(s)
}
