"""Haystack material that needs no download: the noise sentence, offline English prose, word lists.

Essay prose
-----------
RULER fills its ``essay`` haystacks with Paul Graham's essays. Those must be downloaded, so the default
here is English prose that ships with every CPython install:

1. the Python Language Reference topics in ``pydoc_data.topics`` (the text behind ``help("class")``,
   roughly 27k words once cleaned), topics in sorted order; then, only when a haystack needs more words,
2. the docstrings of the standard-library modules, read with :mod:`ast` from the ``.py`` sources
   (no import), files in sorted path order, module/class/function docstrings in source order.

Both are cleaned to plain prose paragraphs: headings, indented blocks (code, grammar, notes), short
fragments, version notes and paragraphs that do not end like a sentence are dropped, footnote marks are
removed and whitespace is collapsed. The text is deterministic for a given Python version (the reference
text differs a little between Python releases). Past the end of all of it the words repeat from the
start, as RULER repeats its essays.

``essay_file=`` replaces all of this with a local file: plain text, or RULER's ``PaulGrahamEssays.json``
(a JSON object whose ``"text"`` field holds the prose).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import re
import sysconfig
from pathlib import Path

from . import _wordlists

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's ``noise`` haystack sentence."""

_UNDERLINE = re.compile(r"^[*=\-~^\"#+]{3,}$")
_FOOTNOTE = re.compile(r"\s*\[\d+\]")
_SENTENCE_END = re.compile(r"[.!?][\"'”’)]*$")
_VERSION_NOTE = re.compile(r"^(Changed|Added|New|Deprecated|Removed) in version")
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
}


def prose_paragraphs(text: str) -> list[str]:
    """Cut reStructuredText-like documentation into plain prose paragraphs (see the module docstring)."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [line.rstrip() for line in block.split("\n")]
        while lines and not lines[0].strip():
            lines.pop(0)
        if len(lines) >= 2 and _UNDERLINE.match(lines[1].strip()):
            lines = lines[2:]  # a heading glued to the paragraph below it
        if not lines or any(line[:1].isspace() for line in lines if line):
            continue  # indented: code, grammar rules, notes, lists
        para = _FOOTNOTE.sub("", " ".join(line.strip() for line in lines))
        para = re.sub(r"\s+", " ", para).strip()
        if len(para.split()) < 8 or not _SENTENCE_END.search(para):
            continue
        if _VERSION_NOTE.match(para) or "::=" in para or ">>>" in para:
            continue
        out.append(para)
    return out


def _reference_topics_prose() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed Python without pydoc_data: the docstrings alone will do
        return []
    return [p for key in sorted(topics) for p in prose_paragraphs(topics[key])]


def _stdlib_docstring_prose() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    paragraphs = []
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    paragraphs.extend(prose_paragraphs(inspect.cleandoc(doc)))
    return paragraphs


@functools.lru_cache(maxsize=4)
def _default_essay_words(part: int) -> tuple[str, ...]:
    if part == 0:
        return tuple(" ".join(_reference_topics_prose()).split())
    return _default_essay_words(0) + tuple(" ".join(_stdlib_docstring_prose()).split())


@functools.lru_cache(maxsize=8)
def _file_essay_words(path: str) -> tuple[str, ...]:
    raw = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        data = json.loads(raw)
        raw = data["text"] if isinstance(data, dict) else " ".join(str(x) for x in data)
    words = tuple(raw.split())
    if not words:
        raise ValueError(f"essay file {path} holds no text")
    return words


def essay_words(num_words: int, essay_file: str | os.PathLike | None = None) -> list[str]:
    """The first ``num_words`` words of the essay haystack, repeating the corpus when it is too short."""
    if essay_file is not None:
        corpus = _file_essay_words(str(Path(essay_file).expanduser().resolve()))
    else:
        corpus = _default_essay_words(0)
        if num_words > len(corpus):
            corpus = _default_essay_words(1)
        if not corpus:
            raise RuntimeError("no offline prose found in this Python install; pass essay_file=")
    if num_words <= len(corpus):
        return list(corpus[:num_words])
    reps = -(-num_words // len(corpus))
    return list((corpus * reps)[:num_words])


_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])[\"'”’)]*\s+(?=[\"'“‘(]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences at ``.``/``!``/``?`` followed by a capital or digit (a small stand-in for
    NLTK's Punkt, which RULER uses). Joining the result with single spaces gives back ``text`` when its
    whitespace was single spaces."""
    text = text.strip()
    if not text:
        return []
    out, start = [], 0
    for m in _SENTENCE_SPLIT.finditer(text):
        end = m.start() + len(m.group(0).rstrip())  # keep closing quotes with their sentence
        out.append(text[start:end].strip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


_WORD_RE = re.compile(r"^[a-z]+(?:-[a-z]+)*$")


def _dedup(words: list[str]) -> tuple[str, ...]:
    return tuple(sorted({w for w in words if _WORD_RE.match(w)}))


@functools.lru_cache(maxsize=1)
def adjectives() -> tuple[str, ...]:
    return _dedup(_wordlists.ADJECTIVES)


@functools.lru_cache(maxsize=1)
def nouns() -> tuple[str, ...]:
    return _dedup(_wordlists.NOUNS)


@functools.lru_cache(maxsize=1)
def common_word_pool() -> tuple[str, ...]:
    """Nouns, adjectives and verbs together (RULER's pool for common-words extraction), sorted."""
    return _dedup(_wordlists.NOUNS + _wordlists.ADJECTIVES + _wordlists.VERBS)


@functools.lru_cache(maxsize=1)
def extended_word_pool() -> tuple[str, ...]:
    """:func:`common_word_pool` followed by further lowercase words of the offline prose, for common-words
    lists longer than the pool (RULER switches to a bigger English word list there)."""
    base = common_word_pool()
    seen = set(base)
    extra = []
    for w in _default_essay_words(1):
        w = w.strip(".,;:!?\"'()[]*“”‘’")
        if 3 <= len(w) <= 14 and w.isascii() and w.isalpha() and w.islower() and w not in seen:
            seen.add(w)
            extra.append(w)
    return base + tuple(sorted(extra))
