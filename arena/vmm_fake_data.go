package arena

import (
	"fmt"
	"maps"
	"slices"
)

// FakePhys's contents and its sleep and wake half (HostCopier): what the
// bytes of its handles and of its pinned host memory hold, kept only where
// something was written, so that a test can write cookies into device
// memory, put it to sleep, wake it and read them back at the same
// addresses. Copies run at once, in the order they are queued, and each is
// work on its stream (an event recorded after it completes with the
// stream); a stream's wait for an event orders nothing more, as the
// simulated device's work has no duration.

// fakePage is the unit in which contents are kept.
const fakePage = 4096

// fakeBytes is memory whose contents are kept only where written: pages
// made on their first write; unwritten bytes read as 0.
type fakeBytes map[uint64]*[fakePage]byte

func (m fakeBytes) write(off uint64, b []byte) {
	for len(b) > 0 {
		pg, at := off/fakePage, off%fakePage
		p := m[pg]
		if p == nil {
			p = new([fakePage]byte)
			m[pg] = p
		}
		n := copy(p[at:], b)
		b, off = b[n:], off+uint64(n)
	}
}

func (m fakeBytes) read(off uint64, b []byte) {
	for len(b) > 0 {
		pg, at := off/fakePage, off%fakePage
		n := min(uint64(len(b)), fakePage-at)
		if p := m[pg]; p != nil {
			copy(b[:n], p[at:])
		} else {
			clear(b[:n])
		}
		b, off = b[n:], off+n
	}
}

// pagesIn is the written pages of m that overlap [off, off+n), in order:
// a walk of the range when it is short, else of the pages written.
func (m fakeBytes) pagesIn(off, n uint64) []uint64 {
	first, last := off/fakePage, (off+n-1)/fakePage
	var out []uint64
	if last-first < uint64(len(m)) {
		for pg := first; pg <= last; pg++ {
			if m[pg] != nil {
				out = append(out, pg)
			}
		}
		return out
	}
	for pg := range m {
		if pg >= first && pg <= last {
			out = append(out, pg)
		}
	}
	slices.Sort(out)
	return out
}

// copyBytes copies n bytes of src at so to dst at do: the destination's
// range is cleared, then what src holds there is written.
func copyBytes(dst fakeBytes, do uint64, src fakeBytes, so, n uint64) {
	if n == 0 {
		return
	}
	for _, pg := range dst.pagesIn(do, n) {
		lo, hi := max(pg*fakePage, do), min((pg+1)*fakePage, do+n)
		if lo == pg*fakePage && hi == (pg+1)*fakePage {
			delete(dst, pg)
			continue
		}
		clear(dst[pg][lo-pg*fakePage : hi-pg*fakePage])
	}
	var buf [fakePage]byte
	for _, pg := range src.pagesIn(so, n) {
		lo, hi := max(pg*fakePage, so), min((pg+1)*fakePage, so+n)
		b := buf[:hi-lo]
		src.read(lo, b)
		dst.write(do+(lo-so), b)
	}
}

// fakePiece is part of a VA range inside one handle.
type fakePiece struct {
	data    fakeBytes
	off, n  uint64 // in the handle
	dev     uintptr
	rangeAt uint64 // from the range's start
}

// devPieces splits [va, va+n) into the handles mapped there; unmapped VA is
// an error, as a copy from it would fault on a GPU. Called with f.mu held.
func (f *FakePhys) devPieces(va uintptr, n uint64) ([]fakePiece, error) {
	var out []fakePiece
	for at := uint64(0); at < n; {
		p := va + uintptr(at)
		g := p &^ uintptr(f.gran-1)
		h, ok := f.page[g]
		if !ok {
			return nil, fmt.Errorf("fakephys: %#x is not mapped", p)
		}
		fh := f.handles[h]
		if fh.data == nil {
			fh.data = fakeBytes{}
		}
		k := min(n-at, f.gran-uint64(p-g))
		out = append(out, fakePiece{data: fh.data, off: f.pageOff[g] + uint64(p-g), n: k, dev: p, rangeAt: at})
		at += k
	}
	return out, nil
}

// Write puts b into device memory at va (as a kernel would): every byte
// must be mapped.
func (f *FakePhys) Write(va uintptr, b []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	pieces, err := f.devPieces(va, uint64(len(b)))
	if err != nil {
		return err
	}
	for _, p := range pieces {
		p.data.write(p.off, b[p.rangeAt:p.rangeAt+p.n])
	}
	return nil
}

// Read is the n bytes of device memory at va: every byte must be mapped.
func (f *FakePhys) Read(va uintptr, n uint64) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	pieces, err := f.devPieces(va, n)
	if err != nil {
		return nil, err
	}
	b := make([]byte, n)
	for _, p := range pieces {
		p.data.read(p.off, b[p.rangeAt:p.rangeAt+p.n])
	}
	return b, nil
}

// fakeHost is a pinned host allocation.
type fakeHost struct {
	size uint64
	data fakeBytes
}

// fakeHostBase is where the fake driver's host allocations lie, apart from
// every device's VA.
const fakeHostBase = uintptr(0x5a0000000000)

// fakeCopyStreams is where the fake driver's own streams are numbered,
// apart from the streams tests use.
const fakeCopyStreams = Stream(0xc0c0000000000000)

// AllocHost makes size bytes of host memory, zeroed; HostUsed counts it.
// FailHost runs without the fake's lock, as a slow pinning would: a test's
// hook may call the driver.
func (f *FakePhys) AllocHost(size uint64) (uintptr, error) {
	f.mu.Lock()
	f.Calls["cuMemHostAlloc"]++
	hook := f.FailHost
	f.mu.Unlock()
	if size == 0 {
		return 0, fmt.Errorf("fakephys: host allocation of 0 bytes")
	}
	if hook != nil {
		if err := hook(size); err != nil {
			return 0, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hosts == nil {
		f.hosts, f.nextHost = map[uintptr]*fakeHost{}, fakeHostBase
	}
	p := f.nextHost
	f.nextHost += uintptr((size + fakePage - 1) &^ (fakePage - 1))
	f.hosts[p] = &fakeHost{size: size, data: fakeBytes{}}
	f.hostUsed += size
	return p, nil
}

// FreeHost frees an allocation of AllocHost.
func (f *FakePhys) FreeHost(p uintptr, size uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuMemFreeHost"]++
	h, ok := f.hosts[p]
	if !ok || h.size != size {
		return fmt.Errorf("fakephys: free of host memory %#x+%d, which is no allocation", p, size)
	}
	delete(f.hosts, p)
	f.hostUsed -= size
	return nil
}

// HostUsed is the bytes of host memory allocated and not freed.
func (f *FakePhys) HostUsed() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hostUsed
}

// hostRange is the host allocation holding [p, p+n), and p's offset in it.
func (f *FakePhys) hostRange(p uintptr, n uint64) (fakeBytes, uint64, error) {
	for base, h := range f.hosts {
		if p >= base && uint64(p-base)+n <= h.size {
			return h.data, uint64(p - base), nil
		}
	}
	return nil, 0, fmt.Errorf("fakephys: host range %#x+%d lies in no host allocation", p, n)
}

// NewCopyStream makes a stream of the driver's own.
func (f *FakePhys) NewCopyStream() (Stream, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuStreamCreate"]++
	f.nextStream++
	s := fakeCopyStreams + Stream(f.nextStream)
	if f.streams == nil {
		f.streams = map[Stream]bool{}
	}
	f.streams[s] = true
	return s, nil
}

// DestroyCopyStream destroys a stream of NewCopyStream.
func (f *FakePhys) DestroyCopyStream(s Stream) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls["cuStreamDestroy"]++
	if !f.streams[s] {
		return fmt.Errorf("fakephys: destroy of stream %#x, which is not the driver's", s)
	}
	delete(f.streams, s)
	return nil
}

// CopyStreams is how many streams of NewCopyStream exist.
func (f *FakePhys) CopyStreams() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.streams)
}

// StreamWaitEvent orders s after e on a simulated device that models
// ordering (arena.Sim); on another it checks that e exists.
func (f *FakePhys) StreamWaitEvent(s Stream, e Event) error {
	f.mu.Lock()
	f.Calls["cuStreamWaitEvent"]++
	fail := f.FailStreamWait
	f.mu.Unlock()
	if fail != nil {
		if err := fail(s, e); err != nil {
			return err
		}
	}
	if w, ok := f.rt.(interface{ StreamWaitEvent(Stream, Event) error }); ok {
		return w.StreamWaitEvent(s, e)
	}
	_, err := f.rt.EventDone(e)
	return err
}

// CopyToHost copies n bytes of device memory at va to host memory at host.
func (f *FakePhys) CopyToHost(host, va uintptr, n uint64, s Stream) error {
	return f.copyBetween("cuMemcpyDtoHAsync", host, va, n, s, false)
}

// CopyToDevice copies n bytes of host memory at host to device memory at va.
func (f *FakePhys) CopyToDevice(va, host uintptr, n uint64, s Stream) error {
	return f.copyBetween("cuMemcpyHtoDAsync", host, va, n, s, true)
}

func (f *FakePhys) copyBetween(call string, host, va uintptr, n uint64, s Stream, toDevice bool) error {
	if f.OnCopy != nil {
		if err := f.OnCopy(va, n, toDevice); err != nil {
			return err
		}
	}
	f.mu.Lock()
	f.Calls[call]++
	err := f.copyLocked(host, va, n, toDevice)
	if err == nil {
		f.CopiedBytes += n
	}
	f.mu.Unlock()
	if err != nil {
		return err
	}
	if l, ok := f.rt.(interface{ Launch(Stream) }); ok {
		l.Launch(s)
	}
	return nil
}

func (f *FakePhys) copyLocked(host, va uintptr, n uint64, toDevice bool) error {
	hd, ho, err := f.hostRange(host, n)
	if err != nil {
		return err
	}
	pieces, err := f.devPieces(va, n)
	if err != nil {
		return err
	}
	for _, p := range pieces {
		if toDevice {
			copyBytes(p.data, p.off, hd, ho+p.rangeAt, p.n)
		} else {
			copyBytes(hd, ho+p.rangeAt, p.data, p.off, p.n)
		}
	}
	return nil
}

// WaitEvent waits for e as cuEventSynchronize does: through the runtime
// when it can wait (a Sim completes the work of e's stream up to e, and
// refuses a stalled stream), else an event not yet done is an error.
func (f *FakePhys) WaitEvent(e Event) error {
	f.mu.Lock()
	f.Calls["cuEventSynchronize"]++
	f.mu.Unlock()
	if w, ok := f.rt.(interface{ WaitEvent(Event) error }); ok {
		return w.WaitEvent(e)
	}
	done, err := f.rt.EventDone(e)
	if err == nil && !done {
		err = fmt.Errorf("fakephys: event %d is not done and its runtime cannot wait for it", e)
	}
	return err
}

// HandleBytes is what each live handle holds written, by handle: for tests
// that check nothing is left behind.
func (f *FakePhys) HandleBytes() map[PhysHandle]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[PhysHandle]int{}
	for _, h := range slices.Sorted(maps.Keys(f.handles)) {
		out[h] = len(f.handles[h].data) * fakePage
	}
	return out
}
