#!/bin/bash
# Prefill A/B of CriticalKV's blocked projected value norms (47bdb51) against f7ccae9, 2 threads, interleaved.
source /work/main/.venv/bin/activate
cd /work/main
mkdir -p runs/ab-criticalkv
C="none snapkv criticalkv"
for round in 1 2; do
  for side in new base; do
    if [ $side = base ]; then export PYTHONPATH=/tmp/base; else unset PYTHONPATH; fi
    kvcomp bench --contexts 2048 8192 --compressors $C --decode-steps 4 --threads 2 --no-memory \
      --out runs/ab-criticalkv/$side-$round > runs/ab-criticalkv/$side-$round.log 2>&1
    echo "== $side $round $(date +%T)"
  done
done
