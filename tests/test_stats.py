"""Evaluation statistics (core/stats.py) and the report aggregation (core/evalreport.py) on hand-computed cases."""

import math

import pytest

from core.evalinput import check_sweep
from core.evalreport import Outcome, build_document, flat_metrics, model_report, paired_test, report_text
from core.stats import bootstrap_ci, mcnemar_exact, paired_bootstrap, pass_at_k, pass_ks, wilson_interval


def test_pass_at_k_n5_c2():
    # 1 - C(3,k)/C(5,k): k=1 1-3/5, k=2 1-3/10, k=3 1-1/10; k>=4 every draw holds a success
    assert [pass_at_k(5, 2, k) for k in range(1, 6)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0])
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # Pass@1 is the sample mean
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_pass_ks():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        pass_ks(0)


def test_wilson_matches_the_formula():
    # 2 successes out of 24 (the README's old before-number), written out from the Wilson formula
    z, n, p = 1.959963984540054, 24, 2 / 24
    den = 1 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = wilson_interval(2, 24)
    assert (lo, hi) == pytest.approx((center - half, center + half), abs=1e-9)
    assert (lo, hi) == pytest.approx((0.0232, 0.2585), abs=1e-4)
    lo0, hi0 = wilson_interval(0, 10)
    assert lo0 == pytest.approx(0.0, abs=1e-12) and hi0 == pytest.approx(z * z / (n := 10) / (1 + z * z / n), abs=1e-9)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_mcnemar_on_a_hand_table():
    # 24 tasks: both solve 10, only A 7, only B 1, neither 6. Under H0 the 8 discordant tasks are fair coins:
    # two-sided p = 2 * P(X <= 1 | 8, 1/2) = 2 * 9/256; one-sided (A better) P(X >= 7) = 9/256
    assert mcnemar_exact(7, 1) == pytest.approx(18 / 256)
    assert mcnemar_exact(7, 1, "greater") == pytest.approx(9 / 256)
    assert mcnemar_exact(7, 1, "less") == pytest.approx(1 - 1 / 256)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0


def test_bootstrap_ci():
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    lo, hi = bootstrap_ci([0.0, 1.0], seed=3)  # resampled means are 0, 1/2, 1 with p 1/4, 1/2, 1/4
    assert (lo, hi) == (0.0, 1.0)
    vals = [0, 0, 1, 1, 1, 0, 1, 0, 0, 0] * 5
    lo, hi = bootstrap_ci(vals, seed=1)
    assert lo < 0.4 < hi and bootstrap_ci(vals, seed=1) == (lo, hi)
    # the normal approximation of the mean's interval: 0.4 +- 1.96 * sqrt(0.24 / 50)
    assert (lo, hi) == pytest.approx((0.4 - 0.1358, 0.4 + 0.1358), abs=0.03)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_paired_bootstrap():
    same = paired_bootstrap([1, 0, 1], [1, 0, 1])
    assert same.diff == 0 and same.ci == (0.0, 0.0) and same.p_value == 1.0
    r = paired_bootstrap([1, 1, 1, 0] * 3, [0, 0, 0, 0] * 3, seed=0)
    assert r.diff == pytest.approx(0.75) and r.p_value < 0.01 and r.ci[0] > 0.3 and r.ci[1] == 1.0
    with pytest.raises(ValueError, match="same tasks"):
        paired_bootstrap([1, 0], [1])


def _outcomes():
    # tasks 1..3 (categories x, x, y), K = 2, budgets 1 and 2
    succ = {(1, 1): [1, 0], (2, 1): [0, 0], (3, 1): [1, 1], (1, 2): [1, 1], (2, 2): [0, 1], (3, 2): [1, None]}
    cat = {1: "x", 2: "x", 3: "y"}
    return [Outcome(t, b, k, None if s is None else bool(s), reward=float(s or 0), turns=b, category=cat[t])
            for (t, b), row in succ.items() for k, s in enumerate(row)]


def test_model_report_hand_case():
    rep = model_report(_outcomes(), [1, 2, 3], [1, 2], samples=2)
    b1, b2 = rep["budgets"]["1"], rep["budgets"]["2"]
    # budget 1: per-task means 1/2, 0, 1 -> Avg@2 = 1/2; Pass@2 = 1, 0, 1 -> 2/3
    assert b1["overall"]["avg"]["value"] == pytest.approx(0.5)
    assert b1["overall"]["pass"]["2"]["value"] == pytest.approx(2 / 3)
    assert b1["overall"]["pass"]["1"]["value"] == pytest.approx(0.5)
    assert b1["categories"]["x"]["avg"]["value"] == pytest.approx(0.25)
    assert b1["categories"]["y"]["pass"]["2"]["value"] == 1.0
    # budget 2: task 3 has one masked sample: Avg over (1, 1/2, 1) = 5/6; Pass@2 only over tasks 1, 2
    o = b2["overall"]
    assert o["avg"]["value"] == pytest.approx(5 / 6) and o["masked_episodes"] == 1 and o["episodes"] == 5
    assert o["pass"]["2"]["value"] == 1.0 and o["pass"]["2"]["tasks"] == 2
    assert o["mean_turns"] == 2.0
    for b in (b1, b2):
        assert sum(c["tasks"] for c in b["categories"].values()) == b["overall"]["tasks"] == 3
        for c in [b["overall"], *b["categories"].values()]:
            for r in [c["avg"], *c["pass"].values()]:
                assert r["value"] is None or r["ci"][0] <= r["value"] <= r["ci"][1]
    assert b2["categories"]["y"]["pass"]["2"] == {"value": None, "ci": None, "method": "bootstrap", "tasks": 0}
    assert b2["per_task"][2] == {"task_id": 3, "category": "y", "successes": [1, None], "rewards": [1.0, 0.0],
                                 "turns": [2, 2]}


def test_model_report_refuses_incomplete_or_duplicate_outcomes():
    outs = _outcomes()
    with pytest.raises(ValueError, match="lack samples"):
        model_report(outs[1:], [1, 2, 3], [1, 2], samples=2)
    with pytest.raises(ValueError, match="two outcomes"):
        model_report(outs + outs[:1], [1, 2, 3], [1, 2], samples=2)


@pytest.mark.parametrize("samples, limits, needle", [
    (0, [2], "--samples must be >= 1"), (1, [], "empty"), (1, [4, 2], "increasing"), (1, [2, 2], "e.g. 2"),
    (1, [0, 2], ">= 1")])
def test_check_sweep(samples, limits, needle):
    with pytest.raises(ValueError, match=needle):
        check_sweep(samples, limits)


def test_greedy_comparison_is_mcnemar_on_the_tasks():
    # A solves tasks 0-7, B solves tasks 7-8: A only on 7 tasks, B only on 1 (task 8), 2 tasks neither
    ids = list(range(10))
    a = [Outcome(t, 4, 0, t < 8) for t in ids]
    b = [Outcome(t, 4, 0, t in (7, 8)) for t in ids]
    ra, rb = model_report(a, ids, [4], 1), model_report(b, ids, [4], 1)
    r = paired_test(ra["budgets"]["4"]["per_task"], rb["budgets"]["4"]["per_task"], greedy=True)
    assert (r["a_better"], r["b_better"], r["tasks"]) == (7, 1, 10)
    assert r["p_value"] == pytest.approx(18 / 256) and r["diff"] == pytest.approx(0.6)
    assert r["ci"][0] <= 0.6 <= r["ci"][1]
    # Wilson over tasks for a greedy run: 8 of 10
    assert ra["budgets"]["4"]["overall"]["avg"]["ci"] == pytest.approx(list(wilson_interval(8, 10)))
    doc = build_document({"env": "toy", "header": "h"}, {"model": ("A", ra), "compare": ("B", rb)}, 1, [4],
                         compare=("model", "compare"))
    assert doc["comparison"]["budgets"]["4"]["overall"]["p_value"] == pytest.approx(18 / 256)
    assert flat_metrics(doc)["success_rate"] == pytest.approx(0.8)
    text = report_text(doc)
    assert "diff +0.600" in text and "p = 0.0703" in text


def test_sampled_comparison_is_a_paired_bootstrap():
    ids = list(range(6))
    a = [Outcome(t, 2, k, True) for t in ids for k in range(2)]
    b = [Outcome(t, 2, k, k == 0) for t in ids for k in range(2)]
    ra, rb = model_report(a, ids, [2], 2), model_report(b, ids, [2], 2)
    r = paired_test(ra["budgets"]["2"]["per_task"], rb["budgets"]["2"]["per_task"], greedy=False)
    assert r["test"] == "paired_bootstrap" and r["diff"] == pytest.approx(0.5) and r["ci"] == [0.5, 0.5]
    assert r["p_value"] == pytest.approx(2 / 2001)


def test_paired_regression_verdict():
    from core.evalreport import paired_regression

    # 6 tasks solved last night, none tonight: P(X <= 0 | 6, 1/2) = 1/64 < 0.05 and the drop 1.0 > 0.05
    v = paired_regression([0] * 6, [1] * 6, alpha=0.05, tolerance=0.05)
    assert v.regressed and v.message.startswith("REGRESSION: success_rate 0.000 vs 1.000 the previous night")
    assert "p = 0.0156" in v.message and v.delta == -1.0
    # the same drop on 2 tasks cannot be told from chance: p = 1/4
    v = paired_regression([0, 0], [1, 1], alpha=0.05)
    assert not v.regressed and v.message.startswith("OK:") and "p = 0.25" in v.message
    # significant but smaller than the tolerance: 7 lost, 1 gained of 100 tasks (p = 9/256), drop 0.06 <= 0.1
    prev = [1] * 7 + [0] + [1] * 50 + [0] * 42
    cur = [0] * 7 + [1] + [1] * 50 + [0] * 42
    v = paired_regression(cur, prev, alpha=0.05, tolerance=0.1)
    assert not v.regressed and "7 lost, 1 gained" in v.message and "p = 0.0352" in v.message
    assert paired_regression(cur, prev, alpha=0.05, tolerance=0.05).regressed
    # masked tasks are left out of the pairing
    v = paired_regression([None, 1], [1, 1])
    assert not v.regressed and "paired on 1 tasks" in v.message


def test_sampled_rates_with_no_spread_get_a_wilson_interval_not_a_point():
    """0 successes in 32 tasks x 4 samples: the bootstrap over tasks collapses to [0, 0]; the report gives the
    Wilson interval over the 32 tasks instead (upper bound 0.107), and the same when every task always succeeds."""
    for s in (False, True):
        outs = [Outcome(t, 4, k, s, reward=float(s), turns=4, category="c") for t in range(32) for k in range(4)]
        cell = model_report(outs, list(range(32)), [4], samples=4)["budgets"]["4"]["overall"]
        lo, hi = wilson_interval(32 if s else 0, 32)
        for r in (cell["avg"], cell["pass"]["2"], cell["pass"]["4"]):
            assert r["method"] == "wilson" and r["ci"] == [pytest.approx(lo), pytest.approx(hi)]
        assert (hi if not s else 1 - lo) == pytest.approx(0.1072, abs=1e-3)
    mixed = [Outcome(t, 4, k, k == 0 and t % 2 == 0, reward=0.0, turns=4, category="c") for t in range(8) for k in range(4)]
    assert model_report(mixed, list(range(8)), [4], samples=4)["budgets"]["4"]["overall"]["avg"]["method"] == "bootstrap"
