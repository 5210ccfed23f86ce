"""Run comparison: the pure table/regression logic on hand-computed cases, `scalinginter compare` and the
notebook (executed with nbclient) against MLflow runs this test writes through the flows' own Tracker; a
learning study (2 arms x 2 seeds, each final checkpoint scored by an eval run logged with flows.evaluate.log_eval)
in a real sqlite store for `scalinginter compare EXPERIMENT` and the notebook's study cell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.compare import (Rate, StudyRow, arm_bands, check_regression, curriculum_label, eval_budgets, eval_label,
                          eval_summary, heldout_curve, last_value, side_by_side, study_arm_seed, study_table,
                          summarize)

ROOT = Path(__file__).resolve().parents[1]


# --- pure logic --------------------------------------------------------------------------------------------
def test_last_value_and_labels():
    assert last_value(None) is None and last_value([]) is None
    assert last_value([(3, 0.5), (1, 0.9), (2, 0.1)]) == 0.5
    assert last_value([(2, 0.1), (2, 0.7)]) == 0.7  # the later log of the same step wins
    assert curriculum_label([2, 3, 4]) == "2>3>4" and curriculum_label([4]) == "4" and curriculum_label([]) == "-"
    assert curriculum_label([4, 4, 4]) == "4" and curriculum_label([2, 2, 4]) == "2>2>4"


def test_summarize_prefers_held_out_success():
    h = {"success_rate": [(1, 0.0), (2, 0.25), (3, 0.5)], "mean_reward": [(1, 0.1), (2, 0.2), (3, 0.4)],
         "mean_turns": [(1, 2.0), (2, 3.0), (3, 2.5)], "eval_after/success_rate": [(3, 0.375)]}
    s = summarize("a", "id-a", h, [2, 3], 1_000, 61_000)
    assert (s.success, s.success_source, s.train_success) == (0.375, "held-out", 0.5)
    assert (s.reward, s.turns, s.steps, s.wall_time_s, s.curriculum) == (0.4, 2.5, 3, 60.0, "2>3")
    s2 = summarize("b", "id-b", {"success_rate": [(0, 0.1), (4, 0.2), (4, 0.2)]}, [4], None, None)
    assert (s2.success, s2.success_source, s2.wall_time_s, s2.reward, s2.steps) == (0.2, "train", None, None, 2)
    s4 = summarize("d", "id-d", {"success_rate": [(1, 0.5)], "heldout/success_rate": [(0, 0.1), (4, 0.3)]},
                   [2, 2], None, None)  # eval.each_phase's held-out curve: its last point is the held-out success
    assert (s4.success, s4.success_source, s4.curriculum) == (0.3, "held-out", "2")
    assert s4.curves["heldout/success_rate"] == [(0, 0.1), (4, 0.3)]
    s3 = summarize("c", "id-c", {}, [], 5, 1)  # nothing logged, clock skew: no wall time
    assert (s3.success, s3.success_source, s3.wall_time_s, s3.steps) == (None, "-", None, 0)


def test_side_by_side_table():
    a = summarize("si", "1", {"success_rate": [(i, 0.5) for i in range(6)], "mean_reward": [(5, 0.25)],
                              "mean_turns": [(5, 3.0)]}, [2, 3, 4], 0, 90_000)
    b = summarize("fixed", "2", {"success_rate": [(i, 0.125) for i in range(6)]}, [4], 0, 120_000)
    lines = side_by_side([a, b]).splitlines()
    assert lines[0].split() == ["si", "fixed"]
    rows = {l[:26].strip(): l[26:].split() for l in lines[2:]}
    assert rows["curriculum (turn limits)"] == ["2>3>4", "4"]
    assert rows["final success"] == ["0.500", "(train)", "0.125", "(train)"]
    assert rows["final reward"] == ["0.250", "-"]
    assert rows["final turns"] == ["3.00", "-"]
    assert rows["wall time (s)"] == ["90", "120"]
    assert rows["steps"] == ["6", "6"]
    with pytest.raises(ValueError):
        side_by_side([])


W58 = (0.3057, 0.8632)  # Wilson 95 % of 5/8 by hand: centre (0.625 + z²/16) / (1 + z²/8) = 0.5845, half 0.2787


def test_eval_summary_budgets_and_label():
    h = {"model/avg": [(2, 0.25), (4, 0.625), (4, 0.5)], "model/avg_ci_low": [(2, 0.1), (4, 0.3)],
         "model/avg_ci_high": [(2, 0.5)], "mean_reward": [(0, 0.4)], "success_rate": [(0, 0.5)]}
    b = eval_budgets(h)
    assert list(b) == [2, 4] and b[2] == Rate(0.25, 0.1, 0.5)
    assert b[4] == Rate(0.5, 0.3, None)  # the later log of budget 4 wins; no upper bound logged
    assert b[2].text() == "0.250 [0.100, 0.500]" and b[4].text() == "0.500"
    e = eval_summary("eval:x", "id", h, 0, 5_000)
    assert (e.kind, e.curriculum, e.success, e.success_source, e.wall_time_s, e.steps) == ("eval", "eval", 0.5,
                                                                                          "held-out", 5.0, 0)
    assert eval_summary("e", "id", {}, None, None).success is None
    assert eval_label("/w/runs-study/checkpoints/study-babyai-fixed-long-s1/phase-3/final", "e") == \
        "eval:study-babyai-fixed-long-s1/phase-3"
    assert eval_label("s3://b/p/run-a/phase-2/step-000004/", "e") == "eval:run-a/phase-2"
    assert eval_label("smollm2-135m", "e") == "eval:smollm2-135m" and eval_label(None, "fb") == "fb"
    assert eval_label("null", "fb") == "fb"


def test_side_by_side_with_an_eval_run():
    a = summarize("si", "1", {"success_rate": [(1, 0.5)]}, [2, 3], 0, 1_000)
    e = eval_summary("eval:si/phase-2", "2", {"model/avg": [(2, 0.25), (4, 0.625)],
                                              "model/avg_ci_low": [(2, 0.1), (4, W58[0])],
                                              "model/avg_ci_high": [(2, 0.5), (4, W58[1])]}, 0, 1_000)
    lines = side_by_side([a, e]).splitlines()
    assert lines[0].split() == ["si", "eval:si/phase-2"]
    rows = {l[:28].strip(): l[28:] for l in lines[2:]}
    assert rows["final success"].split() == ["0.500", "(train)", "0.625", "(held-out)"]
    assert rows["held-out @2 turns [95% CI]"].split() == ["-", "0.250", "[0.100,", "0.500]"]
    assert rows["held-out @4 turns [95% CI]"].split() == ["-", "0.625", "[0.306,", "0.863]"]
    assert rows["curriculum (turn limits)"].split() == ["2>3", "eval"]
    assert not any("held-out @" in l for l in side_by_side([a]).splitlines())  # training runs only: as before


def test_study_arm_seed_and_heldout_curve():
    assert study_arm_seed("study-babyai-fixed-short-s1", "2", 0) == ("fixed-short", 1)  # the name wins
    assert study_arm_seed("study-textcraft-scalinginter-s12", "2>4", None) == ("scalinginter", 12)
    assert study_arm_seed("my-run", "2>3>4", 3) == ("2>3>4", 3)
    c = heldout_curve([(4, 0.25), (2, 0.125), (6, 0.5), (6, 0.625)], 8)
    assert [s for s, _ in c] == [2, 4, 6]
    assert c[2][1].value == 0.625 and c[2][1].lo == pytest.approx(W58[0], abs=1e-4)
    assert c[2][1].hi == pytest.approx(W58[1], abs=1e-4)
    assert heldout_curve([(2, 0.5)], None) == [(2, Rate(0.5))] and heldout_curve(None, 8) == []


def _row(arm, seed, held, train, final=None, limits=(2,)):
    run = summarize(f"study-t-{arm}-s{seed}", f"id-{arm}{seed}", {"success_rate": train, "heldout/success_rate": held},
                    list(limits), 0, 100_000 + 1000 * seed)
    return StudyRow(arm, seed, run, tokens=1000.0 * (seed + 1), final=final, heldout_curve=heldout_curve(held, 8))


def test_study_table_and_bands():
    fin = eval_summary("eval:a", "e1", {"model/avg": [(2, 0.25), (4, 0.625)], "model/avg_ci_low": [(4, W58[0])],
                                        "model/avg_ci_high": [(4, W58[1])]}, 0, 1)
    base = eval_summary("eval:smollm2-135m", "e0", {"model/avg": [(4, 0.125)]}, 0, 3_000)
    rows = [_row("fixed-long", 0, [(2, 0.25), (4, 0.5)], [(1, 0.0), (2, 0.5), (3, 0.5), (4, 1.0)], limits=(4, 4)),
            _row("scalinginter", 1, [(2, 0.125), (4, 0.75)], [(1, 0.5), (2, 0.5), (3, 1.0), (4, 1.0)], fin, (2, 4)),
            _row("scalinginter", 0, [(2, 0.375), (4, 0.625)], [(1, 0.0), (2, 0.0), (3, 0.5), (4, 0.5)], fin, (2, 4))]
    text = study_table(rows, [base], title="study x")
    lines = text.splitlines()
    assert lines[0] == "study x"
    assert lines[1].split()[:7] == ["arm", "seed", "run", "turn", "limits", "steps", "tokens"]
    assert "held-out @2 [95% CI]" in lines[1] and "held-out @4 [95% CI]" in lines[1]
    body = [l.split() for l in lines[3:7]]
    assert [b[:3] for b in body] == [["scalinginter", "0", "study-t-scalinginter-s0"],  # arm order, then seed
                                     ["scalinginter", "1", "study-t-scalinginter-s1"],
                                     ["fixed-long", "0", "study-t-fixed-long-s0"], ["(eval)", "-", "eval:smollm2-135m"]]
    assert body[0][3:] == ["2>4", "4", "1000", "100", "0.250", "0.625", "[0.306,", "0.863]"]
    assert body[2][3:] == ["4", "4", "1000", "100", "-", "-"]  # no final evaluation (yet)
    assert body[3][3:] == ["-", "-", "-", "3", "-", "0.125"]
    i = lines.index("held-out success per phase (eval.each_phase; greedy, 95% Wilson interval):")
    assert lines[i + 1].split() == ["arm", "seed", "run", "step", "2", "step", "4"]
    assert lines[i + 3].split()[:4] == ["scalinginter", "0", "study-t-scalinginter-s0", "0.375"]
    assert lines[i + 3].split()[6:] == ["0.625", "[0.306,", "0.863]"]
    with pytest.raises(ValueError, match="no training runs"):
        study_table([])

    bands = arm_bands(rows, base=0.125)
    assert list(bands) == ["scalinginter", "fixed-long"]
    si = bands["scalinginter"]
    assert sorted(si["heldout"]) == [0, 2, 4]  # the base at step 0, the phases; final already at step 4
    assert (si["heldout"][0].mean, si["heldout"][0].n) == (0.125, 2)
    assert (si["heldout"][2].mean, si["heldout"][2].lo, si["heldout"][2].hi) == (0.25, 0.125, 0.375)
    assert (si["heldout"][4].mean, si["heldout"][4].lo, si["heldout"][4].hi) == (0.6875, 0.625, 0.75)
    assert [(s, b.mean, b.lo, b.hi) for s, b in sorted(si["train"].items())] == [
        (1, 0.25, 0.0, 0.5), (2, 0.25, 0.0, 0.5), (3, 0.75, 0.5, 1.0), (4, 0.75, 0.5, 1.0)]
    assert bands["fixed-long"]["heldout"][4].n == 1
    no_curve = [StudyRow("fixed-short", 0, rows[0].run, None, final=fin)]  # no phase evals: final at the last step
    assert sorted((s, b.mean) for s, b in arm_bands(no_curve)["fixed-short"]["heldout"].items()) == [(4, 0.625)]


def test_check_regression():
    v = check_regression({"success_rate": 0.5}, None)
    assert not v.regressed and v.delta is None and "no previous night" in v.message
    v = check_regression({"success_rate": 0.5}, {"success_rate": 0.54}, tolerance=0.05)
    assert not v.regressed and v.delta == pytest.approx(-0.04) and v.message.startswith("OK")
    v = check_regression({"success_rate": 0.4}, {"success_rate": 0.5}, tolerance=0.05)
    assert v.regressed and v.message.startswith("REGRESSION") and "0.400 vs 0.500" in v.message
    v = check_regression({"success_rate": 0.5}, {"success_rate": 0.5}, tolerance=0.0)
    assert not v.regressed  # equal is not a regression
    v = check_regression({"mean_reward": 0.1}, {"mean_reward": 0.3}, metric="mean_reward", tolerance=0.1)
    assert v.regressed
    with pytest.raises(KeyError, match="success_rate"):
        check_regression({"mean_reward": 1.0}, None)
    with pytest.raises(ValueError):
        check_regression({"success_rate": 1.0}, None, tolerance=-0.1)


# --- against MLflow runs ----------------------------------------------------------------------------------
def _fake_curriculum(tracker, name: str, turn_limits: list[int], success: list[float], eval_after: float | None):
    """Log a curriculum the way the flows do: parent run with config params and per-step metrics, one child
    run per phase (values are made up; the logging path is the flows' Tracker)."""
    from core.config import build_config

    phases = [{"turn_limit": t, "steps": len(success) // len(turn_limits)} for t in turn_limits]
    cfg = build_config("babyai", None, [f"run_name={name}", f"curriculum.phases={__import__('json').dumps(phases)}"])
    parent = tracker.start_run(name, params=cfg.model_dump(mode="json"), tags={"scalinginter.env": "babyai"})
    per = len(success) // len(turn_limits)
    for k, t in enumerate(turn_limits):
        child = tracker.start_run(f"{name}/phase-{k + 1}", params={"phase": k + 1, "turn_limit": t},
                                  parent_id=parent)
        for i in range(per):
            g = k * per + i
            m = {"success_rate": success[g], "mean_reward": success[g] * 0.9, "mean_turns": min(t, 1 + g * 0.5)}
            tracker.log_metrics(child, m, step=g + 1)
            tracker.log_metrics(parent, m, step=g + 1)
        tracker.end_run(child)
    if eval_after is not None:
        tracker.log_metrics(parent, {"eval_after/success_rate": eval_after}, step=len(success))
    tracker.end_run(parent)
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from storage.tracking import Tracker

    d = tmp_path_factory.mktemp("mlstore")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    tr = Tracker(uri, "scalinginter", artifact_root=d / "art")
    ids = {"si": _fake_curriculum(tr, "si-run", [2, 3, 4], [0.0, 0.25, 0.25, 0.5, 0.5, 0.75], 0.625),
           "fixed": _fake_curriculum(tr, "fixed-run", [4], [0.0, 0.0, 0.25, 0.25, 0.25, 0.5], None)}
    return d, uri, ids


def test_compare_cli_table_and_png(store, tmp_path):
    d, uri, ids = store
    png = tmp_path / "curves.png"
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    p = subprocess.run(cmd + ["compare", "si-run", ids["fixed"], "--png", str(png), "--tracking-uri", uri],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["si-run", "fixed-run"]
    out = "\n".join(lines)
    assert "2>3>4" in out and "0.625 (held-out)" in out and "0.500 (train)" in out
    steps = [l for l in lines if l.startswith("steps")][0].split()
    assert steps[1:] == ["6", "6"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    p = subprocess.run(cmd + ["compare", "no-such-run", "--tracking-uri", uri], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "no run 'no-such-run'" in p.stderr


def test_notebook_executes_against_the_runs(store, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    d, uri, ids = store
    png = tmp_path / "nb.png"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("COMPARE_RUNS", "si-run,fixed-run")
    monkeypatch.setenv("COMPARE_PNG", str(png))
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    text = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "si-run" in text and "fixed-run" in text and "0.625 (held-out)" in text
    assert "ScalingInter" in text and "fixed horizon" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- a learning study in a real MLflow store ----------------------------------------------------------------
STUDY_EXP = "learning-study-babyai"
N_TASKS = 8
# arm -> (turn limits per phase, {seed: (held-out successes out of 8 per phase end, final eval {budget: k/8})})
STUDY = {"scalinginter": ([2, 3, 4], {0: ([2, 4, 5], {2: 3, 4: 5}), 1: ([3, 5, 6], {2: 4, 4: 6})}),
         "fixed-long": ([4, 4, 4], {0: ([3, 5, 6], {2: 2, 4: 6}), 1: ([4, 6, 7], {2: 3, 4: 7})})}
BASE = {2: 1, 4: 1}


def _eval_doc(ref: str, solved: dict[int, int]):
    """An evaluation document as flows.evaluate builds it (greedy, N_TASKS tasks, budgets 2 and 4): the first
    ``solved[T]`` tasks succeed at budget T."""
    from core.evalreport import Outcome, build_document, model_report

    ids = list(range(1000, 1000 + N_TASKS))
    outs = [Outcome(t, b, 0, i < solved[b], float(i < solved[b]), b, "GoToObj") for b in (2, 4)
            for i, t in enumerate(ids)]
    meta = {"env": "babyai", "split": "test", "task_ids": ids, "n_tasks": N_TASKS, "temperature": 0.0,
            "greedy": True, "env_options": {}, "env_options_source": "given"}
    return build_document(meta, {"model": (ref, model_report(outs, ids, [2, 4], 1))}, 1, [2, 4])


def _study_run(tracker, out: Path, arm: str, seed: int, limits: list[int], held: list[int]):
    """A study training run logged as the flows log it: parent with the config params, per-step headline metrics
    and the held-out point of each phase (eval.each_phase), one child run per phase with the step metrics, the
    final checkpoint tag. Two steps per phase."""
    import json

    from core.config import build_config

    name = f"study-babyai-{arm}-s{seed}"
    phases = [{"turn_limit": t, "steps": 2} for t in limits]
    cfg = build_config("babyai", None, [f"run_name={name}", f"seed={seed}", f"curriculum.phases={json.dumps(phases)}",
                                        f"eval.n={N_TASKS}", "eval.turn_limit=4", "eval.each_phase=true",
                                        "eval.before=false", "eval.after=false", f"tracking.experiment={STUDY_EXP}"])
    parent = tracker.start_run(name, params=cfg.model_dump(mode="json"), tags={"scalinginter.env": "babyai"})
    for k, t in enumerate(limits):
        child = tracker.start_run(f"{name}/phase-{k + 1}", params={"phase": k + 1, "turn_limit": t}, parent_id=parent)
        for g in (2 * k + 1, 2 * k + 2):
            train = min(1.0, 0.125 * g + 0.125 * seed - 0.0625 * (arm == "scalinginter"))
            m = {"success_rate": train, "mean_reward": 0.1 * g, "mean_turns": 1.5, "generated_tokens": 100.0 * t,
                 "step_time_s": 3.0}
            tracker.log_metrics(child, m, step=g)
            if g == 1 and seed == 1:  # a resumed step logged twice counts once
                tracker.log_metrics(child, m, step=g)
            tracker.log_metrics(parent, {x: m[x] for x in ("success_rate", "mean_reward", "mean_turns")}, step=g)
        tracker.end_run(child)
        tracker.log_metrics(parent, {"heldout/success_rate": held[k] / N_TASKS}, step=2 * k + 2)
    final = str(out / "checkpoints" / name / f"phase-{len(limits)}" / "final")
    tracker.set_tag(parent, "scalinginter.final_checkpoint", final)
    tracker.end_run(parent)
    return cfg, final


@pytest.fixture(scope="module")
def study_store(tmp_path_factory):
    """2 arms x 2 seeds, each final checkpoint and the base model scored by an eval run (flows.evaluate.log_eval,
    as `scalinginter eval --experiment learning-study-babyai` logs it); one more eval in the experiment `eval`."""
    from flows.evaluate import log_eval
    from storage.tracking import Tracker

    d = tmp_path_factory.mktemp("studystore")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    tr = Tracker(uri, STUDY_EXP, artifact_root=d / "mlartifacts")
    log_eval(_eval_doc("smollm2-135m", BASE), _cfg(d), experiment=STUDY_EXP, tracking_uri=uri)
    ids = {}
    for seed in (0, 1):
        for arm, (limits, seeds) in STUDY.items():
            held, final_eval = seeds[seed]
            _, final = _study_run(tr, d, arm, seed, limits, held)
            ids[(arm, seed)] = log_eval(_eval_doc(final, final_eval), _cfg(d), experiment=STUDY_EXP, tracking_uri=uri)
    other = log_eval(_eval_doc(str(d / "checkpoints" / "other-run" / "phase-1" / "final"), {2: 2, 4: 4}), _cfg(d),
                     tracking_uri=uri)  # the default experiment "eval"
    return d, uri, ids, other


def _cfg(d: Path):
    from core.config import build_config

    return build_config("babyai", None, [f"output_dir={d}"])


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    return subprocess.run(cmd + args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _w(k: int) -> str:
    from core.stats import wilson_interval

    lo, hi = wilson_interval(k, N_TASKS)
    return f"{k / N_TASKS:.3f} [{lo:.3f}, {hi:.3f}]"


def test_compare_study_cli_table_and_png(study_store, tmp_path):
    d, uri, ids, _ = study_store
    png = tmp_path / "study.png"
    p = _cli(["compare", STUDY_EXP, "--png", str(png), "--tracking-uri", uri], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == f"study {STUDY_EXP!r}: 4 training run(s), 4 with a final evaluation, 1 other evaluation(s); " \
                       f"held-out n={N_TASKS} at 4 turns"
    assert lines[1].split()[:9] == ["arm", "seed", "run", "turn", "limits", "steps", "tokens", "wall", "s"]
    assert "held-out @2 [95% CI]" in lines[1] and "held-out @4 [95% CI]" in lines[1]
    rows = {tuple(l.split()[:3]): l for l in lines[3:8]}
    assert [k[:2] for k in rows] == [("scalinginter", "0"), ("scalinginter", "1"), ("fixed-long", "0"),
                                     ("fixed-long", "1"), ("(eval)", "-")]
    for arm, (limits, seeds) in STUDY.items():
        for seed, (_, final) in seeds.items():
            cells = rows[(arm, str(seed), f"study-babyai-{arm}-s{seed}")].split()
            assert cells[3:6] == ["2>3>4" if arm == "scalinginter" else "4", "6",
                                  "1800" if arm == "scalinginter" else "2400"]  # 2 steps x 100 tokens x limit
            assert float(cells[6]) >= 0  # wall time (s) of the run
            assert " ".join(cells[7:]) == f"{_w(final[2])} {_w(final[4])}"
    base = rows[("(eval)", "-", "eval:smollm2-135m")].split()
    assert " ".join(base[7:]) == f"{_w(BASE[2])} {_w(BASE[4])}"
    i = lines.index("held-out success per phase (eval.each_phase; greedy, 95% Wilson interval):")
    assert lines[i + 1].split() == ["arm", "seed", "run", "step", "2", "step", "4", "step", "6"]
    curve = {tuple(l.split()[:2]): l.split()[3:] for l in lines[i + 3:i + 7]}
    assert " ".join(curve[("fixed-long", "1")]) == " ".join(_w(k) for k in STUDY["fixed-long"][1][1][0])
    assert " ".join(curve[("scalinginter", "0")]) == " ".join(_w(k) for k in STUDY["scalinginter"][1][0][0])
    assert p.stdout.rstrip().endswith(f"learning curves: {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    from flows.compare import compare_runs

    with pytest.raises(ValueError, match="give it alone"):  # the CLI prints it and exits 2
        compare_runs([STUDY_EXP, "study-babyai-fixed-long-s0"], uri)


def test_compare_names_eval_runs(study_store, tmp_path):
    """Plain `compare`: a training run of the study, its final checkpoint's eval run (by id) and an eval run of
    the experiment `eval` (by name) side by side, each eval with its success and interval per budget."""
    d, uri, ids, other = study_store
    p = _cli(["compare", "study-babyai-scalinginter-s1", ids[("scalinginter", 1)], other,
              "--experiment", STUDY_EXP, "--png", str(tmp_path / "c.png"), "--tracking-uri", uri], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["study-babyai-scalinginter-s1", "eval:study-babyai-scalinginter-s1/phase-3",
                                "eval:other-run/phase-1"]
    rows = {l[:28].strip(): l[28:].split() for l in lines[2:] if l.strip() and not l.startswith("learning")}
    assert rows["curriculum (turn limits)"] == ["2>3>4", "eval", "eval"]
    assert rows["final success"] == ["0.750", "(held-out)", "0.750", "(held-out)", "0.500", "(held-out)"]
    assert " ".join(rows["held-out @4 turns [95% CI]"]) == f"- {_w(6)} {_w(4)}"
    assert " ".join(rows["held-out @2 turns [95% CI]"]) == f"- {_w(4)} {_w(2)}"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # by name: not a run of --experiment (default scalinginter, absent here), so the experiment `eval`
    from flows.compare import compare_runs

    table, runs, out = compare_runs(["eval-babyai-final"], uri, tmp_path / "e.png")
    lines = table.splitlines()
    assert lines[0].split() == ["eval:other-run/phase-1"] and runs[0].kind == "eval" and out.exists()
    assert [l for l in lines if l.startswith("held-out @4")][0].split()[-3:] == _w(4).split()


@pytest.mark.slow  # not in CI: a Jupyter kernel (~1 min); the same table is the default tier's compare CLI test
def test_notebook_study_cells(study_store, tmp_path, monkeypatch):
    """The notebook on the study: its first cells list the study's training runs (not the eval runs), the study
    cells print the same table as `scalinginter compare EXPERIMENT` and write the PNG."""
    import nbformat
    from nbclient import NotebookClient

    d, uri, ids, _ = study_store
    png = tmp_path / "nb-study.png"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("COMPARE_EXPERIMENT", STUDY_EXP)
    monkeypatch.delenv("COMPARE_RUNS", raising=False)
    monkeypatch.setenv("COMPARE_PNG", str(tmp_path / "nb-runs.png"))
    monkeypatch.setenv("COMPARE_STUDY_PNG", str(png))
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outs = [o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
            for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert "eval:" not in outs[0].splitlines()[0]  # the runs table: training runs only by default
    study = next(o for o in outs if o.startswith(f"study {STUDY_EXP!r}"))
    from flows.compare import compare_study

    table, rows, _ = compare_study(STUDY_EXP, uri)
    assert study.rstrip() == table and len(rows) == 4
    line = next(l for l in study.splitlines() if l.startswith("fixed-long    1"))
    assert line.split()[2:6] == ["study-babyai-fixed-long-s1", "4", "6", "2400"] and line.endswith(_w(7))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = "\n".join(outs)
    assert "held-out @4" in text and "fixed-long" in text  # the pandas tables
