#!/bin/bash
# Interleaved A/B of `kvcomp bench`: this checkout against another one (a git worktree of the base commit).
#   bash experiments/ab_bench.sh BASE_TREE OUT_DIR [ROUNDS] -- <kvcomp bench arguments>
# Runs ROUNDS (default 2) rounds in the order new, base; each run writes OUT_DIR/<side>-<round>/bench.json and
# OUT_DIR/<side>-<round>.log. The base side imports kvcomp and compressors from BASE_TREE (PYTHONPATH).
set -euo pipefail
base=$1 out=$2 rounds=2
shift 2
if [ "${1:-}" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] || { echo "usage: $0 BASE_TREE OUT_DIR [ROUNDS] -- <kvcomp bench arguments>" >&2; exit 2; }
shift
[ -d "$base/kvcomp" ] || { echo "$base is not a kvcomp checkout (git worktree add $base <rev>)" >&2; exit 2; }
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in new base; do
    if [ "$side" = base ]; then export PYTHONPATH=$base; else unset PYTHONPATH; fi
    kvcomp bench "$@" --out "$out/$side-$round" > "$out/$side-$round.log" 2>&1
    echo "== $side $round $(date +%T)"
  done
done
