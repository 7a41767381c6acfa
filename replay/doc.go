// Package replay replays recorded PyTorch allocation traces through an
// allocation policy over a device, and measures what it costs in memory and
// in time. It is the engine of `goalloc replay` (cmd/goalloc).
//
// # Design
//
// Reading and replaying are two passes. Open parses the whole trace (see
// traces/README.md for the format) into a Trace: a compact slice of Events,
// only the alloc and free_completed lines, each 32 bytes. The trace's address
// ids are resolved once, at parse time, into slots of a dense pointer table
// (freed slots are reused, so the table is as large as the most blocks live
// at once), so the replay loop indexes a slice where it would otherwise look
// up a map, and every trace error (an unknown action, a free of an id that
// is not live) is reported with its line number before anything runs. One
// parse serves any number of replays: `goalloc replay --compare` runs every
// policy on the same Trace.
//
// Open also takes the memory snapshot pickles PyTorch writes
// (torch.cuda.memory._dump_snapshot, snapshot.go, read by the small
// unpickler of pickle.go): one device's history becomes the same Trace,
// preceded by the allocations of the blocks live at its first event, and
// Trace.Snapshot says what the replay can and cannot reproduce of it.
//
// Parsing is most of the work (a trace is mostly numbers), so it is fast on
// purpose: a goroutine decompresses the next chunk of lines while the
// current one is parsed, and event lines are read by hand (parse.go), first
// against the exact layout the recorder writes and then, for any other valid
// layout, by a general scan; anything stranger goes to encoding/json. The
// tests hold all three to encoding/json's reading of every line of the
// bundled traces, and a fuzz test to any input.
//
// Replay acts on alloc (Malloc) and free_completed (Free) events, passing
// each event's stream, and ignores segment_alloc and free_requested, which
// describe the recorded allocator's own decisions. The policy runs over the
// device through a thin counting wrapper, the same for every policy, which
// counts device allocations and frees, follows the bytes the policy holds
// from the device, and re-reads the pool's reserved bytes after the calls
// that can change them. So the replay loop itself does no more per event
// than the policy's call, a store of live bytes, and two compares.
//
// # Measures
//
// The headline figure is PeakReservedBytes, the device pool's own reserved
// high-water mark (arena.PoolUsage.ReservedHigh): what the driver really
// mapped, the same measure on the simulated pool and on a GPU, and over the
// trace's peak of live bytes it gives Ratio. The policies modelled on
// cudaMalloc (native, buddy, fixed) take whole segments, which the driver
// maps one by one rather than packing them into a pool's chunks, so for them
// the headline is the most bytes of segments they held. Next to it stand the policy's
// own accounting (AllocatorPeakReservedBytes) and the trace header's figures
// from the recorded PyTorch run (max_reserved / max_allocated).
//
// Fragmentation is captured once, right after the event at which live bytes
// first reach their peak: the parse already knows that event (live bytes
// depend on the trace alone, unless an allocation fails), so the policy is
// asked exactly once, at the moment that matters, and its cost is left out
// of the timing.
//
// NsPerOp is the replay loop's wall time per replayed event;
// EndToEndEventsPerSecond counts every line of the trace over the time to
// read, parse and replay it.
//
// Timelines of live and reserved bytes are kept for the HTML report
// (WriteHTML): live bytes per event, reserved bytes as steps, drawn with at
// most two points per pixel column, each column's lowest and highest, so
// the plot is small and still keeps every peak.
package replay
