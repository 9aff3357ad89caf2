"""Achieved memory bandwidth of the decode kernels against the device's copy bandwidth.

Decode attention is memory bound: a kernel is as good as the fraction of the device's bandwidth it reaches
while reading the cache. For contexts of 8K to 128K tokens (one sequence, a Llama-3-8B-like layer: 32 query
heads, 8 KV heads, head dim 128) this times

* ``quant``: the fused quantized decode kernel (4-bit KIVI, group 32, 128-token residual) reading the
  packed codes, scales, zero points and positions;
* ``sparse``: sparse decode attention over 1/8 of the tokens in pages of 16, reading the selected bf16 K/V;
* ``dense``: torch's sdpa over the full bf16 cache (the baseline a compressed cache must beat);
* ``key-scores``: SpeCache's approximate logits of every token from its 2-bit key copy (group 64), reduced over
  each KV head's query group (the fused retrieval scorer);
* ``page-scores``: FreeKV / Quest page bounds from per-page bf16 key extremes (pages of 32);

and reports bytes moved / time against the bandwidth of a large device-to-device copy (bytes read + written
per second: a kernel that only reads can approach it). The attention kernels' bytes are what they read (their
output is one row per head); a scorer's are what it reads plus the float32 score per token or page it writes.
``--tiny`` runs a few hundred tokens (on the CPU under ``TRITON_INTERPRET=1`` it checks the script, not the
speed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def device_copy_bandwidth(device: str, megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes read + written per second by a large copy (best of ``repeats``)."""
    n = megabytes * 2**20 // 4 if device.startswith("cuda") else 2**20
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), device, warmup=2, repeats=repeats))
    return 2 * n * 4 / best


def timed(fn, device: str, warmup: int = 3, repeats: int = 20) -> list[float]:
    """Seconds per call (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def quant_inputs(length: int, heads: int, groups: int, dim: int, bits: int, group: int, residual: int, device,
                 dtype=torch.bfloat16):
    from kvcomp.kernels import quant_ref

    n_groups = length // group
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(1, heads, n_groups, group, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, heads, n_groups, group, dim, device=device, dtype=dtype, generator=gen)
    kc, ks, kz = quant_ref.quantize_keys(k, bits)
    vc, vs, vz = quant_ref.quantize_values(v, bits, min(group, dim))
    del k, v
    positions = torch.arange(n_groups * group, device=device, dtype=torch.int32).view(1, 1, n_groups, group)
    positions = positions.expand(1, heads, n_groups, group).contiguous()
    rk = torch.randn(1, heads, residual, dim, device=device, dtype=dtype, generator=gen)
    rv = torch.randn(1, heads, residual, dim, device=device, dtype=dtype, generator=gen)
    rp = torch.arange(n_groups * group, n_groups * group + residual, device=device, dtype=torch.int32)
    rp = rp.view(1, 1, -1).expand(1, heads, residual).contiguous()
    q = torch.randn(1, heads * groups, 1, dim, device=device, dtype=dtype, generator=gen)
    q_pos = torch.full((1, 1), n_groups * group + residual, device=device)
    return (q, q_pos, kc, ks, kz, vc, vs, vz, positions, rk, rv, rp, bits, dim**-0.5)


def run(contexts: list[int], device: str, heads: int = 8, groups: int = 4, dim: int = 128, bits: int = 4,
        group: int = 32, residual: int = 128, page: int = 16, keep: float = 0.125, repeats: int = 20,
        warmup: int = 3, log=print) -> dict:
    from kvcomp.kernels import quant_ref, quant_triton, sparse_ref, sparse_triton

    copy = device_copy_bandwidth(device)
    log(f"device copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    rows = []
    for length in contexts:
        args = quant_inputs(length, heads, groups, dim, bits, group, residual, device)
        q = args[0]
        read = nbytes(*args[2:12]) + nbytes(q)
        expected = quant_ref.quant_attention(*args, block_tokens=8192)
        for precision in ("ieee", "tf32"):
            quant_triton.DOT_PRECISION = precision
            err = float((quant_triton.quant_attention(*args).float() - expected.float()).abs().max())
            t = sorted(timed(lambda a=args: quant_triton.quant_attention(*a), device, warmup, repeats))[repeats // 2]
            rows.append(dict(kernel=f"quant{bits}-{precision}", tokens=length, bytes=read, seconds=t,
                             gb_s=read / t / 1e9, of_copy=read / t / copy, max_abs_err=err))
        quant_triton.DOT_PRECISION = "ieee"

        gen = torch.Generator(device=device).manual_seed(1)
        keys = torch.randn(1, heads, length, dim, device=device, dtype=torch.bfloat16, generator=gen)
        values = torch.randn_like(keys)
        pages = length // page
        selected = max(1, int(pages * keep))
        indices = torch.stack([torch.randperm(pages, device=device, generator=gen)[:selected] for _ in range(heads)])
        indices = indices.view(1, heads, selected).sort(-1).values
        read = selected * page * heads * dim * 2 * 2 + nbytes(indices, q)
        expected = sparse_ref.sparse_attention(q, keys, values, indices, dim**-0.5, page)
        err = float((sparse_triton.sparse_attention(q, keys, values, indices, dim**-0.5, page).float()
                     - expected.float()).abs().max())
        sparse_args = (q, keys, values, indices, dim**-0.5, page)
        t = sorted(timed(lambda a=sparse_args: sparse_triton.sparse_attention(*a), device, warmup, repeats))[
            repeats // 2]
        rows.append(dict(kernel=f"sparse-1/{round(1 / keep)}", tokens=length, bytes=read, seconds=t,
                         gb_s=read / t / 1e9, of_copy=read / t / copy, max_abs_err=err))

        qg = q.view(1, heads, groups, dim)
        read = nbytes(keys, values, q)
        dense_args = (qg, keys, values)
        t = sorted(timed(lambda a=dense_args: torch.nn.functional.scaled_dot_product_attention(*a), device,
                         warmup, repeats))[repeats // 2]
        rows.append(dict(kernel="dense-sdpa-bf16", tokens=length, bytes=read, seconds=t, gb_s=read / t / 1e9,
                         of_copy=read / t / copy, max_abs_err=0.0))
        rows += scorer_rows(q, length, heads, dim, copy, device, warmup, repeats)
        for row in rows[-6:]:
            log(f"{row['kernel']:18s} {row['tokens']:>7} tokens  {row['seconds'] * 1e6:9.1f} us  "
                f"{row['gb_s']:8.1f} GB/s  {row['of_copy']:.2f} of copy  err {row['max_abs_err']:.1e}")
    return {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "copy_bandwidth_bytes_s": copy, "heads": heads, "groups": groups, "dim": dim, "rows": rows}


def scorer_rows(q, length: int, heads: int, dim: int, copy: float, device, warmup: int, repeats: int,
                bits: int = 2, score_group: int = 64, page_tokens: int = 32) -> list[dict]:
    """The retrieval scorers at SpeCache's and FreeKV's defaults (bits 2, group 64; pages of 32)."""
    from kvcomp.kernels import quant_ref, retrieval_ref, retrieval_triton

    gen = torch.Generator(device=device).manual_seed(2)
    keys = torch.randn(1, heads, length // score_group, score_group, dim, device=device, dtype=torch.bfloat16,
                       generator=gen)
    kc, ks, kz = quant_ref.quantize_keys(keys, bits)
    keys = keys.flatten(2, 3)[:, :, : length // page_tokens * page_tokens].unflatten(2, (-1, page_tokens))
    page_max, page_min = keys.amax(3).contiguous(), keys.amin(3).contiguous()
    del keys
    cases = [
        (f"key-scores{bits}", (q, kc, ks, kz, bits, dim**-0.5), retrieval_triton.quant_key_scores,
         retrieval_ref.quant_key_scores, nbytes(q, kc, ks, kz) + heads * length * 4),
        ("page-scores", (q, page_max, page_min), retrieval_triton.page_scores, retrieval_ref.page_scores,
         nbytes(q, page_max, page_min) + heads * page_max.shape[2] * 4),
    ]
    rows = []
    for name, args, kernel, reference, moved in cases:
        err = float((kernel(*args) - reference(*args)).abs().max())
        t = sorted(timed(lambda a=args, k=kernel: k(*a), device, warmup, repeats))[repeats // 2]
        rows.append(dict(kernel=name, tokens=length, bytes=moved, seconds=t, gb_s=moved / t / 1e9,
                         of_copy=moved / t / copy, max_abs_err=err))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a few hundred tokens, small heads (checks the script)")
    parser.add_argument("--out", default="runs/gpu_check")
    args = parser.parse_args(argv)
    if args.tiny:
        result = run([128], args.device, heads=2, groups=3, dim=32, page=16, keep=0.25, repeats=1, warmup=0)
    else:
        result = run(args.contexts, args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_bench.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
