package caching

import (
	"sync"

	"github.com/goalloc/goalloc/arena"
)

// FrontEmulator does in Go what goalloc's C++ class does with the front log
// (python/goalloc/csrc/goalloc_front.h), step for step, so that the
// allocator's side of the protocol can be tested without C++ and a replay
// can run through a front: it tracks the live blocks of the general cache
// it was handed, writes frees into the log, and hands a pending free out
// again to a request of its stream and size. Safe for concurrent use.
type FrontEmulator struct {
	mu   sync.Mutex // the C++ side's table lock, taken before the log's
	live map[uintptr]frontBlock
	// Given and Recycled count the frees written to the log and the pending
	// frees handed out again.
	Given, Recycled int
}

type frontBlock struct {
	stream    arena.Stream
	requested uint64
}

// NewFrontEmulator makes a front with no blocks.
func NewFrontEmulator() *FrontEmulator { return &FrontEmulator{live: map[uintptr]frontBlock{}} }

// Malloc is the class's malloc: a pending free of stream s and size bytes
// handed out again, else a's Malloc, tracked.
func (f *FrontEmulator) Malloc(a *Allocator, size uint64, s arena.Stream) (uintptr, error) {
	if p := f.take(a, size, s); p != 0 {
		return p, nil
	}
	p, err := a.Malloc(size, s)
	if err == nil {
		f.track(a, p, size, s)
	}
	return p, err
}

// Free is the class's free: into the log, else a's FreeOwned.
func (f *FrontEmulator) Free(a *Allocator, p uintptr) error {
	if f.give(a, p) {
		return nil
	}
	_, err := a.FreeOwned(p)
	return err
}

// track records a block Malloc returned from the general cache.
func (f *FrontEmulator) track(a *Allocator, p uintptr, size uint64, s arena.Stream) {
	if size == 0 || p == 0 {
		return // PyTorch never asks for 0 bytes: the class answers it
	}
	if a.Front() == nil && a.EnableFront() == nil { // the C++ side asks once per device
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live[p] = frontBlock{stream: s, requested: size}
}

// take is a pending free of stream s and size bytes handed out again, or 0.
func (f *FrontEmulator) take(a *Allocator, size uint64, s arena.Stream) uintptr {
	l := a.Front()
	if size == 0 || l == nil {
		return 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	l.acquire()
	defer l.release()
	if l.enabled.Load() == 0 {
		return 0
	}
	for i := int(l.n.Load()) - 1; i >= 0; i-- {
		e := &l.entries[i]
		if e.Recycled == 0 && e.Stream == uint64(s) && e.Requested == size {
			e.Recycled = 1
			f.Recycled++
			f.live[uintptr(e.Ptr)] = frontBlock{stream: s, requested: size}
			return uintptr(e.Ptr)
		}
	}
	return 0
}

// give writes the free of p into the log; false: the caller frees it
// through Go (not tracked, log full, or the front off). (The C++ side asks
// Go to drain a full log first; here the free goes to Go, which drains.)
func (f *FrontEmulator) give(a *Allocator, p uintptr) bool {
	l := a.Front()
	if l == nil {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.live[p]
	if !ok {
		return false
	}
	delete(f.live, p)
	l.acquire()
	defer l.release()
	n := l.n.Load()
	if l.enabled.Load() == 0 || n == FrontCap {
		return false
	}
	l.entries[n] = FrontEntry{Ptr: uint64(p), Stream: uint64(b.stream), Requested: b.requested}
	l.n.Store(n + 1)
	f.Given++
	return true
}

// forget drops p (record_stream gave it to another stream).
func (f *FrontEmulator) forget(p uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.live, p)
}
