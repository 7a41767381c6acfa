package main

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"testing"
)

// The command reaches the allocator only through the replay side (replay,
// replay/reference): configuration is read by reference.DeviceSpec and
// reference.ConfKeys, so a change of caching's API touches one package.
func TestCommandDoesNotImportCaching(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); path == "github.com/goalloc/goalloc/caching" {
				t.Errorf("%s imports %s", name, path)
			}
		}
	}
}
