#!/bin/bash
# usage: grid.sh OUT (from the repository root): the kvcomp side of the matched-load timing (1 thread)
OMP_NUM_THREADS=1 .venv/bin/kvcomp grid --model embedded --lengths 4096 --samples 2 \
  --tasks niah_single_1 niah_single_2 niah_multikey_1 niah_multivalue fwe --modes agnostic \
  --compressors snapkv tova --ratios 0.75 --threads-per-worker 1 --out "$1"
