package streams

import (
	"errors"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/stretchr/testify/require"
)

const (
	sA arena.Stream = 0x100
	sB arena.Stream = 0x200
)

func manualSim(t *testing.T) *arena.Sim {
	t.Helper()
	d := arena.NewSim(0, 1<<30)
	d.SetManual(true)
	return d
}

func collect(d *DeferredFrees) []uintptr {
	var out []uintptr
	d.Poll(func(p uintptr) { out = append(out, p) })
	return out
}

func TestEventPoolReusesEvents(t *testing.T) {
	d := manualSim(t)
	p := NewEventPool(d)
	e1, err := p.Get()
	require.NoError(t, err)
	e2, err := p.Get()
	require.NoError(t, err)
	require.NotEqual(t, e1, e2)
	require.Equal(t, 2, p.InUse())
	p.Put(e1)
	e3, err := p.Get()
	require.NoError(t, err)
	require.Equal(t, e1, e3, "an idle event is handed out again before a new one is made")
	require.Equal(t, 2, p.Created)
	p.Put(e2)
	p.Put(e3)
	require.Equal(t, 0, p.InUse())
	p.Close()
	require.Equal(t, 0, d.Events(), "Close destroys every idle event")
}

// A free waits for every stream that used the block, and only for the work
// queued before the free: later work on those streams does not hold it.
func TestDeferredFreeWaitsForEveryStream(t *testing.T) {
	d := manualSim(t)
	events := NewEventPool(d)
	df := NewDeferredFrees(events)
	d.Launch(sA)
	d.Launch(sB)
	df.Add(0x1000, []arena.Stream{sA, sB})
	require.Equal(t, 1, df.Len())
	require.Empty(t, collect(df), "both streams still busy")

	d.Complete(sA)
	require.Empty(t, collect(df), "stream B is still busy")

	d.Launch(sB) // work queued after the free...
	d.Complete(sB)
	require.Equal(t, []uintptr{0x1000}, collect(df))
	require.Equal(t, 0, df.Len())
	require.Equal(t, 0, events.InUse(), "the events went back to the pool")
}

func TestDeferredFreesCompleteInOrder(t *testing.T) {
	d := manualSim(t)
	df := NewDeferredFrees(NewEventPool(d))
	for i := uintptr(1); i <= 4; i++ {
		d.Launch(sA)
		df.Add(i, []arena.Stream{sA})
	}
	d.Complete(sA)
	require.Equal(t, []uintptr{1, 2, 3, 4}, collect(df))
}

// An event that cannot be recorded cannot prove the free complete: the free
// then waits for a device-wide synchronisation (AllComplete), however often
// it is polled.
func TestFailedRecordWaitsForSynchronize(t *testing.T) {
	d := manualSim(t)
	d.SetFaults(arena.SimFaults{EventRecord: func(s arena.Stream) error {
		if s == sB {
			return errors.New("record failed")
		}
		return nil
	}})
	events := NewEventPool(d)
	df := NewDeferredFrees(events)
	df.Add(0x2000, []arena.Stream{sA, sB})
	require.Equal(t, 1, df.Errors)
	d.Complete(sA)
	d.Complete(sB)
	for i := 0; i < 3; i++ {
		require.Empty(t, collect(df), "poll %d must not complete a free whose event failed", i)
	}
	var done []uintptr
	require.Equal(t, 1, df.AllComplete(func(p uintptr) { done = append(done, p) }))
	require.Equal(t, []uintptr{0x2000}, done)
	require.Equal(t, 0, df.Len())
	require.Equal(t, 0, events.InUse())
}

func TestFailedQueryKeepsTheFreeWaiting(t *testing.T) {
	d := manualSim(t)
	events := NewEventPool(d)
	df := NewDeferredFrees(events)
	df.Add(0x3000, []arena.Stream{sA})
	d.SetFaults(arena.SimFaults{EventQuery: func(arena.Event) error { return errors.New("query failed") }})
	require.Empty(t, collect(df))
	require.Equal(t, 1, df.Errors)
	d.SetFaults(arena.SimFaults{})
	require.Empty(t, collect(df), "once a query failed, only a synchronisation completes the free")
	require.Equal(t, 1, df.AllComplete(func(uintptr) {}))
	require.Equal(t, 0, events.InUse())
}
