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


def _report(seed_outcomes: dict[str, list[list[int]]], budgets=(2, 4), base=0.25, legacy=False,
            first_seed: int = 0) -> dict:
    """A study report as bench/learning_study.py writes it (4 held-out tasks)."""
    arms = {}
    for arm, per_seed in seed_outcomes.items():
        n = len(per_seed[0])
        succ = [sum(s) / n for s in per_seed]
        a = {"turn_limits": [2, 4], "runs": [f"{arm}-s{first_seed + i}" for i in range(len(per_seed))],
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
    b = _report({"scalinginter": [[1, 1, 1, 0]], "fixed-short": [[0, 0, 0, 0]]}, budgets=(2, 3, 4), first_seed=1)
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
        merge_reports([a, _report({"scalinginter": [[1, 1, 1, 1]], "fixed-short": [[0, 0, 0, 0]]}, base=0.5,
                                  first_seed=1)])
    with pytest.raises(SystemExit, match="seed in two reports"):
        merge_reports([a, _report({"scalinginter": [[1, 1, 1, 0]], "fixed-short": [[0, 0, 0, 0]]})])
    with pytest.raises(SystemExit, match="two or more"):
        merge_reports([a])


def test_merge_compares_arms_on_the_seeds_both_have():
    """An arm with seeds 0 and 1 beside one with seed 1 only: their difference is seed 1's paired one (0 here), not
    the gap between rates pooled over different seeds (0.625 - 0.25); a pair with no seed in common is left out."""
    from flows.study import merge_reports, table

    a = _report({"scalinginter": [[1, 1, 1, 1], [0, 1, 0, 0]], "fixed-short": [[0, 0, 0, 0], [0, 0, 0, 0]]})
    b = _report({"fixed-long": [[1, 0, 0, 0]]}, first_seed=1)
    m = merge_reports([a, b])
    assert m["arms"]["scalinginter"]["seeds"] == [0, 1] and m["arms"]["fixed-long"]["seeds"] == [1]
    long_ = m["comparisons"]["scalinginter - fixed-long"]
    assert long_["diff"] == pytest.approx(0.0) and long_["seeds"] == [1]
    short = m["comparisons"]["scalinginter - fixed-short"]
    assert short["diff"] == pytest.approx(0.625) and "seeds" not in short  # the same seeds: nothing restricted
    assert m["arms"]["scalinginter"]["pooled_per_task"] == [0.5, 1.0, 0.5, 0.5]  # the arm's own row keeps both
    assert "seedless_pairs" not in m
    assert "scalinginter - fixed-long on seeds 1: +0.000" in table(m)

    c = _report({"scalinginter": [[1, 0, 0, 0]]})
    d = _report({"fixed-long": [[0, 0, 0, 1]]}, first_seed=1)
    m2 = merge_reports([c, d])
    assert m2["comparisons"] == {} and m2["seedless_pairs"] == ["scalinginter - fixed-long"]
    assert "not compared (no seed in common): scalinginter - fixed-long" in table(m2)


# --- the GiGPO arm, comparison pairs --------------------------------------------------------------------------
def test_gigpo_arm_is_the_scalinginter_curriculum_with_the_gigpo_estimator():
    from core.study import ARMS, DEFAULT_ARMS, arm_overrides

    assert arm_phases(PHASES, "scalinginter-gigpo") == PHASES  # growing limits, as ScalingInter
    assert arm_overrides("scalinginter-gigpo") == ["algo.estimator=gigpo"]
    for arm in ("scalinginter", "fixed-short", "fixed-long"):
        assert arm_overrides(arm) == []
    got = arm_overrides("scalinginter-gigpo")
    got.append("x=1")  # a fresh list: the caller cannot change the arm
    assert arm_overrides("scalinginter-gigpo") == ["algo.estimator=gigpo"]
    assert "scalinginter-gigpo" in ARMS and "scalinginter-gigpo" not in DEFAULT_ARMS
    assert parse_arms("scalinginter,scalinginter-gigpo") == ["scalinginter", "scalinginter-gigpo"]
    with pytest.raises(ValueError, match="unknown study arm 'gigpo'"):
        arm_overrides("gigpo")
    with pytest.raises(ValueError, match="unknown study arm 'gigpo'"):
        arm_phases(PHASES, "gigpo")


def test_gigpo_arm_override_makes_a_valid_gigpo_config():
    """The override is a real config key: on the multistep preset it selects GiGPO; with groups of one the config
    is refused (GiGPO needs rollout.samples_per_task >= 2)."""
    from core.config import ConfigError, build_config
    from core.study import arm_overrides
    from envs.babyai.presets import PRESETS

    cfg = build_config("babyai", "multistep", arm_overrides("scalinginter-gigpo"), presets=PRESETS)
    assert cfg.algo.estimator == "gigpo" and cfg.rollout.samples_per_task == 4
    plain = build_config("babyai", "multistep", arm_overrides("scalinginter"), presets=PRESETS)
    assert plain.algo.estimator == "grpo"
    with pytest.raises(ConfigError, match="samples_per_task >= 2"):
        build_config("babyai", "multistep", ["rollout.samples_per_task=1", *arm_overrides("scalinginter-gigpo")],
                     presets=PRESETS)


def test_comparison_pairs_orders_and_subsets():
    from core.study import comparison_pairs

    every = ["scalinginter", "fixed-short", "fixed-long", "scalinginter-gigpo"]
    assert comparison_pairs(every) == [("scalinginter", "fixed-short"), ("scalinginter", "fixed-long"),
                                       ("scalinginter", "scalinginter-gigpo"),
                                       ("scalinginter-gigpo", "fixed-long"), ("scalinginter-gigpo", "fixed-short")]
    # ScalingInter's pairs follow the given arm order; the GiGPO arm's are always long, then short
    assert comparison_pairs(["fixed-long", "scalinginter-gigpo", "fixed-short", "scalinginter"]) == [
        ("scalinginter", "fixed-long"), ("scalinginter", "scalinginter-gigpo"), ("scalinginter", "fixed-short"),
        ("scalinginter-gigpo", "fixed-long"), ("scalinginter-gigpo", "fixed-short")]
    assert comparison_pairs(["fixed-short", "scalinginter"]) == [("scalinginter", "fixed-short")]
    assert comparison_pairs(["scalinginter-gigpo", "fixed-short"]) == [("scalinginter-gigpo", "fixed-short")]
    assert comparison_pairs(["scalinginter", "scalinginter-gigpo"]) == [("scalinginter", "scalinginter-gigpo")]
    assert comparison_pairs(iter(["fixed-short", "fixed-long"])) == []  # no ScalingInter arm: nothing to compare
    assert comparison_pairs(["scalinginter"]) == [] and comparison_pairs([]) == []


# --- results by required turns --------------------------------------------------------------------------------
def test_bucket_indices_skip_unlabelled_and_keep_bucket_order():
    from core.evalreport import BUCKETS
    from core.study import bucket_indices

    labels = [None, 7, 1, 3, 4, 2, 12, 1, None, 6]
    got = bucket_indices(labels)
    assert got == {"1": [2, 7], "2-3": [3, 5], "4-6": [4, 9], "7+": [1, 6]}
    assert list(got) == list(BUCKETS) == ["1", "2-3", "4-6", "7+"]  # 7+ seen first, listed last
    assert list(bucket_indices([9, 2])) == ["2-3", "7+"]  # empty buckets are left out
    assert bucket_indices([None, None]) == {} and bucket_indices([]) == {}
    with pytest.raises(ValueError, match=">= 1"):
        bucket_indices([1, 0])


def test_bucket_rates_per_bucket_mean():
    from core.study import bucket_rates

    # "1": tasks 0 and 3 -> (1 + 0.5) / 2; "2-3": task 1 -> 0; task 2 unlabelled; "7+": task 4 -> 1
    assert bucket_rates([1, 0, 1, 0.5, 1], [1, 2, None, 1, 8]) == {"1": 0.75, "2-3": 0.0, "7+": 1.0}
    assert bucket_rates([1, 0], [None, None]) == {}
    with pytest.raises(ValueError, match="3 task scores for 4 labels"):
        bucket_rates([1, 0, 1], [1, 2, 3, 4])


# 8 held-out tasks: "1" = tasks 0-2, "2-3" = 3-4, "4-6" = 5, "7+" = 6, task 7 unlabelled
LABELS = [1, 1, 1, 2, 3, 5, 9, None]
BASE = [0, 0, 0, 1, 0, 0, 0, 1]
SEEDS = [[1, 1, 1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 1, 1, 0, 0]]


def test_bucket_stats_by_hand():
    from core.stats import wilson_interval
    from core.study import bucket_stats

    got = bucket_stats(SEEDS, LABELS, BASE)
    assert list(got) == ["1", "2-3", "4-6", "7+"]
    one = got["1"]
    # "1": seed 0 solves 3/3, seed 1 2/3 -> 5 of 6 episodes; the base solves none of the three.
    # McNemar vs base: seed 0 b=3 (only the seed), c=0 -> two-sided binomial 2 * 0.5^3 = 0.25;
    # seed 1 b=2, c=0 -> 2 * 0.5^2 = 0.5
    assert one["success"] == pytest.approx(5 / 6) and one["tasks"] == 3
    assert one["ci95"] == pytest.approx(list(wilson_interval(5, 6)))
    assert one["per_seed_success"] == pytest.approx([1.0, 2 / 3])
    assert one["vs_base_mcnemar_p"] == pytest.approx([0.25, 0.5])
    # "2-3" (tasks 3, 4; base [1, 0]): seed 0 [1, 0] = the base (no discordant pair: p 1); seed 1 [0, 1]:
    # b=1, c=1 -> p 1
    two = got["2-3"]
    assert two["success"] == 0.5 and two["tasks"] == 2 and two["per_seed_success"] == [0.5, 0.5]
    assert two["ci95"] == pytest.approx(list(wilson_interval(2, 4)))
    assert two["vs_base_mcnemar_p"] == [1.0, 1.0]
    # "4-6" (task 5): 0 and 1 -> 1 of 2; "7+" (task 6): 0 of 2
    assert got["4-6"]["success"] == 0.5 and got["4-6"]["per_seed_success"] == [0.0, 1.0]
    assert got["4-6"]["ci95"] == pytest.approx(list(wilson_interval(1, 2)))
    assert got["7+"]["success"] == 0.0 and got["7+"]["ci95"] == pytest.approx(list(wilson_interval(0, 2)))
    # seed-level intervals (a bootstrap over seeds and the bucket's tasks): "7+" is 0 on both seeds -> [0, 0];
    # "4-6" is one task, 0 on seed 0 and 1 on seed 1: a replicate draws seed 0 twice (1/4), seed 1 twice (1/4) or
    # both -> means 0, 1, 0.5, so the 2.5th and 97.5th percentiles are 0 and 1
    assert got["7+"]["ci95_seed_task"] == [0.0, 0.0] and got["4-6"]["ci95_seed_task"] == [0.0, 1.0]
    lo, hi = one["ci95_seed_task"]  # "1": [1, 1, 1] and [1, 1, 0]; only seed 1's task 2 fails
    assert lo < 5 / 6 < hi == 1.0
    # the base better on two tasks, the seed on none: b=0, c=2 -> 2 * 0.5^2 = 0.5
    assert bucket_stats([[0, 0, 0]], [1, 1, 1], [1, 1, 0])["1"]["vs_base_mcnemar_p"] == pytest.approx([0.5])
    # without a base: no McNemar; one seed is a proportion over the bucket's tasks
    base_only = bucket_stats([BASE], LABELS)
    assert "vs_base_mcnemar_p" not in base_only["1"]
    assert {k: c["success"] for k, c in base_only.items()} == {"1": 0.0, "2-3": 0.5, "4-6": 0.0, "7+": 0.0}
    assert base_only["2-3"]["ci95_seed_task"] == [0.0, 1.0]  # one seed: the tasks [1, 0] drawn alone
    assert bucket_stats([[1, 0]], [None, None]) == {}


def test_bucket_stats_errors():
    from core.study import bucket_stats

    with pytest.raises(ValueError, match="no seeds"):
        bucket_stats([], LABELS)
    with pytest.raises(ValueError, match="8 task labels differ in length"):
        bucket_stats([SEEDS[0], SEEDS[1][:7]], LABELS)
    with pytest.raises(ValueError, match="8 task labels differ in length"):
        bucket_stats(SEEDS, LABELS, BASE[:7])


# --- stability diagnostics ------------------------------------------------------------------------------------
def test_phase_means_skip_missing_and_nan_and_order_phases():
    from core.study import phase_means

    nan = float("nan")
    records = [{"global_step": 3, "phase": 2, "a": 5.0},
               {"global_step": 1, "phase": 1, "a": 1.0, "b": nan},
               {"global_step": 2, "phase": 1, "a": 3.0, "b": 2.0, "c": 9.0},
               {"global_step": 4, "phase": None, "a": 100.0},  # no phase: not counted
               {"global_step": 5, "a": 100.0},
               {"global_step": 6, "phase": 10, "a": True, "b": 4}]  # a bool is not a number
    got = phase_means(records, ("a", "b"))
    # phase 1: a = (1 + 3) / 2, b = 2 (the NaN step left out); phase 2: a only; phase 10: b only
    assert got == {"phase-1": {"a": 2.0, "b": 2.0}, "phase-2": {"a": 5.0}, "phase-10": {"b": 4.0}}
    assert list(got) == ["phase-1", "phase-2", "phase-10"]  # numeric phase order, not text or record order
    assert phase_means([], ("a",)) == {}


def test_mean_of_dicts_weights_and_missing_values():
    from core.study import mean_of_dicts

    nan = float("nan")
    parts = [({"phase-1": {"a": 1.0, "b": 2.0}, "phase-2": {"a": 4.0}}, 1.0),
             ({"phase-1": {"a": 4.0}, "phase-2": {"a": nan}, "phase-3": {"a": 6.0}, "phase-4": {"a": nan}}, 2.0)]
    got = mean_of_dicts(parts)
    # phase-1 a: (1 * 1 + 2 * 4) / 3 = 3; b: only the first part; phase-2 a: the NaN is left out;
    # phase-4: no number at all -> no group
    assert got == {"phase-1": {"a": 3.0, "b": 2.0}, "phase-2": {"a": 4.0}, "phase-3": {"a": 6.0}}
    assert list(got) == ["phase-1", "phase-2", "phase-3"]
    assert mean_of_dicts([({"p": {"x": 1.0}}, 1.0), ({"p": {"x": 2.0}}, 1.0)]) == {"p": {"x": 1.5}}
    assert mean_of_dicts([]) == {}


def test_collapse_rule_needs_success_to_fall_and_entropy_to_move():
    from core.study import collapse_check

    up = [0.1, 0.2, 0.2, 0.3, 0.3, 0.4]
    assert not collapse_check(up, [0.2] * 6)["collapsed"]
    fell = [0.3, 0.4, 0.5, 0.4, 0.1, 0.0, 0.0, 0.0]  # best 3-step mean 0.433, last 0.0
    c = collapse_check(fell, [0.14, 0.13, 0.13, 0.10, 0.08, 0.06, 0.05, 0.05])
    assert c["collapsed"] and c["final_success"] == 0.0 and abs(c["best_success"] - 1.3 / 3) < 1e-12
    assert abs(c["entropy_ratio"] - (0.16 / 3) / (0.40 / 3)) < 1e-12
    assert not collapse_check(fell, [0.13] * 8)["collapsed"]  # success fell, entropy steady: not this rule
    assert collapse_check(fell, [0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3])["collapsed"]  # entropy tripled
    assert not collapse_check([0.02, 0.0, 0.0, 0.0, 0.0, 0.0], [0.2] * 3 + [0.05] * 3)["collapsed"]  # never had any
    assert collapse_check([0.5] * 5, [0.1] * 5) == {"collapsed": False, "final_success": None, "best_success": None,
                                                   "entropy_ratio": None}  # too short to tell


def test_retention_counts_what_the_start_solved():
    from core.study import retention

    base = [1, 1, 0, 1, 0, 1]
    final = [1, 0, 1, 1, 0, 0]
    labels = [1, 1, 2, 5, 8, 9]
    r = retention(base, final, labels)
    assert r["all"] == 2 / 4 and r["1"] == 1 / 2 and r["2-3"] is None and r["4-6"] == 1.0 and r["7+"] == 0.0
    assert retention(base, final) == {"all": 0.5}


def test_heldout_churn_counts_losses_and_gains_between_held_out_points():
    from core.study import heldout_churn

    start, p1, p2, final = [1, 0, 0, 1, 0], [1, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 0, 1]
    c = heldout_churn([(0, start), (12, p1), (24, p2), (36, final)])
    assert [(t["from_step"], t["to_step"], t["lost"], t["gained"]) for t in c["transitions"]] == [
        (0, 12, 0, 2), (12, 24, 3, 0), (24, 36, 0, 2)]
    assert [round(t["change"], 12) for t in c["transitions"]] == [0.4, -0.6, 0.4]
    assert abs(c["largest_drop"] - 0.6) < 1e-12 and c["lost"] == 3
    steady = heldout_churn([(0, [0, 0]), (5, [1, 0]), (9, [1, 1])])
    assert steady["largest_drop"] == 0.0 and steady["lost"] == 0  # never fell: no drop, nothing lost
    assert heldout_churn([(0, [1.0, 0.0])]) == {"transitions": [], "largest_drop": None, "lost": 0}
    with pytest.raises(ValueError, match="not the same tasks"):
        heldout_churn([(0, [1, 0]), (3, [1])])


def test_capped_share_counts_failures_at_the_turn_limit():
    from core.study import capped_share

    # task 0: solved at the limit (not capped); task 1: failed at the limit; task 2: failed early (an error or
    # invalid end); task 3: two samples, one failed at the limit, one masked (left out)
    assert capped_share([[1], [0], [0], [0, None]], [[10], [10], [4], [10, 10]], 10) == 2 / 4
    assert capped_share([[0]], [[3]], 3) == 1.0 and capped_share([[0]], [[2]], 3) == 0.0
    with pytest.raises(ValueError, match="no scored episode"):
        capped_share([[None]], [[3]], 3)


def test_every_arm_is_explained_in_the_commands_help():
    import subprocess
    import sys
    from pathlib import Path

    from core.study import ARM_HELP, ARMS

    assert set(ARM_HELP) == set(ARMS)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "study", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0 and "usage: scalinginter study" in out.stdout
    for arm in ARMS:
        assert f"  {arm} " in out.stdout


def test_fit_arm_is_the_scalinginter_curriculum_on_tasks_that_fit_each_phase():
    from core.config import build_config
    from core.study import arm_overrides
    from envs.babyai.presets import PRESETS

    assert arm_phases(PHASES, "scalinginter-fit") == PHASES
    assert arm_overrides("scalinginter-fit") == ["rollout.task_filter=fits_turns"]
    cfg = build_config("babyai", "multistep", arm_overrides("scalinginter-fit"), presets=PRESETS)
    assert cfg.rollout.task_filter == "fits_turns" and cfg.algo.estimator == "grpo"


def test_study_refuses_a_fit_arm_that_would_repeat_scalinginter(tmp_path, capsys):
    """With the fits-turns filter already in the config, scalinginter and scalinginter-fit are one run: refused
    before anything is scored, with the fix."""
    from flows.study import main as study_main

    with pytest.raises(SystemExit) as e:
        study_main(["--env", "babyai", "--preset", "multistep-rl", "--arms", "scalinginter,scalinginter-fit",
                    "--output-dir", str(tmp_path)])
    assert e.value.code == 2 and "rollout.task_filter=none" in capsys.readouterr().err
    assert not (tmp_path / "evals").exists()

def test_rescore_agreement_by_hand():
    from core.study import rescore_agreement

    r = rescore_agreement([1, 0, 1, 1, 0], [1, 1, 1, 0, 0])
    assert r["tasks"] == 5 and r["same"] == 3 and r["differ"] == [1, 3] and r["agreement"] == 3 / 5
    assert r["first"] == 3 / 5 and r["second"] == 3 / 5  # equal rates can hide two flipped tasks
    assert rescore_agreement([0.5, 1.0], [0.5, 1.0])["agreement"] == 1.0
    with pytest.raises(ValueError, match="same tasks"):
        rescore_agreement([1, 0], [1])


def _health(collapsed, at_limit):
    return {"collapsed": collapsed, "horizon": {"phase-1": {"diag/turn_limit_frac": 0.1},
                                                "phase-2": {"diag/turn_limit_frac": at_limit}}}


def test_paper_claims_by_hand():
    from core.study import PLATEAU_TOLERANCE, paper_claims

    arms = {
        # fixed-long: 2 of 3 seeds collapsed; scalinginter: 1 of 3 -> the collapse claim appears
        "fixed-long": {"steps": 36, "per_seed": [_health(True, 0.9), _health(True, 0.7), _health(False, 0.5)],
                       "curve": {"0": {"mean": 0.35}, "12": {"mean": 0.30}}},
        "scalinginter": {"steps": 36, "per_seed": [_health(True, 0.2), _health(False, 0.4), _health(False, 0.3)],
                         # JSON keys (strings) sort as numbers: step 24 -> 36 gains 0.05
                         "curve": {"0": {"mean": 0.35}, "24": {"mean": 0.40}, "36": {"mean": 0.45},
                                   "12": {"mean": 0.5}}},
        # fixed-short gains 0.01 over its last phase (< the tolerance): flat while scalinginter goes on
        "fixed-short": {"steps": 36, "per_seed": [_health(False, 0.0)],
                        "curve": {0: {"mean": 0.35}, 24: {"mean": 0.40}, 36: {"mean": 0.41}}},
    }
    comparisons = {"scalinginter - fixed-short": {"diff": 0.04, "ci95": [0.01, 0.07], "ci95_seed_task": [-0.02, 0.1]},
                   "scalinginter - fixed-long": {"diff": 0.1, "ci95": [0.05, 0.15]}}
    got = {c["claim"]: c for c in paper_claims(arms, comparisons)}
    assert list(got) == ["fixed_long_collapse", "fixed_short_plateau", "curriculum_ahead_of_short",
                         "curriculum_ahead_of_long"]
    c = got["fixed_long_collapse"]
    assert c["verdict"] == "appears"
    assert c["measured"]["fixed-long collapsed"] == "2/3" and c["measured"]["scalinginter collapsed"] == "1/3"
    assert c["measured"]["fixed-long at-limit share, last phase"] == pytest.approx(0.7)
    assert c["measured"]["scalinginter at-limit share, last phase"] == pytest.approx(0.3)
    p = got["fixed_short_plateau"]
    assert p["verdict"] == "appears"
    assert p["measured"]["fixed-short last-phase gain"] == pytest.approx(0.01)
    assert (p["measured"]["from step"], p["measured"]["to step"]) == (24, 36)
    assert p["measured"]["scalinginter last-phase gain"] == pytest.approx(0.05)
    # the seed-level interval decides where the report has it (the per-task one would say "appears")
    s = got["curriculum_ahead_of_short"]
    assert s["verdict"] == "not separated" and s["measured"]["interval"] == "seeds x tasks"
    assert s["measured"]["ci95"] == [-0.02, 0.1]
    assert got["curriculum_ahead_of_long"]["verdict"] == "appears"
    assert got["curriculum_ahead_of_long"]["measured"]["interval"] == "tasks"
    assert str(PLATEAU_TOLERANCE) in p["rule"]


def test_paper_claims_other_verdicts_and_missing_arms():
    from core.study import paper_claims

    # only scalinginter ran: every claim that needs another arm says so
    only = {"scalinginter": {"steps": 4, "per_seed": [_health(False, 0.1)], "curve": {0: {"mean": 0.2}}}}
    assert [c["verdict"] for c in paper_claims(only, {})] == ["not run"] * 4
    arms = {
        "fixed-long": {"steps": 36, "per_seed": [_health(False, 0.9), _health(False, 0.9)]},  # no collapse
        "scalinginter": {"steps": 36, "per_seed": [_health(False, 0.1)],
                         "curve": {0: {"mean": 0.3}, 24: {"mean": 0.30}, 36: {"mean": 0.31}}},  # flat too
        "fixed-short": {"steps": 36, "curve": {0: {"mean": 0.3}, 24: {"mean": 0.30}, 36: {"mean": 0.33}}},
    }
    comparisons = {"scalinginter - fixed-short": {"diff": -0.1, "ci95": [-0.2, -0.01]}}
    got = {c["claim"]: c["verdict"] for c in paper_claims(arms, comparisons)}
    assert got == {"fixed_long_collapse": "does not appear",
                   "fixed_short_plateau": "does not appear",  # fixed-short still gains 0.03
                   "curriculum_ahead_of_short": "reversed", "curriculum_ahead_of_long": "not run"}
    arms["fixed-short"]["curve"][36] = {"mean": 0.29}  # now flat, but scalinginter is flat as well
    arms["fixed-long"]["per_seed"][0]["collapsed"] = True  # 1 of 2: not more than half
    got = {c["claim"]: c["verdict"] for c in paper_claims(arms, comparisons)}
    assert got["fixed_short_plateau"] == "partly" and got["fixed_long_collapse"] == "partly"
    del arms["scalinginter"]  # flat, but nothing to be flat against
    assert {c["claim"]: c["verdict"] for c in paper_claims(arms, comparisons)}["fixed_short_plateau"] == "not run"


def test_report_precision_recorded_or_inferred_from_the_machine_and_overrides():
    from core.study import report_precision

    assert report_precision({"precision": {"learner": "fp32", "rollout": "float32"}}) == \
        {"learner": "fp32", "rollout": "float32"}
    assert report_precision({"machine": "2 cores, avx512_bf16"}) == {"learner": "bf16"}
    assert report_precision({"machine": "2 cores, amx_bf16, avx512_bf16"}) == {"learner": "bf16"}
    assert report_precision({"machine": "2 cores, avx2-only (fp32)"}) == {"learner": "fp32"}
    # an override wins over the machine; the last one counts; none/null leaves it to the machine
    assert report_precision({"machine": "2 cores, avx512_bf16",
                             "overrides": ["model.bf16_autocast=true", "model.bf16_autocast=false"]}) == \
        {"learner": "fp32"}
    assert report_precision({"machine": "m", "overrides": ["model.bf16_autocast=True"]}) == {"learner": "bf16"}
    assert report_precision({"machine": "2 cores, avx512_bf16", "overrides": ["model.bf16_autocast=none"]}) == \
        {"learner": "bf16"}


def test_precision_conflict_and_merged_precision_by_hand():
    from core.study import merged_precision, precision_conflict

    a, b = {"learner": "bf16", "rollout": "bfloat16"}, {"learner": "bf16"}
    assert precision_conflict([a, b], ["p", "q"]) is None  # compared on the keys each records
    c = {"learner": "fp32", "rollout": "float32"}
    assert precision_conflict([a, b, c], ["p", "q", "r"]) == \
        "learner: p bf16, q bf16, r fp32; rollout: p bfloat16, r float32"
    assert merged_precision([a, b]) == a
    assert merged_precision([a, c]) == {"learner": "mixed (bf16, fp32)", "rollout": "mixed (bfloat16, float32)"}
    with pytest.raises(ValueError):
        precision_conflict([a], [])


def test_pieces_in_and_piece_plan_by_hand():
    from core.study import Piece, piece_plan, pieces_in

    def rep(arms, preset="p", **kw):
        return {"env": "e", "preset": preset, "machine": "m",
                "arms": {arm: {"seeds": seeds, "per_seed_success": [0.5] * len(seeds)} for arm, seeds in arms.items()},
                **kw}

    named = [("one.json", rep({"scalinginter": [0], "fixed-short": [0]})),
             ("two.json", rep({"scalinginter": [1, 2]}, precision={"learner": "bf16"})),
             ("old.json", {"env": "e", "preset": "p", "machine": "m",  # no seeds list: from the run names
                           "arms": {"fixed-long": {"runs": ["study-e-fixed-long-s1"], "per_seed_success": [0.25]}}}),
             ("again.json", rep({"scalinginter": [1]})),  # the same run in a second report
             ("merged.json", rep({"scalinginter": [0, 1]}, merged_from=["one.json", "two.json"])),
             ("other.json", rep({"fixed-long": [0]}, preset="q"))]
    pieces = pieces_in(named, "e", "p")
    assert [(p.arm, p.seed, p.report) for p in pieces] == [
        ("scalinginter", 0, "one.json"), ("fixed-short", 0, "one.json"), ("scalinginter", 1, "two.json"),
        ("scalinginter", 2, "two.json"), ("fixed-long", 1, "old.json"), ("scalinginter", 1, "again.json")]
    assert pieces[2] == Piece("scalinginter", 1, "two.json", 0.5, {"learner": "bf16"})
    assert pieces[4].heldout == 0.25 and pieces[0].precision == {"learner": "fp32"}
    found, missing = piece_plan(pieces, ["scalinginter", "fixed-long"], [0, 1])
    assert [p.report for p in found[("scalinginter", 1)]] == ["two.json", "again.json"]
    assert missing == [("fixed-long", 0)]  # seed 2 and fixed-short were not asked for
    assert piece_plan([], ["a"], [3, 4]) == ({("a", 3): [], ("a", 4): []}, [("a", 3), ("a", 4)])


def test_one_arithmetic_and_one_start_per_seed_by_hand():
    """Seeds may differ in arithmetic and starting model; the pieces of one seed may not (their arms' paired
    difference would carry it)."""
    from core.study import Piece, blocked_seeds, seed_precision_conflict, start_key

    bf, fp = {"learner": "bf16"}, {"learner": "fp32"}
    assert seed_precision_conflict([("a", 0, bf), ("b", 0, bf), ("c", 1, fp), ("d", 1, fp)]) is None
    assert seed_precision_conflict([("a", 0, bf), ("b", 0, fp), ("c", 1, fp)]) == "seed 0: learner: a bf16, b fp32"
    assert seed_precision_conflict([("a", 0, bf), ("c", None, fp)]) == "learner: a bf16, c fp32"  # unknown: vs all
    warm = {"source_model": "m", "epochs": 2, "lr": 5e-5, "epoch_losses": [0.42391, 0.13884]}
    again = {"start_model": {"path": "/x", "warmstart": {**warm, "epoch_losses": [0.42389, 0.13876]}}}
    assert start_key({"start_model": {"path": "/w", "warmstart": warm}}) == start_key(again)  # 3 decimals
    fp32_start = {"start_model": {"path": "/w", "warmstart": {**warm, "epoch_losses": [0.406, 0.13884]}}}
    assert start_key(fp32_start) != start_key(again)
    assert start_key({"start_model": {"path": "/base", "warmstart": None}}) == "/base"
    assert start_key({}) is None
    k_bf, k_fp = start_key(again), start_key(fp32_start)
    pieces = [Piece("scalinginter", 0, "a.json", 0.5, bf, k_bf), Piece("fixed-short", 0, "b.json", 0.3, bf, k_bf),
              Piece("scalinginter", 1, "c.json", 0.4, fp, k_fp), Piece("fixed-short", 2, "d.json", 0.4, fp, None)]
    assert blocked_seeds(pieces, fp, k_fp) == {0: "its pieces trained in learner bf16 (scalinginter, a.json)"}
    assert blocked_seeds(pieces, bf, k_bf) == {1: "its pieces trained in learner fp32 (scalinginter, c.json)",
                                               2: "its pieces trained in learner fp32 (fixed-short, d.json)"}
    assert blocked_seeds(pieces, fp, "/other") == {
        0: "its pieces trained in learner bf16 (scalinginter, a.json)",
        1: "its pieces started from another model (scalinginter, c.json)"}  # seed 2's start unknown: not blocked
    assert blocked_seeds(pieces, fp, None) == {0: "its pieces trained in learner bf16 (scalinginter, a.json)"}


def test_piece_progress_by_hand():
    from core.study import piece_progress

    phases = [{"turn_limit": 3, "steps": 2}, {"turn_limit": 6, "steps": 1}, {"turn_limit": 10, "steps": 1}]
    assert piece_progress([], phases) == {"done": 0, "total": 4, "spent_s": 0.0, "left_s": None}
    recs = [{"global_step": 1, "turn_limit": 3, "step_time_s": 40.0},
            {"global_step": 2, "turn_limit": 3, "step_time_s": 70.0},  # killed after this record: logged again
            {"global_step": 2, "turn_limit": 3, "step_time_s": 50.0},
            {"global_step": 3, "turn_limit": 6, "step_time_s": 90.0}]
    # 180 s over turn limits 3 + 3 + 6 = 12: 15 s a unit; the step left is at 10 turns: 150 s
    assert piece_progress(recs, phases) == {"done": 3, "total": 4, "spent_s": 180.0, "left_s": 150.0}
    # the pace of the last 2 steps only: 140 s over 3 + 6 = 9 turns, x 10 turns left
    assert piece_progress(recs, phases, recent=2)["left_s"] == 140.0 / 9 * 10
    # a slow start (other work beside it, or another machine before a resume) does not set the pace
    slow = [{"global_step": 1, "turn_limit": 3, "step_time_s": 400.0}] + recs[1:]
    assert piece_progress(slow, phases, recent=2)["left_s"] == 140.0 / 9 * 10
    assert piece_progress(slow, phases)["spent_s"] == 540.0
    assert piece_progress(recs + [{"global_step": 4, "turn_limit": 10, "step_time_s": 160.0}], phases)["left_s"] == 0


def test_shared_phases_by_hand():
    """fixed-short trains phase 1 as scalinginter does (and -gigpo / -fit do not: their overrides differ);
    fixed-long shares nothing with a growing curriculum; the whole run is never shared."""
    from core.study import phase_donors, shared_phases

    assert shared_phases(PHASES, "fixed-short", "scalinginter") == 1
    assert shared_phases(PHASES, "scalinginter", "fixed-short") == 1
    assert shared_phases(PHASES, "fixed-short", "scalinginter-gigpo") == 0  # GiGPO: another estimator
    assert shared_phases(PHASES, "scalinginter-fit", "scalinginter") == 0  # other tasks
    assert shared_phases(PHASES, "fixed-long", "scalinginter") == 0
    assert shared_phases(PHASES, "scalinginter", "scalinginter") == 0
    flat_start = [{"turn_limit": 2, "steps": 1}, {"turn_limit": 2, "steps": 1}, {"turn_limit": 4, "steps": 1}]
    assert shared_phases(flat_start, "fixed-short", "scalinginter") == 2  # 2, 2 then 2 vs 4
    assert shared_phases(flat_start, "fixed-long", "scalinginter") == 0
    same = [{"turn_limit": 2, "steps": 1}, {"turn_limit": 2, "steps": 1}]
    assert shared_phases(same, "fixed-short", "scalinginter") == 1  # all alike: not the last phase
    assert shared_phases([{"turn_limit": 3, "steps": 4}], "fixed-short", "scalinginter") == 0
    assert phase_donors(PHASES, "fixed-short") == [("scalinginter", 1)]
    assert phase_donors(PHASES, "scalinginter") == [("fixed-short", 1)]
    assert phase_donors(PHASES, "fixed-long") == [] and phase_donors(PHASES, "scalinginter-gigpo") == []
    assert phase_donors(flat_start, "scalinginter", ["fixed-long", "fixed-short"]) == [("fixed-short", 2)]
