package caching

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The action names are PyTorch's, in the order the replay tool lists them;
// each reads back to its action, and no other name reads as one.
func TestActionNames(t *testing.T) {
	want := []string{"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
		"segment_map", "segment_unmap", "oom", "snapshot"}
	require.Len(t, want, int(NumActions))
	for a := range NumActions {
		assert.Equal(t, want[a], a.String())
		got, ok := ActionNamed(a.String())
		assert.True(t, ok, a.String())
		assert.Equal(t, a, got)
	}
	for _, name := range []string{"", "Alloc", "free", "empty_cache", "alloc "} {
		_, ok := ActionNamed(name)
		assert.False(t, ok, name)
	}
	assert.Equal(t, "snapshot", actionEmptyCache.String(), "an empty_cache is marked as it was")
}
