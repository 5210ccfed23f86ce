"""Token log-probs (and entropies) from hidden states, a chunk of positions at a time.

The plain way projects every wanted position onto the vocabulary at once: a ``[positions, vocab]`` logits tensor,
its fp32 copy, the softmax for the entropy, and autograd keeps the logits for the backward pass. With SmolLM2's
49,152-token vocabulary that is ~0.2 MB per position per tensor: a multi-turn micro-batch of 1,000 policy tokens
holds about 1 GB of them. ``chunked_token_logprobs`` projects ``chunk`` positions at a time and keeps only the
hidden states and the output weight for the backward pass, where it recomputes each chunk's logits: the
vocabulary-wide tensors never exceed one chunk (``chunk x vocab``), for one extra output projection in the
backward pass.

Numerics follow the plain path: the projection runs in ``compute_dtype`` (bf16 under autocast: inputs cast to it,
as autocast casts a Linear's), the log-softmax in fp32, divided by the sampling temperature; the backward pass
casts the logits' gradient to ``compute_dtype`` for its two matmuls, as autograd does through the plain path's
``.float()``. The entropy has no gradient (the loss only reports it).
"""

from __future__ import annotations

import torch


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's fp32 logits, divided by the temperature."""
    logits = (h @ w.t()).float()
    return logits / temperature if temperature > 0 else logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, temperature, chunk, with_entropy, compute_dtype, weight_grad_sink):
        n = h.shape[0]
        tok = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.zeros(n, dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # the dtypes are explicit here
            hc, wc = h.to(compute_dtype), weight.to(compute_dtype)
            for s in range(0, n, chunk):
                logits = _logits(hc[s:s + chunk], wc, temperature)
                logz = torch.logsumexp(logits, dim=-1)
                tok[s:s + chunk] = logits.gather(-1, targets[s:s + chunk].unsqueeze(-1)).squeeze(-1) - logz
                if with_entropy:
                    ent[s:s + chunk] = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
                del logits
        ctx.save_for_backward(h, weight, targets)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        ctx.weight_grad_sink = weight_grad_sink
        ctx.mark_non_differentiable(ent)
        return tok, ent

    @staticmethod
    def backward(ctx, grad_tok, _grad_ent):
        h, weight, targets = ctx.saved_tensors
        dt, T, chunk = ctx.compute_dtype, ctx.temperature, ctx.chunk
        with torch.no_grad():
            hc, wc = h.to(dt), weight.to(dt)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        scale = 1.0 / T if T > 0 else 1.0
        for s in range(0, h.shape[0], chunk):
            with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
                # d log p(y) / d z_j = (1[j = y] - p_j) / T, times the incoming gradient
                g = grad_tok[s:s + chunk].float()
                dz = torch.softmax(_logits(hc[s:s + chunk], wc, T), dim=-1).mul_(-g[:, None])
                dz.scatter_add_(-1, targets[s:s + chunk].unsqueeze(-1), g.unsqueeze(-1))
                dz = (dz * scale).to(dt)
                if grad_h is not None:
                    grad_h[s:s + chunk] = (dz @ wc).to(h.dtype)
                if grad_w is not None:
                    grad_w += (dz.t() @ hc[s:s + chunk]).float()
        if grad_w is not None and ctx.weight_grad_sink is not None:
            ctx.weight_grad_sink(grad_w)  # taken now, not carried through the rest of the backward
            grad_w = None
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_token_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk: int, with_entropy: bool = False,
                           compute_dtype: torch.dtype | None = None,
                           weight_grad_sink=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | h[i]) under ``softmax(h @ weight.T / temperature)`` ([n] fp32), and the entropy of that
    distribution (``with_entropy``; no gradient), ``chunk`` positions at a time (module docstring).

    ``h``: [n, hidden]; ``weight``: the output projection [vocab, hidden] (no bias); ``targets``: [n] token ids;
    ``temperature`` <= 0 means none; ``compute_dtype``: the projection's dtype (None: ``h``'s).
    ``weight_grad_sink``: called in the backward with ``weight``'s fp32 gradient, which then does not go to autograd
    (the learner's bf16 gradients: a tied output weight's gradient is otherwise held through the whole backward
    until the embedding's part is added to it)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden states {tuple(h.shape)} and output weight {tuple(weight.shape)} do not match")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"{targets.shape[0]} targets for {h.shape[0]} positions")
    tok, ent = _ChunkedLogProbs.apply(h, weight, targets, float(temperature), int(chunk), bool(with_entropy),
                                      compute_dtype or h.dtype, weight_grad_sink)
    return tok, (ent if with_entropy else None)
