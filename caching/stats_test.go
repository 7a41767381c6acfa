package caching

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The statistics a request and a free update lie in as few cache lines as
// statCells' comment says: each row starts a 64-byte line, and the five
// fields every call updates fit in the first two of it.
func TestStatCellsLayout(t *testing.T) {
	assert.EqualValues(t, 24, unsafe.Sizeof(statCell{}))
	assert.EqualValues(t, 256, unsafe.Sizeof(statRow{}))
	assert.EqualValues(t, 768, unsafe.Sizeof(statCells{}))
	var r statRow
	assert.LessOrEqual(t, unsafe.Offsetof(r.cells)+uintptr(statActiveBytes+1)*24, uintptr(128),
		"the five fields of every call in two lines")
	assert.Less(t, unsafe.Offsetof(r.hits), uintptr(128), "a hit's count among them")
	for range 20 {
		a, _ := newTestAllocator(t, DefaultConfig())
		assert.Zero(t, uintptr(unsafe.Pointer(a.cells))%64, "statCells starts a cache line")
	}
}

// statCells reports what Stat's four figures were: Freed is what went out,
// and ResetAccumulatedStats starts allocated and freed again from now.
func TestStatCellsReportPyTorchsFourFigures(t *testing.T) {
	var c statCells
	c.add(StatSmall, statActive, 5)
	c.sub(StatSmall, statActive, 2)
	c.add(StatLarge, statActive, 1)
	var s Stats
	c.fill(&s)
	assert.Equal(t, Stat{Current: 3, Peak: 5, Allocated: 5, Freed: 2}, s.Active[StatSmall])
	assert.Equal(t, Stat{Current: 1, Peak: 1, Allocated: 1}, s.Active[StatLarge])
	assert.Equal(t, Stat{Current: 4, Peak: 5, Allocated: 6, Freed: 2}, s.Active[StatAll])
	assert.Equal(t, statArray{}, s.Segment, "other fields untouched")
	c.hit()
	c.hit()
	c.miss()
	c.fill(&s)
	assert.Equal(t, [2]int64{2, 1}, [2]int64{s.CacheHits, s.CacheMisses})
	c.resetAccumulated()
	c.resetPeaks()
	c.fill(&s)
	assert.Equal(t, Stat{Current: 4, Peak: 4, Allocated: 4}, s.Active[StatAll])
	assert.Equal(t, [2]int64{0, 0}, [2]int64{s.CacheHits, s.CacheMisses})
	// Every field lands in its own Stats field, named once in statArrays.
	require.Len(t, statArrays, int(numStatFields))
	for f := range numStatFields {
		var d statCells
		d.add(StatLarge, f, int64(f)+1)
		var got Stats
		d.fill(&got)
		for _, a := range statArrays {
			want := int64(0)
			if a.field == f {
				want = int64(f) + 1
			}
			require.Equal(t, want, a.of(&got)[StatLarge].Current, "field %d read as %s", f, a.name)
		}
	}
}

// What every call reads of the mutex fits in one cache line.
func TestStatsMutexHotFieldsInOneLine(t *testing.T) {
	var m statsMutex
	assert.LessOrEqual(t, unsafe.Offsetof(m.front)+unsafe.Sizeof(m.front), uintptr(64))
	assert.Less(t, unsafe.Offsetof(m.held)+unsafe.Offsetof(m.held.unpublished), uintptr(64))
}
