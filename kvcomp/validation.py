"""Checks of settings, one small set shared by every compressor and entry point.

Each helper returns the value when it is acceptable and raises otherwise, naming the field, the value it
got and the accepted range, so a bad setting fails where it is given and never deep inside a tensor op:

    positive_int("window", self.window, none=True, owner=self)    # 1 .. MAX_TOKENS, or None
    fraction("budget_fraction", self.budget_fraction, low_open=True, owner=self)   # (0, 1]

Booleans are not numbers here (``budget=True`` would otherwise keep one token, ``tau=True`` be a cosine of
1), and a float is not an integer (``budget=1e20``). Integers are bounded by :data:`MAX_TOKENS`: positions are
below ``SENTINEL``, so no count of tokens can be larger, and a bigger one would overflow a tensor op.

Compressor fields raise :class:`kvcomp.compressor.CompressorError`; other inputs (a prompt, a run's sample
count, a context that does not fit the model) raise :class:`UsageError`. Both are ``ValueError`` s; with
:class:`ResourceError` (a full disk, a busy run directory) they are :data:`CLEAR_ERRORS`, which the
``kvcomp`` command prints as one line.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Iterable
from typing import Any

from kvcomp.compressor import SENTINEL, CompressorError

MAX_TOKENS = SENTINEL - 1


class UsageError(ValueError):
    """An input or setting outside a compressor that cannot work; the message says how to fix it."""


class ContextTooLong(UsageError):
    """A prompt plus its generation does not fit the model's context."""


class ResourceError(OSError):
    """Something kvcomp needs on this machine is not available (a full offload disk, a run directory another
    process is writing, an output path that is a symbolic link); the message says what to do. Raised as
    ``ResourceError(errno, message)``; ``str()`` is the message alone."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


# What the ``kvcomp`` command and ``experiments.run`` print as one line (exit status 2) instead of a traceback.
CLEAR_ERRORS = (CompressorError, UsageError, ResourceError)


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"{value!r} (a bool; booleans are not numbers here)"
    return repr(value)


def _fail(name: str, accepted: str, value: Any, owner: Any, hint: str, error: type[Exception]) -> None:
    prefix = "" if owner is None else f"{owner if isinstance(owner, str) else type(owner).__name__}: "
    raise error(f"{prefix}{name} must be {accepted}{hint}; got {_describe(value)}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(name: str, value: Any, low: int | None = None, high: int | None = MAX_TOKENS, *, none: bool = False,
            owner: Any = None, hint: str = "", error: type[Exception] = CompressorError) -> int | None:
    """An integer in ``[low, high]`` (None allowed with ``none``)."""
    if value is None and none:
        return None
    ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        span = f"{'-inf' if low is None else low} .. {'inf' if high is None else high}"
        _fail(name, f"an integer in {span}" + (" or None" if none else ""), value, owner, hint, error)
    return int(value)


def positive_int(name: str, value: Any, *, none: bool = False, high: int | None = MAX_TOKENS, owner: Any = None,
                 hint: str = "", error: type[Exception] = CompressorError) -> int | None:
    """An integer ``>= 1`` (and ``<= high``)."""
    if value is None and none:
        return None
    if not (_is_int(value) and value >= 1 and (high is None or value <= high)):
        bound = "" if high is None else f" (at most {high})"
        _fail(name, f"a positive integer{bound}" + (" or None" if none else ""), value, owner, hint, error)
    return int(value)


def non_negative_int(name: str, value: Any, *, none: bool = False, high: int | None = MAX_TOKENS,
                     owner: Any = None, hint: str = "", error: type[Exception] = CompressorError) -> int | None:
    """An integer ``>= 0`` (and ``<= high``)."""
    if value is None and none:
        return None
    if not (_is_int(value) and value >= 0 and (high is None or value <= high)):
        bound = "" if high is None else f" (at most {high})"
        _fail(name, f"a non-negative integer{bound}" + (" or None" if none else ""), value, owner, hint, error)
    return int(value)


def finite_float(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, none: bool = False, owner: Any = None,
                 hint: str = "", error: type[Exception] = CompressorError) -> float | None:
    """A finite real number (an int is accepted, a bool is not) in the interval given by ``low``/``high``
    (closed unless ``low_open``/``high_open``)."""
    if value is None and none:
        return None
    ok = _is_real(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is None and high is None:
            accepted = "a finite number"
        elif high is None:
            accepted = f"a finite number {'>' if low_open else '>='} {low:g}"
        elif low is None:
            accepted = f"a finite number {'<' if high_open else '<='} {high:g}"
        else:
            accepted = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        _fail(name, accepted + (" or None" if none else ""), value, owner, hint, error)
    return float(value)


def fraction(name: str, value: Any, *, low_open: bool = False, high_open: bool = False, none: bool = False,
             owner: Any = None, hint: str = "", error: type[Exception] = CompressorError) -> float | None:
    """A number in ``[0, 1]`` (ends excluded with ``low_open``/``high_open``)."""
    return finite_float(name, value, 0.0, 1.0, low_open=low_open, high_open=high_open, none=none, owner=owner,
                        hint=hint, error=error)


def boolean(name: str, value: Any, *, none: bool = False, owner: Any = None, hint: str = "",
            error: type[Exception] = CompressorError) -> bool | None:
    """``True`` or ``False`` (not a string such as ``"no"``, not 0/1); ``None`` too when ``none``."""
    if value is None and none:
        return value
    if not isinstance(value, bool):
        _fail(name, "True, False or None" if none else "True or False", value, owner, hint, error)
    return value


def choice(name: str, value: Any, options: Iterable[Any], *, owner: Any = None, hint: str = "",
           error: type[Exception] = CompressorError) -> Any:
    """One of ``options`` (compared by type too, so ``True`` is not ``1``)."""
    options = tuple(options)
    if not any(type(value) is type(o) and value == o for o in options):
        shown = ", ".join(repr(o) if isinstance(o, str) else str(o) for o in options)
        _fail(name, f"one of {shown}", value, owner, hint, error)
    return value


def path_or_none(name: str, value: Any, *, owner: Any = None, hint: str = "",
                 error: type[Exception] = CompressorError) -> str | os.PathLike | None:
    """None, or a non-empty str / ``os.PathLike``."""
    if value is None:
        return None
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value):
        return value
    _fail(name, "a path (a non-empty string) or None", value, owner, hint, error)
    return None


def check_context_length(model, needed_tokens: int, what: str, fix: str = "") -> None:
    """Raise :class:`ContextTooLong` when ``needed_tokens`` (prompt + generation) exceed the model's
    ``max_position_embeddings``: beyond it positions have no trained embedding and the output is garbage,
    silently. The one rule that ``kvcomp.generate`` and the evaluation runner share."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit and needed_tokens > limit:
        raise ContextTooLong(
            f"{what} need up to {needed_tokens} tokens (prompt + generation) but the model's context is {limit} "
            f"tokens; {fix or 'shorten the prompt or max_new_tokens, or use a model with a longer context.'}"
        )


def check_prompts(model, prompt_tokens: list[int], max_new_tokens: int) -> None:
    """Every prompt has a token and fits the model's context with its generation (``kvcomp.generate``)."""
    for i, n in enumerate(prompt_tokens):
        if n == 0:
            which = "the prompt" if len(prompt_tokens) == 1 else f"prompt {i + 1} of {len(prompt_tokens)}"
            raise UsageError(f"{which} is empty (no context, no question, no chat template): give a context or a "
                             "question, or chat_template=True for a model that has one.")
    check_context_length(model, max(prompt_tokens, default=0) + max_new_tokens, "The prompt and its generation",
                         "shorten the context or max_new_tokens, or use a model with a longer context.")


def warn_ignored_sampling(where: str, **flags: Any) -> None:
    """Warn that sampling settings are ignored because ``do_sample`` is False (greedy decoding), as transformers
    warns for its own ``generate``; ``flags`` are the settings the caller gave."""
    if flags:
        shown = ", ".join(f"{k}={v!r}" for k, v in flags.items())
        warnings.warn(f"{where}: do_sample=False, so {shown} {'is' if len(flags) == 1 else 'are'} ignored (greedy "
                      "decoding); pass do_sample=True to sample.", UserWarning, stacklevel=3)


def check_greedy_or_sampled(generation_config, model_defaults, where: str) -> None:
    """For a decoding loop that is greedy or sampled only (lossless ``custom_generate``): refuse beam search,
    which it would silently replace by greedy decoding, and warn about sampling flags given without
    ``do_sample`` (compared with the model's own ``generation_config``, so its defaults do not warn)."""
    beams = getattr(generation_config, "num_beams", None) or 1
    if beams > 1:
        raise CompressorError(f"{where} decodes greedily or by sampling, not by beam search; got num_beams={beams}. "
                              "Drop num_beams (or use plain model.generate without custom_generate for beams).")
    if getattr(generation_config, "do_sample", False):
        return
    flags = {}
    for name, neutral in (("temperature", (1.0,)), ("top_p", (1.0,)), ("top_k", (0, 50))):
        value = getattr(generation_config, name, None)
        if value is not None and value not in neutral and value != getattr(model_defaults, name, None):
            flags[name] = value
    warn_ignored_sampling(where, **flags)
