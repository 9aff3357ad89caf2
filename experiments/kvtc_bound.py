"""How much could KVTC gain from a wider PCA? The Gaussian rate-distortion bound per grouping of the KV cache.

    python -m experiments.kvtc_bound --tokens 16384 --factors 8 16 32 --out runs/kvtc_bound

kvcomp's KVTC fits one PCA basis per layer, KV head and kind (keys, values; see
:mod:`kvcomp.kvtc_calibration` for why heads are not concatenated); the paper concatenates every layer and head.
This script collects pre-RoPE keys and values of the default calibration text (first ``n_sink`` tokens of each
sequence skipped, as KVTC does), fits PCA on the first 3/4 of the tokens and measures the variance of the last
1/4 along that basis, then gives for each grouping the least distortion any coder can reach at the bit rate of
a target compression factor (reverse water-filling over the held-out variances, the Gaussian rate-distortion
bound): ``head`` (one basis per KV head, kvcomp's choice), ``layer`` (a layer's heads concatenated) and
``layers<k>`` (``k`` consecutive layers and their heads concatenated). Distortion is relative: the summed
squared error over the summed held-out variance. With ``--artifact`` (or the model's default artifact when it
exists), the ``kvtc_dp`` column is what KVTC's own DP allocation reaches on the calibration tables (its quantizer
options, calibration tokens: an in-sample figure), i.e. how far the practical quantizer sits from its grouping's
bound. Writes ``kvtc_bound.csv`` (one row per kind and factor).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import torch

from kvcomp import kvtc_calibration as calibration
from kvcomp import load_model


def heldout_variances(x: torch.Tensor, train_fraction: float = 0.75) -> np.ndarray:
    """``x`` ``[N, p]``: variances of the last ``1 - train_fraction`` of the rows along the PCA basis (and mean)
    fitted on the first rows, largest first."""
    n_train = int(x.shape[0] * train_fraction)
    if n_train < 2 or n_train >= x.shape[0]:
        raise ValueError(f"need rows on both sides of the split: {x.shape[0]} rows, train_fraction {train_fraction}.")
    train, test = x[:n_train].double(), x[n_train:].double()
    mean = train.mean(0)
    centred = train - mean
    _, vectors = torch.linalg.eigh(centred.T @ centred / n_train)
    variances = (((test - mean) @ vectors) ** 2).mean(0).numpy()
    return np.sort(variances)[::-1]


def water_filling(variances: np.ndarray, rate: float) -> float:
    """Least total squared error of independent Gaussian components with ``variances`` coded with ``rate`` bits
    in all: ``sum(min(theta, var))`` with ``theta`` such that ``sum(max(0, log2(var / theta) / 2)) == rate``."""
    var = np.asarray(variances, dtype=np.float64)
    var = var[var > 0]
    if rate <= 0 or var.size == 0:
        return float(var.sum())
    lo, hi = var.min() * 2.0 ** (-2 * rate / var.size) / 2, var.max()
    for _ in range(200):  # bisection on log(theta)
        theta = np.sqrt(lo * hi)
        lo, hi = (theta, hi) if np.maximum(0.0, 0.5 * np.log2(var / theta)).sum() > rate else (lo, theta)
    theta = np.sqrt(lo * hi)
    return float(np.minimum(theta, var).sum())


def grouping_bound(x: torch.Tensor, factor: float, grouping: str, dtype_bits: int = 32) -> float:
    """Relative distortion bound of ``x`` ``[L, N, H, D]`` (one kind) at ``factor`` for a grouping: ``head``,
    ``layer`` or ``layers<k>``."""
    n_layers, n, n_heads, d = x.shape
    rate_per_head = d * dtype_bits / factor
    if grouping == "head":
        groups = [x[layer, :, head] for layer in range(n_layers) for head in range(n_heads)]
    elif grouping == "layer":
        groups = [x[layer].reshape(n, n_heads * d) for layer in range(n_layers)]
    elif grouping.startswith("layers") and grouping[6:].isdigit() and int(grouping[6:]) > 0:
        k = int(grouping[6:])
        groups = [x[i:i + k].permute(1, 0, 2, 3).reshape(n, -1) for i in range(0, n_layers, k)]
    else:
        raise ValueError(f"grouping must be 'head', 'layer' or 'layers<k>' (e.g. layers5), got {grouping!r}.")
    error = total = 0.0
    for g in groups:
        variances = heldout_variances(g)
        error += water_filling(variances, rate_per_head * g.shape[1] / d)
        total += float(variances.sum())
    return error / total


def dp_distortion(cal: calibration.Calibration, kind: int, factor: float, group_size: int = 4,
                  dtype_bits: int = 32) -> float:
    """Relative squared error of KVTC's DP allocation on the calibration tables (all layers and heads)."""
    error = total = 0.0
    for layer in range(cal.err.shape[0]):
        option = calibration.allocate(cal, layer, dtype_bits, factor, group_size).option[:, kind]  # [H, D]
        error += float(cal.err[layer, :, kind].gather(1, option.unsqueeze(1)).sum())
        total += float(cal.variance[layer, :, kind].sum())
    return error / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.kvtc_bound", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF id or path, 'tiny'; default: the embedded model")
    p.add_argument("--tokens", type=int, default=16384, help="calibration tokens collected (3/4 fit, 1/4 held out)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--factors", type=float, nargs="+", default=[8, 16, 32])
    p.add_argument("--groupings", nargs="+", default=["head", "layer", "layers5"])
    p.add_argument("--artifact", default=None, help="KVTC artifact for the kvtc_dp column (default: the model's)")
    p.add_argument("--out", default="runs/kvtc_bound")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    artifact = Path(args.artifact) if args.artifact else calibration.default_artifact_path(model)
    cal = calibration.load_artifact(artifact, model) if artifact.is_file() else None
    keys, values = calibration.collect(model, tokenizer, calibration.default_text(), args.tokens, args.seq_len,
                                       args.n_sink)
    rows = []
    for kind, (name, x) in enumerate([("keys", keys), ("values", values)]):
        for factor in args.factors:
            row = {"kind": name, "factor": factor, "tokens": x.shape[1]}
            row.update({f"bound_{g}": grouping_bound(x, factor, g) for g in args.groupings})
            row["kvtc_dp"] = dp_distortion(cal, kind, factor) if cal is not None else None
            rows.append(row)
            print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kvtc_bound.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'kvtc_bound.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
