"""Where a compressor's decode step goes: inclusive wall time per step of named methods and functions, each
wrapped with a timer (no profiler on anything else), over real decode steps of the embedded SmolLM2 after
``kvcomp bench``'s synthetic prompt. The results directories' ``sections.py`` scripts name what to wrap::

    from experiments.step_sections import time_sections
    time_sections("kvtc", 2048, methods=["attend", "append"], functions=[(cpu_native, "kvtc_attention")])

prints the mean step time and, per wrapped name, its milliseconds per step and microseconds per call."""

from __future__ import annotations

import collections
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
    wrapped = []  # (owner, attribute, its own value before: None when inherited)
    for owner, attr in [(type(compressor), m) for m in methods] + list(functions):
        own = vars(owner).get(attr)
        if _wrap(owner, attr, times, calls):
            wrapped.append((owner, attr, own))
    seconds = []
    try:
        for step in range(warm + steps):
            if step == warm:
                times.clear()
                calls.clear()
            start = time.perf_counter()
            bench.decode_step(loaded, run, compressor, "cpu")
            seconds.append(time.perf_counter() - start)
    finally:
        for owner, attr, own in reversed(wrapped):
            if own is None:
                delattr(owner, attr)  # it was inherited
            else:
                setattr(owner, attr, own)
    seconds = seconds[warm:]
    print(f"{label}: {sum(seconds) / steps * 1e3:.1f} ms per step (min {min(seconds) * 1e3:.1f})")
    for key, total in sorted(times.items(), key=lambda item: -item[1]):
        print(f"{key:45s} {total / steps * 1e3:6.2f} ms per step {total / calls[key] * 1e6:7.1f} us per call")
    return {"step": sum(seconds) / steps * 1e6, **{key: total / calls[key] * 1e6 for key, total in times.items()}}


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
