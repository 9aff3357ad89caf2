"""NVIDIA kvpress on the exact samples of a kvcomp grid run, in kvpress's own virtual environment.

    .venv-peers/bin/python experiments/peers/kvpress_run.py --samples runs/peers/samples.jsonl \
        --presses none tova:0.75 knorm:0.75 --out runs/peers
    (two processes: the same command with --shard 0/2 and --shard 1/2, then --merge --out runs/peers)

Each sample's context ids are prefilled with ``model.model`` inside the press's context manager (as kvpress's
pipeline does), then the question ids and a greedy generation of ``max_new_tokens`` without it (query-agnostic;
query-aware: the press sees the question too), with the positions kvpress's pipeline gives. Records and summaries
go in the layout ``kvcomp report`` reads (:mod:`experiments.peers.records`), one directory per press and ratio,
written after every sample (a rerun resumes),
labelled ``kvpress-<press>-<ratio>``; fidelity is to kvpress's own uncompressed output of the same sample, and
``kvcomp_reference_match`` says whether that equals kvcomp's uncompressed output. Seconds are per sample,
prefill (context and question) and decode; memory is the cache's tensors at the end of generation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # eval.ruler (standard library only) and experiments.peers.records

from eval.ruler import score as ruler_score  # noqa: E402
from experiments.peers import records as peer_records  # noqa: E402


def make_press(name: str, ratio: float):
    import kvpress

    ea = kvpress.ExpectedAttentionPress
    presses = {
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
        "keydiff": lambda: kvpress.KeyDiffPress(compression_ratio=ratio),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
        "expected_attention": lambda: ea(compression_ratio=ratio),
        "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio),
        "kvzip_layer": lambda: kvpress.KVzipPress(compression_ratio=ratio, layerwise=True),
        "adakv": lambda: kvpress.AdaKVPress(ea(compression_ratio=ratio)),
        "criticalkv": lambda: kvpress.CriticalKVPress(ea(compression_ratio=ratio, use_vnorm=False)),
        "criticaladakv": lambda: kvpress.CriticalAdaKVPress(ea(compression_ratio=ratio, use_vnorm=False)),
        "pyramidkv": lambda: kvpress.PyramidKVPress(compression_ratio=ratio),
    }
    if name not in presses:
        raise SystemExit(f"unknown press {name!r}; known: none, {', '.join(presses)}")
    return presses[name]()


def cache_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def run_sample(model, tokenizer, sample: dict, press):
    import contextlib

    import torch
    from transformers import DynamicCache

    device = model.device
    context = torch.tensor([sample["context_ids"]], device=device)
    question = torch.tensor([sample["question_ids"]], device=device)
    aware = sample["mode"] == "query_aware"
    if aware:
        context, question = torch.cat([context, question], dim=1)[:, :-1], torch.cat([context, question], dim=1)[:, -1:]
    cache = DynamicCache()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    with torch.inference_mode():
        t0 = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        n_context = context.shape[1]
        positions = torch.arange(n_context, n_context + question.shape[1], device=device).view(1, -1)
        out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = [int(out.logits[0, -1].argmax())]
        position = positions[:, -1:] + 1
        for _ in range(sample["max_new_tokens"] - 1):
            if ids[-1] in stops:
                break
            out = model(input_ids=torch.tensor([[ids[-1]]], device=device), past_key_values=cache, position_ids=position)
            position = position + 1
            ids.append(int(out.logits[0, -1].argmax()))
        decode = time.perf_counter() - t0
    ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
    layer_bytes = 2 * model.config.num_key_value_heads * getattr(model.config, "head_dim", None) * model.dtype.itemsize
    seen = n_context + question.shape[1] + len(ids)
    full = seen * layer_bytes * model.config.num_hidden_layers
    resident = cache_bytes(cache)
    return ids, prefill, decode, resident, full


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", help="from python -m experiments.peers.export (kvcomp's venv; not with --merge)")
    parser.add_argument("--model", default=str(Path.home() / ".cache/kvcomp/smollm2-135m-instruct-v1-float32"),
                        help="a local model directory (default: kvcomp's cached float32 SmolLM2-135M-Instruct)")
    parser.add_argument("--presses", nargs="+", default=["none", "tova:0.75"], metavar="PRESS[:RATIO]")
    parser.add_argument("--out", default="runs/peers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shard", metavar="I/N", help="run only every N-th sample from the I-th (0-based), into "
                        "OUT/shards/I-of-N; run each shard in its own process, then --merge")
    parser.add_argument("--merge", action="store_true", help="merge OUT/shards/* into OUT (no model is loaded)")
    args = parser.parse_args(argv)
    if args.merge:
        print(f"{peer_records.merge_shards(Path(args.out))} runs merged into {args.out}")
        return 0
    if not args.samples:
        parser.error("--samples is required (a file from python -m experiments.peers.export), except with --merge")
    index, count = 0, 1
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        if not 0 <= index < count:
            raise SystemExit(f"--shard {args.shard}: I must be in 0..N-1")
        args.out = str(peer_records.shard_dir(Path(args.out), index, count))

    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines() if line.strip()]
    repeated = sorted(key[0] for key, n in Counter((s["id"], s["mode"]) for s in samples).items() if n > 1)
    if repeated:  # the shards would both run it, and their merge refuses it
        raise SystemExit(f"{args.samples}: {len(repeated)} samples appear twice (first: {repeated[0]}); export the "
                         "grid again with this version of experiments.peers.export")
    samples = samples[index::count]
    references: dict[tuple, list[int]] = {}
    specs = ["none", *[p for p in args.presses if p != "none"]]
    for spec in specs:
        name, _, ratio = spec.partition(":")
        ratio = float(ratio or 0.0)
        label = "kvpress-none" if name == "none" else f"kvpress-{name}-{ratio:g}"
        for sample in samples:
            directory = peer_records.run_dir(Path(args.out), sample["task"], sample["length"], sample["mode"], label)
            done = peer_records.read_run(directory)[0] if (directory / "results.jsonl").is_file() else []
            previous = next((r for r in done if r["id"] == sample["id"]), None)
            key = (sample["id"], sample["mode"])
            if previous is not None:  # resume: a rerun skips what is there
                if name == "none":
                    references[key] = previous["token_ids"]
                continue
            press = None if name == "none" else make_press(name, ratio)
            ids, prefill, decode, resident, full = run_sample(model, tokenizer, sample, press)
            if name == "none":
                references[key] = ids
            text = tokenizer.decode(ids, skip_special_tokens=True)
            task = sample["task"].split("/", 1)[1]
            record = {
                "id": sample["id"], "task": sample["task"], "length": sample["length"], "prediction": text,
                "references": sample["references"], "score": ruler_score(task, text, sample["references"]),
                "token_ids": ids, "context_length": len(sample["context_ids"]) + len(sample["question_ids"]),
                "prefill_seconds": prefill, "decode_seconds": decode, "resident_bytes": {"device": resident},
                "full_bytes": full, "memory_factor": full / resident if resident else float("inf"),
                "mode": sample["mode"], "query_aware": sample["mode"] == "query_aware",
                "compressor": {"name": f"kvpress:{name}", "params": {"compression_ratio": ratio}},
                "model": f"{Path(args.model).name} (kvpress {getattr(kvpress, '__version__', '0.5.5')})",
                "dtype": "float32", **peer_records.fidelity(ids, references[key]),
                "kvcomp_reference_match": ids == sample["kvcomp_reference_ids"] if name == "none" else None,
            }
            peer_records.write_run(directory, [*done, record])  # after every sample: an interrupted run resumes
            print(f"{spec:24s} {sample['id']:40s} score {record['score']:5.1f} exact {record['exact_match']} "
                  f"mf {record['memory_factor']:.2f} {prefill + decode:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
