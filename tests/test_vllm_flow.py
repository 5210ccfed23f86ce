"""The phase flow with the issue-8 engines wired in: vLLM rollout (one engine per phase, weights synced after
each update) and the DeepSpeed ZeRO-2 learner, through the real CLI on the tiny preset (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_run_with_vllm_rollout_and_deepspeed_learner(tmp_path):
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    args = ["run", "babyai", "--preset", "tiny", "--set", f"output_dir={tmp_path}", "--run-name", "v",
            "--set", "rollout.backend=vllm", "--set", "learner.engine=deepspeed", "--set", "eval.before=false",
            "--set", "eval.after=false"]
    p = subprocess.run(cmd + args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert rows and all("train/weight_sync_s" in r and "train/logprob_mismatch" in r for r in rows)
    assert all(r["train/logprob_mismatch"] < 0.5 for r in rows)  # bf16 engine vs learner: small, not zero
    final = tmp_path / "checkpoints" / "v" / "phase-2" / "final"
    assert (final / "model.safetensors").exists() and (final / "deepspeed" / "layout.json").exists()
    from runtime.backends.learner import load_causal_lm
    from runtime.backends.model import resolve_model

    a = load_causal_lm(str(final)).state_dict()
    b = load_causal_lm(resolve_model("smollm2-135m")).state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a), "training did not move the weights"
