"""The config schema: dataclasses that Hydra's composed config must fit (lingua-style).

``conf/`` holds YAML presets; these dataclasses decide which keys exist and their types, so a typo in an
override (``compressor.compresion_ratio=0.5``) or a wrong type (``task.length=long``) is an error when Hydra
composes the config, before any model loads. Each registered compressor gets a schema built from its own
dataclass fields (``<name>_schema`` in the ``compressor`` group) plus ``_target_``, so a new method's YAML
is checked the moment it is registered.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    name: str | None = None  # None: the embedded SmolLM2-135M-Instruct; "tiny"; any HF id or path
    dtype: str = "float32"
    device: str = "cpu"


@dataclass
class TaskConfig:
    name: str = "ruler/niah_single_1"  # ruler/<task>, longbench/<task>, longbench_e/<task>
    length: int | None = 4096  # RULER: total tokens; LongBench: middle-truncation budget (None: none)
    num_samples: int | None = 20  # None: RULER 100, LongBench all
    seed: int = 0
    data_dir: str | None = None  # LongBench data (None: $KVCOMP_LONGBENCH_DIR)
    chat_template: bool | None = None  # None: the task's default
    max_new_tokens: int | None = None  # RULER: override the task's generation cap
    options: dict[str, Any] = field(default_factory=dict)  # extra eval.ruler / eval.longbench options


@dataclass
class LoggerConfig:
    name: str = "jsonl"  # jsonl: the run directory's files only; wandb: also a wandb run
    project: str = "kvcomp"
    entity: str | None = None
    mode: str = "offline"  # wandb mode: offline (default, no network or account), online, disabled
    group: str | None = None  # None: the sweep directory's name
    tags: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    compressor: Any = None  # a compressor's schema (see compressor_schema); _target_ null is the baseline
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    query_aware: bool = False  # True: the question is inside the compressed prompt
    # Lossless decoding (kvcomp.lossless): the compressor drafts `gamma` tokens, the full KV verifies them.
    lossless: bool = False
    gamma: int = 4
    adaptive_gamma: bool = False  # choose gamma per round from the acceptance rate and measured times
    kv_tier: str = "resident"  # where the full KV lives: resident (DynamicCache), ram, host or disk
    batch_size: int = 1
    fidelity: bool = True  # compare each output with the uncompressed one
    # Uncompressed references, shared by every run that points here. None: <sweep dir>/reference.jsonl in a
    # multirun, <run dir>/reference.jsonl in a single run.
    reference_path: str | None = None
    progress: bool = False


def _optional(tp: Any) -> Any:
    # OmegaConf wants typing.Optional, not PEP 604 unions.
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        return Optional[next(a for a in args if a is not type(None))]  # noqa: UP045
    return tp


def compressor_schema(cls: type) -> type:
    """A dataclass with ``_target_`` and the fields (names, types, defaults) of compressor class ``cls``."""
    hints = typing.get_type_hints(cls)
    fields = [("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default="???")
        fields.append((f.name, _optional(hints[f.name]), default))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


@dataclass
class NoCompressorConfig:
    _target_: str | None = None


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    from kvcomp import available

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="compressor", name="none_schema", node=NoCompressorConfig)
    for name, cls in available().items():
        cs.store(group="compressor", name=f"{name}_schema", node=compressor_schema(cls))
