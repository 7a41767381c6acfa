package arena

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The profile counts every driver call the engine makes, each under its
// own name: on the simulated device its counts are the fake driver's own,
// call for call, and a free on another stream records an event.
func TestDriverCallsCountEveryCall(t *testing.T) {
	d, err := NewSimVMM(0, 1<<30)
	require.NoError(t, err)
	defer d.Close()
	const s1, s2 = Stream(1), Stream(2)
	p, err := d.Alloc(5<<20, s1)
	require.NoError(t, err)
	q, err := d.Alloc(64<<10, s1)
	require.NoError(t, err)
	require.NoError(t, d.Free(p, 5<<20, s2))
	require.NoError(t, d.Free(q, 64<<10, s1))
	_, err = d.Alloc(7<<20, s1)
	require.NoError(t, err)

	profile := map[string]DriverCallStat{}
	for _, c := range d.DriverCalls() {
		require.NotContains(t, profile, c.Name)
		require.NotZero(t, c.Count, c.Name)
		profile[c.Name] = c
	}
	fake := d.Calls()
	require.NotEmpty(t, fake)
	for name, n := range fake {
		require.Equal(t, uint64(n), profile[name].Count, name)
	}
	require.Contains(t, profile, "cuEventRecord")
	require.GreaterOrEqual(t, profile["cuEventRecord"].Count, uint64(1))
	calls := d.DriverCalls()
	for i := 1; i < len(calls); i++ {
		require.GreaterOrEqual(t, calls[i-1].Nanos, calls[i].Nanos, "the most time first")
	}
}
