package replay

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
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
