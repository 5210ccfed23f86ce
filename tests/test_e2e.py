"""End to end: the real `scalinginter` CLI runs the real flows (Prefect ephemeral API, env server processes,
SmolLM2-135M on CPU, MLflow sqlite, local checkpoints) on a tiny budget; then we inspect what it left."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from tests.clirun import cli, side_by_side

RUN = "e2e"


@pytest.fixture(scope="module")
def run_dir(tiny_babyai_run):
    """The session's tiny run (conftest.py; its run name is ``e2e``); its checkpoints are dropped when this module
    ends (two SmolLM2 phase finals, ~1.5 GB each; the viewer's tests need none)."""
    out, log = tiny_babyai_run
    yield out, log
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def test_progress_and_summary_printed(run_dir):
    out, log = run_dir
    assert "phase 1/2 step 1/1" in log and "phase 2/2 step 1/1" in log
    for word in ("mean_reward", "success_rate", "gen_tokens_per_s", "before", "after", "MLflow run id",
                 "final checkpoint"):
        assert word in log, word
    summary = json.loads((out / RUN / "summary.json").read_text())
    assert summary["eval_before"]["episodes"] == 2 and summary["eval_after"]["episodes"] == 2


def test_checkpoint_complete_loads_back_and_params_changed(run_dir):
    out, _ = run_dir
    from transformers import AutoModelForCausalLM

    from runtime.backends.model import resolve_model
    from storage.checkpoint_store import checkpoint_exists, read_latest

    final = out / "checkpoints" / RUN / "phase-2" / "final"
    assert checkpoint_exists(str(final))
    assert read_latest(str(out / "checkpoints" / RUN)) == str(final)
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["phase"] == 2 and state["phase_step"] == 1
    assert (final / "optimizer.pt").exists() and (final / "rng.pt").exists()
    trained = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32)
    diffs = [float((a - b).abs().max()) for a, b in zip(trained.parameters(), base.parameters())]
    signal = [json.loads(l) for l in (out / RUN / "metrics.jsonl").read_text().splitlines()]
    # the tiny preset is seeded so that GRPO groups have mixed outcomes; without that this test proves nothing
    assert any(s["episodes_with_signal"] > 0 for s in signal), "tiny preset produced no GRPO signal"
    assert max(diffs) > 0, "steps with non-zero advantages must move the weights"
    opt = torch.load(final / "optimizer.pt", weights_only=False)
    assert len(opt["state"]) == len(list(trained.parameters()))


def test_mlflow_parent_and_phase_runs(run_dir):
    out, _ = run_dir
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("scalinginter")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.info.run_name == RUN]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and len(children) == 2
    p = parent[0]
    assert p.info.status == "FINISHED"
    assert "eval_before/success_rate" in p.data.metrics and "eval_after/success_rate" in p.data.metrics
    assert p.data.params["rollout.samples_per_task"] == "4"
    for c in children:
        for m in ("mean_reward", "success_rate", "mean_turns", "train/loss", "train/kl", "train/entropy",
                  "gen_tokens_per_s", "env_steps_per_s", "turn_limit"):
            assert m in c.data.metrics, m
        arts = [a.path for a in client.list_artifacts(c.info.run_id, "trajectories")]
        assert arts, "sample trajectories logged"


def test_turn_limit_of_each_phase_honoured(run_dir):
    out, _ = run_dir
    limits = {1: 1, 2: 2}
    files = sorted((out / RUN / "rollouts").glob("*.parquet"))
    assert len(files) == 2
    for f in files:
        t = pq.read_table(f).to_pylist()
        phase = t[0]["phase"]
        for row in t:
            assert 1 <= row["turns"] <= limits[phase]
            if row["finish_reason"] == "turn_limit":
                assert row["turns"] == limits[phase]
            assert len(row["token_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])


def test_rerun_same_name_skips_finished_phases_and_eval_cli(run_dir):
    from mlflow import MlflowClient

    out, _ = run_dir
    # as if the first run had died between phase 2's final checkpoint and its registration
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}", registry_uri=f"sqlite:///{out / 'mlflow.db'}")
    versions = client.search_model_versions("name='scalinginter-babyai'")
    phase2 = [v for v in versions if v.tags.get("phase") == "2"]
    assert len(phase2) == 1
    client.delete_model_version("scalinginter-babyai", phase2[0].version)
    final = out / "checkpoints" / RUN / "phase-2" / "final"
    js = out / "eval.json"
    # the re-run and an evaluation of the phase-2 final it finds, side by side (the re-run only registers it;
    # the evaluation keeps its records under its own output folder)
    p, evaluation = side_by_side(
        ("run", "babyai", "--preset", "tiny", "--set", f"output_dir={out}", "--run-name", RUN),
        ("eval", str(final), "babyai", "--split", "test", "--n", "2", "--turn-limit", "2", "--max-new-tokens", "12",
         "--json", str(js), "--set", f"output_dir={out / 'eval-runs'}"),
        cwd=out)
    assert p.returncode == 0, p.stderr[-2000:]
    log = p.stdout + p.stderr
    assert "phase 1: final checkpoint exists" in log and "phase 2: final checkpoint exists" in log
    assert "phase 2: registered" in log and "phase 1: registered" not in log  # only the missing one
    phase2 = [v for v in client.search_model_versions("name='scalinginter-babyai'") if v.tags.get("phase") == "2"]
    assert len(phase2) == 1 and phase2[0].tags["scalinginter.checkpoint_uri"].endswith("phase-2/final")
    p = evaluation
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(js.read_text())  # the evaluation document (schema scalinginter.eval/1, flows/evaluate.py)
    m = doc["models"]["model"]["budgets"]["2"]["overall"]
    assert doc["schema"] == "scalinginter.eval/1" and doc["task_ids"] == [1_000_000, 1_000_001]
    assert m["episodes"] == 2 and 0 <= m["avg"]["value"] <= 1 and 1 <= m["mean_turns"] <= 2
    assert "success (95% CI)" in p.stdout and "2 tasks x 1 sample (greedy)" in p.stdout  # the printed report
