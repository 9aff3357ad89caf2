"""Hydra configs, sweeps, reports, wandb offline and the analysis notebook, on the tiny random model.

The sweep runs once per module in a subprocess (Hydra's joblib launcher), as a user would start it; the
other tests compose configs in-process. Scores of the random model are ~0: the tests check structure,
counts, and the values that could be wrong (parameters reaching the records, memory factors, fidelity).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
COMPRESSORS = ("streaming_llm", "snapkv")
RATIOS = (0.5, 0.75)
TINY_TASK = ["model=tiny", "task=ruler/niah_single_1", "task.length=256", "task.num_samples=2"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        **extra,
    )
    return env


def compose(overrides: list[str], hydra_config: bool = False):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import experiments.run  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=hydra_config)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    cmd = [
        sys.executable, "-m", "experiments.run", "-m", *TINY_TASK, "task.max_new_tokens=4",
        f"compressor={','.join(COMPRESSORS)}", f"compressor.compression_ratio={','.join(map(str, RATIOS))}",
        "hydra/launcher=joblib_local", f"hydra.sweep.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_sweep_writes_four_valid_run_dirs(sweep):
    run_dirs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in run_dirs] == ["0", "1", "2", "3"]
    seen = set()
    factors = {}
    for d in run_dirs:
        for name in ("config.yaml", ".hydra/config.yaml", "run_meta.json", "results.jsonl", "summary.json"):
            assert (d / name).is_file() and (d / name).stat().st_size > 0, d / name
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        meta = json.loads((d / "run_meta.json").read_text())
        assert len(meta["git"]["commit"]) == 40 and int(meta["git"]["commit"], 16) >= 0
        assert meta["versions"]["torch"] and meta["versions"]["transformers"] and meta["versions"]["kvcomp"]
        assert (
            meta["machine"]["cpu_count"] and meta["machine"]["device"] == "cpu" and meta["dtype"] == "float32"
        )
        assert meta["start_time"] <= meta["end_time"]
        assert meta["reference_path"] == str(sweep / "reference.jsonl")

        records = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]
        assert len(records) == 2
        name, ratio = cfg["compressor"]["_target_"], cfg["compressor"]["compression_ratio"]
        for r in records:
            assert r["compressor"]["params"]["compression_ratio"] == ratio
            assert r["compressor"]["name"] in COMPRESSORS and name.endswith(
                type_name(r["compressor"]["name"])
            )
            assert r["mode"] == "query_agnostic" and r["query_aware"] is False
            assert r["memory_factor"] > 1.0
            assert r["exact_match"] is not None and r["generated_tokens"] <= 4
        seen.add((records[0]["compressor"]["name"], ratio))
        summary = json.loads((d / "summary.json").read_text())
        assert summary["n"] == 2 and summary["task"] == "ruler/niah_single_1" and summary["length"] == 256
        factors[seen and (records[0]["compressor"]["name"], ratio)] = summary["memory_factor"]
    assert seen == {(c, r) for c in COMPRESSORS for r in RATIOS}
    for c in COMPRESSORS:  # removing more tokens saves more memory
        assert factors[(c, 0.75)] > factors[(c, 0.5)] > 1.0
    # The uncompressed reference is shared: one row per sample for the whole sweep, not per run.
    refs = [json.loads(line) for line in (sweep / "reference.jsonl").read_text().splitlines()]
    assert len(refs) == 2 and len({r["key"] for r in refs}) == 2


def type_name(name: str) -> str:
    from kvcomp import available

    return available()[name].__name__


def test_report_writes_table_and_plots(sweep, tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "report"
    assert main(["report", str(sweep), "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert len(rows) == 4
    assert {(r["compressor"], float(r["compression_ratio"])) for r in rows} == {
        (c, r) for c in COMPRESSORS for r in RATIOS
    }
    assert all(r["label"].endswith("(agnostic)") and float(r["memory_factor"]) > 1 for r in rows)
    text = (out / "report.md").read_text()
    assert text.startswith("Intervals: 95% percentile bootstrap")  # the legend of the confidence columns
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and "memory_factor" in table[0] and "query_agnostic" in table[2]
    assert "| score 95% CI | vs none | vs best other |" in table[0]
    assert all(float(r["score_ci_low"]) <= float(r["score"]) <= float(r["score_ci_high"]) for r in rows)
    for png in ("score_vs_memory.png", "fidelity_vs_memory.png", "time_per_sample.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert main(["report", str(tmp_path / "empty-does-not-exist"), "--out", str(out)]) == 2


def test_report_panels_wrap_into_rows():
    import pandas as pd

    from experiments.report import PANEL_COLUMNS, _panel_axes

    n = PANEL_COLUMNS + 2  # 11 RULER tasks made one 7000-px row before
    df = pd.DataFrame({"task": [f"ruler/t{i}" for i in range(n)], "length": 2048, "label": "none (agnostic)"})
    fig, panels = _panel_axes(df)
    assert [title for _, title, _ in panels] == [f"ruler/t{i} (L=2048)" for i in range(n)]
    width, height = fig.get_size_inches()
    assert (width, height) == (5.5 * PANEL_COLUMNS, 4.2 * 2)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 2 * PANEL_COLUMNS and len(visible) == n
    assert {ax for ax, _, _ in panels} == set(visible)


def test_pareto_front():
    from experiments.report import pareto_front

    pts = [(1.0, 50.0), (2.0, 60.0), (4.0, 40.0), (3.0, 30.0), (8.0, 10.0), (2.0, 55.0)]
    assert pareto_front(pts) == [1, 2, 4]  # (1,50) and (2,55) are beaten by (2,60); (3,30) by (4,40)


def test_override_typo_is_a_hydra_error():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="compresion_ratio"):
        compose([*TINY_TASK, "compressor=snapkv", "compressor.compresion_ratio=0.5"])
    with pytest.raises(ConfigCompositionException, match="task.lenght"):
        compose([*TINY_TASK, "task.lenght=512"])
    with pytest.raises(ConfigCompositionException, match="length"):  # typed: an int
        compose([*TINY_TASK, "task.length=long"])
    with pytest.raises(ConfigCompositionException):  # the baseline has no ratio
        compose([*TINY_TASK, "compressor=none", "compressor.compression_ratio=0.5"])
    # An added key gets past composition ('+'), and the dataclass refuses it when the run builds it.
    from experiments.run import build_compressor

    cfg = compose([*TINY_TASK, "compressor=h2o", "+compressor.recent_fractoin=0.3"])
    with pytest.raises(SystemExit, match="recent_fractoin"):
        build_compressor(cfg)


def test_compressor_configs_match_their_dataclasses():
    from experiments.run import build_compressor
    from kvcomp import available

    for name, cls in available().items():
        raw = yaml.safe_load((CONF / "compressor" / f"{name}.yaml").read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(raw) - {"defaults"} == fields | {"_target_"}, name
        if "compression_ratio" in fields:
            cfg = compose([*TINY_TASK, f"compressor={name}", "compressor.compression_ratio=0.25"])
            built = build_compressor(cfg)
            assert type(built) is cls and built.compression_ratio == 0.25
        else:  # representation methods (quant) have no ratio: the YAML defaults build the dataclass
            built = build_compressor(compose([*TINY_TASK, f"compressor={name}"]))
            assert type(built) is cls and built == cls(**{k: v for k, v in raw.items() if k in fields})
    assert build_compressor(compose([*TINY_TASK, "compressor=none"])) is None


def test_presets_and_launchers_compose():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import experiments.run  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", ["experiment=pareto"], return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        assert len(params.compressor.split(",")) >= 3
        assert len(params["compressor.compression_ratio"].split(",")) >= 3
        assert len(params.task.split(",")) == 2 and cfg.task.length == 2048
        for task in params.task.split(","):
            assert hydra_compose("config", ["experiment=pareto", f"task={task}"]).task.length == 2048
        baseline = hydra_compose("config", ["experiment=pareto_baseline"], return_hydra_config=True)
        assert baseline.compressor._target_ is None and baseline.reference_path == cfg.reference_path
        assert hydra_compose("config", ["experiment=demo"]).task.num_samples == 3
        launchers = [("joblib_local", "Joblib"), ("slurm", "Slurm")]
        try:
            import hydra_plugins.hydra_ray_launcher  # noqa: F401

            launchers.append(("ray_cluster", "Ray"))
        except ImportError:  # the `ray` extra is not installed
            pass
        for launcher, target in launchers:
            cfg = hydra_compose("config", ["hydra/launcher=" + launcher], return_hydra_config=True)
            assert target in cfg.hydra.launcher._target_
        for task in sorted((CONF / "task").rglob("*.yaml")):
            name = task.relative_to(CONF / "task").with_suffix("").as_posix()
            assert hydra_compose("config", [f"task={name}"]).task.name == name


def test_wandb_offline_logs_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from experiments.run import evaluate

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = compose(
        [*TINY_TASK, "task.num_samples=1", "task.max_new_tokens=2", "compressor=streaming_llm",
         "logger=wandb", f"reference_path={tmp_path / 'reference.jsonl'}"]
    )  # fmt: skip
    run_dir = tmp_path / "run"
    summary = evaluate(cfg, run_dir)
    assert summary["n"] == 1
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    assert list(offline[0].glob("*.wandb")), "no wandb transaction log"
    tables = list((offline[0] / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert len(table["data"]) == 1 and {"id", "score", "memory_factor", "exact_match"} <= set(
        table["columns"]
    )
    log = next(offline[0].glob("*.wandb")).read_bytes()  # config and summary are in the transaction log
    assert b"compression_ratio" in log and b"exact_match_rate" in log


def test_notebook_executes_on_the_sweep(sweep, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    monkeypatch.setenv("KVCOMP_SWEEP", str(sweep))
    monkeypatch.setenv("KVCOMP_REPORT_DIR", str(tmp_path / "report"))
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") + json.dumps(o.get("data", {}))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "4 runs under" in outputs and "8 samples" in outputs
    assert (tmp_path / "report" / "score_vs_memory.png").is_file()


def test_tabulate_weights_tasks_by_samples_and_refuses_a_run_given_twice(tmp_path):
    """experiments.tabulate: the mean over tasks of each configuration is weighted by the tasks' sample counts,
    exact-match rates become sample counts, and the same run in two reports is refused."""
    import pandas as pd

    from experiments import tabulate

    base = dict(length=4096, mode="query_agnostic", prefill_seconds=10.0, decode_seconds=2.0)
    rows = [
        dict(base, task="a", n=10, compressor="snapkv", compression_ratio=0.5, label="snapkv (agnostic)", score=100.0,
             memory_factor=2.0, exact_match_rate=0.5),
        dict(base, task="b", n=30, compressor="snapkv", compression_ratio=0.5, label="snapkv (agnostic)", score=20.0,
             memory_factor=1.8, exact_match_rate=0.1),
        dict(base, task="a", n=10, compressor="quant", compression_ratio=float("nan"), label="quant (agnostic)",
             score=90.0, memory_factor=4.0, exact_match_rate=1.0),
    ]
    first, second = tmp_path / "one.csv", tmp_path / "two.csv"
    pd.DataFrame(rows[:2]).to_csv(first, index=False)
    pd.DataFrame(rows[2:]).to_csv(second, index=False)
    summary = tabulate.main([str(first), str(second), "--out", str(tmp_path / "out")]).set_index("configuration")
    assert summary.loc["snapkv 0.5", "score"] == pytest.approx((100 * 10 + 20 * 30) / 40)
    assert summary.loc["snapkv 0.5", "memory_factor"] == pytest.approx((2.0 * 10 + 1.8 * 30) / 40)
    assert summary.loc["snapkv 0.5", "exact_samples"] == 5 + 3
    assert summary.loc["quant", "samples"] == 10
    assert "| 4096 | agnostic | snapkv 0.5 | 40 | 40.0 | 1.85 | 8/40 |" in (tmp_path / "out" / "summary.md").read_text()
    with pytest.raises(ValueError, match="more than one report"):
        tabulate.main([str(first), str(first), "--out", str(tmp_path / "again")])
