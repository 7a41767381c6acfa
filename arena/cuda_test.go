//go:build linux && cgo && goalloc_cudatest

package arena

import (
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
)

var _ Device = (*CUDA)(nil)

// needCUDA skips the test unless the driver is there and sees a device.
func needCUDA(t *testing.T, devices int) {
	t.Helper()
	n, err := CUDADeviceCount()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if n < devices {
		t.Skipf("needs %d CUDA device(s), the driver sees %d", devices, n)
	}
}

func openCUDA(t *testing.T, ordinal int) *CUDA {
	t.Helper()
	d, err := NewCUDA(ordinal, ^uint64(0))
	if err != nil {
		t.Fatalf("NewCUDA(%d): %v", ordinal, err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// onFreshThread runs f on a goroutine locked to its OS thread and never
// unlocked, so that thread exits with the goroutine and whatever f did to its
// CUDA context state dies with it.
func onFreshThread(t *testing.T, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		f()
	}()
	<-done
}

func TestCUDADevice(t *testing.T) {
	needCUDA(t, 1)
	d := openCUDA(t, 0)
	if d.Ordinal() != 0 {
		t.Fatalf("Ordinal() = %d", d.Ordinal())
	}

	free, total, err := d.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	if total == 0 || free > total {
		t.Fatalf("MemInfo: free %d, total %d", free, total)
	}

	const size = 1 << 20
	p, err := d.Alloc(size, 0)
	if err != nil {
		t.Fatal(err)
	}
	if p == 0 {
		t.Fatal("Alloc returned a null pointer")
	}
	u, err := d.PoolUsage()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after Alloc(%d): %+v", size, u)
	if u.UsedCurrent < size || u.ReservedCurrent < u.UsedCurrent || u.UsedHigh < u.UsedCurrent ||
		u.ReservedHigh < u.ReservedCurrent {
		t.Fatalf("PoolUsage after Alloc(%d): %+v", size, u)
	}

	ev, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.RecordEvent(ev, 0); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		done, err := d.EventDone(ev)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("event recorded on an idle stream did not complete in 10s")
		}
		time.Sleep(time.Millisecond)
	}
	if err := d.DestroyEvent(ev); err != nil {
		t.Fatal(err)
	}

	if err := d.Free(p, size, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if u, err = d.PoolUsage(); err != nil {
		t.Fatal(err)
	}
	if u.UsedCurrent != 0 {
		t.Fatalf("PoolUsage after Free: %+v", u)
	}
	if err := d.Trim(0); err != nil {
		t.Fatal(err)
	}
	if u, err = d.PoolUsage(); err != nil {
		t.Fatal(err)
	}
	t.Logf("after Free and Trim(0): %+v", u)
	if u.ReservedCurrent != 0 {
		t.Errorf("Trim(0) left %d bytes reserved", u.ReservedCurrent)
	}
	if err := d.ResetPoolHigh(); err != nil {
		t.Fatal(err)
	}
	if u, err = d.PoolUsage(); err != nil {
		t.Fatal(err)
	}
	if u.ReservedHigh != u.ReservedCurrent || u.UsedHigh != u.UsedCurrent {
		t.Errorf("PoolUsage after ResetPoolHigh: %+v", u)
	}
	if err := d.SetReleaseThreshold(0); err != nil {
		t.Fatal(err)
	}
	if err := d.SetReleaseThreshold(^uint64(0)); err != nil {
		t.Fatal(err)
	}

	if st, err := d.CaptureStatus(0); err != nil || st != CaptureNone {
		t.Fatalf("CaptureStatus(0) = %v, %v", st, err)
	}
	if st, _, err := d.CaptureID(0); err != nil || st != CaptureNone {
		t.Fatalf("CaptureID(0) = %v, %v", st, err)
	}
	onFreshThread(t, func() {
		prev, err := d.ExchangeCaptureMode(2)
		if err != nil {
			t.Error(err)
			return
		}
		back, err := d.ExchangeCaptureMode(prev)
		if err != nil || back != 2 {
			t.Errorf("ExchangeCaptureMode back to %d: got %d, %v", prev, back, err)
		}
	})

	_, err = d.Alloc(1<<60, 0)
	if err == nil {
		t.Fatal("Alloc(1<<60) succeeded")
	}
	var de *DriverError
	if !errors.As(err, &de) {
		t.Fatalf("Alloc(1<<60): %v is not a *DriverError", err)
	}
	if !errors.Is(err, ErrOutOfMemory) {
		t.Logf("Alloc(1<<60) failed, but not as out-of-memory: %v", err)
	} else {
		t.Logf("Alloc(1<<60): %v", err)
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := d.Alloc(size, 0); err == nil {
		t.Fatal("Alloc after Close succeeded")
	}
}

func TestCUDABadOrdinal(t *testing.T) {
	needCUDA(t, 1)
	n, _ := CUDADeviceCount()
	if _, err := NewCUDA(n, 0); err == nil {
		t.Fatalf("NewCUDA(%d) with %d devices succeeded", n, n)
	}
	if _, err := NewCUDA(-1, 0); err == nil {
		t.Fatal("NewCUDA(-1) succeeded")
	}
}

// A thread with no current context (PyTorch's autograd thread) gets the
// device's primary context, and keeps it.
func TestCUDAThreadWithoutContext(t *testing.T) {
	needCUDA(t, 1)
	d := openCUDA(t, 0)
	onFreshThread(t, func() {
		if err := setCurrentContext(0); err != nil {
			t.Error(err)
			return
		}
		if c, err := currentContext(); err != nil || c != 0 {
			t.Errorf("after cuCtxSetCurrent(NULL): current %#x, %v", c, err)
			return
		}
		p, err := d.Alloc(4096, 0)
		if err != nil {
			t.Errorf("Alloc on a thread with no context: %v", err)
			return
		}
		if c, err := currentContext(); err != nil || c != d.primaryContext() {
			t.Errorf("after Alloc: current %#x, want the primary context %#x (%v)", c, d.primaryContext(), err)
		}
		if err := d.Free(p, 4096, 0); err != nil {
			t.Error(err)
		}
		if err := d.Synchronize(); err != nil {
			t.Error(err)
		}
	})
}

// A thread whose current context is another one keeps it: each call borrows
// the primary context and puts the caller's back.
func TestCUDARestoresCallersContext(t *testing.T) {
	needCUDA(t, 1)
	d := openCUDA(t, 0)
	var skip error
	onFreshThread(t, func() {
		other, err := d.newTestContext()
		if err != nil {
			skip = err // t.Skip must run on the test's goroutine
			return
		}
		defer destroyTestContext(other)
		if other == d.primaryContext() {
			t.Error("cuCtxCreate returned the primary context")
			return
		}
		expect := func(what string) {
			if c, err := currentContext(); err != nil || c != other {
				t.Errorf("after %s: current %#x, want the caller's %#x (%v)", what, c, other, err)
			}
		}
		expect("cuCtxCreate")
		p, err := d.Alloc(1<<16, 0)
		if err != nil {
			t.Error(err)
			return
		}
		expect("Alloc")
		if _, _, err := d.MemInfo(); err != nil {
			t.Error(err)
		}
		expect("MemInfo")
		if err := d.Free(p, 1<<16, 0); err != nil {
			t.Error(err)
		}
		expect("Free")
		if err := d.Synchronize(); err != nil {
			t.Error(err)
		}
		expect("Synchronize")
	})
	if skip != nil {
		t.Skip(skip)
	}
}

// Two devices: a call for device 0 from a thread whose current context is
// device 1's leaves device 1 current.
func TestCUDAMultiDevice(t *testing.T) {
	needCUDA(t, 2)
	d0, d1 := openCUDA(t, 0), openCUDA(t, 1)
	onFreshThread(t, func() {
		if err := setCurrentContext(d1.primaryContext()); err != nil {
			t.Error(err)
			return
		}
		p, err := d0.Alloc(1<<20, 0)
		if err != nil {
			t.Error(err)
			return
		}
		if c, _ := currentContext(); c != d1.primaryContext() {
			t.Errorf("after d0.Alloc: current %#x, want device 1's %#x", c, d1.primaryContext())
		}
		if err := d0.Free(p, 1<<20, 0); err != nil {
			t.Error(err)
		}
		if err := d0.Synchronize(); err != nil {
			t.Error(err)
		}
	})
}

func TestCUDAConcurrent(t *testing.T) {
	needCUDA(t, 1)
	d := openCUDA(t, 0)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				size := uint64(512 * (1 + (g*31+i)%64))
				p, err := d.Alloc(size, 0)
				if err != nil {
					errs <- err
					return
				}
				if err := d.Free(p, size, 0); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	u, err := d.PoolUsage()
	if err != nil {
		t.Fatal(err)
	}
	if u.UsedCurrent != 0 {
		t.Fatalf("after concurrent alloc/free: %+v", u)
	}
}

// TestCUDAPeerAccess: each device's pool is opened to every device that can
// access it, whichever device was opened first, and the driver agrees.
func TestCUDAPeerAccess(t *testing.T) {
	needCUDA(t, 2)
	d1 := openCUDA(t, 1) // the higher ordinal first: the grant must not depend on order
	d0 := openCUDA(t, 0)
	for _, c := range []struct {
		d    *CUDA
		peer int
	}{{d0, 1}, {d1, 0}} {
		granted, err := c.d.PeersGranted()
		if err != nil {
			t.Fatalf("device %d: %v", c.d.Ordinal(), err)
		}
		has, err := c.d.PeerAccess(c.peer)
		if err != nil {
			t.Fatal(err)
		}
		listed := len(granted) == 1 && granted[0] == c.peer
		t.Logf("device %d: granted %v, driver says device %d has access: %v", c.d.Ordinal(), granted, c.peer, has)
		if has != listed {
			t.Errorf("device %d: PeersGranted %v but cuMemPoolGetAccess(%d) = %v", c.d.Ordinal(), granted, c.peer, has)
		}
		if !has {
			t.Logf("devices %d and %d are not peers here: nothing to grant", c.d.Ordinal(), c.peer)
		}
	}
}

// TestCUDAEventOnAnotherDevicesStream: an event of device 0 recorded on a
// stream of device 1 (record_stream with another device's stream) is stood
// in for by an event of device 1, polled through it, and dropped when the
// event is next recorded on device 0's own stream.
func TestCUDAEventOnAnotherDevicesStream(t *testing.T) {
	needCUDA(t, 2)
	d0, d1 := openCUDA(t, 0), openCUDA(t, 1)
	e, err := d0.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer d0.DestroyEvent(e)
	if err := d0.RecordEvent(e, Stream(d1.side)); err != nil {
		t.Fatalf("record on device 1's stream: %v", err)
	}
	if n := d0.nStandIns.Load(); n != 1 {
		t.Fatalf("stand-ins after a foreign record: %d, want 1", n)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		done, err := d0.EventDone(e)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("event on an idle stream of device 1 never completed")
		}
		time.Sleep(time.Millisecond)
	}
	if err := d0.RecordEvent(e, Stream(d0.side)); err != nil {
		t.Fatalf("record on device 0's own stream: %v", err)
	}
	if n := d0.nStandIns.Load(); n != 0 {
		t.Fatalf("stand-ins after recording on the own stream: %d, want 0", n)
	}
	if err := d0.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := d0.EventDone(e); err != nil || !done {
		t.Fatalf("own event after synchronize: done %v, err %v", done, err)
	}
}

// The pool's cap on the real driver (PoolCapped): the pool maps physical
// memory in chunks (g, read from the pool after its first allocation, 32 MiB
// on an H200), so under a cap of 1.5 g blocks of g/4 fit while they lie in
// the first chunk, and the one that would take a second is given back and
// refused, for Alloc and for AllocUncaptured (given back on the side
// stream) alike; after every call the pool holds at most the cap, and the
// high-water mark reported leaves the refused moment out.
func TestCUDAPoolCapped(t *testing.T) {
	needCUDA(t, 1)
	d := openCUDA(t, 0)
	c := NewPoolCapped(d, func() { _ = d.Synchronize() })
	first, err := c.Alloc(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	u, err := d.PoolUsage()
	if err != nil {
		t.Fatal(err)
	}
	g := u.ReservedCurrent
	limit := g + g/2
	c.SetCap(limit)
	live := []uintptr{first}
	sizes := []uint64{1 << 20}
	within := func(what string) {
		t.Helper()
		u, err := c.PoolUsage()
		if err != nil {
			t.Fatal(err)
		}
		if u.ReservedCurrent > limit || u.ReservedHigh > limit {
			t.Fatalf("%s: the pool holds %d (high %d) under a cap of %d", what, u.ReservedCurrent, u.ReservedHigh, limit)
		}
	}
	refused := false
	for i := 0; i < 8 && !refused; i++ {
		p, err := c.Alloc(g/4, 0)
		within("Alloc")
		if errors.Is(err, ErrCapReached) {
			refused = true
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		live, sizes = append(live, p), append(sizes, g/4)
	}
	if !refused || len(live) < 2 {
		t.Fatalf("%d blocks of %d under a cap of %d, refused: %v", len(live)-1, g/4, limit, refused)
	}
	if _, err := c.AllocUncaptured(g / 2); !errors.Is(err, ErrCapReached) {
		t.Fatalf("AllocUncaptured over the cap: %v", err)
	}
	within("AllocUncaptured")
	for i, p := range live {
		if err := c.Free(p, sizes[i], 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	p, err := c.Alloc(g/2, 0)
	if err != nil {
		t.Fatalf("a block that fits in the chunk the pool holds: %v", err)
	}
	within("after the frees")
	if err := c.Free(p, g/2, 0); err != nil {
		t.Fatal(err)
	}
}
