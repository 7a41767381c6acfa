package addrmap

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// check verifies the invariants: the count, at most half full, every key
// unique and reachable from its home slot with no empty slot between.
func (m *Map[V]) check() error {
	n := 0
	seen := map[uintptr]bool{}
	mask := len(m.slots) - 1
	for i, e := range m.slots {
		if e.key == 0 {
			continue
		}
		n++
		if seen[e.key] {
			return fmt.Errorf("key %#x twice", e.key)
		}
		seen[e.key] = true
		for j := m.home(e.key); j != i; j = (j + 1) & mask {
			if m.slots[j].key == 0 {
				return fmt.Errorf("key %#x at %d, an empty slot at %d after its home", e.key, i, j)
			}
		}
	}
	if n != m.n {
		return fmt.Errorf("%d keys, %d counted", n, m.n)
	}
	if len(m.slots) > 0 && 2*m.n > len(m.slots) {
		return fmt.Errorf("%d keys in %d slots", m.n, len(m.slots))
	}
	return nil
}

// TestMapAgreesWithAGoMap runs random puts, gets and deletes of addresses
// drawn from a small set (so that runs of colliding keys form, wrap around
// the table's end and are cut by deletes) against a Go map, checking the
// invariants after every step.
func TestMapAgreesWithAGoMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var m Map[int32]
	want := map[uintptr]int32{}
	keys := make([]uintptr, 300)
	for i := range keys {
		keys[i] = uintptr(0x7f0000000000 + rng.IntN(1<<20)*512)
	}
	for step := 0; step < 50_000; step++ {
		k := keys[rng.IntN(len(keys))]
		switch op := rng.IntN(10); {
		case op < 4:
			v := int32(step)
			m.Put(k, v)
			want[k] = v
		case op < 7:
			_, had := want[k]
			assert.Equal(t, had, m.Delete(k), "delete %#x", k)
			delete(want, k)
		default:
			v, ok := m.Get(k)
			w, wok := want[k]
			assert.Equal(t, wok, ok, "get %#x", k)
			assert.Equal(t, w, v)
		}
		if step%97 == 0 || step < 2000 {
			require.NoError(t, m.check(), "step %d", step)
		}
		require.Equal(t, len(want), m.Len())
	}
	got := map[uintptr]int32{}
	m.Range(func(k uintptr, v int32) bool { got[k] = v; return true })
	assert.Equal(t, want, got)
	for k := range want {
		require.True(t, m.Delete(k))
	}
	assert.Zero(t, m.Len())
	require.NoError(t, m.check())
}

// TestMapDeleteShiftsAWrappedRunBack fills the table's last slots and its
// first ones with keys of one home, deletes from the middle of the run, and
// finds every other key still.
func TestMapDeleteShiftsAWrappedRunBack(t *testing.T) {
	var m Map[int]
	m.Put(1<<40, 0) // sizes the table
	m.Delete(1 << 40)
	last := len(m.slots) - 1
	var run []uintptr
	for k := uintptr(512); len(run) < 5; k += 512 {
		if m.home(k) == last {
			run = append(run, k)
		}
	}
	for i, k := range run {
		m.Put(k, i)
	}
	require.NoError(t, m.check())
	assert.NotZero(t, m.slots[0].key, "the run wraps past the table's end")
	require.True(t, m.Delete(run[1]))
	require.NoError(t, m.check())
	for i, k := range run {
		v, ok := m.Get(k)
		assert.Equal(t, i != 1, ok, "key %d", i)
		if ok {
			assert.Equal(t, i, v)
		}
	}
}

func TestMapZeroValueAndKeyZero(t *testing.T) {
	var m Map[string]
	_, ok := m.Get(4096)
	assert.False(t, ok)
	assert.False(t, m.Delete(4096))
	m.Range(func(uintptr, string) bool { t.Fatal("an empty map has no keys"); return false })
	assert.Panics(t, func() { m.Put(0, "x") })
	m.Put(4096, "a")
	m.Put(4096, "b")
	v, ok := m.Get(4096)
	assert.True(t, ok)
	assert.Equal(t, "b", v)
	assert.Equal(t, 1, m.Len())
	m.Clear()
	assert.Zero(t, m.Len())
	_, ok = m.Get(4096)
	assert.False(t, ok)
}

// TestMapGetAllocatesNothing: a lookup is on goalloc's cache-hit path,
// which allocates nothing on the Go heap.
func TestMapGetAllocatesNothing(t *testing.T) {
	var m Map[int32]
	for i := 1; i <= 1000; i++ {
		m.Put(uintptr(i)<<9, int32(i))
	}
	assert.Zero(t, testing.AllocsPerRun(100, func() { _, _ = m.Get(500 << 9) }))
}
