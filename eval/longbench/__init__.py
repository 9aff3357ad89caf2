"""LongBench v1 (21 tasks) and LongBench-E (13 tasks) for kvcomp.

* :mod:`.tasks` -- official prompt templates, generation lengths, metrics per task,
  chat-template and first-line rules, LongBench-E length buckets;
* :mod:`.metrics` -- the official metrics and task / length-bucket scoring;
* :mod:`.loader` -- local (or, on request, hub) data loading, prompts split into a
  context part and a question part, pred.py's middle truncation.
"""

from .loader import (
    LongBenchDataError,
    LongBenchSample,
    apply_chat_template_split,
    default_data_dir,
    download_longbench,
    load_longbench,
    load_task,
    truncate_middle,
    truncate_prompt_middle,
    truncate_sample,
)
from .metrics import (
    METRICS,
    postprocess_prediction,
    score_by_length,
    score_prediction,
    score_samples,
    score_task,
)
from .tasks import (
    FIRST_LINE_TASKS,
    LENGTH_BUCKETS,
    LONGBENCH_E_TASKS,
    MAX_NEW_TOKENS,
    METRIC_NAMES,
    NO_CHAT_TEMPLATE_TASKS,
    PROMPTS,
    TASKS,
    TaskSpec,
    get_task,
    length_bucket,
    render_prompt,
    split_prompt,
)

__all__ = [
    "FIRST_LINE_TASKS",
    "LENGTH_BUCKETS",
    "LONGBENCH_E_TASKS",
    "MAX_NEW_TOKENS",
    "METRICS",
    "METRIC_NAMES",
    "NO_CHAT_TEMPLATE_TASKS",
    "PROMPTS",
    "TASKS",
    "LongBenchDataError",
    "LongBenchSample",
    "TaskSpec",
    "apply_chat_template_split",
    "default_data_dir",
    "download_longbench",
    "get_task",
    "length_bucket",
    "load_longbench",
    "load_task",
    "postprocess_prediction",
    "render_prompt",
    "score_by_length",
    "score_prediction",
    "score_samples",
    "score_task",
    "split_prompt",
    "truncate_middle",
    "truncate_prompt_middle",
    "truncate_sample",
]
