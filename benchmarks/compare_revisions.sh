#!/usr/bin/env bash
# Before/after on one machine in one session: an earlier revision's purepp/ against this
# tree's, both driven by this tree's benchmarks, run alternately (machines drift, so a
# before/after from two sessions says little).
#
#   bash benchmarks/compare_revisions.sh BASE_REV [cpu|cuda] [ROUNDS]
#
# BASE_REV is any git revision (its purepp/ is taken with `git archive`); ROUNDS (default
# 2) is how many before/after pairs to run. Each run is relay_host_cost over n=64, spec 0
# and 3, every wire and both roles, then dp_agreement --no-collective once per side.
# On the device machine, where the tree is a copy without history, pass a folder that
# holds a purepp/ package instead of a revision.
set -euo pipefail
base="${1:?pass the base revision (or a folder holding its purepp/)}"
device="${2:-cpu}"
rounds="${3:-2}"
root="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/before" "$work/after"
if [[ -d "$base/purepp" ]]; then
    cp -r "$base/purepp" "$work/before/"
else
    git archive "$base" purepp | tar -x -C "$work/before"
fi
ln -s "$root/purepp" "$work/after/purepp"

# Run from a folder holding only the purepp/ to test, so it shadows the tree's own.
run() {
    local side="$1"
    shift
    (cd "$work/$side" && PYTHONPATH="${PYTHONPATH:-}:$root" "$@")
}
for round in $(seq "$rounds"); do
    for side in before after; do
        echo "== $side ($round)"
        run "$side" python3 -m benchmarks.relay_host_cost --device "$device" --steps 300 \
            --rounds 3 --warmup 42 --rows 64 --spec 0 3 --wire seed packed fixed \
            --sync-steps 0 | grep -A16 "host us/step"
    done
done
for side in before after; do
    echo "== dp $side"
    run "$side" python3 -m benchmarks.dp_agreement --rounds 7 --iters 1000 --no-collective | tail -13
done
