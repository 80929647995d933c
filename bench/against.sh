#!/usr/bin/env bash
# A benchmark of this tree side by side with another revision, on the same machine, in turns:
#
#   bash bench/against.sh REV ROUNDS bench/learner.py --repeats 3 --threads 1
#
# checks REV out into a temporary worktree, then runs the benchmark ROUNDS times on each tree,
# alternating (REV, this, REV, this, ...) so both see the same background load, and prints
# every run's output under a heading. Each tree's code is imported from that tree (PYTHONPATH),
# with this tree's virtualenv; the benchmark script is each tree's own version of it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: bash bench/against.sh REV ROUNDS BENCH_SCRIPT [ARGS...]" >&2
  exit 2
fi
rev=$1 rounds=$2 script=$3
shift 3
here=$(pwd)
other=$(mktemp -d)/tree
git worktree add -q --detach "$other" "$rev"
trap 'git -C "$here" worktree remove --force "$other"' EXIT
label_here="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +changes)"
label_other=$(git -C "$other" rev-parse --short HEAD)
for round in $(seq 1 "$rounds"); do
  for side in other here; do
    if [ "$side" = other ]; then tree=$other label=$label_other; else tree=$here label=$label_here; fi
    echo "=== round $round: $label ($tree)"
    (cd "$tree" && PYTHONPATH="$tree" "$here/.venv/bin/python" "$script" "$@")
  done
done
