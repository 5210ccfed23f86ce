"""The phase flow's resource lifetimes: a failure while loading the model (or starting the engine) ends the
phase's MLflow run as FAILED instead of leaving it RUNNING, and leaves no session behind."""

import json

import pytest


def test_model_load_failure_does_not_leave_the_mlflow_run_running(tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.config import build_config
    from tasks.runs import make_tracker
    from flows.scalinginter import phase_flow
    from runtime.context import Runtime

    broken = tmp_path / "broken-model"  # a folder that looks like an HF model and fails to load
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "not a number"}))
    cfg = build_config("toy", None, [f"output_dir={tmp_path / 'runs'}", f"model.path={broken}", "run_name=broken",
                                     "rollout.backend=transformers", 'curriculum.phases=[{"turn_limit": 1, "steps": 1}]',
                                     "eval.before=false", "eval.after=false"])
    with Runtime() as rt, pytest.raises(Exception) as info:
        phase_flow.fn(cfg, 1, str(broken))  # the flow body itself; no Prefect API needed for this
    assert "fault injection" not in str(info.value)
    tracker = make_tracker(cfg)
    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'broken/phase-1'")
    assert len(runs) == 1 and runs[0].info.status == "FAILED", [r.info.status for r in runs]
    assert rt.sessions == {}  # nothing left open


def test_tasks_take_and_return_values(tmp_path):
    """compute_advantages and policy_update talk through arguments and results, not session fields: the session
    holds only live handles, and the update uses exactly the batch and advantages it is given."""
    import dataclasses

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flows.config import build_config
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime
    from tasks import steps as T

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = build_config("toy", None, [f"model.path={tmp_path}", "rollout.backend=transformers", "algo.lr=1e-2",
                                     "rollout.max_new_tokens=6", "rollout.token_budget=256", "algo.kl_coef=0"])
    assert {f.name for f in dataclasses.fields(T.Session)} == {"cfg", "learner", "model", "tokenizer", "backend",
                                                               "chat", "servers"}
    with Runtime():
        _tasks_on_a_session(T, cfg, str(tmp_path))


def _tasks_on_a_session(T, cfg, model_dir):
    import asyncio
    import dataclasses

    import torch

    from runtime.backends.generation import SamplingParams
    from envs.sessions import local_factory
    from runtime.rollout import EpisodeSpec, run_rollout

    key = T.open_session(cfg, model_dir, train=True)
    try:
        s = T.get_session(key)
        specs = [EpisodeSpec(task_id=t, group_id=t) for t in range(2) for _ in range(2)]
        trajs, _ = asyncio.run(run_rollout(specs, local_factory("toy"), s.backend, s.chat,
                                           SamplingParams(6, 1.0), 1, 256, seed=3))
        for t, r in zip(trajs, (1.0, 0.0, 0.0, 1.0)):  # a reward signal by hand, so the advantages are nonzero
            t.set_turn_reward(r)
        batch = T.Batch(trajs, {"episodes": 4.0})
        adv = T.compute_advantages.fn(key, batch)
        assert isinstance(adv, T.Advantages) and adv.prepared is not None
        # GRPO by hand: groups (1, 0) and (0, 1), mean 0.5, std 0.5 -> +-1 on the last action token
        assert [round(a[-1], 4) for a in adv.advantages if a] == [1.0, -1.0, -1.0, 1.0]
        before = [p.detach().clone() for p in s.learner.model.parameters()]
        zero = dataclasses.replace(adv, advantages=[[0.0] * len(a) for a in adv.advantages])
        T.policy_update.fn(key, batch, zero)  # zero advantages, no KL: the policy gradient is zero
        mid = [p.detach().clone() for p in s.learner.model.parameters()]
        T.policy_update.fn(key, batch, T.compute_advantages.fn(key, batch))
        after = list(s.learner.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, mid))
        assert any(not torch.equal(a, b) for a, b in zip(mid, after))
    finally:
        T.close_session(key)


def test_resume_verifies_hashes_and_falls_back_to_the_previous_complete_checkpoint(tmp_path, capsys):
    """Every resume and eval load checks the manifest's sha256: a flipped byte (same size) or a truncated file
    is named in the error; resume skips the damaged checkpoint, with a warning, for the phase's previous one,
    and with none left starts the phase from the previous phase's result."""
    from flows.config import build_config
    from tasks.resume import PhasePlan, resume_source
    from tasks.runs import local_model_dir
    from storage.checkpoint_store import CheckpointCorrupted, join_uri, save_checkpoint, write_latest

    cfg = build_config("toy", None, [f"output_dir={tmp_path}", "run_name=r",
                                     'curriculum.phases=[{"turn_limit": 1, "steps": 5}]'])
    plan = PhasePlan.of(cfg, 1)
    init = tmp_path / "init-model"
    init.mkdir()
    for n in (1, 2):
        src = tmp_path / f"src{n}"
        src.mkdir()
        (src / "model.safetensors").write_bytes(bytes(range(256)) * 4 * n)
        (src / "trainer_state.json").write_text(f'{{"phase_step": {n}}}')
        out = save_checkpoint(src, join_uri(plan.phase_uri, f"step-{n:06d}"))
        write_latest(plan.phase_uri, out)
    step1, step2 = (join_uri(plan.phase_uri, f"step-{n:06d}") for n in (1, 2))
    assert resume_source(cfg, plan, str(init))[::2] == (step2, True)

    weights = tmp_path / "checkpoints" / "r" / "phase-1" / "step-000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # same size, different bytes: only the hash can tell
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupted, match="model.safetensors.*sha256 mismatch"):
        local_model_dir(cfg, step2)  # an eval load of it fails, naming the file
    ref, _, resumed = resume_source(cfg, plan, str(init))
    assert (ref, resumed) == (step1, True)
    assert "warning: phase 1: checkpoint" in capsys.readouterr().out

    w1 = tmp_path / "checkpoints" / "r" / "phase-1" / "step-000001" / "model.safetensors"
    w1.write_bytes(w1.read_bytes()[:-10])  # truncated
    with pytest.raises(CheckpointCorrupted, match="model.safetensors.*size"):
        local_model_dir(cfg, step1)
    assert resume_source(cfg, plan, str(init)) == (str(init), str(init), False)
