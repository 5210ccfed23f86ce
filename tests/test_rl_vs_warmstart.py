"""bench/rl_vs_warmstart.py's report from synthetic outcomes, by hand: the gain over the warm start, each seed's gain,
the buckets, and the refusal of finals scored on other tasks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mod():
    sys.path.insert(0, str(ROOT / "bench"))
    import rl_vs_warmstart

    return rl_vs_warmstart


def _outs(successes, labels):
    return [{"task": 100 + i, "required_turns": r, "success": s} for i, (s, r) in enumerate(zip(successes, labels))]


def test_arm_report_by_hand():
    m = _mod()
    labels = [1, 1, 2, 5, 8, 9]
    warm = _outs([1, 1, 0, 1, 0, 0], labels)  # 3/6
    seeds = [{"seed": 0, "final": _outs([1, 1, 1, 1, 0, 0], labels)},   # +1/6
             {"seed": 1, "final": _outs([1, 0, 1, 1, 1, 1], labels)}]   # +2/6
    r = m.arm_report(warm, seeds)
    assert r["warm_start"] == 0.5 and r["final"] == 9 / 12
    assert r["per_seed_gain"] == pytest.approx([1 / 6, 2 / 6]) and r["gain"] == pytest.approx(0.25)
    lo, hi = r["gain_ci_seed_task"]
    assert lo <= 0.25 <= hi and r["gain_ci_task_only"][0] <= 0.25 <= r["gain_ci_task_only"][1]
    b1 = dict(r["buckets"]["1"])
    lo1, hi1 = b1.pop("gain_ci_seed_task")
    assert b1 == {"tasks": 2, "warm_start": 1.0, "final": 0.75, "per_seed": [1.0, 0.5], "gain": -0.25}
    assert lo1 <= -0.25 <= hi1 <= 0  # seed 1 lost one of the two tasks, seed 0 none
    assert r["buckets"]["7+"]["final"] == 0.5 and r["buckets"]["7+"]["warm_start"] == 0.0
    assert r["per_seed_mcnemar_p"][0] == 1.0  # one discordant task: p = 1
    seeds[1]["final"][0]["task"] = 999
    with pytest.raises(SystemExit, match="other tasks"):
        m.arm_report(warm, seeds)


def test_outcomes_read_the_evaluation_document():
    m = _mod()
    doc = {"models": {"model": {"budgets": {"10": {"per_task": [
        {"task_id": 7, "required_turns": 3, "successes": [True]},
        {"task_id": 8, "successes": [False]}]}}}}}
    assert m.outcomes(doc, 10) == [{"task": 7, "required_turns": 3, "success": 1},
                                   {"task": 8, "required_turns": None, "success": 0}]


def test_last_limit_arm_puts_every_step_at_the_presets_last_turn_limit():
    """`groups@last` is `groups@10` on the multistep preset (12 steps at 10 turns) and 12 steps at 4 turns on
    TextCraft easy; the command's own --set comes after the arm's."""
    import argparse
    import json

    m = _mod()
    a = argparse.Namespace(env="babyai", preset="multistep", phase_steps=4, set=["algo.lr=2e-5"])
    r = m.arm_recipe(a, "groups@last")
    assert r[-1] == "algo.lr=2e-5" and json.loads(r[-2].split("=", 1)[1]) == [{"turn_limit": 10, "steps": 12}]
    g10 = m.arm_recipe(a, "groups@10")
    assert g10[:-2] == r[:-2] and json.loads(g10[-2].split("=", 1)[1]) == json.loads(r[-2].split("=", 1)[1])
    t = m.arm_recipe(argparse.Namespace(env="textcraft", preset="easy", phase_steps=4, set=None), "groups@last")
    assert t[-1] == 'curriculum.phases=[{"turn_limit": 4, "steps": 12}]' and t[:-1] == m.ARMS["groups@last"]


def test_table_names_only_the_buckets_the_tasks_fall_in():
    """TextCraft easy's tasks need 2-4 turns: the table's bucket columns are 2-3 and 4-6, not four headers over two
    numbers."""
    m = _mod()
    labels = [2, 2, 3, 4]
    warm = _outs([1, 0, 1, 0], labels)
    seeds = [{"seed": 0, "final": _outs([1, 1, 1, 0], labels), "diagnostics": {"1": {"success_rate": 0.5}}}]
    doc = {"env": "textcraft", "preset": "easy", "turn_limit": 4, "eval_n": 4, "machine": "m", "warm": "w",
           "phase_steps": 4, "arms": {"groups@last": {"recipe": ["algo.lr=1e-5"], "seeds": seeds,
                                                      "report": m.arm_report(warm, seeds)}}}
    text = m.table(doc)
    assert "| needs 2-3 / 4-6 |" in text and "needs 1 /" not in text
    assert "| warm start | - | 0.500 | - | - | - | - | 0.67 / 0.00 |" in text
    assert "| arm | needs 2-3 | needs 4-6 |" in text


def test_merge_carries_earlier_arms_beside_their_own_warm_start():
    """An earlier report's arms (their runs gone) join this run's: an arm run again replaces the earlier one, each
    keeps the warm start it was scored against (a warm start made again differs in bf16), and the table gives one
    warm-start row per warm start; other tasks or another turn limit are refused."""
    m = _mod()
    labels = [1, 2, 3, 8]
    warm_a, warm_b = _outs([1, 1, 0, 0], labels), _outs([1, 0, 0, 0], labels)

    def arm(warm, final):
        seeds = [{"seed": 0, "final": _outs(final, labels), "warm_start": warm, "diagnostics": {}}]
        return {"recipe": [], "turn_limit": 10, "seeds": seeds, "report": m.arm_report(warm, seeds)}

    earlier = {"turn_limit": 10, "warm_start": warm_a,
               "arms": {"old": arm(warm_a, [1, 1, 1, 0]), "again": arm(warm_a, [0, 0, 0, 0])}}
    now = {"again": arm(warm_b, [1, 1, 0, 1]), "new": arm(warm_b, [1, 1, 1, 1])}
    tasks = [o["task"] for o in warm_b]
    arms = m.merge_arms(now, [(Path("earlier.json"), earlier)], 10, tasks)
    assert list(arms) == ["old", "again", "new"] and arms["again"] is now["again"]
    assert arms["old"]["merged_from"] == "earlier.json" and "merged_from" not in arms["new"]
    doc = {"env": "babyai", "preset": "multistep", "turn_limit": 10, "eval_n": 4, "machine": "m", "warm": "w",
           "phase_steps": 4, "arms": arms}
    text = m.table(doc)
    assert "| warm start (old) | - | 0.500 | - | - | - | - | 1.00 / 0.50 / 0.00 |" in text
    assert "| warm start 2 (the other arms) | - | 0.250 | - | - | - | - | 1.00 / 0.00 / 0.00 |" in text
    assert "| old | 1 | 0.750 | +0.250" in text and "| again | 1 | 0.750 | +0.500" in text
    with pytest.raises(SystemExit, match="6 turns"):
        m.merge_arms(now, [(Path("e.json"), {**earlier, "turn_limit": 6})], 10, tasks)
    with pytest.raises(SystemExit, match="other held-out tasks"):
        m.merge_arms(now, [(Path("e.json"), earlier)], 10, tasks[:3])
