"""`bench/learning_study.py` end to end at toy size, so the study command cannot rot: three arms of the tiny
BabyAI preset (real SmolLM2, transformers backend), one seed, two held-out tasks, budgets 1 and 2. Checks the
arms' curricula as trained, the held-out curve points from eval.each_phase, the report's statistics and the
JSON / PNG / table it writes. The numbers are not the point at this size; their shape and provenance are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_learning_study_toy(tmp_path):
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
