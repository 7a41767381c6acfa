#!/bin/sh
# The cache-hit malloc+free pair of two commits, measured in one run: the
# `make bench` benchmarks (BenchmarkMallocFreeHit from Go, BenchmarkCABIPair
# through the C ABI) built from BASE and from the working tree, then
#   - instructions per pair (valgrind's cachegrind: a run of 300000 pairs
#     minus a run of 100000, over 200000; deterministic, so one run each), and
#   - ns per pair, ROUNDS alternating runs of the two builds (-cpu 1), of
#     which the minimum and the median are printed.
#
#   tests/hitpair_compare.sh [BASE] [ROUNDS]     (defaults: main, 10)
#
# Needs Go, a C compiler and valgrind; no GPU (the simulated device).
set -eu
base=${1:-main}
rounds=${2:-10}
. "$(dirname "$0")/compare_lib.sh" "$base"
build() {
	go test -c -tags goalloc_bench -o "$tmp/$side-caching.test" ./caching &&
		go test -c -tags goalloc_bench -o "$tmp/$side-export.test" ./export
}
each_side build
compare_header "$base"

instr() { # binary benchmark pairs -> instructions
	valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null "$1" -test.run '^$' \
		-test.bench "$2\$" -test.benchtime "${3}x" -test.cpu 1 2>&1 | sed -n 's/.*I *refs: *//p' | tr -d ,
}
echo
echo "instructions per pair (cachegrind)      base   head"
for b in MallocFreeHit/4KiB MallocFreeHit/1024KiB MallocFreeHit/65536KiB \
	CABIPair/4KiB CABIPair/1024KiB CABIPair/65536KiB \
	CABIPair/cxx/4KiB CABIPair/cxx/1024KiB CABIPair/cxx/65536KiB; do
	pkg=caching
	case $b in CABIPair/*) pkg=export ;; esac
	line=$(printf '%-38s' "Benchmark$b")
	for side in base head; do
		lo=$(instr "$tmp/$side-$pkg.test" "Benchmark$b" 100000)
		hi=$(instr "$tmp/$side-$pkg.test" "Benchmark$b" 300000)
		line="$line $(printf '%6d' $(((hi - lo) / 200000)))"
	done
	echo "$line"
done

echo
echo "ns per pair, $rounds alternating runs: min / median     base            head"
for i in $(seq "$rounds"); do
	for side in base head; do
		for pkg in caching export; do
			GOALLOC_DEVICE=sim "$tmp/$side-$pkg.test" -test.run '^$' -test.bench . -test.benchtime 100ms -test.cpu 1 |
				awk -v s=$side '/^Benchmark/ {print s, $1, $3}' >>"$tmp/times"
		done
	done
done
for b in $(awk '{print $2}' "$tmp/times" | sort -u); do
	line=$(printf '%-44s' "$b")
	for side in base head; do
		stats=$(awk -v s=$side -v b="$b" '$1 == s && $2 == b {print $3}' "$tmp/times" | sort -g |
			awk '{v[NR] = $1} END {printf "%7.1f / %7.1f", v[1], (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}')
		line="$line  $stats"
	done
	echo "$line"
done
