#!/bin/bash
# A/B of HEAD against f39626e (the session's start), 2 threads, quiet machine, interleaved rounds
source /work/main/.venv/bin/activate
cd /work/main
C="none none-kvcomp knorm quant kvtc streaming_llm tova duo_attention"
for round in 1 2; do
  for side in new base; do
    if [ $side = base ]; then export PYTHONPATH=/tmp/qk/base; else unset PYTHONPATH; fi
    kvcomp bench --contexts 2048 8192 --compressors $C --decode-steps 16 --threads 2 --no-memory \
      --out runs/ab-session6/$side-$round > runs/ab-session6/$side-$round.log 2>&1
    echo "== $side $round $(date +%T)"
  done
done
