"""Records that follow the checkpoint: what a resumed run keeps of the step records an earlier attempt wrote.

A step is recorded (metrics.jsonl, MLflow, rollout Parquet) before its checkpoint is written, and with
``checkpoint.every_n_steps > 1`` several steps are recorded per checkpoint; a run that stops in between re-runs
those steps when it resumes. The rules here keep every global step recorded exactly once:

- ``metrics.jsonl``: when a phase opens, lines after the position it resumes from are dropped (their steps are
  about to run again), as is a torn last line from a write cut short; the re-run appends them again.
- MLflow keeps every value logged, so a metric is logged at a step only if its history has no value there yet.
- Parquet files are named by global step and replaced whole (written to a temporary file, then renamed).
"""

from __future__ import annotations

import json
from typing import Any, Collection, Iterable, Mapping


def kept_metric_lines(lines: Iterable[str], position: int) -> list[str]:
    """The lines of ``metrics.jsonl`` a phase resuming at global step ``position`` keeps: those recording a
    global step ``<= position`` (steps the checkpoint already holds). Blank lines, lines that do not parse (a
    write cut short) and lines without an integer ``global_step`` are dropped; the order is kept."""
    kept = []
    for line in lines:
        text = line.strip()
        if not text:
            continue
        try:
            rec: Any = json.loads(text)
        except ValueError:
            continue
        step = rec.get("global_step") if isinstance(rec, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step <= position:
            kept.append(text)
    return kept


def unlogged(metrics: Mapping[str, float | None], step: int, logged: Mapping[str, Collection[int]]) -> dict[str, float]:
    """The metrics to log at ``step``: those with a value (None is skipped) whose history ``logged[key]`` (the
    steps that already have a value) does not hold ``step``."""
    return {k: float(v) for k, v in metrics.items() if v is not None and step not in logged.get(k, ())}
