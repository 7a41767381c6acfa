package replay

import (
	_ "embed"
	"fmt"
	"html/template"
	"io"
	"math"
	"strings"

	"github.com/goalloc/goalloc/units"
)

// The report is one HTML file with everything inline: the plots are SVG
// written here, the style is a <style> element, and there is no script, so
// it opens anywhere, offline, and can be attached to an issue as it is.

// policyColors gives each policy the same color in every report.
var policyColors = map[string]string{
	"goalloc":     "#1f6fd1",
	"native":      "#d1352b",
	"buddy":       "#8a4fc7",
	"fixed":       "#e08a12",
	"passthrough": "#2a9d55",
}

var extraColors = []string{"#00838f", "#ad1457", "#6d4c41", "#546e7a"}

func colorOf(policy string, i int) string {
	if c, ok := policyColors[policy]; ok {
		return c
	}
	return extraColors[i%len(extraColors)]
}

const (
	liveColor = "#5f6368"
	liveFill  = "#e3e5e8"
)

// WriteHTML writes a report of results, replays of trace on one or more
// policies, to w.
func WriteHTML(w io.Writer, trace *Trace, results []*Result) error {
	if len(results) == 0 {
		return fmt.Errorf("no results to report")
	}
	d := reportData{
		Title:   "goalloc replay: " + nonEmpty(trace.Header.Workload, trace.Path),
		Trace:   trace,
		Results: results,
		Device:  results[0].Device,
		Plot:    timelinePlot(trace, results),
		Bars:    ratioBars(trace, results),

		TinyFreePercent: tinyFreeShare * 100,
	}
	for i, r := range results {
		d.Rows = append(d.Rows, newRow(r, colorOf(r.Policy, i)))
		d.TinyFree = d.TinyFree || d.Rows[i].FragNote != ""
	}
	d.Native = trace.Header.NativeRatio() > 0
	return reportTemplate.Execute(w, d)
}

type reportData struct {
	Title   string
	Trace   *Trace
	Results []*Result
	Device  string
	Plot    template.HTML
	Bars    template.HTML
	Rows    []row
	Native  bool
	// TinyFree says some row's fragmentation is marked; TinyFreePercent
	// is tinyFreeShare for the page's notes.
	TinyFree        bool
	TinyFreePercent float64
}

// row is a result formatted for the table.
type row struct {
	Policy, Color, Conf                                  string
	PeakLive, PeakReserved, Ratio, AllocReserved, Alloc  string
	Frag, FreeAtPeak, LargestAtPeak, DevAllocs, DevFrees string
	OOMs, NsPerOp, EndToEnd, VsNative, OOMAt             string
	// FragNote, when set, says why Frag means little: the free memory it
	// is computed over is tiny (tinyFreeShare).
	FragNote string
	// InputWarnings is Result.InputWarningNote.
	InputWarnings string
}

// tinyFreeShare is the share of peak live bytes below which free memory at
// the peak is too little for its fragmentation to matter: 1 - largest/free
// over a few MiB of crumbs can read 0.9 and cost nothing. The report marks
// such figures rather than hide them.
const tinyFreeShare = 0.01

func newRow(r *Result, color string) row {
	rw := row{
		Policy: r.Policy, Color: color, Conf: r.Conf,
		PeakLive: fmtBytes(r.PeakLiveBytes), PeakReserved: fmtBytes(r.PeakReservedBytes),
		Ratio: fmt.Sprintf("%.3f", r.Ratio), AllocReserved: fmtBytes(r.AllocatorPeakReservedBytes),
		Alloc: "–",
		Frag:  fmt.Sprintf("%.3f", r.FragmentationAtPeak), FreeAtPeak: fmtBytes(r.Fragmentation.FreeBytes),
		LargestAtPeak: fmtBytes(r.Fragmentation.LargestFreeBlock),
		DevAllocs:     fmtCount(r.DeviceAllocs), DevFrees: fmtCount(r.DeviceFrees),
		OOMs: fmtCount(uint64(r.OOMs)), NsPerOp: fmt.Sprintf("%.0f", r.NsPerOp),
		EndToEnd: fmt.Sprintf("%.2f M", r.EndToEndEventsPerSecond/1e6),
		VsNative: "–", OOMAt: r.OOMError, InputWarnings: r.InputWarningNote(),
	}
	if r.AllocatorPeakAllocatedBytes > 0 {
		rw.Alloc = fmtBytes(r.AllocatorPeakAllocatedBytes)
	}
	if free := r.Fragmentation.FreeBytes; free > 0 && float64(free) < tinyFreeShare*float64(r.PeakLiveBytes) {
		rw.FragNote = fmt.Sprintf("%s's figure is computed over only %s of free memory at peak live (%.2f%% of the peak live bytes)",
			r.Policy, fmtBytes(free), 100*float64(free)/float64(r.PeakLiveBytes))
	}
	if r.NativeRatio > 0 {
		rw.VsNative = fmt.Sprintf("%+.1f%%", (r.Ratio/r.NativeRatio-1)*100)
	}
	return rw
}

func nonEmpty(s, alt string) string {
	if s != "" {
		return s
	}
	return alt
}

// Plot geometry, in SVG user units (the SVG scales to the page width).
const (
	plotW, plotH                       = 1100, 440
	marginL, marginR, marginT, marginB = 78, 24, 20, 52
	plotBuckets                        = 900 // at most ~1800 points per line
)

// svgPlot maps events and bytes to the plot area.
type svgPlot struct {
	b       strings.Builder
	n       int     // events on the x axis
	ymax    float64 // bytes at the top of the y axis, a multiple of ystep units
	ystep   float64 // units between y ticks
	unit    uint64  // bytes per unit of the y labels
	unitStr string
}

func (p *svgPlot) x(event int) float64 {
	w := float64(plotW - marginL - marginR)
	if p.n <= 1 {
		return marginL
	}
	return marginL + w*float64(event)/float64(p.n-1)
}

func (p *svgPlot) y(bytes uint64) float64 {
	h := float64(plotH - marginT - marginB)
	return float64(plotH-marginB) - h*float64(bytes)/p.ymax
}

func (p *svgPlot) printf(format string, args ...any) { fmt.Fprintf(&p.b, format, args...) }

// polyline draws pts; title is what a reader hovering over it sees.
func (p *svgPlot) polyline(pts []point, s lineStyle, title string) {
	if len(pts) == 0 {
		return
	}
	p.printf(`<polyline fill="none" stroke="%s" stroke-width="%.1f" stroke-linejoin="round"`, s.color, s.width)
	if s.dash != "" {
		p.printf(` stroke-dasharray="%s"`, s.dash)
	}
	if s.class != "" {
		p.printf(` class="%s"`, s.class)
	}
	p.b.WriteString(` points="`)
	for _, pt := range pts {
		p.printf("%.1f,%.1f ", p.x(pt.x), p.y(pt.y))
	}
	p.printf(`"><title>%s</title></polyline>`+"\n", template.HTMLEscapeString(title))
}

// lineStyle is how one line of the timeline is stroked.
type lineStyle struct {
	color, dash, class string
	width              float64
}

// area fills under pts down to the x axis.
func (p *svgPlot) area(pts []point, fill, title string) {
	if len(pts) == 0 {
		return
	}
	p.printf(`<polygon fill="%s" stroke="none" points="%.1f,%.1f `, fill, p.x(pts[0].x), p.y(0))
	for _, pt := range pts {
		p.printf("%.1f,%.1f ", p.x(pt.x), p.y(pt.y))
	}
	p.printf(`%.1f,%.1f"><title>%s</title></polygon>`+"\n", p.x(pts[len(pts)-1].x), p.y(0), template.HTMLEscapeString(title))
}

// marker circles a peak; title gives its value on hover.
func (p *svgPlot) marker(event int, bytes uint64, color, title string) {
	p.printf(`<circle cx="%.1f" cy="%.1f" r="5" fill="white" stroke="%s" stroke-width="2.5"><title>%s</title></circle>`+"\n",
		p.x(event), p.y(bytes), color, template.HTMLEscapeString(title))
}

// setYMax makes the y axis end on a labelled tick at or above the highest
// value, with a little room over it: the top of the axis is then a figure
// the reader can see.
func (p *svgPlot) setYMax(highest uint64) {
	top := float64(max(highest, 1)) * 1.03
	p.unit, p.unitStr = units.BinaryUnit(uint64(top))
	p.ystep = niceStep(top/float64(p.unit), 6)
	p.ymax = math.Ceil(top/float64(p.unit)/p.ystep) * p.ystep * float64(p.unit)
}

// axes draws the grid, the ticks and their labels.
func (p *svgPlot) axes(xLabel string) {
	step := p.ystep
	for i := 0; float64(i)*step*float64(p.unit) <= p.ymax*1.0001; i++ {
		v := float64(i) * step
		y := p.y(uint64(v * float64(p.unit)))
		p.printf(`<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" class="grid"/>`+"\n", marginL, plotW-marginR, y, y)
		p.printf(`<text x="%d" y="%.1f" class="tick" text-anchor="end">%s %s</text>`+"\n",
			marginL-8, y+4, trimFloat(v), p.unitStr)
	}
	xstep := niceStep(float64(p.n), 8)
	for v := 0.0; v < float64(p.n); v += xstep {
		x := p.x(int(v))
		p.printf(`<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" class="axis"/>`+"\n", x, x, plotH-marginB, plotH-marginB+5)
		p.printf(`<text x="%.1f" y="%d" class="tick" text-anchor="middle">%s</text>`+"\n", x, plotH-marginB+19, fmtSI(v))
	}
	p.printf(`<line x1="%d" x2="%d" y1="%d" y2="%d" class="axis"/>`+"\n", marginL, plotW-marginR, plotH-marginB, plotH-marginB)
	p.printf(`<line x1="%d" x2="%d" y1="%d" y2="%d" class="axis"/>`+"\n", marginL, marginL, marginT, plotH-marginB)
	p.printf(`<text x="%d" y="%d" class="label" text-anchor="middle">%s</text>`+"\n",
		(plotW+marginL-marginR)/2, plotH-10, template.HTMLEscapeString(xLabel))
}

// timelinePlot draws live bytes and each policy's reserved bytes over the
// replayed events, with each peak marked. goalloc's lines are drawn last,
// wider and over a white edge, so that they stay visible where another
// policy runs close to them (passthrough, which holds just the live bytes,
// often does).
func timelinePlot(trace *Trace, results []*Result) template.HTML {
	n := len(results[0].Timeline.Live)
	if n == 0 {
		return `<p class="note">The trace has no events to plot.</p>`
	}
	p := &svgPlot{n: n}
	type line struct {
		pts   []point
		style lineStyle
		title string
	}
	var lines []line
	live := downsampleDense(results[0].Timeline.Live, plotBuckets)
	var highest uint64
	for _, i := range drawOrder(results) {
		r := results[i]
		style := lineStyle{color: colorOf(r.Policy, i), width: 1.8}
		if r.Policy == highlighted {
			style.width, style.class = 2.6, "highlight"
		}
		tl := &r.Timeline
		lines = append(lines, line{downsampleSteps(&tl.PoolReserved, n, plotBuckets), style,
			fmt.Sprintf("%s: device pool reserved, peak %s (%.3f× peak live) at event %s",
				r.Policy, fmtBytes(r.PeakReservedBytes), r.Ratio, fmtCount(uint64(r.PeakReservedEvent)))})
		// What the policy holds from the pool is the same line as the
		// pool's reserved bytes for the policies that never give memory
		// back; draw it only where it tells something (goalloc, passthrough).
		if heldDiffers(r) {
			held := style
			held.dash = "6 4"
			lines = append(lines, line{downsampleSteps(&tl.AllocatorReserved, n, plotBuckets), held,
				fmt.Sprintf("%s: held from the pool, peak %s", r.Policy, fmtBytes(r.AllocatorPeakReservedBytes))})
		}
		highest = max(highest, r.PeakReservedBytes, r.AllocatorPeakReservedBytes, r.PeakLiveBytes)
	}
	p.setYMax(highest)
	r0 := results[0]

	p.printf(`<svg viewBox="0 0 %d %d" class="plot" role="img" aria-label="live and reserved bytes over the trace">`+"\n", plotW, plotH)
	p.axes("replayed event (alloc and free_completed, in trace order)")
	liveTitle := fmt.Sprintf("live bytes: peak %s at event %s", fmtBytes(r0.PeakLiveBytes), fmtCount(uint64(r0.PeakLiveEvent)))
	p.area(live, liveFill, liveTitle)
	p.polyline(live, lineStyle{color: liveColor, width: 1.2}, liveTitle)
	for _, l := range lines {
		if l.style.class == "highlight" {
			edge := l.style
			edge.color, edge.dash, edge.class, edge.width = "#fff", "", "edge", l.style.width+2.4
			p.polyline(l.pts, edge, l.title)
		}
		p.polyline(l.pts, l.style, l.title)
	}
	p.marker(r0.PeakLiveEvent, r0.PeakLiveBytes, liveColor, liveTitle)
	label := fmt.Sprintf("peak live %s (event %s)", fmtBytes(r0.PeakLiveBytes), fmtCount(uint64(r0.PeakLiveEvent)))
	lx, anchor := p.x(r0.PeakLiveEvent)+9, "start"
	if lx > plotW*0.7 {
		lx, anchor = p.x(r0.PeakLiveEvent)-9, "end"
	}
	p.printf(`<text x="%.1f" y="%.1f" class="peak" text-anchor="%s">%s</text>`+"\n",
		lx, p.y(r0.PeakLiveBytes)+18, anchor, template.HTMLEscapeString(label))
	for _, i := range drawOrder(results) {
		r := results[i]
		p.marker(r.PeakReservedEvent, r.PeakReservedBytes, colorOf(r.Policy, i),
			fmt.Sprintf("%s: peak reserved %s (%.3f× peak live) at event %s",
				r.Policy, fmtBytes(r.PeakReservedBytes), r.Ratio, fmtCount(uint64(r.PeakReservedEvent))))
	}
	p.b.WriteString("</svg>\n")

	// The legend is HTML, where text wraps and aligns by itself.
	var lg strings.Builder
	lg.WriteString(`<div class="legend">`)
	fmt.Fprintf(&lg, `<span><i class="sw" style="background:%s"></i>live bytes (peak %s)</span>`, liveFill+";border-color:"+liveColor, fmtBytes(r0.PeakLiveBytes))
	for i, r := range results {
		c := colorOf(r.Policy, i)
		fmt.Fprintf(&lg, `<span><i class="sw line" style="border-color:%s"></i>%s pool reserved (peak %s, %.3f×)</span>`,
			c, template.HTMLEscapeString(r.Policy), fmtBytes(r.PeakReservedBytes), r.Ratio)
		if heldDiffers(r) {
			fmt.Fprintf(&lg, `<span><i class="sw line dash" style="border-color:%s"></i>%s holds from the pool (peak %s)</span>`,
				c, template.HTMLEscapeString(r.Policy), fmtBytes(r.AllocatorPeakReservedBytes))
		}
	}
	lg.WriteString(`<span><i class="sw dot"></i>peaks</span></div>`)
	return template.HTML(p.b.String() + lg.String())
}

// highlighted is the policy whose lines are drawn on top of the others.
const highlighted = "goalloc"

// drawOrder lists the indexes of results in the order their lines are
// drawn: as given, with the highlighted policy last, on top.
func drawOrder(results []*Result) []int {
	var order []int
	last := -1
	for i, r := range results {
		if r.Policy == highlighted && last < 0 {
			last = i
			continue
		}
		order = append(order, i)
	}
	if last >= 0 {
		order = append(order, last)
	}
	return order
}

// heldDiffers says whether the line of what r's policy holds from the
// device tells something the others do not: when it peaks noticeably below
// the pool's reserved bytes (by more than 0.5%), and noticeably above live
// bytes (by more than 0.1%; passthrough holds exactly the live bytes).
func heldDiffers(r *Result) bool {
	held := float64(r.AllocatorPeakReservedBytes)
	return held < 0.995*float64(r.PeakReservedBytes) && held > 1.001*float64(r.PeakLiveBytes)
}

// ratioBars draws each policy's peak reserved / peak live as a bar, with the
// recorded run's own ratio as a line across them.
func ratioBars(trace *Trace, results []*Result) template.HTML {
	const (
		w, rowH, left, right, top = 1100, 30, 130, 90, 26
	)
	h := top + rowH*len(results) + 34
	hi := 1.0
	for _, r := range results {
		hi = max(hi, r.Ratio)
	}
	native := trace.Header.NativeRatio()
	hi = max(hi, native)
	lo := 1.0 // a ratio is never below 1 unless live memory was lost
	for _, r := range results {
		if r.Ratio > 0 {
			lo = min(lo, r.Ratio)
		}
	}
	lo = math.Floor(lo*10) / 10
	hi = math.Ceil(hi*10+0.5) / 10
	x := func(v float64) float64 { return left + (w-left-right)*(v-lo)/(hi-lo) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg viewBox="0 0 %d %d" class="bars" role="img" aria-label="peak reserved over peak live, per policy">`+"\n", w, h)
	step := niceStep(hi-lo, 8)
	for v := lo; v <= hi+1e-9; v += step {
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" class="grid"/>`, x(v), x(v), top-6, h-28)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" class="tick" text-anchor="middle">%s×</text>`+"\n", x(v), h-10, trimFloat(v))
	}
	for i, r := range results {
		y := top + i*rowH
		fmt.Fprintf(&b, `<text x="%d" y="%d" class="name" text-anchor="end">%s</text>`, left-10, y+rowH/2+4, template.HTMLEscapeString(r.Policy))
		fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" rx="3" fill="%s"><title>%s: peak reserved %s / peak live %s = %.3f×</title></rect>`,
			x(lo), y+5, max(x(r.Ratio)-x(lo), 1), rowH-10, colorOf(r.Policy, i), template.HTMLEscapeString(r.Policy),
			fmtBytes(r.PeakReservedBytes), fmtBytes(r.PeakLiveBytes), r.Ratio)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" class="val">%.3f×</text>`+"\n", x(r.Ratio)+6, y+rowH/2+4, r.Ratio)
	}
	if native > 0 {
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" class="native"/>`, x(native), x(native), top-14, h-28)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" class="nativelabel" text-anchor="middle">recorded run %.3f×</text>`+"\n", x(native), top-16, native)
	}
	b.WriteString("</svg>\n")
	return template.HTML(b.String())
}

// niceStep picks a round step (1, 2, 2.5 or 5 times a power of ten) that
// cuts span into at most about n intervals.
func niceStep(span float64, n int) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / float64(n)
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= raw {
			return m * mag
		}
	}
	return 10 * mag
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return s
}

// fmtSI writes an event count as 0, 500, 20k, 1.5M.
func fmtSI(v float64) string {
	switch {
	case v >= 1e6:
		return trimFloat(v/1e6) + "M"
	case v >= 1e3:
		return trimFloat(v/1e3) + "k"
	}
	return trimFloat(v)
}

// fmtBytes and fmtCount are the short names the report's code uses.
var (
	fmtBytes = units.FormatBytes
	fmtCount = units.FormatCount
)

var reportFuncs = template.FuncMap{
	"bytes": fmtBytes,
	"ms":    func(seconds float64) float64 { return seconds * 1000 },
}

// reportPage is the page's template: the HTML and its style, with the
// numbers and the plots filled in by WriteHTML (html/template escapes every
// text it inserts; the plots are template.HTML, written escaped here).
//
//go:embed report.html.tmpl
var reportPage string

var reportTemplate = template.Must(template.New("report").Funcs(reportFuncs).Parse(reportPage))
