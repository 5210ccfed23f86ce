"""Policy-gradient and value losses over token tensors. Shapes: [B, T]; ``mask`` is 1 on policy tokens.

Aggregation is by explicit per-token weights computed for the whole mini-batch, so gradient accumulation over
micro-batches is exact:

- ``token-mean``: every policy token of the mini-batch weighs 1 / (policy tokens in the mini-batch);
- ``seq-mean``: every sequence weighs the same: 1 / (sequences * its own policy tokens).

Data parallel: each rank holds a shard of the mini-batch and the engine (DeepSpeed, DDP) averages the ranks'
gradients. Normalising each shard by its own count would average per-shard means, which is not the mini-batch's
mean when shards differ; instead every rank sums ``batch_totals`` of its shard over the ranks (an all-reduce) and
passes the sums to ``sequence_weights`` with ``ranks``, whose factor undoes the engine's averaging.
"""

from __future__ import annotations

from typing import Sequence

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean")


def batch_totals(policy_tokens: Sequence[int]) -> tuple[int, int]:
    """(policy tokens, sequences with a policy token) of a list of sequences: what a rank adds to the all-reduce
    whose sums ``sequence_weights`` takes as ``totals``."""
    if any(n < 0 for n in policy_tokens):
        raise ValueError(f"negative policy-token count in {list(policy_tokens)}")
    return sum(policy_tokens), sum(1 for n in policy_tokens if n > 0)


def sequence_weights(policy_tokens: Sequence[int], mode: str, totals: tuple[int, int] | None = None,
                     ranks: int = 1) -> list[float]:
    """Per-token weight of each sequence of a mini-batch (sequences with no policy token get 0).

    With data parallelism ``policy_tokens`` is this rank's shard, ``totals`` the ``batch_totals`` summed over all
    ranks (the whole mini-batch), and ``ranks`` the number of ranks whose gradients the engine averages: the
    weights are then ``ranks`` times the whole mini-batch's, so the averaged gradient is the whole mini-batch's
    token-mean (or seq-mean). Defaults: one rank, ``totals`` of ``policy_tokens`` itself."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGGREGATIONS}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    own = batch_totals(policy_tokens)
    total, seqs = own if totals is None else totals
    if total < own[0] or seqs < own[1]:
        raise ValueError(f"totals {totals} over all ranks are smaller than this shard's own {own}")
    if total <= 0:
        raise ValueError("no policy tokens in the mini-batch")
    if mode == "token-mean":
        return [ranks / total if n > 0 else 0.0 for n in policy_tokens]
    return [ranks / (seqs * n) if n > 0 else 0.0 for n in policy_tokens]


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


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    weights: torch.Tensor,  # [B, T]: aggregation weight on policy tokens, 0 elsewhere
    clip: float,
    kl_coef: float,
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss (+ kl_coef * k3 KL to the reference) aggregated by ``weights``; the KL term by
    ``kl_weights`` where given (0 on tokens the policy did not sample, where the k3 estimate means nothing)."""
    pg, clipped = clipped_pg_loss(logp, old_logp, adv, clip)
    loss = (pg * weights).sum()
    stats = {"pg_loss": float((pg.detach() * weights).sum()), "clip_frac": float((clipped * weights).sum())}
    if ref_logp is not None and kl_coef:
        kw = weights if kl_weights is None else kl_weights
        kl = kl_k3(logp, ref_logp)
        loss = loss + kl_coef * (kl * kw).sum()
        stats["kl"] = float((kl.detach() * kw).sum())
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,  # [B, T] current critic values
    old_values: torch.Tensor,  # [B, T] values when the advantages were computed
    returns: torch.Tensor,  # [B, T] targets
    weights: torch.Tensor,  # [B, T]
    clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), aggregated by ``weights``."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1 = (values - returns) ** 2
    l2 = (v_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(l1, l2)
    stats = {"value_loss": float((loss.detach() * weights).sum()),
             "value_clip_frac": float(((l2 > l1).float() * weights).sum())}
    return (loss * weights).sum(), stats


def nll_loss(logp: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised (behaviour-cloning) loss: the token-mean negative log-likelihood of the masked-in tokens.

    ``logp`` [B, T] is log p(token_t | tokens_<t) of every position (the learner's per-token log-probs), ``mask``
    [B, T] is 1 on the tokens to imitate (a trajectory's loss mask: the policy's replies) and 0 elsewhere. The sum
    of -logp over the mask is divided by ``denom``: by default the mask's own token count (the micro-batch's
    mean); a learner accumulating micro-batches passes the whole batch's token count, so the gradients add up to
    the batch's token-mean exactly. Returns the loss and ``{"nll": sum / denom, "tokens": masked tokens}``."""
    if logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.to(logp.dtype)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("mask must hold 0 and 1 only")
    n = float(m.sum())
    d = n if denom is None else float(denom)
    if d <= 0:
        raise ValueError("no masked-in tokens: the NLL needs at least one token to imitate (denominator <= 0)")
    if n > d:
        raise ValueError(f"denominator {d:g} is smaller than the {n:g} masked-in tokens of this micro-batch")
    total = torch.where(m > 0, -logp, torch.zeros_like(logp)).sum()  # a masked-out -inf stays out
    return total / d, {"nll": float(total.detach()) / d, "tokens": n}


def micro_batches(lengths: Sequence[int], max_seqs: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Split sequences (kept in order) into consecutive micro-batches ``[start, end)`` of at most ``max_seqs``
    sequences whose padded size (sequences x the longest) is at most ``max_tokens``; a sequence longer than
    ``max_tokens`` goes alone. The learner's activation memory grows with the padded size, so a token cap bounds
    it whatever the turn limit: an update over 4 sequences of 2,048 tokens peaks at 10.9 GB for SmolLM2-135M, at
    4.5 GB cut into micro-batches of 2,048 padded tokens (bench/bench_learner_memory.py)."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (or None for no cap), got {max_tokens}")
    out: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"negative sequence length {n} at {i}")
        grown = max(longest, n)
        if i > start and (i - start >= max_seqs or (max_tokens is not None and (i - start + 1) * grown > max_tokens)):
            out.append((start, i))
            start, grown = i, n
        longest = grown
    if len(lengths) > start:
        out.append((start, len(lengths)))
    return out
