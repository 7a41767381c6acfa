package replay

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay/reference"
	"github.com/stretchr/testify/require"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files under testdata/ from the current output")

// TestReportGolden renders the report of small replays (a JSON lines trace
// with every policy, a memory snapshot with one) and compares the page byte
// for byte with the one kept in testdata/, so a change to how the page is
// built (its template, its formatting) that changes the page shows here. The
// timings, which differ from run to run, are set to fixed values first.
// After an intended change of the page, rewrite them with
// go test ./replay -run TestReportGolden -update.
func TestReportGolden(t *testing.T) {
	lines := smallTrace(t)
	snap, err := Open(fixture("torch-expandable.pickle"))
	require.NoError(t, err)
	for _, c := range []struct {
		golden   string
		trace    *Trace
		policies []string
	}{
		{"report-jsonl.golden.html", lines, reference.Names},
		{"report-snapshot.golden.html", snap, []string{"goalloc"}},
	} {
		t.Run(c.golden, func(t *testing.T) {
			c.trace.Path = "trace"
			c.trace.Elapsed = 1500000 // 1.5 ms
			var results []*Result
			for _, name := range c.policies {
				r, err := Replay(c.trace, arena.NewSim(0, 0), Options{Policy: name})
				require.NoError(t, err)
				r.NsPerOp, r.EventsPerSecond, r.EndToEndEventsPerSecond = 100, 1e7, 5e6
				r.ParseSeconds, r.ReplaySeconds = 0.0015, 0.002
				results = append(results, r)
			}
			var b bytes.Buffer
			require.NoError(t, WriteHTML(&b, c.trace, results))
			path := filepath.Join("testdata", c.golden)
			if *updateGolden {
				require.NoError(t, os.WriteFile(path, b.Bytes(), 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err)
			require.Equal(t, string(want), b.String())
		})
	}
}
