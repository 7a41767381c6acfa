package replay

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

var bundled = []string{"../traces/gpt2-train.jsonl.gz", "../traces/resnet50-train.jsonl.gz"}

// referenceParse parses an event line with encoding/json alone, independently of
// parse.go, with the semantics the parser promises: exact field names, the
// last of a repeated field winning, null as absent, integers only.
func referenceParse(line []byte) (rawEvent, error) {
	var ev rawEvent
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		return ev, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return ev, errors.New("text after the object")
	}
	if m == nil {
		return ev, errors.New("null")
	}
	for k, v := range m {
		if v == nil {
			continue
		}
		switch k {
		case "a":
			s, ok := v.(string)
			if !ok {
				return ev, errors.New("a is not a string")
			}
			setAction(&ev, []byte(s))
		case "addr", "size", "stream":
			num, ok := v.(json.Number)
			if !ok {
				return ev, errors.New(k + " is not a number")
			}
			u, err := strconv.ParseUint(string(num), 10, 64)
			if err != nil {
				return ev, err
			}
			switch k {
			case "addr":
				ev.addr, ev.has = u, ev.has|hasAddr
			case "size":
				ev.size, ev.has = u, ev.has|hasSize
			default:
				ev.stream, ev.has = u, ev.has|hasStream
			}
		case "t":
			num, ok := v.(json.Number)
			if !ok {
				return ev, errors.New("t is not a number")
			}
			n, err := strconv.ParseInt(string(num), 10, 64)
			if err != nil {
				return ev, err
			}
			ev.t, ev.has = n, ev.has|hasT
		}
	}
	return normalize(ev), nil
}

// normalize clears what the fields an event does not have left behind, so
// that two parses compare equal when they mean the same.
func normalize(ev rawEvent) rawEvent {
	if ev.has&hasA == 0 {
		ev.act, ev.badAction = actNone, ""
	}
	// encoding/json turns each invalid UTF-8 byte of a string into U+FFFD,
	// as a conversion to runes does; the parser keeps the bytes, which only
	// ever reach an error message, quoted.
	ev.badAction = string([]rune(ev.badAction))
	if ev.has&hasAddr == 0 {
		ev.addr = 0
	}
	if ev.has&hasSize == 0 {
		ev.size = 0
	}
	if ev.has&hasStream == 0 {
		ev.stream = 0
	}
	if ev.has&hasT == 0 {
		ev.t = 0
	}
	return ev
}

// eachLine calls f on every event line of a bundled trace.
func eachLine(t *testing.T, path string, f func(n int, line []byte)) {
	file, err := os.Open(path)
	require.NoError(t, err)
	defer file.Close()
	zr, err := gzip.NewReader(file)
	require.NoError(t, err)
	sc := bufio.NewScanner(zr)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		if n > 1 {
			f(n, sc.Bytes())
		}
	}
	require.NoError(t, sc.Err())
}

// TestParseMatchesEncodingJSON checks every line of both bundled traces:
// each of the three parsers (the recorded-layout matcher, the general scan
// and the encoding/json fallback) must read exactly what encoding/json reads.
// Under -short it checks every 16th line (`make stress` checks them all).
func TestParseMatchesEncodingJSON(t *testing.T) {
	stride := 1
	if testing.Short() {
		stride = 16
	}
	for _, path := range bundled {
		lines := 0
		eachLine(t, path, func(n int, line []byte) {
			lines++
			if n%stride != 0 {
				return
			}
			want, err := referenceParse(line)
			require.NoError(t, err, "%s:%d", path, n)
			require.NotZero(t, want.has&hasA, "%s:%d", path, n)

			var ev rawEvent
			require.True(t, parseRecorded(line, &ev), "%s:%d: the bundled traces are all in the recorded layout", path, n)
			require.Equal(t, want, normalize(ev), "%s:%d: parseRecorded", path, n)

			ev = rawEvent{}
			require.NoError(t, parseEventFast(line, &ev), "%s:%d", path, n)
			require.Equal(t, want, normalize(ev), "%s:%d: parseEventFast", path, n)

			ev = rawEvent{}
			require.NoError(t, parseEventSlow(line, &ev), "%s:%d", path, n)
			require.Equal(t, want, normalize(ev), "%s:%d: parseEventSlow", path, n)
		})
		require.Greater(t, lines, 90000, path)
	}
}

var parseSeeds = []string{
	`{"a": "alloc", "addr": 140577299496960, "size": 154389504, "stream": 0, "t": 1795949109765507}`,
	`{"a":"free_completed","addr":1,"size":512,"stream":7,"t":0}`,
	`  { "t" : -5 , "stream" : 3, "size": 0, "addr": 18446744073709551615, "a" : "segment_alloc" }  `,
	`{"a": "alloc", "addr": 1, "size": 512, "stream": 0, "t": 1}` + "\r",
	`{"a": "al\u006coc", "addr": 1, "size": 512, "stream": 0}`,
	`{"a": "alloc", "addr": 1, "size": 512, "stream": 0, "extra": {"nested": [1, 2, {"x": null}]}}`,
	`{"a": "alloc", "addr": 1, "size": 512, "stream": 0, "note": "a \"quoted\" word", "ok": true, "f": 1.5e-3}`,
	`{"a": "alloc", "addr": 1, "size": null, "stream": 0}`,
	`{"a": "alloc", "size": 5, "size": 6, "addr": 1, "stream": 0}`,
	`{"a": "alloc", "size": 5, "size": null, "addr": 1, "stream": 0}`,
	`{"A": "alloc", "Size": 5}`,
	`{"a": "explode", "addr": 1, "size": 512, "stream": 0}`,
	`{"a": 5}`,
	`{"a": "alloc", "addr": -1}`,
	`{"a": "alloc", "addr": 1.0}`,
	`{"a": "alloc", "addr": 1e3}`,
	`{"a": "alloc", "addr": 01}`,
	`{"a": "alloc", "addr": 18446744073709551616}`,
	`{"a": "alloc", "addr": 99999999999999999999999}`,
	`{"t": -9223372036854775808}`,
	`{"t": 9223372036854775808}`,
	`{"t": -0}`,
	`{"addr": -0}`,
	`{"size": "12"}`,
	`{"a": "alloc", "addr": 1, "size": 512, "stream": 0} x`,
	`{"a": "alloc", "addr": 1, "size": 512, "stream": 0`,
	`{"a": "alloc" "addr": 1}`,
	`{"a": "alloc",}`,
	`{"a": "all`,
	"{\"a\": \"al\x01loc\"}",
	`{}`,
	`null`,
	`[]`,
	`   `,
	``,
	`{"x": tru}`,
	`{"x": 1.}`,
	`{"x": -}`,
	`{"x": 1e}`,
}

// FuzzParseEvent checks parseEvent against the reference on any input: the
// same lines are accepted, with the same meaning.
func FuzzParseEvent(f *testing.F) {
	for _, s := range parseSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		want, wantErr := referenceParse(line)
		var ev rawEvent
		err := parseEvent(line, &ev)
		if wantErr != nil {
			require.Error(t, err, "encoding/json rejects %q (%v)", line, wantErr)
			return
		}
		require.NoError(t, err, "encoding/json accepts %q", line)
		require.Equal(t, want, normalize(ev), "%q", line)
	})
}

func TestParseErrorMessages(t *testing.T) {
	for _, c := range []struct{ line, want string }{
		{`{"a": "alloc", "addr": 1, "size": "12", "stream": 0}`, `field size: want a non-negative integer, got "\"12\""`},
		{`{"a": "alloc", "addr": -1, "size": 12, "stream": 0}`, `field addr: want a non-negative integer, got "-1"`},
		{`{"a": "alloc", "addr": 1.5, "size": 12, "stream": 0}`, `field addr: want a non-negative integer, got "1.5"`},
		{`{"a": "alloc", "addr": 99999999999999999999, "size": 12, "stream": 0}`, `does not fit in 64 bits`},
		{`{"a": 3, "addr": 1}`, `field a: want a string naming the action, got "3"`},
		{`{"a": "alloc" "addr": 1}`, `malformed JSON at column 15: want ',' or '}' after the value of "a"`},
		{`{"a": "alloc", "addr": 1`, `malformed JSON at column 25: want ',' or '}'`},
		{`{"a": "alloc", "addr": 1} trailing`, `malformed JSON at column 27: unexpected text after the object`},
		{`not json`, `malformed JSON at column 1: want '{'`},
		{`{"a": "alloc", "x": {"y": }}`, `malformed JSON: invalid character '}'`},
	} {
		var ev rawEvent
		err := parseEvent([]byte(c.line), &ev)
		require.ErrorContains(t, err, c.want, "%s", c.line)
	}
}

func TestEightDigits(t *testing.T) {
	for _, s := range []string{"00000000", "12345678", "99999999", "10203040"} {
		v := uint64(0)
		for i := 7; i >= 0; i-- {
			v = v<<8 | uint64(s[i])
		}
		require.True(t, eightDigits(v), s)
		want, _ := strconv.ParseUint(s, 10, 64)
		require.Equal(t, want, parseEight(v), s)
	}
	for _, s := range []string{"1234567a", "/2345678", ":2345678", "1234 678", "12345678"[:7] + "\x00"} {
		v := uint64(0)
		for i := 7; i >= 0; i-- {
			v = v<<8 | uint64(s[i])
		}
		require.False(t, eightDigits(v), "%q", s)
	}
}

// The recorder's layout, and any line naming an action, parse without
// allocating: the action's name is matched against caching's table in place.
func TestParseEventAllocatesNothing(t *testing.T) {
	for _, line := range []string{
		`{"a": "alloc", "addr": 140577299496960, "size": 512, "stream": 0, "t": 1795949109765507}`,
		`{"a": "free_completed", "addr": 140577299496960, "size": 512, "stream": 0, "t": 1795949109765507}`,
		`{"size": 512, "a": "segment_alloc", "stream": 3, "addr": 7}`,
	} {
		b := []byte(line)
		var ev rawEvent
		require.NoError(t, parseEvent(b, &ev), line)
		require.NotEqual(t, actNone, ev.act, line)
		require.Zero(t, testing.AllocsPerRun(100, func() { _ = parseEvent(b, &ev) }), line)
	}
}
