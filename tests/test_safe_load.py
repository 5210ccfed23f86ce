"""Optimizer, RNG and critic state load with ``torch.load(weights_only=True)`` (issue 18: whoever could write to the
checkpoint store ran code on resume). A tiny Llama (PPO: policy + critic) saves, a fresh learner resumes from the
folder and continues exactly like the original; a pickle that would run code is refused and never runs."""

from __future__ import annotations

import os
import random

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    d = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _batch(n=4, length=24):
    from core.trajectory import Trajectory

    g = torch.Generator().manual_seed(1)
    trajs, advs = [], []
    for i in range(n):
        t = Trajectory(task_id=i, group_id=i // 2)
        ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        t.start(ids[: length // 3])
        t.add_action(ids[length // 3:], [-1.0] * (length - length // 3))
        trajs.append(t)
        advs.append([(1.0 if i % 2 else -1.0) * m for m in t.loss_mask])
    return trajs, advs


def test_resume_loads_every_state_with_weights_only(tiny_model, tmp_path, monkeypatch):
    from runtime.backends.learner import LearnerConfig, TorchLearner

    calls = []
    real_load = torch.load

    def spy(*a, **kw):
        calls.append(kw.get("weights_only"))
        return real_load(*a, **kw)

    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=False, critic=True, critic_lr=1e-3)
    trajs, advs = _batch()
    a = TorchLearner(tiny_model, cfg)
    rets = [[0.5 * m for m in t.loss_mask] for t in trajs]
    a.update(trajs, advs, returns=rets)  # policy and critic steps: both optimizers have state
    torch.manual_seed(123)
    random.seed(456)
    a.save(tmp_path / "ckpt", {"global_step": 1})
    expect_torch, expect_py = torch.rand(3), random.random()

    b = TorchLearner(tiny_model, cfg)
    torch.manual_seed(0)
    random.seed(0)
    monkeypatch.setattr(torch, "load", spy)
    state = b.load_training_state(tmp_path / "ckpt")
    monkeypatch.setattr(torch, "load", real_load)
    assert state == {"global_step": 1}
    # optimizer, RNG, critic model, critic optimizer: four files, every one loaded with weights_only=True
    assert calls == [True, True, True, True], calls
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py

    # the resumed learner continues exactly like the original one (policy and critic)
    torch.manual_seed(7)
    a.update(trajs, advs, returns=rets)
    torch.manual_seed(7)
    b.update(trajs, advs, returns=rets)
    for x, y in ((a.model, b.model), (a.critic.net, b.critic.net)):
        sx, sy = x.state_dict(), y.state_dict()
        assert all(torch.equal(sx[k], sy[k]) for k in sx)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['SI_PWNED']}",))


def test_a_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    from runtime.backends.safe_load import UnsafeCheckpointFile, load_plain

    marker = tmp_path / "pwned"
    monkeypatch.setenv("SI_PWNED", str(marker))
    bad = tmp_path / "rng.pt"
    torch.save({"torch": torch.get_rng_state(), "python": _RunsCode()}, bad)
    with pytest.raises(UnsafeCheckpointFile, match="rng.pt"):
        load_plain(bad)
    assert not marker.exists()
    torch.load(bad, weights_only=False)  # the old loader would have run it: the test can fail
    assert marker.exists()
