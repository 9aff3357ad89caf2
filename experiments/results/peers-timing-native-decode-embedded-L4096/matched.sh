#!/bin/bash
# The matched-load leg: kvpress (one thread) beside kvcomp grid repetitions (one thread) until kvpress ends.
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../peers/matched.sh" runs/timing3 "$here/grid.sh" none tova:0.75 snapkv:0.75
