package replay

import "github.com/goalloc/goalloc/arena"

// countingDevice wraps the device a policy runs on and watches what crosses
// it, the same way for every policy: how many allocations and frees reach
// the device, how many bytes the policy holds from it (its reserved bytes,
// whatever its own accounting says), and the pool's reserved bytes.
//
// The pool's reserved bytes change only when the pool maps memory (an Alloc
// it cannot serve from what it has) or unmaps it (Trim, or a Synchronize
// with a release threshold below the maximum), so reading them after those
// calls, and never per event, follows them exactly at no cost to the replay.
//
// The replay drives it from one goroutine, so it takes no lock; the device
// under it keeps its own.
type countingDevice struct {
	arena.Device
	allocs, frees uint64
	held          uint64 // bytes allocated from the device and not freed
	poolReserved  uint64 // the pool's ReservedCurrent after the last call that can change it
	poolErr       error  // the first failure to read the pool's figures
}

func newCountingDevice(dev arena.Device) *countingDevice {
	d := &countingDevice{Device: dev}
	d.readPool()
	return d
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
	p, err := d.Device.Alloc(size, s)
	if err == nil {
		d.allocs++
		d.held += size
		d.readPool()
	}
	return p, err
}

func (d *countingDevice) Free(ptr uintptr, size uint64, s arena.Stream) error {
	err := d.Device.Free(ptr, size, s)
	if err == nil {
		d.frees++
		d.held -= size
	}
	return err
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
