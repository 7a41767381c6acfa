package replay

// A plot of a whole trace has a thousand-odd pixels across and a hundred
// thousand or more events, so series are cut into buckets of consecutive
// events and each bucket keeps only its lowest and its highest point, in
// event order. That draws the same picture as every point would (each pixel
// column spans the bucket's range), is at most two points per bucket, and
// never loses a peak: the highest point of the series is the highest of its
// bucket.

// point is one plotted value: bytes after event x.
type point struct {
	x int
	y uint64
}

// downsampleDense reduces y (one value per event) to at most 2*buckets+2
// points: the first, each bucket's lowest and highest, and the last.
func downsampleDense(y []uint64, buckets int) []point {
	n := len(y)
	if n == 0 {
		return nil
	}
	if n <= 2*buckets {
		pts := make([]point, n)
		for i, v := range y {
			pts[i] = point{i, v}
		}
		return pts
	}
	pts := make([]point, 0, 2*buckets+2)
	pts = append(pts, point{0, y[0]})
	for b := 0; b < buckets; b++ {
		lo, hi := b*n/buckets, (b+1)*n/buckets
		minI, maxI := lo, lo
		for i := lo + 1; i < hi; i++ {
			if y[i] < y[minI] {
				minI = i
			}
			if y[i] > y[maxI] {
				maxI = i
			}
		}
		pts = appendMinMax(pts, point{minI, y[minI]}, point{maxI, y[maxI]})
	}
	if last := (point{n - 1, y[n-1]}); pts[len(pts)-1] != last {
		pts = append(pts, last)
	}
	return pts
}

// appendMinMax appends a bucket's lowest and highest points in event order,
// each once: not twice if they are the same point, and not again if it is
// the last point already there (the series' first, say).
func appendMinMax(pts []point, lo, hi point) []point {
	if hi.x < lo.x {
		lo, hi = hi, lo
	}
	for _, p := range [2]point{lo, hi} {
		if n := len(pts); n == 0 || pts[n-1].x < p.x {
			pts = append(pts, p)
		}
	}
	return pts
}

// downsampleSteps draws s, a step series over n events, in at most about
// 2*buckets+2 points. With few steps it draws them exactly, as stairs; with
// many, each bucket's lowest and highest values, as downsampleDense does.
func downsampleSteps(s *Steps, n, buckets int) []point {
	if len(s.At) == 0 || n == 0 {
		return nil
	}
	if len(s.At) <= buckets {
		pts := make([]point, 0, 2*len(s.At)+1)
		for k, at := range s.At {
			if k > 0 {
				pts = append(pts, point{at, s.Bytes[k-1]})
			}
			pts = append(pts, point{at, s.Bytes[k]})
		}
		return append(pts, point{n - 1, s.Bytes[len(s.Bytes)-1]})
	}
	pts := make([]point, 0, 2*buckets+2)
	pts = append(pts, point{0, s.Bytes[0]})
	k := 0 // the step in force at the bucket's first event
	for b := 0; b < buckets; b++ {
		lo, hi := b*n/buckets, (b+1)*n/buckets
		if lo == hi {
			continue
		}
		for k+1 < len(s.At) && s.At[k+1] <= lo {
			k++
		}
		minP, maxP := point{lo, s.Bytes[k]}, point{lo, s.Bytes[k]}
		for k+1 < len(s.At) && s.At[k+1] < hi {
			k++
			if v := s.Bytes[k]; v < minP.y {
				minP = point{s.At[k], v}
			} else if v > maxP.y {
				maxP = point{s.At[k], v}
			}
		}
		pts = appendMinMax(pts, minP, maxP)
	}
	if last := (point{n - 1, s.Bytes[len(s.Bytes)-1]}); pts[len(pts)-1] != last {
		pts = append(pts, last)
	}
	return pts
}
