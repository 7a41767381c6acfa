package caching

import (
	"fmt"
	"testing"

	"github.com/goalloc/goalloc/arena"
)

// BenchmarkMallocFreeHit: a cache-hit pair from Go, without the cgo
// crossing; BenchmarkCABIPair in export measures it from C.
func BenchmarkMallocFreeHit(b *testing.B) {
	for _, size := range []uint64{4 << 10, 1 << 20, 64 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			a, err := New(arena.NewSim(0, 0), DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			p, _ := a.Malloc(size, 0)
			_ = a.Free(p, size, 0)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p, _ := a.Malloc(size, 0)
				_ = a.Free(p, size, 0)
			}
		})
	}
}
