"""Calibration for KVTC transform coding: PCA bases and per-component rate/error tables, saved as a
versioned safetensors artifact tied to the model.

``calibrate(model, tokenizer, out)`` (CLI: ``kvcomp calibrate kvtc --model ... --out ...``) runs the model
over calibration text in sequences of ``seq_len`` tokens, takes the cached keys (which transformers stores
after RoPE) and undoes RoPE with the model's own ``inv_freq`` and ``attention_scaling`` (``keys="pre_rope"``,
the paper's choice; ``keys="post_rope"`` keeps the keys as cached, see below), skips each
sequence's first ``n_sink`` tokens (KVTC keeps sinks uncompressed, and their outlier activations would
dominate the variance), and fits with scikit-learn one PCA basis per layer, KV head and kind (keys, values).

Heads are *not* concatenated (the paper concatenates all layers and heads into one vector): each KV head has
its own ``D x D`` basis. Token selection composed before KVTC (``Compose(SnapKV(...), KVTC(...))``) keeps
different tokens in each KV head, so a per-token vector across heads does not exist there; per-head bases
also need far fewer calibration tokens than a ``layers * heads * D``-dimensional PCA (5760 dimensions on
SmolLM2-135M).

For each component and quantizer option (a stored width of 2, 4 or 8 bits and a step, see
:mod:`kvcomp.transform_coding`) the artifact stores the step, the squared error on the calibration
coefficients and the empirical entropy of the codes (bits per token: the rate an entropy coder can reach). A
width's first step is the clipping range on a grid of multiples of the component's standard deviation that
minimises the squared error (at 8 bits at least 1.5 times the largest calibration coefficient, so that text
unlike the calibration text is not clipped where the budget asks for near-lossless coding); its other steps
are that one times ``sqrt(2)**j``. The allocation for a target compression factor is computed from these
tables when KVTC loads the artifact (:func:`allocate`), so one artifact serves every factor and dtype.

Key space. Keys without RoPE have a lower-rank spectrum (SmolLM2-135M, 12K tokens of prose: the top 16 of 64
components hold 75% of the variance before RoPE, 64% after; the DP's squared error at 128 bits per token is 4.0%
of the variance before RoPE and 6.2% after), but a key coded before RoPE has to be rebuilt (``S x D``
multiply-adds) and rotated before each query can use it. A basis fitted to keys *after* RoPE lets a decode step
project its query once instead (``q . (offset + codes @ W) = q . offset + codes . (W q)``: ``S`` multiply-adds
per key), at the worse rate-distortion. ``keys`` is in the artifact's metadata and in its default path. A
post-RoPE artifact holds no RoPE tables and its model needs none, so KVTC with post-RoPE keys also runs models
whose position encoding kvcomp cannot undo (cohere's interleaved RoPE, gpt2's learned positions). Its
calibration needs sequences as long as the contexts it will code (a RoPE pair whose period is longer than the
calibration sequences shows only an arc of its turn, and a later position turns the key out of it), so its
default ``seq_len`` is the model's context length up to 8192 (``--seq-len`` for longer contexts).

Default text (no download): docstrings of the Python standard library, read with :mod:`ast`. RULER's
offline ``essay`` haystacks come from ``pydoc_data.topics`` first and reach the docstrings only beyond about
27k words, so calibration prose and 4K-token evaluation haystacks do not overlap.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvcomp.attention import UnsupportedModel, check_rope, rotary_embedding
from kvcomp.compressor import CompressorError
from kvcomp.steps import forward
from kvcomp.transform_coding import (
    BITS,
    OPTION_BITS,
    OPTION_SCALE,
    apply_rope,
    dequantize,
    max_level,
    quantize,
    undo_rope,
)

FORMAT = "kvcomp-kvtc"
# 3: a sha256 of the tensors in the metadata (checked on load); 2: the same tables without it (still read, with a
# warning); 1: one quantizer step per width (refused).
VERSION = 3
KEY_SPACES = ("pre_rope", "post_rope")  # keys coded without RoPE (the default) or as cached, with it
READABLE_VERSIONS = ("2", "3")
REQUIRED_TENSORS = ("basis", "mean", "variance", "step", "err", "rate", "inv_freq", "probe", "option_bits",
                    "option_scale")
_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rope_parameters", "rope_scaling",
                "partial_rotary_factor", "max_position_embeddings")
_STEP_GRID = torch.logspace(-2, 4, 19, base=2.0)  # clipping range / sigma, 0.25 .. 16
_SEARCH_TOKENS = 1024
_MARGIN = 1.5  # 8-bit clipping range over the largest calibration coefficient (text unlike the calibration's)
CALIBRATE_COMMAND = "kvcomp calibrate kvtc --model <name or path> --out <artifact.safetensors>"


# -- model identity ------------------------------------------------------------------------------------------
def _text_config(model):
    return model.config.get_text_config(decoder=True)


def model_identity(model) -> dict:
    """What ties an artifact to a model: layer/head/dim counts and a hash of the architecture config."""
    cfg = _text_config(model)
    d = cfg.to_dict()
    key = json.dumps({k: d.get(k) for k in _CONFIG_KEYS}, sort_keys=True, default=str)
    return {
        "model": str(getattr(cfg, "name_or_path", "") or getattr(model, "name_or_path", "") or cfg.model_type),
        "config_hash": hashlib.sha256(key.encode()).hexdigest()[:16],
        "num_layers": int(cfg.num_hidden_layers),
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
    }


def weight_probe(model, n: int = 256) -> torch.Tensor:
    """The first ``n`` weights of the first key projection (float32): tells two checkpoints of one
    architecture apart (compared with a tolerance that survives bfloat16 rounding)."""
    for name, p in model.named_parameters():
        if "k_proj" in name and name.endswith("weight"):
            return p.detach().flatten()[:n].float().cpu().clone()
    return next(model.parameters()).detach().flatten()[:n].float().cpu().clone()


def rotary(model) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of the RoPE of the model's full-attention layers (the layers KVTC
    codes; sliding-window layers keep their window exactly), after checking that undoing it as
    :func:`kvcomp.transform_coding.undo_rope` does is exact for this model (:func:`kvcomp.attention.check_rope`)."""
    try:
        inv_freq, scaling = rotary_embedding(model)
        check_rope(model, lambda x, pos: apply_rope(x, pos, inv_freq.to(x.device), scaling))
    except UnsupportedModel as err:
        raise UnsupportedModel(f"{err} KVTC with keys coded as the cache holds them needs no RoPE: "
                               "KVTC(keys='post_rope') on `kvcomp calibrate kvtc --keys post_rope`.") from None
    return inv_freq, scaling


def default_artifact_path(model, keys: str = "pre_rope") -> Path:
    from kvcomp.files import cache_dir

    suffix = "" if keys == "pre_rope" else f"-{keys.replace('_', '-')}"
    return cache_dir() / "kvtc" / f"kvtc-{model_identity(model)['config_hash']}{suffix}.safetensors"


def default_seq_len(model, keys: str) -> int:
    """Tokens per calibration sequence unless given (see "Key space" in the module docstring)."""
    if keys == "pre_rope":
        return 1024
    return min(8192, int(getattr(_text_config(model), "max_position_embeddings", None) or 8192))


# -- calibration text ----------------------------------------------------------------------------------------
def default_text(num_words: int = 60000) -> str:
    """Prose from the docstrings of the standard library (sorted files, source order), about ``num_words``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
    words: list[str] = []
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                tree = ast.parse((Path(dirpath) / name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc.split()) >= 8:
                        words.extend(doc.split())
            if len(words) >= num_words:
                return " ".join(words)
    return " ".join(words)


# -- fitting -------------------------------------------------------------------------------------------------
@torch.inference_mode()
def collect(model, tokenizer, text: str, tokens: int, seq_len: int, n_sink: int, keys_space: str = "pre_rope"):
    """Keys (without RoPE, or as cached for ``keys_space="post_rope"``) and values of ``tokens`` calibration
    tokens: two ``[L, N, H, D]`` float32 tensors."""
    from transformers import DynamicCache

    if keys_space == "pre_rope":
        inv_freq, scaling = rotary(model)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if ids.numel() < min(tokens, seq_len):
        raise CompressorError(f"the calibration text has {ids.numel()} tokens; KVTC needs at least {seq_len}.")
    keys, values, taken = [], [], 0
    for start in range(0, ids.numel() - n_sink - 1, seq_len):
        chunk = ids[start:start + min(seq_len, tokens - taken)]
        if chunk.numel() <= n_sink or taken >= tokens:
            break
        cache = DynamicCache()
        forward(model, cache, chunk.view(1, -1).to(model.device))
        pos = torch.arange(chunk.numel())[n_sink:]
        k = torch.stack([layer.keys[0, :, n_sink:].float().cpu() for layer in cache.layers])  # [L, H, n, D]
        v = torch.stack([layer.values[0, :, n_sink:].float().cpu() for layer in cache.layers])
        keys.append((undo_rope(k, pos, inv_freq, scaling) if keys_space == "pre_rope" else k).transpose(1, 2))
        values.append(v.transpose(1, 2))
        taken += chunk.numel()
    if not keys:
        raise CompressorError(f"KVTC calibration needs more than the n_sink={n_sink} tokens per sequence it skips; "
                              f"got tokens={tokens}, seq_len={seq_len}. Give more tokens (--tokens).")
    return torch.cat(keys, 1), torch.cat(values, 1)


def _quantizer_tables(y: torch.Tensor, sigma: torch.Tensor):
    """For coefficients ``y`` ``[N, D]``: per quantizer option, the step ``[D]`` (options 1..), its squared
    error and rate (option 0, dropping the component, first)."""
    steps, errs, rates = [], [(y * y).mean(0)], [torch.zeros(y.shape[1])]
    sample = y[torch.linspace(0, y.shape[0] - 1, min(_SEARCH_TOKENS, y.shape[0])).long()]
    base = {}
    for bits in BITS[1:]:
        m = max_level(bits)
        grid = _STEP_GRID.view(-1, 1) * sigma.clamp_min(1e-12).view(1, -1) / m  # [G, D]
        level = torch.full_like(grid[:, None], float(m))
        recon = dequantize(quantize(sample[None], grid[:, None], level), grid[:, None], level)
        best = ((recon - sample[None]) ** 2).mean(1).argmin(0)  # [D]
        base[bits] = grid.gather(0, best.view(1, -1))[0]
        if bits == BITS[-1]:  # the near-lossless width never clips what calibration saw, with a margin
            base[bits] = torch.maximum(base[bits], _MARGIN * y.abs().amax(0) / m)
    for bits, scale in zip(OPTION_BITS[1:], OPTION_SCALE[1:]):
        m = torch.tensor(float(max_level(bits)))
        step = base[bits] * scale
        codes = quantize(y, step, m)
        errs.append(((dequantize(codes, step, m) - y) ** 2).mean(0))
        counts = torch.zeros(y.shape[1], 2 * int(m) + 1).scatter_add_(1, codes.T.long(), torch.ones(codes.T.shape))
        p = counts / counts.sum(1, keepdim=True)
        rates.append(-(p * torch.log2(p.clamp_min(1e-30))).sum(1))
        steps.append(step)
    return torch.stack(steps), torch.stack(errs), torch.stack(rates)


def fit(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """PCA per layer, KV head and kind, with the quantizer tables (see the module docstring)."""
    from sklearn.decomposition import PCA

    n_layers, _, n_heads, d = keys.shape
    out = {name: [] for name in ("basis", "mean", "variance", "step", "err", "rate")}
    for layer in range(n_layers):
        for head in range(n_heads):
            for x in (keys[layer, :, head], values[layer, :, head]):
                pca = PCA(n_components=d, svd_solver="full").fit(x.double().numpy())
                basis = torch.from_numpy(pca.components_).float()
                mean = torch.from_numpy(pca.mean_).float()
                y = (x - mean) @ basis.T
                step, err, rate = _quantizer_tables(y, y.std(0))
                for name, t in zip(out, (basis, mean, torch.from_numpy(pca.explained_variance_).float(),
                                         step, err, rate)):
                    out[name].append(t)
    return {name: torch.stack(ts).view(n_layers, n_heads, 2, *ts[0].shape) for name, ts in out.items()}


def calibrate(model, tokenizer, out: str | os.PathLike, text: str | None = None, tokens: int = 8192,
              seq_len: int | None = None, n_sink: int = 4, source: str = "stdlib docstrings",
              keys: str = "pre_rope") -> Path:
    """Fit and save a KVTC artifact for ``model``; returns its path. ``seq_len`` None: :func:`default_seq_len`."""
    from safetensors.torch import save_file

    from kvcomp import validation

    validation.choice("keys", keys, KEY_SPACES, owner="KVTC calibration")
    seq_len = default_seq_len(model, keys) if seq_len is None else seq_len
    validation.positive_int("tokens", tokens, owner="KVTC calibration", hint=" (calibration tokens, --tokens)")
    validation.non_negative_int("n_sink", n_sink, owner="KVTC calibration")
    validation.integer("seq_len", seq_len, n_sink + 1, owner="KVTC calibration",
                       hint=" (tokens per sequence, --seq-len; more than n_sink)")
    text = text if text is not None else default_text(num_words=tokens * 2)
    calibration_keys, values = collect(model, tokenizer, text, tokens, seq_len, n_sink, keys)
    head_dim = calibration_keys.shape[-1]
    if calibration_keys.shape[1] < head_dim:  # a full-rank PCA of a D-dimensional head needs D samples
        raise CompressorError(
            f"KVTC calibration got {calibration_keys.shape[1]} tokens past the {n_sink} sinks of each sequence; a {head_dim}-"
            f"dimensional head needs at least {head_dim}. Give more tokens (--tokens) or longer sequences (--seq-len)."
        )
    tensors = fit(calibration_keys, values)
    # Post-RoPE keys are never rotated: their artifact holds no RoPE (and needs none: any position encoding).
    inv_freq, scaling = rotary(model) if keys == "pre_rope" else (torch.zeros(0), 1.0)
    tensors.update(inv_freq=inv_freq, probe=weight_probe(model), option_bits=torch.tensor(OPTION_BITS),
                   option_scale=torch.tensor(OPTION_SCALE))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"format": FORMAT, "version": str(VERSION), **{k: str(v) for k, v in model_identity(model).items()},
            "attention_scaling": repr(scaling), "tokens": str(calibration_keys.shape[1]), "seq_len": str(seq_len),
            "n_sink": str(n_sink), "keys": keys, "data": source, "bits": ",".join(map(str, BITS)),
            "tensors_sha256": tensors_digest(tensors)}
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order (what ``calibrate`` records and
    :func:`load_artifact` checks: flipped bytes in a table decode garbage, silently, otherwise)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# -- loading -------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """A loaded artifact. basis ``[L, H, 2, D, D]`` (rows: components in variance order; index 2: keys,
    values), mean/variance ``[L, H, 2, D]``, step ``[L, H, 2, O - 1, D]`` (quantizer options 1..), err/rate
    ``[L, H, 2, O, D]`` (option 0, dropping the component, first), option_bits/option_scale ``[O]`` (stored
    width and step multiple of each option), inv_freq ``[D_rot / 2]``, probe ``[256]``."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]
    path: str
    digest: str = ""  # sha256 of the file (first 16 hex digits): which calibration a run used

    def __getattr__(self, name):
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(f"the KVTC artifact {self.__dict__.get('path')} has no tensor {name!r}") from None

    @property
    def attention_scaling(self) -> float:
        return float(self.meta["attention_scaling"])

    @property
    def keys(self) -> str:
        """The key space of the bases (:data:`KEY_SPACES`; artifacts written before it existed are pre-RoPE)."""
        return self.meta.get("keys", "pre_rope")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def check_model(self, model) -> None:
        """Raise CompressorError when this artifact was calibrated on another model."""
        ident = model_identity(model)
        for key in ("num_layers", "num_kv_heads", "head_dim", "config_hash"):
            if self.meta.get(key) != str(ident[key]):
                raise CompressorError(
                    f"The KVTC artifact {self.path} was calibrated on another model ({self.meta.get('model')}: "
                    f"{key}={self.meta.get(key)}, this model has {ident[key]}). Calibrate this one with: "
                    f"{CALIBRATE_COMMAND}"
                )
        if not torch.allclose(weight_probe(model), self.probe, rtol=1e-2, atol=1e-3):
            raise CompressorError(
                f"The KVTC artifact {self.path} was calibrated on a model with the same architecture but other "
                f"weights ({self.meta.get('model')}). Calibrate this one with: {CALIBRATE_COMMAND}"
            )
        if self.keys == "pre_rope":
            rotary(model)  # the RoPE KVTC undoes must be the model's (UnsupportedModel otherwise)


def is_current(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a KVTC artifact of the version this kvcomp reads (False for older ones)."""
    from safetensors import safe_open

    with safe_open(str(Path(path).expanduser()), framework="pt") as f:
        meta = f.metadata() or {}
    return meta.get("format") == FORMAT and meta.get("version") == str(VERSION)


def _check_tables(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Every table present, with the shapes the metadata implies, matching the recorded digest, and finite."""
    broken = f"Recalibrate with: {CALIBRATE_COMMAND}"
    missing = [name for name in REQUIRED_TENSORS if name not in tensors]
    if missing:
        raise CompressorError(f"The KVTC artifact {path} lacks the tensor{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(repr, missing))}: it is damaged or incomplete. {broken}")
    try:
        dims = (int(meta["num_layers"]), int(meta["num_kv_heads"]), 2)
        d, options = int(meta["head_dim"]), tensors["option_bits"].numel()
    except (KeyError, ValueError) as err:
        raise CompressorError(f"The KVTC artifact {path} has damaged metadata ({err}). {broken}") from None
    if meta.get("keys", "pre_rope") not in KEY_SPACES:
        raise CompressorError(f"The KVTC artifact {path} has damaged metadata (keys={meta.get('keys')!r}, not one "
                              f"of {', '.join(KEY_SPACES)}). {broken}")
    shapes = {"basis": (*dims, d, d), "mean": (*dims, d), "variance": (*dims, d), "step": (*dims, options - 1, d),
              "err": (*dims, options, d), "rate": (*dims, options, d), "option_scale": (options,)}
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise CompressorError(f"The KVTC artifact {path} is damaged: tensor {name!r} has shape "
                                  f"{tuple(tensors[name].shape)}, its metadata says {shape}. {broken}")
    recorded = meta.get("tensors_sha256")
    if recorded is None and meta.get("version") == str(VERSION):
        raise CompressorError(f"The KVTC artifact {path} has lost the digest of its tables from its metadata. {broken}")
    if recorded is not None and recorded != tensors_digest(tensors):
        raise CompressorError(f"The KVTC artifact {path} is corrupted: its tensors do not match the sha256 recorded "
                              f"when it was calibrated (changed bytes decode garbage). {broken}")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CompressorError(f"The KVTC artifact {path} has {bad} non-finite value{'s' if bad > 1 else ''} "
                                  f"(NaN or inf) in tensor {name!r}. {broken}")


def load_artifact(path: str | os.PathLike, model=None) -> Calibration:
    """Read a KVTC artifact (checked against ``model`` when given)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise CompressorError(f"No KVTC artifact at {path}. Create one with: {CALIBRATE_COMMAND}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CompressorError(f"{path} is not a KVTC artifact (format {meta.get('format')!r}).")
            if meta.get("version") not in READABLE_VERSIONS:
                raise CompressorError(
                    f"{path} is a version {meta.get('version')} KVTC artifact; this kvcomp reads versions "
                    f"{', '.join(READABLE_VERSIONS)}. Recalibrate with: {CALIBRATE_COMMAND}"
                )
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CompressorError(f"Cannot read the KVTC artifact {path} ({err}); it is damaged or not a safetensors "
                              f"file. Recalibrate with: {CALIBRATE_COMMAND}") from None
    _check_tables(path, tensors, meta)
    if "tensors_sha256" not in meta:
        import warnings

        warnings.warn(f"The KVTC artifact {path} (version {meta.get('version')}) carries no digest of its tables, so "
                      f"damage to them cannot be detected. Recalibrate with: {CALIBRATE_COMMAND}", stacklevel=2)
    cal = Calibration(tensors, meta, str(path), hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    if model is not None:
        cal.check_model(model)
    return cal


def allocation_budget(head_dim: int, dtype_bits: int, compression_factor: float) -> float:
    """Coded bits per token, KV head and kind for a target factor over the uncompressed cache dtype."""
    return head_dim * dtype_bits / compression_factor


class Allocation(NamedTuple):
    """Per-component choice for one layer, each ``[H, 2, D]`` (keys and values of each KV head): ``option``
    (index into the artifact's tables), ``bits`` (stored width, 0 for dropped) and ``step`` (0 for dropped)."""

    option: torch.Tensor
    bits: torch.Tensor
    step: torch.Tensor


def allocate(cal: Calibration, layer: int, dtype_bits: int, compression_factor: float, group_size: int) -> Allocation:
    """The DP's quantizer option per component of ``layer`` for a target factor."""
    from kvcomp.transform_coding import allocate_options

    err, rate = cal.err[layer].numpy(), cal.rate[layer].numpy()  # [H, 2, O, D]
    budget = allocation_budget(err.shape[-1], dtype_bits, compression_factor)
    option = torch.from_numpy(np.array([[allocate_options(err[h, kind], rate[h, kind], budget, group_size)
                                         for kind in range(2)] for h in range(err.shape[0])]))
    steps = torch.cat([torch.zeros_like(cal.step[layer][:, :, :1]), cal.step[layer]], dim=2)  # [H, 2, O, D]
    step = steps.gather(2, option.unsqueeze(2)).squeeze(2)
    return Allocation(option, cal.option_bits[option], step)
