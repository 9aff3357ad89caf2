"""The ``kvcomp`` command: list, generate, store, demo, grid (and grid merge), run, report, export, calibrate, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

# `kvcomp grid`'s columns when neither --compressors nor --configs names any.
GRID_COMPRESSORS = ("streaming_llm", "h2o", "snapkv")


def _list(args) -> int:
    from kvcomp import available

    for name, cls in available().items():
        fields = ", ".join(
            f"{f.name}={f.default!r}" for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        )
        caps = [k for k, v in dataclasses.asdict(cls.capabilities).items() if v is True]
        caps.append(f"sliding layers: {'compressed' if cls.sliding_layers == 'compress' else 'window kept'}")
        module_doc = sys.modules[cls.__module__].__doc__ or ""
        doc = module_doc.strip().splitlines()[0] if module_doc.strip() else ""
        print(f"{name:16s} {cls.__module__}.{cls.__name__}  [{', '.join(caps)}]\n    {doc}\n    {fields}")
    return 0


def _parse_param(text: str) -> tuple[str, object]:
    """``key=value`` with the value read as a Python literal when it is one (``bits=4``, ``window=None``)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"kvcomp: --param takes key=value, got {text!r}.")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _read_text(path: str, option: str) -> str:
    """The UTF-8 text of a file the user named with ``option``; a clear error for what it cannot be."""
    from kvcomp.validation import UsageError

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file.") from None
    except IsADirectoryError:
        raise UsageError(f"{option} {path} is a directory; give a text file.") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{option} {path} is not UTF-8 text ({err.reason} at byte {err.start}); convert it first, "
                         f"e.g. iconv -f latin1 -t utf-8 {path} > converted.txt") from None
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot read it ({err.strerror}).") from None


def _load(args):
    from kvcomp import load_model

    return load_model(args.model, dtype=args.dtype)


def _generate(args) -> int:
    from kvcomp import generate

    context = _read_text(args.context_file, "--context-file") if args.context_file else (args.context or "")
    if not context and not args.context_key:
        raise SystemExit("kvcomp generate: give the context with --context-file FILE, --context TEXT or "
                         "--context-key KEY (a stored context, see kvcomp store put).")
    params = dict(_parse_param(p) for p in args.param)
    if args.compression_ratio is not None:
        params["compression_ratio"] = args.compression_ratio
    if args.budget is not None:
        params["budget"] = args.budget
    from kvcomp.generation import resolve_compressor

    compressor = None if args.compressor == "none" else resolve_compressor(args.compressor, **params)
    model, tokenizer = _load(args)  # after the compressor: a bad name fails before the model loads
    lossless = {"lossless": True, "gamma": args.gamma} if args.lossless else {}
    if args.context_key:  # a stored context (kvcomp store put): no prefill of the context here
        from kvcomp import Lossless, load_context

        context = load_context(model, args.context_key, args.store)
        compressor = None
        if args.lossless:
            tier = {"tier": "store", "tier_options": {"store": args.store}} if context.has_full_kv else {}
            lossless = {"lossless": Lossless(gamma=args.gamma, **tier)}
    result = generate(model, tokenizer, context, args.question, compressor=compressor,
                      max_new_tokens=args.max_new_tokens, query_aware=args.query_aware, **lossless)
    print(result.text)
    stats = {
        "compressor": result.compressor, "query_aware": result.query_aware, "prompt_tokens": result.prompt_tokens[0],
        "memory_factor": round(result.memory_factor, 3), "resident_bytes": result.resident_bytes,
        "prefill_seconds": round(result.prefill_seconds, 3), "decode_seconds": round(result.decode_seconds, 3),
        "kept_tokens_mean": round(sum(result.kept_tokens_per_layer) / len(result.kept_tokens_per_layer), 1),
        "dtype": result.dtype,
    }
    if result.lossless is not None:
        stats["lossless"] = {k: result.lossless[k] for k in ("rounds", "mean_accepted", "accepted_hist")}
    print(json.dumps(stats), file=sys.stderr)
    return 0


def _store(args) -> int:
    from kvcomp.store import open_store

    store = open_store(args.store)
    if args.action == "ls":
        for m in store.entries(args.prefix or ""):
            meta = m.meta
            spec = meta.get("compressor")
            name = "-" if not meta.get("format") else ("none" if spec is None else spec["name"])
            model = (meta.get("model") or {}).get("name", "-")
            tokens = meta.get("prompt_tokens", "-")
            print(f"{m.key}\t{m.nbytes:,} bytes\t{name}\ttokens={tokens}\tmodel={model}\t"
                  f"full_kv={'yes' if meta.get('full_kv_bytes') else 'no'}")
        return 0
    if args.action == "rm":
        keys = list(args.keys) + (store.list(args.prefix) if args.prefix else [])
        if not keys:
            raise SystemExit("kvcomp store rm: name the keys to remove, or --prefix P.")
        for key in keys:
            print(f"{'removed' if store.delete(key) else 'no such key'}\t{key}")
        return 0
    # put
    from kvcomp import save_context
    from kvcomp.generation import resolve_compressor

    context = _read_text(args.context_file, "--context-file") if args.context_file else (args.context or "")
    if not context:
        raise SystemExit("kvcomp store put: give the context with --context-file FILE or --context TEXT.")
    params = dict(_parse_param(p) for p in args.param)
    if args.compression_ratio is not None:
        params["compression_ratio"] = args.compression_ratio
    compressor = resolve_compressor(args.compressor, **params)
    model, tokenizer = _load(args)
    saved = save_context(model, tokenizer, context, compressor=compressor, store=store, key=args.key,
                         full_kv=args.full_kv)
    print(saved.key)
    print(json.dumps({"store": saved.store, "state_bytes": saved.state_bytes, "full_kv_bytes": saved.full_kv_bytes,
                      "prompt_tokens": saved.prompt_tokens, "prefill_seconds": round(saved.prefill_seconds, 3),
                      "write_seconds": round(saved.write_seconds, 3)}), file=sys.stderr)
    return 0


def _demo(args) -> int:
    from experiments.demo import print_table, run_demo

    model, tokenizer = _load(args)
    modes = ("agnostic", "aware") if args.mode == "both" else (args.mode,)
    rows = run_demo(model, tokenizer, samples=args.samples, length=args.length, ratios=tuple(args.ratios),
                    compressors=tuple(args.compressors), modes=modes, out_dir=args.out,
                    max_new_tokens=args.max_new_tokens)
    print_table(rows, f"Needle in a haystack (RULER niah_single_1, ~{args.length} tokens, {args.samples} samples, "
                      f"{model.config.name_or_path or 'model'}, {args.dtype})")
    print(f"Per-sample records and summary-L{args.length}.csv are in {args.out}/ (rerun to resume).")
    return 0


def _grid(args) -> int:
    from experiments.bench import parse_spec
    from experiments.grid import OFFLINE_RULER, check_modes, run_table
    from kvcomp.registry import get

    if args.compressors is None:  # the default columns, unless the configurations are listed one by one
        args.compressors = [] if args.configs else list(GRID_COMPRESSORS)
    for name in [*args.compressors, *(parse_spec(s)[0] for s in args.configs)]:
        get(name)  # an unknown name fails before the model loads
    check_modes(args.modes)
    params = dict(_parse_param(p) for p in args.param)
    if args.launcher or args.shard:
        return _sharded_grid(args, params)
    if args.threads_per_worker:
        import torch

        torch.set_num_threads(args.threads_per_worker)
    from experiments.shard import Shard, pick_device
    from kvcomp import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=pick_device(args.device, Shard(0, 1)))
    files = run_table(model, tokenizer, tasks=args.tasks or OFFLINE_RULER, lengths=args.lengths,
                      samples=args.samples, compressors=args.compressors, ratios=args.ratios, modes=args.modes,
                      out_dir=args.out, params=params, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      configs=tuple(args.configs), store=args.store)
    _print_grid(files)
    return 0


def _print_grid(files: dict) -> None:
    print(files["scores_md"].read_text())
    for kind, path in files.items():
        print(f"{kind:20s} {path}")


def _sharded_grid(args, params: dict) -> int:
    from experiments.grid import OFFLINE_RULER
    from experiments.launchers import LaunchOptions, ShardsFailed, launch
    from experiments.merge import ShardMergeError, merge_shards
    from experiments.shard import GridMismatch, GridSpec, Shard, run_shard

    spec = GridSpec(tasks=args.tasks or OFFLINE_RULER, lengths=args.lengths, samples=args.samples,
                    compressors=args.compressors, ratios=args.ratios, modes=args.modes, params=params,
                    configs=tuple(args.configs), store=args.store, assign=args.assign,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, model=args.model, dtype=args.dtype)
    threads = args.threads_per_worker or 1
    try:
        if args.shard:
            if args.launcher:
                raise ValueError("--shard runs one shard in this process; it does not go with --launcher.")
            shard = Shard.parse(args.shard)
            status = run_shard(args.out, spec, shard, device=args.device, threads=threads, progress=True)
            print(f"shard {shard.index}/{shard.count} complete in {status['wall_seconds']:.1f} s. When every shard "
                  f"is, run: kvcomp grid merge {args.out}")
            return 0
        launch(args.out, spec, LaunchOptions(
            launcher=args.launcher, workers=args.workers, threads=threads, device=args.device,
            gpus_per_worker=args.gpus_per_worker, ray_address=args.ray_address,
            submitit_cluster=args.submitit_cluster,
            submitit_params=dict(_parse_param(p) for p in args.submitit_param)))
        merged = merge_shards(args.out)
    except (GridMismatch, ShardsFailed, ShardMergeError, ValueError) as err:
        print(f"kvcomp grid: {err}", file=sys.stderr)
        return 2
    print(f"merged {merged['records']} records of {args.workers} shards into {len(merged['runs'])} runs")
    _print_grid(merged["files"])
    return 0


def _grid_merge(args) -> int:
    from experiments.merge import ShardMergeError, merge_shards
    from experiments.shard import GridMismatch

    try:
        merged = merge_shards(args.dir)
    except (FileNotFoundError, GridMismatch, ShardMergeError) as err:
        print(f"kvcomp grid merge: {err}", file=sys.stderr)
        return 2
    print(f"merged {merged['records']} records into {len(merged['runs'])} runs under {args.dir}")
    _print_grid(merged["files"])
    return 0


def _grid_diff(args) -> int:
    from experiments.merge import compare_grids

    result = compare_grids(*args.dirs)
    print(f"{result['identical']} of {result['records']} records identical (timing fields aside) in "
          f"{result['files']} files")
    for rel in result["differ"]:
        print(f"differs: {rel}")
    return 0 if not result["differ"] else 1


def _run(args) -> int:
    # Hydra parses its own command line: hand it the overrides as if experiments.run had been started.
    from experiments import run

    sys.argv = ["kvcomp run", *args.overrides]
    run.main()
    return 0


def _report(args) -> int:
    from experiments.report import make_report

    try:
        files = make_report(args.dirs, args.out)
    except FileNotFoundError as err:
        print(f"kvcomp report: {err}", file=sys.stderr)
        return 2
    for kind, path in files.items():
        print(f"{kind:20s} {path}")
    return 0


def _export(args) -> int:
    from experiments.kvpress_format import KvpressFormatError, export_kvpress

    try:
        written = export_kvpress(args.dirs, args.out)
    except (FileNotFoundError, KvpressFormatError) as err:
        print(f"kvcomp export: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"{len(written)} kvpress evaluation directories under {args.out}")
    return 0


def _calibrate(args) -> int:
    import time

    if args.method == "heads":
        from kvcomp import head_calibration

        model, tokenizer = _load(args)
        out = args.out or head_calibration.default_artifact_path(model)
        t0 = time.perf_counter()
        path = head_calibration.calibrate(model, tokenizer, out, samples=args.samples, length=args.seq_len or 1024)
        pattern = head_calibration.load_artifact(path)
        print(f"{path}\n  {pattern.meta['samples']} synthetic passkey prompts of {pattern.meta['length']} tokens, "
              f"{pattern.meta['num_layers']} layers x {pattern.meta['num_kv_heads']} KV heads, "
              f"{time.perf_counter() - t0:.1f} s")
        return 0
    from kvcomp import kvtc_calibration as calibration

    text = _read_text(args.data, "--data") if args.data else None
    model, tokenizer = _load(args)
    out = args.out or calibration.default_artifact_path(model, args.keys)
    t0 = time.perf_counter()
    path = calibration.calibrate(model, tokenizer, out, text=text, tokens=args.tokens, seq_len=args.seq_len,
                                 source=args.data or "stdlib docstrings", keys=args.keys)
    meta = calibration.load_artifact(path).meta
    print(f"{path}\n  {meta['tokens']} calibration tokens of {meta['data']} ({meta['seq_len']} per sequence), "
          f"{meta['keys']} keys, {meta['num_layers']} layers x {meta['num_kv_heads']} KV heads x "
          f"{meta['head_dim']}, {time.perf_counter() - t0:.1f} s")
    return 0


def _bench(args) -> int:
    from experiments.bench import BenchConfig, print_table, run_bench

    config = BenchConfig(contexts=args.contexts, compressors=args.compressors, compression_ratio=args.ratio,
                         quant_bits=args.bits, decode_steps=args.decode_steps,
                         prefill_rounds=args.prefill_rounds, model=args.model, dtype=args.dtype,
                         device=args.device, threads=args.threads, seed=args.seed, out=args.out,
                         memory=args.memory, native_linear=args.native_linear)
    rows = run_bench(config)
    print_table(rows, f"kvcomp bench ({args.model or 'embedded SmolLM2-135M-Instruct'}, {args.dtype}, "
                      f"{args.decode_steps} decode steps)")
    print(f"bench.csv, bench.json and bench.png are in {args.out}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcomp", description="KV-cache compression for Hugging Face LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p):
        p.add_argument("--model", default=None,
                       help="HF id or path, 'tiny' or 'embedded'; default: the embedded SmolLM2-135M-Instruct")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    p = sub.add_parser("list", help="registered compressors and their parameters")
    p.set_defaults(func=_list)

    p = sub.add_parser("generate", help="answer a question about a context with a compressed cache")
    model_args(p)
    p.add_argument("--compressor", default="snapkv")
    p.add_argument("--compression-ratio", type=float, default=None, help="fraction of tokens removed")
    p.add_argument("--budget", type=int, default=None, help="tokens kept per KV head")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other hyper-parameter, e.g. --param bits=2 (repeatable)")
    p.add_argument("--context-file")
    p.add_argument("--context")
    p.add_argument("--question", default="")
    p.add_argument("--query-aware", action="store_true", help="compress with the question in the prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lossless", action="store_true", help="draft with the compressor, verify with the full KV")
    p.add_argument("--gamma", type=int, default=4, help="tokens drafted per round (--lossless)")
    p.add_argument("--context-key", default=None,
                   help="answer from a stored context (kvcomp store put) instead of prefilling one")
    p.add_argument("--store", default=None, help="store URL of --context-key (default: the directory store)")
    p.set_defaults(func=_generate)

    p = sub.add_parser("store", help="saved contexts: put (prefill and store), ls, rm")
    store_sub = p.add_subparsers(dest="action", required=True)
    for action, text in (("put", "prefill a context once and store its compressed cache"),
                         ("ls", "list stored entries"), ("rm", "remove stored entries")):
        q = store_sub.add_parser(action, help=text)
        q.add_argument("--store", default=None,
                       help="redis://host:port/db, file:///path or a directory (default: $KVCOMP_STORE or "
                            "~/.cache/kvcomp/store)")
        q.set_defaults(func=_store)
        if action == "put":
            model_args(q)
            q.add_argument("--context-file")
            q.add_argument("--context")
            q.add_argument("--compressor", default="none")
            q.add_argument("--compression-ratio", type=float, default=None)
            q.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
            q.add_argument("--key", default=None, help="default: a digest of model, tokens and compressor")
            q.add_argument("--full-kv", action="store_true", help="also store the full KV (lossless decoding)")
        elif action == "ls":
            q.add_argument("--prefix", default=None)
        else:
            q.add_argument("keys", nargs="*")
            q.add_argument("--prefix", default=None, help="remove every key starting with this")

    p = sub.add_parser("demo", help="needle-in-a-haystack: no compression vs each compressor at 2x and 4x")
    model_args(p)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    p.add_argument("--compressors", nargs="+", default=["streaming_llm", "h2o", "snapkv"])
    p.add_argument("--mode", choices=["agnostic", "aware", "both"], default="both")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=_demo)

    p = sub.add_parser("grid", help="compressors x ratios x tasks x lengths x modes, one prefill per sample")
    model_args(p)
    p.add_argument("--tasks", nargs="+", default=None,
                   help="RULER task names or runner task names (default: the 11 RULER tasks that need no data)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--compressors", nargs="*", default=None,
                   help="each at every --ratios (default: " + " ".join(GRID_COMPRESSORS) + ", unless --configs is "
                        "given: then only those)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    p.add_argument("--modes", nargs="+", default=["agnostic", "aware"], choices=["agnostic", "aware"])
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyper-parameter given to every compressor (repeatable)")
    p.add_argument("--configs", nargs="*", default=[], metavar="NAME:KEY=VALUE,...",
                   help="more columns, each a compressor with its own parameters (quant:bits=4 kvtc:compression_factor=8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: each task's own cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/grid")
    p.add_argument("--device", default="cpu", help="cpu, cuda (several GPUs: one per worker), cuda:N or auto")
    p.add_argument("--launcher", choices=["local", "joblib", "ray", "submitit"], default=None,
                   help="split the samples over --workers workers on this engine, then merge (default: one process)")
    p.add_argument("--workers", type=int, default=2, help="shards (workers) with --launcher")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads of each worker (default 1), or of the one process without --launcher")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only shard I of N (0-based) in this process, for any scheduler; then `grid merge`")
    p.add_argument("--assign", choices=["round-robin", "queue"], default="round-robin",
                   help="how the shards split the samples: round-robin (shard I takes samples I, I+N, ...: fixed in "
                        "advance) or queue (each worker takes the next sample nobody has taken yet)")
    p.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs requested per worker (ray, submitit)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to connect to ('auto': the one `ray start` runs here); default: a local one")
    p.add_argument("--submitit-cluster", choices=["slurm", "local"], default=None,
                   help="default: Slurm where sbatch exists, else local processes")
    p.add_argument("--submitit-param", action="append", default=[], metavar="KEY=VALUE",
                   help="submitit executor parameter, e.g. slurm_partition=gpu, timeout_min=600 (repeatable)")
    p.add_argument("--store", default=None,
                   help="keep each sample's compressed prefills in this store (redis://host:port/db or a directory) "
                        "and reuse them in later runs")
    p.set_defaults(func=_grid)
    grid_sub = p.add_subparsers(dest="grid_command", required=False, metavar="{merge,diff}")
    m = grid_sub.add_parser("merge", help="merge the shards of a sharded grid into the files one process writes")
    m.add_argument("dir", help="the grid's --out directory (holding shards/)")
    m.set_defaults(func=_grid_merge)
    d = grid_sub.add_parser("diff", help="are two grids' records identical (timings aside)?")
    d.add_argument("dirs", nargs=2, metavar="DIR")
    d.set_defaults(func=_grid_diff)

    # Hydra parses run's arguments itself (main() hands them over before argparse sees them).
    p = sub.add_parser("run", help="one evaluation run, or a sweep with -m (Hydra); see experiments/README")
    p.add_argument("overrides", nargs="*", help="e.g. compressor=snapkv compressor.compression_ratio=0.75")
    p.set_defaults(func=_run)

    p = sub.add_parser("report", help="tables (CSV, Markdown) and plots from run or sweep directories")
    p.add_argument("dirs", nargs="+",
                   help="run directories, sweeps, grids, kvpress evaluation directories, or trees of them")
    p.add_argument("--out", default="reports/latest", help="where report.csv, report.md and the PNGs go")
    p.set_defaults(func=_report)

    p = sub.add_parser("export", help="write runs in kvpress's evaluation layout (kvcomp report reads it back)")
    p.add_argument("dirs", nargs="+", help="run directories, grids, sweeps or trees of them")
    p.add_argument("--format", choices=["kvpress"], default="kvpress")
    p.add_argument("--out", required=True, help="where the <dataset>__<length>__<model>__<press>__<ratio> dirs go")
    p.set_defaults(func=_export)

    p = sub.add_parser("calibrate", help="fit a method's calibration artifact (kvtc: PCA bases and bit tables; "
                                         "heads: DuoAttention's streaming/retrieval head pattern)")
    p.add_argument("method", choices=["kvtc", "heads"])
    model_args(p)
    p.add_argument("--data", default=None, help="a plain-text file; default: Python stdlib docstrings (offline)")
    p.add_argument("--out", default=None, help="artifact path; default: the model's path under $KVCOMP_CACHE/kvtc")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per calibration sequence (heads: per prompt); default: kvtc 1024 for pre-RoPE "
                        "keys, the model's context up to 8192 for post-RoPE keys; heads 1024")
    p.add_argument("--keys", choices=["pre_rope", "post_rope"], default="pre_rope",
                   help="kvtc: fit the key bases without RoPE (better rate-distortion) or with it (a decode "
                        "step projects its query once instead of rebuilding every key)")
    p.add_argument("--samples", type=int, default=8, help="heads: synthetic passkey prompts")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("bench", help="prefill/decode speed, memory and roofline of each compressor vs none")
    model_args(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--compressors", nargs="+", default=[],
                   help="none, none-kvcomp, registered names or name:key=value,...; default: both uncompressed "
                        "baselines and every registered one")
    p.add_argument("--ratio", type=float, default=0.75, help="compression_ratio where a compressor has one")
    p.add_argument("--bits", type=int, default=4, help="bits for quant unless given as quant:bits=N")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prefill-rounds", type=int, default=1,
                   help="prefills per compressor and context in interleaved rounds; the prefill columns are "
                        "medians and the slowdowns paired by round, with the lowest and highest round beside them")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the memory pass (peak RSS, prefill and decode-step rises) after the timed one")
    p.add_argument("--native-linear", action="store_true",
                   help="every row (both baselines too) runs one-token linear layers through kvcomp's native "
                        "CPU kernel (kvcomp.steps.native_linears)")
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvcomp.validation import CLEAR_ERRORS

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # argparse would eat Hydra's own flags (-m, --cfg, --help)
        return _run(argparse.Namespace(overrides=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLEAR_ERRORS as err:  # a setting, input or resource problem whose message says how to fix it
        print(f"kvcomp: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
