"""The levers that keep RL from making a competent agent worse (issue 44), on hand-computed cases: the pure part
(core.levers, the filtered-BC estimator, the relabel sample's layout), then each lever through the product's own
code: a skipped step leaves weights and optimizer state bit-identical, dynamic sampling's batch holds the groups
with signal, the expert term's gradient is coef x the gradient of the expert replies' token-mean NLL, and
truncated episodes leave the loss."""

from __future__ import annotations

import math

import pytest
import torch

from core.advantages import EstimatorParams, filtered_bc_reference, trajectory_advantages
from core.levers import (all_succeeded, expert_coef_at, fits_turns, group_has_variance, has_signal, keep_groups,
                         mask_truncated, relabel_turns, replay_advantages, solved_groups)
from core.seeds import round_seed, step_seed
from core.trajectory import Trajectory, relabel_sample, reply_starts


# --- pure ------------------------------------------------------------------------------------------------
def test_has_signal():
    assert not has_signal([[0.0, 0.0], [0.0]])
    assert has_signal([[0.0, 0.0], [0.0, -0.25]])
    assert has_signal([[0.0]], expert_samples=1)
    assert not has_signal([])
    with pytest.raises(ValueError):
        has_signal([[0.0]], expert_samples=-1)


def test_group_has_variance():
    assert not group_has_variance([0.0, 0.0, 0.0, 0.0])
    assert not group_has_variance([0.9, 0.9])
    assert group_has_variance([0.0, 0.0, 0.9, 0.0])
    assert not group_has_variance([1.0, 0.0], masked=[False, True])  # one live sample: no baseline
    assert not group_has_variance([])
    with pytest.raises(ValueError):
        group_has_variance([1.0, 0.0], masked=[False])


def test_keep_groups_takes_groups_with_variance_in_round_order():
    rounds = [[False, True, False, False], [True, False, True, True]]
    assert keep_groups(rounds, 4) == [(0, 1), (1, 0), (1, 2), (1, 3)]
    assert keep_groups(rounds, 2) == [(0, 1), (1, 0)]
    assert keep_groups([[False, False]], 2) == []
    with pytest.raises(ValueError):
        keep_groups(rounds, 0)


def test_all_succeeded_and_the_solved_groups_to_replay():
    assert all_succeeded([True, True]) and not all_succeeded([True, False]) and not all_succeeded([])
    assert all_succeeded([True, False], [False, True])  # the failed sample was masked (a crashed server)
    assert not all_succeeded([True], [True])  # nothing live
    with pytest.raises(ValueError):
        all_succeeded([True], [False, False])
    solved = [[False, True, True], [True, False]]  # round 0: groups 1, 2 solved; round 1: group 0
    assert solved_groups(solved, [(0, 0)], 2) == [(0, 1), (0, 2)]
    assert solved_groups(solved, [(0, 1)], 5) == [(0, 2), (1, 0)]  # one already in the batch is not taken twice
    assert solved_groups(solved, [], 0) == []
    with pytest.raises(ValueError):
        solved_groups(solved, [], -1)


def test_replay_advantages_put_the_coefficient_on_the_replayed_rows_action_tokens():
    adv = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    masks = [[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert replay_advantages(adv, masks, [True, False, True], 0.5) == [[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0],
                                                                      [0.0, 0.0, 0.5, 0.5]]
    assert replay_advantages(adv, masks, [False] * 3, 1.0) == adv
    with pytest.raises(ValueError):
        replay_advantages(adv, masks, [True], 1.0)
    with pytest.raises(ValueError):
        replay_advantages(adv, masks, [True] * 3, 0.0)


def test_mask_truncated_zeroes_rows_cut_by_a_limit():
    adv = [[0.0, 1.5, 1.5], [0.0, -0.5], [0.0, -0.5, -0.5], [0.0, -0.5]]
    reasons = ["success", "turn_limit", "failure", "token_budget"]
    assert mask_truncated(adv, reasons) == [[0.0, 1.5, 1.5], [0.0, 0.0], [0.0, -0.5, -0.5], [0.0, 0.0]]
    with pytest.raises(ValueError):
        mask_truncated(adv, reasons[:2])


def test_expert_coef_decays_linearly_over_the_run():
    assert expert_coef_at(0.5, "none", 7, 12) == 0.5
    assert expert_coef_at(0.5, "linear", 0, 12) == 0.5
    assert expert_coef_at(0.6, "linear", 6, 12) == pytest.approx(0.3)
    assert expert_coef_at(0.6, "linear", 11, 12) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        expert_coef_at(0.5, "cosine", 0, 12)
    with pytest.raises(ValueError):
        expert_coef_at(0.5, "linear", 12, 12)


def test_relabel_turns_picks_the_first_turns_that_leave_the_expert():
    mine = ["Action: go to red ball 1", "Action: turn left", "Action: pick up", "Action: toggle"]
    expert = ["action: go to red ball 1 ", "Action: move forward", "Action: pick up", "Action: open door",
              "Action: done"]  # one more entry: the state after the last turn
    assert relabel_turns(mine, expert, 1) == [1]
    assert relabel_turns(mine, expert, 5) == [1, 3]
    assert relabel_turns(mine, [None, None, "Action: pick up", None], 2) == []
    assert relabel_turns(mine, expert, 0) == []


def test_fits_turns():
    assert fits_turns(3, 3) and fits_turns(1, 3) and fits_turns(None, 3)
    assert not fits_turns(4, 3)


def test_round_seed_keeps_round_zero_and_separates_later_rounds():
    base = step_seed(7, 3)
    assert round_seed(base, 0) == base
    seeds = {round_seed(step_seed(s, g), r) for s in range(3) for g in range(50) for r in range(4)}
    assert len(seeds) == 3 * 50 * 4


def _traj(task: int, group: int, reward: float, reason: str, turns: int = 2) -> Trajectory:
    t = Trajectory(task_id=task, group_id=group)
    t.start([1, 2, 3])
    for k in range(turns):
        t.add_action([10 + k, 20 + k], [-1.0, -1.0])
        if k == turns - 1:
            t.set_turn_reward(reward)
        else:
            t.add_env([5, 6])
    t.finish(reason, success=reward > 0)
    return t


def test_filtered_bc_scores_successes_one_and_everything_else_zero():
    assert filtered_bc_reference([0.9, 0.0, 0.0, 0.5], [False, False, True, True]) == [1.0, 0.0, 0.0, 0.0]
    trajs = [_traj(0, 0, 0.9, "success"), _traj(0, 0, 0.0, "failure"), _traj(1, 1, 0.0, "turn_limit")]
    adv, _, _ = trajectory_advantages("filtered-bc", EstimatorParams(), trajs)
    assert adv[0] == [float(m) for m in trajs[0].loss_mask]  # 1 on every policy token of the success
    assert adv[1] == [0.0] * len(trajs[1].token_ids) and adv[2] == [0.0] * len(trajs[2].token_ids)


def test_relabel_sample_is_the_context_of_the_turn_then_the_expert_reply():
    t = _traj(0, 0, 0.0, "failure", turns=3)
    # prompt 1 2 3 | turn 0: 10 20 | env 5 6 | turn 1: 11 21 | env 5 6 | turn 2: 12 22
    assert reply_starts(t) == [3, 7, 11]
    ids, mask = relabel_sample(t, 1, [99, 98])
    assert ids == [1, 2, 3, 10, 20, 5, 6, 99, 98]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    ids0, mask0 = relabel_sample(t, 0, [7])
    assert ids0 == [1, 2, 3, 7] and mask0 == [0, 0, 0, 1]
    with pytest.raises(ValueError):
        relabel_sample(t, 3, [7])


def test_relabel_sample_under_a_history_window_starts_at_the_turns_own_sample():
    t = Trajectory(task_id=0, group_id=0)
    t.start([1, 2])
    t.add_action([10], [-1.0])
    t.start_segment([3, 4, 10, 5])  # turn 1's own prompt: instruction, the last turn, the new observation
    t.add_action([11], [-1.0])
    assert t.segment_starts == [0, 3]
    ids, mask = relabel_sample(t, 1, [99])
    assert ids == [3, 4, 10, 5, 99] and mask == [0, 0, 0, 0, 1]


# --- through the config ------------------------------------------------------------------------------------
def test_config_refuses_levers_that_cannot_apply(monkeypatch):
    import tasks.demos
    from core.config import ConfigError
    from flows.config import build_config

    with pytest.raises(ConfigError, match="expert_coef"):
        build_config("babyai", overrides=["algo.expert_turns=2"])
    with pytest.raises(ConfigError, match="dynamic_sampling_rounds"):
        build_config("babyai", overrides=["rollout.dynamic_sampling_rounds=2", "algo.estimator=ppo"])
    with pytest.raises(ConfigError, match="torch learner"):
        build_config("babyai", overrides=["algo.expert_coef=0.1", "learner.engine=deepspeed"])
    cfg = build_config("babyai", overrides=["algo.expert_coef=0.2", "algo.expert_decay=linear",
                                            "rollout.dynamic_sampling_rounds=2", "algo.skip_no_signal=true",
                                            "algo.truncated=mask", "rollout.task_filter=fits_turns"])
    assert cfg.algo.expert_coef == 0.2 and cfg.rollout.dynamic_sampling_rounds == 2
    with pytest.raises(ConfigError, match="replay_solved.*ppo"):
        build_config("babyai", overrides=["algo.replay_solved=2", "algo.estimator=ppo"])
    assert build_config("babyai", overrides=["algo.replay_solved=2"]).algo.replay_solved == 2
    with pytest.raises(ConfigError, match="expert_groups.*reinforce"):
        build_config("babyai", overrides=["algo.expert_groups=true", "algo.estimator=reinforce++"])
    for est in ("grpo", "filtered-bc"):  # a group's successes, or filtered-bc's: the expert's episode is one of them
        assert build_config("babyai", overrides=["algo.expert_groups=true", f"algo.estimator={est}"]).algo.expert_groups

    def no_expert(env):
        raise tasks.demos.DemoError(f"env {env!r} has no scripted expert")

    monkeypatch.setattr(tasks.demos, "expert_for", no_expert)
    with pytest.raises(ConfigError, match="no scripted expert.*algo.expert_coef=0"):
        build_config("babyai", overrides=["algo.expert_coef=0.1"])
    build_config("babyai")  # the term off: no expert needed
    with pytest.raises(ConfigError, match="remaining turns.*textcraft"):
        build_config("textcraft", overrides=["algo.shaping_coef=0.1"])


# --- through the learner and the step tasks ------------------------------------------------------------------
from tests.test_learning import _fixed_batch, tiny_model_dir  # noqa: E402,F401  (the tiny policy's fixture)


def _expert_rows(tok, trajs):
    """One relabel per trajectory: its second turn's state, answered with the digit '7' + EOS."""
    from core.chat import ChatFormat

    reply = ChatFormat.from_tokenizer(tok).encode("7") + [tok.eos_token_id]
    return [(*relabel_sample(t, 1, reply), t.group_id) for t in trajs]


def test_expert_term_gradient_is_coef_times_the_nll_gradient(tiny_model_dir):
    """With every advantage 0 and no KL, an update's gradient is the expert term's alone: mu x the gradient of the
    token-mean NLL of the relabelled replies, computed here straight from the model's logits (log-softmax, the
    reply tokens' log-probs, their mean)."""
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from tests.grads import record_grads

    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=False, length_buckets=0)
    learner = TorchLearner(tiny_model_dir, cfg)
    trajs, advs = _fixed_batch(learner.tokenizer, n=4)
    zero = [[0.0] * len(a) for a in advs]
    rows = _expert_rows(learner.tokenizer, trajs)
    mu = 0.3
    grads = record_grads(learner)
    stats = learner.update(trajs, zero, prepared=learner.prepare(trajs), expert=(rows, mu))
    n_tok = sum(sum(m) for _, m, _ in rows)
    assert stats["expert_tokens"] == n_tok == 8 and stats["expert_samples"] == 4

    ref = TorchLearner(tiny_model_dir, cfg).model
    total = 0.0
    for ids, mask, _ in rows:
        logits = ref(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        total = total - (logp * torch.tensor(mask[1:], dtype=torch.float32)).sum()
    (mu * total / n_tok).backward()
    assert stats["expert_nll"] == pytest.approx(float(total) / n_tok, rel=1e-4)
    for name, p in ref.named_parameters():
        if p.grad is not None and float(p.grad.abs().max()) > 0:
            assert torch.allclose(grads[name], p.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("case", ["shared-prompt", "buckets", "bf16-grads", "bf16-autocast", "skipped-home"])
def test_expert_relabels_as_branches_give_the_update_of_relabels_as_sequences(tiny_model_dir, case):
    """Relabels run as branches of their episodes' training forwards (algo.expert_branches, the default: the
    expert's reply attends to the episode's cached keys and values) give the gradients and expert stats that each
    relabel run as its own sequence gives, with nonzero advantages and a KL term in the same backward. A relabel
    whose context starts no trained sequence (another group; an episode the update skips) runs on its own."""
    from core.chat import ChatFormat
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from tests.grads import record_grads

    kw = dict(lr=1e-3, kl_coef=0.01, micro_batch_size=2, bf16_autocast=False, length_buckets=0, share_prefix=True)
    kw.update({"shared-prompt": {}, "buckets": dict(length_buckets=8, share_prefix=False),
               "bf16-grads": dict(grad_dtype="bf16"), "bf16-autocast": dict(bf16_autocast=True),
               "skipped-home": dict(kl_coef=0.0, skip_zero_advantage=True)}[case])
    stats, grads = {}, {}
    for branches in (True, False):
        learner = TorchLearner(tiny_model_dir, LearnerConfig(**kw, expert_branches=branches))
        tok = learner.tokenizer
        trajs, advs = _fixed_batch(tok, n=6)
        if case == "skipped-home":  # group 0's episodes have no signal: skipped, so their relabels run on their own
            advs = [[0.0] * len(a) if t.group_id == 0 else a for t, a in zip(trajs, advs)]
        eos = [tok.eos_token_id]
        rows = _expert_rows(tok, trajs)
        rows.append((*relabel_sample(trajs[0], 0, ChatFormat.from_tokenizer(tok).encode("3") + eos), 0))  # turn 0
        rows.append((*relabel_sample(trajs[3], 1, eos), trajs[3].group_id))  # a one-token reply: no branch forward
        rows.append((rows[0][0], rows[0][1], 99))  # a group no sequence has: its own sequence
        grads[branches] = record_grads(learner)
        stats[branches] = learner.update(trajs, advs, prepared=learner.prepare(trajs), expert=(rows, 0.5))
    a, b = stats[True], stats[False]
    assert b["expert_branched"] == 0
    assert a["expert_branched"] == (len(rows) - 1 if case != "skipped-home" else len(rows) - 1 - 3)
    assert a["expert_samples"] == b["expert_samples"] == len(rows)
    assert a["expert_tokens"] == b["expert_tokens"]
    bf16 = case.startswith("bf16")  # bf16 values: the two paths' sums round differently
    assert a["expert_nll"] == pytest.approx(b["expert_nll"], rel=1e-2 if bf16 else 1e-5)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-2 if bf16 else 1e-5, abs=1e-7)
    rtol, atol = (2e-2, 1e-4) if bf16 else (1e-4, 1e-6)
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        assert torch.allclose(grads[True][name], g, rtol=rtol, atol=atol), name


def _step_session(tiny_model_dir, **algo):
    """A training session of the tiny policy (no engine: a backend whose sync only counts) in the open Runtime."""
    from core.config import RunConfig
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.context import Runtime, Session

    cfg = RunConfig.model_validate({"env": {"name": "toy"}, "algo": {"lr": 1e-2, "kl_coef": 0.0, **algo},
                                    "rollout": {"backend": "transformers"}})

    class Backend:
        syncs = 0

        def sync_weights(self):
            Backend.syncs += 1

    s = Session(cfg=cfg, learner=TorchLearner(tiny_model_dir, LearnerConfig.from_run(cfg)), backend=Backend())
    s.tokenizer = s.learner.tokenizer
    return Runtime.current().add_session(s), s, Backend


def _snapshot(learner):
    weights = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    opt = {k: {n: (x.clone() if torch.is_tensor(x) else x) for n, x in st.items()}
           for k, st in learner.opt.state_dict()["state"].items()}
    return weights, opt


def _same(a, b) -> bool:
    (wa, oa), (wb, ob) = a, b
    if wa.keys() != wb.keys() or oa.keys() != ob.keys():
        return False
    if any(not torch.equal(wa[k], wb[k]) for k in wa):
        return False
    return all((torch.equal(x, ob[k][n]) if torch.is_tensor(x) else x == ob[k][n])
               for k, st in oa.items() for n, x in st.items())


@pytest.mark.parametrize("skip", [True, False])
def test_a_step_without_signal_changes_nothing_when_skipped(tiny_model_dir, skip):
    """After a step with signal (Adam has momentum), a batch whose advantages are all 0: with algo.skip_no_signal
    the weights and the optimizer state stay bit-identical and the engine gets no sync; without it Adam's momentum
    moves the weights anyway (the drift the lever stops)."""
    from runtime.context import Runtime
    from tasks.steps import Advantages, Batch, policy_update

    with Runtime():
        key, s, backend = _step_session(tiny_model_dir, skip_no_signal=skip)
        trajs, advs = _fixed_batch(s.tokenizer)
        batch = Batch(trajs, {})
        out = policy_update.fn(key, batch, Advantages(advs, None, s.learner.prepare(trajs), {}), 0)
        assert out["skipped"] == 0.0 and backend.syncs == 1
        before = _snapshot(s.learner)
        zero = [[0.0] * len(a) for a in advs]
        out = policy_update.fn(key, batch, Advantages(zero, None, s.learner.prepare(trajs), {}), 1)
        after = _snapshot(s.learner)
        if skip:
            assert out["skipped"] == 1.0 and backend.syncs == 1
            assert _same(before, after)
        else:
            assert out["skipped"] == 0.0 and backend.syncs == 2
            assert any(not torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_an_expert_relabel_is_signal_for_a_skipping_step(tiny_model_dir, monkeypatch):
    """A batch without advantage but with expert relabels is trained (the expert term), not skipped."""
    import tasks.steps as T
    from runtime.context import Runtime

    with Runtime():
        key, s, backend = _step_session(tiny_model_dir, skip_no_signal=True, expert_coef=0.5)
        trajs, advs = _fixed_batch(s.tokenizer)
        rows = _expert_rows(s.tokenizer, trajs)
        monkeypatch.setattr(T, "expert_samples", lambda sess, tr: rows)
        zero = [[0.0] * len(a) for a in advs]
        before = _snapshot(s.learner)
        out = T.policy_update.fn(key, T.Batch(trajs, {}), T.Advantages(zero, None, s.learner.prepare(trajs), {}), 0)
        assert out["skipped"] == 0.0 and out["expert_samples"] == len(rows) and backend.syncs == 1
        assert not _same(before, _snapshot(s.learner))


def test_dynamic_sampling_keeps_the_groups_with_signal(monkeypatch):
    """Round 1: groups 0 and 2 without variance, 1 and 3 with; round 2 (fresh tasks): group 0 with, 1 without, 2
    with. The step trains on round 1's groups 1, 3 then round 2's 0, 2 (tasks_per_step 4), renumbered 0-3, and
    logs what it rolled, kept and dropped."""
    import tasks.steps as T
    from core.config import RunConfig
    from runtime.context import Runtime, Session

    cfg = RunConfig.model_validate({"env": {"name": "toy"}, "rollout": {
        "backend": "transformers", "tasks_per_step": 4, "samples_per_task": 2, "dynamic_sampling_rounds": 3}})
    rewards = {0: [(0, 0), (0, 1), (1, 1), (1, 0)], 1: [(1, 0), (0, 0), (1, 0), (0, 1)]}
    calls = []

    def fake_rollout(s, urls, tasks, samples, limit, temp, max_new, label, seed=None, after_turn=None, expert=None):
        k = len(calls)
        calls.append((tasks, seed))
        trajs = [_traj(task, g, float(r), "success" if r else "failure")
                 for g, (task, pair) in enumerate(zip(tasks, rewards[k])) for r in pair]
        return trajs, {"rollout_time_s": 1.0, "generated_tokens": 10.0}

    monkeypatch.setattr(T, "_rollout", fake_rollout)
    with Runtime() as rt:
        key = rt.add_session(Session(cfg=cfg))
        b = T.rollout_batch.fn(key, [], 5, 2)
    assert len(calls) == 2  # four groups with signal after the second round: no third
    assert calls[0] == (T.train_tasks_for_step(cfg, 5), step_seed(0, 5))
    assert calls[1] == (T.train_tasks_for_step(cfg, 5, 1), round_seed(step_seed(0, 5), 1))
    t0, t1 = calls[0][0], calls[1][0]
    assert [t.task_id for t in b.trajectories] == [t0[1]] * 2 + [t0[3]] * 2 + [t1[0]] * 2 + [t1[2]] * 2
    assert [t.group_id for t in b.trajectories] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert b.metrics["dyn/rounds"] == 2 and b.metrics["dyn/groups_rolled"] == 8
    assert b.metrics["dyn/groups_kept"] == 4 and b.metrics["dyn/groups_dropped"] == 4
    assert b.metrics["dyn/first_round_zero_var_frac"] == 0.5
    assert b.metrics["rollout_time_s"] == 2.0 and b.metrics["episodes"] == 16  # what the policy did: both rounds


def test_replay_solved_keeps_the_solved_groups_the_refill_dropped(monkeypatch):
    """As above, with algo.replay_solved=1: round 1's group 2 (both samples succeeded) joins the batch after the four
    groups with signal as group 4, the one replayed group. Without a refill, a batch's own solved group is replayed."""
    import tasks.steps as T
    from core.config import RunConfig
    from runtime.context import Runtime, Session

    rewards = {0: [(0, 0), (0, 1), (1, 1), (1, 0)], 1: [(1, 0), (0, 0), (1, 0), (0, 1)]}
    for rounds, want_groups, want_replay in ((3, 5, [4]), (0, 4, [2])):
        cfg = RunConfig.model_validate({"env": {"name": "toy"}, "algo": {"replay_solved": 1}, "rollout": {
            "backend": "transformers", "tasks_per_step": 4, "samples_per_task": 2, "dynamic_sampling_rounds": rounds}})
        calls = []

        def fake_rollout(s, urls, tasks, samples, limit, temp, max_new, label, seed=None, after_turn=None,
                         expert=None):
            k = len(calls)
            calls.append(tasks)
            return [_traj(task, g, float(r), "success" if r else "failure")
                    for g, (task, pair) in enumerate(zip(tasks, rewards[k])) for r in pair], {}

        monkeypatch.setattr(T, "_rollout", fake_rollout)
        with Runtime() as rt:
            key = rt.add_session(Session(cfg=cfg))
            b = T.rollout_batch.fn(key, [], 5, 2)
        assert len({t.group_id for t in b.trajectories}) == want_groups and b.replay_groups == want_replay
        assert b.metrics["replay_groups"] == 1.0
        replayed = [t for t in b.trajectories if t.group_id in b.replay_groups]
        assert [t.task_id for t in replayed] == [calls[0][2]] * 2 and all(t.success for t in replayed)


def test_replay_solved_takes_the_batchs_own_solved_group_when_the_refill_dropped_none(monkeypatch):
    """Dynamic sampling on, round 1's four groups all with reward variance (no refill round), group 0 solved by both
    samples in different numbers of turns (rewards 1.0 and 0.9): no solved group was dropped, so the batch's own
    solved group 0 is the one replayed (as the groups@10+replay arm ran; a refactor once left it out)."""
    import tasks.steps as T
    from core.config import RunConfig
    from runtime.context import Runtime, Session

    cfg = RunConfig.model_validate({"env": {"name": "toy"}, "algo": {"replay_solved": 2}, "rollout": {
        "backend": "transformers", "tasks_per_step": 4, "samples_per_task": 2, "dynamic_sampling_rounds": 1}})
    calls = []

    def fake_rollout(s, urls, tasks, samples, limit, temp, max_new, label, seed=None, after_turn=None, expert=None):
        calls.append(tasks)
        return [_traj(task, g, float(r), "success" if r else "failure")
                for g, (task, pair) in enumerate(zip(tasks, [(1, 0.9), (0, 1), (1, 0), (0, 1)])) for r in pair], {}

    monkeypatch.setattr(T, "_rollout", fake_rollout)
    with Runtime() as rt:
        key = rt.add_session(Session(cfg=cfg))
        b = T.rollout_batch.fn(key, [], 5, 2)
    assert len(calls) == 1 and b.metrics["dyn/groups_kept"] == 4
    assert b.replay_groups == [0] and b.metrics["replay_groups"] == 1.0


def test_replayed_groups_get_the_coefficient_and_the_others_their_grpo_advantage():
    """Group 0 {1, 0} (GRPO without std: +0.5, -0.5), group 1 {1, 1} replayed at 0.3 (its GRPO advantage is 0), one of
    its samples masked (a crashed server: it stays at 0)."""
    import tasks.steps as T
    from core.config import RunConfig
    from runtime.context import Runtime, Session

    class Learner:
        def prepare(self, samples, old_for_reward=False):
            return None

    trajs = [_traj(0, 0, 1.0, "success"), _traj(0, 0, 0.0, "failure"), _traj(1, 1, 1.0, "success"),
             _traj(1, 1, 1.0, "success"), _traj(1, 1, 1.0, "success")]
    trajs[4].masked = True
    cfg = RunConfig.model_validate({"env": {"name": "toy"}, "rollout": {"backend": "transformers"},
                                    "algo": {"normalize_std": False, "replay_solved": 1, "replay_coef": 0.3}})
    with Runtime() as rt:
        key = rt.add_session(Session(cfg=cfg, learner=Learner()))
        adv = T.compute_advantages.fn(key, T.Batch(trajs, {}, [1]))
    for row, t, w in zip(adv.advantages, trajs, [0.5, -0.5, 0.3, 0.3, 0.0]):
        assert row == pytest.approx([w * m for m in t.loss_mask])
    assert adv.stats["replayed_episodes"] == 2 and adv.stats["episodes_with_signal"] == 4


def _step_advantages(trajs: list[Trajectory], **algo):
    """``tasks.steps.compute_advantages`` on ``trajs`` for a toy run with these ``algo`` settings (a learner with
    nothing to prepare: no old or reference log-probs, no critic)."""
    import tasks.steps as T
    from core.config import RunConfig
    from runtime.context import Runtime, Session

    class Learner:
        def prepare(self, samples, old_for_reward=False):
            return None

    cfg = RunConfig.model_validate({"env": {"name": "toy"}, "rollout": {"backend": "transformers"}, "algo": algo})
    with Runtime() as rt:
        key = rt.add_session(Session(cfg=cfg, learner=Learner()))
        return T.compute_advantages.fn(key, T.Batch(trajs, {}))


def test_truncated_episodes_leave_the_loss_but_not_the_baseline(monkeypatch):
    """GRPO over a group {success 1, turn limit, failure, turn limit} without std: advantages +0.75, -0.25, -0.25,
    -0.25; with algo.truncated=mask the two truncated rows become 0 and the others keep theirs (the truncated
    episodes still count in the group's mean)."""
    trajs = [_traj(0, 0, 1.0, "success"), _traj(0, 0, 0.0, "turn_limit"), _traj(0, 0, 0.0, "failure"),
             _traj(0, 0, 0.0, "turn_limit")]
    for mode, want in (("fail", [0.75, -0.25, -0.25, -0.25]), ("mask", [0.75, 0.0, -0.25, 0.0])):
        adv = _step_advantages(trajs, normalize_std=False, truncated=mode)
        for row, t, w in zip(adv.advantages, trajs, want):
            assert row == pytest.approx([w * m for m in t.loss_mask])
        assert adv.stats["episodes_with_signal"] == (4 if mode == "fail" else 2)


def test_seed_task_bootstrap_widens_with_seed_spread():
    """A table whose seeds disagree (one seed +1 on every task, the other 0) has mean 0.5 and an interval that
    reaches both seeds' means (a replicate can draw one seed twice); a table whose seeds agree on every task
    (half +1, half 0) has the same mean and a narrower, task-level interval."""
    from core.stats import seed_task_bootstrap

    spread = [[1.0] * 40, [0.0] * 40]
    agree = [[1.0, 0.0] * 20, [1.0, 0.0] * 20]
    m, lo, hi = seed_task_bootstrap(spread)
    assert m == 0.5 and lo == 0.0 and hi == 1.0
    m2, lo2, hi2 = seed_task_bootstrap(agree)
    assert m2 == 0.5 and 0.2 < lo2 < 0.5 < hi2 < 0.8
    assert math.isnan(seed_task_bootstrap([])[0])


def test_seed_cluster_bootstrap_counts_a_cluster_that_moves_together_once():
    """40 tasks in 2 clusters of 20: one cluster all solved, the other none (one strategy per level). Drawn by task,
    the mean is pinned near 0.5; drawn by cluster, a replicate draws the same cluster twice half the time, so the
    interval reaches 0 and 1. With one cluster per task it is the task-level bootstrap's kind of interval."""
    from core.stats import seed_cluster_bootstrap, seed_task_bootstrap

    x = [[1.0] * 20 + [0.0] * 20, [1.0] * 20 + [0.0] * 20]
    levels = ["a"] * 20 + ["b"] * 20
    assert seed_cluster_bootstrap(x, levels) == (0.5, 0.0, 1.0)
    _, lo, hi = seed_task_bootstrap(x)
    assert 0.3 < lo < 0.5 < hi < 0.7
    m, lo1, hi1 = seed_cluster_bootstrap(x, list(range(40)))  # every task its own cluster
    assert m == 0.5 and 0.3 < lo1 < 0.5 < hi1 < 0.7
    mixed = [[1.0, 0.0] * 20, [1.0, 0.0] * 20]  # each cluster half solved: clusters agree, interval narrow
    assert seed_cluster_bootstrap(mixed, levels) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="2 cluster labels for 40 tasks"):
        seed_cluster_bootstrap(x, ["a", "b"])
    assert math.isnan(seed_cluster_bootstrap([], [])[0])


def test_the_kl_reference_of_every_phase_is_the_runs_starting_model(tmp_path, monkeypatch):
    """Phase 2 starts from phase 1's final checkpoint, but its KL reference is the run's model.path (the warm start
    when a run starts from one), not the previous phase: the anchor is where the run started."""
    import flows.scalinginter as F
    from flows.config import build_config
    from tasks.resume import PhasePlan

    warm, p1 = tmp_path / "warm", tmp_path / "phase-1-final"
    for d in (warm, p1):
        d.mkdir()
    cfg = build_config("babyai", "multistep", [f"model.path={warm}", f"output_dir={tmp_path / 'out'}",
                                               "run_name=anchor", "algo.kl_coef=0.05"])
    seen = {}

    def fake_open(c, model_dir, train, reference_dir=None):
        seen.update(model_dir=model_dir, reference_dir=reference_dir)
        raise RuntimeError("stop here")

    monkeypatch.setattr(F.T, "open_session", fake_open)
    monkeypatch.setattr(F, "resume_source", lambda c, plan, ref: (ref, ref, False))
    monkeypatch.setattr(F, "local_model_dir", lambda c, ref: str(ref))
    with pytest.raises(RuntimeError, match="stop here"):
        F.open_phase(cfg, PhasePlan.of(cfg, 2), str(p1))
    assert seen == {"model_dir": str(p1), "reference_dir": str(warm)}


def test_potential_shaping_telescopes_to_the_progress_made():
    """Phi = -remaining turns: remaining 5, 4, 4, 6, 0 over four turns gives 1, 0, -2, 6 (a turn that undoes
    progress is charged for it), and the sum is remaining[0] - remaining[T] = 5 whatever the path."""
    from core.levers import potential_shaping

    assert potential_shaping([5, 4, 4, 6, 0], 4, 1.0) == [1.0, 0.0, -2.0, 6.0]
    assert sum(potential_shaping([5, 4, 4, 6, 0], 4, 1.0)) == 5 - 0
    assert potential_shaping([5, 4, 4, 6, 0], 4, 0.1) == pytest.approx([0.1, 0.0, -0.2, 0.6])
    for path in ([7, 6, 5, 8, 9, 3], [7, 7, 7, 7, 7, 3], [7, 2, 9, 1, 4, 3]):
        assert sum(potential_shaping(path, 5, 0.5)) == pytest.approx(0.5 * (7 - 3))
    assert potential_shaping([5, None, 3], 2, 1.0) == [0.0, 0.0]  # unknown counts give no shaping
    assert potential_shaping([5, 4], 3, 1.0) == [1.0, 0.0, 0.0]  # missing counts too


def test_babyai_reports_the_experts_remaining_turns_and_the_run_shapes_with_them():
    """The env's remaining-turns label counts down along the expert's own path to 0 at success; a shaped
    trajectory's turn rewards gain Phi(s') - Phi(s) and its own rewards stay as the env gave them."""
    from envs.babyai.env import BabyAIEnv
    from tasks.steps import shaped

    env = BabyAIEnv("GoToLocal,PutNextS4N1", label_remaining=True)
    _, info = env.reset(1)
    rem = [info["expert_remaining_turns"]]
    assert rem[0] == info["required_turns"] >= 2
    while True:
        r = env.step(env.expert_next_action())
        rem.append(r.info["expert_remaining_turns"])
        if r.done:
            break
    assert r.info["success"] and rem == list(range(rem[0], -1, -1))
    t = _traj(0, 0, 1.0, "success", turns=2)
    t.expert_remaining = [3, 1, 0]
    s = shaped([t], 0.1)[0]
    assert s.turn_rewards == pytest.approx([0.2, 1.1]) and t.turn_rewards == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="label_remaining"):
        shaped([_traj(0, 0, 1.0, "success")], 0.1)


def test_all_failed():
    from core.levers import all_failed

    assert all_failed([False, False]) and not all_failed([False, True])
    assert all_failed([False, True], masked=[False, True])  # the success was masked: the live ones all failed
    assert not all_failed([True], masked=[True]) and not all_failed([])


def test_expert_episodes_complete_the_all_fail_groups_through_a_real_env_server():
    """Group 0 failed everywhere, group 1 has a success: only group 0 gets the expert's episode of its task, run on
    a real BabyAI env server through the rollout's framing (a success, marked expert_demo, loss mask 1 on replies)."""
    from transformers import AutoTokenizer

    import tasks.steps as T
    from core.chat import ChatFormat
    from core.config import RunConfig
    from envs.spawn import spawn_env_server
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime, Session

    cfg = RunConfig.model_validate({"env": {"name": "babyai", "options": {"levels": "GoToLocal"}},
                                    "rollout": {"backend": "transformers", "max_new_tokens": 24,
                                                "token_budget": 1536},
                                    "algo": {"expert_groups": True}})
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    srv = spawn_env_server("babyai", cfg.env.options, runtime="process")
    try:
        with Runtime() as rt:
            s = Session(cfg=cfg, tokenizer=tok, chat=ChatFormat.from_tokenizer(tok))
            rt.add_session(s)
            trajs = [_traj(11, 0, 0.0, "failure"), _traj(11, 0, 0.0, "turn_limit"),
                     _traj(12, 1, 0.9, "success"), _traj(12, 1, 0.0, "failure")]
            out, added = T.with_expert_episodes(s, [srv.url], trajs, 6)
    finally:
        srv.stop()
    assert added == 1.0 and len(out) == 5 and out[:4] == trajs
    d = out[4]
    assert d.expert_demo and d.success and d.group_id == 0 and d.task_id == 11 and d.turn_limit == 6
    assert d.num_policy_tokens > 0 and all(x == 0.0 for x in d.logprobs)
    assert d.replies and all(r.startswith("Action: ") for r in d.replies)


def test_an_expert_episode_stays_out_of_the_sampling_mismatch(tiny_model_dir):
    """The engine never sampled an expert episode's tokens (log-probs 0 there): the update's rollout-vs-learner
    mismatch is the same with it in the batch as without it."""
    from runtime.backends.learner import LearnerConfig, TorchLearner

    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=8, bf16_autocast=False, length_buckets=0)
    trajs, advs = _fixed_batch(TorchLearner(tiny_model_dir, cfg).tokenizer, n=6)
    a = TorchLearner(tiny_model_dir, cfg)
    without = a.update(trajs[:5], advs[:5], prepared=a.prepare(trajs[:5]))
    demo = trajs[5]
    demo.expert_demo, demo.logprobs = True, [0.0] * len(demo.logprobs)
    b = TorchLearner(tiny_model_dir, cfg)
    with_demo = b.update(trajs, advs, prepared=b.prepare(trajs))
    assert with_demo["logprob_mismatch"] == pytest.approx(without["logprob_mismatch"], rel=1e-5)


def test_the_kl_term_leaves_an_expert_episodes_tokens_out():
    """policy_loss with kl_weights: the KL part sums only where they are nonzero (the tokens the policy sampled);
    on a hand case, pg 0 (adv 0) and k3 = exp(d) - d - 1 at d = ref - logp."""
    import torch

    from core.losses import policy_loss

    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -6.0]])  # the second token: an expert token the reference finds unlikely
    w = torch.tensor([[0.5, 0.5]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(-4.0) + 4.0 - 1]
    loss, st = policy_loss(logp, logp, ref, torch.zeros(1, 2), w, 0.2, 0.1)
    assert float(loss) == pytest.approx(0.1 * 0.5 * (k3[0] + k3[1]))
    loss, st = policy_loss(logp, logp, ref, torch.zeros(1, 2), w, 0.2, 0.1, kl_weights=torch.tensor([[0.5, 0.0]]))
    assert float(loss) == pytest.approx(0.1 * 0.5 * k3[0]) and st["kl"] == pytest.approx(0.5 * k3[0])


def test_invalid_action_penalties_by_hand():
    from core.levers import invalid_action_penalties

    assert invalid_action_penalties([False, True, True, False], 4, 0.1) == [0.0, -0.1, -0.1, 0.0]
    assert invalid_action_penalties([True], 3, 0.5) == [-0.5, 0.0, 0.0]  # turns past the flags: none
    assert invalid_action_penalties(None, 2, 0.5) == [0.0, 0.0]
    with pytest.raises(ValueError):
        invalid_action_penalties([], -1, 0.1)


def test_invalid_action_penalty_ranks_an_all_fail_group():
    """A group of four failures, with 0, 1, 2 and 1 invalid turns (of 3): without the penalty GRPO gives all 0;
    with algo.invalid_action_penalty=0.1 (no std) the sequence scores are 0, -0.1, -0.2, -0.1, mean -0.1, so the
    advantages are +0.1, 0, -0.1, 0 on every policy token; the episodes' own rewards are unchanged."""
    def traj(flags):
        t = _traj(0, 0, 0.0, "turn_limit", turns=3)
        for f in flags:
            t.record_env_reply("obs", None if f else "a", f)
        return t

    trajs = [traj(f) for f in ([False] * 3, [False, True, False], [True, True, False], [False, False, True])]
    for pen, want in ((0.0, [0.0, 0.0, 0.0, 0.0]), (0.1, [0.1, 0.0, -0.1, 0.0])):
        adv = _step_advantages(trajs, normalize_std=False, invalid_action_penalty=pen)
        for row, t, w in zip(adv.advantages, trajs, want):
            assert row == pytest.approx([w * m for m in t.loss_mask], abs=1e-6)  # float32 advantages
    assert [t.reward for t in trajs] == [0.0] * 4
