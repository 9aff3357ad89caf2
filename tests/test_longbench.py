"""Tests of eval.longbench: official task facts, metrics on hand-computed cases, loader,
middle truncation. No network: the data are small LongBench-format files written here."""

from __future__ import annotations

import hashlib
import json
import math
import zipfile

import pytest

from eval.longbench import loader as lb_loader
from eval.longbench import metrics as M
from eval.longbench.loader import (
    LongBenchDataError,
    apply_chat_template_split,
    load_longbench,
    load_task,
    truncate_middle,
    truncate_prompt_middle,
    truncate_sample,
)
from eval.longbench.metrics import score_by_length, score_prediction, score_samples, score_task
from eval.longbench.tasks import (
    FIRST_LINE_TASKS,
    LONGBENCH_E_TASKS,
    MAX_NEW_TOKENS,
    METRIC_NAMES,
    NO_CHAT_TEMPLATE_TASKS,
    PROMPTS,
    TASKS,
    get_task,
    length_bucket,
    render_prompt,
    split_prompt,
)

# sha256 of json.dumps(dataset2prompt.json, sort_keys=True, ensure_ascii=False) of the
# official THUDM/LongBench repository (LongBench/config/dataset2prompt.json).
OFFICIAL_PROMPTS_SHA256 = "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"

HOTPOT_TEMPLATE = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nQuestion: {input}\nAnswer:"
)


# ---------------------------------------------------------------------------------------
# task facts


def test_task_lists_and_tables():
    assert len(TASKS) == 21 and len(set(TASKS)) == 21
    assert len(LONGBENCH_E_TASKS) == 13 and set(LONGBENCH_E_TASKS) <= set(TASKS)
    for table in (PROMPTS, MAX_NEW_TOKENS, METRIC_NAMES):
        assert set(table) == set(TASKS)
    assert set(METRIC_NAMES.values()) == set(M.METRICS)
    assert NO_CHAT_TEMPLATE_TASKS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert FIRST_LINE_TASKS == {"trec", "triviaqa", "samsum", "lsht"}
    assert MAX_NEW_TOKENS["gov_report"] == 512 and MAX_NEW_TOKENS["hotpotqa"] == 32
    assert METRIC_NAMES["lsht"] == "classification" and METRIC_NAMES["dureader"] == "rouge_zh"


def test_prompts_are_the_official_ones():
    digest = hashlib.sha256(json.dumps(PROMPTS, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    assert digest == OFFICIAL_PROMPTS_SHA256
    assert PROMPTS["hotpotqa"] == HOTPOT_TEMPLATE
    assert "asconcisely" in PROMPTS["narrativeqa"]  # official typo, kept on purpose


def test_get_task_and_e_names():
    spec = get_task("qasper_e")
    assert spec.name == "qasper" and spec.has_longbench_e and spec.e_name == "qasper_e"
    assert spec.use_chat_template and spec.metric == "qa_f1" and spec.max_new_tokens == 128
    samsum = get_task("samsum")
    assert not samsum.use_chat_template and samsum.first_line_only and samsum.stop_on_newline
    assert get_task("vcsum").language == "zh" and get_task("lcc").language == "code"
    with pytest.raises(KeyError):
        get_task("narrativeqa_e")  # no LongBench-E variant
    with pytest.raises(KeyError):
        get_task("nonexistent")


@pytest.mark.parametrize("task", TASKS)
def test_split_concatenates_to_prompt(task):
    ctx, q = "CONTEXT {with braces} ...", "QUESTION?"
    context_part, question_part = split_prompt(task, ctx, q)
    assert (
        context_part + question_part
        == render_prompt(task, ctx, q)
        == PROMPTS[task].format(context=ctx, input=q)
    )
    assert context_part.endswith(ctx) and ctx not in question_part
    if "{input}" in PROMPTS[task]:
        assert q in question_part and q not in context_part


def test_length_bucket():
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 50000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


# ---------------------------------------------------------------------------------------
# metrics, hand-computed


def test_qa_f1_by_hand():
    # normalized "cat sat" vs "cat sat on": P = 2/2, R = 2/3, F1 = 2PR/(P+R) = 0.8
    assert M.qa_f1_score("The cat sat", "cat sat on") == pytest.approx(0.8)
    assert M.qa_f1_score("An apple, the PEAR!", "apple pear") == pytest.approx(1.0)
    assert M.qa_f1_score("dog", "cat") == 0.0
    assert M.normalize_answer("The  Quick, brown fox!") == "quick brown fox"


def test_rouge_l_by_hand():
    # rouge's summary-level ROUGE-L counts unique words: hyp {a,b,c,d} (4), ref {a,c,e} (3),
    # LCS "a c" (2): R = 2/3, P = 2/4, F = 2PR/(P+R) = 4/7
    assert M.rouge_score("a b c d", "a c e") == pytest.approx(4 / 7, abs=1e-6)
    assert M.rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0, abs=1e-6)
    assert M.rouge_score("", "reference") == 0.0  # rouge raises on empty text: official gives 0


def test_chinese_metrics_with_jieba():
    # jieba: 我/爱/北京/天安门 vs 北京/天安门: P = 2/4, R = 2/2, F1 = 2/3
    assert M.qa_f1_zh_score("我爱北京天安门", "北京天安门") == pytest.approx(2 / 3)
    assert M.qa_f1_zh_score("北京天安门。", "北京，天安门") == pytest.approx(1.0)  # punctuation dropped
    # ROUGE-L on jieba words: LCS 北京 天安门 (2), hyp 4 words, ref 2: F = 2/3
    assert M.rouge_zh_score("我爱北京天安门", "北京天安门") == pytest.approx(2 / 3, abs=1e-6)


def test_classification_score():
    classes = ["Location", "Human", "Human being", "Entity"]
    assert M.classification_score("Human being", "Human being", all_classes=classes) == 1.0
    # matches Location, Human (dropped: part of the truth), Human being -> 1/2
    assert M.classification_score("Location or Human being", "Human being", all_classes=classes) == 0.5
    assert M.classification_score("Entity", "Human being", all_classes=classes) == 0.0
    # official quirk: removing while iterating skips "ab" after "a" is removed -> 1/2, not 1
    assert M.classification_score("abc", "abc", all_classes=["a", "ab", "abc"]) == 0.5
    with pytest.raises(ValueError):
        M.classification_score("x", "y")


def test_retrieval_and_count():
    assert M.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert M.retrieval_score("I do not know", "Paragraph 3") == 0.0
    assert M.retrieval_score("Paragraph 13", "Paragraph 3") == 0.0
    assert M.retrieval_zh_score("答案是：段落2", "段落2") == 1.0
    assert M.retrieval_zh_score("段落2和段落4", "段落4") == 0.5
    assert M.count_score("12", "12") == 1.0
    assert M.count_score("There are 12 unique paragraphs, not 13", "12") == 0.5
    assert M.count_score("twelve", "12") == 0.0


def test_code_similarity():
    assert M.code_sim_score("x = 1", "x = 1") == 1.0
    # Indel ratio: common " = " (3 chars) of 5 + 5 -> 2 * 3 / 10
    assert M.code_sim_score("x = 1", "y = 2") == pytest.approx(0.6)
    assert M.code_sim_score("x = 1", "y = 2", backend="difflib") == pytest.approx(0.6)
    assert M.code_sim_score("abc", "abd") == pytest.approx(0.67)  # 66.67 rounded as fuzzywuzzy
    # the first line without ` # // is used
    assert M.code_sim_score("\n```python\n# comment\nx = 1\ny = 2", "x = 1") == 1.0
    assert M.code_sim_score("# only a comment", "x = 1") == 0.0


def test_score_prediction_max_over_refs_and_first_line():
    assert score_prediction("hotpotqa", "Paris", ["London", "Paris"]) == pytest.approx(100.0)
    assert score_prediction("hotpotqa", "Paris", "Paris") == pytest.approx(100.0)
    # triviaqa keeps only the first line; hotpotqa does not ("paris london is big" vs "paris")
    assert score_prediction("triviaqa", "\nParis\nLondon is big", ["Paris"]) == pytest.approx(100.0)
    assert score_prediction("hotpotqa", "Paris\nLondon is big", ["Paris"]) == pytest.approx(
        100 * 2 * 0.25 / 1.25
    )
    assert score_prediction("trec", "Location\nHuman", ["Location"], ["Location", "Human"]) == 100.0
    assert score_prediction("triviaqa_e", "Paris", ["Paris"]) == pytest.approx(100.0)
    assert M.postprocess_prediction("lsht", "\n\nA\nB") == "A"
    assert M.postprocess_prediction("lcc", "\nA\nB") == "\nA\nB"


def test_score_task_and_by_length():
    preds = ["Paris", "Rome", "x", "Berlin"]
    answers = [["Paris"], ["Madrid"], ["x"], ["Berlin"]]
    assert score_task("hotpotqa", preds, answers) == 75.0
    by_len = score_by_length("hotpotqa", preds, answers, [100, 5000, 7999, 9000])
    assert by_len == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 100.0}
    empty = score_by_length("hotpotqa", ["x"], [["x"]], [10])
    assert empty["0-4k"] == 100.0 and math.isnan(empty["8k+"])
    # shared vs per-sample all_classes
    classes = ["Location", "Human"]
    assert score_task("trec", ["Human", "Human"], [["Human"], ["Location"]], classes) == 50.0
    assert score_task("trec", ["Human", "Human"], [["Human"], ["Location"]], [classes, classes]) == 50.0
    with pytest.raises(ValueError):
        score_task("hotpotqa", ["a"], [["a"], ["b"]])


# ---------------------------------------------------------------------------------------
# loader


def _records(task: str, n: int, long_context: str = "") -> list[dict]:
    return [
        {
            "input": f"Who is person {i}?",
            "context": f"Passage 1:\nPerson {i} is Ada.{long_context}",
            "answers": [f"Ada {i}"],
            "length": 3000 + 3000 * i,
            "dataset": task,
            "language": "en",
            "all_classes": None,
            "_id": f"id{i}",
        }
        for i in range(n)
    ]


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


@pytest.fixture
def data_dir(tmp_path):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", _records("hotpotqa", 2, long_context=" Filler text." * 60))
    _write_jsonl(tmp_path / "data" / "qasper_e.jsonl", _records("qasper_e", 3))  # unzipped data.zip layout
    trec = _records("trec", 1)
    trec[0].update(input="What is the capital?", context="Question: Who?\nType: Human", answers=["Location"])
    trec[0]["all_classes"] = ["Location", "Human"]
    _write_jsonl(tmp_path / "trec.jsonl", trec)
    return tmp_path


def test_load_task_renders_official_prompt(data_dir):
    samples = load_task("hotpotqa", data_dir=data_dir)
    assert len(samples) == 2
    s = samples[1]
    assert s.task == "hotpotqa" and not s.longbench_e and s._id == "id1" and s.answers == ["Ada 1"]
    assert s.input == s.question == "Who is person 1?" and s.length == 6000 and s.all_classes is None
    assert s.prompt == HOTPOT_TEMPLATE.format(context=s.context, input=s.input)
    assert s.context_part + s.question_part == s.prompt
    assert s.context_part.endswith(s.context) and s.question_part.startswith("\n\nAnswer the question")
    assert s.question_part.endswith("Question: Who is person 1?\nAnswer:")
    assert s.as_dict()["_id"] == "id1"
    trec = load_task("trec", data_dir=data_dir)[0]
    assert trec.all_classes == ["Location", "Human"] and trec.question_part == "\nWhat is the capital?"


def test_load_longbench_e(data_dir):
    by_flag = load_task("qasper", data_dir=data_dir, longbench_e=True)
    by_name = load_task("qasper_e", data_dir=data_dir)
    assert by_flag == by_name and len(by_flag) == 3
    assert all(s.longbench_e and s.task == "qasper" and s.dataset == "qasper_e" for s in by_flag)
    assert by_flag[0].prompt == PROMPTS["qasper"].format(context=by_flag[0].context, input=by_flag[0].input)
    assert load_task("qasper_e", data_dir=data_dir, max_samples=2)[1]._id == "id1"
    both = load_longbench(["qasper"], data_dir=data_dir, longbench_e=True)
    assert list(both) == ["qasper"]
    with pytest.raises(KeyError):
        load_task("musique", data_dir=data_dir, longbench_e=True)
    preds = [s.answers[0] for s in by_flag]
    assert score_samples("qasper_e", by_flag, preds, by_length=True) == {
        "0-4k": 100.0,
        "4-8k": 100.0,
        "8k+": 100.0,
    }
    assert score_samples("qasper", by_flag, ["nope"] * 3) == 0.0


def test_missing_data_raises_clear_error(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("must not download without allow_download=True")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", no_network)
    with pytest.raises(LongBenchDataError) as info:
        load_task("hotpotqa", data_dir=tmp_path / "nowhere")
    msg = str(info.value)
    assert (
        "hotpotqa.jsonl" in msg and "data.zip" in msg and "THUDM/LongBench" in msg and "allow_download" in msg
    )
    with pytest.raises(LongBenchDataError, match="gov_report_e.jsonl"):
        load_task("gov_report", data_dir=tmp_path, longbench_e=True)


def test_allow_download_unzips_hub_archive(tmp_path, monkeypatch):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("data/musique.jsonl", json.dumps(_records("musique", 1)[0]) + "\n")
    calls = []

    def fake_download(repo_id, filename, repo_type):
        calls.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    samples = load_task("musique", data_dir=tmp_path / "cache", allow_download=True)
    assert calls == [("THUDM/LongBench", "data.zip", "dataset")]
    assert len(samples) == 1 and (tmp_path / "cache" / "data" / "musique.jsonl").is_file()
    load_task("musique", data_dir=tmp_path / "cache", allow_download=True)  # now local
    assert len(calls) == 1


def test_default_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(lb_loader.DATA_ENV_VAR, str(tmp_path))
    assert lb_loader.default_data_dir() == tmp_path


# ---------------------------------------------------------------------------------------
# middle truncation


class CharTokenizer:
    """One token per character, BOS (id 1) prepended; decode skips it."""

    BOS = 1

    def __call__(self, text, truncation=False, add_special_tokens=True):
        ids = [ord(c) + 10 for c in text]
        return {"input_ids": ([self.BOS] + ids) if add_special_tokens else ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(
            "<s>" if i == self.BOS else chr(i - 10)
            for i in ids
            if not (skip_special_tokens and i == self.BOS)
        )


def test_truncate_middle_ids():
    ids = list(range(10))
    assert truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert truncate_middle(ids, 5) == [0, 1, 8, 9]  # half = 5 // 2, as pred.py
    assert truncate_middle(ids, 10) is ids
    assert truncate_middle(tuple(ids), 6) == (0, 1, 2, 7, 8, 9)
    torch = pytest.importorskip("torch")
    out = truncate_middle(torch.arange(100), 64)
    assert (
        out.shape == (64,)
        and out[:32].tolist() == list(range(32))
        and out[32:].tolist() == list(range(68, 100))
    )
    with pytest.raises(ValueError):
        truncate_middle(ids, 1)


def test_truncate_prompt_middle_keeps_head_and_tail():
    tok = CharTokenizer()
    prompt = "abcdefghijklmnopqrstuvwxyz"  # 27 tokens with BOS
    assert truncate_prompt_middle(prompt, tok, 27) == prompt
    out = truncate_prompt_middle(prompt, tok, 10)
    # head: BOS + "abcd" (BOS skipped on decode), tail: "vwxyz"
    assert out == "abcd" + "vwxyz"
    assert len(tok(out)["input_ids"]) == 10
    assert truncate_prompt_middle(prompt, tok, 10, add_special_tokens=False) == "abcde" + "vwxyz"


def test_truncate_sample_keeps_split(data_dir):
    tok = CharTokenizer()
    s = load_task("hotpotqa", data_dir=data_dir)[0]
    assert truncate_sample(s, tok, len(s.prompt) + 1) is s
    max_len = 2 * (len(s.question_part) + 20)
    t = truncate_sample(s, tok, max_len)
    assert len(tok(t.prompt)["input_ids"]) == max_len
    assert t.prompt == s.prompt[: max_len // 2 - 1] + s.prompt[-(max_len // 2) :]
    assert t.question_part == s.question_part and t.context_part + t.question_part == t.prompt
    assert t.context_part.startswith("Answer the question based")
    # a budget too small to keep the whole question: split where the kept tail starts
    with pytest.warns(UserWarning, match="does not end with the question"):
        tiny = truncate_sample(s, tok, 40)
    assert tiny.context_part == s.prompt[:19] and tiny.context_part + tiny.question_part == tiny.prompt


def _hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ["Answer the question based on the given passages. Question: Who? 问题"], trainer=trainer
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return hf


def test_hf_tokenizer_truncation_and_chat_split(data_dir):
    hf = _hf_tokenizer()
    s = load_task("hotpotqa", data_dir=data_dir)[1]
    n = len(hf(s.prompt)["input_ids"])
    t = truncate_sample(s, hf, n - 30)
    assert t.question_part == s.question_part and t.context_part + t.question_part == t.prompt
    assert t.prompt.startswith("Answer the question") and len(hf(t.prompt)["input_ids"]) <= n - 30

    ctx, q = apply_chat_template_split("hotpotqa", t.context_part, t.question_part, hf)
    assert ctx == "<|user|>\n" + t.context_part
    assert q == t.question_part + "<|end|>\n<|assistant|>\n"
    # the template trims: passage_count's prompt ends with a space that disappears
    pc_ctx, pc_q = split_prompt("passage_count", "Paragraph 1: x", "")
    ctx, q = apply_chat_template_split("passage_count", pc_ctx, pc_q, hf)
    assert ctx == "<|user|>\n" + pc_ctx and q == pc_q.rstrip() + "<|end|>\n<|assistant|>\n"
    # no chat template for the few-shot / code tasks (pred.py)
    assert apply_chat_template_split("trec", "a", "b", hf) == ("a", "b")
