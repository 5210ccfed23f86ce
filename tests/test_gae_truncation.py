"""PPO/GAE: truncation is not termination.

An episode that terminated (success, failure) has nothing after its last action: GAE bootstraps from 0. One a turn
limit or the token budget cut short still had a future: GAE bootstraps from the critic's value of the state after
its last token, V(s_T). Env tokens stay skipped either way. Numbers below are worked by hand.
"""

from __future__ import annotations

import random

import pytest
import torch

from core.advantages import (EstimatorParams, bootstrap_values, gae_reference, get_estimator, make_batch,
                             trajectory_advantages, unpad)
from core.trajectory import Trajectory, is_truncated

# prompt 0-1, action 2-3 (turn reward .5 on 3), env 4-5, action 6-7 (the last token: the rollout appends no
# observation after the final action)
MASK = [0, 0, 1, 1, 0, 0, 1, 1]
REWARDS = [0, 0, 0, 0.5, 0, 0, 0, 0]
# env-token values 9 / -9: any recursion that bootstrapped from an env token would move the results by a lot
VALUES = [0, 0, 0.1, 0.2, 9.0, -9.0, 0.3, 0.4]
V_FINAL = 2.0  # the critic's value of the state after token 7
GAMMA, LAM = 0.9, 0.8

# terminated: V(s_T) = 0
# pos 7: delta = 0 + .9*0 - .4 = -.4                     A = -.4
# pos 6: delta = 0 + .9*.4 - .3 = .06                     A = .06 + .72*(-.4) = -.228
# pos 3: delta = .5 + .9*.3 - .2 = .57 (from token 6, not env token 4)   A = .57 + .72*(-.228) = .40584
# pos 2: delta = 0 + .9*.2 - .1 = .08                     A = .08 + .72*.40584 = .3722048
TERMINATED = [0, 0, 0.3722048, 0.40584, 0, 0, -0.228, -0.4]
# truncated: V(s_T) = 2.0
# pos 7: delta = 0 + .9*2 - .4 = 1.4                      A = 1.4
# pos 6: delta = .06                                      A = .06 + .72*1.4 = 1.068
# pos 3: delta = .57                                      A = .57 + .72*1.068 = 1.33896
# pos 2: delta = .08                                      A = .08 + .72*1.33896 = 1.0440512
TRUNCATED = [0, 0, 1.0440512, 1.33896, 0, 0, 1.068, 1.4]


def traj(reason: str) -> Trajectory:
    t = Trajectory(task_id=0, group_id=0)
    t.start([11, 12])
    t.add_action([21, 22], [-0.1, -0.2])
    t.set_turn_reward(0.5)
    t.add_env([31, 32])
    t.add_action([23, 24], [-0.3, -0.4])
    t.set_turn_reward(0.0)
    t.finish(reason, success=reason == "success")
    assert t.loss_mask == MASK
    return t


PARAMS = EstimatorParams(gamma=GAMMA, lam=LAM, whiten=False)


@pytest.mark.parametrize("reason", ["failure", "success"])
def test_terminated_episode_bootstraps_from_zero(reason):
    t = traj(reason)
    if reason == "success":  # same numbers with the turn reward moved: just check the ending, not the reward
        t.turn_rewards[-1] = 0.0
    adv, ret, _ = trajectory_advantages("ppo", PARAMS, [t], values=[VALUES], final_values=[V_FINAL])
    assert adv[0] == pytest.approx(TERMINATED, abs=1e-6)
    assert ret[0][7] == pytest.approx(0.0, abs=1e-6)  # target of the last action: r + gamma * 0
    ref, _ = gae_reference([REWARDS], [MASK], [VALUES], GAMMA, LAM, bootstrap=[0.0])
    assert ref[0] == pytest.approx(TERMINATED, abs=1e-9)


@pytest.mark.parametrize("reason", ["turn_limit", "token_budget"])
def test_truncated_episode_bootstraps_from_the_critic_value_of_the_truncated_state(reason):
    t = traj(reason)
    assert is_truncated(t)
    adv, ret, _ = trajectory_advantages("ppo", PARAMS, [t], values=[VALUES], final_values=[V_FINAL])
    assert adv[0] == pytest.approx(TRUNCATED, abs=1e-6)
    # the critic's target at the last action is r + gamma * V(s_T) = .9 * 2 (lambda plays no part at the end)
    assert ret[0][7] == pytest.approx(GAMMA * V_FINAL, abs=1e-6)
    assert ret[0] == pytest.approx([a + v * m for a, v, m in zip(TRUNCATED, VALUES, MASK)], abs=1e-6)
    ref, _ = gae_reference([REWARDS], [MASK], [VALUES], GAMMA, LAM, bootstrap=[V_FINAL])
    assert ref[0] == pytest.approx(TRUNCATED, abs=1e-9)
    # without the critic's final value the old behaviour (bootstrap 0) is what one gets
    adv0, _, _ = trajectory_advantages("ppo", PARAMS, [t], values=[VALUES])
    assert adv0[0] == pytest.approx(TERMINATED, abs=1e-6)


def test_env_tokens_are_skipped_and_get_no_advantage_in_a_truncated_episode():
    t = traj("turn_limit")
    other = [v if m else -v for v, m in zip(VALUES, MASK)]  # flip the env-token values only
    a1, _, _ = trajectory_advantages("ppo", PARAMS, [t], values=[VALUES], final_values=[V_FINAL])
    a2, _, _ = trajectory_advantages("ppo", PARAMS, [t], values=[other], final_values=[V_FINAL])
    assert a1 == a2
    assert [a1[0][i] for i in (0, 1, 4, 5)] == [0, 0, 0, 0]


def test_bootstrap_values_per_ending_and_masked_episodes():
    trajs = [traj(r) for r in ("success", "failure", "turn_limit", "token_budget", "env_error")]
    assert bootstrap_values(trajs, [1.0, 2.0, 3.0, 4.0, 5.0]) == [0.0, 0.0, 3.0, 4.0, 0.0]
    assert bootstrap_values(trajs, None) == [0.0] * 5
    with pytest.raises(ValueError, match="one per trajectory"):
        bootstrap_values(trajs, [1.0])
    # a masked (env_error) episode: no advantage at all, whatever its final value
    adv, _, _ = trajectory_advantages("ppo", PARAMS, [trajs[4]], values=[VALUES], final_values=[7.0])
    assert adv[0] == [0.0] * len(MASK)


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_gae_with_bootstrap_matches_plain_loop(seed):
    rng = random.Random(seed)
    rewards, masks, values, boot, masked = [], [], [], [], []
    for _ in range(7):
        n = rng.randint(3, 20)
        m = [0] * rng.randint(1, 3) + [rng.choice([0, 1, 1]) for _ in range(n)]
        rewards.append([rng.choice([0.0, 0.0, 1.0, -0.5]) * x for x in m])
        masks.append(m)
        values.append([rng.uniform(-1, 1) for _ in m])
        boot.append(rng.uniform(-2, 2))
        masked.append(rng.random() < 0.2)
    batch = make_batch(rewards, masks, [0] * 7, masked, values, bootstrap=boot)
    res = get_estimator("ppo").fn(batch, EstimatorParams(gamma=0.97, lam=0.9, whiten=False))
    ref_adv, ref_ret = gae_reference(rewards, masks, values, 0.97, 0.9, [not x for x in masked], boot)
    lengths = [len(m) for m in masks]
    for x, y in zip(unpad(res.advantages, lengths), ref_adv):
        assert x == pytest.approx(y, abs=1e-4)
    for x, y in zip(unpad(res.returns, lengths), ref_ret):
        assert x == pytest.approx(y, abs=1e-4)


def test_critic_final_value_is_the_value_of_the_state_after_the_last_token(tmp_path):
    """A real (tiny, randomly initialised) Llama critic: the final value of a sequence equals the value the same
    critic gives *before* the next token of any longer sequence with that prefix (causal model), and the per-token
    values are the usual shifted ones."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.backends.critic import Critic

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    c = Critic(str(tmp_path / "m"), lr=1e-3, bf16_autocast=False, micro_batch_size=2)
    torch.nn.init.normal_(c.net.head.weight)  # the head starts at zero; give it something to say
    seqs = [[5, 6, 7, 8, 9], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16]]
    vals, final = c.values_and_final(seqs)
    assert vals == c.values(seqs)
    longer = c.values([s + [1] for s in seqs])
    for s, v, f, lv in zip(seqs, vals, final, longer):
        assert len(v) == len(s) and v[0] == 0.0
        assert v == pytest.approx(lv[: len(s)], abs=1e-5)
        assert f == pytest.approx(lv[len(s)], abs=1e-5)
    assert len({round(f, 4) for f in final}) == 3  # not a constant
