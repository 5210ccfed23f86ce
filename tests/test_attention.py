"""The learner's CPU attention (runtime.backends.attention): the matmul path computes what SDPA computes, and large
calls still go to SDPA (a learner switched to it: tests/test_learning.py)."""

import pytest
import torch
import torch.nn.functional as F

from runtime.backends import attention
from runtime.backends.attention import matmul_attention


def _qkv(B, H, KH, q, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(B, h, n, 16, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(H, q), make(KH, k), make(KH, k)


def _sdpa(q, k, v, mask, causal):  # as transformers calls it: causal only for several queries and no mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None and q.shape[2] > 1,
                                          scale=0.25, enable_gqa=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", ["causal", "padded", "cached-prompt", "one-query"])
def test_matmul_attention_equals_sdpa(dtype, tol, case):
    """Outputs and the gradients of query, key and value against torch's SDPA: grouped key/value heads (6 query
    heads on 2), a pure causal call (no mask), right padding, a row's rest against a cached prompt whose tail columns
    are hidden (the learner's shared-prompt forward), and a single query (decoding)."""
    B, H, KH = 3, 6, 2
    q_len, k_len = {"causal": (7, 7), "padded": (7, 7), "cached-prompt": (5, 12), "one-query": (1, 9)}[case]
    mask = None
    if case == "padded":
        keep = torch.tensor([7, 5, 3])[:, None] > torch.arange(7)
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None] & keep[:, None, None]
    elif case == "cached-prompt":  # prompts of 7, 4 and 6 tokens in 7 cache columns, then 5 own tokens each
        cols = torch.cat([torch.tensor([7, 4, 6])[:, None] > torch.arange(7), torch.ones(3, 5, dtype=torch.bool)], 1)
        own = torch.ones(5, 5, dtype=torch.bool).tril()
        causal = torch.cat([torch.ones(5, 7, dtype=torch.bool), own], 1)
        mask = (causal[None] & cols[:, None])[:, None]
    runs = []
    for fn in (lambda q, k, v: matmul_attention(q, k, v, mask, 0.25, True), lambda q, k, v: _sdpa(q, k, v, mask, True)):
        q, k, v = _qkv(B, H, KH, q_len, k_len, dtype)
        out = fn(q, k, v)
        (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        runs.append((out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()))
    for a, b in zip(*runs):
        assert torch.allclose(a, b, atol=tol, rtol=tol), float((a - b).abs().max())


def test_large_calls_go_to_sdpa(monkeypatch):
    """Past MAX_PER_HEAD query x key positions per head (or MAX_SCORES in all) the call runs SDPA, which keeps no
    score matrix for the backward."""
    q, k, v = _qkv(1, 4, 2, 8, 8, torch.float32)
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 2
    assert attention.small(q, k)
    seen = []
    real = attention.matmul_attention
    monkeypatch.setattr(attention, "matmul_attention", lambda *a: (seen.append(1), real(*a))[1])
    small_out, _ = attention.cpu_attention(module, q, k, v, None, scaling=0.25)
    assert seen == [1]
    monkeypatch.setattr(attention, "MAX_PER_HEAD", 63)
    assert not attention.small(q, k)
    big_out, _ = attention.cpu_attention(module, q, k, v, None, scaling=0.25)
    assert seen == [1]  # SDPA ran it
    assert torch.allclose(small_out, big_out, atol=1e-5)
