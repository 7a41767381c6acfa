// Wake: a sleeping tag's memory mapped again at its addresses, and its host
// copies restored. See Note [Sleep and wake] in vmm_sleep.go.

package arena

import (
	"errors"
	"fmt"
	"time"
)

// Wake maps the memory of the sleeping tag again, under its live spans, and
// copies back what sleep offloaded. Out of memory (the cap, the device)
// leaves the tag asleep, as it was.
func (e *vmmSegments) Wake(tag Tag) (WakeReport, error) {
	if !e.sleeping[tag] {
		return WakeReport{}, fmt.Errorf("arena: VMM: wake of memory tag %d: %w", tag, ErrNotAsleep)
	}
	if e.copier == nil {
		return WakeReport{}, ErrNoSleep
	}
	segs := e.segmentsOf([]Tag{tag}, true)
	// What a failed release left goes first: the free spans, and the
	// handles no live span needs.
	for _, g := range segs {
		if err := e.dropLeftovers(g); err != nil {
			return WakeReport{}, err
		}
	}
	var need uint64
	for _, g := range segs {
		need += uint64(len(e.missing(g))) * e.gran
	}
	if err := e.roomFor(need); err != nil {
		return WakeReport{}, fmt.Errorf("arena: VMM: wake of memory tag %d: %w", tag, err)
	}
	start := time.Now()
	if err := e.mapAsleep(segs); err != nil {
		return WakeReport{}, fmt.Errorf("arena: VMM: wake of memory tag %d: %w", tag, err)
	}
	rep := WakeReport{Mapped: need, Map: time.Since(start)}
	var items []copyItem
	var restored uint64
	for _, g := range segs {
		g.asleep = false
		e.refill(g)
		for base, c := range g.offloads {
			items = append(items, copyItem{g: g, va: base, size: c.size, host: c.host})
			restored += c.size
		}
		g.offloads = nil
	}
	delete(e.sleeping, tag)
	sortItems(items)
	start = time.Now()
	err := e.host.copyBack(e, items)
	rep.Restore = time.Since(start)
	e.host.used -= restored
	if err != nil {
		return rep, fmt.Errorf("arena: VMM: memory tag %d is awake, but its contents were not restored: %w", tag, err)
	}
	rep.Restored = restored
	return rep, nil
}

// sortItems puts copies in address order, so that neighbours coalesce.
func sortItems(items []copyItem) {
	for i := 1; i < len(items); i++ {
		for j := i; j > 0 && items[j].va < items[j-1].va; j-- {
			items[j], items[j-1] = items[j-1], items[j]
		}
	}
}

// dropLeftovers drops the free spans of the sleeping segment g and
// releases every handle it maps that no live span touches: what a release
// the driver failed left behind.
func (e *vmmSegments) dropLeftovers(g *vmmSegment) error {
	e.dropFreeSpans(g)
	want := e.touched(g)
	for k, m := range g.mapped {
		if m && !want[k] {
			if err := e.unmapGranule(g, g.base+uintptr(k)*uintptr(e.gran)); err != nil {
				return err
			}
			if err := e.releaseSpare(); err != nil {
				return err
			}
		}
	}
	return nil
}

// touched is the granules g's live spans touch.
func (e *vmmSegments) touched(g *vmmSegment) map[int]bool {
	want := map[int]bool{}
	for id := g.first; id != noSpan; id = g.next(id) {
		sp := g.span(id)
		for k := int((sp.base - g.base) / uintptr(e.gran)); k <= int((sp.end()-1-g.base)/uintptr(e.gran)); k++ {
			want[k] = true
		}
	}
	return want
}

// missing is the granules g's live spans touch that are not mapped, in
// order.
func (e *vmmSegments) missing(g *vmmSegment) []int {
	var out []int
	for id := g.first; id != noSpan; id = g.next(id) {
		sp := g.span(id)
		for k := int((sp.base - g.base) / uintptr(e.gran)); k <= int((sp.end()-1-g.base)/uintptr(e.gran)); k++ {
			if (k >= len(g.mapped) || !g.mapped[k]) && (len(out) == 0 || out[len(out)-1] != k) {
				out = append(out, k)
			}
		}
	}
	return out
}

// roomFor makes room for need bytes more under the cap and the device's
// memory: complete free memory is trimmed first where they would be
// passed, and if that is not enough, ErrOutOfMemory, before any mapping.
func (e *vmmSegments) roomFor(need uint64) error {
	limit := e.mem
	if e.cap > 0 && (limit == 0 || e.cap < limit) {
		limit = e.cap
	}
	if limit == 0 || e.held+need <= limit {
		return nil
	}
	if need > limit {
		return fmt.Errorf("%d bytes to map, more than the %d the cap or the device allows: %w", need, limit, ErrOutOfMemory)
	}
	if err := e.Trim(limit - need); err != nil {
		return err
	}
	if e.held+need > limit {
		return fmt.Errorf("%d bytes to map with %d held, above the %d the cap or the device allows: %w",
			need, e.held, limit, ErrOutOfMemory)
	}
	return nil
}

// mapAsleep maps a fresh handle on every granule the live spans of segs
// touch that is not mapped, and sets access over each run of them. A
// failure unmaps and releases everything it mapped.
func (e *vmmSegments) mapAsleep(segs []*vmmSegment) error {
	type granule struct {
		g  *vmmSegment
		va uintptr
	}
	var done []granule
	undo := func(err error) error {
		var errs []error
		for _, m := range done {
			errs = append(errs, e.unmapGranule(m.g, m.va))
		}
		return errors.Join(append([]error{err}, append(errs, e.releaseSpare())...)...)
	}
	for _, g := range segs {
		miss := e.missing(g)
		for _, k := range miss {
			va := g.base + uintptr(k)*uintptr(e.gran)
			h, err := e.drv.CreateHandle(e.gran)
			if err != nil {
				return undo(err)
			}
			e.held += e.gran
			e.heldHigh = max(e.heldHigh, e.held)
			if err := e.drv.Map(va, e.gran, h); err != nil {
				e.spare = append(e.spare, h)
				return undo(err)
			}
			e.setHandle(g, va, h)
			done = append(done, granule{g, va})
		}
		for i := 0; i < len(miss); {
			j := i + 1
			for j < len(miss) && miss[j] == miss[j-1]+1 {
				j++
			}
			va := g.base + uintptr(miss[i])*uintptr(e.gran)
			if err := e.drv.SetAccess(va, uint64(j-i)*e.gran); err != nil {
				return undo(err)
			}
			i = j
		}
	}
	return nil
}

// refill makes the parts of g's mapped granules that no live span covers
// free spans, complete: g has just woken, holding its live spans alone.
func (e *vmmSegments) refill(g *vmmSegment) {
	lo := g.base
	for id := g.first; ; id = g.next(id) {
		hi := g.end()
		if id != noSpan {
			hi = g.span(id).base
		}
		e.fillGap(g, lo, hi, id)
		if id == noSpan {
			return
		}
		lo = g.span(id).end()
	}
}

// fillGap makes a free span of each run of mapped granules within
// [lo, hi), linked before the span next (noSpan: after the last).
func (e *vmmSegments) fillGap(g *vmmSegment, lo, hi uintptr, next spanID) {
	gran := uintptr(e.gran)
	for at := lo; at < hi; {
		k := int((at - g.base) / gran)
		if k >= len(g.mapped) {
			return
		}
		end := min(hi, g.base+uintptr(k+1)*gran)
		if !g.mapped[k] {
			at = end
			continue
		}
		run := at
		for at = end; at < hi; at = end {
			k = int((at - g.base) / gran)
			if k >= len(g.mapped) || !g.mapped[k] {
				break
			}
			end = min(hi, g.base+uintptr(k+1)*gran)
		}
		id := g.insert(next, segSpan{base: run, size: uint64(at - run), state: spanFree})
		e.index(g, id)
	}
}
