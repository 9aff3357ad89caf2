#!/bin/bash
# The matched-load leg: kvpress (one thread) beside kvcomp grid repetitions (one thread) until kvpress ends.
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../peers/matched.sh" runs/timing2 "$here/grid.sh" \
  none streaming_llm:0.75 tova:0.75 snapkv:0.75 kvzip_layer:0.75
