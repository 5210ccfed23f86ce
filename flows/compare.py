"""Compare runs from MLflow: a side-by-side table and a PNG of the learning curves.

``scalinginter compare RUN [RUN ...]`` — a RUN is an MLflow run id or a ScalingInter run name: the parent run of
a curriculum, or a ``scalinginter eval`` run (looked up in ``--experiment``, then in the experiment ``eval``),
which shows its held-out success with the 95 % interval at every turn budget.

``scalinginter compare EXPERIMENT`` — a RUN that names an MLflow experiment (the learning study's
``learning-study-<env>``) shows the study: one line per training run (arm, seed, steps, tokens generated, wall
time) with the evaluation of its final checkpoint (the eval run whose ``checkpoint`` param is the training run's
``scalinginter.final_checkpoint`` tag) at every turn budget, the held-out curve per phase (``eval.each_phase``)
and a PNG of held-out and train success vs step per arm (mean over seeds, min-max band). ``compare_study`` is
the same from Python (the notebook calls it).

The table logic lives in ``core.compare``; this module reads MLflow and plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.compare import (RunSummary, StudyRow, arm_bands, eval_label, eval_summary, heldout_curve, side_by_side,
                          study_arm_seed, study_rows, study_table, summarize)

CURVE_METRICS = ("success_rate", "mean_reward", "mean_turns", "eval_after/success_rate", "heldout/success_rate")


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


EVAL_EXPERIMENT = "eval"  # where ``scalinginter eval`` logs by default (flows.evaluate.log_eval)


def _get_run(client: Any, ref: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException:
        return None


def find_parent_run(client: Any, ref: str, experiment: str = "scalinginter") -> Any:
    """An MLflow run by id, else the newest parent run whose ScalingInter run name is ``ref`` in ``experiment``,
    else the newest ``scalinginter eval`` run of that name in the experiment ``eval``."""
    run = _get_run(client, ref)
    if run is not None:
        return run
    names = [experiment] + ([EVAL_EXPERIMENT] if experiment != EVAL_EXPERIMENT else [])
    exps = [e for e in (client.get_experiment_by_name(n) for n in names) if e is not None]
    if not exps:
        raise LookupError(f"no MLflow experiment {experiment!r} at {client.tracking_uri}")
    for exp in exps:
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`scalinginter.run_name` = '{ref}'",
                                  order_by=["attributes.start_time DESC"], max_results=20)
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        if exp.name == experiment:  # a training run of that name wins over an eval run of that name
            parents.sort(key=lambda r: _is_eval(r))
        if parents:
            return parents[0]
    raise LookupError(f"no run {ref!r} (neither an MLflow run id nor a ScalingInter run name) in "
                      f"experiment {experiment!r} at {client.tracking_uri}")


def _is_eval(run: Any) -> bool:
    return run.data.tags.get("scalinginter.eval") == "true"


def _turn_limits(run: Any) -> list[int]:
    raw = run.data.params.get("curriculum.phases")
    try:
        return [int(p["turn_limit"]) for p in json.loads(raw)] if raw else []
    except (ValueError, TypeError, KeyError):
        return []


def _history(client: Any, rid: str, metrics: tuple[str, ...] | list[str]) -> dict[str, list[tuple[int, float]]]:
    return {m: [(x.step, x.value) for x in client.get_metric_history(rid, m)] for m in metrics}


def _run_summary(client: Any, run: Any) -> RunSummary:
    """A training (parent) run or a ``scalinginter eval`` run, from its MLflow record."""
    rid = run.info.run_id
    name = run.data.tags.get("scalinginter.run_name") or run.info.run_name or rid
    if _is_eval(run):
        keys = [k for k in run.data.metrics if k.startswith("model/avg")] + ["mean_reward", "mean_turns"]
        return eval_summary(eval_label(run.data.params.get("checkpoint"), name), rid, _history(client, rid, keys),
                            run.info.start_time, run.info.end_time)
    return summarize(name, rid, _history(client, rid, CURVE_METRICS), _turn_limits(run), run.info.start_time,
                     run.info.end_time)


def load_summary(client: Any, ref: str, experiment: str = "scalinginter") -> RunSummary:
    return _run_summary(client, find_parent_run(client, ref, experiment))


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


def _param_int(run: Any, key: str) -> int | None:
    try:
        return int(json.loads(run.data.params.get(key, "null")))
    except (TypeError, ValueError):
        return None


def _generated_tokens(client: Any, experiment_id: str, parent_id: str) -> float | None:
    """Tokens generated in training: the phase (child) runs' ``generated_tokens`` per step, summed (a step logged
    twice by a resumed run counts once)."""
    children = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  max_results=1000)
    per_step: dict[int, float] = {}
    for c in children:
        for m in client.get_metric_history(c.info.run_id, "generated_tokens"):
            per_step[m.step] = m.value
    return sum(per_step.values()) if per_step else None


def load_study(client: Any, experiment: str) -> tuple[list[StudyRow], list[RunSummary], float | None, str]:
    """The study logged to ``experiment``: its training runs with their final evaluation (``StudyRow``), the
    other eval runs (the base model, ...), the base model's held-out success at the training runs' eval budget
    (None if not scored; step 0 of the held-out curve) and a one-line description."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment {experiment!r} at {client.tracking_uri}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=5000)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    evals = [r for r in top if _is_eval(r)]
    trains = [r for r in top if not _is_eval(r)]
    seen: set[str] = set()
    trains = [r for r in trains if not (_name(r) in seen or seen.add(_name(r)))]  # a re-created run: the newest
    used: set[str] = set()
    rows = []
    for r in trains:
        summary = _run_summary(client, r)
        ckpt = r.data.tags.get("scalinginter.final_checkpoint")
        match = next((e for e in evals if ckpt and e.data.params.get("checkpoint") == ckpt), None)
        if match is None:  # no tag (an unfinished run): its own checkpoints' evaluation, newest first
            match = next((e for e in evals if f"/{summary.name}/phase-" in (e.data.params.get("checkpoint") or "")),
                         None)
        final = None
        if match is not None:
            used.add(match.info.run_id)
            final = _run_summary(client, match)
        arm, seed = study_arm_seed(summary.name, summary.curriculum, _param_int(r, "seed"))
        rows.append(StudyRow(arm=arm, seed=seed, run=summary,
                             tokens=_generated_tokens(client, exp.experiment_id, r.info.run_id), final=final,
                             heldout_curve=heldout_curve(summary.curves.get("heldout/success_rate"),
                                                         _param_int(r, "eval.n"))))
    others_runs = [e for e in evals if e.info.run_id not in used]
    checkpoints_seen: set[str] = set()
    others_runs = [e for e in others_runs if not (e.data.params.get("checkpoint") in checkpoints_seen
                                                  or checkpoints_seen.add(e.data.params.get("checkpoint")))]
    others = [_run_summary(client, e) for e in others_runs]
    base = n = budget = None
    if trains:
        model = trains[0].data.params.get("model.path")
        budget = _param_int(trains[0], "eval.turn_limit") or (_turn_limits(trains[0]) or [None])[-1]
        n = _param_int(trains[0], "eval.n")
        for e, o in zip(others_runs, others):
            if model and e.data.params.get("checkpoint") == model and budget in o.heldout:
                base = o.heldout[budget].value
                break
    held = f"held-out n={n}" + (f" at {budget} turns" if budget else "") if n else ""
    desc = (f"study {experiment!r}: {len(rows)} training run(s), {sum(1 for r in rows if r.final is not None)} with "
            f"a final evaluation, {len(others)} other evaluation(s)" + (f"; {held}" if held else ""))
    return study_rows(rows), others, base, desc


def _name(run: Any) -> str:
    return run.data.tags.get("scalinginter.run_name") or run.info.run_name or run.info.run_id


def plot_study(rows: list[StudyRow], path: str | Path, base: float | None = None, title: str = "") -> Path:
    """Held-out success vs training step per arm (left) and train success per step (right): the mean over seeds
    and the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bands = arm_bands(rows, base)
    limits = {r.arm: r.run.curriculum for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    for ax, (key, label) in zip(axes, [("heldout", "held-out success (greedy)"),
                                       ("train", "train success (sampled episodes of the step)")]):
        for arm, b in bands.items():
            pts = sorted(b[key].items())
            if not pts:
                continue
            xs = [s for s, _ in pts]
            n = max(p.n for _, p in pts)
            ax.plot(xs, [p.mean for _, p in pts], marker="o", markersize=3,
                    label=f"{arm} ({limits[arm]}; {n} seed{'s' if n != 1 else ''})")
            ax.fill_between(xs, [p.lo for _, p in pts], [p.hi for _, p in pts], alpha=0.15)
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "learning study: mean over seeds, band = min-max")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_study(experiment: str, tracking_uri: str, png: str | Path | None = None
                  ) -> tuple[str, list[StudyRow], Path | None]:
    """The learning study logged to ``experiment``: the table (``core.compare.study_table``), its rows and the
    PNG (when ``png`` is given)."""
    client = _client(tracking_uri)
    rows, others, base, desc = load_study(client, experiment)
    table = study_table(rows, others, title=desc)
    held = desc.split("; ", 1)[1] if "; " in desc else ""
    title = f"{experiment}{f' ({held}, greedy)' if held else ''}: mean over seeds, band = min-max"
    out = plot_study(rows, png, base, title=title) if png and rows else None
    return table, rows, out


def _experiment_ref(client: Any, ref: str) -> bool:
    """``ref`` names an experiment (and is not a run id)."""
    return _get_run(client, ref) is None and client.get_experiment_by_name(ref) is not None


def compare_runs(refs: list[str], tracking_uri: str, png: str | Path | None = None,
                 experiment: str = "scalinginter") -> tuple[str, list[RunSummary], Path | None]:
    """Runs side by side; a single ``ref`` naming an MLflow experiment is a study (``compare_study``)."""
    if not refs:
        raise ValueError("give at least one run (MLflow run id or run name) or a study's MLflow experiment")
    client = _client(tracking_uri)
    studies = [r for r in refs if _experiment_ref(client, r)]
    if studies:
        if len(refs) > 1:
            raise ValueError(f"{', '.join(studies)} names an MLflow experiment (a study): give it alone, "
                             f"or give run names with --experiment {studies[0]}")
        table, rows, out = compare_study(studies[0], tracking_uri, png)
        return table, [r.run for r in rows], out
    runs = [load_summary(client, r, experiment) for r in refs]
    out = plot_curves(runs, png) if png else None
    return side_by_side(runs), runs, out
