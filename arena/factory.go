package arena

import (
	"fmt"
	"math"
	"strings"
)

// The kinds of device NewDevice makes: the simulated device or a GPU
// through the CUDA driver (GOALLOC_DEVICE, the replay tool's --device).
const (
	KindSim  = "sim"
	KindCUDA = "cuda"
)

// The memory backends (GOALLOC_CONF's backend): handles goalloc maps
// itself (VMM, SimVMM) or the driver's stream-ordered pool (CUDA, Sim).
const (
	BackendVMM   = "vmm"
	BackendAsync = "async"
)

// DeviceKinds and Backends list the names NewDevice takes.
var (
	DeviceKinds = []string{KindSim, KindCUDA}
	Backends    = []string{BackendVMM, BackendAsync}
)

// DeviceSpec says which device NewDevice makes. The library (package
// export) and the replay tool fill it in from their settings and make every
// device with it, so that the two choose a device the same way.
type DeviceSpec struct {
	// Kind is KindSim or KindCUDA.
	Kind string
	// Backend is BackendVMM or BackendAsync.
	Backend string
	// Layout is how BackendVMM lays memory out (vmm_handle); the zero
	// layout is the default. BackendAsync
	// ignores it (GOALLOC_CONF keeps one whatever the backend).
	Layout VMMLayout
	// SimMemory is the simulated device's memory in bytes, 0 for
	// DefaultSimMemory. Only KindSim has one.
	SimMemory uint64
}

// Check says what is wrong with s, if anything, without making a device.
func (s DeviceSpec) Check() error {
	switch s.Kind {
	case KindSim:
		if s.SimMemory != 0 {
			if err := CheckSimMemory(s.SimMemory); err != nil {
				return fmt.Errorf("arena: simulated device memory: %w", err)
			}
		}
	case KindCUDA:
		if s.SimMemory != 0 {
			return fmt.Errorf("arena: a simulated memory size (%d bytes) given for a %s device; it sizes the %s device only", s.SimMemory, KindCUDA, KindSim)
		}
	default:
		return fmt.Errorf("arena: unknown device kind %q (want %s)", s.Kind, strings.Join(DeviceKinds, " or "))
	}
	switch s.Backend {
	case BackendVMM:
		if err := s.Layout.Check(); err != nil {
			return fmt.Errorf("arena: VMM layout: %w", err)
		}
	case BackendAsync:
	default:
		return fmt.Errorf("arena: unknown memory backend %q (want %s)", s.Backend, strings.Join(Backends, " or "))
	}
	return nil
}

// NewDevice makes device ordinal as s says: the one place where a kind and
// a backend become a device.
//
//	sim,  vmm    SimVMM (NewSimVMMWith), laid out as s.Layout says
//	sim,  async  Sim (NewSim), a simulated stream-ordered pool
//	cuda, vmm    VMM (NewVMMWith), laid out as s.Layout says
//	cuda, async  CUDA (NewCUDA), a private stream-ordered pool
//
// A stream-ordered pool starts with its release threshold at the maximum
// (it keeps what is freed to it); whoever owns the device sets another
// with SetReleaseThreshold (caching.New sets its Config's).
func NewDevice(s DeviceSpec, ordinal int) (Device, error) {
	if err := s.Check(); err != nil {
		return nil, err
	}
	if ordinal < 0 {
		return nil, fmt.Errorf("arena: device %d: an ordinal is 0 or more", ordinal)
	}
	// Each constructor's error is returned alone: a nil *SimVMM, *VMM or
	// *CUDA must not become a non-nil Device.
	switch {
	case s.Kind == KindSim && s.Backend == BackendVMM:
		d, err := NewSimVMMWith(ordinal, s.SimMemory, s.Layout)
		if err != nil {
			return nil, err
		}
		return d, nil
	case s.Kind == KindSim:
		if ordinal >= maxSimDevices {
			return nil, fmt.Errorf("sim: device %d: outside %d devices", ordinal, maxSimDevices)
		}
		return NewSim(ordinal, s.SimMemory), nil
	case s.Backend == BackendVMM:
		d, err := NewVMMWith(ordinal, s.Layout)
		if err != nil {
			return nil, err
		}
		return d, nil
	default:
		d, err := NewCUDA(ordinal, math.MaxUint64)
		if err != nil {
			return nil, err
		}
		return d, nil
	}
}
