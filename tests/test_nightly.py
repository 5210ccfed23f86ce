"""Nightly evaluation: registry/previous-night lookups (fast, sqlite MLflow), the flow's no-checkpoint path
(Prefect ephemeral API), and for real (slow): the `nightly-eval/babyai` deployment from prefect.yaml on a
loopback Prefect server whose scheduler creates the 02:00 UTC runs, run twice by a worker against the
stack's MLflow server — the second night regresses and ends Failed with the regression in its artifact."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_settings_validation():
    from flows.nightly import NightlySettings

    assert NightlySettings().tolerance == 0.05 and NightlySettings().n == 16
    with pytest.raises(ValueError):
        NightlySettings(n=0)
    with pytest.raises(ValueError):
        NightlySettings(tolerance=-1)
    with pytest.raises(ValueError):
        NightlySettings(bogus=1)


def test_latest_version_and_previous_night(tmp_path):
    from flows.nightly import latest_version, previous_night
    from storage.tracking import Tracker

    tr = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "scalinginter", artifact_root=tmp_path / "art")
    assert latest_version(tr.client, "babyai") is None
    rid = tr.start_run("r/phase-1")
    assert tr.register_checkpoint("babyai", str(tmp_path / "ck1"), rid, {"phase": "1"}) == "1"
    assert tr.register_checkpoint("babyai", "s3://b/r/phase-2/final", rid, {"phase": "2"}) == "2"
    tr.register_checkpoint("toy", str(tmp_path / "other"), rid, {"phase": "1"})
    mv = latest_version(tr.client, "babyai")
    assert mv.version == "2" or mv.version == 2
    assert mv.tags["phase"] == "2" and mv.tags["env"] == "babyai"
    assert mv.tags["scalinginter.checkpoint_uri"] == "s3://b/r/phase-2/final"

    nt = Tracker(tr.uri, "nightly-eval")
    assert previous_night(nt.client, nt.experiment_id, "babyai") is None
    for v, env, status in [(0.5, "babyai", "FINISHED"), (0.25, "toy", "FINISHED"), (0.75, "babyai", "FAILED")]:
        r = nt.start_run(f"n-{v}", resume=False, tags={"env": env})
        nt.log_metrics(r, {"success_rate": v}, step=0)
        nt.end_run(r, status)
        time.sleep(0.01)
    assert previous_night(nt.client, nt.experiment_id, "babyai") == {"success_rate": 0.5}


def test_previous_version_and_per_task_tags(tmp_path):
    from flows.nightly import decode_successes, encode_successes, eval_key, previous_version
    from storage.tracking import Tracker

    tr = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "scalinginter", artifact_root=tmp_path / "art")
    rid = tr.start_run("r/phase-1")
    for k in (1, 2, 3):
        tr.register_checkpoint("babyai", str(tmp_path / f"ck{k}"), rid, {"phase": str(k)})
    assert int(previous_version(tr.client, "babyai", 3).version) == 2
    assert previous_version(tr.client, "babyai", 1) is None
    assert previous_version(tr.client, "toy", 1) is None
    assert encode_successes([1, 0, None, 1]) == "10x1" and decode_successes("10x1") == [1, 0, None, 1]
    assert eval_key(6, 2, 24, 0, {"levels": "A"}) != eval_key(6, 2, 24, 0, {"levels": "B"})
    assert eval_key(6, 2, 24, 0, {}) != eval_key(7, 2, 24, 0, {})


def test_no_registered_checkpoint_completes_with_a_message(tmp_path):
    from flows.nightly import NightlySettings, nightly_eval

    st = nightly_eval(env="babyai", settings=NightlySettings(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                                                             output_dir=str(tmp_path)), return_state=True)
    assert st.is_completed() and "no registered checkpoint for babyai" in st.message


# --- for real: scheduler + worker + MLflow server on loopback -----------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from flows.stack import down, free_port, pid_alive, up

    d = tmp_path_factory.mktemp("nstack") / "stack"
    st = up(d, prefect_port=free_port(), mlflow_port=free_port(), workdir=ROOT, timeout=180)
    try:
        yield st
    finally:
        pids = [s["pid"] for s in st["services"].values()]
        down(d)
        assert not any(pid_alive(p) for p in pids)


@contextlib.contextmanager
def prefect_client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack["urls"]["prefect_api"]}):
        with get_client(sync_client=True) as client:
            yield client


def _wait_final(client, run_id, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        fr = client.read_flow_run(run_id)
        if fr.state and fr.state.is_final():
            return fr
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} not finished in {timeout}s")


@pytest.mark.slow
def test_nightly_deployment_schedule_and_runs(stack, tmp_path):
    from flows.stack import client_env
    from storage.tracking import Tracker

    env = {**os.environ, "PREFECT_HOME": str(Path(stack["dir"]) / "prefect-home"), **client_env(stack), "PWD": str(ROOT)}
    p = subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--name",
                        "nightly-eval/babyai"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]

    # the stack's MLflow server holds a registered babyai checkpoint (the embedded base model)
    mlflow_uri = stack["urls"]["mlflow"]
    tr = Tracker(mlflow_uri, "scalinginter")
    rid = tr.start_run("nightly-test/phase-1")
    tr.end_run(rid)
    version = tr.register_checkpoint("babyai", "smollm2-135m", rid, {"phase": "1", "turn_limit": "1"})
    # 1 token: never succeeds; 6 tasks: losing all six is significant (one-sided McNemar p = 1/64)
    settings = {"n": 6, "turn_limit": 1, "max_new_tokens": 1, "output_dir": str(tmp_path)}

    with prefect_client(stack) as client:
        dep = client.read_deployment_by_name("nightly-eval/babyai")
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules] == [("0 2 * * *", "UTC", True)]
        # the real scheduler service creates the upcoming runs at 02:00 UTC
        t0 = time.time()
        scheduled = []
        while time.time() - t0 < 90 and not scheduled:
            from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
            scheduled = [r for r in runs if r.state and r.state.is_scheduled() and r.auto_scheduled]
            time.sleep(2)
        assert scheduled, "the scheduler created no runs"
        for r in scheduled:
            t = r.expected_start_time.astimezone(__import__("datetime").timezone.utc)
            assert (t.hour, t.minute) == (2, 0)
        # the schedule is shown: pause it (Prefect deletes its auto-scheduled runs), so that a test that spans
        # 02:00 UTC does not have the worker run tonight's scheduled run beside the two below
        client.pause_deployment(dep.id)
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
        assert not [r for r in runs if r.state and r.state.is_scheduled()], "pausing left scheduled runs"

        # night 1: no previous night -> Completed
        fr = client.create_flow_run_from_deployment(dep.id, parameters={"settings": settings})
        fr = _wait_final(client, fr.id)
        assert fr.state.is_completed(), fr.state
        assert "no previous night" in (fr.state.message or "")

        # a better "previous night" on the same tasks and settings is on record (it solved all six) -> tonight is a
        # paired regression: Failed, flagged in the artifact
        from flows.nightly import eval_key

        nt = Tracker(mlflow_uri, "nightly-eval")
        prev = nt.start_run("nightly-babyai-previous", resume=False, tags={
            "env": "babyai", "eval.key": eval_key(6, 1, 1, 0, {}), "eval.successes": "111111"})
        nt.log_metrics(prev, {"success_rate": 1.0, "mean_reward": 1.0, "mean_turns": 1.0}, step=0)
        nt.end_run(prev)
        fr2 = client.create_flow_run_from_deployment(dep.id, parameters={"settings": settings})
        fr2 = _wait_final(client, fr2.id)
        assert fr2.state.is_failed(), fr2.state
        assert (fr2.state.message or "").startswith("REGRESSION: success_rate 0.000 vs 1.000")
        assert "6 lost, 0 gained" in fr2.state.message and "p = 0.0156" in fr2.state.message
        arts = [a for a in client.read_artifacts() if a.key == "nightly-babyai" and a.flow_run_id == fr2.id]
        assert arts and "REGRESSION" in arts[0].data and f"v{version}" in arts[0].data

    runs = nt.client.search_runs([nt.experiment_id], filter_string="tags.env = 'babyai'")
    tonight = [r for r in runs if r.info.run_id != prev]
    # a third run was seen twice in ~12 runs of this test (2026-11-28/29), before the schedule was paused above;
    # name them all if it happens again
    seen = [(r.info.run_name, r.info.start_time, r.info.status, r.data.params.get("model_version"),
             r.data.tags.get("regression"), r.data.tags.get("prefect.flow_run_id")) for r in tonight]
    assert len(tonight) == 2 and all(r.data.params["model_version"] == version for r in tonight), seen
    assert {r.data.tags["regression"] for r in tonight} == {"false", "true"}
    assert {r.data.tags["prefect.flow_run_id"] for r in tonight} == {str(fr.id), str(fr2.id)}
    assert all(r.data.metrics["episodes"] == 6 for r in tonight)
    assert all(r.data.tags["eval.successes"] == "000000" for r in tonight)
