package arena

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSimStreamOrderedReuse(t *testing.T) {
	d := NewSim(0, 1<<30)
	d.SetManual(true)
	p, err := d.Alloc(4<<20, 1)
	require.NoError(t, err)
	require.Zero(t, p%512)
	d.Launch(1)
	require.NoError(t, d.Free(p, 4<<20, 1))
	q, err := d.Alloc(4<<20, 2)
	require.NoError(t, err)
	assert.NotEqual(t, p, q, "stream 2 must not get memory stream 1 may still use")
	r, err := d.Alloc(4<<20, 1)
	require.NoError(t, err)
	assert.Equal(t, p, r, "stream 1 reuses its own free at once")
	require.NoError(t, d.Free(r, 4<<20, 1))
	d.Complete(1)
	s, err := d.Alloc(4<<20, 2)
	require.NoError(t, err)
	assert.Equal(t, p, s, "once the free completed, any stream may reuse it")
}

func TestSimPendingRemainderStaysPending(t *testing.T) {
	d := NewSim(0, 1<<30)
	d.SetManual(true)
	p, err := d.Alloc(8<<20, 1)
	require.NoError(t, err)
	require.NoError(t, d.Free(p, 8<<20, 1))
	q, err := d.Alloc(2<<20, 1) // takes the front of the pending range
	require.NoError(t, err)
	assert.Equal(t, p, q)
	r, err := d.Alloc(2<<20, 2)
	require.NoError(t, err)
	assert.False(t, r >= p && r < p+8<<20, "the rest of the range is still pending on stream 1")
}

func TestSimReservedCoalescingTrimAndCapacity(t *testing.T) {
	d := NewSim(0, 64<<20)
	a, _ := d.Alloc(3<<20, 0)
	b, _ := d.Alloc(1<<20, 0)
	u, _ := d.PoolUsage()
	assert.EqualValues(t, 32<<20, u.ReservedCurrent, "both fit in the first 32 MiB chunk")
	require.NoError(t, d.Free(a, 3<<20, 0))
	require.NoError(t, d.Free(b, 1<<20, 0))
	c, err := d.Alloc(4<<20, 0)
	require.NoError(t, err)
	assert.Equal(t, a, c)
	big, err := d.Alloc(40<<20, 0) // reaches into a second chunk
	require.NoError(t, err)
	u, _ = d.PoolUsage()
	assert.EqualValues(t, 64<<20, u.ReservedCurrent)
	require.NoError(t, d.Free(big, 40<<20, 0))
	u, _ = d.PoolUsage()
	assert.EqualValues(t, 64<<20, u.ReservedCurrent, "chunks stay mapped until a trim")
	require.NoError(t, d.Free(c, 4<<20, 0))
	_, err = d.Alloc(100<<20, 0)
	assert.True(t, errors.Is(err, ErrOutOfMemory), "64 MiB of capacity")
	require.NoError(t, d.Trim(0))
	u, _ = d.PoolUsage()
	assert.Zero(t, u.ReservedCurrent)
	assert.EqualValues(t, 64<<20, u.ReservedHigh)
	require.Error(t, d.Free(c, 4<<20, 0), "double free is caught")
}

func TestSimEventsAndStall(t *testing.T) {
	d := NewSim(0, 1<<30)
	d.SetManual(true)
	e, err := d.NewEvent()
	require.NoError(t, err)
	done, _ := d.EventDone(e)
	assert.True(t, done, "an event never recorded is complete")
	d.Launch(3)
	require.NoError(t, d.RecordEvent(e, 3))
	done, _ = d.EventDone(e)
	assert.False(t, done)
	d.Complete(3)
	done, _ = d.EventDone(e)
	assert.True(t, done)
	d.Stall(4)
	d.Launch(4)
	require.NoError(t, d.RecordEvent(e, 4))
	require.Error(t, d.Synchronize(), "a stalled stream makes synchronisation hang")
	done, _ = d.EventDone(e)
	assert.False(t, done)
	require.NoError(t, d.DestroyEvent(e))
	assert.Zero(t, d.Events())
}

// Devices of more than 1 TiB each get address ranges that do not overlap
// (device d used to start only d TiB above device 0).
func TestSimDevicesNeverShareAnAddress(t *testing.T) {
	const capacity = 4 << 40
	var ranges [][2]uintptr
	for d := 0; d < 3; d++ {
		dev := NewSim(d, capacity)
		p, err := dev.Alloc(3<<40, 0)
		require.NoError(t, err)
		ranges = append(ranges, [2]uintptr{p, p + 3<<40})
	}
	for i := range ranges {
		for j := i + 1; j < len(ranges); j++ {
			assert.False(t, ranges[i][0] < ranges[j][1] && ranges[j][0] < ranges[i][1],
				"device %d %#x and device %d %#x overlap", i, ranges[i], j, ranges[j])
		}
	}
	require.Error(t, CheckSimMemory(MaxSimMemory+1))
	require.Error(t, CheckSimMemory(1<<19))
	require.NoError(t, CheckSimMemory(capacity))
	assert.Panics(t, func() { NewSim(0, MaxSimMemory+1) })
}

// A pool whose range would grow into the next device's refuses instead.
func TestSimPoolStaysInItsRange(t *testing.T) {
	d := NewSim(0, 1<<30)
	d.pool.span = 256 << 20 // a small range, to reach its end
	a, err := d.Alloc(200<<20, 0)
	require.NoError(t, err)
	b, err := d.Alloc(1<<20, 0)
	require.NoError(t, err)
	require.NoError(t, d.Free(a, 200<<20, 0))
	_, err = d.Alloc(201<<20, 0) // does not fit in a's place: would go past b
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.NoError(t, d.Free(b, 1<<20, 0))
}
