"""Run comparison: the pure table/regression logic on hand-computed cases, `scalinginter compare` and the
notebook (executed with nbclient) against MLflow runs this test writes through the flows' own Tracker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.compare import check_regression, curriculum_label, last_value, side_by_side, summarize

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
    from tasks.tracking import Tracker

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
