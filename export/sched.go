package main

// Why a thread that calls goalloc from C++ may yield to Go's scheduler.
//
// A C thread that calls an exported Go function runs it on a Go processor
// (a P) and, when the call returns to C, keeps that P in the state Go gives
// a thread in a system call: the next call takes it back with one atomic
// operation (tens of nanoseconds). Go's monitor thread
// (sysmon) takes the P away from a thread out in C only when the P's
// scheduling tick has not moved for 10 ms (the runtime's forcePreemptNS,
// proc.go's retake). A call from C never moves that tick: it runs no
// scheduler. So, 10 ms after a thread's first call, sysmon takes its P at
// every tick it finds the thread out in C (a tick every 20 us while it
// keeps finding work), and the next call finds the P gone: it takes an
// idle P under the scheduler's lock and wakes sysmon, which had gone to
// sleep with every P idle (a futex call and a thread switch).
//
// What that costs depends on how long the thread stayed in C: nothing
// after a short stretch, microseconds after one of hundreds of
// microseconds, where the call itself costs under a tenth of one. A
// training step bound by the host (launches, cuDNN and Python between its
// allocations) is made of such stretches.
//
// runtime.Gosched moves the tick: the thread hands its P to the scheduler
// and gets one back. The C++ class can do it at most once every
// Config.YieldEvery on each thread that calls into Go, checking the clock
// every few calls (python/goalloc/csrc/goalloc_sched.h). It is off by
// default: a yield is a thread switch for a locked thread, as every C
// thread in Go is, and costs more than most stretches lose. BENCHMARKS.md,
// "A call into Go after a stretch in C", has the measurements, and "Where
// a ResNet-50 step's time goes" found the crossing cheap inside a real
// step: the time a step spends in Go is Go's work, not the way in.

/*
#include "cgo.h"
*/
import "C"

import "runtime"

//export goalloc_sched_yield
func goalloc_sched_yield() { runtime.Gosched() }

//export goalloc_yield_every_ns
func goalloc_yield_every_ns() C.longlong { return C.longlong(lib.yieldEvery()) }

// yieldEvery is goalloc_yield_every_ns's answer: Config.YieldEvery in
// nanoseconds.
func (l *library) yieldEvery() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case !l.initialized:
		return -1
	case l.initErr != nil:
		return 0 // nothing will be allocated
	}
	return int64(l.cfg.YieldEvery)
}
