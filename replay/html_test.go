package replay

import (
	"bytes"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/replay/reference"
	"github.com/stretchr/testify/require"
)

func TestWriteHTML(t *testing.T) {
	tr := smallTrace(t)
	tr.Header.Workload = `<script>alert("x")</script>`
	var results []*Result
	for _, name := range reference.Names {
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: name})
		require.NoError(t, err)
		results = append(results, r)
	}
	for _, rs := range [][]*Result{results, results[:1]} {
		var b bytes.Buffer
		require.NoError(t, WriteHTML(&b, tr, rs))
		page := b.String()
		require.True(t, strings.HasPrefix(page, "<!DOCTYPE html>"))
		require.Equal(t, 2, strings.Count(page, "<svg "), "the timeline and the ratio bars")
		for _, r := range rs {
			require.Contains(t, page, ">"+r.Policy+"<")
			require.Contains(t, page, fmtBytes(r.PeakReservedBytes))
		}
		// Self-contained: nothing is fetched, nothing runs.
		require.NotContains(t, page, "http://")
		require.NotContains(t, page, "https://")
		require.NotContains(t, page, "<script")
		require.NotContains(t, page, "src=")
		require.NotContains(t, page, "<link")
		require.Contains(t, page, "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;", "text from the trace is escaped")
		require.Contains(t, page, "recorded run 1.333×")
	}
	require.Error(t, WriteHTML(&bytes.Buffer{}, tr, nil))
}

func TestNiceStep(t *testing.T) {
	for _, c := range []struct {
		span float64
		n    int
		want float64
	}{{49, 6, 10}, {26, 6, 5}, {1, 8, 0.2}, {114473, 8, 20000}, {0.9, 8, 0.2}, {0, 5, 1}} {
		require.InDelta(t, c.want, niceStep(c.span, c.n), 1e-9, "%v/%d", c.span, c.n)
	}
}

func TestFormatting(t *testing.T) {
	require.Equal(t, "23.64 GiB", fmtBytes(25379906248))
	require.Equal(t, "2.00 MiB", fmtBytes(2<<20))
	require.Equal(t, "1.50 KiB", fmtBytes(1536))
	require.Equal(t, "512 B", fmtBytes(512))
	require.Equal(t, "1,234,567", fmtCount(1234567))
	require.Equal(t, "999", fmtCount(999))
	require.Equal(t, "20k", fmtSI(20000))
	require.Equal(t, "1.5M", fmtSI(1.5e6))
}

// everyPolicy replays the small trace under every policy, goalloc first.
func everyPolicy(t *testing.T) (*Trace, []*Result) {
	tr := smallTrace(t)
	var results []*Result
	for _, name := range reference.Names {
		r, err := Replay(tr, arena.NewSim(0, 0), Options{Policy: name})
		require.NoError(t, err)
		results = append(results, r)
	}
	require.Equal(t, "goalloc", results[0].Policy)
	return tr, results
}

// timelineSVG is the first plot of a report: the timeline.
func timelineSVG(t *testing.T, tr *Trace, results []*Result) string {
	var b bytes.Buffer
	require.NoError(t, WriteHTML(&b, tr, results))
	page := b.String()
	start := strings.Index(page, "<svg ")
	end := strings.Index(page, "</svg>")
	require.True(t, start >= 0 && end > start)
	return page[start:end]
}

var (
	polylineRE = regexp.MustCompile(`<polyline [^>]*stroke="([^"]+)"[^>]*>(<title>[^<]*</title>)?`)
	circleRE   = regexp.MustCompile(`<circle [^>]*stroke="([^"]+)"[^>]*>(<title>[^<]*</title>)?`)
	yTickRE    = regexp.MustCompile(`<text x="\d+" y="([\d.]+)" class="tick" text-anchor="end">([\d.]+) (\w+)</text>`)
)

func TestTimelineDrawsGoallocOnTop(t *testing.T) {
	tr, results := everyPolicy(t)
	svg := timelineSVG(t, tr, results)
	lines := polylineRE.FindAllStringSubmatch(svg, -1)
	require.NotEmpty(t, lines)
	last := lines[len(lines)-1]
	require.Equal(t, policyColors["goalloc"], last[1], "goalloc's line is the last drawn, over the others")
	require.Contains(t, last[0], `class="highlight"`)
	require.Contains(t, svg, `class="edge"`, "goalloc's line has a white edge under it")
	markers := circleRE.FindAllStringSubmatch(svg, -1)
	require.Equal(t, policyColors["goalloc"], markers[len(markers)-1][1], "and its peak marker is the last one")
	// Whatever order the results come in.
	reversed := slices.Clone(results)
	slices.Reverse(reversed)
	lines = polylineRE.FindAllStringSubmatch(timelineSVG(t, tr, reversed), -1)
	require.Equal(t, policyColors["goalloc"], lines[len(lines)-1][1])
}

func TestTimelineLinesAndPeaksCarryTheirValues(t *testing.T) {
	tr, results := everyPolicy(t)
	svg := timelineSVG(t, tr, results)
	for _, l := range polylineRE.FindAllStringSubmatch(svg, -1) {
		require.NotEmpty(t, l[2], "every line has a <title>: %.80s", l[0])
	}
	for _, m := range circleRE.FindAllStringSubmatch(svg, -1) {
		require.NotEmpty(t, m[2], "every peak marker has a <title>: %.80s", m[0])
	}
	for _, r := range results {
		require.Contains(t, svg, fmt.Sprintf("<title>%s: peak reserved %s (%.3f× peak live) at event %d</title>",
			r.Policy, fmtBytes(r.PeakReservedBytes), r.Ratio, r.PeakReservedEvent))
	}
	require.Contains(t, svg, "<title>live bytes: peak "+fmtBytes(results[0].PeakLiveBytes))
}

func TestTimelineYAxisIsLabelledUpToItsTop(t *testing.T) {
	tr, results := everyPolicy(t)
	var highest uint64
	for _, r := range results {
		highest = max(highest, r.PeakReservedBytes, r.AllocatorPeakReservedBytes, r.PeakLiveBytes)
	}
	ticks := yTickRE.FindAllStringSubmatch(timelineSVG(t, tr, results), -1)
	require.GreaterOrEqual(t, len(ticks), 3)
	top := ticks[len(ticks)-1]
	y, err := strconv.ParseFloat(top[1], 64)
	require.NoError(t, err)
	require.InDelta(t, float64(marginT+4), y, 0.05, "the last tick label sits at the top of the axis")
	v, err := strconv.ParseFloat(top[2], 64)
	require.NoError(t, err)
	unit := map[string]float64{"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[top[3]]
	require.GreaterOrEqual(t, v*unit, float64(highest), "and it is above every line")

	// The same for axis spans that are not round.
	for _, highest := range []uint64{1, 1000, 3*MiB + 1024, 23_910_000_000, 46_380_000_000} {
		p := &svgPlot{n: 10}
		p.setYMax(highest)
		steps := p.ymax / float64(p.unit) / p.ystep
		require.InDelta(t, math.Round(steps), steps, 1e-9, "%d: the top is a whole number of steps", highest)
		require.GreaterOrEqual(t, p.ymax, float64(highest))
		require.Less(t, p.ymax, 1.5*float64(highest)+float64(p.ystep)*float64(p.unit))
	}
}

func TestFragmentationOverTinyFreeMemoryIsMarked(t *testing.T) {
	tr, results := everyPolicy(t)
	tiny := *results[0]
	tiny.PeakLiveBytes = 1 << 30
	tiny.Fragmentation.FreeBytes = 4 << 20 // 0.39% of peak live
	tiny.Fragmentation.LargestFreeBlock = 448 << 10
	tiny.FragmentationAtPeak = 0.89
	plenty := tiny
	plenty.Policy = "plenty"
	plenty.Fragmentation.FreeBytes = 200 << 20
	var b bytes.Buffer
	require.NoError(t, WriteHTML(&b, tr, []*Result{&tiny, &plenty}))
	page := b.String()
	require.Equal(t, 1, strings.Count(page, "0.890†"), "only the figure over tiny free memory is marked")
	require.Contains(t, page, "goalloc&#39;s figure is computed over only 4.00 MiB of free memory at peak live (0.39% of the peak live bytes)")
	require.Contains(t, page, "Below 1% of peak live, free memory is too little")
	require.NotContains(t, page, "plenty&#39;s figure")

	require.NoError(t, WriteHTML(&b, tr, []*Result{&plenty}))
	require.False(t, strings.Contains(b.String()[len(page):], "†"), "no mark, no note where no figure needs one")
}
