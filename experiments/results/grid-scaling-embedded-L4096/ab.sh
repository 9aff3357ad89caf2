#!/bin/bash
# Interleaved A/B: round-robin and queue Ray legs alternating, against the same single-process leg.
cd "$(dirname "$0")/../../.."  # the repository root
source .venv/bin/activate
for run in 1-round-robin 2-queue 3-round-robin 4-queue; do
  assign=${run#*-}
  out=runs/grid-scaling-ab/$run
  mkdir -p $out
  [ -e $out/single ] || cp -r runs/grid-scaling/single $out/single
  [ -e $out/timing.json ] || python3 -c "
import json; d=json.load(open('runs/grid-scaling/timing.json'))
json.dump({'cores': d['cores'], 'single_from': 'runs/grid-scaling at 59afa37', 'legs': {'single': d['legs']['single']}}, open('$out/timing.json','w'), indent=2)"
  echo "== $run $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  python -m experiments.grid_scaling --lengths 4096 --samples 4 --tasks niah_single_1 niah_single_2 niah_multikey_1 \
     --legs single ray --out $out --assign $assign > $out.log 2>&1 || { echo "FAILED $run"; exit 1; }
done
echo "== done $(date +%T)"
