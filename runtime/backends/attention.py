"""The learner's attention on the CPU: small score matrices in two plain batched matmuls, the rest in SDPA.

transformers runs a model's attention through torch's ``scaled_dot_product_attention`` by default; on the CPU
that is its flash kernel, which walks the keys block by block and, with a padding mask or the key/value heads
shared by several query heads (SmolLM2: 9 query heads on 3), costs 3-4x two matmuls and a softmax where the
score matrix is small (measured on 2 AVX512-BF16 cores, forward and backward: 4 rows x 64 queries x 203 keys,
4.2 ms vs 1.2 ms; one 139-token prompt, 2.5 vs 0.6 ms). The learner's shared-prompt forwards are all of that
kind: a group's prompt alone, then each row's reply against the prompt's keys. Where the scores grow (long
episodes) the flash kernel wins (2 x 1024 tokens: 70 vs 208 ms) and holds no score matrix for the backward, so
those keep SDPA: ``MAX_PER_HEAD`` query x key products per head, ``MAX_SCORES`` over the call.

The small path computes what SDPA computes: softmax(q k^T * scale + mask) v, the matmuls in the autocast dtype and
the softmax in fp32 (as transformers' eager attention), the query heads of one key/value head stacked into one
matmul (no copy of the keys per query head); like flash attention it keeps no probabilities for the backward, which
recomputes them from each row's log-sum-exp. ``tests/test_attention.py`` compares the two.
"""

from __future__ import annotations

import torch

NAME = "scalinginter_cpu"
MAX_PER_HEAD = 256 * 256  # query x key positions of one head
MAX_SCORES = 1 << 22  # over the batch and the heads (the fp32 probabilities, 16 MiB, exist one layer at a time)


def small(query: torch.Tensor, key: torch.Tensor) -> bool:
    """True when the call's score matrix is small enough for the matmul path."""
    B, H, q, _ = query.shape
    k = key.shape[2]
    return q * k <= MAX_PER_HEAD and B * H * q * k <= MAX_SCORES and H % key.shape[1] == 0


class _MatmulAttention(torch.autograd.Function):
    """softmax(q k^T * scale, masked) v on the folded layout (query [B, KH, r*q, d], key/value [B, KH, k, d], mask
    broadcasting to [B, KH, r, q, k] or None), the same operations as transformers' eager attention, keeping only
    the inputs for the backward: the probabilities are recomputed there (one more q k^T and softmax), as flash
    attention does, instead of holding them (fp32 and bf16) for every layer until the backward (~6 bytes per score:
    0.3 GiB over SmolLM2's 30 layers for a micro-batch of 8 replies against their prompts)."""

    @staticmethod
    def _probs(q, k, mask, scale, r, qn):
        B, KH, rq, _ = q.shape
        s = torch.matmul(q, k.transpose(2, 3)).mul_(scale).view(B, KH, r, qn, k.shape[2])
        if mask is not None:  # a row with every key masked gets uniform weights (as eager attention), not NaN
            s = s.masked_fill_(~mask, torch.finfo(s.dtype).min) if mask.dtype == torch.bool else s.add_(mask)
        s = s.view(B, KH, rq, k.shape[2])
        return s.dtype, torch.softmax(s, dim=-1, dtype=torch.float32)

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, r: int, qn: int):
        _, p = _MatmulAttention._probs(q, k, mask, scale, r, qn)
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale, ctx.r, ctx.qn = scale, r, qn
        return torch.matmul(p.to(v.dtype), v)

    @staticmethod
    def backward(ctx, go):
        q, k, v, mask = ctx.saved_tensors
        s_dtype, p = _MatmulAttention._probs(q, k, mask, ctx.scale, ctx.r, ctx.qn)
        go = go.to(v.dtype)
        gv = torch.matmul(p.to(v.dtype).transpose(2, 3), go)
        gp = torch.matmul(go, v.transpose(2, 3)).float()
        # the mask's positions get p = 0, so no gradient (a row with every key masked: a padding position, whose
        # output has no gradient)
        gs = torch.ops.aten._softmax_backward_data(gp, p, -1, s_dtype).mul_(ctx.scale).to(q.dtype)
        del p, gp
        return torch.matmul(gs, k), torch.matmul(gs.transpose(2, 3), q), gv, None, None, None, None


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, causal: bool) -> torch.Tensor:
    """softmax(query key^T * scaling, masked) value for query [B, H, q, d] and key, value [B, KH, k, d] (H a
    multiple of KH: query head h reads key/value head h // (H / KH)); ``mask`` [B or 1, 1, q, k] bool (True:
    attend) or float (added), or None with ``causal`` for torch's causal pattern (key j <= query i). [B, H, q, d]."""
    B, H, q, d = query.shape
    KH, k = key.shape[1], key.shape[2]
    r = H // KH
    if mask is None and causal and q > 1:
        mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril()
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, None]  # [B, 1, 1, q, k] against [B, KH, r, q, k]
    out = _MatmulAttention.apply(query.reshape(B, KH, r * q, d), key, value, mask, scaling, r, q)
    return out.view(B, H, q, d)


def cpu_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
    """transformers' attention interface: the matmul path for a small call on the CPU, SDPA for anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (query.device.type == "cpu" and not dropout and small(query, key) and not kwargs.get("sliding_window")
             and kwargs.get("s_aux") is None and not kwargs.get("softcap") and not kwargs.get("output_attentions"))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.dtype != key.dtype or query.dtype != value.dtype:  # as SDPA: one dtype
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = matmul_attention(query, key, value, attention_mask, scale, causal)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``NAME`` with transformers (attention, and SDPA's boolean masks); returns it. Idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, cpu_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use_cpu_attention(model) -> bool:
    """Switch a transformers model on the CPU that runs SDPA attention to ``NAME``; True when it did (a model
    elsewhere, or with another attention implementation, or one that cannot switch, is left alone)."""
    device = next(model.parameters()).device
    if device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    model.set_attn_implementation(register())
    return model.config._attn_implementation == NAME
