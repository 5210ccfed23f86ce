"""The transformers engine's kept keys and values (``rollout.kv_reuse_gib``): which kept row a prompt continues (pure,
hand-computed), and that a multi-turn conversation generated with them is the one generated from whole prompts."""

from __future__ import annotations

import pytest
import torch

from core.kvcache import best_cached_prefix, evict_to_budget
from core.prefix import common_prefix_len
from runtime.backends.generation import SamplingParams, TransformersBackend

EOS, PAD = 1, 0


# --- pure ---------------------------------------------------------------------------------------------------------
def test_common_prefix_of_a_prompt_and_a_kept_row():
    assert common_prefix_len([[1, 2, 3], [1, 2, 4]]) == 2
    assert common_prefix_len([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix_len([[], [1]]) == 0
    assert common_prefix_len([[5], [4]]) == 0


def test_best_cached_prefix_takes_the_longest_shared_run_and_leaves_the_last_token():
    kept = [[7, 8, 9], [7, 8, 9, 10, 11], [3, 4]]
    assert best_cached_prefix([7, 8, 9, 10, 11, 12], kept) == (1, 5)  # the whole second row
    assert best_cached_prefix([7, 8, 9, 10, 99], kept) == (1, 4)  # a part of it
    assert best_cached_prefix([7, 8, 9, 10, 11], kept) == (1, 4)  # the prompt's last token runs through the model
    assert best_cached_prefix([7, 8, 5], kept) == (0, 2)  # a tie: the earliest row
    assert best_cached_prefix([2, 3, 4], kept) == (None, 0)
    assert best_cached_prefix([7], kept) == (None, 0)  # nothing usable: a one-token prompt runs whole
    assert best_cached_prefix([7, 8, 5], kept, min_tokens=3) == (None, 0)
    assert best_cached_prefix([7, 8], []) == (None, 0)
    with pytest.raises(ValueError):
        best_cached_prefix([1], kept, min_tokens=0)


def test_evict_to_budget_drops_the_least_recently_used_first():
    # sizes 10, 20, 30, 40 (100 in all), last used at calls 3, 1, 2, 1
    assert evict_to_budget([10, 20, 30, 40], [3, 1, 2, 1], 100) == []
    assert evict_to_budget([10, 20, 30, 40], [3, 1, 2, 1], 80) == [1]  # call 1, the lower index first
    assert evict_to_budget([10, 20, 30, 40], [3, 1, 2, 1], 50) == [1, 3]
    assert evict_to_budget([10, 20, 30, 40], [3, 1, 2, 1], 39) == [1, 2, 3]
    assert evict_to_budget([10, 20, 30, 40], [3, 1, 2, 1], 0) == [0, 1, 2, 3]


# --- the engine ---------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=EOS, pad_token_id=PAD, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # EOS a little likelier, so replies end at different lengths
        model.lm_head.weight[EOS] += 0.5 * model.lm_head.weight.std()
    return model


def engine(model, **kw):
    """The engine in fp32: the property is that kept keys and values change nothing, which fp32 can show token for
    token (the two paths' log-probs within 5e-7 here). Under bf16 autocast (the CPU default) they differ by up to 4e-2,
    enough to flip this flat tiny model's near-tied greedy choices (2 of 20 rows on an AVX512-BF16 EPYC, none on AVX2)."""
    return TransformersBackend(model, EOS, PAD, bf16_autocast=False, **kw)


def conversation(backend, starts, turns: int, params: SamplingParams, seed: int = 0):
    """``turns`` rounds of: every prompt generates, then grows by its reply and an 'observation' of 1-6 tokens (the
    same observations whatever was generated, from their own generator)."""
    obs = torch.Generator().manual_seed(99)
    torch.manual_seed(seed)
    prompts = [list(p) for p in starts]
    out = []
    for _ in range(turns):
        gens = backend.generate(prompts, params)
        out.append(gens)
        for p, g in zip(prompts, gens):
            n = int(torch.randint(1, 7, (1,), generator=obs))
            p.extend(g.token_ids + torch.randint(3, 120, (n,), generator=obs).tolist())
    return out


def starts(n: int = 5, shared: int = 9):
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 120, (shared,), generator=g).tolist()  # an instruction every prompt starts with
    return [head + torch.randint(3, 120, (k,), generator=g).tolist() for k in (4, 11, 2, 7, 5)[:n]]


def same(a, b, tol=5e-3):
    """The same tokens, and log-probs within ``tol``: this engine's log-probs already move by up to 2e-3 on this
    tiny model with how a batch is padded (whole prompts two at a time against one at a time, measured)."""
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            assert x.token_ids == y.token_ids
            assert x.finish == y.finish
            assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0.0) < tol


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_turns_with_kept_keys_and_values_generate_what_whole_prompts_generate(temperature):
    model = tiny_llama()
    params = SamplingParams(6, temperature, 0.9 if temperature else 1.0)
    whole = conversation(engine(model, batch_size=2), starts(), 4, params)
    kept = engine(model, batch_size=2, kv_reuse_bytes=2**26)
    reuse = conversation(kept, starts(), 4, params)
    same(whole, reuse)
    # turn 1 reuses the shared instruction of rows in earlier batches; later turns all but the new tokens
    assert kept.kv.reused_tokens > 0.7 * kept.kv.prompt_tokens
    assert 0 < kept.kv.bytes <= 2**26


def test_an_update_forgets_the_kept_rows():
    model = tiny_llama()
    params = SamplingParams(5, 0.0)
    kept = engine(model, batch_size=8, kv_reuse_bytes=2**26)
    prompts = starts()
    first = kept.generate(prompts, params)
    assert kept.kv.bytes > 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # an in-place update, as the learner's
    model.train()
    model(input_ids=torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss.backward()
    opt.step()
    model.eval()
    grown = [p + g.token_ids + [5, 6] for p, g in zip(prompts, first)]
    before = kept.kv.reused_tokens
    after = kept.generate(grown, params)
    assert kept.kv.reused_tokens - before < sum(len(p) for p in prompts)  # only what this call's own batch shares
    same([engine(model, batch_size=8).generate(grown, params)], [after])
    kept.sync_weights()
    assert kept.kv.bytes == 0


def test_a_small_budget_keeps_less_and_generates_the_same():
    model = tiny_llama()
    params = SamplingParams(6, 0.0)
    whole = conversation(engine(model, batch_size=3), starts(), 3, params)
    # one layer's keys and values of ~40 tokens: 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes = 512 per token
    kept = engine(model, batch_size=3, kv_reuse_bytes=40 * 512)
    same(whole, conversation(kept, starts(), 3, params))
    assert kept.kv.bytes <= 40 * 512
    assert 0 < kept.kv.reused_tokens


def test_new_and_continued_prompts_in_one_batch():
    model = tiny_llama()
    params = SamplingParams(4, 0.0)
    kept = engine(model, batch_size=8, kv_reuse_bytes=2**26)
    a = starts(2)
    gens = kept.generate(a, params)
    fresh = [[100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]]  # shares nothing
    mixed = [p + g.token_ids + [9, 10, 11] for p, g in zip(a, gens)] + fresh
    same([engine(model, batch_size=8).generate(mixed, params)], [kept.generate(mixed, params)])


def test_kept_keys_and_values_are_off_at_zero():
    backend = TransformersBackend(tiny_llama(), EOS, PAD, kv_reuse_bytes=0)
    assert backend.kv is None
    backend.generate(starts(2), SamplingParams(3, 0.0))
    backend.clear_cache()
