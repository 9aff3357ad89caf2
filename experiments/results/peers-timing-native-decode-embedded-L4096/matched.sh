#!/bin/bash
# The matched-load leg: kvpress (one thread) beside kvcomp grid repetitions (one thread) until kvpress ends.
set -u
here=$(cd "$(dirname "$0")" && pwd); cd "$(git -C "$here" rev-parse --show-toplevel)"; mkdir -p runs/timing3
OMP_NUM_THREADS=1 .venv-peers/bin/python experiments/peers/kvpress_run.py --samples runs/timing3/samples.jsonl \
  --threads 1 --out runs/timing3/kvpress --presses none tova:0.75 snapkv:0.75 > runs/timing3/kvpress.log 2>&1 &
peer=$!
i=2
while kill -0 $peer 2>/dev/null; do
  "$here/grid.sh" runs/timing3/kvcomp-rep$i > runs/timing3/rep$i.log 2>&1 &
  g=$!
  while kill -0 $g 2>/dev/null; do
    if ! kill -0 $peer 2>/dev/null; then kill -- $g 2>/dev/null; pkill -f "kvcomp-rep$i" ; break; fi
    sleep 5
  done
  wait $g; echo "rep$i rc $?" >> runs/timing3/matched.log
  i=$((i+1))
done
wait $peer; echo "kvpress rc $?" >> runs/timing3/matched.log
