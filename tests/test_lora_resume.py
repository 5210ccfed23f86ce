"""Kill-and-resume with model.lora on (issue 48): a real SIGKILL inside a step, then the same command, ends where an
uninterrupted LoRA run ends: bit-exact adapters of both phases' finals, the same trainer states, metrics, rollouts,
checkpoint folders and MLflow records (the comparisons of tests/test_kill_resume.py, on the same toy runs with
``model.lora.rank=8``). The checkpoints hold the adapter, its optimizer state and the base's record, not the base."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from runtime.killpoint import KILL_ENV
from tests.test_kill_resume import NAME, SETS, recorded_steps, run_cli, snapshot

LORA_SETS = SETS + ["model.lora.rank=8"]
KILLS = {"rollout:3": [1, 2], "update:2": [1]}  # mid-phase (a step checkpoint), and phase 2's first update


def adapter(out, phase: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / NAME / f"phase-{phase}" / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, toy_policy):
    out = tmp_path_factory.mktemp("lora-uninterrupted")
    rc, log, left = run_cli(out, toy_policy, sets=LORA_SETS)
    assert rc == 0, log[-3000:]
    assert not left
    snap = snapshot(out)
    assert [m["global_step"] for m in snap["metrics"]] == [1, 2, 3]
    final = out / "checkpoints" / NAME / "phase-2" / "final"
    names = {p.name for p in final.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "lora_base.json", "optimizer.pt"} <= names
    assert "model.safetensors" not in names
    base = json.loads((final / "lora_base.json").read_text())
    assert base["base_dir"] == str(toy_policy) and len(base["base_sha256"]) == 64
    assert any(not torch.equal(t, torch.zeros_like(t)) for k, t in adapter(out, 2).items() if "lora_B" in k)
    return out, snap


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", list(KILLS))
def test_lora_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, lora_reference, kill_at, toy_policy):
    ref_out, ref = lora_reference
    rc, log, left = run_cli(tmp_path, toy_policy, kill_at, sets=LORA_SETS)
    assert rc == -signal.SIGKILL, f"expected a SIGKILL at {kill_at}, got exit {rc}:\n{log[-3000:]}"
    assert f"{KILL_ENV}: SIGKILL at {kill_at}" in log and not left
    assert recorded_steps(tmp_path) == KILLS[kill_at]
    rc, log, left = run_cli(tmp_path, toy_policy, sets=LORA_SETS)
    assert rc == 0, log[-4000:]
    for phase in (1, 2):
        a, b = adapter(tmp_path, phase), adapter(ref_out, phase)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"phase {phase} adapter"
    got = snapshot(tmp_path)
    for key in ("states", "latest", "metrics", "rollouts", "checkpoints", "run_dir"):
        assert got[key] == ref[key], key
    assert got["mlflow"]["versions"] == ref["mlflow"]["versions"]
    for run, want in ref["mlflow"]["runs"].items():
        have = got["mlflow"]["runs"][run]
        assert have["status"] == want["status"] == "FINISHED" and have["metrics"] == want["metrics"], run
