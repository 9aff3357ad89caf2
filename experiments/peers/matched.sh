#!/bin/bash
# Matched-load timing: kvpress (one thread) beside kvcomp grid repetitions (one thread each) until kvpress ends,
# so that each tool always has one single-thread neighbour.
#   bash experiments/peers/matched.sh RUNS GRID_SCRIPT PRESS...
# RUNS holds samples.jsonl (python -m experiments.peers.export); kvpress writes RUNS/kvpress, repetition i of
# GRID_SCRIPT (called with its output directory) RUNS/kvcomp-rep<i> from i = 2 (rep1: the run the samples
# came from); the last repetition is cut when kvpress ends. Exit codes go to RUNS/matched.log.
set -u
[ $# -ge 3 ] || { echo "usage: $0 RUNS GRID_SCRIPT PRESS..." >&2; exit 2; }
runs=$1 grid=$2
shift 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"; mkdir -p "$runs"
OMP_NUM_THREADS=1 .venv-peers/bin/python experiments/peers/kvpress_run.py --samples "$runs/samples.jsonl" \
  --threads 1 --out "$runs/kvpress" --presses "$@" > "$runs/kvpress.log" 2>&1 &
peer=$!
i=2
while kill -0 $peer 2>/dev/null; do
  "$grid" "$runs/kvcomp-rep$i" > "$runs/rep$i.log" 2>&1 &
  g=$!
  while kill -0 $g 2>/dev/null; do
    if ! kill -0 $peer 2>/dev/null; then kill -- $g 2>/dev/null; pkill -f "kvcomp-rep$i" ; break; fi
    sleep 5
  done
  wait $g; echo "rep$i rc $?" >> "$runs/matched.log"
  i=$((i+1))
done
wait $peer; echo "kvpress rc $?" >> "$runs/matched.log"
