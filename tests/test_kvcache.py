"""core.kvcache: the KV cache sized from the batch within a budget, and the live-episode cap (hand-computed)."""

import pytest

from core.kvcache import GiB, kv_bytes_per_token, plan_kv_cache


def test_bytes_per_token_smollm2():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; keys + values
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040  # bf16
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080  # fp32


def test_cache_is_the_batch_need_when_under_budget():
    # 16 episodes x 2048 tokens (128 blocks of 16) x 23040 B = 754,974,720 B
    p = plan_kv_cache(16, 2048, 23_040, budget_bytes=2 * GiB)
    assert p.cache_bytes == 16 * 2048 * 23_040 and p.live_cap is None and p.fits == 16 and not p.capped


def test_sequence_length_rounds_up_to_whole_blocks():
    p = plan_kv_cache(2, 17, 100, budget_bytes=GiB, block=16)  # 17 tokens take 2 blocks = 32 tokens
    assert p.cache_bytes == 2 * 32 * 100


def test_budget_binds_and_caps_live_episodes():
    # 96 episodes x 2048 x 23040 = 4.5 GiB needed; 1 GiB holds floor(2^30 / 47,185,920) = 22 sequences
    p = plan_kv_cache(96, 2048, 23_040, budget_bytes=GiB)
    assert p.cache_bytes == GiB and p.fits == 22 and p.live_cap == 22 and p.capped


def test_fixed_size_overrides_the_budget_and_still_caps():
    p = plan_kv_cache(96, 2048, 23_040, budget_bytes=8 * GiB, fixed_bytes=GiB // 2)
    assert p.cache_bytes == GiB // 2 and p.live_cap == 11
    assert plan_kv_cache(4, 2048, 23_040, budget_bytes=1, fixed_bytes=GiB).live_cap is None


def test_too_small_to_hold_one_sequence_says_what_to_raise():
    with pytest.raises(ValueError, match="vllm_kv_budget_gb"):
        plan_kv_cache(4, 2048, 23_040, budget_bytes=1000)
    with pytest.raises(ValueError, match=">= 1"):
        plan_kv_cache(0, 2048, 23_040, budget_bytes=GiB)
