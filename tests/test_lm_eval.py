"""eval.lm_eval: the `kvcomp` model type runs local lm-eval tasks offline on the tiny model, with compression."""

from __future__ import annotations

import json
import os

# Before lm-eval / datasets are imported by this module: nothing may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

pytest.importorskip("lm_eval")

import datasets.config  # noqa: E402
import huggingface_hub.constants  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import eval.lm_eval as kvcomp_lm_eval  # noqa: E402  (registers --model kvcomp)

CITIES = ["Velmar", "Ostra", "Quenby", "Tarrow"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # The environment variables only count when read at import time, which may have happened already.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = []
    for i, city in enumerate(CITIES):
        filler = " ".join(
            f"The {w} market of {city} opens at dawn and closes at dusk." for w in ("fish", "cloth", "grain")
        )
        rows.append(
            {
                "context": filler,
                "question": f"Which town has a cloth market? ({i})",
                "answer": city,
                "choices": [city, "Nowhere"],
                "label": 0,
            }
        )
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {root / 'hf_cache'}\n"
        "test_split: test\n"
    )
    (root / "gen.yaml").write_text(
        "task: kvcomp_tiny_gen\n"
        + common
        + "output_type: generate_until\n"
        + 'doc_to_text: "{{context}}\\nQuestion: {{question}}\\nAnswer:"\n'
        + 'doc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (root / "mc.yaml").write_text(
        "task: kvcomp_tiny_mc\n"
        + common
        + "output_type: multiple_choice\n"
        + 'doc_to_text: "{{context}}\\nQuestion: {{question}}\\nAnswer:"\n'
        + "doc_to_choice: choices\n"
        + "doc_to_target: label\n"
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


def _evaluate(task_dir, model_args: str, tasks: list[str]):
    return lm_eval.simple_evaluate(
        model="kvcomp",
        model_args=model_args,
        tasks=tasks,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
    )


def test_generate_until_runs_compressed(task_dir):
    results = _evaluate(
        task_dir,
        "pretrained=tiny,compressor=streaming_llm,compression_ratio=0.5",
        ["kvcomp_tiny_gen", "kvcomp_tiny_mc"],
    )
    gen = results["results"]["kvcomp_tiny_gen"]
    assert isinstance(gen["exact_match,none"], float) and 0.0 <= gen["exact_match,none"] <= 1.0
    assert isinstance(results["results"]["kvcomp_tiny_mc"]["acc,none"], float)  # loglikelihood, uncompressed
    info = results["config"]["kvcomp"]
    assert (
        info["compressor"]["name"] == "streaming_llm"
        and info["compressor"]["params"]["compression_ratio"] == 0.5
    )
    assert info["query_aware"] is True and info["mode"] == "query_aware"
    stats = info["generate_until"]
    assert stats["requests"] == len(CITIES)
    assert stats["memory_factor"] > 1.2  # half of each ~60-token prompt evicted
    assert stats["kept_tokens"] < stats["prompt_tokens"]
    for sample in results["samples"]["kvcomp_tiny_gen"]:
        text = sample["resps"][0][0]
        assert "\n" not in text and "." not in text  # `until` honoured


def test_query_agnostic_needs_split_and_splits(task_dir):
    with pytest.raises(ValueError, match="question_split"):
        _evaluate(
            task_dir,
            "pretrained=tiny,compressor=snapkv,compression_ratio=0.5,query_aware=false",
            ["kvcomp_tiny_gen"],
        )
    results = _evaluate(
        task_dir,
        "pretrained=tiny,compressor=snapkv,compression_ratio=0.5,query_aware=false,question_split=\\nQuestion:",
        ["kvcomp_tiny_gen"],
    )
    info = results["config"]["kvcomp"]
    assert info["mode"] == "query_agnostic" and info["question_split"] == "\nQuestion:"
    assert info["generate_until"]["memory_factor"] > 1.0


def test_bad_model_args_are_refused():
    with pytest.raises(ValueError, match="compresion_ratio"):
        kvcomp_lm_eval.KVCompLM(pretrained="tiny", compressor="snapkv", compresion_ratio=0.5, device="cpu")
    with pytest.raises(ValueError, match="batch_size=auto"):
        kvcomp_lm_eval.KVCompLM(pretrained="tiny", batch_size="auto", device="cpu")
