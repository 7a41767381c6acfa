package main

import (
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/goalloc/goalloc/caching"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goalloc.h is the C ABI's one declaration (main.go). cgo checks each
// //export against it when it compiles this package, but Go's build cache
// does not see a header outside the package's folder: after a change to the
// header alone, the package is not compiled again. These tests read the
// header afresh (so that go test's cache does see it) and check it against
// the library as it is built now.

// headerPath is goalloc.h, beside the C++ class.
const headerPath = "../python/goalloc/csrc/goalloc.h"

var (
	cComment     = regexp.MustCompile(`(?s)/\*.*?\*/|//[^\n]*`)
	cDirective   = regexp.MustCompile(`(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*`)
	cDeclaration = regexp.MustCompile(`^[\w\s\*]*?\b(\w+)\s*\(([^()]*)\)$`)
)

// headerFunctions is every function goalloc.h declares, by name, with its
// declaration.
func headerFunctions(t *testing.T) map[string]string {
	src, err := os.ReadFile(headerPath)
	require.NoError(t, err)
	text := cDirective.ReplaceAllString(cComment.ReplaceAllString(string(src), " "), " ")
	text = strings.NewReplacer(`extern "C" {`, " ", "}", " ").Replace(text)
	fns := map[string]string{}
	for _, decl := range strings.Split(text, ";") {
		decl = strings.Join(strings.Fields(decl), " ")
		if decl == "" || strings.HasPrefix(decl, "typedef ") || strings.HasPrefix(decl, "enum ") {
			continue
		}
		m := cDeclaration.FindStringSubmatch(decl)
		require.NotNil(t, m, "goalloc.h: %q is not a function declaration this test reads", decl)
		require.NotContains(t, fns, m[1], "goalloc.h declares %s twice", m[1])
		fns[m[1]] = decl
	}
	require.NotEmpty(t, fns)
	return fns
}

// buildLibrary builds libgoalloc.so as `make lib` does, into a folder of
// the test's; cgo writes its header, libgoalloc.h, beside it.
func buildLibrary(t *testing.T) (dir string) {
	dir = t.TempDir()
	cmd := exec.Command("go", "build", "-buildmode=c-shared", "-o", filepath.Join(dir, "libgoalloc.so"), ".")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build -buildmode=c-shared:\n%s", out)
	return dir
}

// The library exports exactly the functions goalloc.h declares, and with
// the signatures it declares: cgo's header for the library as built now is
// compiled together with goalloc.h, where a C compiler refuses two
// declarations of one function that differ. Both are compiled as C and as
// C++, and the statistics count the header computes must be the one the
// library was built with.
func TestHeaderDeclaresWhatTheLibraryExports(t *testing.T) {
	declared := headerFunctions(t)
	dir := buildLibrary(t)

	f, err := elf.Open(filepath.Join(dir, "libgoalloc.so"))
	require.NoError(t, err)
	defer f.Close()
	syms, err := f.DynamicSymbols()
	require.NoError(t, err)
	exported := map[string]bool{}
	for _, s := range syms {
		if elf.ST_TYPE(s.Info) == elf.STT_FUNC && elf.ST_BIND(s.Info) == elf.STB_GLOBAL && s.Section != elf.SHN_UNDEF &&
			(strings.HasPrefix(s.Name, "goalloc_") || strings.HasPrefix(s.Name, "my_")) {
			exported[s.Name] = true
		}
	}
	for name := range exported {
		assert.Contains(t, declared, name, "libgoalloc.so exports %s, which goalloc.h does not declare", name)
	}
	for name := range declared {
		assert.True(t, exported[name], "goalloc.h declares %s, which libgoalloc.so does not export", name)
	}

	csrc, err := filepath.Abs(filepath.Dir(headerPath))
	require.NoError(t, err)
	here, err := os.Getwd()
	require.NoError(t, err)
	tu := filepath.Join(dir, "both.c")
	require.NoError(t, os.WriteFile(tu, []byte(fmt.Sprintf(`#include "goalloc.h"
#include "libgoalloc.h"
#ifdef __cplusplus
#define _Static_assert static_assert
#endif
_Static_assert(GOALLOC_TORCH_STAT_FIGURES == %d, "goalloc.h counts other statistics than the library was built with");
`, torchStatFigures)), 0o644))
	for _, lang := range []struct{ compiler, flags string }{{"cc", "-xc -std=c11"}, {"c++", "-xc++ -std=c++17"}} {
		args := append(strings.Fields(lang.flags), "-fsyntax-only", "-Wall", "-Werror", "-I"+csrc, "-I"+here, "-I"+dir, tu)
		out, err := exec.Command(lang.compiler, args...).CombinedOutput()
		assert.NoError(t, err, "%s: goalloc.h and cgo's declarations of the library disagree:\n%s", lang.compiler, out)
	}
}

// xMacroEntries is the arguments of each X(...) of the table macro name in
// goalloc.h.
func xMacroEntries(t *testing.T, name string) [][]string {
	src, err := os.ReadFile(headerPath)
	require.NoError(t, err)
	body := regexp.MustCompile(`(?m)^#define ` + name + `\(X\)((?:[^\n]*\\\n)*[^\n]*)`).FindSubmatch(src)
	require.NotNil(t, body, "goalloc.h defines no %s(X)", name)
	var entries [][]string
	for _, m := range regexp.MustCompile(`X\(([^)]*)\)`).FindAllSubmatch(body[1], -1) {
		var args []string
		for _, a := range strings.Split(string(m[1]), ",") {
			args = append(args, strings.TrimSpace(a))
		}
		entries = append(entries, args)
	}
	require.NotEmpty(t, entries, name)
	return entries
}

func firstArgs(entries [][]string) []string {
	var names []string
	for _, e := range entries {
		names = append(names, e[0])
	}
	return names
}

// caching's statistics tables are goalloc.h's: the same names in the same
// order, so that goalloc_torch_device_stats writes each figure where the
// C++ class reads it, and memory_stats() names them as c10 does.
func TestStatTablesMatchTheHeader(t *testing.T) {
	arrays, pools, values, counters := caching.StatTables()
	assert.Equal(t, firstArgs(xMacroEntries(t, "GOALLOC_STAT_ARRAYS")), arrays, "GOALLOC_STAT_ARRAYS")
	assert.Equal(t, firstArgs(xMacroEntries(t, "GOALLOC_STAT_POOLS")), pools, "GOALLOC_STAT_POOLS")
	assert.Equal(t, firstArgs(xMacroEntries(t, "GOALLOC_STAT_VALUES")), values, "GOALLOC_STAT_VALUES")
	assert.Equal(t, firstArgs(xMacroEntries(t, "GOALLOC_STAT_COUNTERS")), counters, "GOALLOC_STAT_COUNTERS")
}

// The error kinds are goalloc.h's: the same names at the same numbers, as C
// callers and the Python package read them from there.
func TestErrorKindsMatchTheHeader(t *testing.T) {
	assert.Equal(t, firstArgs(xMacroEntries(t, "GOALLOC_ERROR_KINDS")), errorKindNames[:], "GOALLOC_ERROR_KINDS")
}
