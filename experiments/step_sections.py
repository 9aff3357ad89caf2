"""Where kvcomp's steps spend their time: inclusive wall time of named methods and functions, each wrapped with
a timer (no profiler on anything else), on the embedded SmolLM2 and ``kvcomp bench``'s synthetic prompt.

:func:`time_sections` times the parts of real decode steps; the results directories' ``sections.py`` scripts
name what to wrap::

    from experiments.step_sections import time_sections
    time_sections("kvtc", 2048, methods=["attend", "append"], functions=[(cpu_native, "kvtc_attention")])

prints the mean step time and, per wrapped name, its milliseconds per step and microseconds per call.
:func:`prefill_hooks` times each compressor's prefill hook (its scoring, selection or coding: what it adds to a
prefill beyond kvcomp's attention path) against transformers' DynamicCache prefill, in interleaved rounds."""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Any


def time_sections(name: str, length: int, methods: list[str], functions: list[tuple[Any, str]], steps: int = 24,
                  warm: int = 3, threads: int = 2, model: str = "embedded") -> dict[str, float]:
    """``methods`` of the compressor's class and ``functions`` (``(owner, attribute)``) timed over ``steps``
    decode steps after ``warm`` untimed ones; names the owner lacks are skipped, and every wrapped one is put
    back on return. Returns microseconds per call by name (and ``"step"``: the mean step in microseconds)."""
    import torch

    from experiments import bench
    from kvcomp import load_model

    torch.set_num_threads(threads)
    loaded, _ = load_model(model, dtype="float32", device="cpu")
    label, compressor = bench.build_compressor(name, bench.BenchConfig())
    run = bench.prefill(loaded, bench.synthetic_prompt(length, loaded.config.vocab_size, 0), compressor, "cpu")
    times: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    targets = [(type(compressor), m) for m in methods] + list(functions)
    seconds = []
    with _wrapped(targets, times, calls):
        for step in range(warm + steps):
            if step == warm:
                times.clear()
                calls.clear()
            start = time.perf_counter()
            bench.decode_step(loaded, run, compressor, "cpu")
            seconds.append(time.perf_counter() - start)
    seconds = seconds[warm:]
    print(f"{label}: {sum(seconds) / steps * 1e3:.1f} ms per step (min {min(seconds) * 1e3:.1f})")
    for key, total in sorted(times.items(), key=lambda item: -item[1]):
        print(f"{key:45s} {total / steps * 1e3:6.2f} ms per step {total / calls[key] * 1e6:7.1f} us per call")
    return {"step": sum(seconds) / steps * 1e6, **{key: total / calls[key] * 1e6 for key, total in times.items()}}


def prefill_hooks(names: list[str], length: int, rounds: int = 5, threads: int = 2, model: str = "embedded"
                  ) -> dict[str, dict[str, float]]:
    """Prefill ``length`` tokens with transformers' DynamicCache and each compressor of ``names`` (``kvcomp
    bench`` specs), ``rounds`` times in interleaved rounds, timing the compressor's ``prefill`` hook (summed over
    layers) inside each. Returns per name the medians of the prefill (``prefill_s``), of the hook (``hook_s``)
    and of the hook over the same round's DynamicCache prefill (``hook_share``), and prints them."""
    import statistics

    import torch

    from experiments import bench
    from kvcomp import load_model

    torch.set_num_threads(threads)
    loaded, _ = load_model(model, dtype="float32", device="cpu")
    ids = bench.synthetic_prompt(length, loaded.config.vocab_size, 0)
    built = [bench.build_compressor("none", bench.BenchConfig())]
    built += [bench.build_compressor(name, bench.BenchConfig()) for name in names if name != "none"]
    prefill_s: dict[str, list[float]] = collections.defaultdict(list)
    hook_s: dict[str, list[float]] = collections.defaultdict(list)
    shares: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(rounds + 1):  # round 0 warms up, untimed
        order = built[r % len(built):] + built[:r % len(built)]
        baseline, hooks = None, {}
        for label, compressor in order:
            times: collections.Counter = collections.Counter()
            targets = [] if compressor is None else [(type(compressor), "prefill")]
            with _wrapped(targets, times, collections.Counter()):
                run = bench.prefill(loaded, ids, compressor, "cpu")
            if r:
                prefill_s[label].append(run["prefill_s"])
                hooks[label] = sum(times.values())
                baseline = run["prefill_s"] if compressor is None else baseline
        for label, seconds in hooks.items():
            hook_s[label].append(seconds)
            shares[label].append(seconds / baseline)
    out = {}
    for label, _ in built:
        out[label] = {"prefill_s": statistics.median(prefill_s[label]), "hook_s": statistics.median(hook_s[label]),
                      "hook_share": statistics.median(shares[label])}
        print(f"{label:45s} prefill {out[label]['prefill_s']:.3f} s  hook {out[label]['hook_s'] * 1e3:7.1f} ms  "
              f"hook / DynamicCache prefill {out[label]['hook_share']:.3f}")
    return out


@contextlib.contextmanager
def _wrapped(targets: list[tuple[Any, str]], times: collections.Counter, calls: collections.Counter):
    """Each ``(owner, attribute)`` replaced by a timed wrapper (names an owner lacks skipped) while the block
    runs; the originals are put back after, an inherited one by removing the wrapper."""
    wrapped = []  # (owner, attribute, its own value before: None when inherited)
    try:
        for owner, attr in targets:
            own = vars(owner).get(attr)
            if _wrap(owner, attr, times, calls):
                wrapped.append((owner, attr, own))
        yield
    finally:
        for owner, attr, own in reversed(wrapped):
            if own is None:
                delattr(owner, attr)  # it was inherited
            else:
                setattr(owner, attr, own)


def _wrap(owner: Any, attr: str, times: collections.Counter, calls: collections.Counter) -> bool:
    fn, key = getattr(owner, attr, None), f"{getattr(owner, '__name__', owner)}.{attr}"
    if fn is None:
        return False

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - start
            calls[key] += 1

    setattr(owner, attr, timed)
    return True
