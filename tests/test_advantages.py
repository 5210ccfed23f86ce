"""The four estimators on a hand-computed 2-turn trajectory with env tokens between (and after) the turns,
vectorised-vs-loop equivalence on random batches, loss aggregation, the gated curriculum, config refusals."""

import math
import random

import pytest
import torch

from core.advantages import (
    EstimatorParams,
    broadcast_reference,
    discounted_returns_reference,
    estimator_names,
    gae_reference,
    get_estimator,
    grpo_scores,
    make_batch,
    reinforce_pp_reference,
    rloo_scores,
    unpad,
)
from flows.config import ConfigError, build_config
from core.curriculum import Gate, GateState, gate_update
from core.losses import clipped_value_loss, policy_loss, sequence_weights
from core.trajectory import Trajectory, token_rewards

# positions: 0 1 prompt | 2 3 action turn 1 | 4 5 env reply | 6 7 action turn 2 | 8 env (final observation)
MASK = [0, 0, 1, 1, 0, 0, 1, 1, 0]
REWARDS = [0, 0, 0, 0.5, 0, 0, 0, 1.0, 0]  # turn 1 earned 0.5 (last token 3), turn 2 earned 1.0 (token 7)
NOISE = 9.0  # values / KL on non-policy tokens: must never be used
VALUES = [NOISE, NOISE, 0.1, 0.2, NOISE, NOISE, 0.3, 0.4, NOISE]
KL = [NOISE, NOISE, 0.1, 0.2, NOISE, NOISE, 0.0, 0.3, NOISE]
POLICY = [2, 3, 6, 7]


def run(name, rewards, masks, groups, masked=None, values=None, kl=None, turn_ends=None, anchors=None, **params):
    batch = make_batch(rewards, masks, groups, masked, values, kl, turn_ends=turn_ends, anchors=anchors)
    res = get_estimator(name).fn(batch, EstimatorParams(**params))
    lengths = [len(m) for m in masks]
    return unpad(res.advantages, lengths), (unpad(res.returns, lengths) if res.returns is not None else None)


def test_registry_has_all_six():
    assert set(estimator_names()) == {"filtered-bc", "gigpo", "grpo", "ppo", "reinforce++", "rloo"}
    assert get_estimator("ppo").needs_critic and get_estimator("reinforce++").kl_in_reward
    assert get_estimator("gigpo").needs_turns and get_estimator("gigpo").needs_groups
    with pytest.raises(KeyError, match="available: filtered-bc, gigpo, grpo, ppo"):
        get_estimator("a2c")


def test_trajectory_puts_rewards_on_last_action_tokens_even_when_it_ends_on_env_tokens():
    t = Trajectory(task_id=0, group_id=0)
    t.start([1, 2])
    t.add_action([3, 4], [-0.1, -0.2])
    t.set_turn_reward(0.5)
    t.add_env([5, 6])
    t.add_action([7, 8], [-0.3, -0.4])
    t.set_turn_reward(1.0)
    t.add_env([9])  # the episode's final observation: the sequence ends on an env token
    t.finish("success", True)
    assert t.loss_mask == MASK and token_rewards(t) == REWARDS


def test_ppo_gae_by_hand():
    # gamma .9, lambda .8, policy positions 2, 3, 6, 7 (env tokens 4, 5, 8 skipped):
    # pos 7: delta = 1.0 + .9*0 - .4 = .6                  A = .6
    # pos 6: delta = 0 + .9*.4 - .3 = .06                   A = .06 + .72*.6 = .492
    # pos 3: delta = .5 + .9*.3 - .2 = .57 (bootstraps from token 6, not env token 4)  A = .57 + .72*.492 = .92424
    # pos 2: delta = 0 + .9*.2 - .1 = .08                   A = .08 + .72*.92424 = .7454528
    adv, ret = run("ppo", [REWARDS], [MASK], [0], values=[VALUES], gamma=0.9, lam=0.8, whiten=False)
    expect = [0, 0, 0.7454528, 0.92424, 0, 0, 0.492, 0.6, 0]
    assert adv[0] == pytest.approx(expect, abs=1e-6)
    # returns = A + V on policy tokens: the critic's targets
    assert ret[0] == pytest.approx([0, 0, 0.8454528, 1.12424, 0, 0, 0.792, 1.0, 0], abs=1e-6)
    ref_adv, ref_ret = gae_reference([REWARDS], [MASK], [VALUES], 0.9, 0.8)
    assert ref_adv[0] == pytest.approx(expect, abs=1e-9) and ref_ret[0] == pytest.approx(ret[0], abs=1e-6)
    # whitened (default): mean 0, population std 1 over the policy tokens
    w, _ = run("ppo", [REWARDS], [MASK], [0], values=[VALUES], gamma=0.9, lam=0.8)
    pol = [w[0][t] for t in POLICY]
    assert sum(pol) == pytest.approx(0, abs=1e-5) and sum(x * x for x in pol) / 4 == pytest.approx(1, abs=1e-4)
    assert [w[0][t] for t in (0, 1, 4, 5, 8)] == [0] * 5


def test_ppo_gamma_one_lambda_one_is_reward_to_go_minus_value():
    adv, _ = run("ppo", [REWARDS], [MASK], [0], values=[VALUES], whiten=False)
    # returns to go: 1.5, 1.5, 1.0, 1.0 minus values .1 .2 .3 .4
    assert [adv[0][t] for t in POLICY] == pytest.approx([1.4, 1.3, 0.7, 0.6], abs=1e-6)


def test_reinforce_pp_by_hand():
    # kl_coef .5, gamma 1: shaped rewards on policy tokens r - .5*kl: pos2 -.05, pos3 .4, pos6 0, pos7 .85
    # returns over policy tokens: pos7 .85, pos6 .85, pos3 1.25, pos2 1.2 (env tokens' KL of 9 is ignored)
    shaped = [[(r - 0.5 * k) * m for r, k, m in zip(REWARDS, KL, MASK)]]
    g = discounted_returns_reference(shaped, [MASK], 1.0)
    assert [g[0][t] for t in POLICY] == pytest.approx([1.2, 1.25, 0.85, 0.85])
    # whitened over the batch: mean 1.0375, deviations .1625 .2125 -.1875 -.1875, var .03546875
    std = math.sqrt(0.03546875)
    expect = [0, 0, 0.1625 / std, 0.2125 / std, 0, 0, -0.1875 / std, -0.1875 / std, 0]
    adv, ret = run("reinforce++", [REWARDS], [MASK], [0], kl=[KL], kl_coef=0.5)
    assert ret is None
    assert adv[0] == pytest.approx(expect, abs=1e-4)
    assert reinforce_pp_reference([REWARDS], [MASK], [KL], 0.5, 1.0)[0] == pytest.approx(expect, abs=1e-4)


def test_grpo_by_hand_on_two_turns():
    # two samples of one task: returns 1.5 and 0 -> mean .75, std .75 -> +1 / -1 on every policy token
    zero = [0.0] * 9
    adv, _ = run("grpo", [REWARDS, zero], [MASK, MASK], [4, 4])
    assert adv[0] == pytest.approx([0, 0, 1, 1, 0, 0, 1, 1, 0], abs=1e-5)
    assert adv[1] == pytest.approx([0, 0, -1, -1, 0, 0, -1, -1, 0], abs=1e-5)
    raw, _ = run("grpo", [REWARDS, zero], [MASK, MASK], [4, 4], normalize_std=False)
    assert raw[0][2] == pytest.approx(0.75) and raw[1][7] == pytest.approx(-0.75)


def test_rloo_by_hand():
    # returns 1.5, 0, .3 in one group: 1.5 - (0 + .3)/2 = 1.35 ; 0 - (1.5 + .3)/2 = -.9 ; .3 - 1.5/2 = -.45
    third = [0, 0, 0, 0, 0, 0, 0, 0.3, 0]
    adv, _ = run("rloo", [REWARDS, [0.0] * 9, third], [MASK] * 3, [1, 1, 1])
    assert [a[2] for a in adv] == pytest.approx([1.35, -0.9, -0.45])
    assert [a[8] for a in adv] == [0, 0, 0]  # the trailing env token gets nothing
    assert rloo_scores([1.5, 0, 0.3], [1, 1, 1]) == pytest.approx([1.35, -0.9, -0.45])
    # a masked sample neither gets an advantage nor enters the baseline; a group of one has no signal
    adv, _ = run("rloo", [REWARDS, [0.0] * 9, third], [MASK] * 3, [1, 1, 2], masked=[False, False, True])
    assert [a[2] for a in adv] == pytest.approx([1.5, -1.5, 0])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++", "ppo"])
def test_final_reward_not_lost_when_sequence_ends_on_env_token(name):
    """Two samples of one task that differ only in the final turn's reward (on token 7, followed by the env
    token 8 that ends the sequence): the rewarded one must get the larger advantage on every action token,
    and the env tokens nothing. (In the prior system this reward sat on a masked token and vanished.)"""
    won = [0, 0, 0, 0, 0, 0, 0, 1.0, 0]
    lost = [0.0] * 9
    kw = {"ppo": dict(values=[[0.0] * 9] * 2), "reinforce++": dict(kl=[[0.0] * 9] * 2)}.get(name, {})
    adv, _ = run(name, [won, lost], [MASK, MASK], [0, 0], **kw)
    for t in POLICY:
        assert adv[0][t] > adv[1][t] + 0.1, (t, adv)
    assert all(adv[b][t] == 0 for b in (0, 1) for t in (0, 1, 4, 5, 8))


@pytest.mark.parametrize("name", ["reinforce++", "ppo"])
def test_reward_on_an_env_token_is_an_error_not_a_silent_loss(name):
    bad = [0, 0, 0, 0, 0, 0, 0, 0, 1.0]  # on the env token 8
    with pytest.raises(ValueError, match="non-policy token 8"):
        run(name, [bad], [MASK], [0], values=[VALUES], kl=[KL])


def random_batch(rng: random.Random, B=7, groups=3):
    masks, rewards, values, kl, grp, masked = [], [], [], [], [], []
    for b in range(B):
        T = rng.randint(6, 30)
        m = [0] * rng.randint(1, 4)
        r = [0.0] * len(m)
        while len(m) < T:
            a = rng.randint(1, 4)
            m += [1] * a
            r += [0.0] * a
            if rng.random() < 0.6:
                r[-1] = rng.choice([0.0, 1.0, -0.5, rng.uniform(-1, 2)])
            e = rng.randint(0, 3)
            m += [0] * e
            r += [0.0] * e
        masks.append(m)
        rewards.append(r)
        values.append([rng.uniform(-1, 1) for _ in m])
        kl.append([rng.uniform(-0.5, 0.5) for _ in m])
        grp.append(rng.randrange(groups))
        masked.append(rng.random() < 0.15)
    return rewards, masks, grp, masked, values, kl


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_matches_plain_loops(seed):
    rng = random.Random(seed)
    rewards, masks, grp, masked, values, kl = random_batch(rng)
    live = [not x for x in masked]
    totals = [sum(r) for r in rewards]

    adv, _ = run("grpo", rewards, masks, grp, masked)
    assert_close(adv, broadcast_reference(grpo_scores(totals, grp, masked), masks))
    adv, _ = run("grpo", rewards, masks, grp, masked, normalize_std=False)
    assert_close(adv, broadcast_reference(grpo_scores(totals, grp, masked, normalize_std=False), masks))
    adv, _ = run("rloo", rewards, masks, grp, masked)
    assert_close(adv, broadcast_reference(rloo_scores(totals, grp, masked), masks))
    adv, _ = run("reinforce++", rewards, masks, grp, masked, kl=kl, kl_coef=0.3, gamma=0.95)
    assert_close(adv, reinforce_pp_reference(rewards, masks, kl, 0.3, 0.95, live))
    adv, ret = run("ppo", rewards, masks, grp, masked, values=values, gamma=0.97, lam=0.9, whiten=False)
    ref_adv, ref_ret = gae_reference(rewards, masks, values, 0.97, 0.9, live)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def assert_close(a, b, tol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=tol)


# --- loss aggregation ----------------------------------------------------------------------------------------
def test_sequence_weights_by_hand():
    assert sequence_weights([2, 4], "token-mean") == pytest.approx([1 / 6, 1 / 6])
    assert sequence_weights([2, 4], "seq-mean") == pytest.approx([1 / 4, 1 / 8])
    assert sequence_weights([2, 0, 4], "seq-mean") == pytest.approx([1 / 4, 0, 1 / 8])
    with pytest.raises(ValueError, match="token-mean"):
        sequence_weights([1], "sum")


def test_seq_mean_loss_weighs_sequences_equally():
    # seq A has 1 policy token (adv 1), seq B has 3 (adv 1 each); ratio 1 (logp == old):
    # token-mean: -(1 + 3) / 4 = -1 ; seq-mean: -(1/2 * 1 + 1/2 * (3/3)) = -1 ; grads differ:
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0], [1.0, 1, 1]])
    adv = mask.clone()
    for mode, ga, gb in (("token-mean", 0.25, 0.25), ("seq-mean", 0.5, 1 / 6)):
        w = mask * torch.tensor(sequence_weights([1, 3], mode))[:, None]
        loss, _ = policy_loss(logp, logp.detach(), None, adv, w, 0.2, 0.0)
        assert float(loss) == pytest.approx(-1.0)
        (g,) = torch.autograd.grad(loss, logp)
        assert g[0, 0] == pytest.approx(-ga) and g[1, 2] == pytest.approx(-gb) and g[0, 1] == 0


def test_clipped_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    ret = torch.tensor([[2.0, 0.0]])
    w = torch.tensor([[1.0, 0.0]])
    # unclipped (1 - 2)^2 = 1 ; clipped: .5 + clamp(.5, -.2, .2) = .7 -> (.7 - 2)^2 = 1.69 -> max 1.69 * .5
    loss, st = clipped_value_loss(v, old, ret, w, clip=0.2)
    assert float(loss) == pytest.approx(0.845) and st["value_clip_frac"] == 1.0


# --- gated curriculum --------------------------------------------------------------------------------------
def feed(gate, rates, max_steps=100):
    st, reasons = GateState(), []
    for r in rates:
        st, why = gate_update(gate, st, r, max_steps)
        reasons.append(why)
        if why:
            break
    return st, reasons


def test_gate_plateau_by_hand():
    g = Gate(patience=2, min_delta=0.05, window=1, min_steps=1)
    # best .2 (step 1), .3 improves (step 2), .32 < .35 no (since 1), .31 no (since 2) -> plateau at step 4
    st, reasons = feed(g, [0.2, 0.3, 0.32, 0.31, 0.9])
    assert reasons == [None, None, None, "plateau"] and st.best == 0.3 and st.since_best == 2


def test_gate_threshold_window_min_steps_and_max():
    g = Gate(patience=10, min_delta=0.0, threshold=0.5, window=2, min_steps=3)
    # smoothed: .6, .6 (avg of .6 .6) -> threshold but min_steps 3 -> ends at step 3
    assert feed(g, [0.6, 0.6, 0.6])[1] == [None, None, "threshold"]
    g2 = Gate(patience=10, threshold=0.9, window=2, min_steps=1)
    # .8 then 1.0: smoothed .9 -> threshold at step 2 (window average, not the single step)
    assert feed(g2, [0.8, 1.0])[1] == [None, "threshold"]
    assert feed(Gate(patience=50), [0.1, 0.2, 0.3], max_steps=3)[1] == [None, None, "max_steps"]


def test_gate_state_round_trips_through_checkpoint_json():
    st, _ = feed(Gate(patience=9), [0.1, 0.4, 0.2])
    import json

    back = GateState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back == st
    # resuming from the restored state continues exactly as the uninterrupted run
    g = Gate(patience=2, min_delta=0.05, window=1, min_steps=1)
    a, _ = feed(g, [0.2, 0.3])
    a2, why = gate_update(g, GateState.from_dict(a.to_dict()), 0.31, 100)
    b, reasons = feed(g, [0.2, 0.3, 0.31])
    assert a2 == b


# --- config refuses silent no-ops ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad,msg", [
    (["algo.critic.lr=1e-5"], "only ppo trains a critic"),
    (["algo.estimator=rloo", "algo.critic.model=x"], "only ppo trains a critic"),
    (["algo.lam=0.95"], "GAE parameter"),
    (["algo.gamma=0.9"], "does nothing for 'grpo'"),
    (["algo.mini_batches=17"], "exceeds the episodes per step"),
    (["algo.mini_batches=15"], "non-empty mini-batches"),
    (["algo.estimator=rloo", "rollout.samples_per_task=1"], "rloo needs rollout.samples_per_task >= 2"),
    (["curriculum.gate.patience=2"], "curriculum.mode=gated"),
    (["curriculum.mode=gated", "curriculum.gate.min_steps=5"], "fewer steps"),
    (["algo.estimator=a2c"], "algo.estimator"),
    (["algo.loss_agg=sum"], "algo.loss_agg"),
])
def test_config_refuses_silent_no_ops(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        build_config("babyai", "smoke", bad)


def test_config_accepts_each_estimator():
    assert build_config("babyai", "smoke", ["algo.estimator=ppo", "algo.critic.lr=1e-4", "algo.lam=0.95",
                                            "algo.gamma=0.99"]).algo.critic.lr == 1e-4
    assert build_config("babyai", "smoke", ["algo.estimator=reinforce++", "algo.gamma=0.99"]).algo.gamma == 0.99
    assert build_config("babyai", "smoke", ["algo.estimator=rloo", "algo.loss_agg=seq-mean"]).algo.loss_agg == "seq-mean"
    c = build_config("babyai", "smoke", ["curriculum.mode=gated", "curriculum.gate.threshold=0.8"])
    assert c.curriculum.gate.threshold == 0.8


# --- per-turn credit: GiGPO and per-turn discounting -------------------------------------------------------
from core.advantages import (  # noqa: E402
    gigpo_reference,
    grpo_turn_reference,
    trajectory_advantages,
    turn_broadcast_reference,
    turn_rewards_reference,
)
from core.trajectory import turn_observations  # noqa: E402

TURN_ENDS = [3, 7]  # MASK's two turns end on tokens 3 and 7


def episode(group, states, rewards, window=False, masked=False):
    """A trajectory through ``states`` (the observation before each turn, then the final one): two action tokens
    per turn, env tokens between turns (with ``window``, a whole new prompt: a history-window sample)."""
    t = Trajectory(task_id=group, group_id=group)
    t.start([1, 2])
    t.first_observation = states[0]
    for k, r in enumerate(rewards):
        t.add_action([10 + k, 20 + k], [-0.1, -0.1])
        t.set_turn_reward(r)
        t.observations = (t.observations or []) + [states[k + 1]]
        if k < len(rewards) - 1:
            t.start_segment([7, 7, 7]) if window else t.add_env([5])
    t.finish("env_error" if masked else ("success" if sum(rewards) > 0 else "failure"), sum(rewards) > 0)
    return t


def per_turn(traj, row):
    """The advantage on each turn's two action tokens (asserting both carry it) and 0 on every other token."""
    out = []
    for e in traj.action_ends:
        assert row[e - 1] == pytest.approx(row[e], abs=1e-6)
        out.append(row[e])
    off = [row[t] for t in range(len(row)) if not traj.loss_mask[t]]
    assert off == [0] * len(off)
    return out


def gigpo_batch(window=False):
    return [
        # task 0: A and B both start in s0 and diverge; B comes back to s0 (that state is visited twice by B)
        episode(0, ["s0", "s1", "done"], [0.0, 1.0], window),  # A: s0 -> s1 -> success
        episode(0, ["s0", "s2", "s0", "s3"], [0.0, 0.0, 0.0], window),  # B: s0 -> s2 -> s0 -> turn limit
        episode(0, ["s0", "s1"], [1.0], window, masked=True),  # masked: no advantage, in no statistic
        # task 1: its own groups (the same text "s0" here is another task's state)
        episode(1, ["s0", "win"], [1.0], window),  # C
        episode(1, ["s0", "lose"], [0.0], window),  # D
        episode(2, ["s0", "s1", "done"], [0.0, 1.0], window),  # E: a group of one
    ]


@pytest.mark.parametrize("window", [False, True])
def test_gigpo_by_hand(window):
    trajs = gigpo_batch(window)
    assert turn_observations(trajs[1]) == ["s0", "s2", "s0"]
    # gamma .5, no std division, omega 1. Task 0 (A, B live; the masked one left out):
    #   episode returns A 1, B 0 -> mean .5 -> A_ep: A +.5, B -.5
    #   turn returns (gamma .5): A [0 + .5*1, 1] = [.5, 1]; B [0, 0, 0]
    #   step group (task 0, s0) = {A0 .5, B0 0, B2 0}: mean 1/6 -> A0 +1/3, B0 -1/6, B2 -1/6
    #   (task 0, s1) = {A1}, (task 0, s2) = {B1}: groups of one -> 0
    #   A: [.5 + 1/3, .5 + 0] ; B: [-.5 - 1/6, -.5 + 0, -.5 - 1/6]
    # Task 1: C 1, D 0 -> A_ep +-.5; step group (task 1, s0) = {1, 0} -> +-.5 -> C 1, D -1
    # Task 2: E alone -> episode and step groups of one -> 0 on both turns
    p = EstimatorParams(gamma=0.5, normalize_std=False, step_weight=1.0)
    adv, ret, stats = trajectory_advantages("gigpo", p, trajs)
    assert ret is None
    got = [per_turn(t, a) for t, a in zip(trajs, adv)]
    expect = [[0.5 + 1 / 3, 0.5], [-0.5 - 1 / 6, -0.5, -0.5 - 1 / 6], [0.0], [1.0], [-1.0], [0.0, 0.0]]
    for g, e in zip(got, expect):
        assert g == pytest.approx(e, abs=1e-6)
    assert adv[2] == [0.0] * len(adv[2])  # masked: 0 on every token
    # step groups of the 9 live turns: (0,s0) x3, (0,s1), (0,s2), (1,s0) x2, (2,s0), (2,s1): 6 groups, 5 turns shared
    assert stats["step_group_size_mean"] == pytest.approx(9 / 6)
    assert stats["turns_in_shared_step_groups"] == pytest.approx(5 / 9)
    # omega scales the step part only: omega 0 is GRPO's episode advantage on every turn
    adv0, _, _ = trajectory_advantages("gigpo", EstimatorParams(gamma=0.5, normalize_std=False, step_weight=0.0), trajs)
    assert [per_turn(t, a) for t, a in zip(trajs, adv0)][:2] == [pytest.approx([0.5] * 2), pytest.approx([-0.5] * 3)]
    # with the std division (population std, as grpo): task 0's episode returns {1, 0}: std .5 -> +-1;
    # step group {.5, 0, 0}: var ((1/3)^2 + 2 (1/6)^2) / 3 = 1/18 -> A0 (1/3)/sqrt(1/18) = sqrt 2, B0 = B2 = -sqrt(2)/2
    adv, _, _ = trajectory_advantages("gigpo", EstimatorParams(gamma=0.5), trajs)
    r2 = math.sqrt(2)
    assert per_turn(trajs[0], adv[0]) == pytest.approx([1 + r2, 1], abs=1e-4)
    assert per_turn(trajs[1], adv[1]) == pytest.approx([-1 - r2 / 2, -1, -1 - r2 / 2], abs=1e-4)


def test_gigpo_with_gamma_one_and_the_plain_reference():
    trajs = gigpo_batch()
    # gamma 1: turn returns A [1, 1], B [0, 0, 0]; (0, s0) = {1, 0, 0}: mean 1/3 -> A0 +2/3, B0 = B2 = -1/3
    adv, _, _ = trajectory_advantages("gigpo", EstimatorParams(gamma=1.0, normalize_std=False), trajs)
    assert per_turn(trajs[0], adv[0]) == pytest.approx([0.5 + 2 / 3, 0.5], abs=1e-6)
    assert per_turn(trajs[1], adv[1]) == pytest.approx([-0.5 - 1 / 3, -0.5, -0.5 - 1 / 3], abs=1e-6)
    ref = gigpo_reference([t.turn_rewards for t in trajs],
                          [[""] * t.turns if t.masked else turn_observations(t) for t in trajs],
                          [t.group_id for t in trajs], [t.masked for t in trajs], gamma=1.0, normalize_std=False)
    assert ref[0] == pytest.approx([0.5 + 2 / 3, 0.5]) and ref[2] == [0.0]
    assert_close(adv, turn_broadcast_reference(ref, [t.action_ends for t in trajs], [t.loss_mask for t in trajs]))


def test_gigpo_needs_the_observations_and_sane_turn_ends():
    t = episode(0, ["s0", "s1"], [1.0])
    t.first_observation = None
    with pytest.raises(ValueError, match="first observation"):
        trajectory_advantages("gigpo", EstimatorParams(), [t])
    rewards, masks = [REWARDS], [MASK]
    with pytest.raises(ValueError, match="needs batch.turn_ends"):
        run("gigpo", rewards, masks, [0])
    with pytest.raises(ValueError, match="needs batch.anchors"):
        run("gigpo", rewards, masks, [0], turn_ends=[TURN_ENDS])
    with pytest.raises(ValueError, match="2 anchors for 1 turns|1 anchors for 2 turns"):
        run("gigpo", rewards, masks, [0], turn_ends=[TURN_ENDS], anchors=[["a"]])
    with pytest.raises(ValueError, match="token 4, which is not a policy token"):
        run("gigpo", rewards, masks, [0], turn_ends=[[3, 4]], anchors=[["a", "b"]])
    with pytest.raises(ValueError, match="must increase"):
        run("gigpo", rewards, masks, [0], turn_ends=[[7, 3]], anchors=[["a", "b"]])
    with pytest.raises(ValueError, match="policy token 6 lies after the last turn end"):
        run("gigpo", [[0] * 9], masks, [0], turn_ends=[[3]], anchors=[["a"]])
    with pytest.raises(ValueError, match="non-policy token 8"):
        run("gigpo", [[0, 0, 0, 0, 0, 0, 0, 0, 1.0]], masks, [0], turn_ends=[TURN_ENDS], anchors=[["a", "b"]])


def test_reinforce_pp_per_turn_discount_by_hand():
    # gamma .8 per turn, no KL: turn 1 (tokens 2, 3) sees .5 + .8 * 1.0 = 1.3, turn 2 (6, 7) sees 1.0 (per token it
    # would be .8-discounted inside the turns too). Whitened: mean 1.15, deviations +-.15, std .15 -> +-1
    g = discounted_returns_reference([REWARDS], [MASK], 0.8, turn_ends=[TURN_ENDS])
    assert [g[0][t] for t in POLICY] == pytest.approx([1.3, 1.3, 1.0, 1.0])
    adv, _ = run("reinforce++", [REWARDS], [MASK], [0], kl=[KL], turn_ends=[TURN_ENDS], gamma=0.8, discount="turn")
    assert adv[0] == pytest.approx([0, 0, 1, 1, 0, 0, -1, -1, 0], abs=1e-4)
    # with the KL penalty (kl_coef .5): shaped pos2 -.05, pos3 .4, pos6 0, pos7 .85; factor 1 inside a turn:
    # pos7 .85, pos6 .85, pos3 .4 + .8 * .85 = 1.08, pos2 -.05 + 1.08 = 1.03
    shaped = [[(r - 0.5 * k) * m for r, k, m in zip(REWARDS, KL, MASK)]]
    g = discounted_returns_reference(shaped, [MASK], 0.8, turn_ends=[TURN_ENDS])
    assert [g[0][t] for t in POLICY] == pytest.approx([1.03, 1.08, 0.85, 0.85])
    mean = (1.03 + 1.08 + 0.85 + 0.85) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in (1.03, 1.08, 0.85, 0.85)) / 4)
    expect = [0, 0, (1.03 - mean) / std, (1.08 - mean) / std, 0, 0, (0.85 - mean) / std, (0.85 - mean) / std, 0]
    adv, _ = run("reinforce++", [REWARDS], [MASK], [0], kl=[KL], turn_ends=[TURN_ENDS], gamma=0.8, kl_coef=0.5,
                 discount="turn")
    assert adv[0] == pytest.approx(expect, abs=1e-4)
    assert reinforce_pp_reference([REWARDS], [MASK], [KL], 0.5, 0.8, turn_ends=[TURN_ENDS])[0] == \
        pytest.approx(expect, abs=1e-4)
    # gamma 1: per-turn and per-token discounting are the same
    a1, _ = run("reinforce++", [REWARDS], [MASK], [0], kl=[KL], turn_ends=[TURN_ENDS], kl_coef=0.5, discount="turn")
    a2, _ = run("reinforce++", [REWARDS], [MASK], [0], kl=[KL], kl_coef=0.5)
    assert a1[0] == pytest.approx(a2[0], abs=1e-6)


def test_grpo_per_turn_by_hand():
    # task 0, gamma .5, no std division: E1 [0, 1] (success at turn 2), E2 [0, 0] (fails at turn 2), E3 [0] (fails
    # at turn 1). Turn returns E1 [.5, 1], E2 [0, 0], E3 [0].
    #   turn-0 group {.5, 0, 0}: mean 1/6 -> E1 1/3, E2 -1/6, E3 -1/6
    #   turn-1 group {1, 0} (the samples that reached turn 2): mean .5 -> E1 .5, E2 -.5
    trajs = [episode(0, ["s0", "s1", "ok"], [0.0, 1.0]), episode(0, ["s0", "s1", "no"], [0.0, 0.0]),
             episode(0, ["s0", "no"], [0.0])]
    p = EstimatorParams(gamma=0.5, normalize_std=False, discount="turn")
    adv, _, _ = trajectory_advantages("grpo", p, trajs)
    got = [per_turn(t, a) for t, a in zip(trajs, adv)]
    for g, e in zip(got, [[1 / 3, 0.5], [-1 / 6, -0.5], [-1 / 6]]):
        assert g == pytest.approx(e, abs=1e-6)
    assert grpo_turn_reference([t.turn_rewards for t in trajs], [0, 0, 0], gamma=0.5, normalize_std=False) == \
        [pytest.approx([1 / 3, 0.5]), pytest.approx([-1 / 6, -0.5]), pytest.approx([-1 / 6])]
    # the default (per token = per sequence for grpo): returns {1, 0, 0}, mean 1/3 on every turn
    adv, _, _ = trajectory_advantages("grpo", EstimatorParams(normalize_std=False), trajs)
    assert [per_turn(t, a) for t, a in zip(trajs, adv)] == \
        [pytest.approx([2 / 3] * 2), pytest.approx([-1 / 3] * 2), pytest.approx([-1 / 3])]


def test_per_turn_discount_is_refused_where_undefined():
    for name in ("ppo", "rloo"):
        with pytest.raises(ValueError, match=f"not defined for {name}"):
            run(name, [REWARDS], [MASK], [0], values=[VALUES], turn_ends=[TURN_ENDS], discount="turn")
    with pytest.raises(ValueError, match="unknown discount"):
        run("grpo", [REWARDS], [MASK], [0], discount="step")


def random_turn_batch(rng: random.Random, B=9, groups=3):
    """Sequences of 1-5 turns (1-4 action tokens, rewards on any of them, 0-3 env tokens between: 0 makes two
    action turns adjacent), anchors from a small alphabet so step groups of every size occur."""
    rewards, masks, ends, anchors, grp, masked, kl = [], [], [], [], [], [], []
    for b in range(B):
        m = [0] * rng.randint(1, 3)
        r, e, a = [0.0] * len(m), [], []
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 4)
            m += [1] * n
            r += [rng.choice([0.0, 0.0, 1.0, -0.5, rng.uniform(-1, 2)]) for _ in range(n)]
            e.append(len(m) - 1)
            a.append(rng.choice("abcd"))
            k = rng.randint(0, 3)
            m += [0] * k
            r += [0.0] * k
        rewards.append(r)
        masks.append(m)
        ends.append(e)
        anchors.append(a)
        kl.append([rng.uniform(-0.5, 0.5) for _ in m])
        grp.append(rng.randrange(groups))
        masked.append(rng.random() < 0.15)
    return rewards, masks, ends, anchors, grp, masked, kl


@pytest.mark.parametrize("seed", range(8))
def test_per_turn_vectorised_matches_plain_loops(seed):
    rng = random.Random(seed)
    rewards, masks, ends, anchors, grp, masked, kl = random_turn_batch(rng)
    live = [not x for x in masked]
    turn_r = [turn_rewards_reference(r, m, e) for r, m, e in zip(rewards, masks, ends)]
    for gamma, norm, omega in ((1.0, True, 1.0), (0.9, True, 0.5), (0.7, False, 2.0)):
        adv, _ = run("gigpo", rewards, masks, grp, masked, turn_ends=ends, anchors=anchors, gamma=gamma,
                     normalize_std=norm, step_weight=omega)
        ref = gigpo_reference(turn_r, anchors, grp, masked, gamma, norm, omega)
        assert_close(adv, turn_broadcast_reference(ref, ends, masks))
        adv, _ = run("grpo", rewards, masks, grp, masked, turn_ends=ends, gamma=gamma, normalize_std=norm,
                     discount="turn")
        assert_close(adv, turn_broadcast_reference(grpo_turn_reference(turn_r, grp, masked, gamma, norm), ends, masks))
        adv, _ = run("reinforce++", rewards, masks, grp, masked, kl=kl, turn_ends=ends, kl_coef=0.3, gamma=gamma,
                     discount="turn")
        assert_close(adv, reinforce_pp_reference(rewards, masks, kl, 0.3, gamma, live, ends))


def test_gigpo_turns_in_a_one_state_group_equal_grpo_plus_its_step_part():
    """Every turn acting on the same single state (one anchor for all) with gamma 1 and one turn per episode: the
    step group is the episode group, so GiGPO is (1 + omega) x GRPO."""
    won, lost = [0, 0, 1, 1.0, 0], [0.0] * 5
    mask = [0, 0, 1, 1, 0]
    g, _ = run("grpo", [won, lost, won], [mask] * 3, [0, 0, 0])
    a, _ = run("gigpo", [won, lost, won], [mask] * 3, [0, 0, 0], turn_ends=[[3]] * 3, anchors=[["s"]] * 3,
               step_weight=0.5)
    assert_close(a, [[1.5 * x for x in row] for row in g])


def test_config_per_turn_options():
    assert build_config("babyai", "smoke", ["algo.estimator=gigpo", "algo.gamma=0.95",
                                            "algo.gigpo_step_weight=0.5"]).algo.gigpo_step_weight == 0.5
    assert build_config("babyai", "smoke", ["algo.estimator=grpo", "algo.discount=turn",
                                            "algo.gamma=0.9"]).algo.discount == "turn"
    assert build_config("babyai", "smoke", ["algo.estimator=reinforce++", "algo.discount=turn"]).algo.gamma == 1.0
    for bad, msg in ((["algo.estimator=ppo", "algo.discount=turn"], "not defined for 'ppo'"),
                     (["algo.estimator=rloo", "algo.discount=turn"], "not defined for 'rloo'"),
                     (["algo.discount=step"], "algo.discount"),
                     (["algo.gigpo_step_weight=2"], "does nothing for 'grpo'"),
                     (["algo.estimator=gigpo", "algo.gigpo_step_weight=-1"], "gigpo_step_weight"),
                     (["algo.estimator=gigpo", "algo.gigpo_step_weight=inf"], "gigpo_step_weight"),
                     (["algo.estimator=rloo", "algo.gamma=0.9"], "does nothing for 'rloo'")):
        with pytest.raises(ConfigError, match=msg):
            build_config("babyai", "smoke", bad)
    # the algo section gives the estimator its parameters
    a = build_config("babyai", "smoke", ["algo.estimator=gigpo", "algo.gamma=0.95", "algo.gigpo_step_weight=0.5"]).algo
    p = EstimatorParams.from_algo(a)
    assert (p.gamma, p.step_weight, p.discount, p.normalize_std) == (0.95, 0.5, "token", True)
