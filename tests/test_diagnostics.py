"""Stability diagnostics per step (core.metrics.step_diagnostics) on hand-made episodes."""

from core.metrics import step_diagnostics
from core.trajectory import Trajectory


def ep(group, actions, observations, invalid, finish="failure", reply=(2, 3), masked=False):
    t = Trajectory(task_id=group, group_id=group)
    t.start([0, 0, 0])
    for k, _ in enumerate(actions):
        n = reply[k % len(reply)]
        t.add_action([7] * n, [-0.1] * n)
        if k < len(actions) - 1:
            t.add_env([0, 0])
    t.first_observation, t.observations = observations[0], list(observations[1:])
    t.actions, t.invalid_actions = list(actions), list(invalid)
    t.finish(finish, finish == "success")
    t.masked = masked
    return t


def test_hand_counted_diagnostics():
    # episode A (group 0): 3 turns; turn 2 repeats turn 1's action in the same state ("s1" both times); turn 3
    #   repeats again but the state changed ("s2"): 1 repeat of 2 turns with a turn before; 1 invalid turn
    a = ep(0, ["left", "left", "left"], ["s1", "s1", "s2", "end"], [False, True, False], finish="turn_limit")
    # episode B (group 0): 1 turn, success, reply 2 tokens
    b = ep(0, ["go"], ["s1", "won"], [False], finish="success")
    # episode C (group 1): 2 turns, both invalid, different actions
    c = ep(1, ["x", "y"], ["s9", "s9", "s9"], [True, True], finish="turn_limit")
    d = ep(2, ["z"], ["s"], [True], masked=True)  # masked: in no statistic
    adv = [[0.5 * m for m in a.loss_mask], [-0.5 * m for m in b.loss_mask], [0.0] * len(c.loss_mask),
           [9.0] * len(d.loss_mask)]
    m = step_diagnostics([a, b, c, d], adv, turn_limit=3)
    assert m["diag/invalid_action_rate"] == 3 / 6  # 1 + 0 + 2 invalid of 3 + 1 + 2 turns
    assert m["diag/repeated_action_rate"] == 1 / 3  # A: turn 2 (same action, same state); C: none; 3 with a previous
    # reply tokens per turn: A 2, 3, 2; B 2; C 2, 3 -> 14 / 6
    assert abs(m["diag/reply_tokens"] - 14 / 6) < 1e-12
    assert abs(m["diag/turns_used_frac"] - (3 + 1 + 2) / 3 / 3) < 1e-12
    assert m["diag/turn_limit_frac"] == 2 / 3
    assert m["diag/zero_adv_group_frac"] == 1 / 2  # group 0 has signal, group 1 none; masked group 2 left out


def test_no_live_episode_and_no_advantages():
    d = ep(2, ["z"], ["s", "t"], [True], masked=True)
    assert step_diagnostics([d], None, 3) == {}
    a = ep(0, ["go"], ["s", "t"], [False])
    m = step_diagnostics([a], None, None)
    assert "diag/zero_adv_group_frac" not in m and "diag/turns_used_frac" not in m
