#!/bin/sh
# What goalloc's calls cost when the caches are cold, for two commits, by
# valgrind's callgrind with its cache simulation: the bundled ResNet-50
# trace replayed once on the simulated VMM device with WALK KiB walked
# between events (BenchmarkReplayVMMCold, replay/bench_test.go, taken from
# the working tree for both sides so that only the library differs),
# counting only inside the calls (coldMalloc and coldFree; the walk runs
# simulated, not counted). Printed per call, for base and head:
# instructions, simulated first-level data cache misses (reads and writes)
# and last-level misses; then where the head's first-level read misses fall,
# by function. A cache miss is what a call pays for in training, where
# torch's own work between two calls evicts the allocator's lines; the
# counts are the simulator's (32 KiB first level, the host's last level),
# so they compare commits, not machines. Go randomises its maps' hashing
# per process, so two runs of one build differ a little: the script runs
# each side RUNS times and prints each run.
#
#   tests/misspath_compare.sh [BASE] [WALK] [RUNS]     (defaults: main, 256, 2)
#
# Needs Go and valgrind; no GPU. About a minute a run.
set -eu
base=${1:-main}
walk=${2:-256}
runs=${3:-2}
. "$(dirname "$0")/compare_lib.sh" "$base"
cp "$repo/replay/bench_test.go" "$tmp/base/replay/bench_test.go"
build() { go test -c -o "$tmp/$side.test" ./replay; }
each_side build
compare_header "$base"
echo "per call, the ResNet-50 trace with $walk KiB walked between events (callgrind)"
echo "side   run  calls     instructions  D1 misses (read+write)  LL misses"
for i in $(seq "$runs"); do
	for side in base head; do
		out=$tmp/$side-$i.cg
		# No asynchronous preemption: callgrind sometimes fails an assertion
		# on the signal Go sends for it (threads.c, vgCallgrind_post_signal).
		(cd "$repo/replay" && GOMAXPROCS=1 GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind --cache-sim=yes --callgrind-out-file="$out" \
			--toggle-collect='*replay.coldMalloc' --toggle-collect='*replay.coldFree' \
			"$tmp/$side.test" -test.run '^$' -test.bench "ReplayVMMCold/walk=${walk}KiB/calls=true\$" \
			-test.benchtime 1x -test.cpu 1 >"$tmp/$side-$i.log" 2>&1) ||
			{ tail -20 "$tmp/$side-$i.log"; exit 1; }
		calls=$(awk '{for (k = 2; k <= NF; k++) if ($k == "calls/replay") print int($(k - 1))}' "$tmp/$side-$i.log")
		[ -n "$calls" ] || { echo "no calls/replay in the benchmark's output:"; tail -5 "$tmp/$side-$i.log"; exit 1; }
		# The summary line holds the totals, in the order of the events line.
		awk -v side=$side -v run=$i -v calls="$calls" '
			/^events:/ {for (k = 2; k <= NF; k++) col[$k] = k - 1}
			/^summary:/ {
				printf "%-6s %3d  %5d  %15.1f  %22.2f  %9.3f\n", side, run, calls,
					$(col["Ir"] + 1) / calls, ($(col["D1mr"] + 1) + $(col["D1mw"] + 1)) / calls,
					($(col["DLmr"] + 1) + $(col["DLmw"] + 1)) / calls
			}' "$out"
	done
done
echo
echo "where head's simulated first-level read misses fall (its last run; self cost per function):"
callgrind_annotate --show=Ir,D1mr,D1mw --sort=D1mr "$tmp/head-$runs.cg" 2>/dev/null |
	awk '/file:function/ {on = 1; next} on && NF > 0' | head -15 | sed 's|github.com/goalloc/goalloc/||; s| \[.*\]$||'
