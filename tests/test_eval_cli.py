"""`scalinginter eval` end to end with the real SmolLM2 model on BabyAI: K = 4 samples x turn budgets 2,4, compared
with a second checkpoint on the same tasks and seeds; the JSON, the PNG and the MLflow run are checked. Bad input
fails with one line that says the fix."""

import json
import shutil
from pathlib import Path

import pytest

from tests.clirun import cli


def base_dir() -> Path:
    from runtime.backends.model import resolve_model

    return Path(resolve_model("smollm2-135m"))


def trained_like_checkpoint(tmp: Path) -> Path:
    """A checkpoint folder as a training run leaves it (HF files + trainer_state.json with the run's config), its
    weights linked to the base model's: trained on one BabyAI level only."""
    ck = tmp / "ckpt"
    ck.mkdir()
    for f in base_dir().iterdir():
        (ck / f.name).symlink_to(f)
    from flows.config import build_config

    cfg = build_config("babyai", None, ["env.options={\"levels\": \"GoToObj\"}"])
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 1, "phase": 1, "turn_limit": 2,
                                                       "config": cfg.model_dump(mode="json")}))
    return ck


def rates(cell):
    yield cell["avg"]
    yield from cell["pass"].values()


def test_eval_samples_budgets_compare(tmp_path):
    ck = trained_like_checkpoint(tmp_path)
    out = tmp_path / "out"
    p = cli("eval", str(ck), "babyai", "--n", "3", "--samples", "2", "--turn-limits", "2,4", "--compare",
            "smollm2-135m", "--max-new-tokens", "8", "--json", str(out / "eval.json"), "--png", str(out / "eval.png"),
            "--set", "rollout.backend=transformers", "--set", f"output_dir={out}", cwd=tmp_path, timeout=1800)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    doc = json.loads((out / "eval.json").read_text())
    assert doc["schema"] == "scalinginter.eval/1" and doc["samples"] == 2 and doc["turn_limits"] == [2, 4]
    assert doc["n_tasks"] == 3 and doc["task_ids"] == [1_000_000, 1_000_001, 1_000_002] and not doc["greedy"]
    assert doc["temperature"] == 1.0
    # the checkpoint's own training options, said in the header
    assert doc["env_options_source"] == "checkpoint" and doc["env_options"] == {"levels": "GoToObj"}
    assert "as trained" in doc["header"] and "as trained" in log
    assert set(doc["models"]) == {"model", "compare"}
    for m in doc["models"].values():
        assert set(m["budgets"]) == {"2", "4"}
        for b in m["budgets"].values():
            o = b["overall"]
            assert o["tasks"] == 3 and o["episodes"] + o["masked_episodes"] == 6
            assert set(o["pass"]) == {"1", "2"}
            assert set(b["categories"]) == {"GoToObj"}  # the trained level only, not the env's eight
            assert sum(c["tasks"] for c in b["categories"].values()) == o["tasks"]
            assert sum(c["episodes"] for c in b["categories"].values()) == o["episodes"]
            for cell in [o, *b["categories"].values()]:
                for r in rates(cell):
                    assert r["value"] is not None and r["ci"][0] <= r["value"] <= r["ci"][1], r
            assert [len(t["successes"]) for t in b["per_task"]] == [2, 2, 2]
            assert max(t for row in b["per_task"] for t in row["turns"]) <= b["turn_limit"]
            # Avg@2 recomputed from the per-task successes
            means = [sum(t["successes"]) / 2 for t in b["per_task"]]
            assert o["avg"]["value"] == pytest.approx(sum(means) / 3)
    # same weights, same tasks, same seeds: the same episodes, so the paired difference is exactly 0
    for key in ("2", "4"):
        a, b = (doc["models"][n]["budgets"][key]["per_task"] for n in ("model", "compare"))
        assert [t["successes"] for t in a] == [t["successes"] for t in b]
        c = doc["comparison"]["budgets"][key]["overall"]
        assert c["test"] == "paired_bootstrap" and c["diff"] == 0 and c["p_value"] == 1.0 and c["tasks"] == 3
    # one rollout call per model for all 2 x 2 x 3 episodes: one first-turn progress line each
    assert log.count("[eval] first turn: ") == 2, log[-3000:]
    assert "/12 episodes done" in log
    png = (out / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # MLflow: an eval run with the sweep at step = turn budget and the document as artifact
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("eval")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    hist = client.get_metric_history(runs[0].info.run_id, "model/avg")
    assert sorted(h.step for h in hist) == [2, 4]
    assert {h.step: h.value for h in hist}[4] == pytest.approx(doc["models"]["model"]["budgets"]["4"]["overall"]["avg"]["value"])
    art = Path(client.download_artifacts(runs[0].info.run_id, "eval/eval.json", str(tmp_path / "dl")))
    assert json.loads(art.read_text())["models"]["model"]["budgets"]["2"]["per_task"] == \
        doc["models"]["model"]["budgets"]["2"]["per_task"]
    shutil.rmtree(out / "mlartifacts", ignore_errors=True)


def test_compare_with_a_different_tokenizer_is_refused(tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(str(base_dir()))
    tok.add_tokens(["<an-extra-token>"])
    tok.save_pretrained(other)
    shutil.copy(base_dir() / "config.json", other / "config.json")
    p = cli("eval", "smollm2-135m", "babyai", "--compare", str(other), "--no-mlflow", cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()[-1]
    assert "different tokenizer" in err and "same base model" in err, p.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["--samples", "0"], "--samples must be >= 1"),
    (["--turn-limits", "4,2"], "pass e.g. 2,4"),
    (["--turn-limits", ","], "--turn-limits is empty"),
    (["--turn-limits", "300"], "beyond the context"),
    (["--samples", "2", "--temperature", "0"], "identical greedy episodes"),
])
def test_bad_sweep_is_refused(tmp_path, args, needle):
    p = cli("eval", "smollm2-135m", "babyai", *args, "--no-mlflow", cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert needle in p.stderr, p.stderr[-2000:]


def test_missing_or_non_checkpoint_folder_is_refused(tmp_path):
    p = cli("eval", str(tmp_path / "nope"), "babyai", "--no-mlflow", cwd=tmp_path)
    assert p.returncode != 0 and "not found" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "empty").mkdir()
    p = cli("eval", str(tmp_path / "empty"), "babyai", "--no-mlflow", cwd=tmp_path)
    assert p.returncode != 0 and "is not a checkpoint" in p.stderr and "Traceback" not in p.stderr
