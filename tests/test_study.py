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
