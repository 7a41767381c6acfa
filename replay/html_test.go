package replay

import (
	"bytes"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/arena"
	"github.com/goalloc/goalloc/policies"
	"github.com/stretchr/testify/require"
)

func TestWriteHTML(t *testing.T) {
	tr := smallTrace(t)
	tr.Header.Workload = `<script>alert("x")</script>`
	var results []*Result
	for _, name := range policies.Names {
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
