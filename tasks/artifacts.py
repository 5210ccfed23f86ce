"""Prefect markdown artifacts: one per phase (steps, reward, success, turns, checkpoint URI) and one per
nightly evaluation. Shown on the flow run's Artifacts tab in the Prefect UI."""

from __future__ import annotations

import re

from core.compare import markdown_table
from core.trajview import viewer_url


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return re.sub(r"-{2,}", "-", key)[:100] or "artifact"


def phase_markdown(run_name: str, phase: int, n_phases: int, turn_limit: int, steps_done: int, steps: int,
                   global_step: int, metrics: dict[str, float] | None, checkpoint_uri: str,
                   mlflow_run_id: str | None, note: str = "") -> str:
    m = metrics or {}

    def f(key: str, spec: str = ".3f") -> str:
        return format(m[key], spec) if key in m else "-"

    rows = [("run", run_name), ("phase", f"{phase}/{n_phases}"), ("turn limit", str(turn_limit)),
            ("steps", f"{steps_done}/{steps} (global step {global_step})"),
            ("reward (last step)", f("mean_reward")), ("success (last step)", f("success_rate")),
            ("turns (last step)", f("mean_turns", ".2f")), ("checkpoint URI", f"`{checkpoint_uri}`"),
            ("MLflow run", mlflow_run_id or "-"),
            ("trajectories", f"{viewer_url(run_name)} (serve it: `scalinginter view --runs-dir OUTPUT_DIR`)")]
    head = f"# ScalingInter {run_name}: phase {phase}\n\n" + (f"{note}\n\n" if note else "")
    return head + markdown_table(rows, ("", "value"))


def publish_markdown(key: str, markdown: str, description: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=markdown, key=key, description=description)
