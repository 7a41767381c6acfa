package arena

import (
	"math/bits"
	"time"

	"go.uber.org/atomic"
)

// LatencyHistogram counts durations in log-linear buckets, so that a
// quantile can be read at any time without keeping the samples: eight
// buckets per power of two, so a quantile read from it is within 12.5% of
// the true one (the bucket's width over its lower bound, 1/8), and exact
// below 16 ns. Recording is two atomic adds; it is safe for concurrent use.
//
// It measures the calls that reach the device (an allocator's cache
// misses), not the cache's hits: the clock is read only on that path.
type LatencyHistogram struct {
	counts [latencyBuckets]atomic.Uint64
	total  atomic.Uint64
	max    atomic.Uint64
}

const (
	latencyExact   = 16 // below this many ns a bucket is one ns wide
	latencySub     = 8  // buckets per power of two above it
	latencyBuckets = latencyExact + (64-4)*latencySub
)

// latencyBucket is the bucket of a duration of ns nanoseconds.
func latencyBucket(ns uint64) int {
	if ns < latencyExact {
		return int(ns)
	}
	e := bits.Len64(ns) - 1 // 2^e <= ns < 2^(e+1), e >= 4
	sub := int(ns>>(e-3)) & (latencySub - 1)
	return latencyExact + (e-4)*latencySub + sub
}

// latencyBucketTop is the largest duration that falls in bucket b.
func latencyBucketTop(b int) uint64 {
	if b < latencyExact {
		return uint64(b)
	}
	e := (b-latencyExact)/latencySub + 4
	sub := uint64((b - latencyExact) % latencySub)
	low := (latencySub + sub) << (e - 3)
	return low + 1<<(e-3) - 1
}

// Record counts one duration.
func (h *LatencyHistogram) Record(d time.Duration) {
	ns := uint64(0)
	if d > 0 {
		ns = uint64(d)
	}
	h.counts[latencyBucket(ns)].Inc()
	h.total.Inc()
	for {
		m := h.max.Load()
		if ns <= m || h.max.CompareAndSwap(m, ns) {
			return
		}
	}
}

// Count is how many durations were recorded.
func (h *LatencyHistogram) Count() uint64 { return h.total.Load() }

// Max is the longest duration recorded, in nanoseconds.
func (h *LatencyHistogram) Max() uint64 { return h.max.Load() }

// Quantile is the q-quantile (0 < q <= 1) in nanoseconds: the top of the
// bucket holding the ceil(q*count)-th shortest duration, never above Max.
// It is 0 when nothing was recorded.
func (h *LatencyHistogram) Quantile(q float64) uint64 {
	n := h.total.Load()
	if n == 0 {
		return 0
	}
	rank := uint64(q*float64(n) + 0.999999)
	if rank < 1 {
		rank = 1
	}
	var seen uint64
	for b := range h.counts {
		seen += h.counts[b].Load()
		if seen >= rank {
			return min(latencyBucketTop(b), h.max.Load())
		}
	}
	return h.max.Load() // counts raced ahead of total: the longest is an answer
}

// Reset forgets every duration.
func (h *LatencyHistogram) Reset() {
	for b := range h.counts {
		h.counts[b].Store(0)
	}
	h.total.Store(0)
	h.max.Store(0)
}
