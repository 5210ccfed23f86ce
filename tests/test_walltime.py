"""core.walltime: exclusive seconds per category, nesting, the rest as ``other`` (hand-computed cases)."""

import pytest

from core.walltime import WallLedger, format_breakdown


def test_nested_categories_count_exclusive_time_and_the_rest_is_other():
    w = WallLedger()
    w.enter("evaluation", 10.0)  # an evaluation 10..40 with an engine start 12..20 inside it
    w.enter("setup", 12.0)
    assert w.exit(20.0) == 8.0
    assert w.exit(40.0) == 22.0
    w.enter("rollout", 50.0)
    w.exit(53.5)
    w.enter("update", 60.0)
    w.add("weight_sync", 0.5)  # measured by the backend inside the update
    w.exit(64.0)
    b = w.breakdown(100.0)
    assert b["setup"] == 8.0 and b["evaluation"] == 22.0 and b["rollout"] == 3.5
    assert b["update"] == 3.5 and b["weight_sync"] == 0.5
    assert b["advantages"] == 0.0 and b["checkpoint"] == 0.0
    assert b["other"] == 100.0 - (8 + 22 + 3.5 + 3.5 + 0.5)
    assert list(b)[-1] == "other" and list(b)[0] == "setup"


def test_repeated_categories_add_up():
    w = WallLedger()
    for t in (0.0, 10.0, 20.0):
        w.enter("rollout", t)
        w.exit(t + 2.0)
    assert w.breakdown(6.0) == {"setup": 0.0, "rollout": 6.0, "advantages": 0.0, "update": 0.0, "weight_sync": 0.0,
                                "evaluation": 0.0, "checkpoint": 0.0, "other": 0.0}


def test_bad_use_is_refused():
    w = WallLedger()
    with pytest.raises(ValueError, match="category"):
        w.enter("lunch", 0.0)
    with pytest.raises(RuntimeError, match="enter"):
        w.exit(1.0)


def test_format_lists_largest_first_with_percentages():
    line = format_breakdown({"setup": 10.0, "rollout": 60.0, "update": 0.0, "other": 30.0}, 100.0)
    assert line == "wall time 100 s: rollout 60 s (60%), other 30 s (30%), setup and engine start 10 s (10%)"
