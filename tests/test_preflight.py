"""``--dry-run``: the context, KV cache and memory plan (core.preflight, hand-checked numbers) and every preset of
every env passing it on the default model."""

import subprocess
import sys
from pathlib import Path

import pytest

from core.kvcache import GiB
from core.preflight import ModelShape, RunShape, check_run

ROOT = Path(__file__).resolve().parents[1]

# SmolLM2-135M's config.json (the numbers that matter)
SMOL = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "tie_word_embeddings": True}


def shape(**kw):
    base = dict(turn_limit=4, max_new_tokens=24, token_budget=1536, history_turns=None, episodes=16,
                kv_budget_bytes=2 * GiB, kv_fixed_bytes=None, engine_bytes_per_elem=2, micro_batch_tokens=2048,
                micro_batch_size=2, reference=False, critic=False, vllm=True)
    base.update(kw)
    return RunShape(**base)


def test_model_shape_counts_smollm2_parameters_and_kv_bytes():
    m = ModelShape.from_hf_config(SMOL)
    # per layer: q,o 576x576 each; k,v 576x192 each; MLP 3 x 576 x 1536; two norms -> 3,540,096 + 1,152
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert m.params == 30 * per_layer + 49152 * 576 + 576 == 134_515_008  # the published 135 M
    assert m.kv_bytes_per_token_16 == 2 * 30 * 3 * 64 * 2 and m.context == 8192
    assert ModelShape.from_hf_config({"text_config": SMOL}).params == m.params


def test_context_checks_name_the_fix():
    m = ModelShape.from_hf_config(SMOL)
    ok = check_run(m, shape(), 24 * GiB)
    assert not ok.errors and ok.live_cap is None
    over = check_run(m, shape(token_budget=14000, turn_limit=20, max_new_tokens=512), 24 * GiB)
    assert "rollout.token_budget=8191" in over.errors[0] and "history_turns=2" in over.errors[0]
    assert "20 turns x 512 reply tokens = 10240" in over.errors[1]
    win = check_run(m, shape(token_budget=4096, turn_limit=20, max_new_tokens=512, history_turns=2), 24 * GiB)
    assert not win.errors and "3 replies x 512 = 1536" in win.lines[0]
    tight = check_run(m, shape(token_budget=1024, turn_limit=20, max_new_tokens=512, history_turns=2), 24 * GiB)
    assert "lower rollout.history_turns" in tight.errors[0]
    # replies beyond the budget but inside the context: the run starts, long episodes end at the budget
    note = check_run(m, shape(turn_limit=10, max_new_tokens=256, token_budget=2048), 24 * GiB)
    assert not note.errors and any("end at the token budget" in x for x in note.lines)


def test_kv_and_memory_plans():
    m = ModelShape.from_hf_config(SMOL)
    p = check_run(m, shape(episodes=96), 24 * GiB)
    # 1537 tokens -> 97 blocks of 16 = 1552 tokens x 23,040 bytes = 35,758,080 per sequence; 2 GiB hold 60
    assert p.live_cap == 60 and any("at most 60 live" in x for x in p.lines)
    acts = 2048 * (30 * 576 * 34 + 49152 * 12)
    expect = 16 * m.params + 2 * m.params + 2 * GiB + acts + int(1.5 * GiB)
    assert p.memory_bytes == expect
    eight = check_run(m, shape(episodes=96, optimizer_bytes_per_param=2), 24 * GiB)  # algo.optimizer=adamw8bit
    assert p.memory_bytes - eight.memory_bytes == 6 * m.params
    # two DeepSpeed ranks, ZeRO-2, PPO with a reference: each rank holds the fp32 weights, half the gradients and
    # half the Adam moments, a whole reference and a whole critic (16 bytes a parameter), its own activations
    two = check_run(m, shape(episodes=96, ranks=2, zero_stage=2, reference=True, critic=True), 24 * GiB)
    half = -(-4 * m.params // 2)
    assert two.memory_bytes == (2 * (4 * m.params + half + -(-8 * m.params // 2)) + 2 * (4 + 16) * m.params
                                + 2 * m.params + 2 * GiB + 2 * acts + int(1.5 * GiB))
    line = next(x for x in two.lines if x.startswith("memory:"))
    assert "(2 ranks, ZeRO-2)" in line and "per micro-batch on each rank" in line and "(whole on each rank)" in line
    three = check_run(m, shape(episodes=96, ranks=2, zero_stage=3), 24 * GiB)
    zero1 = check_run(m, shape(episodes=96, ranks=2, zero_stage=1), 24 * GiB)
    assert zero1.memory_bytes - three.memory_bytes == 2 * (4 * m.params - half) * 2  # weights and grads unsharded
    assert check_run(m, shape(episodes=96, ranks=1, zero_stage=3), 24 * GiB).memory_bytes == expect
    small = check_run(m, shape(), 4 * GiB)
    assert "more than this machine's 4.0 GiB" in small.errors[0]
    one = check_run(m, shape(token_budget=8000, kv_budget_bytes=GiB // 8), None)
    assert "cannot hold one sequence" in one.errors[0]


def _presets():
    import importlib

    from envs.base import env_names

    out = []
    for env in env_names():
        try:
            mod = importlib.import_module(f"envs.{env}.presets")
        except ModuleNotFoundError:
            continue
        out += [(env, p) for p in mod.PRESETS]
    return out


@pytest.mark.parametrize("env,preset", _presets())
def test_every_preset_passes_the_dry_run_on_the_default_model(env, preset):
    from flows.config import build_config
    from flows.dryrun import dry_run

    plan = dry_run(build_config(env, preset))
    assert not plan.errors, plan.errors


def test_dry_run_cli_exits_0_or_2_with_one_line():
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    ok = subprocess.run(cmd + ["run", "babyai", "--preset", "paper", "--dry-run"], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
    assert ok.returncode == 0 and "would start" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run(cmd + ["run", "babyai", "--preset", "paper", "--dry-run", "--set",
                                "rollout.history_turns=null", "--set", "rollout.token_budget=14000"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2
    errors = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "rollout.token_budget=8191" in errors[0], bad.stderr
