"""Each compressor's prefill hook against DynamicCache's prefill: ``PYTHONPATH=. python
experiments/results/bench-prefill-hooks-embedded/hooks.py CONTEXT [ROUNDS] [COMPRESSOR ...]`` (default: 5 rounds,
every registered compressor and kvcomp's uncompressed path; 2 threads;
:func:`experiments.step_sections.prefill_hooks`)."""

import json
import sys

from experiments.bench import default_specs
from experiments.step_sections import prefill_hooks

length = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
names = sys.argv[3:] or default_specs()
print(json.dumps({"context": length, "rounds": rounds, "hooks": prefill_hooks(names, length, rounds)}))
