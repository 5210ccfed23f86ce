"""Compare curriculum runs from MLflow: a side-by-side table and a PNG of the learning curves.

``scalinginter compare RUN [RUN ...]`` — a RUN is an MLflow run id or a ScalingInter run name (the parent
run of a curriculum). The table logic lives in ``core.compare``; this module reads MLflow and plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.compare import RunSummary, side_by_side, summarize

CURVE_METRICS = ("success_rate", "mean_reward", "mean_turns", "eval_after/success_rate", "heldout/success_rate")


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def find_parent_run(client: Any, ref: str, experiment: str = "scalinginter") -> Any:
    """An MLflow run by id, else the newest parent run whose ScalingInter run name is ``ref``."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment {experiment!r} at {client.tracking_uri}")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`scalinginter.run_name` = '{ref}'",
                              order_by=["attributes.start_time DESC"], max_results=20)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not parents:
        raise LookupError(f"no run {ref!r} (neither an MLflow run id nor a ScalingInter run name) in "
                          f"experiment {experiment!r} at {client.tracking_uri}")
    return parents[0]


def _turn_limits(run: Any) -> list[int]:
    raw = run.data.params.get("curriculum.phases")
    try:
        return [int(p["turn_limit"]) for p in json.loads(raw)] if raw else []
    except (ValueError, TypeError, KeyError):
        return []


def load_summary(client: Any, ref: str, experiment: str = "scalinginter") -> RunSummary:
    run = find_parent_run(client, ref, experiment)
    rid = run.info.run_id
    hist = {m: [(x.step, x.value) for x in client.get_metric_history(rid, m)] for m in CURVE_METRICS}
    name = run.data.tags.get("scalinginter.run_name") or run.info.run_name or rid
    return summarize(name, rid, hist, _turn_limits(run), run.info.start_time, run.info.end_time)


def plot_curves(runs: list[RunSummary], path: str | Path) -> Path:
    """Learning curves (train success, reward, turns vs global step), one line per run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [("success_rate", "train success rate"), ("mean_reward", "mean reward"),
              ("mean_turns", "mean turns")]
    if any(r.curves.get("heldout/success_rate") for r in runs):  # eval.each_phase: the held-out curve
        panels.insert(1, ("heldout/success_rate", "held-out success"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), constrained_layout=True)
    for ax, (key, label) in zip(axes, panels):
        for r in runs:
            pts = r.curves.get(key) or []
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3,
                        label=f"{r.name} ({r.curriculum})")
        ax.set_xlabel("global step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("ScalingInter runs: learning curves")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_runs(refs: list[str], tracking_uri: str, png: str | Path | None = None,
                 experiment: str = "scalinginter") -> tuple[str, list[RunSummary], Path | None]:
    if not refs:
        raise ValueError("give at least one run (MLflow run id or run name)")
    client = _client(tracking_uri)
    runs = [load_summary(client, r, experiment) for r in refs]
    out = plot_curves(runs, png) if png else None
    return side_by_side(runs), runs, out
