"""cProfile of one compressor's decode steps while every registered compressor's cache is resident and
stepped in turn, as in ``kvcomp bench``: ``PYTHONPATH=. python
experiments/results/bench-all-embedded-1k-8k/profile_env.py adakv 4096 --threads 2`` (prints each
compressor's median step and the profiled one's top functions by own time)."""

import argparse
import cProfile
import pstats

import torch

from experiments import bench
from kvcomp import load_model

parser = argparse.ArgumentParser()
parser.add_argument("target", help="label prefix of the compressor to profile, e.g. adakv")
parser.add_argument("length", type=int)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--skip", nargs="*", default=[], help="label prefixes to leave out of the environment")
parser.add_argument("--steps", type=int, default=8, help="profiled decode steps each, after 2 warm-up steps")
args = parser.parse_args()
torch.set_num_threads(args.threads)
model, _ = load_model("embedded", dtype="float32", device="cpu")
config = bench.BenchConfig()
ids = bench.synthetic_prompt(args.length, model.config.vocab_size, 0)
runs = []
for spec in bench.default_specs():  # both baselines, then every registered compressor
    label, compressor = bench.build_compressor(spec, config)
    if any(label.startswith(prefix) for prefix in args.skip):
        continue
    runs.append((label, compressor, bench.prefill(model, ids, compressor, "cpu")))
for _ in range(2):  # warm-up steps, neither profiled nor timed
    for _, compressor, run in runs:
        bench.decode_step(model, run, compressor, "cpu")
profile = cProfile.Profile()
for _ in range(args.steps):
    for label, compressor, run in runs:
        profiled = label.startswith(args.target)
        if profiled:
            profile.enable()
        bench.decode_step(model, run, compressor, "cpu")
        if profiled:
            profile.disable()
for label, _, run in runs:
    run["step_s"] = run["step_s"][2:]
    print(f"{label[:40]:40s} median {bench.summarize(run)['decode_ms_per_token']:.1f} ms")
print(f"intra-op threads at the end: {torch.get_num_threads()}")
pstats.Stats(profile).sort_stats("tottime").print_stats(12)
