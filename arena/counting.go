package arena

import (
	"time"

	"go.uber.org/atomic"
)

// Counting is a MemorySource that counts what crosses it, in the manner of
// RMM's statistics_resource_adaptor: the allocations and frees that
// succeeded, the bytes held (allocated and not freed) and their high-water
// mark. A failed call counts nothing. It sits under a cache, so what it
// counts are the calls that reach the device, never the cache's hits.
//
// It also times every successful allocation: under a cache, that is the
// cost of a cache miss at the device, read from Latency.
//
// The counts are atomics, so reading them needs no lock of the caller's.
type Counting struct {
	MemorySource
	allocs, frees atomic.Uint64
	held, peak    atomic.Uint64
	latency       LatencyHistogram
}

// NewCounting counts the calls that reach src.
func NewCounting(src MemorySource) *Counting { return &Counting{MemorySource: src} }

// Allocs is the number of successful Alloc and AllocUncaptured calls.
func (c *Counting) Allocs() uint64 { return c.allocs.Load() }

// Frees is the number of successful Free calls.
func (c *Counting) Frees() uint64 { return c.frees.Load() }

// Held is the bytes allocated and not freed.
func (c *Counting) Held() uint64 { return c.held.Load() }

// Peak is the most bytes held at once since the start or ResetPeak.
func (c *Counting) Peak() uint64 { return c.peak.Load() }

// Latency is the histogram of successful allocation calls' durations.
func (c *Counting) Latency() *LatencyHistogram { return &c.latency }

// ResetCounts zeroes the allocation and free counts and the latencies.
func (c *Counting) ResetCounts() {
	c.allocs.Store(0)
	c.frees.Store(0)
	c.latency.Reset()
}

// ResetPeak sets the high-water mark to the bytes held now.
func (c *Counting) ResetPeak() { c.peak.Store(c.held.Load()) }

// latencyEpoch anchors the latency clock. time.Now reads the wall clock
// and the monotonic one; time.Since of a time that holds a monotonic
// reading reads only the monotonic clock. Timing a call as the difference
// of two time.Since(latencyEpoch) costs two clock reads instead of three,
// on the path of every cache miss.
var latencyEpoch = time.Now()

func latencyNow() time.Duration { return time.Since(latencyEpoch) }

func (c *Counting) allocated(size uint64, start time.Duration) {
	c.latency.Record(latencyNow() - start)
	c.allocs.Inc()
	held := c.held.Add(size)
	for {
		peak := c.peak.Load()
		if held <= peak || c.peak.CompareAndSwap(peak, held) {
			return
		}
	}
}

func (c *Counting) Alloc(size uint64, s Stream) (uintptr, error) {
	start := latencyNow()
	p, err := c.MemorySource.Alloc(size, s)
	if err == nil {
		c.allocated(size, start)
	}
	return p, err
}

func (c *Counting) AllocUncaptured(size uint64) (uintptr, error) {
	start := latencyNow()
	p, err := c.MemorySource.AllocUncaptured(size)
	if err == nil {
		c.allocated(size, start)
	}
	return p, err
}

func (c *Counting) Free(ptr uintptr, size uint64, s Stream) error {
	err := c.MemorySource.Free(ptr, size, s)
	if err == nil {
		c.frees.Inc()
		c.held.Sub(size)
	}
	return err
}
