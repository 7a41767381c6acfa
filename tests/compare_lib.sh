# Sourced by the scripts that measure two commits side by side
# (tests/hitpair_compare.sh, tests/misspath_compare.sh, tests/gpu/cold_ab.py
# --build):
#
#   . tests/compare_lib.sh BASE
#
# sets repo (the checkout), tmp (a folder removed on exit) and puts BASE's
# tree in $tmp/base. each_side CMD... then runs CMD in $tmp/base and in the
# working tree, in that order, with side set to base and then head, so that
# one build command makes both sides' binaries; compare_header prints which
# commits they are.
repo=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/base"
git -C "$repo" archive "$1" | tar -x -C "$tmp/base"

each_side() {
	for side in base head; do
		src=$repo
		[ "$side" = base ] && src=$tmp/base
		(cd "$src" && "$@") || exit 1
	done
}

compare_header() {
	echo "base: $1 ($(git -C "$repo" rev-parse --short "$1")); head: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo ' plus uncommitted changes')"
}
