// The offload area: the pinned host memory that holds what sleep copies
// out of the device, and the copies, chunked over streams of the driver's
// own. See Note [Sleep and wake] in vmm_sleep.go.

package arena

import (
	"errors"
	"fmt"
)

// copyStreams is how many streams the copies of a sleep or a wake are
// spread over: a device copies to and from the host on more than one copy
// engine, and more than one queue keeps each busy while another waits for
// its next piece.
const copyStreams = 4

// copyChunk is the most bytes one queued copy moves: large enough that a
// copy's fixed cost is small beside it, small enough that the streams'
// shares of a few large blocks stay even.
const copyChunk = 64 << 20

// hostAlign is the step in which the offload area grows, so that a next
// sleep a little larger than the last reuses it.
const hostAlign = 64 << 20

// offloadArea is the pinned host memory that holds the host copies of
// memory asleep, and the streams the copies run on: made at the first
// sleep that offloads anything and kept, grown when a later one needs
// more (its contents are then held by nothing: one sleep at a time), so
// that a cycle neither pins memory nor makes a stream.
type offloadArea struct {
	base    uintptr
	size    uint64
	used    uint64 // bytes holding copies of memory asleep
	streams []Stream
}

// offloadCopy is where the host copy of a live span lies in the offload
// area.
type offloadCopy struct {
	host, size uint64
}

// copyItem is one range to copy between the device and the offload area:
// the span at va of g, its bytes, and its place in the area.
type copyItem struct {
	g    *vmmSegment
	va   uintptr
	size uint64
	host uint64
}

// offloadItems is the live spans of the segments of the tags to offload,
// in address order within each segment, placed one after another in the
// area, and their bytes.
func (e *vmmSegments) offloadItems(segs []*vmmSegment, offload map[Tag]bool) ([]copyItem, uint64) {
	var items []copyItem
	var total uint64
	for _, g := range segs {
		if !offload[g.tag] {
			continue
		}
		for id := g.first; id != noSpan; id = g.next(id) {
			if sp := g.span(id); sp.state == spanLive {
				items = append(items, copyItem{g: g, va: sp.base, size: sp.size, host: total})
				total += sp.size
			}
		}
	}
	return items, total
}

// prepare makes the area hold at least need bytes, and its streams.
func (a *offloadArea) prepare(c HostCopier, need uint64) error {
	for len(a.streams) < copyStreams {
		s, err := c.NewCopyStream()
		if err != nil {
			return fmt.Errorf("arena: VMM: a stream for the offload copies: %w", err)
		}
		a.streams = append(a.streams, s)
	}
	if need <= a.size {
		return nil
	}
	if a.used > 0 {
		return fmt.Errorf("arena: VMM: the offload area holds %d bytes of memory asleep and cannot grow", a.used)
	}
	if a.size > 0 {
		if err := c.FreeHost(a.base, a.size); err != nil {
			return fmt.Errorf("arena: VMM: freeing the offload area: %w", err)
		}
		a.base, a.size = 0, 0
	}
	size := (need + hostAlign - 1) &^ (hostAlign - 1)
	p, err := c.AllocHost(size)
	if err != nil {
		return fmt.Errorf("arena: VMM: %d bytes of pinned host memory for the offload area: %w", size, err)
	}
	a.base, a.size = p, size
	return nil
}

// copyOut is step 3 of sleep: the items are copied to the area, in pieces
// of at most copyChunk bytes round robin on the area's streams, each of
// which first waits for the events after. It returns the events recorded
// after each stream's copies (also on an error, with those it recorded).
func (a *offloadArea) copyOut(e *vmmSegments, items []copyItem, total uint64, after []Event) ([]Event, error) {
	if total == 0 {
		return nil, nil
	}
	if err := a.prepare(e.copier, total); err != nil {
		return nil, err
	}
	return a.run(e, items, false, after)
}

// copyBack queues the items back to the device, as copyOut does, and waits
// for them.
func (a *offloadArea) copyBack(e *vmmSegments, items []copyItem) error {
	if len(items) == 0 {
		return nil
	}
	done, err := a.run(e, items, true, nil)
	if err == nil {
		err = e.waitAll(done)
	}
	e.events = append(e.events, done...)
	return err
}

// run queues the copies of items, one way or the other, and records an
// event after each stream's share.
func (a *offloadArea) run(e *vmmSegments, items []copyItem, toDevice bool, after []Event) ([]Event, error) {
	c := e.copier
	used := make([]bool, len(a.streams))
	k := 0
	queue := func(va uintptr, host uint64, n uint64) error {
		s := a.streams[k]
		if !used[k] {
			used[k] = true
			for _, ev := range after {
				if err := c.StreamWaitEvent(s, ev); err != nil {
					return err
				}
			}
		}
		k = (k + 1) % len(a.streams)
		if toDevice {
			return c.CopyToDevice(va, a.base+uintptr(host), n, s)
		}
		return c.CopyToHost(a.base+uintptr(host), va, n, s)
	}
	var err error
	for _, it := range coalesce(items) {
		for off := uint64(0); off < it.size && err == nil; off += copyChunk {
			err = queue(it.va+uintptr(off), it.host+off, min(copyChunk, it.size-off))
		}
		if err != nil {
			break
		}
	}
	var done []Event
	for i, s := range a.streams {
		if !used[i] {
			continue
		}
		ev, rerr := e.event()
		if rerr == nil {
			if rerr = e.drv.RecordEvent(ev, s); rerr != nil {
				e.events = append(e.events, ev)
			}
		}
		if rerr != nil {
			err = errors.Join(err, rerr)
			continue
		}
		done = append(done, ev)
	}
	if err != nil {
		return done, fmt.Errorf("arena: VMM: copying %s the host: %w", map[bool]string{false: "to", true: "from"}[toDevice], err)
	}
	return done, nil
}

// coalesce joins items that lie one after the other both on the device
// and in the area (neighbouring live spans), so that a run of small
// blocks is one copy.
func coalesce(items []copyItem) []copyItem {
	var out []copyItem
	for _, it := range items {
		if k := len(out) - 1; k >= 0 && out[k].va+uintptr(out[k].size) == it.va && out[k].host+out[k].size == it.host {
			out[k].size += it.size
			continue
		}
		out = append(out, it)
	}
	return out
}

// close frees the area and its streams.
func (a *offloadArea) close(c HostCopier) error {
	var errs []error
	if a.size > 0 {
		errs = append(errs, c.FreeHost(a.base, a.size))
	}
	for _, s := range a.streams {
		errs = append(errs, c.DestroyCopyStream(s))
	}
	*a = offloadArea{}
	return errors.Join(errs...)
}
