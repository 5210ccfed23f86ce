"""The phase flow's resource lifetimes: a failure while loading the model (or starting the engine) ends the
phase's MLflow run as FAILED instead of leaving it RUNNING, and leaves no session behind."""

import json

import pytest


def test_model_load_failure_does_not_leave_the_mlflow_run_running(tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.config import build_config
    from flows.scalinginter import make_tracker, phase_flow
    from tasks import steps as T

    broken = tmp_path / "broken-model"  # a folder that looks like an HF model and fails to load
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "not a number"}))
    cfg = build_config("toy", None, [f"output_dir={tmp_path / 'runs'}", f"model.path={broken}", "run_name=broken",
                                     "rollout.backend=transformers", 'curriculum.phases=[{"turn_limit": 1, "steps": 1}]',
                                     "eval.before=false", "eval.after=false"])
    sessions_before = set(T._SESSIONS)
    with pytest.raises(Exception) as info:
        phase_flow.fn(cfg, 1, str(broken))  # the flow body itself; no Prefect API needed for this
    assert "fault injection" not in str(info.value)
    tracker = make_tracker(cfg)
    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'broken/phase-1'")
    assert len(runs) == 1 and runs[0].info.status == "FAILED", [r.info.status for r in runs]
    assert set(T._SESSIONS) == sessions_before  # nothing left open
