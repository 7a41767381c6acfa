// Package units reads and writes the sizes and counts goalloc's messages,
// configuration and reports carry, so that every part of goalloc (the
// allocator's errors, GOALLOC_CONF and GOALLOC_SIM_MEMORY, the replay tool's
// flags, tables and HTML report) spells a size the same way and reads back
// what another part wrote. It imports only the standard library, so any
// package may use it.
package units

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// FormatBytes writes n in the largest binary unit it reaches, with two
// decimals (23.64 GiB), as goalloc's messages and reports do.
func FormatBytes(n uint64) string {
	unit, name := BinaryUnit(n)
	if unit == 1 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.2f %s", float64(n)/float64(unit), name)
}

// BinaryUnit is the largest of B, KiB, MiB and GiB that n reaches, as bytes
// and as its name: the unit FormatBytes writes n in, and the one a plot's
// axis up to n counts in.
func BinaryUnit(n uint64) (uint64, string) {
	switch {
	case n >= 1<<30:
		return 1 << 30, "GiB"
	case n >= 1<<20:
		return 1 << 20, "MiB"
	case n >= 1<<10:
		return 1 << 10, "KiB"
	}
	return 1, "B"
}

// FormatCount writes n with thousands separators (1,234,567), as the replay
// tool's tables and report do.
func FormatCount(n uint64) string {
	s := strconv.FormatUint(n, 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// ParseBytes reads a byte count: a plain integer, or a number with a suffix
// K, M, G, T (powers of 1024; KB/KiB and friends mean the same), in either
// case and with spaces around it. A fraction of a byte is dropped (1.5K is
// 1536, 0.5 is 0).
func ParseBytes(v string) (uint64, error) {
	s, mult := splitUnit(strings.ToUpper(strings.TrimSpace(v)))
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("%q is not a byte size", v)
	}
	n := f * float64(mult)
	if n >= math.MaxUint64 {
		return 0, fmt.Errorf("%q is too large", v)
	}
	return uint64(n), nil
}

// splitUnit splits an upper-cased size into its number and multiplier.
func splitUnit(s string) (string, uint64) {
	for _, u := range []struct {
		suffix string
		mult   uint64
	}{{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}} {
		for _, form := range []string{u.suffix + "IB", u.suffix + "B", u.suffix} {
			if strings.HasSuffix(s, form) {
				return strings.TrimSpace(strings.TrimSuffix(s, form)), u.mult
			}
		}
	}
	return strings.TrimSuffix(s, "B"), 1
}

// RoundUp rounds n up to a multiple of align, which must not be 0.
func RoundUp(n, align uint64) uint64 { return (n + align - 1) / align * align }
