"""Nightly evaluation: score the latest registered checkpoint of an env on its held-out test split, log it to
MLflow (experiment ``nightly-eval``), and flag a regression against the previous night.

Deployed as ``nightly-eval/<env>`` (cron 02:00 UTC, see prefect.yaml). The verdict is a paired test on the same
tasks and seeds (greedy, so the outcomes are per task): tonight's per-task successes against the previous night's
(kept in its run's tags when it scored the same tasks with the same settings), else against the previous
registered version scored tonight on the same tasks. The flow run ends Failed with a ``REGRESSION: ...`` message
when tonight solves significantly fewer of the tasks (one-sided exact McNemar p < alpha) and the success rate fell
by more than the tolerance, Completed otherwise; either way a markdown artifact ``nightly-<env>`` shows both.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, ConfigDict, Field

from core.compare import Verdict, markdown_table


class NightlySettings(BaseModel):
    """Settings of a nightly evaluation (a form in the Prefect UI)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(16, ge=1, description="Held-out test tasks scored (greedy).")
    turn_limit: int | None = Field(None, ge=1, description="Turn limit (default: the phase's turn limit the "
                                                           "checkpoint was trained at).")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: the training run's rollout setting.")
    metric: str = Field("success_rate", description="Metric watched for regressions.")
    tolerance: float = Field(0.05, ge=0, description="A significant drop counts as a regression only when larger than "
                                                     "this (absolute; for another metric than success_rate it is "
                                                     "the whole verdict).")
    alpha: float = Field(0.05, gt=0, lt=1, description="Significance level of the paired test (one-sided exact "
                                                       "McNemar on the per-task greedy outcomes).")
    seed: int = Field(0, description="Base sampling seed of the evaluation (greedy: only the env tasks matter).")
    tracking_uri: str | None = Field(None, description="MLflow URI (default: $MLFLOW_TRACKING_URI or "
                                                        "<output_dir>/mlflow.db).")
    output_dir: str = Field("runs", description="Local folder for the checkpoint cache and the default store.")
    experiment: str = Field("nightly-eval", description="MLflow experiment of the nightly runs.")


def latest_version(client: Any, env: str) -> Any | None:
    from storage.tracking import registered_model_name

    try:
        mvs = client.search_model_versions(f"name='{registered_model_name(env)}'",
                                           order_by=["version_number DESC"], max_results=1)
    except Exception:  # noqa: BLE001 — no such model yet
        return None
    return mvs[0] if mvs else None


def previous_night(client: Any, experiment_id: str, env: str) -> dict[str, float] | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.env = '{env}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return dict(runs[0].data.metrics) if runs else None


def previous_night_run(client: Any, experiment_id: str, env: str) -> Any | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.env = '{env}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def previous_version(client: Any, env: str, version: Any) -> Any | None:
    """The registered version before ``version`` (None if there is none)."""
    from storage.tracking import registered_model_name

    try:
        mvs = client.search_model_versions(f"name='{registered_model_name(env)}'",
                                           order_by=["version_number DESC"], max_results=50)
    except Exception:  # noqa: BLE001
        return None
    older = [m for m in mvs if int(m.version) < int(version)]
    return max(older, key=lambda m: int(m.version)) if older else None


def eval_key(n: int, turn_limit: int, max_new_tokens: int, seed: int, env_options: dict[str, Any]) -> str:
    """What makes two nights' greedy outcomes pairable task by task: the same tasks and the same settings."""
    return (f"test n={n} turns={turn_limit} tokens={max_new_tokens} seed={seed} "
            f"options={json.dumps(env_options, sort_keys=True)}")[:5000]


def encode_successes(successes: list[int | None]) -> str:
    return "".join("x" if s is None else str(int(s)) for s in successes)


def decode_successes(text: str) -> list[int | None]:
    return [None if ch == "x" else int(ch) for ch in text]


def _training_config(env: str, model_dir: Path):
    """The training run's config stored in the checkpoint's trainer_state.json (env options, rollout), else
    the env's defaults."""
    from core.config import build_config, stored_config

    from pydantic import ValidationError

    path = model_dir / "trainer_state.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    if state.get("config"):
        try:
            return stored_config(state["config"]), state
        except ValidationError as e:  # a config from an older version: fall back to the env's defaults
            print(f"the checkpoint's config does not validate any more ({e.error_count()} errors); using defaults")
    return build_config(env), state


@flow(name="nightly-eval", log_prints=True)
def nightly_eval(env: str = "babyai", settings: NightlySettings = NightlySettings()) -> State:
    """Evaluate the latest registered checkpoint of ``env`` on its test split and compare with last night.

    Args:
        env: Environment whose latest registered model version (scalinginter-<env>) is evaluated.
        settings: Number of test tasks, turn limit, regression metric and tolerance, MLflow location.
    """
    from tasks.runs import local_model_dir
    from tasks.artifacts import artifact_key, publish_markdown
    from storage.tracking import Tracker, default_tracking_uri, registered_model_name

    s = settings
    uri = default_tracking_uri(s.output_dir, s.tracking_uri)
    tracker = Tracker(uri, s.experiment, artifact_root=Path(s.output_dir).resolve() / "mlartifacts")
    key = artifact_key("nightly", env)
    mv = latest_version(tracker.client, env)
    if mv is None:
        msg = f"no registered checkpoint for {env} (model {registered_model_name(env)!r} at {uri}); nothing to evaluate"
        publish_markdown(key, f"# Nightly eval {env}\n\n{msg}\n", f"nightly eval of {env}")
        print(msg)
        return Completed(message=msg)
    ckpt = mv.tags.get("scalinginter.checkpoint_uri") or mv.source
    from core.config import RunConfig

    bootstrap = RunConfig.model_validate({"env": {"name": env}, "output_dir": s.output_dir})
    model_dir = Path(local_model_dir(bootstrap, ckpt))
    cfg, state = _training_config(env, model_dir)
    cfg = cfg.model_copy(update={"output_dir": s.output_dir})
    turn_limit = s.turn_limit or int(mv.tags.get("turn_limit") or state.get("turn_limit") or cfg.eval_turn_limit)
    max_new = s.max_new_tokens or cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    print(f"nightly eval of {env}: model {mv.name} v{mv.version} ({ckpt}), {s.n} test tasks, {turn_limit} turns")
    from core.compare import check_regression
    from core.evalreport import flat_metrics, paired_regression
    from flows.evaluate import evaluate

    key_ = eval_key(s.n, turn_limit, max_new, s.seed, cfg.env.options)
    prev_run = previous_night_run(tracker.client, tracker.experiment_id, env)
    previous = dict(prev_run.data.metrics) if prev_run else None
    prev_successes, against = None, "the previous night"
    if prev_run is not None and prev_run.data.tags.get("eval.key") == key_ and prev_run.data.tags.get("eval.successes"):
        prev_successes = decode_successes(prev_run.data.tags["eval.successes"])
        against = f"the previous night (v{prev_run.data.tags.get('model_version', '?')})"
    compare_ref = None
    if prev_successes is None and s.metric == "success_rate":
        pv = previous_version(tracker.client, env, mv.version)
        if pv is not None:  # the previous night cannot be paired: score the previous version tonight, same tasks
            compare_ref = pv.tags.get("scalinginter.checkpoint_uri") or pv.source
            against = f"the previous version v{pv.version}"
            print(f"the previous night has no per-task results for these settings: also scoring v{pv.version} "
                  f"({compare_ref}) on the same tasks")
    doc = evaluate(cfg, str(model_dir), split="test", n=s.n, samples=1, turn_limits=[turn_limit], seed=s.seed,
                   compare_ref=compare_ref, env_options=cfg.env.options, max_new_tokens=max_new)
    metrics = flat_metrics(doc)
    budget = doc["models"]["model"]["budgets"][str(turn_limit)]
    successes = [t["successes"][0] for t in budget["per_task"]]
    if compare_ref is not None:
        prev_successes = [t["successes"][0] for t in doc["models"]["compare"]["budgets"][str(turn_limit)]["per_task"]]
        previous = flat_metrics(doc, "compare")
    if s.metric == "success_rate" and prev_successes is not None and len(prev_successes) == len(successes):
        verdict: Verdict = paired_regression(successes, prev_successes, s.alpha, s.tolerance, against)
    elif s.metric == "success_rate" and previous is None:
        verdict = Verdict(False, f"success_rate {metrics['success_rate']:.3f}; no previous night to compare with", None)
    else:  # another metric, or a previous night without per-task results and no previous version: absolute drop
        verdict = check_regression(metrics, previous, s.metric, s.tolerance)
    night = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    run_id = tracker.start_run(f"nightly-{env}-{night}-v{mv.version}", resume=False, params={
        "env": env, "model_name": mv.name, "model_version": mv.version, "checkpoint": ckpt, "n": s.n,
        "turn_limit": turn_limit, "max_new_tokens": max_new, "metric": s.metric, "tolerance": s.tolerance,
        "alpha": s.alpha, "seed": s.seed},
        tags={"env": env, "model_version": str(mv.version), "regression": str(verdict.regressed).lower(),
              "eval.key": key_, "eval.successes": encode_successes(successes)[:5000],
              "prefect.flow_run_id": str(flow_run.id or "")})
    tracker.log_metrics(run_id, metrics, step=0)
    tracker.log_text(run_id, json.dumps(doc, indent=2, allow_nan=False), "eval/eval.json")
    tracker.end_run(run_id, "FINISHED")

    def f(d: dict[str, float] | None, k: str) -> str:
        return f"{d[k]:.3f}" if d and k in d else "-"

    rows = [("model", f"{mv.name} v{mv.version} (phase {mv.tags.get('phase', '?')}, run "
                      f"{mv.tags.get('run_name', '?')})"),
            ("checkpoint URI", f"`{ckpt}`"), ("tasks", f"{s.n} (test split, greedy, {turn_limit} turns)"),
            ("success rate, 95% Wilson interval", f"{f(metrics, 'success_rate_ci_low')} - {f(metrics, 'success_rate_ci_high')}")]
    rows += [(k, f"{f(metrics, k)} ({against} {f(previous, k)})") for k in ("success_rate", "mean_reward", "mean_turns")]
    rows += [("verdict", verdict.message), ("MLflow run", run_id)]
    title = ("REGRESSION" if verdict.regressed else "OK")
    publish_markdown(key, f"# Nightly eval {env}: {title}\n\n" + markdown_table(rows, ("", "tonight")),
                     f"nightly eval of {env}: {verdict.message}")
    print(verdict.message)
    if verdict.regressed:
        return Failed(message=verdict.message)
    return Completed(message=verdict.message)
