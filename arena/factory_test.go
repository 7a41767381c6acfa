package arena

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNewDeviceMakesEachSimulatedKind(t *testing.T) {
	for _, c := range []struct {
		spec DeviceSpec
		want Device
		mem  uint64
	}{
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync}, &Sim{}, DefaultSimMemory},
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync, SimMemory: 1 << 30}, &Sim{}, 1 << 30},
		{DeviceSpec{Kind: KindSim, Backend: BackendVMM}, &SimVMM{}, DefaultSimMemory},
		{DeviceSpec{Kind: KindSim, Backend: BackendVMM, SimMemory: 1 << 30,
			Layout: VMMLayout{Handle: 4 << 20}}, &SimVMM{}, 1 << 30},
		// GOALLOC_CONF keeps a layout whatever the backend: async ignores it.
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync, Layout: VMMLayout{Handle: 4 << 20}}, &Sim{}, DefaultSimMemory},
	} {
		dev, err := NewDevice(c.spec, 3)
		require.NoError(t, err, "%+v", c.spec)
		require.IsType(t, c.want, dev, "%+v", c.spec)
		require.Equal(t, 3, dev.Ordinal())
		_, total, err := dev.MemInfo()
		require.NoError(t, err)
		require.Equal(t, c.mem, total, "%+v", c.spec)
		p, err := dev.Alloc(1<<20, 0)
		require.NoError(t, err)
		require.NoError(t, dev.Free(p, 1<<20, 0))
		require.NoError(t, dev.Close())
	}
	// The layout reaches the VMM device: 4 MiB handles, one per 1 MiB request.
	dev, err := NewDevice(DeviceSpec{Kind: KindSim, Backend: BackendVMM, SimMemory: 1 << 30,
		Layout: VMMLayout{Handle: 4 << 20}}, 0)
	require.NoError(t, err)
	defer dev.Close()
	_, err = dev.Alloc(1<<20, 0)
	require.NoError(t, err)
	u, err := dev.PoolUsage()
	require.NoError(t, err)
	require.Equal(t, uint64(4<<20), u.ReservedCurrent)
}

func TestNewDeviceMakesTheCUDAKindsOrSaysWhyNot(t *testing.T) {
	for _, backend := range Backends {
		spec := DeviceSpec{Kind: KindCUDA, Backend: backend}
		require.NoError(t, spec.Check())
		dev, err := NewDevice(spec, 0)
		if n, cerr := CUDADeviceCount(); cerr != nil || n == 0 {
			require.Error(t, err, backend)
			// A nil *CUDA or *VMM must not come back as a non-nil Device.
			require.True(t, dev == nil, "%s: %#v", backend, dev)
			continue
		}
		require.NoError(t, err, backend)
		want := map[string]Device{BackendVMM: &VMM{}, BackendAsync: &CUDA{}}[backend]
		require.IsType(t, want, dev)
		require.NoError(t, dev.Close())
	}
}

func TestNewDeviceRefusesWhatItCannotMake(t *testing.T) {
	for _, c := range []struct {
		spec    DeviceSpec
		ordinal int
		want    string
	}{
		{DeviceSpec{Kind: "tpu", Backend: BackendVMM}, 0, `arena: unknown device kind "tpu" (want sim or cuda)`},
		{DeviceSpec{Kind: "", Backend: BackendVMM}, 0, `arena: unknown device kind "" (want sim or cuda)`},
		{DeviceSpec{Kind: "CUDA", Backend: BackendAsync}, 0, `arena: unknown device kind "CUDA" (want sim or cuda)`},
		{DeviceSpec{Kind: KindSim, Backend: "tape"}, 0, `arena: unknown memory backend "tape" (want vmm or async)`},
		{DeviceSpec{Kind: KindSim}, 0, `arena: unknown memory backend "" (want vmm or async)`},
		{DeviceSpec{Kind: KindCUDA, Backend: "expandable"}, 0, `arena: unknown memory backend "expandable" (want vmm or async)`},
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync, SimMemory: 1000}, 0, "arena: simulated device memory: 1000 bytes is outside [1 MiB, 1 PiB]"},
		{DeviceSpec{Kind: KindSim, Backend: BackendVMM, SimMemory: 2 * MaxSimMemory}, 0, "arena: simulated device memory: "},
		{DeviceSpec{Kind: KindCUDA, Backend: BackendVMM, SimMemory: 1 << 30}, 0, "arena: a simulated memory size (1073741824 bytes) given for a cuda device; it sizes the sim device only"},
		{DeviceSpec{Kind: KindSim, Backend: BackendVMM, Layout: VMMLayout{Handle: 3 << 20}}, 0, "arena: VMM layout: VMM handle size 3145728 is not a power of two"},
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync}, -1, "arena: device -1: an ordinal is 0 or more"},
		{DeviceSpec{Kind: KindSim, Backend: BackendAsync}, maxSimDevices, "sim: device 64: outside 64 devices"},
		{DeviceSpec{Kind: KindSim, Backend: BackendVMM}, maxSimDevices, "sim: VMM device 64: outside 64 devices"},
		{DeviceSpec{Kind: KindCUDA, Backend: BackendVMM}, -1, "arena: device -1: an ordinal is 0 or more"},
	} {
		dev, err := NewDevice(c.spec, c.ordinal)
		require.ErrorContains(t, err, c.want, "%+v on %d", c.spec, c.ordinal)
		require.True(t, dev == nil, "%#v", dev)
		if c.ordinal == 0 {
			require.Error(t, c.spec.Check(), "%+v", c.spec)
		}
	}
}
