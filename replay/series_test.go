package replay

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkPoints checks a downsampled series: at most most points, from the
// first event to the last, in event order, each on the series; with stairs,
// a corner point may instead hold the value from before its event.
func checkPoints(t *testing.T, pts []point, valueAt func(int) uint64, n, most int, stairs bool) {
	t.Helper()
	require.LessOrEqual(t, len(pts), most)
	require.Equal(t, 0, pts[0].x)
	require.Equal(t, n-1, pts[len(pts)-1].x)
	for i, p := range pts {
		if stairs && p.x > 0 && p.y == valueAt(p.x-1) {
			continue
		}
		require.Equal(t, valueAt(p.x), p.y, "point %d is on the series", i)
		if i > 0 && !stairs {
			require.Greater(t, p.x, pts[i-1].x, "points are in event order")
		}
	}
	for i := 1; i < len(pts); i++ {
		require.GreaterOrEqual(t, pts[i].x, pts[i-1].x, "points are in event order")
	}
}

func TestDownsampleDense(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 2, 5, 1799, 1800, 1801, 10007, 200000} {
		y := make([]uint64, n)
		v := uint64(1 << 30)
		for i := range y {
			v = v + rng.Uint64N(1<<20) - 1<<19
			y[i] = v
		}
		pts := downsampleDense(y, 900)
		checkPoints(t, pts, func(x int) uint64 { return y[x] }, n, 2*900+2, false)
		top := slices.Max(y)
		require.Equal(t, top, slices.MaxFunc(pts, func(a, b point) int { return cmpU(a.y, b.y) }).y, "n=%d: the peak is kept", n)
		require.Equal(t, slices.Min(y), slices.MinFunc(pts, func(a, b point) int { return cmpU(a.y, b.y) }).y, "n=%d: the trough is kept", n)
	}
	require.Nil(t, downsampleDense(nil, 10))
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func TestDownsampleSteps(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, steps := range []int{1, 3, 900, 901, 50000} {
		n := 100000
		var s Steps
		s.set(0, 7)
		for len(s.At) < steps {
			at := s.At[len(s.At)-1] + 1 + rng.IntN(n/steps)
			if at >= n {
				break
			}
			s.set(at, rng.Uint64N(1<<40))
		}
		valueAt := func(x int) uint64 {
			k, _ := slices.BinarySearch(s.At, x+1)
			return s.Bytes[k-1]
		}
		pts := downsampleSteps(&s, n, 900)
		checkPoints(t, pts, valueAt, n, 2*900+2, len(s.At) <= 900)
		_, peak := s.Peak()
		require.Equal(t, peak, slices.MaxFunc(pts, func(a, b point) int { return cmpU(a.y, b.y) }).y, "steps=%d: the peak is kept", steps)
	}
}

func TestStepsSetAndPeak(t *testing.T) {
	var s Steps
	s.set(0, 5)
	s.set(1, 5) // no change, no step
	s.set(4, 9)
	s.set(6, 2)
	s.set(8, 9)
	require.Equal(t, []int{0, 4, 6, 8}, s.At)
	at, v := s.Peak()
	require.Equal(t, 4, at, "the first time it peaks")
	require.Equal(t, uint64(9), v)
}
