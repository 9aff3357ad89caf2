"""Export the exact samples of a ``kvcomp grid`` run for a peer: ``python -m experiments.peers.export GRID --out F``.

For each task, length and mode directory of the grid, the samples are generated again (same task, length, seed
and count, read from the grid's records), checked against the grid's own (the prompt hash in its uncompressed
``reference.jsonl``), and written as JSON lines with the token ids kvcomp used (``context_ids``, then
``question_ids``: the peer feeds the same tokens, not its own chat template), the references, the metric,
``max_new_tokens`` and kvcomp's uncompressed output ids (so the peer can check its uncompressed run is the same).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def grid_sample_sets(grid: Path) -> list[tuple[str, int, str, Path]]:
    """``(task, length, mode, directory)`` of every task/length/mode directory of a grid run (holding a
    ``reference.jsonl``), the merged grid's only: a sharded grid's shards hold the same samples again."""
    from experiments.shard import inside_shard

    grid = Path(grid)
    refs = sorted(grid.rglob("reference.jsonl"))
    merged = [ref.parent for ref in refs if not inside_shard(ref.parent, grid)]
    if refs and not merged:
        raise ValueError(f"{grid} holds only the shards of a grid: merge them first (kvcomp grid merge {grid}).")
    return [(d.parent.parent.name.replace("_", "/", 1), int(d.parent.name.removeprefix("L")), d.name, d)
            for d in merged]


def export(grid: Path, out: Path, model: str | None = None) -> int:
    import kvcomp
    from eval.runner import _prompt_hash, load_records, load_samples
    from kvcomp.generation import split_prompt

    _, tokenizer = kvcomp.load_model(model, tokenizer_only=True)
    rows = []
    for task, length, mode, directory in grid_sample_sets(grid):
        references = {r["id"]: r for r in load_records(directory / "reference.jsonl")}
        records = [r for d in directory.iterdir() if (d / "results.jsonl").is_file()
                   for r in load_records(d / "results.jsonl")]
        seeds = {r["metadata"]["seed"] for r in records}
        count = max(r["metadata"]["index"] for r in records) + 1
        for seed in sorted(seeds):
            for s in load_samples(task, tokenizer, length=length, num_samples=count, seed=seed).samples:
                ref = references.get(s.id)
                if ref is None:
                    continue
                if json.loads(ref["key"])[1] != _prompt_hash(s):
                    raise ValueError(f"{s.id}: the regenerated sample differs from the grid's (prompt hash).")
                parts = split_prompt(tokenizer, s.context, s.question, s.answer_prefix, s.chat_template)
                rows.append({"id": s.id, "task": task, "length": length, "mode": "query_" + mode,
                             "context_ids": parts.context_ids, "question_ids": parts.question_ids,
                             "references": s.references, "max_new_tokens": s.max_new_tokens,
                             "kvcomp_reference_ids": ref["token_ids"]})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", help="the output directory of a kvcomp grid run")
    parser.add_argument("--out", required=True, help="samples file (JSON lines) for experiments/peers/kvpress_run.py")
    parser.add_argument("--model", default=None, help="the grid's model (default: the embedded SmolLM2)")
    args = parser.parse_args(argv)
    n = export(Path(args.grid), Path(args.out), args.model)
    print(f"{n} samples -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
