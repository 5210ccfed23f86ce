"""`bench/learning_study.py` end to end at toy size, so the study command cannot rot: three arms of the tiny
BabyAI preset (real SmolLM2, transformers backend), one seed, two held-out tasks, budgets 1 and 2. Checks the
arms' curricula as trained, the held-out curve points from eval.each_phase, the report's statistics and the
JSON / PNG / table it writes. The numbers are not the point at this size; their shape and provenance are.

The fast tests build the report from synthetic evaluation documents and run records (the shapes ``train_arm`` and
``flows.evaluate`` produce) and check its per-bucket numbers, comparisons, merge, table and plot by hand."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import learning_study

    return learning_study


# --- the report from synthetic runs ---------------------------------------------------------------------------
# 8 held-out tasks: bucket "1" = tasks 0-2, "2-3" = 3-4, "4-6" = 5, "7+" = 6, task 7 unlabelled; budgets 2 and 4
TASKS = list(range(1000, 1008))
LABELS = [1, 1, 1, 2, 3, 5, 9, None]
BASE = {4: [0, 0, 0, 1, 0, 0, 0, 1], 2: [0, 0, 0, 0, 0, 0, 0, 1]}
# per arm, per seed: the final checkpoint's greedy outcomes per budget, and the phase-1 final's at 4 turns
FINAL = {
    "scalinginter": [{4: [1, 1, 1, 1, 0, 0, 0, 1], 2: [1, 0, 0, 0, 0, 0, 0, 0]},
                     {4: [1, 1, 0, 0, 1, 1, 0, 0], 2: [0, 0, 0, 0, 0, 0, 0, 0]}],
    "fixed-long": [{4: [0, 0, 0, 1, 0, 0, 0, 1], 2: [0, 0, 0, 0, 0, 0, 0, 0]},
                   {4: [1, 0, 0, 1, 0, 0, 0, 1], 2: [0, 0, 0, 0, 0, 0, 0, 0]}],
    "scalinginter-gigpo": [{4: [1, 1, 1, 1, 1, 1, 1, 1], 2: [1, 1, 1, 0, 0, 0, 0, 1]},
                           {4: [1, 1, 1, 1, 1, 0, 0, 1], 2: [1, 1, 0, 0, 0, 0, 0, 1]}],
}
PHASE1 = {"scalinginter": [[1, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0, 0, 0]]}  # other arms: the base's
ARMS3 = list(FINAL)
PHASES = [{"turn_limit": 2, "steps": 1}, {"turn_limit": 4, "steps": 1}]
CATEGORIES = ["L1"] * 3 + ["L2"] * 3 + ["L3"] * 2  # the tasks' levels


def _doc(outcomes: dict[int, list[int]], labels: list, ref: str) -> dict:
    """An evaluation document as flows.evaluate writes it (greedy, one sample per task)."""
    from core.evalreport import Outcome, model_report

    outs = [Outcome(task_id=t, turn_limit=b, sample=0, success=bool(v[i]), reward=float(v[i]), turns=b,
                    category=CATEGORIES[i], required_turns=labels[i])
            for b, v in outcomes.items() for i, t in enumerate(TASKS)]
    return {"task_ids": list(TASKS), "samples": 1,
            "models": {"model": {"ref": ref, **model_report(outs, TASKS, sorted(outcomes), 1)}}}


def _run(arm: str, seed: int, labels: list) -> dict:
    """A run record as train_arm returns it (2 steps, one per phase), with its final evaluation."""
    name = f"study-babyai-{arm}-s{seed}"
    phase1 = PHASE1.get(arm, [BASE[4], BASE[4]])[seed]
    # seed 0: turn-limit share 1.0 then 0.5, entropy 2.0; seed 1: 0.5 then 0.0, entropy NaN (a step without it)
    records = [{"global_step": 1, "phase": 1, "diag/turn_limit_frac": 1.0 - 0.5 * seed,
                "train/entropy": float("nan") if seed else 2.0, "success_rate": 0.5 * seed},
               {"global_step": 2, "phase": 2, "diag/turn_limit_frac": 0.5 - 0.5 * seed,
                "success_rate": 0.25 + 0.5 * seed}]
    return {"run_name": name, "arm": arm, "seed": seed, "final_checkpoint": f"/x/{name}/final",
            "overrides": [], "mlflow_run_id": None, "wall_time_s": 10.0 + seed, "steps": 2,
            "generated_tokens": 100 * (seed + 1), "step_time_s": 4.0,
            "train_success": {1: 0.5 * seed, 2: 0.25 + 0.5 * seed},
            "heldout_by_step": {1: {**_doc({4: phase1}, labels, f"/x/{name}/phase-1"), "global_step": 1}},
            "step_records": records, "final_eval": _doc(FINAL[arm][seed], labels, f"/x/{name}/final")}


def _report(seeds: list[int], labels: list = LABELS, arms: list[str] = ARMS3, base: dict = BASE,
            start: dict | None = None) -> dict:
    """build_report on the synthetic runs, through JSON as the study writes it."""
    ls = _bench()
    a = argparse.Namespace(env="babyai", preset="multistep", set=["model.path=/m"], seeds=len(seeds), eval_n=8,
                           experiment="learning-study-babyai")
    runs = [_run(arm, s, labels) for s in seeds for arm in arms]
    rep = ls.build_report(a, arms, PHASES, [2, 4], _doc(base, labels, "/m"), runs, 60.0)
    rep["start_model"] = start or {"path": "/m", "warmstart": None}
    return json.loads(json.dumps(rep))


def _flat(x, key=""):
    """Nested dicts/lists -> {path: leaf}, to compare two reports' numbers with a tolerance."""
    if isinstance(x, dict):
        return {k: v for kk, vv in x.items() for k, v in _flat(vv, f"{key}/{kk}").items()}
    if isinstance(x, list):
        return {k: v for i, vv in enumerate(x) for k, v in _flat(vv, f"{key}/{i}").items()}
    return {key: x}


def test_build_report_buckets_by_hand():
    from core.stats import wilson_interval

    rep = _report([0, 1])
    assert rep["task_required_turns"] == LABELS and rep["task_ids"] == TASKS
    assert rep["base"]["per_task_by_budget"] == {"2": BASE[2], "4": BASE[4]}
    assert {k: c["success"] for k, c in rep["base"]["buckets"]["4"].items()} == {"1": 0.0, "2-3": 0.5, "4-6": 0.0,
                                                                                 "7+": 0.0}
    si = rep["arms"]["scalinginter"]
    assert si["overrides"] == [] and rep["arms"]["scalinginter-gigpo"]["overrides"] == ["algo.estimator=gigpo"]
    assert si["turn_limits"] == [2, 4] and rep["arms"]["fixed-long"]["turn_limits"] == [4, 4]
    # at 4 turns seed 0 solves 5 of 8, seed 1 4 of 8; at 2 turns 1 and 0
    assert si["heldout_success"] == pytest.approx(9 / 16) and si["sweep"] == {"2": 1 / 16, "4": 9 / 16}
    assert si["per_seed_per_task_by_budget"] == {"2": [FINAL["scalinginter"][0][2], FINAL["scalinginter"][1][2]],
                                                 "4": [FINAL["scalinginter"][0][4], FINAL["scalinginter"][1][4]]}
    b4 = si["buckets"]["4"]
    assert list(b4) == ["1", "2-3", "4-6", "7+"]
    # "1" (tasks 0-2; base 0, 0, 0): seed 0 solves 3, seed 1 2 -> 5/6; McNemar vs base: seed 0 b=3, c=0 ->
    # 2 * 0.5^3 = 0.25; seed 1 b=2, c=0 -> 2 * 0.5^2 = 0.5
    assert b4["1"]["success"] == pytest.approx(5 / 6) and b4["1"]["tasks"] == 3
    assert b4["1"]["ci95"] == pytest.approx(list(wilson_interval(5, 6)))
    assert b4["1"]["per_seed_success"] == pytest.approx([1.0, 2 / 3])
    assert b4["1"]["vs_base_mcnemar_p"] == pytest.approx([0.25, 0.5])
    # "2-3" (tasks 3, 4; base 1, 0): [1, 0] and [0, 1] -> 2/4; "4-6" (task 5): 0, 1; "7+" (task 6): 0, 0
    assert (b4["2-3"]["success"], b4["4-6"]["success"], b4["7+"]["success"]) == (0.5, 0.5, 0.0)
    assert b4["4-6"]["per_seed_success"] == [0.0, 1.0]
    # at 2 turns: "1" seed 0 solves task 0 only -> 1/6, vs the base (none): b=1, c=0 -> p 1
    b2 = si["buckets"]["2"]
    assert b2["1"]["success"] == pytest.approx(1 / 6) and b2["1"]["vs_base_mcnemar_p"] == [1.0, 1.0]
    assert b2["2-3"]["success"] == 0.0
    # bucket curves at 4 turns: base (step 0), phase-1 final (step 1), final (step 2)
    c1 = si["bucket_curves"]["1"]
    assert c1["0"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": 2}
    assert c1["1"] == {"mean": pytest.approx(1 / 6), "lo": 0.0, "hi": pytest.approx(1 / 3), "n": 2}
    assert c1["2"] == {"mean": pytest.approx(5 / 6), "lo": pytest.approx(2 / 3), "hi": 1.0, "n": 2}
    assert si["bucket_curves"]["2-3"]["1"]["mean"] == pytest.approx(0.25)  # phase 1: [0, 0] and [1, 0]
    # overall held-out curve: base 2/8, phase 1 (2/8 + 1/8) / 2, final (5/8 + 4/8) / 2
    assert {s: b["mean"] for s, b in si["curve"].items()} == pytest.approx({"0": 0.25, "1": 0.1875, "2": 0.5625})
    # diagnostics: per phase over the steps, then over the seeds (the NaN entropy step is left out)
    assert si["diagnostics"] == {
        "phase-1": {"diag/turn_limit_frac": 0.75, "train/entropy": 2.0, "success_rate": 0.25},
        "phase-2": {"diag/turn_limit_frac": 0.25, "success_rate": 0.5}}
    assert set(si["diag_curves"]) == {"diag/turn_limit_frac", "train/entropy"}
    assert si["diag_curves"]["diag/turn_limit_frac"]["1"] == {"mean": 0.75, "lo": 0.5, "hi": 1.0, "n": 2}
    assert si["diag_curves"]["train/entropy"] == {"1": {"mean": 2.0, "lo": 2.0, "hi": 2.0, "n": 1}}
    # comparisons: ScalingInter minus the others, the GiGPO arm minus the fixed one; per budget and bucket
    cmp = rep["comparisons"]
    assert list(cmp) == ["scalinginter - fixed-long", "scalinginter - scalinginter-gigpo",
                         "scalinginter-gigpo - fixed-long"]
    c = cmp["scalinginter - fixed-long"]
    # pooled per task at 4: [1, 1, .5, .5, .5, .5, 0, .5] (4.5/8) vs [.5, 0, 0, 1, 0, 0, 0, 1] (2.5/8)
    assert c["diff"] == pytest.approx(0.25) and c["tasks"] == 8
    assert set(c["budgets"]) == {"2", "4"} and c["budgets"]["4"]["diff"] == pytest.approx(0.25)
    assert c["budgets"]["2"]["diff"] == pytest.approx(1 / 16)
    assert list(c["budgets"]["4"]["buckets"]) == ["1", "2-3", "4-6", "7+"]
    assert c["budgets"]["4"]["buckets"]["1"]["diff"] == pytest.approx(5 / 6 - 1 / 6)  # [1, 1, .5] vs [.5, 0, 0]
    assert c["budgets"]["4"]["buckets"]["1"]["tasks"] == 3
    # paired by seed too: the per-seed differences drawn over seeds and tasks. "7+" (task 6): 0 - 0 on both seeds;
    # "4-6" (task 5): ScalingInter 0 and 1, fixed-long 0 and 0 -> differences 0 and 1 -> [0, 1]
    assert c["budgets"]["4"]["buckets"]["7+"]["ci95_seed_task"] == [0.0, 0.0]
    assert c["budgets"]["4"]["buckets"]["4-6"]["ci95_seed_task"] == [0.0, 1.0]
    lo, hi = c["budgets"]["4"]["ci95_seed_task"]
    assert lo <= 0.25 <= hi
    g = cmp["scalinginter-gigpo - fixed-long"]["budgets"]["2"]  # at 2: [1, 1, .5, 0, 0, 0, 0, 1] vs zeros
    assert g["diff"] == pytest.approx(3.5 / 8) and g["buckets"]["1"]["diff"] == pytest.approx(2.5 / 3)
    assert "final_eval" not in rep["runs"][0] and len(rep["runs"]) == 6


def test_build_report_refuses_other_tasks_and_skips_buckets_without_labels(tmp_path):
    ls = _bench()
    a = argparse.Namespace(env="babyai", preset="multistep", set=[], seeds=1, eval_n=8, experiment="x")
    run = _run("scalinginter", 0, LABELS)
    run["final_eval"]["task_ids"] = TASKS[::-1]
    with pytest.raises(SystemExit, match="other held-out tasks"):
        ls.build_report(a, ["scalinginter"], PHASES, [2, 4], _doc(BASE, LABELS, "/m"), [run], 1.0)
    # an env that labels no task: no buckets anywhere, the rest as before
    rep = _report([0, 1], labels=[None] * 8)
    assert "task_required_turns" not in rep and "buckets" not in rep["base"]
    for r in rep["arms"].values():
        assert "buckets" not in r and "bucket_curves" not in r
    assert rep["arms"]["scalinginter"]["heldout_success"] == pytest.approx(9 / 16)
    c = rep["comparisons"]["scalinginter - fixed-long"]
    assert set(c["budgets"]) == {"2", "4"} and "buckets" not in c["budgets"]["4"]
    assert "by required turns" not in ls.table(rep)
    ls.plot(rep, tmp_path / "plain.png")
    assert (tmp_path / "plain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_of_one_seed_reports_equals_the_two_seed_report():
    ls = _bench()
    full = _report([0, 1])
    m = ls.merge_reports([_report([0]), _report([1])])
    assert m["seeds"] == 2 and m["budgets"] == [2, 4] and m["task_required_turns"] == LABELS
    assert m["base"]["buckets"] == full["base"]["buckets"]
    assert m["base"]["per_task_by_budget"] == full["base"]["per_task_by_budget"]
    for arm in ARMS3:
        got, want = m["arms"][arm], full["arms"][arm]
        for key in ("buckets", "per_seed_per_task_by_budget", "per_seed_per_task", "pooled_per_task", "ci95",
                    "vs_base_mcnemar_p", "per_seed_success", "overrides", "turn_limits"):
            assert got[key] == want[key], (arm, key)
        for key in ("heldout_success", "sweep", "bucket_curves", "diagnostics", "diag_curves", "curve"):
            assert _flat(got[key]) == pytest.approx(_flat(want[key])), (arm, key)
    assert m["comparisons"] == full["comparisons"]  # the same pooled per-task outcomes, the same bootstrap seed
    bad = _report([1])
    bad["task_required_turns"] = [1] * 8
    with pytest.raises(SystemExit, match="required-turns labels"):
        ls.merge_reports([_report([0]), bad])


def test_merge_of_a_study_run_in_pieces_with_the_warm_start_made_again(tmp_path):
    """A study run an arm and a seed at a time, each piece on a machine that made the warm start again (the same
    recipe, other epoch losses, one held-out task scored otherwise): the merge pools each arm's seeds in seed order
    from whichever pieces ran them, compares each seed with its own piece's starting model, and gives the base row
    as the mean of the starting models with each one's score and the tasks they agree on. Another recipe, a seed
    in two pieces, other tasks are refused."""
    ls = _bench()
    rec = {"source_model": "smollm2-135m", "demos_requested": 48, "demos_succeeded": 48, "epochs": 2, "lr": 5e-5,
           "env_options": {}}
    start_a = {"path": "/a/warm", "warmstart": {**rec, "epoch_losses": [0.42, 0.14]}}
    start_b = {"path": "/b/warm", "warmstart": {**rec, "epoch_losses": [0.43, 0.13]}}
    base_b = {4: [0, 0, 0, 1, 1, 0, 0, 1], 2: BASE[2]}  # the remade warm start also solves task 4 at 4 turns
    # piece 1: fixed-long seed 1 alone; piece 2: ScalingInter seed 1 and fixed-long seed 0 (another warm start);
    # piece 3: ScalingInter seed 0
    p1 = _report([1], arms=["fixed-long"], start=start_a)
    p2 = _report([1], arms=["scalinginter"], start=start_b, base=base_b)
    p2b = _report([0], arms=["fixed-long"], start=start_b, base=base_b)
    p2["arms"]["fixed-long"] = p2b["arms"]["fixed-long"]
    p3 = _report([0], arms=["scalinginter"], start=start_a)
    m = ls.merge_reports([p1, p2, p3])
    full = _report([0, 1], arms=["scalinginter", "fixed-long"])
    assert list(m["arms"]) == ["fixed-long", "scalinginter"] and m["seeds"] == 2
    for arm in ("scalinginter", "fixed-long"):
        got, want = m["arms"][arm], full["arms"][arm]
        assert got["seeds"] == [0, 1]  # seed order, whichever piece ran them
        for key in ("per_seed_per_task", "per_seed_per_task_by_budget", "pooled_per_task", "per_seed_success"):
            assert got[key] == want[key], (arm, key)
        assert [h["seed"] for h in got["per_seed"]] == [0, 1]
    # the base row: the mean of the two starting models per task (pieces 1 and 3 one, piece 2 the other)
    assert m["base"]["per_task_by_budget"]["4"] == pytest.approx([0, 0, 0, 1, 1 / 3, 0, 0, 1])
    assert m["base"]["heldout_success"] == pytest.approx((2 / 8 + 3 / 8 + 2 / 8) / 3)
    assert [s["heldout_success"] for s in m["base"]["starts"]] == [0.25, 0.375, 0.25]
    assert m["base"]["starts"][1]["epoch_losses"] == [0.43, 0.13]
    assert m["base"]["starts_agree"] == {"2": 8, "4": 7}
    assert ls.starts_text(m["base"]["starts"]) == (
        "2 warm starts of this recipe (epoch NLL 0.420 -> 0.140: 2 pieces, 0.250 each; "
        "epoch NLL 0.430 -> 0.130: 1 piece, 0.375)")
    # each seed against its own piece's starting model, per bucket: "2-3" at 4 turns (tasks 3, 4):
    # ScalingInter seed 0 (piece 3, base [1, 0]) solves [1, 0]: no discordant task, p 1; seed 1 (piece 2, base
    # [1, 1]) solves [0, 1]: one discordant, p 1; fixed-long seed 0 (piece 2) solves [1, 0] against [1, 1]
    b23 = m["arms"]["scalinginter"]["buckets"]["4"]["2-3"]
    assert b23["per_seed_success"] == [0.5, 0.5] and b23["vs_base_mcnemar_p"] == [1.0, 1.0]
    # "1" (tasks 0-2, base 0 in both): seed 0 solves 3 (p 0.25), seed 1 solves 2 (p 0.5)
    assert m["arms"]["scalinginter"]["buckets"]["4"]["1"]["vs_base_mcnemar_p"] == pytest.approx([0.25, 0.5])
    # the comparison is paired by seed: the same as the two-seed study's
    assert m["comparisons"]["scalinginter - fixed-long"]["ci95_seed_task"] == \
        full["comparisons"]["scalinginter - fixed-long"]["ci95_seed_task"]
    text = ls.table(m)
    assert "scored by each of the 3 pieces, which started from 2 warm starts of this recipe" in text
    # the paper's claims on the merged study: the verdict against fixed-long from the seed-paired interval
    claims = {c["claim"]: c for c in m["paper_claims"]}
    assert claims["curriculum_ahead_of_long"]["measured"]["ci95"] == \
        m["comparisons"]["scalinginter - fixed-long"]["ci95_seed_task"]
    assert claims["fixed_short_plateau"]["verdict"] == "not run"  # no fixed-short arm in these pieces
    assert "the paper's claims here" in text and "curriculum_ahead_of_long" in text
    ls.plot(m, tmp_path / "pieces.png")
    other = _report([1], arms=["scalinginter"], start={"path": "/c", "warmstart": {**rec, "epochs": 3,
                                                                                  "epoch_losses": [0.4]}})
    with pytest.raises(SystemExit, match="not one warm start's recipe"):
        ls.merge_reports([p1, other])
    with pytest.raises(SystemExit, match="seed in two reports"):
        ls.merge_reports([p1, _report([1], arms=["fixed-long"], start=start_b, base=base_b)])
    with pytest.raises(SystemExit, match="base model scored differently"):
        ls.merge_reports([p1, _report([0], arms=["fixed-long"], start=start_a, base=base_b)])


def test_merge_refuses_pieces_of_one_seed_in_other_arithmetic_unless_allowed():
    """Within a seed, a piece trained with an fp32 learner (a machine without native bf16) beside a bf16 piece:
    refused, naming each piece's arithmetic; merged with --allow-mixed-precision, the report says it is mixed. Seeds
    in different arithmetic merge, the report giving each seed's."""
    ls = _bench()
    p0 = {**_report([0], arms=["scalinginter"]), "machine": "2 cores, avx512_bf16"}  # inferred: learner bf16
    p1 = {**_report([0], arms=["fixed-long"]), "precision": {"learner": "fp32", "rollout": "float32"}}
    with pytest.raises(SystemExit, match=r"one seed trained in different arithmetic \(seed 0: learner: a bf16, "
                                         r"b fp32\).*--allow-mixed"):
        ls.merge_reports([p0, p1], names=["a", "b"])
    m = ls.merge_reports([p0, p1], allow_mixed_precision=True, names=["a", "b"])
    assert m["precision"] == {"learner": "mixed (bf16, fp32)", "rollout": "float32"}
    assert m["precision_by_seed"] == {"0": {"learner": "mixed (bf16, fp32)", "rollout": "float32"}}
    p2 = {**_report([1], arms=["scalinginter", "fixed-long"]), "precision": {"learner": "fp32", "rollout": "float32"}}
    m = ls.merge_reports([p0, {**p1, "precision": {"learner": "bf16"}}, p2], names=["a", "b", "c"])
    assert m["precision_by_seed"] == {"0": {"learner": "bf16"}, "1": {"learner": "fp32", "rollout": "float32"}}
    assert "arithmetic: learner mixed (bf16, fp32), rollout float32 (seed 0: learner bf16; seed 1: learner fp32, " \
           "rollout float32; within a seed, one)" in ls.table(m)
    p3 = {**_report([1], arms=["scalinginter"]), "precision": {"learner": "bf16", "rollout": "bfloat16"}}
    assert ls.merge_reports([p0, p3])["precision"] == {"learner": "bf16", "rollout": "bfloat16"}


def test_status_lists_the_pieces_done_and_the_next_command(tmp_path, capsys):
    """``scalinginter study --status``: the pieces in --results (each arm and seed, its held-out success and
    arithmetic; a merged report and another preset's ignored), those left, each seed's arithmetic and whether this
    machine may add to it, and the command for the next piece it may run."""
    ls = _bench()
    from runtime.backends.hardware import native_bf16

    here = "bf16" if native_bf16() else "fp32"
    other = "fp32" if here == "bf16" else "bf16"
    p0 = {**_report([0], arms=["scalinginter"]), "precision": {"learner": other}}
    p1 = {**_report([0], arms=["fixed-long"]), "precision": {"learner": other}}
    merged = {**ls.merge_reports([p0, p1]), "merged_from": ["a.json", "b.json"]}
    (tmp_path / "a.json").write_text(json.dumps(p0))
    (tmp_path / "b.json").write_text(json.dumps(p1))
    (tmp_path / "m.json").write_text(json.dumps(merged))
    (tmp_path / "x.json").write_text(json.dumps({**p0, "preset": "tiny"}))
    (tmp_path / "broken.json").write_text("{")
    def argv(seeds):
        return ["--env", "babyai", "--preset", "multistep", "--arms", "scalinginter,fixed-long", "--seeds", seeds,
                "--results", str(tmp_path), "--set", "model.path=/m", "--budgets", "2,4", "--status"]

    assert ls.main(argv("2")) == 0
    out = capsys.readouterr().out
    assert "2 of 4 done" in out
    rows = [x.split() for x in out.splitlines() if x.startswith(("scalinginter ", "fixed-long "))]
    assert [r[:2] for r in rows] == [["scalinginter", "0"], ["fixed-long", "0"], ["scalinginter", "1"],
                                     ["fixed-long", "1"]]
    assert rows[0][2] == f"{p0['arms']['scalinginter']['per_seed_success'][0]:.3f}" and rows[0][-1] == "a.json"
    assert rows[2][-2:] == ["(to", "run)"] and rows[3][-2:] == ["(to", "run)"]
    # a piece under way in --output-dir: how far it got and the training time left at its pace (the multistep
    # preset: 10 steps each at 3, 6 and 10 turns; 2 steps done at 3 turns in 3,600 s, one logged twice across a
    # resume: 600 s a unit of turn limit, times 8 x 3 + 10 x 6 + 10 x 10 = 184 units left = 30.7 h)
    run = tmp_path / "runs" / "study-babyai-scalinginter-s1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"global_step": g, "turn_limit": 3, "step_time_s": t}) + "\n"
                                               for g, t in ((1, 1500.0), (2, 99.0), (2, 2100.0))) + '{"global_st')
    assert ls.main(argv("2") + ["--output-dir", str(tmp_path / "runs")]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("scalinginter            1"))
    assert row.endswith(f"(in progress in {tmp_path / 'runs'}: step 2/30, about 30.7 h of training left at its pace; "
                        "its command resumes it)")
    # its phase evaluations so far (eval.each_phase): their held-out success; one cut by a kill is left out
    overall = {"avg": {"value": 0.3071, "ci": [0.24, 0.39]}, "mean_reward": 0.3, "mean_turns": 5.0, "episodes": 140,
               "masked_episodes": 0, "tasks": 140, "pass": {}}
    (run / "eval_phase-1.json").write_text(json.dumps({"models": {"model": {"budgets": {"4": {"overall": overall}}}}}))
    (run / "eval_phase-2.json").write_text('{"models": {"mo')
    assert ls.main(argv("2") + ["--output-dir", str(tmp_path / "runs")]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("scalinginter            1"))
    assert "step 2/30, held-out after phase 1 0.307, about 30.7 h of training left" in row
    (run / "summary.json").write_text("{}")
    assert ls.main(argv("2") + ["--output-dir", str(tmp_path / "runs")]) == 0
    assert "its held-out scoring and report are left" in capsys.readouterr().out
    assert f"seed 0: trained in learner {other}; this machine must not add to it: its pieces trained in learner " \
        f"{other} (scalinginter, a.json), this machine trains in learner {here}" in out
    nxt = next(x for x in out.splitlines() if x.startswith("next (2 left): "))
    assert nxt.endswith("--budgets 2,4 --arms scalinginter --seeds 1 --first-seed 1")
    assert "--status" not in nxt and "--arms scalinginter,fixed-long" not in nxt
    # the pieces of seed 1 in this machine's arithmetic: the next one here is seed 1's fixed-long
    (tmp_path / "c.json").write_text(json.dumps({**_report([1], arms=["scalinginter"]),
                                                 "precision": {"learner": here}}))
    assert ls.main(argv("3")) == 0
    out = capsys.readouterr().out
    assert "3 of 6 done" in out and f"seed 1: trained in learner {here}\n" in out
    assert next(x for x in out.splitlines() if x.startswith("next (")).startswith("next (3 left): ")
    d = {**_report([1], arms=["fixed-long"]), "precision": {"learner": other}}
    d["arms"]["fixed-long"]["seeds"] = [2]  # seed 2's fixed-long, in the other arithmetic
    (tmp_path / "d.json").write_text(json.dumps(d))
    assert ls.main(argv("3")) == 0
    out = capsys.readouterr().out
    assert "next (2 left, 1 of them on this machine): " in out and out.rstrip().endswith("--first-seed 1")
    # a study started here with such pieces of the seeds it runs in its --results says so before it trains
    ns = argparse.Namespace(results=str(tmp_path), env="babyai", preset="multistep", first_seed=0, seeds=1)
    ls.warn_other_arithmetic(ns, {"learner": here})
    assert f"2 piece(s) of seed(s) 0 of this study in {tmp_path} trained in learner {other}" in capsys.readouterr().out
    ls.warn_other_arithmetic(ns, {"learner": other})
    assert capsys.readouterr().out == ""
    ns.first_seed = 1
    ls.warn_other_arithmetic(ns, {"learner": here})  # seed 1's piece trained here's way
    assert capsys.readouterr().out == ""


def test_next_runs_the_first_missing_piece_in_the_pieces_arithmetic(tmp_path, capsys):
    """``--next``: the first arm and seed without a report (seed by seed, in the arms' order) whose seed has no piece
    in another arithmetic than this machine's; refused where every seed left has (unless --allow-mixed-precision);
    nothing to run once every piece is in. A piece's report is named after its arm and seed."""
    ls = _bench()
    from runtime.backends.hardware import native_bf16

    here = "bf16" if native_bf16() else "fp32"
    other = "fp32" if here == "bf16" else "bf16"
    ns = argparse.Namespace(results=str(tmp_path), env="babyai", preset="multistep", first_seed=0, seeds=2,
                            set=["model.path=/m"], allow_mixed_precision=False)
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) == ("scalinginter", 0)  # nothing there yet
    (tmp_path / "a.json").write_text(json.dumps({**_report([0], arms=["scalinginter"]),
                                                 "precision": {"learner": here}}))
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) == ("fixed-long", 0)
    assert "next piece: fixed-long seed 0 (3 of 4 left)" in capsys.readouterr().out
    (tmp_path / "b.json").write_text(json.dumps({**_report([1], arms=["scalinginter"]),
                                                 "precision": {"learner": other}}))
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) == ("fixed-long", 0)  # seed 0 still first
    (tmp_path / "c.json").write_text(json.dumps({**_report([0], arms=["fixed-long"]),
                                                 "precision": {"learner": other}}))  # seed 0 mixed already
    with pytest.raises(SystemExit, match=f"left has pieces this machine must not add to: seed 1: its pieces trained "
                                         f"in learner {other}.*this machine trains in learner {here}"):
        ls.next_piece(ns, ["scalinginter", "fixed-long"])
    ns.seeds = 3  # a seed with no piece yet: any arithmetic may start it
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) == ("scalinginter", 2)
    assert "skipped seed(s) 1: seed 1: its pieces trained in learner" in capsys.readouterr().out
    ns.seeds, ns.allow_mixed_precision = 2, True
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) == ("fixed-long", 1)
    ns.seeds = 1
    (tmp_path / "c.json").unlink()
    (tmp_path / "e.json").write_text(json.dumps({**_report([0], arms=["fixed-long"]), "precision": {"learner": here}}))
    assert ls.next_piece(ns, ["scalinginter", "fixed-long"]) is None
    assert "nothing to run" in capsys.readouterr().out
    assert ls.main(["--env", "babyai", "--preset", "multistep", "--arms", "scalinginter,fixed-long", "--seeds", "1",
                    "--results", str(tmp_path), "--set", "model.path=/m", "--next"]) == 0  # trains nothing
    (tmp_path / "e.json").unlink()  # seed 0's piece left started from /m, not from the model.path asked for
    ns.set, ns.allow_mixed_precision = ["model.path=/elsewhere"], False
    with pytest.raises(SystemExit, match=r"seed 0: its pieces started from another model \(scalinginter, a.json\)"):
        ls.next_piece(ns, ["scalinginter", "fixed-long"])
    out = tmp_path / "out"
    ls.write_outputs(argparse.Namespace(results=str(out), env="babyai", tag=None),
                     _report([1], arms=["scalinginter"]))
    (js,) = out.glob("*.json")
    assert js.name.startswith("learning-study-babyai-scalinginter-s1-")
    ls.write_outputs(argparse.Namespace(results=str(out / "two"), env="babyai", tag=None), _report([0, 1]))
    (js,) = (out / "two").glob("*.json")
    assert re.match(r"learning-study-babyai-\d{8}-\d{6}\.json$", js.name)
    ls.write_outputs(argparse.Namespace(results=str(out / "tag"), env="babyai", tag="multistep-rl"),
                     _report([1], arms=["fixed-long"]))
    (js,) = (out / "tag").glob("*.json")
    assert re.match(r"learning-study-babyai-multistep-rl-fixed-long-s1-\d{8}-\d{6}\.json$", js.name)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # a tag goes into file names: a path is refused before anything runs
        ls.main(["--tag", "../x", "--status"])
    assert refused.value.code == 2 and "--tag '../x': use letters, digits and '-'" in capsys.readouterr().err


def test_table_and_plot_show_the_buckets(tmp_path):
    from core.stats import wilson_interval

    ls = _bench()
    rep = _report([0, 1])
    text = ls.table(rep)
    assert "arm overrides: scalinginter-gigpo: algo.estimator=gigpo" in text
    i4, i2 = (text.index(f"held-out by required turns at {b} turns") for b in (4, 2))
    assert i4 < i2  # the largest budget first
    block = text[i4:i2].splitlines()
    assert block[1].split() == ["1", "(n=3)", "2-3", "(n=2)", "4-6", "(n=1)", "7+", "(n=1)"]
    lo, hi = wilson_interval(5, 6)
    si_row = next(line for line in block if line.startswith("scalinginter "))
    assert si_row.split()[1:3] == ["0.83", f"[{lo:.2f},{hi:.2f}]"]  # bucket "1": 5/6
    base_row = next(line for line in block if line.startswith("base model"))
    assert base_row.split()[2:4] == ["0.00", "[0.00,0.56]"]  # Wilson of 0/3
    assert "at 2 turns: all +0.062" in text  # ScalingInter - fixed-long at 2 turns: 1/16
    assert "stability diagnostics per phase" in text
    assert "phases trained once" not in text
    rep["runs"][1]["shared_phases"] = {"from_run": rep["runs"][0]["run_name"], "phases": 1, "global_step": 1,
                                       "step_time_s": 12.4}
    assert (f"phases trained once for two arms: {rep['runs'][1]['run_name']} took phases 1-1 (steps 1-1, 12 s) over "
            f"from {rep['runs'][0]['run_name']}") in ls.table(rep)
    diag = next(line for line in text.splitlines() if line.startswith("scalinginter ") and "phase-1" in line)
    assert diag.split()[1:3] == ["phase-1", "2"] and diag.split()[6] == "0.750"  # turn limit 2; at-limit 0.75
    for name, r in (("single", rep), ("merged", ls.merge_reports([_report([0]), _report([1])]))):
        png = tmp_path / f"{name}.png"
        ls.plot(r, png)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000



class _Stop(Exception):
    pass


def _stop_at_the_first_command(monkeypatch, ls) -> list[list[str]]:
    """The study's subprocess runner replaced: the command it is given is recorded, then ``_Stop`` is raised."""
    seen: list[list[str]] = []

    def fake_run(cmd, log, label, tally=None):
        seen.append(cmd)
        raise _Stop

    monkeypatch.setattr(ls, "_run_logged", fake_run)
    return seen


def _sets(cmd: list[str]) -> list[str]:
    """The ``--set`` values of a command line, in order."""
    return [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]


def test_run_logged_sums_the_wall_time_of_a_runs_commands(tmp_path):
    """A piece resumed by a second command reports both commands' wall time: the tally file carries the first's
    (a failed one too) into the second's."""
    ls = _bench()
    log, tally = tmp_path / "logs" / "r.log", tmp_path / "logs" / "r.wall.json"
    sleep = [sys.executable, "-c", "import time; time.sleep(0.5); print('x')"]
    first = ls._run_logged(sleep, log, "r", tally=tally)
    assert first >= 0.5 and json.loads(tally.read_text())["wall_time_s"] == pytest.approx(first, abs=0.05)
    with pytest.raises(SystemExit, match="r failed"):
        ls._run_logged([sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"], log, "r",
                       tally=tally)
    failed_too = json.loads(tally.read_text())["wall_time_s"]
    assert failed_too >= first + 0.5
    total = ls._run_logged(sleep, log, "r", tally=tally)
    assert total >= failed_too + 0.5 and json.loads(tally.read_text())["wall_time_s"] == pytest.approx(total, abs=0.05)
    assert ls._run_logged(sleep, log, "r") < total  # without a tally: this command's time alone
    tally.write_text("not json")
    assert ls._read_tally(tally) == 0.0 and ls._read_tally(None) == 0.0


@pytest.mark.parametrize("arm", ["scalinginter", "fixed-short", "fixed-long", "scalinginter-gigpo",
                                 "scalinginter-fit"])
def test_train_arm_command_gives_the_arm_its_curriculum_and_overrides(tmp_path, monkeypatch, arm):
    """The ``scalinginter run`` command of an arm, read back as the run reads it: the arm's turn limits and
    overrides win over the user's ``--set`` (which may set the curriculum the arms derive from)."""
    from core.study import arm_phases
    from flows.config import build_config

    ls = _bench()
    seen = _stop_at_the_first_command(monkeypatch, ls)
    user = ['curriculum.phases=[{"turn_limit": 1, "steps": 1}, {"turn_limit": 3, "steps": 2}]',
            "algo.estimator=grpo", "rollout.samples_per_task=2"]
    a = argparse.Namespace(env="babyai", preset="multistep", set=user, output_dir=str(tmp_path), eval_n=4,
                           experiment="learning-study-babyai")
    phases = [p.model_dump() for p in build_config("babyai", "multistep", user).curriculum.phases]
    assert [p["turn_limit"] for p in phases] == [1, 3]  # main() derives the arms from the user's curriculum
    with pytest.raises(_Stop):
        ls.train_arm(a, arm, 0, phases, 3)
    (cmd,) = seen
    sets = _sets(cmd)
    cfg = build_config("babyai", "multistep", sets)  # as flows.cli applies them: in order, the last one wins
    assert [p.model_dump() for p in cfg.curriculum.phases] == arm_phases(phases, arm)
    assert cfg.algo.estimator == ("gigpo" if arm == "scalinginter-gigpo" else "grpo")
    assert cfg.seed == 0 and cfg.eval.turn_limit == 3 and cfg.eval.n == 4 and cfg.eval.each_phase
    assert not cfg.eval.each_phase_last  # the study scores the final checkpoint itself
    assert cmd[cmd.index("--run-name") + 1] == f"study-babyai-{arm}-s0"
    assert cfg.rollout.task_filter == ("fits_turns" if arm == "scalinginter-fit" else "none")

def _donor_run(ls, a, arm: str, phases: list[dict], *, extra: list[str] = ()) -> Path:
    """A finished run of ``arm`` (seed 0) in ``a.output_dir`` as ``scalinginter run`` leaves it, at toy size: its
    config, two step records (one per phase), the phase-1 held-out score, a rollout file and the phase finals
    (``storage.checkpoint_store`` checkpoints whose trainer state holds the config's fingerprint); ``extra``
    overrides make its training config differ from the study's."""
    from core.fingerprint import fingerprint
    from storage.checkpoint_store import save_checkpoint
    from tasks.runs import recorded_config

    out, name = Path(a.output_dir), ls.run_name(a, arm, 0)
    cfg = ls.preset_config(a.env, a.preset, ls.arm_sets(a, arm, 0, phases, 3) + list(extra) + [f"run_name={name}"])
    rd = out / name
    (rd / "rollouts").mkdir(parents=True)
    (rd / "config.json").write_text(json.dumps(recorded_config(cfg)))
    (rd / "metrics.jsonl").write_text("".join(json.dumps({"global_step": s, "phase": s, "success_rate": s / 4,
                                                          "step_time_s": 10.0 * s}) + "\n" for s in (1, 2)))
    (rd / "eval_phase-1.json").write_text(json.dumps({"global_step": 1, "note": "phase-1 score"}))
    (rd / "rollouts" / "step-000001.parquet").write_bytes(b"step 1")
    (rd / "rollouts" / "step-000002.parquet").write_bytes(b"step 2")
    for k in (1, 2):
        src = out / f"src-{arm}-{k}"
        src.mkdir()
        (src / "model.safetensors").write_bytes(f"weights {arm} phase {k}".encode())
        (src / "trainer_state.json").write_text(json.dumps({"global_step": k, "phase": k, "phase_step": 1,
                                                            "fingerprint": fingerprint(recorded_config(cfg))}))
        for step in ("step-000001", "final"):  # a step checkpoint and the final
            save_checkpoint(src, str(out / "checkpoints" / name / f"phase-{k}" / step))
    return rd


def test_an_arm_takes_over_the_phases_another_arm_trained_alike(tmp_path, monkeypatch, capsys):
    """fixed-short's phase 1 is scalinginter's (same limit, steps, seed, start and settings): with scalinginter's
    run scored in the output dir, fixed-short's run gets its phase-1 final (linked, not copied), held-out score
    and step records, and the run command allows the one difference its resume check meets (the later phases'
    limits, ``curriculum.phases``); the real resume check passes with it and refuses without. The donor's phase
    finals are kept while fixed-short has not started and deleted once it has; a kill between the record and the
    links is mended; a donor trained with other settings is not used."""
    from core.fingerprint import ResumeMismatch
    from flows.config import build_config
    from storage.checkpoint_store import checkpoint_exists
    from tasks.resume import check_config

    ls = _bench()
    user = ['curriculum.phases=[{"turn_limit": 1, "steps": 1}, {"turn_limit": 3, "steps": 1}]',
            "rollout.samples_per_task=2"]
    a = argparse.Namespace(env="babyai", preset="multistep", set=user, output_dir=str(tmp_path / "runs"), eval_n=4,
                           experiment="learning-study-babyai", share_phases=True)
    phases = [p.model_dump() for p in build_config("babyai", "multistep", user).curriculum.phases]
    ck = tmp_path / "runs" / "checkpoints"
    donor = _donor_run(ls, a, "scalinginter", phases)
    dname, name = donor.name, "study-babyai-fixed-short-s0"
    (tmp_path / "runs" / "evals").mkdir()
    (tmp_path / "runs" / "evals" / f"{dname}.json").write_text("{}")  # scored: the piece prunes its checkpoints
    ls.prune_checkpoints(a, phases, dname)
    kept = sorted(str(p.relative_to(ck / dname)) for p in (ck / dname).iterdir())
    assert kept == [ls.KEPT_FOR_SHARING, "phase-1"] and [p.name for p in (ck / dname / "phase-1").iterdir()] == ["final"]

    assert ls._in_progress(a, "fixed-short", 0, phases) == (
        f"(to run; it may take phases 1-1 over from {dname} in {a.output_dir})")  # what --status says
    assert ls._in_progress(a, "fixed-long", 0, phases) == "(to run)"
    seen = _stop_at_the_first_command(monkeypatch, ls)
    with pytest.raises(_Stop):
        ls.train_arm(a, "fixed-short", 0, phases, 3)
    assert "phases 1-1 taken over from study-babyai-scalinginter-s0" in capsys.readouterr().out
    sets = _sets(seen[-1])
    assert sets[-1] == 'resume.allow_changes=["curriculum.phases"]'
    rd = tmp_path / "runs" / name
    assert [json.loads(x)["global_step"] for x in (rd / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((rd / "eval_phase-1.json").read_text())["note"] == "phase-1 score"
    assert (rd / "rollouts" / "step-000001.parquet").exists() and not (rd / "rollouts" / "step-000002.parquet").exists()
    rec = json.loads((rd / ls.SHARED_FILE).read_text())
    assert rec["from_run"] == dname and rec["phases"] == 1 and rec["global_step"] == 1 and rec["step_time_s"] == 10.0
    final = ck / name / "phase-1" / "final"
    assert checkpoint_exists(str(final)) and not (ck / name / "phase-2").exists()
    assert (final / "model.safetensors").stat().st_ino == (ck / dname / "phase-1" / "final" / "model.safetensors").stat().st_ino
    # in MLflow as if trained: a finished phase-1 run with the step's metrics (0-based step), the headline on the run
    from tasks.runs import make_tracker
    tracker = make_tracker(build_config("babyai", "multistep", sets + [f"run_name={name}"]))
    parent = tracker.find_run(name)
    ph1 = tracker.find_run(f"{name}/phase-1", parent)
    assert parent and ph1 and tracker.find_run(f"{name}/phase-2", parent) is None
    run = tracker.client.get_run(ph1)
    assert run.info.status == "FINISHED" and run.data.tags["scalinginter.shared_from"] == dname
    assert run.data.tags["scalinginter.final_checkpoint"] == str(final)
    assert [(m.step, m.value) for m in tracker.client.get_metric_history(ph1, "step_time_s")] == [(0, 10.0)]
    assert [(m.step, m.value) for m in tracker.client.get_metric_history(parent, "success_rate")] == [(0, 0.25)]
    # the run's own resume check on that final, as flows.scalinginter makes it: allowed, and refused without
    cfg = build_config("babyai", "multistep", sets + [f"run_name={name}"])
    state = json.loads((final / "trainer_state.json").read_text())
    check_config(cfg, state, str(final))
    with pytest.raises(ResumeMismatch, match="curriculum.phases"):
        check_config(build_config("babyai", "multistep", sets[:-1] + [f"run_name={name}"]), state, str(final))

    # a kill after the record, before the links: the next command links them again
    import shutil
    shutil.rmtree(ck / name)
    with pytest.raises(_Stop):
        ls.train_arm(a, "fixed-short", 0, phases, 3)
    assert checkpoint_exists(str(final)) and _sets(seen[-1])[-1] == 'resume.allow_changes=["curriculum.phases"]'
    tracker = make_tracker(build_config("babyai", "multistep", sets + [f"run_name={name}"]))  # logged once only
    assert len(tracker.client.get_metric_history(ph1, "step_time_s")) == 1 and tracker.find_run(name) == parent
    # the donor's kept final stays while fixed-short has no checkpoint folder and is not done
    shutil.rmtree(ck / name)
    ls.prune_checkpoints(a, phases, dname)
    assert checkpoint_exists(str(ck / dname / "phase-1" / "final"))
    with pytest.raises(_Stop):
        ls.train_arm(a, "fixed-short", 0, phases, 3)
    # fixed-short trained and scored: its checkpoints and the donor's kept final go
    (rd / "summary.json").write_text(json.dumps({"final_checkpoint": str(ck / name / "phase-2" / "final")}))
    (tmp_path / "runs" / "evals" / f"{name}.json").write_text("{}")
    ls.prune_checkpoints(a, phases, name)
    assert not (ck / name).exists() and not (ck / dname).exists()
    # had it not finished, it could not go on without them: said, with the way out
    (rd / "summary.json").unlink()
    with pytest.raises(SystemExit, match="neither run has their final checkpoints now: delete"):
        ls.train_arm(a, "fixed-short", 0, phases, 3)

    # a donor whose training config differs in more than the later phases' limits is not used
    b = argparse.Namespace(**{**vars(a), "output_dir": str(tmp_path / "other")})
    _donor_run(ls, b, "scalinginter", phases, extra=["algo.lr=0.5"])
    with pytest.raises(_Stop):
        ls.train_arm(b, "fixed-short", 0, phases, 3)
    assert "not taking phases over from study-babyai-scalinginter-s0" in capsys.readouterr().out
    assert not any(s.startswith("resume.allow_changes") for s in _sets(seen[-1]))
    assert not (tmp_path / "other" / name / "metrics.jsonl").exists()
    # and with --no-shared-phases nothing is taken over
    c = argparse.Namespace(**{**vars(a), "output_dir": str(tmp_path / "third"), "share_phases": False})
    _donor_run(ls, c, "scalinginter", phases)
    with pytest.raises(_Stop):
        ls.train_arm(c, "fixed-short", 0, phases, 3)
    assert not (tmp_path / "third" / name).exists()


@pytest.mark.slow
def test_learning_study_toy(tmp_path):
    """The default study (three arms, the tiny preset) with the real SmolLM2. Not in CI (~4.5 min): CI runs the
    multistep toy test below, the same command and resume on a tiny model with three of its arms."""
    out, res = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench" / "learning_study.py"), "--env", "babyai", "--preset", "tiny",
           "--seeds", "1", "--eval-n", "2", "--budgets", "1,2", "--output-dir", str(out), "--results", str(res),
           "--set", "rollout.backend=transformers", "--set", "rollout.max_new_tokens=8"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (js,) = res.glob("learning-study-babyai-*.json")
    assert js.with_suffix(".png").stat().st_size > 1000 and js.with_suffix(".md").exists()
    rep = json.loads(js.read_text())
    assert list(rep["arms"]) == ["scalinginter", "fixed-short", "fixed-long"]
    assert [rep["arms"][a]["turn_limits"] for a in rep["arms"]] == [[1, 2], [1, 1], [2, 2]]
    for arm, r in rep["arms"].items():
        run = f"study-babyai-{arm}-s0"
        cfg = json.loads((out / run / "config.json").read_text())
        assert [p["turn_limit"] for p in cfg["curriculum"]["phases"]] == r["turn_limits"]  # trained as planned
        assert cfg["tracking"]["experiment"] == "learning-study-babyai"
        assert (out / run / "eval_phase-1.json").exists()  # the held-out point after phase 1
        assert not (out / run / "eval_phase-2.json").exists()  # the last phase's final: the study's own final eval
        assert sorted(int(s) for s in r["curve"]) == [0, 1, 2]  # base, phase 1, final
        assert r["steps"] == 2 and r["generated_tokens"] > 0
        lo, hi = r["ci95"]
        assert lo <= r["heldout_success"] <= hi
        assert set(r["sweep"]) == {"1", "2"} or set(r["sweep"]) == {1, 2}
        assert not (out / "checkpoints" / run).exists()  # scored, then deleted
    assert set(rep["comparisons"]) == {"scalinginter - fixed-short", "scalinginter - fixed-long"}
    assert "held-out" in p.stdout and "scalinginter" in p.stdout
    # a second invocation resumes: nothing is trained or scored again
    p2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0 and "training study-" not in p2.stdout and "evaluating " not in p2.stdout


@pytest.mark.slow
def test_learning_study_multistep_toy(tmp_path, toy_policy):
    """``scalinginter study`` on three of the multistep preset's arms (a fixed horizon, GiGPO and matched tasks: the
    other arms differ from these only in their overrides) end to end at toy size: the multistep preset's levels
    with a 1 -> 2 turn curriculum of one step per phase, the tiny
    warm-started Llama of tests/toypolicy.py, one seed, four held-out tasks, budgets 1 and 2. Checks that the GiGPO
    arm trained with GiGPO and the fit arm on tasks matched to its limits, that the report carries the tasks'
    required-turns labels, the per-bucket results, curves and diagnostics, the comparisons, and the starting
    model's re-score."""
    import os

    from core.evalreport import BUCKETS

    out, res = tmp_path / "runs", tmp_path / "results"
    arms = ["fixed-short", "scalinginter-gigpo", "scalinginter-fit"]
    sets = [f"model.path={toy_policy}",
            'curriculum.phases=[{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 1}]',
            "rollout.tasks_per_step=2", "rollout.samples_per_task=2", "rollout.max_new_tokens=8",
            "rollout.token_budget=1000", "rollout.backend=transformers", "tracking.log_trajectories=0"]
    cmd = [sys.executable, "-m", "flows.cli", "study", "--env", "babyai", "--preset", "multistep",
           "--arms", ",".join(arms), "--seeds", "1", "--eval-n", "4", "--budgets", "1,2",
           "--output-dir", str(out), "--results", str(res)]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the study's own store under out
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (js,) = res.glob("learning-study-babyai-*.json")
    assert js.with_suffix(".png").stat().st_size > 1000
    md = js.with_suffix(".md").read_text()
    assert "held-out by required turns at 2 turns" in md and "held-out by required turns at 1 turns" in md
    assert "arm overrides: scalinginter-gigpo: algo.estimator=gigpo" in md
    rep = json.loads(js.read_text())
    assert rep["start_model"]["path"] == str(toy_policy)
    assert list(rep["arms"]) == arms
    from runtime.backends.hardware import native_bf16  # the arithmetic the runs trained in (transformers rollout)

    want = "bf16" if native_bf16() else "fp32"
    assert rep["precision"] == {"learner": want, "rollout": want}
    assert [rep["arms"][a]["turn_limits"] for a in arms] == [[1, 1], [1, 2], [1, 2]]
    rs = rep["rescore"]["budgets"]  # the starting model scored twice, lock-step: the same outcome on every task
    assert set(rs) == {"1", "2"} and all(r["tasks"] == 4 and r["same"] == 4 for r in rs.values())
    for arm, r in rep["arms"].items():
        cfg = json.loads((out / f"study-babyai-{arm}-s0" / "config.json").read_text())
        assert [ph["turn_limit"] for ph in cfg["curriculum"]["phases"]] == r["turn_limits"]  # trained as planned
        assert cfg["algo"]["estimator"] == ("gigpo" if arm == "scalinginter-gigpo" else "grpo")
        assert cfg["model"]["path"] == str(toy_policy) and cfg["rollout"]["samples_per_task"] == 2
        assert cfg["rollout"]["task_filter"] == ("fits_turns" if arm == "scalinginter-fit" else "none")
        assert r["overrides"] == {"scalinginter-gigpo": ["algo.estimator=gigpo"],
                                  "scalinginter-fit": ["rollout.task_filter=fits_turns"]}.get(arm, [])
    labels = rep["task_required_turns"]  # BabyAI's expert labels every held-out task
    assert len(labels) == 4 and all(isinstance(x, int) and x >= 1 for x in labels)
    for name, r in [("base", rep["base"])] + list(rep["arms"].items()):
        assert set(r["buckets"]) == {"1", "2"}, name
        for b, cells in r["buckets"].items():
            assert set(cells) <= set(BUCKETS) and sum(c["tasks"] for c in cells.values()) == 4, (name, b)
            for c in cells.values():
                assert c["ci95"][0] <= c["success"] <= c["ci95"][1]
    for arm, r in rep["arms"].items():
        assert r["steps"] == 2
        assert set(r["bucket_curves"]) == set(r["buckets"]["2"])
        for curve in r["bucket_curves"].values():
            assert sorted(int(s) for s in curve) == [0, 1, 2]  # base, phase-1 final, final
        for run in r["runs"]:  # the last phase's final is scored once, by the study's own evaluation
            assert not (out / run / "eval_phase-2.json").exists() and (out / run / "eval_phase-1.json").exists()
        assert list(r["diagnostics"]) == ["phase-1", "phase-2"]
        assert "diag/turn_limit_frac" in r["diagnostics"]["phase-1"] and "success_rate" in r["diagnostics"]["phase-2"]
        assert sorted(int(s) for s in r["diag_curves"]["diag/turn_limit_frac"]) == [1, 2]
    assert list(rep["comparisons"]) == ["scalinginter-gigpo - fixed-short"]
    for c in rep["comparisons"].values():
        assert set(c["budgets"]) == {"1", "2"}
        assert set(c["budgets"]["2"]["buckets"]) == set(rep["base"]["buckets"]["2"])
    # scored, deleted; but fixed-short's phase-1 final, which scalinginter (not run yet) may take over
    assert all(not (out / "checkpoints" / f"study-babyai-{arm}-s0").exists() for arm in arms[1:])
    kept = out / "checkpoints" / "study-babyai-fixed-short-s0"
    assert sorted(p.name for p in kept.iterdir()) == [".kept-for-sharing", "phase-1"]
    assert [p.name for p in (kept / "phase-1").iterdir()] == ["final"]
    assert "kept for scalinginter" in p.stdout
    # the command again with scalinginter added: the three arms resume (nothing trained or scored again), and
    # scalinginter takes over fixed-short's kept phase-1 final (trained once), trains its phase 2 from it and is
    # scored; then no checkpoint is left
    cmd3 = list(cmd)
    cmd3[cmd3.index("--arms") + 1] = ",".join(arms + ["scalinginter"])
    p3 = subprocess.run(cmd3, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p3.returncode == 0, p3.stdout[-3000:] + p3.stderr[-3000:]
    assert re.findall(r"(?:training|evaluating) (study-[\w-]+|base[\w-]*)", p3.stdout) == [
        "study-babyai-scalinginter-s0", "study-babyai-scalinginter-s0"], p3.stdout[-3000:]
    assert "study-babyai-scalinginter-s0: phases 1-1 taken over from study-babyai-fixed-short-s0" in p3.stdout
    own, took = _step_records(out / "study-babyai-fixed-short-s0"), _step_records(out / "study-babyai-scalinginter-s0")
    assert took[1] == own[1] and sorted(took) == [1, 2]  # step 1 fixed-short's, step 2 its own (2 turns)
    assert json.loads((out / "study-babyai-scalinginter-s0" / "config.json").read_text())["curriculum"]["phases"] == [
        {"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 1}]
    (rep3,) = [r for r in map(lambda f: json.loads(f.read_text()), res.glob("learning-study-babyai-*.json"))
               if "scalinginter" in r["arms"]]
    assert rep3["arms"]["fixed-short"]["per_seed_per_task_by_budget"] == rep["arms"]["fixed-short"][
        "per_seed_per_task_by_budget"]  # the resumed arms' results as they were
    (run3,) = [r for r in rep3["runs"] if r["arm"] == "scalinginter"]
    assert all("shared_phases" not in r for r in rep3["runs"] if r["arm"] != "scalinginter")
    assert run3["shared_phases"]["from_run"] == "study-babyai-fixed-short-s0" and run3["steps"] == 2
    (md3,) = [f.with_suffix(".md").read_text() for f in res.glob("learning-study-babyai-*.json")
              if "scalinginter" in json.loads(f.read_text())["arms"]]
    assert "study-babyai-scalinginter-s0 took phases 1-1 (steps 1-1" in md3 and "over from study-babyai-fixed-short-s0" in md3
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())  # all scored, deleted
    # in MLflow its taken phase is its own: a finished phase-1 run with fixed-short's step, the whole headline curve
    # on the run, and the phase-1 final registered under its name (as the run's skipped phase registers it)
    from storage.tracking import Tracker, default_tracking_uri, registered_model_name
    tracker, taker = Tracker(default_tracking_uri(out), "learning-study-babyai"), "study-babyai-scalinginter-s0"
    parent = tracker.find_run(taker)
    ph1 = tracker.client.get_run(tracker.find_run(f"{taker}/phase-1", parent))
    assert ph1.info.status == "FINISHED" and ph1.data.tags["scalinginter.shared_from"] == "study-babyai-fixed-short-s0"
    assert [m.step for m in tracker.client.get_metric_history(ph1.info.run_id, "train/loss")] == [0]
    assert sorted(m.step for m in tracker.client.get_metric_history(parent, "success_rate")) == [0, 1]
    versions = tracker.client.search_model_versions(f"name='{registered_model_name('babyai')}'")
    assert {(v.tags["run_name"], v.tags["phase"]) for v in versions if v.tags.get("run_name") == taker} == {
        (taker, "1"), (taker, "2")}


def _step_records(run: Path) -> dict[int, dict]:
    """A run's step records (metrics.jsonl) by global step: what training did (loss, entropy, tokens, outcome)."""
    keep = ("train/loss", "train/entropy", "generated_tokens", "success_rate", "mean_reward", "turn_limit")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["global_step"]: {k: r.get(k) for k in keep} for r in recs}


@pytest.mark.slow
def test_a_taken_over_phase_is_the_arms_own(tmp_path, toy_policy):
    """What makes taking phases over sound: fixed-short after scalinginter's phase 1 (trained once) ends as the
    fixed-short that trained its phase 1 itself, step for step and task for task. Not in CI (~4 min here): the
    multistep toy test runs the takeover end to end, and the study's seed 1 showed the same on the real preset
    (docs/results/learning-study-multistep.md)."""
    import os

    sets = [f"model.path={toy_policy}",
            'curriculum.phases=[{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 1}]',
            "rollout.tasks_per_step=2", "rollout.samples_per_task=2", "rollout.max_new_tokens=8",
            "rollout.token_budget=1000", "rollout.backend=transformers", "tracking.log_trajectories=0"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    reports = {}
    for label, arms, extra in [("own", "fixed-short", ["--no-shared-phases"]), ("shared", "scalinginter,fixed-short", [])]:
        out, res = tmp_path / label, tmp_path / f"results-{label}"
        cmd = [sys.executable, "-m", "flows.cli", "study", "--env", "babyai", "--preset", "multistep",
               "--arms", arms, "--seeds", "1", "--eval-n", "4", "--budgets", "1,2", "--no-rescore",
               "--output-dir", str(out), "--results", str(res)] + extra
        for s in sets:
            cmd += ["--set", s]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert ("taken over from" in p.stdout) == (label == "shared")
        (js,) = res.glob("learning-study-babyai-*.json")
        reports[label] = json.loads(js.read_text())
    own, took = tmp_path / "own" / "study-babyai-fixed-short-s0", tmp_path / "shared" / "study-babyai-fixed-short-s0"
    assert json.loads((took / "shared_phases.json").read_text())["from_run"] == "study-babyai-scalinginter-s0"
    assert not (own / "shared_phases.json").exists()
    assert _step_records(took) == _step_records(own) and sorted(_step_records(took)) == [1, 2]
    for b in ("1", "2"):
        assert (reports["shared"]["arms"]["fixed-short"]["per_seed_per_task_by_budget"][b]
                == reports["own"]["arms"]["fixed-short"]["per_seed_per_task_by_budget"][b]), b


def test_report_gives_seed_level_intervals_and_per_run_health():
    """Beside the per-episode Wilson interval, each arm's pooled success and each paired difference get a bootstrap
    over seeds and tasks; each run gets its collapse verdict (too short here to tell), horizon use per phase and
    retention of what the base solved (base solves tasks 3 and 7: scalinginter seed 0 keeps both, seed 1 neither)."""
    from core.stats import seed_cluster_bootstrap, seed_task_bootstrap

    rep = _report([0, 1])
    si = rep["arms"]["scalinginter"]
    rows = [FINAL["scalinginter"][s][4] for s in (0, 1)]
    assert si["ci95_seed_task"] == list(seed_task_bootstrap(rows)[1:])
    c = rep["comparisons"]["scalinginter - fixed-long"]
    diffs = [[a - b for a, b in zip(FINAL["scalinginter"][s][4], FINAL["fixed-long"][s][4])] for s in (0, 1)]
    assert c["ci95_seed_task"] == list(seed_task_bootstrap(diffs)[1:])
    # and with whole levels drawn (the tasks' categories, carried in the report)
    assert rep["task_categories"] == CATEGORIES
    assert si["ci95_seed_category"] == list(seed_cluster_bootstrap(rows, CATEGORIES)[1:])
    assert c["ci95_seed_category"] == list(seed_cluster_bootstrap(diffs, CATEGORIES)[1:])
    h0, h1 = si["per_seed"]
    assert (h0["seed"], h1["seed"]) == (0, 1) and not h0["collapsed"] and h0["final_success"] is None
    assert h0["horizon"] == {"phase-1": {"diag/turn_limit_frac": 1.0}, "phase-2": {"diag/turn_limit_frac": 0.5}}
    assert h0["retention"]["all"] == 1.0 and h1["retention"]["all"] == 0.0 and h0["retention"]["2-3"] == 1.0
    assert "collapse_rule" in rep
    # held-out path (base -> phase 1 -> final at 4 turns): seed 0 lost task 3 and gained task 0, then gained 1-3;
    # seed 1 lost task 7 (-1/8), then lost 3 and gained 0, 1, 4, 5
    c0, c1 = h0["heldout_churn"], h1["heldout_churn"]
    assert [(t["from_step"], t["to_step"], t["lost"], t["gained"]) for t in c0["transitions"]] == [(0, 1, 1, 1),
                                                                                                  (1, 2, 0, 3)]
    assert c0["largest_drop"] == 0.0 and c0["lost"] == 1
    assert [(t["lost"], t["gained"]) for t in c1["transitions"]] == [(1, 0), (1, 4)]
    assert c1["largest_drop"] == 0.125 and c1["lost"] == 2
    # episodes failed at the cap (every synthetic episode takes the whole budget): base 6/8, phase 1 6/8, final 3/8
    assert h0["heldout_at_cap"] == {"0": 0.75, "1": 0.75, "2": 0.375}
    ls = _bench()
    text = ls.table(rep)
    assert "CI seeds x tasks" in text and "no collapse" in text and "retention all 1.00" in text
    assert "held-out lost/gained 1/1 0/3 (largest drop 0.000); held-out failed at the cap 0.75 0.75 0.38" in text
    assert "seeds x categories [" in text
    older = [_report([0]), _report([1])]  # pieces reported before the churn and the categories were: the merge
    for r in older:                       # computes them from the pieces' runs
        del r["task_categories"]
        for a in r["arms"].values():
            for h in a["per_seed"]:
                del h["heldout_churn"]
    merged = ls.merge_reports(older)
    assert merged["task_categories"] == CATEGORIES
    assert merged["arms"]["scalinginter"]["ci95_seed_category"] == si["ci95_seed_category"]
    assert merged["arms"]["scalinginter"]["ci95_seed_task"] == si["ci95_seed_task"]
    assert [h["seed"] for h in merged["arms"]["scalinginter"]["per_seed"]] == [0, 1]
    assert [h["heldout_churn"] for h in merged["arms"]["scalinginter"]["per_seed"]] == [c0, c1]


def test_the_study_evaluates_lock_step_and_reports_the_rescore(tmp_path, monkeypatch):
    """Every held-out evaluation of the study runs lock-step (a generation batch fixed by the tasks and outcomes,
    not by env timing); the starting model's second score is compared task by task and shown in the table."""
    ls = _bench()
    seen = _stop_at_the_first_command(monkeypatch, ls)
    a = argparse.Namespace(env="babyai", set=["rollout.vllm_dtype=bfloat16"], output_dir=str(tmp_path), eval_n=8,
                           experiment="e")
    with pytest.raises(_Stop):
        ls.evaluate(a, "/m", "base", [2, 4], None, 16)
    sets = _sets(seen[0])
    assert "rollout.async_episodes=false" in sets and "rollout.vllm_dtype=bfloat16" in sets

    again = {4: [0, 0, 0, 1, 0, 0, 1, 1], 2: list(BASE[2])}  # task 6 flips at 4 turns
    rs = ls.rescore_report(_doc(BASE, LABELS, "/m"), _doc(again, LABELS, "/m"), [2, 4])
    assert rs["budgets"]["2"]["same"] == 8 and rs["budgets"]["4"]["same"] == 7 and rs["budgets"]["4"]["differ"] == [6]
    rep = {**_report([0]), "rescore": rs}
    assert "re-score (the starting model scored twice" in ls.table(rep) and "4 turns 7/8 tasks the same" in ls.table(rep)
    # two pieces that scored the starting model in one output dir carry the same re-score: said once
    merged = ls.merge_reports([rep, {**_report([1]), "rescore": rs}])
    assert merged["rescore"] == rs and ls.table(merged).count("re-score") == 1
    other = ls.rescore_report(_doc(BASE, LABELS, "/m"), _doc(BASE, LABELS, "/m"), [2, 4])  # all the same
    merged = ls.merge_reports([rep, {**_report([1]), "rescore": other}])
    assert merged["rescore"] == {"parts": [rs, other]} and ls.table(merged).count("re-score") == 2


def test_merge_again_leaves_out_an_earlier_merged_report(tmp_path, capsys):
    """``--merge DIR/*.json`` run again where DIR holds the pieces and their earlier merge: the merged report is
    left out (said), so the pieces are not counted twice, and the new merge equals the first."""
    ls = _bench()
    p0, p1 = _report([0], arms=["scalinginter", "fixed-long"]), _report([1], arms=["scalinginter", "fixed-long"])
    (tmp_path / "a.json").write_text(json.dumps(p0))
    (tmp_path / "b.json").write_text(json.dumps(p1))
    out = tmp_path / "out"
    assert ls.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--results", str(out)]) == 0
    (first,) = out.glob("*.json")
    merged = json.loads(first.read_text())
    assert merged["merged_from"] == ["a.json", "b.json"]
    (tmp_path / "m.json").write_text(json.dumps(merged))
    capsys.readouterr()
    again = tmp_path / "again"
    assert ls.main(["--merge", *(str(tmp_path / n) for n in ("a.json", "b.json", "m.json")),
                    "--results", str(again)]) == 0
    assert "left out 1 merged report(s), whose pieces are merged from their own reports: m.json" in \
        capsys.readouterr().out
    (second,) = again.glob("*.json")
    redo = json.loads(second.read_text())
    assert redo["merged_from"] == ["a.json", "b.json"]
    assert redo["arms"]["scalinginter"]["per_seed_per_task"] == merged["arms"]["scalinginter"]["per_seed_per_task"]
    assert redo["comparisons"] == merged["comparisons"]


def test_study_says_what_is_wrong_with_its_input(tmp_path, capsys):
    """A --merge file that is missing or not JSON, a starting model that is not there: a clear error before
    anything trains (no traceback); --status on a results folder not made yet says so."""
    ls = _bench()
    (tmp_path / "notes.txt").write_text("not a report")
    for argv, says in ((["--merge", str(tmp_path / "missing.json")], "cannot read"),
                       (["--merge", str(tmp_path / "notes.txt")], "is not a study report"),
                       (["--env", "babyai", "--preset", "multistep", "--arms", "fixed-short", "--seeds", "1",
                         "--set", f"model.path={tmp_path / 'no-model'}", "--output-dir", str(tmp_path / "out")],
                        "not found: no such folder")):
        with pytest.raises(SystemExit):
            ls.main(argv)
        assert says in capsys.readouterr().err
    assert not (tmp_path / "out" / "evals").exists()  # nothing was scored
    assert ls.main(["--env", "babyai", "--preset", "multistep", "--results", str(tmp_path / "later"), "--status"]) == 0
    assert f"({tmp_path / 'later'} does not exist yet: no pieces)" in capsys.readouterr().out
