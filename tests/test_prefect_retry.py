"""Resume from the UI, for real: a `prefect server` and a process worker on 127.0.0.1 (brought up by
`flows.stack`), the `scalinginter/babyai` deployment from prefect.yaml, a run whose phase 2 fails mid-way
(fault injection), then a retry through the Prefect API (what the UI's Retry button and `prefect flow-run
retry` do: force the run back to Scheduled). The retried run must skip phase 1, resume phase 2 at the step
after its last checkpoint, and end with the step count of an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.stack import client_env, down, free_port, pid_alive, status, up

ROOT = Path(__file__).resolve().parents[1]
PHASES = [{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 2}]  # global steps 1 | 2, 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stack")
    st = up(d / "stack", prefect_port=free_port(), mlflow_port=free_port(), workdir=ROOT, timeout=180)
    try:
        yield st
    finally:
        pids = [s["pid"] for s in st["services"].values()]
        assert set(down(d / "stack")) == set(st["services"])
        assert not any(pid_alive(p) for p in pids)


def _prefect(stack, *args, timeout=300):
    exe = Path(sys.executable).with_name("prefect")
    env = {**os.environ, "PREFECT_HOME": str(Path(stack["dir"]) / "prefect-home"), **client_env(stack), "PWD": str(ROOT)}
    p = subprocess.run([str(exe), "--no-prompt", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p.stdout


@contextlib.contextmanager
def prefect_client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack["urls"]["prefect_api"]}):
        with get_client(sync_client=True) as client:
            yield client


def _wait_terminal(client, run_id, timeout=420, after: float | None = None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        fr = client.read_flow_run(run_id)
        if fr.state and fr.state.is_final() and (after is None or fr.state.timestamp.timestamp() > after):
            return fr
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} not finished after {timeout}s (state {fr.state})")


def _logs(client, run_ids):
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    out, offset = [], 0
    while True:
        page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(run_ids))),
                                limit=200, offset=offset)
        out += [l.message for l in page]
        if len(page) < 200:
            return "\n".join(out)
        offset += 200


@pytest.mark.slow
def test_retry_from_the_api_resumes_the_failed_phase(stack, tmp_path):
    from prefect.states import Scheduled

    out = tmp_path / "runs"
    assert all(r["healthy"] for r in status(stack["dir"]))
    _prefect(stack, "deploy", "--name", "scalinginter/babyai")
    with prefect_client(stack) as client:
        dep = client.read_deployment_by_name("scalinginter/babyai")
        schema = dep.parameter_openapi_schema
        assert "RunConfig" in schema["definitions"] and schema["properties"]["preset"]["description"]
        assert schema["definitions"]["RolloutConfig"]["properties"]["temperature"]["description"]

        overrides = [f"output_dir={out}", f"curriculum.phases={json.dumps(PHASES)}", "eval.before=false",
                     "eval.after=false", "tracking.log_trajectories=0"]
        assert "fail_after_step" not in json.dumps(schema)  # the form shows real settings only
        # the test-only fault hook is an env var of the flow run's process (a process work pool's job variable)
        fr = client.create_flow_run_from_deployment(dep.id, parameters={"preset": "tiny", "overrides": overrides},
                                                    job_variables={"env": {"SCALINGINTER_FAULT_AFTER_STEP": "2"}})
        fr = _wait_terminal(client, fr.id)
        assert fr.state.type.value == "FAILED", fr.state
        assert "fault injection" in (fr.state.message or "")
        run_name = next(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith("babyai-tiny-"))
        assert fr.name in run_name  # the run name derives from the flow run: a retry finds the same run
        ck = out / "checkpoints" / run_name
        p1 = ck / "phase-1" / "final" / "manifest.json"
        assert p1.exists() and (ck / "phase-2" / "step-000001" / "manifest.json").exists()
        assert not (ck / "phase-2" / "final").exists()
        p1_mtime = p1.stat().st_mtime_ns
        # the worker reports on the process's exit a moment after the engine set Failed; a retry before that
        # would be overwritten (a person clicking Retry in the UI is never that fast)
        time.sleep(10)
        assert client.read_flow_run(fr.id).state.type.value == "FAILED"

        # Retry: exactly what `prefect flow-run retry` / the UI's Retry button does for a deployment run.
        t_retry = time.time()
        client.set_flow_run_state(fr.id, Scheduled(message="Retried via API"), force=True)
        fr2 = _wait_terminal(client, fr.id, after=t_retry)
        assert fr2.state.type.value == "COMPLETED", fr2.state
        assert fr2.run_count >= 2

        steps = [json.loads(l)["global_step"] for l in (out / run_name / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]  # phase 1 not recomputed, phase 2 resumed at step 2 (global 3), nothing repeated
        assert p1.stat().st_mtime_ns == p1_mtime
        state = json.loads((ck / "phase-2" / "final" / "trainer_state.json").read_text())
        assert (state["global_step"], state["phase"], state["phase_step"], state["turn_limit"]) == (3, 2, 2, 2)
        assert state["global_step"] == sum(p["steps"] for p in PHASES)  # an uninterrupted run's step count
        assert sorted(f.name for f in (out / run_name / "rollouts").iterdir()) == [
            "step-000001.parquet", "step-000002.parquet", "step-000003.parquet"]

        runs = client.read_flow_runs()
        phase_runs = [r.id for r in runs if r.name.startswith("phase-")]
        log = _logs(client, phase_runs + [fr.id])
        assert "phase 1: final checkpoint exists" in log
        assert "phase 2: resuming after step 1/2" in log

        arts = {a.key: a for a in client.read_artifacts()}
        for k in (1, 2):
            key = f"{run_name}-phase-{k}".lower()
            assert key in arts, sorted(arts)
            assert f"phase-{k}/final" in arts[key].data and "| success (last step) |" in arts[key].data

    # each phase's final checkpoint is a model version with env and phase tags (stack's MLflow server)
    from mlflow.tracking import MlflowClient

    mvs = MlflowClient(stack["urls"]["mlflow"]).search_model_versions("name='scalinginter-babyai'")
    tags = sorted((m.tags["env"], m.tags["phase"], m.tags["scalinginter.checkpoint_uri"]) for m in mvs
                  if m.tags.get("run_name") == run_name)
    assert tags == [("babyai", "1", str(ck / "phase-1" / "final")), ("babyai", "2", str(ck / "phase-2" / "final"))]
