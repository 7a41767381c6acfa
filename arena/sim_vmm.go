package arena

import "fmt"

// SimVMM is the simulated device with the VMM backend: a Sim for streams,
// events and capture, and the very placement the CUDA VMM device runs
// (vmm_source.go), over an in-memory driver (FakePhys) whose granularity
// is an H200's 2 MiB, raised to the layout's handle size. Its reserved figure is the physical bytes its
// handles hold, handle for handle what the real device would hold.
type SimVMM struct {
	*Sim
	phys     *FakePhys
	src      *vmmSource
	capacity uint64
}

var (
	_ Device         = (*SimVMM)(nil)
	_ DriverProfiler = (*SimVMM)(nil)
	_ CaptureAware   = (*SimVMM)(nil)
	_ StreamGranular = (*SimVMM)(nil)
	_ Sleeper        = (*SimVMM)(nil)
	_ Sharer         = (*SimVMM)(nil)
	_ HeldSplitter   = (*SimVMM)(nil)
)

// simVMMGranule is the simulated allocation granularity, an H200's.
const simVMMGranule = 2 << 20

// NewSimVMM makes a simulated VMM device with capacity bytes of memory and
// the default layout.
func NewSimVMM(ordinal int, capacity uint64) (*SimVMM, error) {
	return NewSimVMMWith(ordinal, capacity, VMMLayout{})
}

// The simulated VMM devices' VA: device d reserves in [simVMMVABase +
// d*simVMMVAWindow, + simVMMVAWindow), above every simulated pool's range
// (simBase + 64 devices x at most 4 PiB each). A window holds eight
// segments of the largest simulated device (1 PiB).
const (
	simVMMVABase   = uintptr(1) << 60
	simVMMVAWindow = uintptr(1) << 53
)

// NewSimVMMWith makes a simulated VMM device with capacity bytes of
// memory laid out as l says.
func NewSimVMMWith(ordinal int, capacity uint64, l VMMLayout) (*SimVMM, error) {
	if capacity == 0 {
		capacity = DefaultSimMemory
	}
	if ordinal < 0 || ordinal >= maxSimDevices {
		return nil, fmt.Errorf("sim: VMM device %d: outside %d devices", ordinal, maxSimDevices)
	}
	gran, err := l.granule(simVMMGranule, capacity)
	if err != nil {
		return nil, err
	}
	sim := NewSim(ordinal, capacity)
	phys := NewFakePhys(sim, capacity, gran)
	// Its handles are exportable, as descriptors of this process
	// (vmm_fake_ipc.go).
	phys.attachSim(ordinal)
	// Each device reserves VA in a window of its own, as a real process's
	// devices share one address space: a pointer names its device.
	start := simVMMVABase + uintptr(ordinal)*simVMMVAWindow
	phys.SetVAWindow(start, start+simVMMVAWindow)
	src, err := newVMMSource(phys, capacity, 0)
	if err != nil {
		return nil, err
	}
	return &SimVMM{Sim: sim, phys: phys, src: src, capacity: capacity}, nil
}

// Phys is the fake driver under the device, for tests.
func (d *SimVMM) Phys() *FakePhys { return d.phys }

func (d *SimVMM) refuseCapture(op string, s Stream) error {
	if st, _ := d.Sim.CaptureStatus(s); st != CaptureNone {
		return fmt.Errorf("sim: %s on stream %#x, which is being captured", op, s)
	}
	return nil
}

func (d *SimVMM) Alloc(size uint64, s Stream) (uintptr, error) {
	if err := d.refuseCapture("VMM alloc", s); err != nil {
		return 0, err
	}
	return d.src.alloc(size, s)
}

// AllocUncaptured places memory any stream may use at once: VMM calls are
// not stream-ordered, so nothing is added to a graph.
func (d *SimVMM) AllocUncaptured(size uint64) (uintptr, error) { return d.src.alloc(size, anyStream) }

// Free is ordered on s by an event recorded there, which would be a graph
// node during a capture: refused then, as the caching layer never does it.
func (d *SimVMM) Free(ptr uintptr, size uint64, s Stream) error {
	if err := d.refuseCapture("VMM free", s); err != nil {
		return err
	}
	return d.src.free(ptr, size, s)
}

// Synchronize completes all work, as Sim's does, and then tells the
// placement, as the CUDA VMM device does.
func (d *SimVMM) Synchronize() error { return d.src.synchronize(d.Sim.Synchronize) }

func (d *SimVMM) Trim(keep uint64) error           { return d.src.trim(keep) }
func (d *SimVMM) SetReleaseThreshold(uint64) error { return nil }
func (d *SimVMM) PoolUsage() (PoolUsage, error)    { return d.src.usage(), nil }
func (d *SimVMM) ResetPoolHigh() error             { d.src.resetHigh(); return nil }
func (d *SimVMM) SetCap(limit uint64)              { d.src.setCap(limit) }
func (d *SimVMM) SetCaptureUnderway(underway bool) { d.src.setCaptureUnderway(underway) }
func (d *SimVMM) CheckInvariants() error           { return d.src.checkInvariants() }

// Sleeper's methods: the placement's sleep and wake over the fake driver,
// whose copies keep the bytes written to the device (vmm_fake_data.go).
func (d *SimVMM) SetAllocTag(tag Tag)                         { d.src.setAllocTag(tag) }
func (d *SimVMM) Sleep(req SleepRequest) (SleepReport, error) { return d.src.sleep(req) }
func (d *SimVMM) Wake(tag Tag) (WakeReport, error)            { return d.src.wake(tag) }
func (d *SimVMM) SleepState() SleepState                      { return d.src.sleepState() }
func (d *SimVMM) PrepareOffload(size uint64) (uint64, error)  { return d.src.prepareOffload(size) }

// Sharer's methods: the placement's export and import over the fake
// driver, whose descriptors live in the simulated devices' kernel.
func (d *SimVMM) ExportIPC(ptr uintptr, size uint64) (IPCExport, error) {
	return d.src.exportIPC(ptr, size)
}
func (d *SimVMM) ImportIPC(x IPCExport) (uintptr, error) { return d.src.importIPC(x) }
func (d *SimVMM) CloseIPC(base uintptr) error            { return d.src.closeIPC(base) }

// MemInfo is what cuMemGetInfo would say: the device less the physical
// memory held.
func (d *SimVMM) MemInfo() (free, total uint64, err error) {
	return d.capacity - d.phys.Used(), d.capacity, nil
}

func (d *SimVMM) Close() error {
	err := d.src.close()
	_ = d.Sim.Close()
	return err
}

// Capped is a device whose physical memory can be capped: the VMM devices.
// The caching layer sets the cap with its own (set_per_process_memory_fraction),
// so that the cap bounds the bytes the device holds, not only goalloc's
// own count of them.
type Capped interface {
	SetCap(limit uint64)
}

// DriverCalls is DriverProfiler's method: the calls' times are the fake
// driver's, only their counts say something of a GPU.
func (d *SimVMM) DriverCalls() []DriverCallStat { return d.src.DriverCalls() }

// Calls counts the driver calls the device made so far, by driver function.
func (d *SimVMM) Calls() map[string]int {
	d.phys.mu.Lock()
	defer d.phys.mu.Unlock()
	out := make(map[string]int, len(d.phys.Calls))
	for k, v := range d.phys.Calls {
		out[k] = v
	}
	return out
}

// StreamGranular is a device whose streams never share a physical handle:
// the VMM devices, where a stream's memory lies in its own segments. A
// stream that holds anything makes the device hold at least one handle for
// it, which is what the caching layer's budget for memory kept per stream
// counts (caching/retention.go).
type StreamGranular interface {
	// StreamGranule is the bytes of a handle: the least the device holds
	// for a stream that holds anything.
	StreamGranule() uint64
}

// StreamGranule is StreamGranular's method.
func (d *SimVMM) StreamGranule() uint64 { return d.src.gran }
