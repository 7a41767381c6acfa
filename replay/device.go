package replay

import "github.com/goalloc/goalloc/arena"

// countingDevice wraps the device a policy runs on and watches what crosses
// it, the same way for every policy: the calls that reach the device and the
// bytes the policy holds from it (its reserved bytes, whatever its own
// accounting says) are arena's Counting adaptor, the one the caching
// allocator stacks under its cache; on top, the pool's reserved bytes.
//
// The pool's reserved bytes change only when the pool maps memory (an Alloc
// it cannot serve from what it has) or unmaps it (Trim, or a Synchronize
// with a release threshold below the maximum), so reading them after those
// calls, and never per event, follows them exactly at no cost to the replay.
//
// The replay drives it from one goroutine; the device under it keeps its
// own lock.
type countingDevice struct {
	arena.Device
	counts       *arena.Counting
	poolReserved uint64 // the pool's ReservedCurrent after the last call that can change it
	poolErr      error  // the first failure to read the pool's figures
}

func newCountingDevice(dev arena.Device) *countingDevice {
	d := &countingDevice{Device: dev, counts: arena.NewCounting(dev)}
	d.readPool()
	return d
}

// asDevice is d as the policy sees it: over a device that caps its own
// physical memory (arena.Capped, the VMM backend) it stays one, so that a
// cache above passes its cap down and reports the device's figure, as it
// does in the library. (Over the stream-ordered pool the cache caps the
// pool itself, arena.PoolCapped over d.)
func (d *countingDevice) asDevice() arena.Device {
	if _, ok := d.Device.(arena.Capped); ok {
		return cappedCountingDevice{d}
	}
	return d
}

// cappedCountingDevice is a countingDevice over an arena.Capped device.
type cappedCountingDevice struct{ *countingDevice }

func (d cappedCountingDevice) SetCap(limit uint64) { d.Device.(arena.Capped).SetCap(limit) }

// StreamGranule passes the device's own on (arena.StreamGranular), so that
// the cache above keeps what it keeps in the library; 0, a device whose
// streams may share handles, where the device has none.
func (d cappedCountingDevice) StreamGranule() uint64 {
	if g, ok := d.Device.(arena.StreamGranular); ok {
		return g.StreamGranule()
	}
	return 0
}

func (d *countingDevice) readPool() {
	u, err := d.Device.PoolUsage()
	if err != nil {
		if d.poolErr == nil {
			d.poolErr = err
		}
		return
	}
	d.poolReserved = u.ReservedCurrent
}

func (d *countingDevice) Alloc(size uint64, s arena.Stream) (uintptr, error) {
	p, err := d.counts.Alloc(size, s)
	if err == nil {
		d.readPool()
	}
	return p, err
}

func (d *countingDevice) AllocUncaptured(size uint64) (uintptr, error) {
	p, err := d.counts.AllocUncaptured(size)
	if err == nil {
		d.readPool()
	}
	return p, err
}

func (d *countingDevice) Free(ptr uintptr, size uint64, s arena.Stream) error {
	return d.counts.Free(ptr, size, s)
}

func (d *countingDevice) Trim(keep uint64) error {
	err := d.Device.Trim(keep)
	d.readPool()
	return err
}

func (d *countingDevice) Synchronize() error {
	err := d.Device.Synchronize()
	d.readPool()
	return err
}
