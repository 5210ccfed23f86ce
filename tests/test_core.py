"""Pure logic on hand-computed cases: GRPO, loss mask, reward placement, curriculum, config, losses."""

import math

import pytest
import torch

from core.advantages import EstimatorParams, get_estimator, grpo_scores, make_batch, unpad
from flows.config import ConfigError, build_config
from core.curriculum import Phase, phase_at, phase_start, total_steps, turn_limit_at
from core.losses import clipped_pg_loss, grpo_token_loss, kl_k3
from core.metrics import episode_metrics
from core.trajectory import Trajectory, token_rewards


# --- GRPO -----------------------------------------------------------------------------------------------
def test_grpo_two_groups_by_hand():
    # group 0: rewards 1, 0 -> mean .5, std .5 -> +1, -1 ; group 1: 1, 1, 0, 0 -> mean .5, std .5 -> ±1
    s = grpo_scores([1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], eps=0.0)
    assert s == pytest.approx([1, -1, 1, 1, -1, -1])


def test_grpo_uneven_group_by_hand():
    # rewards 1, 0, 0: mean 1/3, population std sqrt(2)/3 -> (2/3)/(sqrt2/3) = sqrt2 ; (-1/3)/(sqrt2/3) = -1/sqrt2
    s = grpo_scores([1, 0, 0], [7, 7, 7], eps=0.0)
    assert s == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    s2 = grpo_scores([1, 0, 0], [7, 7, 7], normalize_std=False)
    assert s2 == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_grpo_no_signal_and_masked():
    assert grpo_scores([1, 1], [0, 0]) == [0.0, 0.0]
    # the masked sample neither gets an advantage nor moves its group's mean
    s = grpo_scores([1, 0, 0.0], [0, 0, 0], masked=[False, False, True], eps=0.0)
    assert s == pytest.approx([1, -1, 0])


def test_grpo_broadcasts_over_policy_tokens_only():
    batch = make_batch([[0, 0, 0, 0, 1], [0, 0, 0]], [[0, 1, 1, 0, 1], [0, 1, 0]], [0, 0])
    adv = unpad(get_estimator("grpo").fn(batch, EstimatorParams()).advantages, [5, 3])
    assert adv[0] == pytest.approx([0, 1, 1, 0, 1], abs=1e-5)
    assert adv[1] == pytest.approx([0, -1, 0], abs=1e-5)


def test_unknown_estimator():
    with pytest.raises(KeyError, match="grpo"):
        get_estimator("nope")


# --- trajectory, loss mask, rewards ----------------------------------------------------------------------
def three_turn():
    t = Trajectory(task_id=3, group_id=1)
    t.start([10, 11, 12])  # prompt
    t.add_action([20, 21], [-0.1, -0.2])
    t.set_turn_reward(0.0)
    t.add_env([30, 31, 32])
    t.add_action([22], [-0.3])
    t.add_env([33])
    t.add_action([23, 24, 25], [-0.4, -0.5, -0.6])
    t.set_turn_reward(0.75)
    t.finish("success", True)
    return t


def test_loss_mask_of_three_turn_trajectory():
    t = three_turn()
    assert t.token_ids == [10, 11, 12, 20, 21, 30, 31, 32, 22, 33, 23, 24, 25]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1]
    assert t.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3, 0, -0.4, -0.5, -0.6])
    assert t.action_ends == [4, 8, 12]
    assert t.turns == 3 and t.num_policy_tokens == 6 and t.reward == 0.75


def test_rewards_land_on_last_action_token_even_when_env_tokens_follow():
    t = three_turn()
    t.add_env([34, 35])  # trailing env tokens (e.g. final observation): reward must not move there
    r = token_rewards(t)
    assert r[12] == 0.75 and sum(r) == 0.75
    assert all(r[i] == 0 for i, m in enumerate(t.loss_mask) if m == 0)


def test_trajectory_errors():
    t = Trajectory(0, 0)
    t.start([1])
    with pytest.raises(ValueError):
        t.add_action([1, 2], [0.0])
    with pytest.raises(ValueError):
        t.finish("exploded")
    t.finish("env_error")
    assert t.masked


def test_episode_metrics_excludes_masked():
    a, b = three_turn(), Trajectory(1, 1)
    b.start([1])
    b.finish("env_error")
    m = episode_metrics([a, b])
    assert m["episodes"] == 1 and m["masked_episodes"] == 1 and m["success_rate"] == 1.0
    assert m["mean_reward"] == 0.75 and m["finish_env_error"] == 1


# --- curriculum -----------------------------------------------------------------------------------------
def test_curriculum_at_every_boundary():
    ph = [Phase(6, 3), Phase(13, 2), Phase(20, 4)]
    assert total_steps(ph) == 9
    assert [phase_start(ph, k) for k in range(3)] == [0, 3, 5]
    expected = {0: 6, 2: 6, 3: 13, 4: 13, 5: 20, 8: 20}
    for step, limit in expected.items():
        assert turn_limit_at(ph, step) == limit, step
    assert [phase_at(ph, s) for s in range(9)] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    with pytest.raises(ValueError):
        turn_limit_at(ph, 9)
    with pytest.raises(ValueError):
        phase_at(ph, -1)
    with pytest.raises(ValueError):
        Phase(0, 1)


# --- losses ---------------------------------------------------------------------------------------------
def test_kl_k3_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.5), math.log(0.5)])
    # d = ref - logp = [0, log 2]; k3 = e^d - d - 1 = [0, 2 - log2 - 1]
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.0, 1 - math.log(2)])


def test_clipped_loss_by_hand():
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, clipped = clipped_pg_loss(logp, old, adv, clip=0.2)
    # 1.5*1 vs 1.2*1 -> min 1.2 -> loss -1.2 (clipped); 0.5*-1=-0.5 vs 0.8*-1=-0.8 -> min -0.8 -> loss 0.8
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -1.1])
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_token_mean_loss_uses_global_denominator():
    logp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[5.0, 1.0, 2.0, 5.0]])
    loss, st = grpo_token_loss(logp, logp.detach(), None, adv, mask, 0.2, 0.0, denom=4.0)
    assert float(loss) == pytest.approx(-(1 + 2) / 4)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0, -0.25, -0.5, 0])


# --- config ---------------------------------------------------------------------------------------------
def test_presets_and_overrides():
    c = build_config("babyai", "smoke", ["rollout.temperature=0.5", "algo.lr=3e-6", "run_name=x"])
    assert c.rollout.temperature == 0.5 and c.algo.lr == 3e-6 and c.run_name == "x"
    assert [p.turn_limit for p in c.curriculum.phases] == sorted(p.turn_limit for p in c.curriculum.phases)
    c2 = build_config("babyai", None, ['curriculum.phases=[{"turn_limit": 2, "steps": 1}]'])
    assert c2.curriculum.phases[0].turn_limit == 2


@pytest.mark.parametrize("bad, needle", [
    (["rollout.tempurature=1"], "rollout.tempurature"),
    (["algo.mini_batches=999"], "mini_batches"),
    (["rollout.samples_per_task=1"], "samples_per_task"),
    (["rollout.token_budget=20", "rollout.max_new_tokens=64"], "token_budget"),
    (["curriculum.phases=[]"], "curriculum"),
    (["novalue"], "key=value"),
    (["rollout.vllm_in_process=true", "learner.engine=deepspeed"], "learner.engine=torch"),
    (["rollout.vllm_in_process=true", "rollout.backend=transformers"], "rollout.backend=vllm"),
    (["learner.engine=deepspeed", "algo.optimizer=adamw8bit"], "algo.optimizer=adamw"),
    (["algo.optimizer=sgd"], "algo.optimizer"),
    (["learner.engine=deepspeed", "algo.optimizer=adamw", "algo.grad_dtype=bf16"], "algo.grad_dtype=fp32"),
    (["algo.grad_dtype=fp16"], "algo.grad_dtype"),
])
def test_bad_config_says_how_to_fix(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config("babyai", "smoke", bad)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="smoke"):
        build_config("babyai", "nope")


def test_core_config_takes_presets_as_data():
    """core.config is pure: the presets come in as data (flows.config looks the env's up)."""
    from core.config import build_config as core_build

    presets = {"mine": {"rollout": {"temperature": 0.25}, "curriculum": {"phases": [{"turn_limit": 3, "steps": 2}]}}}
    c = core_build("babyai", "mine", ["algo.lr=2e-6"], presets=presets)
    assert (c.rollout.temperature, c.curriculum.phases[0].turn_limit, c.algo.lr, c.preset) == (0.25, 3, 2e-6, "mine")
    assert presets["mine"]["rollout"] == {"temperature": 0.25}  # not mutated
    with pytest.raises(ConfigError, match="presets=envs.base.env_presets"):
        core_build("babyai", "mine")
    with pytest.raises(ConfigError, match="available: mine"):
        core_build("babyai", "smoke", presets=presets)


def test_episode_metrics_average_what_envs_report_besides_reward():
    from core.metrics import episode_metrics
    from core.trajectory import Trajectory

    ts = []
    for score, masked in [(100.0, False), (40.0, False), (7.0, True)]:
        t = Trajectory(task_id=0, group_id=0)
        t.start([1, 2])
        t.add_action([3], [-0.1])
        t.episode_metrics = {"score": score}
        t.finish("env_error" if masked else ("success" if score == 100 else "failure"), score == 100)
        ts.append(t)
    m = episode_metrics(ts)
    assert m["mean_score"] == 70.0  # the masked episode's 7 is not counted
    assert m["success_rate"] == 0.5 and m["masked_episodes"] == 1.0


def test_stored_config_drops_retired_keys():
    """A checkpoint written before fail_after_step left RunConfig still gives its config (and env options)."""
    from pydantic import ValidationError

    from core.config import RunConfig, stored_config

    old = RunConfig(env={"name": "babyai", "options": {"levels": "GoToObj"}}).model_dump(mode="json")
    old["fail_after_step"] = None
    with pytest.raises(ValidationError):
        RunConfig.model_validate(old)
    assert stored_config(old).env.options == {"levels": "GoToObj"}
    old["no_such_key"] = 1
    with pytest.raises(ValidationError):
        stored_config(old)
