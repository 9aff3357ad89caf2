"""Speed and memory of each compressor against no compression, and against the memory roofline.

For every context length and compressor: prefill a synthetic prompt once, then decode ``decode_steps`` tokens
greedily (the compressors' steps interleaved, so load changes on a shared machine hit all alike), and record

* prefill tokens/s, decode tokens/s and the median ms per decoded token. One prefill here varies by about
  +-12%, more than the overhead of most methods: ``--prefill-rounds N`` prefills every compressor N times in
  interleaved rounds; ``prefill_s`` is then the median, ``prefill_rounds_s`` every round's time, and each
  ``prefill_slowdown`` the median of the per-round ratios to the baseline's prefill of the same round, with
  the lowest and highest round's ratio in ``prefill_slowdown_low`` / ``_high`` (``..._kvcomp_low`` / ``_high``);
* in a second pass after the timed one (``--no-memory`` skips it), each compressor alone: the rise of the
  process's resident memory during the prefill (sampled: the cache plus prefill transients), the process's
  peak, and the largest rise within a decode step; timings come from glibc's own allocator, peaks from a fixed
  mmap threshold (see :func:`run_bench`);
* resident KV bytes at the end on the fast tier (device or RAM; a retrieval method's offloaded full KV is
  ``kv_slow_tier_bytes``), and the memory factor against ``none`` in the same run;
* the decode roofline: a step must read the weights and the resident KV, so it cannot take less than
  ``(weight bytes + KV bytes) / read bandwidth``, the rate at which a sum over a large tensor reads it on the
  same device with the run's threads (a decode step is such a read stream). ``roofline_fraction`` is that
  bound divided by the measured step time (1.0 = at the memory limit). The copy bandwidth is recorded beside
  it; on the 2-core machine this project runs on it is bimodal between processes (about 22 or 41 GB/s, the
  read rate 46-54 GB/s), which is why it is no longer the denominator.

``--native-linear`` (``BenchConfig.native_linear``) runs every row, both baselines included, with
:func:`kvcomp.steps.native_linears`: a one-token step's linear layers stream their weights through
:func:`kvcomp.kernels.cpu_native.linear` instead of torch's matrix product, the larger part of a step of this
small model on the CPU (SmolLM2-135M, 2 threads: 33.6 against 12.7 ms for its 211 layers). Every row gets the
same model code, so the ratios still measure the caches; the step times fall for all.

Two uncompressed baselines, so that a speed-up is never just a faster uncompressed path: ``none`` is
transformers' own cache (``DynamicCache(config=model.config)``) on sdpa attention, and ``none-kvcomp`` is the
uncompressed cache through kvcomp's own path (a ``CompressedCache`` whose layers keep every token,
:class:`kvcomp.selection.WindowStore`: grouped-query attention without repeated K/V, growable stores, the decode
step compressors run). Ratios are against both at the same context in the same process, because timings on a
shared machine drift between runs: ``decode_speedup`` / ``prefill_slowdown`` against ``none``,
``decode_speedup_kvcomp`` / ``prefill_slowdown_kvcomp`` against ``none-kvcomp``; ``memory_factor`` against
``none``'s bytes (the live cache), ``stored_factor`` the same for what a saved context keeps
(``Compressor.stored_nbytes``: KVTC's entropy-coded blocks; the live bytes for every other method). Every model call goes through :mod:`kvcomp.steps` (``prefill``, ``decode_one``).

``kvcomp bench --contexts 1024 2048 4096 8192 --out runs/bench`` writes bench.csv, bench.json (settings,
machine, bandwidth) and bench.png there and prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcomp import files, metrics, steps
from kvcomp.memory import PeakMemory, fixed_malloc_threshold, trim_heap

DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
KVCOMP_BASELINE = "none-kvcomp"  # the uncompressed cache through kvcomp's own path


@dataclass
class BenchConfig:
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))
    # "none", "none-kvcomp", registered names, or "name:key=value,key=value"; empty = both baselines + every
    # registered compressor.
    compressors: list[str] = field(default_factory=list)
    compression_ratio: float = 0.75  # for compressors with a compression_ratio field, unless given
    quant_bits: int = 4
    decode_steps: int = 32
    # Prefills per compressor and context, in interleaved rounds (run_bench): the prefill columns are medians.
    prefill_rounds: int = 1
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0
    # A second pass, after the timed one, that measures peak memory (fixed malloc threshold: run_bench).
    memory: bool = True
    # Every row's one-token linear layers through the native kernel (kvcomp.steps.native_linears).
    native_linear: bool = False
    out: str = "runs/bench"

    def __post_init__(self) -> None:
        from kvcomp import validation

        validation.positive_int("prefill_rounds", self.prefill_rounds, owner=self, hint=" (prefills per row)",
                                error=ValueError)


# -- what to run ---------------------------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"snapkv:compression_ratio=0.5,window=16"`` -> ``("snapkv", {...})`` (values as Python literals)."""
    import ast

    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bench: compressor parameters are key=value, got {item!r} in {spec!r}.")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    return name, params


BASELINES = ("none", KVCOMP_BASELINE)


def default_specs() -> list[str]:
    from kvcomp import available

    return [*BASELINES, *available()]


def build_compressor(spec: str, config: BenchConfig):
    """(label, compressor or None) for a spec, filling in the default ratio / bits."""
    from kvcomp import available, create

    name, params = parse_spec(spec)
    if name == "none":
        return "none", None
    if name == KVCOMP_BASELINE:
        from kvcomp.selection import WindowStore

        return KVCOMP_BASELINE, WindowStore()
    cls = available().get(name)
    fields = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    if "compression_ratio" in fields and "compression_ratio" not in params and "budget" not in params:
        params["compression_ratio"] = config.compression_ratio
    if name == "quant" and "bits" not in params:
        params["bits"] = config.quant_bits
    compressor = create(name, **params)
    label = name + ("(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")
    return label, compressor


# -- measurements --------------------------------------------------------------------------------------------
def copy_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a large tensor copy moves on ``device`` (best of ``repeats``; each byte is read once
    and written once, so a read-only stream is bounded by about this rate)."""
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def read_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a sum over a large tensor reads on ``device`` (best of ``repeats``): the rate a decode
    step's read streams (weights, KV) can reach."""
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        src.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def synthetic_prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    """Random ordinary token ids (no special tokens: those are at the ends of the vocabulary)."""
    gen = torch.Generator().manual_seed(seed + length)
    return torch.randint(100, max(101, vocab - 1000), (1, length), generator=gen)


def _use_attention(model, compressor) -> None:
    # none is plain transformers sdpa; a CompressedCache needs kvcomp's attention (installed by its constructor).
    want = "sdpa" if compressor is None else "kvcomp"
    if model.config._attn_implementation != want:
        model.set_attn_implementation(want)


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, compressor, device: str, measure: bool = False) -> dict[str, Any]:
    """Prefill the prompt into a new cache; returns the timing, the cache and the next token, and with
    ``measure`` the rise of memory while it ran (sampled by a thread: only in the memory pass)."""
    from transformers import DynamicCache

    from kvcomp import CompressedCache

    cache = DynamicCache(config=model.config) if compressor is None else CompressedCache(model, compressor)
    _use_attention(model, compressor)
    rows = steps.Rows(ids.shape[0], device)
    with PeakMemory(device) if measure else contextlib.nullcontext() as memory:
        _sync(device)
        t0 = time.perf_counter()
        logits = steps.prefill(model, cache, ids, rows)
        _sync(device)
        seconds = time.perf_counter() - t0
    run = {"cache": cache, "rows": rows, "next_ids": logits.argmax(-1), "prefill_s": seconds,
           "prefill_tok_s": ids.shape[1] / seconds, "step_s": []}
    if measure:
        run.update(peak_rss_mb=memory.peak / 2**20, peak_rise_mb=memory.rise_mb)
    return run


@torch.inference_mode()
def decode_step(model, run: dict[str, Any], compressor, device: str, measure: bool = False) -> None:
    """One greedy decode step on a prefilled run (its time appended to ``run["step_s"]``; with ``measure``,
    the largest rise of memory within a step so far in ``run["decode_rise"]``)."""
    _use_attention(model, compressor)
    with PeakMemory(device, collect=False) if measure else contextlib.nullcontext() as memory:
        t0 = time.perf_counter()
        run["next_ids"] = steps.decode_one(model, run["cache"], run["next_ids"], run["rows"]).argmax(-1)
        _sync(device)
        run["step_s"].append(time.perf_counter() - t0)
    if measure:
        run["decode_rise"] = max(run.get("decode_rise", 0), memory.peak - memory.start)


def measure_memory(model, ids: torch.Tensor, compressor, device: str, decode_steps: int) -> dict[str, float]:
    """The memory pass for one compressor, alone in the process: the rise of a prefill, the process's peak,
    and the largest rise within a decode step (see :func:`run_bench`)."""
    gc.collect()
    trim_heap()
    run = prefill(model, ids, compressor, device, measure=True)
    for _ in range(decode_steps):
        decode_step(model, run, compressor, device, measure=True)
    return {"peak_rss_mb": run["peak_rss_mb"], "peak_rise_mb": run["peak_rise_mb"],
            "decode_peak_rise_mb": run.get("decode_rise", float("nan")) / 2**20}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    from kvcomp import CompressedCache
    from kvcomp.generation import cache_stats

    cache = run["cache"]
    resident, full, _ = cache_stats(cache)
    steps = sorted(run["step_s"])
    rounds = run.get("prefill_rounds_s", [run["prefill_s"]])
    tokens = run["prefill_tok_s"] * run["prefill_s"]
    row = {"prefill_s": _median(rounds), "prefill_tok_s": tokens / _median(rounds)}
    if len(rounds) > 1:
        row["prefill_rounds_s"] = rounds
    row.update(
        decode_tok_s=len(steps) / sum(steps) if steps else float("nan"),
        decode_ms_per_token=1000 * steps[len(steps) // 2] if steps else float("nan"),
        # Resident = the fast tier (what a decode step reads and what memory_factor counts); retrieval
        # methods keep the full KV in a slower tier as well, reported apart.
        kv_bytes=resident.get("device", 0),
        kv_slow_tier_bytes=resident.get("host", 0) + resident.get("disk", 0),
        # What a saved context keeps (KVTC: its entropy-coded blocks; the live codes are kv_bytes).
        kv_stored_bytes=cache.stored_bytes() if isinstance(cache, CompressedCache) else resident.get("device", 0),
        full_kv_bytes=full,
    )
    return row


def warm_up(model, config: BenchConfig, built: list) -> None:
    """A short prefill and a decode step of each compressor: first-call costs (allocator, kernel compilation)
    must not land on whichever is measured first."""
    warm = synthetic_prompt(64, model.config.vocab_size, config.seed)
    for _, compressor in built:
        decode_step(model, prefill(model, warm, compressor, config.device), compressor, config.device)


def memory_pass(model, config: BenchConfig, built: list, log=print) -> dict[str, dict[str, float]]:
    """Peaks of every (context, compressor), each compressor alone after a warm-up: ``{"context|label":
    {peak_rise_mb, peak_rss_mb, decode_peak_rise_mb}}``."""
    warm_up(model, config, built)
    peaks = {}
    for context in config.contexts:
        ids = synthetic_prompt(context, model.config.vocab_size, config.seed)
        for label, compressor in built:
            peaks[f"{context}|{label}"] = found = measure_memory(model, ids, compressor, config.device,
                                                                 config.decode_steps)
            log(f"{context:>6} {label:32s} prefill rise {found['peak_rise_mb']:7.0f} MiB, decode step rise "
                f"{found['decode_peak_rise_mb']:6.1f} MiB")
    return peaks


def fresh_memory_pass(config_json: str, specs_json: str) -> None:
    """Entry point of :func:`memory_in_fresh_process`: load the model, run :func:`memory_pass`, print JSON."""
    import sys

    from kvcomp import load_model

    config = BenchConfig(**json.loads(config_json))
    if config.threads:
        torch.set_num_threads(config.threads)
    built = [build_compressor(s, config) for s in json.loads(specs_json)]
    model, _ = load_model(config.model, dtype=config.dtype, device=config.device)
    peaks = memory_pass(model, config, built, log=lambda *a: print(*a, file=sys.stderr))
    print(json.dumps(peaks))


def memory_in_fresh_process(config: BenchConfig, specs: list[str]) -> dict[str, dict[str, float]]:
    """The memory pass in a new Python process whose malloc threshold is fixed from its start
    (``MALLOC_MMAP_THRESHOLD_``), as ``tests/test_peak_memory.py`` measures: peaks measured in the process that
    ran the timed pass carry its heap's history (FreeKV at 8K rose 1.8 GB there against 0.26 GB fresh)."""
    import subprocess
    import sys

    code = "import sys; from experiments.bench import fresh_memory_pass; fresh_memory_pass(sys.argv[1], sys.argv[2])"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(dataclasses.asdict(config)), json.dumps(specs)],
                          stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: the memory pass failed (exit {proc.returncode}); its error is above. "
                           "--no-memory skips it.")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_bench(config: BenchConfig, model=None, tokenizer=None, log=print) -> list[dict[str, Any]]:
    """Run every (context, compressor) pair; returns the rows (also written to ``config.out``).

    Two passes. The timing pass runs with glibc's own allocator, as a user's process would: at each context
    every compressor prefills once (in turn, each prefill timed alone; or in ``prefill_rounds`` rounds), then
    the decode steps are interleaved, one step of each compressor in turn, so that a change in the machine's
    load (a shared machine) slows all of them alike and the ratios to ``none`` stay meaningful. The memory
    pass (``config.memory``) follows in a fresh process (:func:`memory_in_fresh_process`; in this one when a
    model object is given) with a fixed mmap threshold (:func:`kvcomp.memory.fixed_malloc_threshold`: peaks
    then compare what each method allocates, not the heap's history, but every large allocation faults its
    pages in, which would slow allocating steps by up to 40%): each compressor alone prefills and decodes the
    same steps again.
    ``peak_rise_mb`` is the rise of the process's resident memory during its prefill (its cache plus prefill
    transients; on CUDA, of allocated device memory), ``peak_rss_mb`` the process's peak then;
    ``decode_peak_rise_mb`` the largest rise within one decode step over the memory held just before it (the
    step's transients: fetched pages, attention buffers). Both are peaks; ``memory_factor`` is the bytes the
    cache holds at rest.
    """
    from kvcomp import load_model

    if config.threads:
        torch.set_num_threads(config.threads)
    specs = list(config.compressors) or default_specs()
    names = [parse_spec(s)[0] for s in specs]
    specs = [b for b in BASELINES if b not in names] + specs  # ratios need both baselines
    built = [build_compressor(s, config) for s in specs]  # bad names fail before the model loads
    own_model = model is None
    if own_model:
        model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    copy, bandwidth = copy_bandwidth(config.device), read_bandwidth(config.device)
    weights = weight_bytes(model)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (copy {copy / 1e9:.1f}); weights {weights / 2**20:.0f} MiB; "
        f"{torch.get_num_threads()} threads" + ("; native linear layers" if config.native_linear else ""))
    with steps.native_linears(model) if config.native_linear else contextlib.nullcontext():
        rows = _timed_pass(model, config, built, weights, bandwidth, log)
    malloc_fixed = False
    if config.memory:
        by_key = {(r["context"], r["compressor"]): r for r in rows}
        if own_model:  # a fresh process, its threshold fixed from its start: no heap history from the timed pass
            peaks, malloc_fixed = memory_in_fresh_process(config, specs), "fresh process"
        else:  # a model object given (tests): this process, its threshold fixed from now on
            malloc_fixed = fixed_malloc_threshold()
            peaks = memory_pass(model, config, built, log)
        for key, value in peaks.items():
            context, label = key.split("|", 1)
            by_key[int(context), label].update(value)
    meta = {
        "config": dataclasses.asdict(config),
        "read_bandwidth_bytes_s": bandwidth,
        "copy_bandwidth_bytes_s": copy,
        "weight_bytes": weights,
        "threads": torch.get_num_threads(),
        "malloc_mmap_threshold_fixed": malloc_fixed,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "native_quant_kernel": _native_status(config.device),
    }
    write_outputs(rows, meta, Path(config.out))
    return rows


def _prefill_rounds(model, ids: torch.Tensor, config: BenchConfig, built: list, log) -> list[dict[str, Any]]:
    """``config.prefill_rounds`` rounds in which every compressor prefills ``ids`` once, each round starting one
    compressor further along (so none always runs first); each run of the last round (kept for the decode steps)
    records every round's ``prefill_s`` in ``prefill_rounds_s``, in round order."""
    times: list[list[float]] = [[] for _ in built]
    runs: list[dict[str, Any] | None] = [None] * len(built)
    for r in range(config.prefill_rounds):
        for i in [(r + j) % len(built) for j in range(len(built))]:
            label, compressor = built[i]
            runs[i] = None  # the previous round's cache goes before this prefill allocates another
            run = prefill(model, ids, compressor, config.device)
            times[i].append(run["prefill_s"])
            runs[i] = run
            log(f"{ids.shape[1]:>6} {label:32s} prefill {run['prefill_tok_s']:7.0f} tok/s"
                + (f" (round {r + 1} of {config.prefill_rounds})" if config.prefill_rounds > 1 else ""))
    for run, seconds in zip(runs, times):
        run["prefill_rounds_s"] = seconds
    return runs


def _prefill_ratios(row: dict[str, Any], ref: dict[str, Any], suffix: str) -> None:
    """``prefill_slowdown{suffix}``: the median over rounds of the row's prefill time over ``ref``'s in the same
    round (paired: a round's load hits both), with the lowest and highest round's ratio beside it."""
    ratios = sorted(a / b for a, b in zip(row.get("prefill_rounds_s", [row["prefill_s"]]),
                                          ref.get("prefill_rounds_s", [ref["prefill_s"]])))
    row[f"prefill_slowdown{suffix}"] = _median(ratios)
    if len(ratios) > 1:
        row[f"prefill_slowdown{suffix}_low"], row[f"prefill_slowdown{suffix}_high"] = ratios[0], ratios[-1]


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _timed_pass(model, config: BenchConfig, built: list, weights: int, bandwidth: float, log) -> list[dict]:
    """Every context: prefill each compressor (in rounds), decode their steps interleaved, one row each
    (run_bench)."""
    warm_up(model, config, built)
    rows = []
    for context in config.contexts:
        ids = synthetic_prompt(context, model.config.vocab_size, config.seed)
        runs = _prefill_rounds(model, ids, config, built, log)
        for _ in range(config.decode_steps):
            for (_, compressor), run in zip(built, runs):
                decode_step(model, run, compressor, config.device)
        at_context = []
        for (label, _), run in zip(built, runs):
            row = {"context": context, "compressor": label, **summarize(run)}
            step_bytes = weights + row["kv_bytes"]
            row["step_bytes"] = step_bytes
            row["roofline_ms"] = 1000 * step_bytes / bandwidth
            row["roofline_fraction"] = row["roofline_ms"] / row["decode_ms_per_token"]
            at_context.append(row)
        base = {r["compressor"]: r for r in at_context if r["compressor"] in BASELINES}
        for row in at_context:
            for suffix, name in (("", "none"), ("_kvcomp", KVCOMP_BASELINE)):
                ref = base[name]
                row[f"decode_speedup{suffix}"] = ref["decode_ms_per_token"] / row["decode_ms_per_token"]
                _prefill_ratios(row, ref, suffix)
            row["memory_factor"] = metrics.fast_tier_factor(base["none"]["kv_bytes"], row["kv_bytes"])
            row["stored_factor"] = metrics.fast_tier_factor(base["none"]["kv_bytes"], row["kv_stored_bytes"])
            rows.append(row)
            log(f"{context:>6} {row['compressor']:32s} decode {row['decode_ms_per_token']:7.1f} ms/token "
                f"(x{row['decode_speedup']:.2f} none, x{row['decode_speedup_kvcomp']:.2f} none-kvcomp)  "
                f"KV {row['kv_bytes'] / 2**20:7.1f} MiB  roofline {row['roofline_fraction']:.2f}")
        del runs
        gc.collect()
    return rows


def _native_status(device: str) -> bool:
    from kvcomp.kernels import cpu_native

    return device == "cpu" and cpu_native.enabled() and cpu_native.load() is not None


# -- output --------------------------------------------------------------------------------------------------
COLUMNS = [
    ("context", "context", "{:d}"),
    ("compressor", "compressor", "{}"),
    ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
    ("prefill_slowdown", "prefill time x none", "{:.2f}"),
    ("decode_tok_s", "decode tok/s", "{:.2f}"),
    ("decode_ms_per_token", "ms/token", "{:.1f}"),
    ("decode_speedup", "decode x none", "{:.2f}"),
    ("decode_speedup_kvcomp", "decode x none-kvcomp", "{:.2f}"),
    ("kv_bytes", "KV MiB", None),
    ("memory_factor", "memory factor", "{:.2f}"),
    ("stored_factor", "stored factor", "{:.2f}"),
    ("peak_rise_mb", "prefill RSS rise MiB", "{:.0f}"),
    ("decode_peak_rise_mb", "decode step rise MiB", "{:.1f}"),
    ("roofline_ms", "roofline ms", "{:.1f}"),
    ("roofline_fraction", "of roofline", "{:.2f}"),
]


def _cell(row: dict, key: str, fmt: str | None) -> str:
    value = row.get(key)
    if value is None:
        return ""
    if key == "kv_bytes":
        return f"{value / 2**20:.1f}"
    if key == "prefill_slowdown" and "prefill_slowdown_low" in row:  # rounds: the extreme rounds beside it
        return f"{value:.2f} ({row['prefill_slowdown_low']:.2f}-{row['prefill_slowdown_high']:.2f})"
    return fmt.format(value)


def print_table(rows: list[dict], title: str = "kvcomp bench") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="left" if header == "compressor" else "right")
    for row in rows:
        table.add_row(*[_cell(row, key, fmt) for key, _, fmt in COLUMNS])
    Console(width=200).print(table)


def write_outputs(rows: list[dict], meta: dict, out: Path) -> dict[str, Path]:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with files.open_output(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    files.write_text(out / "bench.json", json.dumps({"meta": meta, "rows": rows}, indent=2))
    written = {"csv": out / "bench.csv", "json": out / "bench.json"}
    if rows:
        written["plot"] = plot(rows, out / "bench.png", meta)
    return written


def plot(rows: list[dict], path: Path, meta: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    labels = list(dict.fromkeys(r["compressor"] for r in rows))
    for label in labels:
        mine = sorted((r for r in rows if r["compressor"] == label), key=lambda r: r["context"])
        x = [r["context"] for r in mine]
        line = axes[0].plot(x, [r["decode_ms_per_token"] for r in mine], marker="o", label=label)[0]
        axes[0].plot(x, [r["roofline_ms"] for r in mine], linestyle=":", color=line.get_color())
        axes[1].plot(x, [r["kv_bytes"] / 2**20 for r in mine], marker="o", label=label)
        axes[2].plot(x, [r["prefill_tok_s"] for r in mine], marker="o", label=label)
    titles = ["decode ms/token (dotted: memory roofline)", "resident KV (MiB)", "prefill tokens/s"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("context tokens")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if meta:
        fig.suptitle(f"read bandwidth {meta.get('read_bandwidth_bytes_s', 0) / 1e9:.1f} GB/s, {meta['threads']} threads, "
                     f"dtype {meta['config']['dtype']}", fontsize=9)
    fig.tight_layout()
    with files.open_output(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")
    return path


def main(argv: list[str] | None = None) -> int:
    from experiments.cli import main as cli_main

    return cli_main(["bench", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
