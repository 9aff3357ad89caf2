"""Calibration of retrieval and streaming heads (DuoAttention-style): which KV heads need the whole context.

``calibrate(model, tokenizer, out)`` (CLI: ``kvcomp calibrate heads --model ...``) runs the model over synthetic
passkey prompts made here (no data set, no download): a haystack of fixed noise sentences, one needle "The
special magic number for WORD is: NNNNNNN." at a random depth, the question, and the answer itself, so the
answer's queries are those of a model retrieving the needle (teacher forcing). For every layer and KV head it
measures what a streaming head (the first ``n_sink`` tokens and the last ``recent``) would change: the relative
squared error of the attention output of the answer queries, ``||o_full - o_stream||^2 / ||o_full||^2``, averaged
over the query group, the answer tokens and the samples (DuoAttention trains a gate to minimise this
deviation; this measures it directly). High scores are retrieval heads; the lowest are made streaming.

The artifact (safetensors) holds ``head_scores`` ``[L, H_kv]`` and the model's weight probe; its metadata name
the format and version, the model identity (layer/head counts and config hash, as KVTC's artifact), the
settings and data, and a sha256 of the tensors, all checked on load.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcomp import steps
from kvcomp.compressor import CompressorError
from kvcomp.kvtc_calibration import model_identity, tensors_digest, weight_probe

FORMAT = "kvcomp-heads"
VERSION = "1"
CALIBRATE_COMMAND = "kvcomp calibrate heads --model <name or path> --out <artifact.safetensors>"
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_WORDS = ["apple", "river", "copper", "lantern", "meadow", "violet", "harbor", "falcon", "marble", "cedar",
          "ember", "glacier", "orchid", "quartz", "saffron", "thistle"]


def default_artifact_path(model) -> Path:
    from kvcomp.files import cache_dir

    return cache_dir() / "heads" / f"heads-{model_identity(model)['config_hash']}.safetensors"


def synthetic_samples(tokenizer, n: int, length: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` passkey prompts of about ``length`` tokens: ``(ids, answer_tokens)``, the answer at the end."""
    rng = random.Random(seed)
    noise = tokenizer(_NOISE, add_special_tokens=False)["input_ids"]
    samples = []
    for _ in range(n):
        word, number = rng.choice(_WORDS), str(rng.randrange(10**6, 10**7))
        needle = tokenizer(f" The special magic number for {word} is: {number}. ", add_special_tokens=False)["input_ids"]
        question = tokenizer(f"\nWhat is the special magic number for {word}? The special magic number for {word} "
                             "is:", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {number}", add_special_tokens=False)["input_ids"]
        fill = max(1, length - len(needle) - len(question) - len(answer))
        haystack = (noise * (fill // len(noise) + 1))[:fill]
        depth = rng.randrange(0, fill)
        samples.append((haystack[:depth] + needle + haystack[depth:] + question + answer, len(answer)))
    return samples


@torch.inference_mode()
def head_scores(model, samples, n_sink: int, recent: int) -> torch.Tensor:
    """``[L, H_kv]`` mean relative output error of streaming attention on the answer queries."""
    from kvcomp.cache import CompressedCache
    from kvcomp.ops import dense_attention, visible
    from kvcomp.shared_prefill import _Recorder

    total = None
    for ids, n_answer in samples:
        recorder = _Recorder()
        cache = CompressedCache(model, recorder)
        steps.forward(model, cache, torch.tensor([ids], device=model.device))
        rows = []
        for layer in sorted(recorder.records):
            q, k, v, ctx = recorder.records[layer]
            q, q_pos = q[:, :, -n_answer - 1:-1], ctx.query_positions[:, -n_answer - 1:-1]  # queries that predict the answer
            full, _ = dense_attention(q, k, v, q_pos, ctx.positions, ctx.spec)
            # A streaming head: sinks and the recent window only (positions outside both made empty).
            near = visible(q_pos[:, -1].view(-1, 1, 1), ctx.positions, recent + n_answer) | (ctx.positions < n_sink)
            stream_pos = ctx.positions.masked_fill(~near, 2**30)
            stream, _ = dense_attention(q, k, v, q_pos, stream_pos, ctx.spec)
            b, hq, n, d = q.shape
            hkv = k.shape[1]
            err = ((full - stream) ** 2).sum(-1) / (full**2).sum(-1).clamp_min(1e-12)  # [B, H_q, n]
            rows.append(err.view(b, hkv, hq // hkv, n).mean(dim=(0, 2, 3)).float().cpu())
        scores = torch.stack(rows)
        total = scores if total is None else total + scores
    return total / len(samples)


def calibrate(model, tokenizer, out, samples: int = 8, length: int = 1024, n_sink: int = 4, recent: int = 64,
              seed: int = 0) -> Path:
    """Measure and save the head pattern of ``model``; returns the artifact path."""
    from safetensors.torch import save_file

    from kvcomp import validation

    validation.positive_int("samples", samples, owner="heads calibration")
    validation.integer("length", length, 64, owner="heads calibration", hint=" tokens per prompt")
    validation.non_negative_int("n_sink", n_sink, owner="heads calibration")
    validation.positive_int("recent", recent, owner="heads calibration")
    scores = head_scores(model, synthetic_samples(tokenizer, samples, length, seed), n_sink, recent)
    tensors = {"head_scores": scores.contiguous(), "probe": weight_probe(model)}
    meta = {"format": FORMAT, "version": VERSION, **{k: str(v) for k, v in model_identity(model).items()},
            "samples": str(samples), "length": str(length), "n_sink": str(n_sink), "recent": str(recent),
            "seed": str(seed), "data": "synthetic passkey prompts (kvcomp.head_calibration)",
            "tensors_sha256": tensors_digest(tensors)}
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return out


@dataclass
class HeadPattern:
    """A loaded artifact: ``head_scores`` ``[L, H_kv]`` (higher: more of a retrieval head)."""

    head_scores: torch.Tensor
    meta: dict[str, str]
    path: str
    digest: str

    def streaming(self, fraction: float) -> torch.Tensor:
        """``[L, H_kv]`` bool: the ``round(fraction * L * H_kv)`` heads with the lowest scores (over all layers)."""
        flat = self.head_scores.reshape(-1)
        n = round(fraction * flat.numel())
        mask = torch.zeros(flat.numel(), dtype=torch.bool)
        if n:
            mask[flat.argsort()[:n]] = True
        return mask.view_as(self.head_scores)

    def check_model(self, model) -> None:
        ident = model_identity(model)
        for key in ("num_layers", "num_kv_heads", "head_dim", "config_hash"):
            if self.meta.get(key) != str(ident[key]):
                raise CompressorError(
                    f"The head pattern {self.path} was calibrated on another model ({self.meta.get('model')}: "
                    f"{key}={self.meta.get(key)}, this model has {ident[key]}). Calibrate this one with: "
                    f"{CALIBRATE_COMMAND}")
        if not torch.allclose(weight_probe(model), self.probe, rtol=1e-2, atol=1e-3):
            raise CompressorError(f"The head pattern {self.path} was calibrated on other weights of this architecture "
                                  f"({self.meta.get('model')}). Calibrate this one with: {CALIBRATE_COMMAND}")

    probe: torch.Tensor | None = None


def load_artifact(path) -> HeadPattern:
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise CompressorError(f"No head pattern at {path}. Create one with: {CALIBRATE_COMMAND}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CompressorError(f"Cannot read the head pattern {path} ({err}). Recalibrate with: {CALIBRATE_COMMAND}") from None
    if meta.get("format") != FORMAT:
        raise CompressorError(f"{path} is not a head pattern (format {meta.get('format')!r}).")
    if meta.get("version") != VERSION:
        raise CompressorError(f"{path} is a version {meta.get('version')} head pattern; this kvcomp reads version "
                              f"{VERSION}. Recalibrate with: {CALIBRATE_COMMAND}")
    if set(tensors) != {"head_scores", "probe"} or meta.get("tensors_sha256") != tensors_digest(tensors):
        raise CompressorError(f"The head pattern {path} is damaged (its tensors do not match the sha256 recorded "
                              f"when it was calibrated). Recalibrate with: {CALIBRATE_COMMAND}")
    shape = (int(meta["num_layers"]), int(meta["num_kv_heads"]))
    if tuple(tensors["head_scores"].shape) != shape or not bool(torch.isfinite(tensors["head_scores"]).all()):
        raise CompressorError(f"The head pattern {path} is damaged (head_scores {tuple(tensors['head_scores'].shape)}, "
                              f"expected {shape}, finite). Recalibrate with: {CALIBRATE_COMMAND}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return HeadPattern(tensors["head_scores"], meta, str(path), digest, tensors["probe"])
