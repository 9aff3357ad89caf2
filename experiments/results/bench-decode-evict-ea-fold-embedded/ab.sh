#!/bin/bash
# A/B of this session's decode-time changes (4f16573) against f7ccae9, 2 threads, interleaved rounds.
# decode_evict runs at its new default (interval 10) and at interval 1 (the old default) on both sides.
source /work/main/.venv/bin/activate
cd /work/main
mkdir -p runs/ab-session7
C="none none-kvcomp knorm decode_evict decode_evict:interval=10 decode_evict:interval=1 inertiakv"
for round in 1 2; do
  for side in new base; do
    if [ $side = base ]; then export PYTHONPATH=/tmp/base; else unset PYTHONPATH; fi
    kvcomp bench --contexts 2048 8192 --compressors $C --decode-steps 64 --threads 2 --no-memory \
      --out runs/ab-session7/$side-$round > runs/ab-session7/$side-$round.log 2>&1
    echo "== $side $round $(date +%T)"
  done
done
