package replay

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/goalloc/goalloc/caching"
)

// This file parses one event line. Every line of a trace is a flat JSON
// object of a handful of fields, and encoding/json spends most of its time on
// reflection and allocation for such lines, several times what the replay
// of the event itself costs; so the common form is scanned by hand here, with
// no allocation. Anything unusual that is still valid JSON (escapes in a
// string, a nested object under a field the replay does not know) goes to
// parseEventSlow, which is encoding/json, so the two always agree: the tests
// check them against each other on every line of the bundled traces, and by
// fuzzing.

// lineActions are the actions an event line may name (the trace recorder
// writes no others); their names are caching's, PyTorch's.
var lineActions = [...]caching.Action{caching.ActionAlloc, caching.ActionFreeRequested,
	caching.ActionFreeCompleted, caching.ActionSegmentAlloc}

// actNone is an event's action when its "a" field names none of lineActions.
const actNone = caching.NumActions

// Which fields an event line had, as bits of rawEvent.has.
const (
	hasA = 1 << iota
	hasAddr
	hasSize
	hasStream
	hasT
)

// rawEvent is one event line as parsed, before it is checked against the
// trace's state (is the id live, ...).
type rawEvent struct {
	act                caching.Action // when has&hasA: one of lineActions, or actNone
	addr, size, stream uint64
	t                  int64
	has                uint8
	// badAction holds the "a" value when it names no known action.
	badAction string
}

// errSlow says the line is not of the common form the fast parser takes;
// parseEventSlow decides.
var errSlow = errors.New("not the common form")

// parseEvent parses an event line into ev. Lines the fast scan does not take
// go to parseEventSlow.
func parseEvent(b []byte, ev *rawEvent) error {
	*ev = rawEvent{}
	if parseRecorded(b, ev) {
		return nil
	}
	*ev = rawEvent{}
	err := parseEventFast(b, ev)
	if err == errSlow {
		*ev = rawEvent{}
		return parseEventSlow(b, ev)
	}
	return err
}

// parseRecorded takes the one layout the trace recorder writes,
//
//	{"a": "alloc", "addr": 140577299496960, "size": 512, "stream": 0, "t": 1795949109765507}
//
// by matching its fixed text in order, which is several times faster than
// scanning for structure. Any other line, valid or not, returns false and is
// left to the general scan, which also writes the error messages.
func parseRecorded(b []byte, ev *rawEvent) bool {
	const (
		open   = `{"a": "`
		addr   = `", "addr": `
		size   = `, "size": `
		stream = `, "stream": `
		t      = `, "t": `
	)
	if len(b) < len(open) || string(b[:len(open)]) != open {
		return false
	}
	i := len(open)
	k := bytes.IndexByte(b[i:], '"')
	if k < 0 {
		return false
	}
	act := actionNamed(b[i : i+k])
	if act == actNone {
		return false
	}
	ev.act = act
	i += k
	var ok bool
	if !hasAt(b, i, addr) {
		return false
	}
	if ev.addr, i, ok = plainDigits(b, i+len(addr)); !ok || !hasAt(b, i, size) {
		return false
	}
	if ev.size, i, ok = plainDigits(b, i+len(size)); !ok || !hasAt(b, i, stream) {
		return false
	}
	if ev.stream, i, ok = plainDigits(b, i+len(stream)); !ok || !hasAt(b, i, t) {
		return false
	}
	var tu uint64
	if tu, i, ok = plainDigits(b, i+len(t)); !ok || tu > math.MaxInt64 || i >= len(b) || b[i] != '}' {
		return false
	}
	if skipSpace(b, i+1) != len(b) {
		return false
	}
	ev.t = int64(tu)
	ev.has = hasA | hasAddr | hasSize | hasStream | hasT
	return true
}

func hasAt(b []byte, i int, s string) bool {
	return len(b)-i >= len(s) && string(b[i:i+len(s)]) == s
}

// plainDigits parses the unsigned integer of at most 19 digits at b[i],
// with no leading zero and no fraction or exponent after it; ok is false
// for anything else.
func plainDigits(b []byte, i int) (n uint64, j int, ok bool) {
	n, j = scanDigits(b, i)
	if j == i || j-i > 19 || (b[i] == '0' && j > i+1) {
		return 0, 0, false
	}
	if j < len(b) && (b[j] == '.' || b[j] == 'e' || b[j] == 'E') {
		return 0, 0, false
	}
	return n, j, true
}

// syntaxError is malformed JSON at a column (1-based) of the line.
func syntaxError(i int, format string, args ...any) error {
	return fmt.Errorf("malformed JSON at column %d: %s", i+1, fmt.Sprintf(format, args...))
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n') {
		i++
	}
	return i
}

func parseEventFast(b []byte, ev *rawEvent) error {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return syntaxError(i, "want '{' to start an object")
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return checkEnd(b, i+1)
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return syntaxError(i, "want a quoted field name")
		}
		end, err := scanString(b, i)
		if err != nil {
			return err
		}
		key := b[i+1 : end-1]
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ':' {
			return syntaxError(i, "want ':' after field name %s", preview(key))
		}
		i = skipSpace(b, i+1)
		if i < len(b) && b[i] == 'n' { // null: as if the field were absent
			if i, err = scanLiteral(b, i); err != nil {
				return err
			}
			ev.has &^= fieldBit(key)
		} else {
			switch string(key) {
			case "a":
				i, err = parseAction(b, i, ev)
			case "addr":
				ev.addr, i, err = parseUint(b, i, "addr")
				ev.has |= hasAddr
			case "size":
				ev.size, i, err = parseUint(b, i, "size")
				ev.has |= hasSize
			case "stream":
				ev.stream, i, err = parseUint(b, i, "stream")
				ev.has |= hasStream
			case "t":
				ev.t, i, err = parseInt(b, i, "t")
				ev.has |= hasT
			default:
				i, err = skipScalar(b, i)
			}
			if err != nil {
				return err
			}
		}
		i = skipSpace(b, i)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
			continue
		}
		if i < len(b) && b[i] == '}' {
			return checkEnd(b, i+1)
		}
		return syntaxError(i, "want ',' or '}' after the value of %s", preview(key))
	}
}

func fieldBit(key []byte) uint8 {
	switch string(key) {
	case "a":
		return hasA
	case "addr":
		return hasAddr
	case "size":
		return hasSize
	case "stream":
		return hasStream
	case "t":
		return hasT
	}
	return 0
}

func checkEnd(b []byte, i int) error {
	if i = skipSpace(b, i); i != len(b) {
		return syntaxError(i, "unexpected text after the object")
	}
	return nil
}

// scanString returns the end (one past the closing quote) of the string
// starting at b[i]. Escapes are left to encoding/json.
func scanString(b []byte, i int) (int, error) {
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			return j + 1, nil
		case c == '\\':
			return 0, errSlow
		case c < 0x20:
			return 0, syntaxError(j, "control character in a string")
		}
	}
	return 0, syntaxError(len(b), "unterminated string")
}

func parseAction(b []byte, i int, ev *rawEvent) (int, error) {
	if i >= len(b) {
		return 0, syntaxError(i, "want a value")
	}
	if b[i] != '"' {
		return 0, fmt.Errorf("field a: want a string naming the action, got %s", valuePreview(b, i))
	}
	end, err := scanString(b, i)
	if err != nil {
		return 0, err
	}
	setAction(ev, b[i+1:end-1])
	return end, nil
}

// actionNamed is the one of lineActions that an event line names, or actNone.
func actionNamed(name []byte) caching.Action {
	for _, a := range lineActions {
		if string(name) == a.String() {
			return a
		}
	}
	return actNone
}

// lineActionList names lineActions for a message: "alloc, ... or segment_alloc".
func lineActionList() string {
	names := make([]string, len(lineActions))
	for i, a := range lineActions {
		names[i] = a.String()
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

func setAction(ev *rawEvent, name []byte) {
	ev.has |= hasA
	ev.badAction = ""
	if ev.act = actionNamed(name); ev.act == actNone {
		ev.badAction = string(name)
	}
}

// parseUint parses the non-negative integer at b[i], the value of field.
func parseUint(b []byte, i int, field string) (uint64, int, error) {
	return parseDigits(b, i, i, field, "a non-negative integer")
}

// parseInt parses the integer at b[i], the value of field.
func parseInt(b []byte, i int, field string) (int64, int, error) {
	if i < len(b) && b[i] == '-' {
		u, j, err := parseDigits(b, i, i+1, field, "an integer")
		if err == nil && u > 1<<63 {
			err = fmt.Errorf("field %s: %s does not fit in 64 bits", field, valuePreview(b, i))
		}
		return -int64(u), j, err // -(1<<63) wraps to itself, as it should
	}
	u, j, err := parseDigits(b, i, i, field, "an integer")
	if err == nil && u > math.MaxInt64 {
		err = fmt.Errorf("field %s: %s does not fit in 64 bits", field, valuePreview(b, i))
	}
	return int64(u), j, err
}

// scanDigits reads the decimal digits at b[i:] into n, without an
// overflow check (callers check the length), and returns where they end.
// Trace numbers are long (addresses and microsecond times have 15 and 16
// digits): it takes eight digits at a time while there are eight.
func scanDigits(b []byte, i int) (n uint64, j int) {
	j = i
	for len(b)-j >= 8 {
		v := binary.LittleEndian.Uint64(b[j:])
		if !eightDigits(v) {
			break
		}
		n = n*1e8 + parseEight(v)
		j += 8
	}
	for j < len(b) && '0' <= b[j] && b[j] <= '9' {
		n = n*10 + uint64(b[j]-'0')
		j++
	}
	return n, j
}

// parseDigits parses the digits at b[start:] of the value at b[i] of field,
// which must be want: a JSON number with no fraction and no exponent.
func parseDigits(b []byte, i, start int, field, want string) (uint64, int, error) {
	n, j := scanDigits(b, start)
	// 19 digits always fit in 64 bits; only a longer number can overflow,
	// and then the digits are parsed again with a check.
	if j-start > 19 {
		if _, err := strconv.ParseUint(string(b[start:j]), 10, 64); err != nil {
			return 0, 0, fmt.Errorf("field %s: %s does not fit in 64 bits", field, valuePreview(b, i))
		}
	}
	if j == start || (j < len(b) && (b[j] == '.' || b[j] == 'e' || b[j] == 'E')) {
		// Not an integer: is it valid JSON of another kind, or not JSON?
		if _, err := skipScalar(b, i); err != nil {
			return 0, 0, err
		}
		return 0, 0, fmt.Errorf("field %s: want %s, got %s", field, want, valuePreview(b, i))
	}
	if b[start] == '0' && j > start+1 {
		return 0, 0, syntaxError(start, "number with a leading zero")
	}
	return n, j, nil
}

// eightDigits says whether the eight bytes of v (little-endian) are all
// ASCII digits: each byte's high nibble is 3, and adding 6 keeps it 3.
func eightDigits(v uint64) bool {
	return (v&0xF0F0F0F0F0F0F0F0)|(((v+0x0606060606060606)&0xF0F0F0F0F0F0F0F0)>>4) == 0x3333333333333333
}

// parseEight is the value of eight ASCII digits, the first in the low byte
// of v: pairs of digits are combined, then pairs of pairs, in three multiplies.
func parseEight(v uint64) uint64 {
	v -= 0x3030303030303030
	v = v*10 + v>>8
	return ((v&0x000000FF000000FF)*(100+1000000<<32) + (v>>16&0x000000FF000000FF)*(1+10000<<32)) >> 32
}

// scanNumber checks the JSON number at b[i] and returns its end.
func scanNumber(b []byte, i int) (int, error) {
	j := i
	if j < len(b) && b[j] == '-' {
		j++
	}
	switch {
	case j < len(b) && b[j] == '0':
		j++
	case j < len(b) && '1' <= b[j] && b[j] <= '9':
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
	default:
		return 0, syntaxError(j, "want a value")
	}
	if j < len(b) && b[j] == '.' {
		j++
		if j >= len(b) || b[j] < '0' || b[j] > '9' {
			return 0, syntaxError(j, "want a digit after the decimal point")
		}
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
	}
	if j < len(b) && (b[j] == 'e' || b[j] == 'E') {
		j++
		if j < len(b) && (b[j] == '+' || b[j] == '-') {
			j++
		}
		if j >= len(b) || b[j] < '0' || b[j] > '9' {
			return 0, syntaxError(j, "want a digit in the exponent")
		}
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
	}
	return j, nil
}

func scanLiteral(b []byte, i int) (int, error) {
	for _, lit := range []string{"null", "true", "false"} {
		if len(b)-i >= len(lit) && string(b[i:i+len(lit)]) == lit {
			return i + len(lit), nil
		}
	}
	return 0, syntaxError(i, "want a value")
}

// skipScalar skips the value of a field the replay does not use. Objects and
// arrays are left to encoding/json.
func skipScalar(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, syntaxError(i, "want a value")
	}
	switch c := b[i]; {
	case c == '"':
		return scanString(b, i)
	case c == '{' || c == '[':
		return 0, errSlow
	case c == 't' || c == 'f' || c == 'n':
		return scanLiteral(b, i)
	}
	return scanNumber(b, i)
}

// previewBytes is how much of a value from the input a message quotes:
// enough to recognise it, while the message stays one short line however
// large the value is.
const previewBytes = 40

// preview quotes a value from the input for a message: whole when it is
// short, else its first previewBytes bytes and its length. Every message
// that shows input goes through it.
func preview[T ~string | ~[]byte](s T) string {
	if len(s) <= previewBytes {
		return strconv.Quote(string(s))
	}
	return fmt.Sprintf("%s... (%d bytes)", strconv.Quote(string(s[:previewBytes])), len(s))
}

// valuePreview quotes the value at b[i], up to the ',' or '}' after it, for
// a message.
func valuePreview(b []byte, i int) string {
	j := i
	for j < len(b) && b[j] != ',' && b[j] != '}' {
		j++
	}
	return preview(b[i:j])
}

// parseEventSlow parses an event line with encoding/json, fields matched by
// exact name (encoding/json's struct decoding would also take "Size" for
// "size"), the last of a repeated field winning, null as absent.
func parseEventSlow(b []byte, ev *rawEvent) error {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("malformed JSON: %v", err)
	}
	if m == nil {
		return errors.New("want a JSON object, got null")
	}
	for key, raw := range m {
		if string(raw) == "null" {
			continue
		}
		var err error
		switch key {
		case "a":
			var s string
			if err = json.Unmarshal(raw, &s); err != nil {
				return fmt.Errorf("field a: want a string naming the action, got %s", preview(raw))
			}
			setAction(ev, []byte(s))
		case "addr":
			ev.addr, err = slowUint(raw, "addr")
			ev.has |= hasAddr
		case "size":
			ev.size, err = slowUint(raw, "size")
			ev.has |= hasSize
		case "stream":
			ev.stream, err = slowUint(raw, "stream")
			ev.has |= hasStream
		case "t":
			if err = json.Unmarshal(raw, &ev.t); err != nil {
				err = fmt.Errorf("field t: want an integer, got %s", preview(raw))
			}
			ev.has |= hasT
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func slowUint(raw json.RawMessage, field string) (uint64, error) {
	var n uint64
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, fmt.Errorf("field %s: want a non-negative integer, got %s", field, preview(raw))
	}
	return n, nil
}
