"""PPO (critic) and the gated curriculum through the real flows: the `scalinginter` CLI, Prefect's ephemeral API,
an env server process, MLflow sqlite, local checkpoints. A small random Llama with the real SmolLM2 tokenizer
keeps it fast; the run is killed after step 1 and resumed, and must end where an uninterrupted run ends: the
same gated transitions (the gate's state is in the checkpoint), the same policy and critic weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.clirun import background, finished

ROOT = Path(__file__).resolve().parents[1]
PHASES = '[{"turn_limit": 1, "steps": 3}, {"turn_limit": 2, "steps": 2}]'


def command(out, model, name, *extra, fault_after: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The toy PPO + gated run ``name`` in ``out``: its command line and environment."""
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    sets = [f"model.path={model}", "rollout.backend=transformers", "algo.estimator=ppo", "algo.lr=1e-3",
            "algo.critic.lr=1e-3", "curriculum.mode=gated", f"curriculum.phases={PHASES}",
            "curriculum.gate.min_steps=1", "curriculum.gate.patience=1", "curriculum.gate.window=1",
            "rollout.tasks_per_step=2", "rollout.samples_per_task=2", "rollout.max_new_tokens=8",
            "rollout.token_budget=512", "env.task_pool=1000", "eval.before=false", "eval.after=false", "tracking.log_trajectories=0",
            f"output_dir={out}"]
    cmd += ["run", "toy", "--run-name", name] + [a for s in sets + list(extra) for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SCALINGINTER_FAULT_AFTER_STEP", None)
    if fault_after is not None:  # the test-only fault hook (not a config key)
        env["SCALINGINTER_FAULT_AFTER_STEP"] = str(fault_after)
    return cmd, env


def cli(out, model, name, *extra, fault_after: int | None = None):
    cmd, env = command(out, model, name, *extra, fault_after=fault_after)
    return subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=900)


def steps_logged(out, name):
    return [(r["phase"], r["global_step"]) for r in
            map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())]


def test_ppo_gated_run_killed_and_resumed_ends_like_an_uninterrupted_one(tmp_path, toy_policy, request):
    # the uninterrupted run, in its own output folder, while the other is killed and resumed (the two are
    # independent processes: their results may not depend on what else runs); stopped if the test stops first
    wdir = tmp_path / "w"
    wdir.mkdir()
    cmd, env = command(wdir, toy_policy, "whole")
    whole = background(cmd, cwd=wdir, env=env, log=wdir / "whole.log", request=request)
    p = cli(tmp_path, toy_policy, "cut", fault_after=1)
    assert p.returncode != 0 and "fault injection" in (p.stdout + p.stderr)
    assert steps_logged(tmp_path, "cut") == [(1, 1)]

    p = cli(tmp_path, toy_policy, "cut")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert "phase 1: resuming after step 1/3" in log
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["episodes_with_signal"] for r in rows) > 0, "no reward signal: the test would prove nothing"
    ck = tmp_path / "checkpoints" / "cut"
    s1 = json.loads((ck / "phase-1" / "final" / "trainer_state.json").read_text())
    p1 = [r for r in rows if r["phase"] == 1]
    # the gate saw every phase-1 step, the one before the kill included (its state came from the checkpoint)
    assert s1["gate"]["history"] == [r["success_rate"] for r in p1] and s1["global_step"] == len(p1)
    assert s1["gate_reason"] in ("plateau", "max_steps") and f"gated transition after {len(p1)} steps" in log
    assert [r["global_step"] for r in rows] == list(range(1, len(rows) + 1))  # no step lost or repeated
    assert (ck / "phase-2" / "final" / "critic" / "model.pt").exists()  # PPO: the critic is in the checkpoint
    # superseded step checkpoints (the one resumed from included) are gone; the phase finals stay
    from storage.checkpoint_store import list_checkpoints
    assert list_checkpoints(str(ck)) == [str(ck / "phase-1" / "final"), str(ck / "phase-2" / "final")]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("scalinginter").experiment_id])
    phase1 = [r for r in runs if r.info.run_name == "cut/phase-1" and r.info.status == "FINISHED"]
    assert phase1 and phase1[0].data.tags["scalinginter.phase_1.end"] == f"{s1['gate_reason']} at step {len(p1)}"
    assert phase1[0].data.metrics["train/critic_grad_norm"] > 0

    finished(whole, wdir / "whole.log")
    assert steps_logged(wdir, "whole") == steps_logged(tmp_path, "cut")
    wa = load_file(ck / "phase-2" / "final" / "model.safetensors")
    wb = load_file(wdir / "checkpoints" / "whole" / "phase-2" / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    w0 = load_file(Path(toy_policy) / "model.safetensors")
    assert any(not torch.equal(wa[k], w0[k]) for k in wa if k in w0)  # training moved them
    ca = torch.load(ck / "phase-2" / "final" / "critic" / "model.pt")
    cb = torch.load(wdir / "checkpoints" / "whole" / "phase-2" / "final" / "critic" / "model.pt")
    assert all(torch.equal(ca[k], cb[k]) for k in ca)


def test_fault_hook_is_test_only(monkeypatch):
    """The fault hook is an env var read by the flow, not a config key: RunConfig (the Prefect form, the MLflow
    params) has no such field, and the hook fails exactly after the named step, with a clear error on bad input."""
    from core.config import RunConfig
    from flows.config import ConfigError, build_config
    from tasks.resume import FAULT_ENV, inject_fault

    assert not [f for f in RunConfig.model_fields if "fail" in f or "fault" in f]
    with pytest.raises(ConfigError, match="fail_after_step"):
        build_config("toy", None, ["fail_after_step=2"])
    monkeypatch.delenv(FAULT_ENV, raising=False)
    inject_fault(2)  # unset: nothing happens
    monkeypatch.setenv(FAULT_ENV, "2")
    inject_fault(1)
    inject_fault(3)
    with pytest.raises(RuntimeError, match="fault injection: failing after global step 2"):
        inject_fault(2)
    monkeypatch.setenv(FAULT_ENV, "two")
    with pytest.raises(ValueError, match="set it to a global step"):
        inject_fault(1)
