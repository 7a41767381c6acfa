// Package addrmap is a hash map from device addresses to small values: the
// lookups goalloc makes on every free (which block starts at this
// address?) and on every cache miss.
//
// Why not a Go map. A Go map lookup hashes the key with the process's
// seed, then reads the map's header, its directory and a group's control
// word before the slot: in the ResNet-50 replay with a buffer walked
// between calls, as PyTorch's own work does in training, lookups in Go's
// maps were a sixth of the first-level cache misses inside goalloc's calls
// (tests/misspath_compare.sh). Here a lookup multiplies the address by a
// constant and reads the slot it lands on, usually one cache line, beside
// the Map value itself.
//
// How. Open addressing with linear probing in a power-of-two table kept at
// most half full, Fibonacci hashing (the key times 2^64/phi, the top bits:
// device addresses are aligned, so their low bits say nothing), and
// deletion by shifting the entries after the deleted one back (no
// tombstones), so a lookup stops at the first empty slot. Key 0 marks an
// empty slot: no device allocation starts at address 0. Iteration is in
// table order: deterministic for a given sequence of changes, unlike a Go
// map's.
package addrmap

import "math/bits"

// Map maps nonzero addresses to values of type V. The zero Map is empty and
// ready to use. It is not safe for concurrent use.
type Map[V any] struct {
	// slots has a power-of-two length, 0 before the first Put. Invariant:
	// n < len(slots)/2+1 after every call, every key sits at or after its
	// home slot with no empty slot between, and keys are unique.
	slots []entry[V]
	shift uint // 64 - log2(len(slots))
	n     int
}

type entry[V any] struct {
	key uintptr // 0: empty
	val V
}

const minSlots = 16

// home is key's first slot.
func (m *Map[V]) home(key uintptr) int {
	return int((uint64(key) * 0x9E3779B97F4A7C15) >> m.shift)
}

// Len is the number of keys.
func (m *Map[V]) Len() int { return m.n }

// Get returns the value at key and whether key is there.
func (m *Map[V]) Get(key uintptr) (V, bool) {
	if m.n > 0 && key != 0 {
		mask := len(m.slots) - 1
		for i := m.home(key); ; i = (i + 1) & mask {
			e := &m.slots[i]
			if e.key == key {
				return e.val, true
			}
			if e.key == 0 {
				break
			}
		}
	}
	var zero V
	return zero, false
}

// Put sets key's value. Key 0 panics: it marks an empty slot.
func (m *Map[V]) Put(key uintptr, val V) {
	if key == 0 {
		panic("addrmap: key 0")
	}
	if 2*(m.n+1) > len(m.slots) {
		m.grow()
	}
	mask := len(m.slots) - 1
	for i := m.home(key); ; i = (i + 1) & mask {
		e := &m.slots[i]
		if e.key == key {
			e.val = val
			return
		}
		if e.key == 0 {
			*e = entry[V]{key, val}
			m.n++
			return
		}
	}
}

// Delete removes key, and says whether it was there.
func (m *Map[V]) Delete(key uintptr) bool {
	if m.n == 0 || key == 0 {
		return false
	}
	mask := len(m.slots) - 1
	i := m.home(key)
	for m.slots[i].key != key {
		if m.slots[i].key == 0 {
			return false
		}
		i = (i + 1) & mask
	}
	// Shift back each later entry of the run that may move into the hole:
	// one whose home is not cyclically in (hole, its slot].
	for j := (i + 1) & mask; m.slots[j].key != 0; j = (j + 1) & mask {
		if h := m.home(m.slots[j].key); (j-h)&mask >= (j-i)&mask {
			m.slots[i] = m.slots[j]
			i = j
		}
	}
	m.slots[i] = entry[V]{}
	m.n--
	return true
}

// Range calls f for each key and value, in table order, until f returns
// false. f must not change the map.
func (m *Map[V]) Range(f func(key uintptr, val V) bool) {
	for i := range m.slots {
		if e := &m.slots[i]; e.key != 0 && !f(e.key, e.val) {
			return
		}
	}
}

// Clear removes every key and keeps the table.
func (m *Map[V]) Clear() {
	clear(m.slots)
	m.n = 0
}

func (m *Map[V]) grow() {
	old := m.slots
	size := max(minSlots, 2*len(old))
	m.slots = make([]entry[V], size)
	m.shift = uint(64 - bits.TrailingZeros(uint(size)))
	m.n = 0
	for _, e := range old {
		if e.key != 0 {
			m.Put(e.key, e.val)
		}
	}
}
