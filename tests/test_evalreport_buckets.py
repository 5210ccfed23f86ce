"""Results by required turns (the fewest turns an expert needs): buckets 1, 2-3, 4-6, 7+ in the eval document,
its comparison, its text and plot; hand-made outcomes."""

import pytest

from core.evalreport import Outcome, build_document, model_report, report_text, required_turns_bucket


def test_bucket_boundaries():
    assert [required_turns_bucket(n) for n in (1, 2, 3, 4, 6, 7, 20)] == ["1", "2-3", "2-3", "4-6", "4-6", "7+", "7+"]
    with pytest.raises(ValueError):
        required_turns_bucket(0)


NEEDS = {0: 1, 1: 1, 2: 2, 3: 3, 4: 5, 5: 9, 6: 12}  # task -> required turns: buckets 1 (2), 2-3 (2), 4-6 (1), 7+ (2)
SOLVED = {0, 1, 2, 4}  # greedy outcomes of model a; b solves only task 0


def _outs(solved, labelled=True):
    return [Outcome(t, 10, 0, t in solved, float(t in solved), 3, "lvl", NEEDS[t] if labelled else None)
            for t in NEEDS]


def test_cells_per_bucket_with_wilson_intervals():
    rep = model_report(_outs(SOLVED), list(NEEDS), [10], 1)
    b = rep["budgets"]["10"]
    assert list(b["required_turns"]) == ["1", "2-3", "4-6", "7+"]
    got = {k: (c["tasks"], c["avg"]["value"]) for k, c in b["required_turns"].items()}
    assert got == {"1": (2, 1.0), "2-3": (2, 0.5), "4-6": (1, 1.0), "7+": (2, 0.0)}
    # Wilson 95 % for 1 of 2: [0.0945, 0.9055]
    lo, hi = b["required_turns"]["2-3"]["avg"]["ci"]
    assert abs(lo - 0.0945) < 1e-3 and abs(hi - 0.9055) < 1e-3
    assert sum(c["tasks"] for c in b["required_turns"].values()) == b["overall"]["tasks"]
    assert [r["required_turns"] for r in b["per_task"]] == list(NEEDS.values())


def test_unlabelled_tasks_leave_the_key_out():
    rep = model_report(_outs(SOLVED, labelled=False), list(NEEDS), [10], 1)
    assert "required_turns" not in rep["budgets"]["10"]
    assert all("required_turns" not in r for r in rep["budgets"]["10"]["per_task"])


def test_paired_per_bucket_and_the_text():
    a = model_report(_outs(SOLVED), list(NEEDS), [10], 1)
    b = model_report(_outs({0}), list(NEEDS), [10], 1)
    doc = build_document({"header": "h", "env": "babyai", "split": "test", "n_tasks": 7}, {"model": ("A", a),
                         "compare": ("B", b)}, 1, [10], compare=("model", "compare"))
    q = doc["comparison"]["budgets"]["10"]["required_turns"]
    assert q["1"]["a"] == 1.0 and q["1"]["b"] == 0.5 and q["1"]["a_better"] == 1 and q["1"]["b_better"] == 0
    assert q["7+"]["diff"] == 0.0 and q["7+"]["p_value"] == 1.0
    text = report_text(doc)
    assert "needs 1 turn " in text and "needs 2-3 turns" in text and "needs 7+ turns" in text
    assert "    needs 4-6 turns: 1.000 vs 0.000" in text


def test_plot_draws_the_buckets(tmp_path):
    from flows.evaluate import plot_sweep

    a = model_report(_outs(SOLVED), list(NEEDS), [10], 1)
    doc = build_document({"header": "h", "env": "babyai", "split": "test", "n_tasks": 7}, {"model": ("A", a)}, 1, [10])
    out = plot_sweep(doc, tmp_path / "p.png", buckets=True)
    assert out.exists() and out.stat().st_size > 1000


def test_run_summary_shows_success_per_bucket_before_and_after():
    from core.evalreport import bucket_rates
    from flows.config import build_config
    from flows.scalinginter import summary_table

    before = build_document({"header": "h", "env": "babyai", "split": "test", "n_tasks": 7},
                            {"model": ("base", model_report(_outs({0}), list(NEEDS), [10], 1))}, 1, [10])
    after = build_document({"header": "h", "env": "babyai", "split": "test", "n_tasks": 7},
                           {"model": ("ckpt", model_report(_outs(SOLVED), list(NEEDS), [10], 1))}, 1, [10])
    assert bucket_rates(after)["1"]["value"] == 1.0 and bucket_rates(before)["1"]["value"] == 0.5
    assert bucket_rates(None) == {} and bucket_rates(model_report_doc_unlabelled()) == {}
    summary = {"eval_before": {"success_rate": 1 / 7}, "eval_after": {"success_rate": 4 / 7}, "eval_paired": None,
               "eval_required_turns": {"before": bucket_rates(before), "after": bucket_rates(after)},
               "mlflow_run_id": "x", "mlflow_uri": "sqlite://", "final_checkpoint": "c"}
    text = summary_table(summary, build_config("babyai", "tiny", ["run_name=r"]))
    assert "needs 1 (2)" in text and "needs 7+ (2)" in text
    line = next(x for x in text.splitlines() if x.startswith("needs 4-6"))
    assert "0.000 [" in line and "1.000 [" in line  # before 0/1, after 1/1


def model_report_doc_unlabelled():
    return build_document({"header": "h", "env": "x", "split": "test", "n_tasks": 7},
                          {"model": ("m", model_report(_outs(SOLVED, labelled=False), list(NEEDS), [10], 1))}, 1, [10])
