"""Policy-gradient losses over token tensors. Shapes: [B, T]; ``mask`` is 1 on policy tokens.

Aggregation is by an explicit denominator so gradient accumulation over micro-batches is exact:
``token-mean`` divides by the number of policy tokens in the *whole* batch.
"""

from __future__ import annotations

import torch


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Low-variance KL estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


def clipped_pg_loss(
    logp: torch.Tensor,  # [B, T] current policy log-probs of the taken tokens
    old_logp: torch.Tensor,  # [B, T] log-probs of the policy that produced the advantages
    adv: torch.Tensor,  # [B, T]
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss and a per-token 'was clipped' indicator."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    kl_coef: float,
    denom: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss + kl_coef * k3 KL, summed over policy tokens and divided by ``denom``."""
    if denom <= 0:
        raise ValueError("loss denominator must be positive (no policy tokens in the batch?)")
    pg, clipped = clipped_pg_loss(logp, old_logp, adv, clip)
    total = pg
    stats = {"pg_loss": float(masked_sum(pg.detach(), mask) / denom),
             "clip_frac": float(masked_sum(clipped, mask) / denom)}
    if ref_logp is not None and kl_coef:
        kl = kl_k3(logp, ref_logp)
        total = total + kl_coef * kl
        stats["kl"] = float(masked_sum(kl.detach(), mask) / denom)
    return masked_sum(total, mask) / denom, stats
