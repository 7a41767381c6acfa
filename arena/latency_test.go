package arena

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every duration falls in a bucket whose bounds hold it, the buckets are
// in order, and a bucket is at most an eighth of its lower bound wide.
func TestLatencyBucketsCoverEveryDuration(t *testing.T) {
	low := uint64(0) // the lowest duration of bucket b
	for b := 0; b < latencyBuckets; b++ {
		top := latencyBucketTop(b)
		require.GreaterOrEqual(t, top, low, "bucket %d", b)
		assert.Equal(t, b, latencyBucket(low), "the lowest duration of bucket %d", b)
		assert.Equal(t, b, latencyBucket(top), "the highest duration of bucket %d", b)
		if low >= latencyExact {
			assert.LessOrEqual(t, float64(top-low+1), float64(low)/8, "bucket %d is [%d, %d]", b, low, top)
		}
		if top == ^uint64(0) {
			require.Equal(t, latencyBuckets-1, b, "only the last bucket ends at the largest duration")
		}
		low = top + 1
	}
	assert.Zero(t, low, "the last bucket ends at the largest duration")
}

func TestLatencyQuantiles(t *testing.T) {
	var h LatencyHistogram
	assert.Zero(t, h.Quantile(0.5), "nothing recorded")
	// 1..1000 us: the true p50 is 500 us, p99 990 us.
	for us := 1; us <= 1000; us++ {
		h.Record(time.Duration(us) * time.Microsecond)
	}
	h.Record(-time.Second) // a clock step back counts as 0
	assert.Equal(t, uint64(1001), h.Count())
	assert.Equal(t, uint64(time.Millisecond), h.Max())
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, time.Millisecond}} {
		got := float64(h.Quantile(c.q))
		assert.InEpsilon(t, float64(c.want), got, 0.125, "q %v: %v", c.q, time.Duration(got))
		assert.GreaterOrEqual(t, got, float64(c.want)*0.999, "q %v: the top of the bucket, never below", c.q)
	}
	assert.LessOrEqual(t, h.Quantile(1), h.Max(), "never above the longest")
	h.Reset()
	assert.Zero(t, h.Count())
	assert.Zero(t, h.Max())
	assert.Zero(t, h.Quantile(0.99))
}

func TestLatencyConcurrentRecords(t *testing.T) {
	var h LatencyHistogram
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 5000; i++ {
				h.Record(time.Duration(g*1000+i%1000) * time.Nanosecond)
				_ = h.Quantile(0.99)
			}
		}(g)
	}
	wg.Wait()
	assert.Equal(t, uint64(20000), h.Count())
	assert.Equal(t, uint64(3999), h.Max())
}
