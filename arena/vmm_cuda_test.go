//go:build linux && cgo && goalloc_cudatest

package arena

import (
	"testing"
	"time"
)

var _ Device = (*VMM)(nil)

// openVMM opens device ordinal with 2 MiB handles, the H200's
// granularity, so that the tests' sizes count granules.
func openVMM(t *testing.T, ordinal int) *VMM {
	t.Helper()
	d, err := NewVMMWith(ordinal, VMMLayout{Handle: 2 << 20})
	if err != nil {
		t.Fatalf("NewVMMWith(%d): %v", ordinal, err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// expectBytes copies n bytes at p to the host and checks they are all v.
func expectBytes(t *testing.T, d *VMM, p uintptr, n uint64, v byte, what string) {
	t.Helper()
	buf := make([]byte, n)
	if err := d.copyToHost(buf, p); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	// Byte by byte: bytes.IndexFunc would decode UTF-8, and 0xab is not a rune.
	for i, b := range buf {
		if b != v {
			t.Fatalf("%s: byte %d is %#x, want %#x", what, i, b, v)
		}
	}
}

func TestVMMCUDAAllocFreeReuse(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	if g := d.Granularity(); g == 0 || g&(g-1) != 0 {
		t.Fatalf("granularity %d", g)
	}
	t.Logf("granularity %d, peers %v", d.Granularity(), d.peers)
	free0, total, err := d.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	const big = 64 << 20
	p, err := d.Alloc(big, 0)
	if err != nil {
		t.Fatal(err)
	}
	small, err := d.Alloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.memset(p, 0xab, big, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.memset(small, 0xcd, 4096, 0); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, p, big, 0xab, "large range")
	expectBytes(t, d, small, 4096, 0xcd, "small piece")
	u, _ := d.PoolUsage()
	free1, _, _ := d.MemInfo()
	t.Logf("usage %+v; device free %d -> %d of %d", u, free0, free1, total)
	if u.ReservedCurrent != big+d.Granularity() {
		t.Errorf("reserved %d, want %d (the range and one page)", u.ReservedCurrent, big+d.Granularity())
	}
	if free0-free1 < u.ReservedCurrent {
		t.Errorf("the device lost %d bytes, less than the %d held", free0-free1, u.ReservedCurrent)
	}
	if err := d.Free(p, big, 0); err != nil {
		t.Fatal(err)
	}
	c0, m0, _, _, _ := d.engineCounts()
	q, err := d.Alloc(big, 0)
	if err != nil {
		t.Fatal(err)
	}
	c1, m1, _, _, _ := d.engineCounts()
	if q != p || c1 != c0 || m1 != m0 {
		t.Errorf("same size on the same stream: got %#x (had %#x), %d creates and %d maps more", q, p, c1-c0, m1-m0)
	}
	expectBytes(t, d, q, big, 0xab, "range handed back")
	for _, f := range []struct {
		p uintptr
		n uint64
	}{{q, big}, {small, 4096}} {
		if err := d.Free(f.p, f.n, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := d.Trim(0); err != nil {
		t.Fatal(err)
	}
	u, _ = d.PoolUsage()
	free2, _, _ := d.MemInfo()
	t.Logf("after trim: usage %+v, device free %d", u, free2)
	if u.ReservedCurrent != 0 {
		t.Errorf("reserved %d after freeing everything and trimming", u.ReservedCurrent)
	}
	if free2+(8<<20) < free0 {
		t.Errorf("device free %d after trim, %d before anything", free2, free0)
	}
}

// A free span whose handles pay for growth elsewhere is unmapped, and the
// data of every other span survives the remapping.
func TestVMMCUDADataSurvivesRemap(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	const n = 8 << 20
	a, _ := d.Alloc(n, 0)
	b, err := d.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	d.memset(a, 0x11, n, 0)
	d.memset(b, 0x22, n, 0)
	if err := d.Free(a, n, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	c, err := d.Alloc(3*n, 0) // takes a's handle, creates the rest
	if err != nil {
		t.Fatal(err)
	}
	if err := d.memset(c, 0x33, 3*n, 0); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, b, n, 0x22, "b after c was mapped over a's memory")
	expectBytes(t, d, c, 3*n, 0x33, "c")
	u, _ := d.PoolUsage()
	if u.ReservedCurrent != 4*n {
		t.Errorf("reserved %d, want %d: a's memory backs c", u.ReservedCurrent, 4*n)
	}
}

// Memory freed on a busy stream serves another stream's miss at once:
// that stream waits on the device for the free's event
// (cuStreamWaitEvent), so its work on the memory runs after the first
// stream's, and nothing is created.
func TestVMMCUDALendAcrossStreams(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	const n = 1 << 30
	_, s2, p := freeOnBusyStream(t, d, n)
	c0, _, un0, _, _ := d.engineCounts()
	waits0 := d.src.profile.calls[callStreamWait].n.Load()
	q, err := d.Alloc(n, s2)
	if err != nil {
		t.Fatal(err)
	}
	c1, _, un1, _, _ := d.engineCounts()
	waits := d.src.profile.calls[callStreamWait].n.Load() - waits0
	if q == p || c1 != c0 {
		t.Fatalf("stream 2 got %#x (freed %#x on busy stream 1), %d handles created", q, p, c1-c0)
	}
	if waits == 0 {
		t.Logf("stream 1 finished its fills before the miss (%d unmaps): the wait was not exercised", un1-un0)
	}
	// Stream 2's fill is queued after its wait, so after stream 1's 200
	// fills of the same memory: it is what stays.
	if err := d.memset(q, 7, n, s2); err != nil {
		t.Fatal(err)
	}
	if err := d.streamSync(s2); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, q, 1<<20, 7, "stream 2's fill, after stream 1's")
	expectBytes(t, d, q+n-1<<20, 1<<20, 7, "the end of stream 2's fill")
	if u, _ := d.PoolUsage(); u.ReservedCurrent != n {
		t.Errorf("reserved %d, want %d: stream 1's memory serves stream 2", u.ReservedCurrent, n)
	}
}

// Memory of stream 1's segment freed on busy stream 2 is pending; a miss
// of stream 1 that would otherwise create memory waits for that free on
// the device (cuStreamWaitEvent) and takes the memory back where it lies,
// so its work on it runs after stream 2's, and nothing is created.
func TestVMMCUDAAdoptsPendingFrees(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	const n = 1 << 30
	s1, err := d.newStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.destroyStream(s1) })
	s2, err := d.newStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.destroyStream(s2) })
	p, err := d.Alloc(n, s1)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 200; i++ {
		if err := d.memset(p, byte(i), n, s2); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Free(p, n, s2); err != nil {
		t.Fatal(err)
	}
	c0, _, _, _, _ := d.engineCounts()
	waits0 := d.src.profile.calls[callStreamWait].n.Load()
	q, err := d.Alloc(n, s1)
	if err != nil {
		t.Fatal(err)
	}
	c1, _, _, _, _ := d.engineCounts()
	waits := d.src.profile.calls[callStreamWait].n.Load() - waits0
	if q != p || c1 != c0 {
		t.Fatalf("stream 1 got %#x (its %#x freed on busy stream 2), %d handles created", q, p, c1-c0)
	}
	if waits == 0 {
		t.Logf("stream 2 finished its fills before the miss: the wait was not exercised")
	}
	// Stream 1's fill is queued after its wait, so after stream 2's 200
	// fills of the same memory: it is what stays.
	if err := d.memset(q, 7, n, s1); err != nil {
		t.Fatal(err)
	}
	if err := d.streamSync(s1); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, q, 1<<20, 7, "stream 1's fill, after stream 2's")
	expectBytes(t, d, q+n-1<<20, 1<<20, 7, "the end of stream 1's fill")
	if u, _ := d.PoolUsage(); u.ReservedCurrent != n {
		t.Errorf("reserved %d, want %d", u.ReservedCurrent, n)
	}
	if err := d.Free(q, n, s1); err != nil {
		t.Fatal(err)
	}
}

// Every mapping is opened to each peer that can access the device: a copy
// from device 0's memory by device 1 works.
func TestVMMCUDAPeerAccess(t *testing.T) {
	needCUDA(t, 2)
	d0, d1 := openVMM(t, 0), openVMM(t, 1)
	peers, _ := d0.PeersGranted()
	t.Logf("device 0 is opened to %v", peers)
	if len(peers) == 0 {
		t.Skip("device 1 cannot access device 0 here")
	}
	const n = 16 << 20
	src, err := d0.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := d1.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	d0.memset(src, 0x5a, n, 0)
	d0.Synchronize()
	if err := d1.copyDevice(dst, src, n); err != nil {
		t.Fatalf("device 1 copying from device 0's VMM memory: %v", err)
	}
	expectBytes(t, d1, dst, n, 0x5a, "copied to device 1")
}

// Driver cost per miss, for the record: misses that grow the segment, and
// one served by the memory they freed.
func TestVMMCUDAMissCost(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	start := time.Now()
	var ps []uintptr
	for i := 1; i <= 50; i++ {
		p, err := d.Alloc(uint64(i)*(2<<20), 0)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	t.Logf("50 new allocations of 2..100 MiB: %v per miss", time.Since(start)/50)
	for i, p := range ps {
		d.Free(p, uint64(i+1)*(2<<20), 0)
	}
	d.Synchronize()
	start = time.Now()
	p, err := d.Alloc(1<<30, 0)
	if err != nil {
		t.Fatal(err)
	}
	c, m, u, r, a := d.engineCounts()
	t.Logf("1 GiB from freed memory: %v (totals: %d creates, %d maps, %d unmaps, %d releases, %d set-access)",
		time.Since(start), c, m, u, r, a)
	d.Free(p, 1<<30, 0)
}

// Close with frees still held (their events not yet destroyed) succeeds:
// the device marks itself closed first, and its own event destruction must
// not be refused for that.
func TestVMMCUDACloseWithHeldFrees(t *testing.T) {
	needCUDA(t, 1)
	d, err := NewVMM(0)
	if err != nil {
		t.Fatalf("NewVMM(0): %v", err)
	}
	for _, n := range []uint64{64 << 20, 4096} {
		p, err := d.Alloc(n, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Free(p, n, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// vmmCounts is the VMM driver calls made so far, as one comparable value.
type vmmCounts struct{ create, mapped, unmapped, released, access uint64 }

func countsOf(d *VMM) vmmCounts {
	c, m, u, r, a := d.engineCounts()
	return vmmCounts{c, m, u, r, a}
}

// The segments placement on the driver: a split reuses memory in place
// with no driver call, an extension maps only the missing granules next
// to memory whose data stays, and a free still in use on a busy stream is
// not unmapped for another stream. The cost of a miss either way is logged.
func TestVMMCUDASegments(t *testing.T) {
	needCUDA(t, 1)
	d := openVMM(t, 0)
	const n = 8 << 20
	a, err := d.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.Alloc(n, 0)
	if err != nil {
		t.Fatal(err)
	}
	if b != a+n {
		t.Errorf("b at %#x, want %#x: the segment grows at its end", b, a+n)
	}
	d.memset(a, 0x11, n, 0)
	d.memset(b, 0x22, n, 0)
	if err := d.Free(a, n, 0); err != nil {
		t.Fatal(err)
	}
	before := countsOf(d)
	start := time.Now()
	c, err := d.Alloc(n/2, 0)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if c != a || countsOf(d) != before {
		t.Errorf("split on the same stream: got %#x (freed %#x), calls %+v -> %+v", c, a, before, countsOf(d))
	}
	t.Logf("a miss served by a split: %v", took)
	d.memset(c, 0x33, n/2, 0)
	expectBytes(t, d, b, n, 0x22, "b after a's head was reused")
	expectBytes(t, d, a+n/2, n/2, 0x11, "a's free tail, untouched")
	// [c live 4 MiB][a's tail + b free 12 MiB][end]: 20 MiB extends the
	// free span by 8 MiB, four granules.
	if err := d.Free(b, n, 0); err != nil {
		t.Fatal(err)
	}
	before = countsOf(d)
	start = time.Now()
	q, err := d.Alloc(20<<20, 0)
	took = time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	after := countsOf(d)
	if q != c+n/2 || after.mapped-before.mapped != 4 || after.access-before.access != 1 {
		t.Errorf("extend: got %#x, want %#x; calls %+v -> %+v (want 4 maps, 1 set-access)", q, c+n/2, before, after)
	}
	t.Logf("a miss extending the segment by 8 MiB: %v (%d creates, %d maps, %d set-access)",
		took, after.create-before.create, after.mapped-before.mapped, after.access-before.access)
	expectBytes(t, d, q, n/2, 0x11, "a's tail, now the head of the extended span")
	expectBytes(t, d, q+n/2, n, 0x22, "b, inside the extended span")
	expectBytes(t, d, c, n/2, 0x33, "c, next to the new mappings")
	if err := d.memset(q, 0x44, 20<<20, 0); err != nil {
		t.Fatal(err)
	}
	expectBytes(t, d, q, 20<<20, 0x44, "the extended span, written whole")

	// Misses of varied sizes on one stream once the segment holds enough:
	// no driver call at all.
	var ps []uintptr
	for i := 1; i <= 8; i++ {
		p, err := d.Alloc(uint64(i)*(2<<20), 0)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	for i, p := range ps {
		d.Free(p, uint64(i+1)*(2<<20), 0)
	}
	before = countsOf(d)
	start = time.Now()
	const rounds = 200
	for r := 0; r < rounds; r++ {
		i := uint64(r%8 + 1)
		p, err := d.Alloc(i*(2<<20), 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Free(p, i*(2<<20), 0); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d misses reusing the segment: %v per alloc+free, calls %+v -> %+v", rounds, time.Since(start)/rounds, before, countsOf(d))
	if countsOf(d) != before {
		t.Errorf("same-stream reuse made driver calls: %+v -> %+v", before, countsOf(d))
	}

	// A free on a busy stream pays for another stream's miss, lent after
	// a wait, with stream 0's 72 MiB of complete free memory: nothing is
	// created.
	const big = 1 << 30
	_, s2, p := freeOnBusyStream(t, d, big)
	before = countsOf(d)
	start = time.Now()
	r, err := d.Alloc(big, s2)
	took = time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	after = countsOf(d)
	t.Logf("a 1 GiB miss on a new stream: %v (%d creates, %d maps, %d unmaps)", took,
		after.create-before.create, after.mapped-before.mapped, after.unmapped-before.unmapped)
	if r == p {
		t.Errorf("stream 2 got stream 1's addresses")
	}
	if made := after.create - before.create; made != 0 {
		t.Errorf("%d handles created: free memory, complete or still in use, pays", made)
	}
	if err := d.Free(r, big, s2); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := d.Trim(0); err != nil {
		t.Fatal(err)
	}
	u, _ := d.PoolUsage()
	t.Logf("after trim: %+v", u)
	if u.ReservedCurrent != 24<<20 {
		t.Errorf("held %d after trimming, with 20 MiB and 4 MiB live", u.ReservedCurrent)
	}
}

// freeOnBusyStream makes two streams, allocates n bytes on the first, queues
// some 50 ms or more of fills of them there and frees them there at once: a
// free whose last use is still running. The streams go at the test's end.
func freeOnBusyStream(t *testing.T, d *VMM, n uint64) (s1, s2 Stream, p uintptr) {
	t.Helper()
	s1, err := d.newStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.destroyStream(s1) })
	s2, err = d.newStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.destroyStream(s2) })
	p, err = d.Alloc(n, s1)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 200; i++ {
		if err := d.memset(p, byte(i), n, s1); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Free(p, n, s1); err != nil {
		t.Fatal(err)
	}
	return s1, s2, p
}
