package main

/*
// The memory tag of each OS thread (goalloc_set_memory_tag): allocations
// the thread makes carry it. It is kept in C, per OS thread, as the last
// error is (lasterror.go), and for the same reason: an exported function
// runs on its C caller's thread, so Go reads the caller's tag, whichever
// way the allocation arrived (PyTorch's pluggable path, goalloc's C++
// class, a C caller). A Python thread is an OS thread. 0: untagged.
static __thread unsigned int goalloc_thread_tag_value;

static unsigned int goalloc_thread_tag_get(void) { return goalloc_thread_tag_value; }
static void goalloc_thread_tag_set(unsigned int tag) { goalloc_thread_tag_value = tag; }
*/
import "C"

import "github.com/goalloc/goalloc/caching"

// threadTag is the calling OS thread's memory tag. A call from Go to C: the
// allocation paths ask only once a tag was set in the process
// (library.tagsUsed).
func threadTag() caching.Tag { return caching.Tag(C.goalloc_thread_tag_get()) }

// setThreadTag sets the calling OS thread's memory tag.
func setThreadTag(t caching.Tag) { C.goalloc_thread_tag_set(C.uint(t)) }
