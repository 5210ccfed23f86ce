"""runtime.backends.logprobs: token log-probs a chunk of positions at a time, checked against log_softmax on
random tensors (values and gradients), fp32."""

from __future__ import annotations

import pytest
import torch

from runtime.backends.logprobs import chunked_token_logprobs


@pytest.mark.parametrize("chunk,temperature", [(1, 1.0), (4, 0.7), (100, 1.3), (5, 0.0)])
def test_chunks_match_log_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 8, generator=g).requires_grad_()
    y = torch.randint(0, 50, (13,), generator=g)
    up = torch.randn(13, generator=g)  # an arbitrary upstream gradient
    tok, ent = chunked_token_logprobs(h, w, y, temperature, chunk, with_entropy=True)
    (tok * up).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = h @ w.t()
    z = z / temperature if temperature > 0 else z
    lp = torch.log_softmax(z, dim=-1)
    ref = lp.gather(-1, y[:, None]).squeeze(-1)
    ref_ent = -(lp.exp() * lp).sum(-1)
    (ref * up).sum().backward()
    assert torch.allclose(tok, ref, atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)
    assert not ent.requires_grad


def test_without_entropy_and_bad_input():
    h, w, y = torch.randn(3, 4), torch.randn(6, 4), torch.tensor([0, 5, 2])
    tok, ent = chunked_token_logprobs(h, w, y, 1.0, 2)
    assert ent is None and tok.shape == (3,) and bool((tok <= 0).all())
    with pytest.raises(ValueError, match="chunk"):
        chunked_token_logprobs(h, w, y, 1.0, 0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_token_logprobs(h, torch.randn(6, 5), y, 1.0, 2)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, y[:2], 1.0, 2)
