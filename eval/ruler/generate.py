"""Sample generation for the 13 RULER tasks, sized in the tokens of the model's own tokenizer.

How a sample is laid out
------------------------
RULER renders ``template + answer_prefix`` (``base`` model template, no chat template) and gives the
model everything up to and including the answer prefix. Here that text is cut into three strings::

    sample.context        = <instruction text> + <haystack>      (template up to and including {context})
    sample.question       = <rest of the template, query filled>  (starts with "\\n", or "\\n\\n" for QA)
    sample.answer_prefix  = RULER's answer prefix, filled          (starts with a space)

    sample.prompt     == sample.context + sample.question       (plain concatenation, nothing in between)
    sample.full_input == sample.prompt + sample.answer_prefix   (RULER's model input for a base model)

For ``vt`` and ``cwe`` RULER puts one solved example of the task (a few-shot demonstration) in front of
the instruction; it is part of ``context``. A chat model would get ``prompt`` as the user turn and
``answer_prefix`` at the start of its own turn.

How long a sample is
--------------------
``length`` is the total sequence length in tokens of ``tokenizer``, generation included, as RULER's
``max_seq_length``. The haystack size (sentences, words, list entries or documents, by task) is the
largest one for which::

    len(tokenizer.encode(sample.full_input, add_special_tokens=False)) + max_new_tokens + reserve_tokens <= length

found by interpolation then bisection, separately for each sample. ``sample.length_tokens`` is that
measured token count of ``full_input``; ``max_new_tokens`` is the task's RULER generation cap.
``reserve_tokens`` (option, default 0) leaves room for a chat template (RULER's ``model_template_token``).

Determinism
-----------
Every random draw of sample ``i`` comes from ``random.Random(f"kvcomp.ruler/{task}/{seed}/{i}")`` (and
sub-streams of it), so the same (task, seed, length, tokenizer, options) gives identical samples in any
process, and other seeds give other needles, chains, words and questions. The needles of a sample do not
depend on ``length``; only the haystack around them grows. The ``essay`` haystack comes from text that
ships with Python and so can differ slightly between Python versions (see :mod:`eval.ruler.haystack`).

Options (``**options``)
-----------------------
``essay_file``      a local prose file for ``essay`` haystacks (plain text, or RULER's PaulGrahamEssays.json).
``squad_file``      SQuAD v2 dev json for ``qa_1``;  ``hotpotqa_file``: HotpotQA dev distractor json for ``qa_2``.
``allow_download``  let ``qa_1``/``qa_2`` fetch their data with ``datasets`` when no file is given.
``reserve_tokens``  tokens kept free for a chat template (default 0).
``tokens_to_generate``  override the task's generation cap.
Task arguments of ``TASKS[task].args`` (``num_needle_k``, ``type_haystack``, ``num_hops``, ``freq_cw``,
``alpha``, ...) override the task's configuration; task arguments of other tasks are ignored, so one
option dict can serve all 13 tasks. Unknown option names raise ``TypeError``.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import haystack as hs
from .qa import load_qa_data
from .tasks import TASKS, TaskSpec

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
"""RULER's needle sentence (``type_needle_v`` stays plural here, as in RULER)."""

DEPTHS = [round(100 * i / 39) for i in range(40)]
"""The 40 insertion depths (percent of the essay's sentences) that RULER samples needles at."""

DOCUMENT = "Document {i}:\n{document}"

VT_ICL_TOKENS = 500
"""Token budget of the solved variable-tracking example put in front of each ``vt`` sample (as RULER)."""

_GENERAL_OPTIONS = {
    "essay_file",
    "squad_file",
    "hotpotqa_file",
    "allow_download",
    "reserve_tokens",
    "tokens_to_generate",
}
_TASK_ARGS = {k for spec in TASKS.values() for k in spec.args}


@dataclass
class RulerSample:
    """One RULER sample. ``prompt == context + question``; see the module docstring for the layout."""

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    outputs: list[str]
    length_tokens: int
    max_new_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The task input without the answer prefix: ``context + question``."""
        return self.context + self.question

    @property
    def full_input(self) -> str:
        """What RULER feeds a base model: ``prompt + answer_prefix``; ``length_tokens`` counts this."""
        return self.prompt + self.answer_prefix


class WhitespaceTokenizer:
    """A stand-in tokenizer that counts whitespace-separated words (for fast tests and dry runs)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())


class _Parts(NamedTuple):
    context: str
    question: str
    answer_prefix: str
    outputs: list[str]
    metadata: dict[str, Any]

    @property
    def full_input(self) -> str:
        return self.context + self.question + self.answer_prefix


class _Unbuildable(Exception):
    """A haystack size that cannot be built (e.g. more distinct words than the word pool holds)."""


@dataclass
class _Ctx:
    spec: TaskSpec
    args: dict[str, Any]
    opts: dict[str, Any]
    count: Callable[[str], int]
    length: int
    budget: int
    seed: int

    def rng(self, index: int, stream: str = "") -> random.Random:
        return random.Random(f"kvcomp.ruler/{self.spec.name}/{self.seed}/{index}{stream}")


# A family returns (build(n) -> _Parts, n_min, n_max or None, unit name).
_Family = tuple[Callable[[int], _Parts], int, "int | None", str]


def _token_counter(tokenizer) -> Callable[[str], int]:
    try:
        tokenizer.encode("probe", add_special_tokens=False)
    except TypeError:
        return lambda text: len(tokenizer.encode(text))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------------------------- needles
def _random_needle(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(hs.adjectives())}-{rng.choice(hs.nouns())}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r} is not one of 'words', 'numbers', 'uuids'")


def _distinct(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        x = _random_needle(rng, kind)
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def _insert_into_essay(sentences: list[str], items: list[str], rng: random.Random) -> str:
    """Put ``items`` (in order) between essay sentences at distinct random RULER depths."""
    if len(items) > len(DEPTHS):
        raise ValueError(f"at most {len(DEPTHS)} insertions fit the essay depths, got {len(items)}")
    cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(items)))
    pieces, last = [], 0
    for cut, item in zip(cuts, items, strict=True):
        pieces.append(" ".join(sentences[last:cut]))
        pieces.append(item)
        last = cut
    pieces.append(" ".join(sentences[last:]))
    return " ".join(p for p in pieces if p)


def _depths(context: str, outputs: list[str]) -> list[float]:
    return [round(context.find(o) / max(1, len(context)), 4) for o in outputs]


# -------------------------------------------------------------------------------------------------- NIAH
def _singular(text: str) -> str:
    # RULER's wording for a single expected value.
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is")


def _niah(ctx: _Ctx, index: int) -> _Family:
    a = ctx.args
    kind_k, kind_v, hay = a["type_needle_k"], a["type_needle_v"], a["type_haystack"]
    num_q, num_v = a["num_needle_q"], a["num_needle_v"]
    num_k = max(a["num_needle_k"], num_q)
    if hay not in ("noise", "essay", "needle"):
        raise ValueError(f"type_haystack {hay!r} is not one of 'noise', 'essay', 'needle'")
    if min(num_q, num_v, num_k) < 1:
        raise ValueError("num_needle_k, num_needle_v and num_needle_q must be >= 1")
    rng = ctx.rng(index)
    taken: set[str] = set()
    keys = _distinct(rng, kind_k, num_k, taken)
    values = [_distinct(rng, kind_v, num_v, taken) for _ in keys]
    needles = [
        NEEDLE.format(type_needle_v=kind_v, key=k, value=v)
        for k, vs in zip(keys, values, strict=True)
        for v in vs
    ]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    outputs = [v for i in asked for v in values[i]]
    query = queries[0] if num_q == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]

    ctx_t, q_t = ctx.spec.split_template()
    prefix_t = ctx.spec.answer_prefix
    v_word = kind_v
    if num_q * num_v == 1:
        ctx_t, q_t, prefix_t = _singular(ctx_t), _singular(q_t), _singular(prefix_t)
        v_word = kind_v[:-1]
    head = ctx_t.replace("{type_needle_v}", v_word)
    question = q_t.format(type_needle_v=v_word, query=query)
    answer_prefix = prefix_t.format(type_needle_v=v_word, query=query)
    place_seed = rng.getrandbits(64)

    distractor_rng = ctx.rng(index, "/distractors")
    distractors: list[str] = []

    def build(n: int) -> _Parts:
        place = random.Random(place_seed)
        if hay == "essay":
            sentences = hs.split_sentences(" ".join(hs.essay_words(n, ctx.opts.get("essay_file"))))
            body = _insert_into_essay(sentences, needles, place)
        else:
            if hay == "noise":
                lines = [hs.NOISE] * n
            else:
                while len(distractors) < n:
                    k, v = (
                        _distinct(distractor_rng, kind_k, 1, taken)[0],
                        _distinct(distractor_rng, kind_v, 1, taken)[0],
                    )
                    distractors.append(NEEDLE.format(type_needle_v=kind_v, key=k, value=v))
                lines = distractors[:n]
            for pos, needle in zip(
                sorted(place.sample(range(n), len(needles)), reverse=True), needles, strict=True
            ):
                lines.insert(pos, needle)
            body = "\n".join(lines)
        context = head.replace("{context}", body)
        meta = {"answer_depths": _depths(context, outputs), "queries": queries}
        return _Parts(context, question, answer_prefix, list(outputs), meta)

    if hay == "essay":
        return build, 1, None, "essay words"
    return build, len(needles), None, "haystack lines" if hay == "noise" else "distractor needles"


# ------------------------------------------------------------------------------------- variable tracking
def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int) -> tuple[list, list]:
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    groups, chains = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        value = str(rng.randint(10000, 99999))
        groups.append(vs)
        chains.append(
            [f"VAR {vs[0]} = {value}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(num_hops)]
        )
    return groups, chains


def _interleave(chains: list[list[str]], rng: random.Random) -> list[str]:
    """Merge several chains in random order while keeping each chain's own order."""
    pending = [list(c) for c in chains]
    out = []
    while any(pending):
        pick = rng.choice([i for i, c in enumerate(pending) if c])
        out.append(pending[pick].pop(0))
    return out


def _vt_builder(ctx: _Ctx, rng: random.Random, num_chains: int, num_hops: int, name_len: int, prefix: str):
    hay = ctx.args["type_haystack"]
    if hay not in ("noise", "essay"):
        raise ValueError(f"type_haystack {hay!r} is not one of 'noise', 'essay' for variable tracking")
    if num_chains < 1 or num_hops < 1:
        raise ValueError("num_chains and num_hops must be >= 1")
    groups, chains = _vt_chains(rng, num_chains, num_hops, name_len)
    value = chains[0][0].split("=")[-1].strip()
    ctx_t, q_t = ctx.spec.split_template()
    question = q_t.format(query=value)
    answer_prefix = ctx.spec.answer_prefix.format(num_v=num_hops + 1, query=value)
    place_seed = rng.getrandbits(64)

    def build(n: int) -> _Parts:
        place = random.Random(place_seed)
        if hay == "noise":
            lines = [hs.NOISE] * n
            for chain in chains:
                for j, pos in enumerate(sorted(place.sample(range(len(lines)), len(chain)))):
                    lines.insert(pos + j, chain[j])
            body = "\n".join(lines)
        else:
            sentences = hs.split_sentences(" ".join(hs.essay_words(n, ctx.opts.get("essay_file"))))
            body = _insert_into_essay(sentences, [s + "." for s in _interleave(chains, place)], place)
        context = prefix + ctx_t.format(context=body)
        meta = {"answer_depths": _depths(context, [f"VAR {v} =" for v in groups[0]])}
        return _Parts(context, question, answer_prefix, list(groups[0]), meta)

    n_min = (num_hops + 1) if hay == "noise" else 1
    return build, n_min, "haystack lines" if hay == "noise" else "essay words"


def _vt(ctx: _Ctx, index: int) -> _Family:
    a = ctx.args
    # The solved example: 3-letter names, at most 10 hops, fitted to VT_ICL_TOKENS with no generation room.
    icl_budget = min(VT_ICL_TOKENS, ctx.budget // 2)
    icl_build, icl_min, _ = _vt_builder(
        ctx, ctx.rng(index, "/icl"), a["num_chains"], min(10, a["num_hops"]), 3, ""
    )
    icl_n = _largest_fitting(
        lambda n: ctx.count(icl_build(n).full_input), icl_budget, icl_min, None, None, "vt example"
    )
    icl = icl_build(icl_n)
    example = icl.full_input + " ".join(icl.outputs) + "\n\n"
    build, n_min, unit = _vt_builder(ctx, ctx.rng(index), a["num_chains"], a["num_hops"], 5, example)
    return build, n_min, None, unit


# ------------------------------------------------------------------------------ common words extraction
def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe(ctx: _Ctx, index: int) -> _Family:
    a = ctx.args
    num_cw = a["num_cw"]
    if ctx.length < 4096:  # RULER's settings for short inputs
        ex_size, ex_cw, ex_ucw, cw, ucw = 20, 3, 1, 6, 1
    else:
        ex_size, ex_cw, ex_ucw, cw, ucw = 40, 10, 3, a["freq_cw"], a["freq_ucw"]
    if not (num_cw >= 1 and cw > ucw >= 1):
        raise ValueError("cwe needs num_cw >= 1 and freq_cw > freq_ucw >= 1")
    ctx_t, q_t = ctx.spec.split_template()
    question = q_t.format(num_cw=num_cw)
    answer_prefix = ctx.spec.answer_prefix.format(num_cw=num_cw)
    rng = ctx.rng(index)

    def word_list(r: random.Random, n: int, n_cw: int, n_ucw: int) -> tuple[list[str], list[str]]:
        pool = hs.common_word_pool()
        if n > len(pool):
            pool = hs.extended_word_pool()
            if n > len(pool):
                raise _Unbuildable(f"only {len(pool)} distinct words are available")
        words = r.sample(pool, n)
        common = words[:num_cw]
        entries = common * n_cw + words[num_cw:] * n_ucw
        r.shuffle(entries)
        return entries, common

    ex_entries, ex_common = word_list(rng, max(ex_size, num_cw), ex_cw, ex_ucw)
    example = (
        ctx_t.format(context=_numbered(ex_entries)) + question + answer_prefix + " " + _numbered(ex_common)
    )
    main_seed = rng.getrandbits(64)

    def build(n: int) -> _Parts:
        entries, common = word_list(random.Random(main_seed), n, cw, ucw)
        context = example + "\n" + ctx_t.format(context=_numbered(entries))
        return _Parts(context, question, answer_prefix, common, {"repeats": [cw, ucw]})

    return build, num_cw, None, "distinct words"


# ---------------------------------------------------------------------------- frequent words extraction
def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin tail after 1000 terms; error far below 1e-12)."""
    if s <= 1:
        raise ValueError("fwe needs alpha > 1")
    n = 1000
    head = math.fsum(k**-s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12


def _fwe(ctx: _Ctx, index: int) -> _Family:
    a = ctx.args
    alpha, wordlen = float(a["alpha"]), int(a["coded_wordlen"])
    vocab_size = int(a["vocab_size"]) if a["vocab_size"] and a["vocab_size"] > 0 else ctx.budget // 50
    if vocab_size < 5:
        raise ValueError(
            f"fwe needs a vocabulary of at least 5 coded words, got {vocab_size} (length too small?)"
        )
    rng = ctx.rng(index)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent "word" is noise, as in RULER
    z = _zeta(alpha)
    shares = [k**-alpha / z for k in range(1, vocab_size + 1)]
    # Smallest text in which ranks 2..4 (the answers) are strictly more frequent than every other coded word.
    n_min = math.ceil(1 / (shares[3] - shares[4])) + 1
    ctx_t, q_t = ctx.spec.split_template()
    shuffle_seed = rng.getrandbits(64)

    def build(n: int) -> _Parts:
        words = [w for w, share in zip(ranked, shares, strict=True) for _ in range(int(n * share))]
        random.Random(shuffle_seed).shuffle(words)
        context = ctx_t.format(context=" ".join(words))
        return _Parts(context, q_t, ctx.spec.answer_prefix, ranked[1:4], {"vocab_size": vocab_size})

    return build, n_min, None, "coded words"


# -------------------------------------------------------------------------------------------------- QA
def _qa_family(ctx: _Ctx, index: int, data, order: list[int]) -> _Family:
    item = data.items[order[index % len(order)]]
    rng = ctx.rng(index)
    gold, related = list(item.gold), list(item.related)
    rng.shuffle(related)
    excluded = set(gold) | set(related)
    others = [i for i in range(len(data.docs)) if i not in excluded]
    rng.shuffle(others)
    fillers = related + others
    order_seed = rng.getrandbits(64)
    ctx_t, q_t = ctx.spec.split_template()
    question = q_t.format(query=item.question)

    def build(n: int) -> _Parts:
        extra = n - len(gold)
        chosen = gold + [fillers[i % len(fillers)] for i in range(extra)] if fillers else list(gold)
        random.Random(order_seed).shuffle(chosen)
        docs = "\n\n".join(DOCUMENT.format(i=i + 1, document=data.docs[d]) for i, d in enumerate(chosen))
        meta = {"gold_documents": [data.docs[g] for g in gold], "num_documents": len(chosen)}
        return _Parts(ctx_t.format(context=docs), question, ctx.spec.answer_prefix, list(item.answers), meta)

    return build, len(gold), (None if fillers else len(gold)), "documents"


# ---------------------------------------------------------------------------------------------- search
def _largest_fitting(
    measure: Callable[[int], int], budget: int, n_min: int, n_max: int | None, guess: int | None, what: str
) -> int:
    """Largest ``n`` in ``[n_min, n_max]`` with ``measure(n) <= budget`` (``measure`` is near-monotone).

    Every value returned was measured to fit; sizes that cannot be built count as too large.
    """
    cache: dict[int, float] = {}

    def tokens(n: int) -> float:
        if n not in cache:
            try:
                cache[n] = measure(n)
            except _Unbuildable:
                cache[n] = math.inf
        return cache[n]

    def clamp(n: int) -> int:
        n = max(n_min, n)
        return n if n_max is None else min(n, n_max)

    t_min = tokens(n_min)
    if t_min > budget:
        raise ValueError(
            f"{what}: the smallest haystack already needs {t_min} tokens, over the budget of {budget}"
        )
    if n_max is not None and n_max <= n_min:
        return n_min
    if guess is None:  # two interpolation steps from the smallest size
        probe = clamp(n_min + max(8, n_min))
        for _ in range(2):
            t = tokens(probe)
            if probe == n_min or not math.isfinite(t) or t <= t_min:
                probe = clamp(probe * 2)
                continue
            probe = clamp(n_min + int((budget - t_min) * (probe - n_min) / (t - t_min)))
        guess = probe
    guess = clamp(guess)
    step = max(1, guess // 200)
    if tokens(guess) <= budget:
        lo, hi = guess, None
        while hi is None:
            if n_max is not None and lo >= n_max:
                return lo
            n = clamp(lo + step)
            if tokens(n) <= budget:
                lo, step = n, step * 2
            else:
                hi = n
    else:
        hi = guess
        while True:
            n = max(n_min, hi - step)
            if n == n_min or tokens(n) <= budget:
                lo = n
                break
            hi, step = n, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


_FAMILIES = {
    "niah": _niah,
    "variable_tracking": _vt,
    "common_words_extraction": _cwe,
    "freq_words_extraction": _fwe,
}


def generate_samples(
    task: str, tokenizer, length: int, num_samples: int, seed: int = 0, **options
) -> list[RulerSample]:
    """Generate ``num_samples`` RULER samples of ``task`` whose input plus generation fits ``length`` tokens.

    ``tokenizer`` is anything with ``encode(text, add_special_tokens=False)`` (a Hugging Face tokenizer, or
    :class:`WhitespaceTokenizer`). See the module docstring for the sample layout, the length rule, the
    seeding and the options. Raises :class:`TaskDataUnavailable` for ``qa_1``/``qa_2`` without their data,
    ``ValueError`` when ``length`` is too small for the task, ``KeyError`` for an unknown task.
    """
    if task not in TASKS:
        raise KeyError(f"unknown RULER task {task!r}; known: {list(TASKS)}")
    unknown = set(options) - _GENERAL_OPTIONS - _TASK_ARGS
    if unknown:
        raise TypeError(
            f"unknown option(s) {sorted(unknown)}; known: {sorted(_GENERAL_OPTIONS | _TASK_ARGS)}"
        )
    if num_samples < 0:
        raise ValueError("num_samples must be >= 0")
    spec = TASKS[task]
    args = {k: options.get(k, v) for k, v in spec.args.items()}
    cap = (
        spec.tokens_to_generate
        if options.get("tokens_to_generate") is None
        else int(options["tokens_to_generate"])
    )
    reserve = int(options.get("reserve_tokens") or 0)
    budget = length - cap - reserve

    if spec.kind == "qa":
        option = "squad_file" if args["dataset"] == "squad" else "hotpotqa_file"
        data = load_qa_data(task, args["dataset"], options.get(option), bool(options.get("allow_download")))
        order = random.Random(f"kvcomp.ruler/{task}/{seed}/questions").sample(
            range(len(data.items)), len(data.items)
        )

        def family(c: _Ctx, i: int) -> _Family:
            return _qa_family(c, i, data, order)
    else:
        family = _FAMILIES[spec.kind]

    ctx = _Ctx(spec, args, options, _token_counter(tokenizer), length, budget, seed)
    samples, guess = [], None
    for index in range(num_samples):
        build, n_min, n_max, unit = family(ctx, index)
        n = _largest_fitting(
            lambda k, build=build: ctx.count(build(k).full_input),
            budget,
            n_min,
            n_max,
            guess,
            f"{task} at length {length}",
        )
        guess = n
        parts = build(n)
        measured = ctx.count(parts.full_input)
        assert measured <= budget, (measured, budget)
        meta = {"seed": seed, "haystack_size": n, "haystack_unit": unit, **parts.metadata}
        samples.append(
            RulerSample(
                task,
                index,
                parts.context,
                parts.question,
                parts.answer_prefix,
                parts.outputs,
                measured,
                cap,
                meta,
            )
        )
    return samples
