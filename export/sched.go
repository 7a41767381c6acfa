package main

// Why a thread that calls goalloc from C++ may yield to Go's scheduler.
//
// A C thread that calls an exported Go function runs it on a Go processor
// (a P) and, when the call returns to C, keeps that P in the state Go gives
// a thread in a system call: the next call takes it back with one atomic
// operation (60-90 ns a call on the H200 machine). Go's monitor thread
// (sysmon) takes the P away from a thread out in C only when the P's
// scheduling tick has not moved for 10 ms (the runtime's forcePreemptNS,
// proc.go's retake). A call from C never moves that tick: it runs no
// scheduler. So, 10 ms after a thread's first call, sysmon takes its P at
// every tick it finds the thread out in C (a tick every 20 us while it
// keeps finding work), and the next call finds the P gone: it takes an
// idle P under the scheduler's lock and wakes sysmon, which had gone to
// sleep with every P idle (a futex call and a thread switch).
//
// What that costs depends on how long the thread stayed in C. Measured with
// bench/cgo_gap.cpp (a cache-hit malloc+free pair through the C++ class's
// entry points, two calls into Go, on the simulated device, the 2-core
// machine; bench/results/cgo_gap/cpu-2core.txt, BENCHMARKS.md "A call into
// Go after a stretch in C"): a pair made 0-5 us after the last costs
// 0.3-0.7 us on average, 20-60 us after 0.6-1.7 us, 200 us after 9.8-13.3
// us. A training step bound by the host (ResNet-50: about 1,200 allocations
// a step, with launches, cuDNN and Python in between) is made of such
// stretches.
//
// runtime.Gosched moves the tick: the thread hands its P to the scheduler
// and gets one back. The C++ class can do it at most once every
// Config.YieldEvery on each thread that calls into Go, checking the clock
// every few calls (python/goalloc/csrc/goalloc_sched.h). It is off by
// default: a yield is a thread switch for a locked thread, as every C
// thread in Go is, and cost about 100-150 us on the 2-core machine.
// There, yielding every 8 or 9 ms brought the pairs 200 us apart to 3.7-3.8
// us on average (p50 0.3-0.4 us against 9.6-17.3) and made those 20-60 us
// apart 0.2-1.2 us slower. On the two-GPU H200 host's CPU
// (bench/results/cgo_gap/gpu-h200x2.txt, run_gpu.sh cgogap) the price is
// smaller: a pair 200 us after the last cost 2.9 us on average, 1.7 us with
// a yield every 9 ms. And in ResNet-50 training there, the class's call
// clock found the crossing cheap where the step makes it: an empty call
// into Go made before each request took 0.30-0.36 us on average (p50 under
// 0.26 us; BENCHMARKS.md, "Where goalloc's time goes in a ResNet-50 step").
// So yielding stays off: the time a step spends in Go is Go's work, not
// the way in.

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
