"""Resume records each global step once and checks what it resumes.

Hand-computed cases for the pure rules (core.records, core.fingerprint), the MLflow adapter against a real
sqlite store, and the real flows on the toy env with a tiny random Llama: a run failed after a step that had
no checkpoint (checkpoint.every_n_steps=2) resumes with every global step once in metrics.jsonl and in MLflow;
a changed training setting refuses the resume, naming the key; resume.allow_changes lets it through."""

import json

import pytest

from core.fingerprint import (ABSENT, Change, ResumeMismatch, check_resume, diff, fingerprint, is_allowed,
                              training_values)
from core.records import kept_metric_lines, unlogged


# --- core.records ------------------------------------------------------------------------------------------
def test_kept_metric_lines_cut_back_to_the_resumed_position():
    lines = ['{"global_step": 1, "a": 0.5}', "", '{"global_step": 2}', '{"global_step": 3}',
             '{"global_step": true}', '{"phase": 1}', '[1, 2]', '{"global_step": 4, "a": 0.2']  # last one torn
    assert kept_metric_lines(lines, 2) == ['{"global_step": 1, "a": 0.5}', '{"global_step": 2}']
    assert kept_metric_lines(lines, 0) == []
    assert kept_metric_lines(lines, 10) == ['{"global_step": 1, "a": 0.5}', '{"global_step": 2}',
                                            '{"global_step": 3}']


def test_unlogged_skips_steps_that_have_a_value_and_none_values():
    logged = {"a": {0, 1}, "c": {0}}
    assert unlogged({"a": 1.0, "b": None, "c": 2}, 1, logged) == {"c": 2.0}
    assert unlogged({"a": 1.0, "d": 3.0}, 2, logged) == {"a": 1.0, "d": 3.0}
    assert unlogged({"a": 1.0}, 0, logged) == {}


# --- core.fingerprint --------------------------------------------------------------------------------------
CONFIG = {"model": {"path": "m", "threads": 2}, "env": {"name": "toy", "options": {}, "url": "http://h:1"},
          "algo": {"lr": 1e-6, "critic": {"lr": None}}, "curriculum": {"phases": [{"turn_limit": 1, "steps": 2}]},
          "seed": 0, "eval": {"n": 16}, "tracking": {"uri": None}, "output_dir": "runs", "run_name": "r",
          "resume": {"allow_changes": []}}


def test_training_values_are_the_training_sections_without_operational_keys():
    assert training_values(CONFIG) == {"algo.critic.lr": None, "algo.lr": 1e-6, "curriculum.phases":
                                       [{"turn_limit": 1, "steps": 2}], "env.name": "toy", "model.path": "m",
                                       "seed": 0}
    other = {**CONFIG, "eval": {"n": 64}, "output_dir": "elsewhere", "env": {**CONFIG["env"], "url": "http://x:2"},
             "model": {"path": "m", "threads": 8}}
    assert fingerprint(other) == fingerprint(CONFIG)  # where results go and how servers run do not count
    changed = {**CONFIG, "algo": {"lr": 1e-3, "critic": {"lr": None}}}
    assert fingerprint(changed)["sha256"] != fingerprint(CONFIG)["sha256"]


def test_diff_lists_changed_added_and_removed_keys():
    old = {"algo.lr": 1e-6, "seed": 0, "env.options.size": 5}
    new = {"algo.lr": 1e-3, "seed": 0, "env.options.level": "x"}
    assert diff(old, new) == [Change("algo.lr", 1e-6, 1e-3), Change("env.options.level", ABSENT, "x"),
                              Change("env.options.size", 5, ABSENT)]
    assert str(Change("env.options.size", 5, ABSENT)) == "env.options.size: 5 -> (absent)"
    assert str(Change("model.path", "a", "b")) == 'model.path: "a" -> "b"'


def test_check_resume_refuses_what_is_not_allowed():
    old = fingerprint(CONFIG)
    new = fingerprint({**CONFIG, "seed": 1, "env": {**CONFIG["env"], "options": {"size": 7}}})
    chk = check_resume(old, new)
    assert [c.key for c in chk.refused] == ["env.options.size", "seed"] and not chk.allowed
    chk = check_resume(old, new, ["env.options"])  # a section allows the keys under it
    assert [c.key for c in chk.refused] == ["seed"] and [c.key for c in chk.allowed] == ["env.options.size"]
    chk = check_resume(old, new, ["seed", "env.options.size"])
    assert not chk.refused and len(chk.allowed) == 2
    assert check_resume(old, fingerprint(CONFIG)) == check_resume(old, old)
    assert not check_resume(old, old).refused and not check_resume(old, old).unchecked
    assert check_resume(None, new).unchecked and not check_resume(None, new).refused  # an older checkpoint
    assert is_allowed("env.options.size", ["env.options"]) and not is_allowed("env.optionsx", ["env.options"])


def test_a_setting_newer_than_the_checkpoint_is_no_change_at_its_default():
    from core.config import RunConfig
    from core.fingerprint import default_values

    now = RunConfig().model_dump(mode="json")
    current = fingerprint(now)
    older = dict(current["values"])
    for key in ("rollout.history_turns", "env.prompt", "algo.discount"):  # settings added after that checkpoint
        older.pop(key)
    stored = {"version": 1, "sha256": "older", "values": older}
    assert [c.key for c in check_resume(stored, current).refused] == ["algo.discount", "env.prompt",
                                                                      "rollout.history_turns"]
    assert check_resume(stored, current, defaults=default_values()) == check_resume(current, current)
    now["rollout"]["history_turns"] = 2  # a new setting away from its default is a change the checkpoint never had
    chk = check_resume(stored, fingerprint(now), defaults=default_values())
    assert [str(c) for c in chk.refused] == ["rollout.history_turns: (absent) -> 2"]


def test_a_key_made_operational_later_is_no_change():
    """algo.share_prefix was a training key before its default began to follow the device; a checkpoint that
    recorded it resumes (same log-probs and gradients either way), while a real change is still refused."""
    from core.config import RunConfig

    current = fingerprint(RunConfig().model_dump(mode="json"))
    assert "algo.share_prefix" not in current["values"]
    stored = {"version": 1, "sha256": "older", "values": {**current["values"], "algo.share_prefix": True}}
    assert check_resume(stored, current) == check_resume(current, current)
    stored["values"]["algo.lr"] = 123.0
    assert [c.key for c in check_resume(stored, current).refused] == ["algo.lr"]


def test_mismatch_message_names_keys_values_and_both_ways_out():
    msg = str(ResumeMismatch("r", "/ck/phase-1/step-000002", [Change("algo.lr", 1e-6, 0.001),
                                                              Change("seed", 0, 1)]))
    assert "algo.lr: 1e-06 -> 0.001" in msg and "seed: 0 -> 1" in msg and "/ck/phase-1/step-000002" in msg
    assert "--run-name" in msg and "--set 'resume.allow_changes=[algo.lr,seed]'" in msg


def test_allow_changes_parses_from_set():
    from core.config import ConfigError
    from flows.config import build_config

    assert build_config("toy", None, ["resume.allow_changes=[algo.lr,env.options]"]).resume.allow_changes == [
        "algo.lr", "env.options"]
    assert build_config("toy", None, ['resume.allow_changes=["seed"]']).resume.allow_changes == ["seed"]
    assert build_config("toy", None, ["resume.allow_changes=[]"]).resume.allow_changes == []
    with pytest.raises(ConfigError, match="dotted config keys"):
        build_config("toy", None, ["resume.allow_changes=[algo..lr]"])


# --- adapters ----------------------------------------------------------------------------------------------
def test_tracker_logs_a_step_once_across_trackers(tmp_path):
    from storage.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "e")
    rid = t.start_run("r")
    assert t.log_metrics_once(rid, {"a": 1.0, "b": 2.0}, step=0) == {"a": 1.0, "b": 2.0}
    t.log_metrics_once(rid, {"a": 1.5}, step=1)
    again = Tracker(uri, "e")  # a resumed run: a new process, a new tracker
    assert again.log_metrics_once(rid, {"a": 9.0, "b": 3.0}, step=1) == {"b": 3.0}
    assert again.log_metrics_once(rid, {"a": 9.0}, step=1) == {}
    hist = {k: sorted((m.step, m.value) for m in again.client.get_metric_history(rid, k)) for k in ("a", "b")}
    assert hist == {"a": [(0, 1.0), (1, 1.5)], "b": [(0, 2.0), (1, 3.0)]}


def test_trim_metrics_file_rewrites_only_when_needed(tmp_path):
    from tasks.recording import trim_metrics_file

    p = tmp_path / "metrics.jsonl"
    trim_metrics_file(p, 3)  # no file: nothing to do
    assert not p.exists()
    p.write_text('{"global_step": 1}\n{"global_step": 2}\n{"global_step": 3}\n{"global_st')
    trim_metrics_file(p, 2)
    assert p.read_text() == '{"global_step": 1}\n{"global_step": 2}\n'
    mtime = p.stat().st_mtime_ns
    trim_metrics_file(p, 2)
    assert p.stat().st_mtime_ns == mtime and not (tmp_path / "metrics.jsonl.tmp").exists()


def test_final_position_is_the_checkpoints_own(tmp_path):
    from flows.config import build_config
    from tasks.resume import PhasePlan, final_position

    phases = '[{"turn_limit": 1, "steps": 5}, {"turn_limit": 2, "steps": 6}]'
    cfg = build_config("toy", None, [f"output_dir={tmp_path}", "run_name=g", "curriculum.mode=gated",
                                     f"curriculum.phases={phases}"])
    plan = PhasePlan.of(cfg, 2)
    assert plan.start + plan.steps == 11  # the plan's maximum; phase 1 ended early at global step 3
    assert final_position(plan, {"global_step": 7, "phase_step": 4}) == (7, 4)
    assert final_position(plan, {}) == (11, 6)  # an older checkpoint without a trainer state


def test_eval_of_a_truncated_checkpoint_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app
    from storage.checkpoint_store import save_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    ck = save_checkpoint(src, str(tmp_path / "ck"))
    w = tmp_path / "ck" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    res = CliRunner().invoke(app, ["eval", ck, "babyai", "--no-mlflow"])
    out = res.output.strip()
    assert res.exit_code == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert "is damaged" in out and "model.safetensors" in out and "size 100" in out


# --- the flows ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _overrides(out, model, *extra):
    return [f"model.path={model}", "rollout.backend=transformers", f"output_dir={out}", "run_name=r",
            'curriculum.phases=[{"turn_limit": 1, "steps": 4}]', "checkpoint.every_n_steps=2",
            "rollout.tasks_per_step=2", "rollout.samples_per_task=2", "rollout.max_new_tokens=6",
            "rollout.token_budget=256", "env.task_pool=100", "eval.before=false", "eval.after=false",
            "tracking.log_trajectories=0", *extra]


def _config(out, model, *extra):
    from flows.config import build_config

    return build_config("toy", None, _overrides(out, model, *extra))


def _steps(out):
    return [json.loads(line)["global_step"] for line in (out / "r" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resumed_run_records_each_step_once_and_checks_its_config(tmp_path, tiny_model, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tasks.resume import FAULT_ENV, PhasePlan
    from flows.scalinginter import finished_phase, open_phase, scalinginter
    from tasks.runs import make_tracker

    cfg = _config(tmp_path, tiny_model)
    monkeypatch.setenv(FAULT_ENV, "3")  # step 3 has no checkpoint (every 2 steps): it runs again on resume
    with pytest.raises(RuntimeError, match="fault injection"):
        scalinginter(config=cfg)
    assert _steps(tmp_path) == [1, 2, 3]
    state = json.loads((tmp_path / "checkpoints" / "r" / "phase-1" / "step-000002" / "trainer_state.json").read_text())
    assert state["fingerprint"]["values"]["algo.lr"] == 1e-6
    monkeypatch.delenv(FAULT_ENV)

    changed = _config(tmp_path, tiny_model, "algo.lr=1e-3")
    with pytest.raises(ResumeMismatch, match=r"algo\.lr: 1e-06 -> 0\.001") as info:
        scalinginter(config=changed)
    assert [c.key for c in info.value.changes] == ["algo.lr"]
    assert _steps(tmp_path) == [1, 2, 3]  # refused before anything was written
    with pytest.raises(ResumeMismatch, match="step-000002"):  # the phase's own check, before the model loads
        open_phase(changed, PhasePlan.of(changed, 1), str(tiny_model))
    # the CLI: the same refusal as one error message (exit code 2), no flow traceback
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["run", "toy"] + [a for o in _overrides(tmp_path, tiny_model, "algo.lr=1e-3")
                                                    for a in ("--set", o)])
    assert res.exit_code == 2, res.output  # a config error, as for any other refused config
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert "error: run 'r' cannot resume" in out and "algo.lr: 1e-06 -> 0.001" in out, out
    assert "Traceback" not in out and "Flow run" not in out
    assert _steps(tmp_path) == [1, 2, 3]

    allowed = _config(tmp_path, tiny_model, "algo.lr=1e-3", "resume.allow_changes=[algo.lr]")
    summary = scalinginter(config=allowed)
    assert summary["final_checkpoint"].endswith("phase-1/final")
    assert _steps(tmp_path) == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "r" / "rollouts").iterdir()) == [
        f"step-{n:06d}.parquet" for n in (1, 2, 3, 4)]
    client = MlflowClient(make_tracker(cfg).uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"r", "r/phase-1"}
    child, parent = runs["r/phase-1"], runs["r"]
    assert len(child.data.metrics) > 20
    for key in child.data.metrics:
        steps = [m.step for m in client.get_metric_history(child.info.run_id, key)]
        assert sorted(steps) == [0, 1, 2, 3], (key, steps)
    for key in ("mean_reward", "success_rate", "mean_turns"):
        steps = [m.step for m in client.get_metric_history(parent.info.run_id, key)]
        assert sorted(steps) == [0, 1, 2, 3], (key, steps)

    # the finished phase's final now holds the allowed config: the original one is refused by the skip path too
    with pytest.raises(ResumeMismatch, match=r"algo\.lr: 0\.001 -> 1e-06"):
        finished_phase(cfg, PhasePlan.of(cfg, 1), None)
