"""The learning study's pure pieces (core.study), on hand-computed cases."""

import pytest

from core.study import arm_phases, band, curve_over_seeds, parse_arms, pooled_successes

PHASES = [{"turn_limit": 2, "steps": 3}, {"turn_limit": 3, "steps": 2}, {"turn_limit": 5, "steps": 4}]


def test_arm_phases_keep_boundaries_and_change_only_limits():
    assert arm_phases(PHASES, "scalinginter") == PHASES
    assert arm_phases(PHASES, "fixed-short") == [{"turn_limit": 2, "steps": 3}, {"turn_limit": 2, "steps": 2},
                                                 {"turn_limit": 2, "steps": 4}]
    assert arm_phases(PHASES, "fixed-long") == [{"turn_limit": 5, "steps": 3}, {"turn_limit": 5, "steps": 2},
                                                {"turn_limit": 5, "steps": 4}]
    assert PHASES[0]["turn_limit"] == 2  # the input is not modified


def test_arm_errors():
    with pytest.raises(ValueError, match="unknown study arm 'fixed'"):
        arm_phases(PHASES, "fixed")
    with pytest.raises(ValueError, match="at least one phase"):
        arm_phases([], "scalinginter")
    assert parse_arms(" scalinginter, fixed-long ") == ["scalinginter", "fixed-long"]
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arms("scalinginter,long")
    with pytest.raises(ValueError, match="twice"):
        parse_arms("fixed-long,fixed-long")
    with pytest.raises(ValueError, match="empty"):
        parse_arms(" , ")


def test_curve_over_seeds_mean_and_spread():
    curves = [{0: 0.1, 4: 0.3, 8: 0.5}, {0: 0.1, 4: 0.5}]
    c = curve_over_seeds(curves)
    assert sorted(c) == [0, 4, 8]
    assert c[4].mean == pytest.approx(0.4) and c[4].lo == 0.3 and c[4].hi == 0.5 and c[4].n == 2
    assert c[8].mean == 0.5 and c[8].n == 1
    assert band([1.0, 0.0, 0.5]).mean == pytest.approx(0.5)


def test_pooled_successes_average_per_task_over_seeds():
    assert pooled_successes([[1, 0, 0], [1, 1, 0]]) == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="same tasks"):
        pooled_successes([[1, 0], [1, 0, 0]])


def _report(seed_outcomes: dict[str, list[list[int]]], budgets=(2, 4), base=0.25, legacy=False) -> dict:
    """A study report as bench/learning_study.py writes it (4 held-out tasks)."""
    arms = {}
    for arm, per_seed in seed_outcomes.items():
        n = len(per_seed[0])
        succ = [sum(s) / n for s in per_seed]
        a = {"turn_limits": [2, 4], "runs": [f"{arm}-s{i}" for i in range(len(per_seed))],
             "heldout_success": sum(succ) / len(succ), "ci95": [0, 1], "per_seed_success": succ,
             "vs_base_mcnemar_p": [0.5] * len(per_seed), "sweep": {str(b): sum(succ) / len(succ) for b in budgets},
             "steps": 12, "generated_tokens": 100.0 * len(per_seed), "wall_time_s": 10.0, "step_time_s": 5.0,
             "curve": {"0": {"mean": base, "lo": base, "hi": base, "n": len(per_seed)},
                       "12": {"mean": sum(succ) / len(succ), "lo": min(succ), "hi": max(succ), "n": len(per_seed)}},
             "train_curve": {"1": {"mean": 0.5, "lo": 0.5, "hi": 0.5, "n": len(per_seed)}},
             "pooled_per_task": [sum(col) / len(per_seed) for col in zip(*per_seed)]}
        if not legacy:
            a["per_seed_per_task"] = per_seed
        arms[arm] = a
    return {"env": "babyai", "preset": "smoke", "overrides": [], "seeds": 1, "eval_n": 4, "budgets": list(budgets),
            "experiment": "x", "machine": "m", "base": {"heldout_success": base, "ci95": [0, 1],
                                                       "sweep": {str(b): base for b in budgets}},
            "arms": arms, "comparisons": {}, "wall_time_s": 100.0, "runs": []}


def test_merge_reports_pools_seeds_by_hand():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from learning_study import merge_reports

    a = _report({"scalinginter": [[1, 1, 0, 0]], "fixed-short": [[1, 0, 0, 0]]}, budgets=(2, 4), legacy=True)
    b = _report({"scalinginter": [[1, 1, 1, 0]], "fixed-short": [[0, 0, 0, 0]]}, budgets=(2, 3, 4))
    m = merge_reports([a, b])
    si = m["arms"]["scalinginter"]
    assert m["seeds"] == 2 and m["budgets"] == [2, 4]  # the budgets both reports have
    assert si["heldout_success"] == pytest.approx(5 / 8) and si["per_seed_success"] == [0.5, 0.75]
    assert si["pooled_per_task"] == [1.0, 1.0, 0.5, 0.0]
    assert si["per_seed_per_task"] == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert si["sweep"] == {"2": pytest.approx(0.625), "4": pytest.approx(0.625)}
    assert si["curve"]["12"] == {"mean": pytest.approx(0.625), "lo": 0.5, "hi": 0.75, "n": 2}
    assert si["generated_tokens"] == pytest.approx(100.0)
    lo, hi = si["ci95"]
    assert lo < 5 / 8 < hi
    assert set(m["comparisons"]) == {"scalinginter - fixed-short"}
    assert m["comparisons"]["scalinginter - fixed-short"]["diff"] == pytest.approx(5 / 8 - 1 / 8)
    with pytest.raises(SystemExit, match="base model scored differently"):
        merge_reports([a, _report({"scalinginter": [[1, 1, 1, 1]], "fixed-short": [[0, 0, 0, 0]]}, base=0.5)])
    with pytest.raises(SystemExit, match="two or more"):
        merge_reports([a])
