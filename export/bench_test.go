//go:build goalloc_bench

package main

import (
	"fmt"
	"math"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
)

// The rows of the benchmark's exports (bench_nop.go) in
// TestEveryExportTakesNullNegativeAndHugeArguments, built with their tag.
func init() {
	abiBuildTags = append(abiBuildTags, "goalloc_bench")
	abiRows["goalloc_bench_nop_malloc"] = func(t *testing.T) {
		wantAccepted(t, func() { assert.Nil(t, goalloc_bench_nop_malloc(math.MinInt64, math.MaxInt32, nil)) })
		benchNopCount--
	}
	abiRows["goalloc_bench_nop_free"] = func(t *testing.T) {
		wantAccepted(t, func() { goalloc_bench_nop_free(nil, -1, math.MinInt32, nil) })
		benchNopCount++
	}
}

// BenchmarkCABIPair: a cache-hit malloc+free pair through the C ABI on the
// simulated device (make bench; BENCHMARKS.md has the figures).
func BenchmarkCABIPair(b *testing.B) {
	os.Setenv("GOALLOC_DEVICE", "sim")
	b.Run("floor", func(b *testing.B) { // two exported no-ops: the crossing alone
		benchNopPairs(100)
		b.ResetTimer()
		benchNopPairs(b.N)
	})
	for _, size := range []int64{4 << 10, 1 << 20, 64 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			benchPairs(100, size) // warm the cache
			b.ReportAllocs()
			b.ResetTimer()
			benchPairs(b.N, size)
		})
		b.Run(fmt.Sprintf("cxx/%dKiB", size>>10), func(b *testing.B) { // goalloc_pool_malloc + goalloc_free_ptr
			benchCxxPairs(100, size)
			b.ReportAllocs()
			b.ResetTimer()
			benchCxxPairs(b.N, size)
		})
	}
}
