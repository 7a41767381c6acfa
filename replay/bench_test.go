package replay

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay/reference"
)

// BenchmarkReplay replays each bundled trace on the simulated device with
// goalloc and reports replayed events per second. The trace is parsed once,
// outside the timing; BenchmarkEndToEnd times both.
func BenchmarkReplay(b *testing.B) {
	benchReplay(b, "", func() (arena.Device, error) { return arena.NewSim(0, 0), nil })
}

// BenchmarkReplayVMM is BenchmarkReplay on the simulated VMM device
// (backend:vmm, its default layout): the caching layer and the segments
// placement, over the in-memory driver.
func BenchmarkReplayVMM(b *testing.B) {
	benchReplay(b, "backend:vmm", func() (arena.Device, error) {
		return arena.NewSimVMMWith(0, 80<<30, arena.VMMLayout{})
	})
}

// benchReplay replays each bundled trace with goalloc under conf, on a
// fresh device from newDevice each time.
func benchReplay(b *testing.B, conf string, newDevice func() (arena.Device, error)) {
	for _, path := range bundled {
		b.Run(traceName(path), func(b *testing.B) {
			tr, err := Open(path)
			if err != nil {
				b.Fatal(err)
			}
			runs := 0
			for b.Loop() {
				dev, err := newDevice()
				if err != nil {
					b.Fatal(err)
				}
				if _, err := Replay(tr, dev, Options{Policy: "goalloc", Conf: conf}); err != nil {
					b.Fatal(err)
				}
				runs++
			}
			b.ReportMetric(float64(runs*len(tr.Events))/b.Elapsed().Seconds(), "events/s")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(runs*len(tr.Events)), "ns/event")
		})
	}
}

// BenchmarkParse reports how fast a bundled trace is read and parsed, in
// event lines per second.
func BenchmarkParse(b *testing.B) {
	for _, path := range bundled {
		b.Run(traceName(path), func(b *testing.B) {
			lines := 0
			for b.Loop() {
				tr, err := Open(path)
				if err != nil {
					b.Fatal(err)
				}
				lines += tr.Lines
			}
			b.ReportMetric(float64(lines)/b.Elapsed().Seconds(), "lines/s")
		})
	}
}

// BenchmarkEndToEnd reads, parses and replays a bundled trace with goalloc,
// and reports event lines per second over all of it: the figure the replay
// tool is held to (2 million a second).
func BenchmarkEndToEnd(b *testing.B) {
	for _, path := range bundled {
		b.Run(traceName(path), func(b *testing.B) {
			lines := 0
			for b.Loop() {
				tr, err := Open(path)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: "goalloc"}); err != nil {
					b.Fatal(err)
				}
				lines += tr.Lines
			}
			b.ReportMetric(float64(lines)/b.Elapsed().Seconds(), "events/s")
		})
	}
}

func traceName(path string) string {
	return strings.TrimSuffix(filepath.Base(path), ".jsonl.gz")
}

// BenchmarkReplayVMMCold replays the ResNet-50 trace on the simulated VMM
// device as BenchmarkReplayVMM does, but walks a buffer between events, as
// PyTorch's own work does between two calls into goalloc in training, so
// that each call finds the caches cold. It reports the calls' ns per event,
// split into requests that the cache served (hits) and those that went to
// the device (misses), and the walk's own ns per event; profiled
// (-cpuprofile), it says where a cold call's time goes. With calls=false
// it makes no call at all: the walk's time then, against the walk's time
// with the calls, is what the calls cost the work around them (the cache
// lines they evicted).
func BenchmarkReplayVMMCold(b *testing.B) {
	for _, walk := range []int{0, 256 << 10, 1 << 20, 8 << 20} {
		for _, calls := range []bool{true, false} {
			if walk == 0 && !calls {
				continue
			}
			b.Run(fmt.Sprintf("walk=%dKiB/calls=%v", walk>>10, calls), func(b *testing.B) {
				replayCold(b, walk, calls)
			})
		}
	}
}

func replayCold(b *testing.B, walk int, calls bool) {
	tr, err := Open(bundled[1])
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, walk)
	var sink byte
	var hitNs, missNs, freeNs, walkNs time.Duration
	var hits, misses, frees, walks, loops int
	for b.Loop() {
		loops++
		dev, err := arena.NewSimVMMWith(0, 80<<30, arena.VMMLayout{})
		if err != nil {
			b.Fatal(err)
		}
		cd := newCountingDevice(dev)
		a, err := reference.New("goalloc", cd.asDevice(), "backend:vmm")
		if err != nil {
			b.Fatal(err)
		}
		ptrs := make([]uintptr, tr.Slots)
		for i := range tr.Events {
			w0 := time.Now()
			for j := 0; j < len(buf); j += 64 {
				buf[j]++
			}
			walkNs, walks = walkNs+time.Since(w0), walks+1
			if !calls {
				continue
			}
			ev := &tr.Events[i]
			switch ev.Op {
			case OpAlloc:
				before := cd.counts.Allocs()
				t0 := time.Now()
				p, err := coldMalloc(a, ev.Size, ev.Stream)
				d := time.Since(t0)
				if err != nil {
					b.Fatal(err)
				}
				if cd.counts.Allocs() != before {
					missNs, misses = missNs+d, misses+1
				} else {
					hitNs, hits = hitNs+d, hits+1
				}
				ptrs[ev.Slot] = p
			case OpFree:
				t0 := time.Now()
				if err := coldFree(a, ptrs[ev.Slot], ev.Size, ev.Stream); err != nil {
					b.Fatal(err)
				}
				freeNs, frees = freeNs+time.Since(t0), frees+1
			}
		}
		if len(buf) > 0 {
			sink += buf[0]
		}
		if err := a.Close(); err != nil {
			b.Fatal(err)
		}
	}
	_ = sink
	b.ReportMetric(float64(walkNs.Nanoseconds())/float64(max(walks, 1)), "ns/walk")
	if calls {
		b.ReportMetric(float64(hitNs.Nanoseconds())/float64(max(hits, 1)), "ns/hit")
		b.ReportMetric(float64(missNs.Nanoseconds())/float64(max(misses, 1)), "ns/miss")
		b.ReportMetric(float64(freeNs.Nanoseconds())/float64(max(frees, 1)), "ns/free")
		b.ReportMetric(float64(misses)/float64(max(hits+misses, 1)), "miss-share")
		b.ReportMetric(float64(hits+misses+frees)/float64(max(loops, 1)), "calls/replay")
	}
}

// coldMalloc and coldFree are the calls replayCold times, kept out of line
// so that cachegrind can count inside them alone
// (--toggle-collect='*replay.coldMalloc', tests/misspath_compare.sh).
//
//go:noinline
func coldMalloc(a reference.Allocator, size uint64, s arena.Stream) (uintptr, error) {
	return a.Malloc(size, s)
}

//go:noinline
func coldFree(a reference.Allocator, p uintptr, size uint64, s arena.Stream) error {
	return a.Free(p, size, s)
}
