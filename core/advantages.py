"""Advantage estimators for multi-turn trajectories (one of the two plug-in registries).

Every estimator sees the batch as padded ``[B, T]`` tensors over the *whole* token sequence (prompt, policy
tokens and env tokens) and returns per-token advantages that are 0 everywhere but on policy tokens:

- ``rewards``: each turn's reward on that turn's last action token (``core.trajectory.token_rewards``), the
  outcome reward therefore on the final action token, never on an env token the loss mask zeroes;
- ``mask``: 1 on policy tokens;
- ``groups``: samples of the same task in the same step share a group id;
- ``live``: False for masked samples (infrastructure failures), which get 0 and never enter statistics;
- ``values``: the critic's value of the state before each token (PPO only);
- ``bootstrap``: per sequence, the value of the state after its last action (PPO only): 0 when the episode
  terminated (success, failure: nothing follows), the critic's value of the truncated state when a turn limit
  or token budget cut it short (``bootstrap_values``) — truncation is not termination;
- ``kl``: per-token KL estimate log pi_old - log pi_ref (REINFORCE++ puts ``-kl_coef * kl`` in the reward).

Token-level recursions (GAE, discounted returns) run over *policy tokens only*: the successor of a turn's
last action token is the next turn's first action token; env tokens are skipped, never bootstrapped from.

Each estimator has a plain-Python reference version (``*_reference``, lists in, lists out, written to be
read) and the vectorised tensor version the learner uses; tests check they agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

EPS = 1e-6


@dataclass
class AdvantageBatch:
    rewards: torch.Tensor  # [B, T] float
    mask: torch.Tensor  # [B, T] float, 1 on policy tokens
    groups: torch.Tensor  # [B] long
    live: torch.Tensor  # [B] bool
    values: torch.Tensor | None = None  # [B, T] (PPO)
    kl: torch.Tensor | None = None  # [B, T] log pi_old - log pi_ref (REINFORCE++)
    bootstrap: torch.Tensor | None = None  # [B] V(s_T) after the last action; None = 0 for all (PPO)


@dataclass
class EstimatorParams:
    gamma: float = 1.0
    lam: float = 1.0
    normalize_std: bool = True  # GRPO: divide by the group std
    whiten: bool = True  # PPO: normalise advantages over the batch's policy tokens
    kl_coef: float = 0.0  # REINFORCE++: KL penalty in the reward


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] critic targets (PPO)


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[[AdvantageBatch, EstimatorParams], AdvantageResult]
    needs_critic: bool = False  # PPO: values in, returns out
    kl_in_reward: bool = False  # REINFORCE++: the KL penalty is in the reward, not in the loss
    needs_groups: bool = False  # group baselines need >= 2 samples per task
    description: str = ""


_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register(name: str, *, needs_critic: bool = False, kl_in_reward: bool = False, needs_groups: bool = False,
             description: str = ""):
    def deco(fn):
        _ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, kl_in_reward, needs_groups, description)
        return fn

    return deco


def get_estimator(name: str) -> EstimatorSpec:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; available: {', '.join(estimator_names())}")
    return _ESTIMATORS[name]


def estimator_names() -> list[str]:
    return sorted(_ESTIMATORS)


# --- sequence-level baselines (plain Python; shared by reference and tensor versions) ---------------------
def _members(groups: Sequence[int], masked: Sequence[bool]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        if not masked[i]:
            members[g].append(i)
    return members


def grpo_scores(
    rewards: Sequence[float],
    groups: Sequence[int],
    masked: Sequence[bool] | None = None,
    normalize_std: bool = True,
    eps: float = EPS,
) -> list[float]:
    """Group-normalised outcome reward: (r - mean_g) / (std_g + eps), std the population std.

    Masked samples get 0 and do not enter their group's statistics. A group with one live sample, or with
    identical rewards, gives 0 advantages (no signal).
    """
    n = len(rewards)
    if len(groups) != n:
        raise ValueError(f"{n} rewards but {len(groups)} group ids")
    masked = list(masked) if masked is not None else [False] * n
    out = [0.0] * n
    for idx in _members(groups, masked).values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i in idx:
            a = float(rewards[i]) - mean
            out[i] = a / (std + eps) if normalize_std else a
    return out


def rloo_scores(rewards: Sequence[float], groups: Sequence[int], masked: Sequence[bool] | None = None) -> list[float]:
    """Leave-one-out baseline: r_i - mean of the *other* live samples of i's group (0 for a group of one)."""
    n = len(rewards)
    if len(groups) != n:
        raise ValueError(f"{n} rewards but {len(groups)} group ids")
    masked = list(masked) if masked is not None else [False] * n
    out = [0.0] * n
    for idx in _members(groups, masked).values():
        if len(idx) < 2:
            continue
        total = sum(float(rewards[i]) for i in idx)
        for i in idx:
            out[i] = float(rewards[i]) - (total - float(rewards[i])) / (len(idx) - 1)
    return out


# --- reference (plain loop) versions ----------------------------------------------------------------------
def _policy_positions(mask: Sequence[int]) -> list[int]:
    return [t for t, m in enumerate(mask) if m]


def broadcast_reference(scores: Sequence[float], masks: Sequence[Sequence[int]]) -> list[list[float]]:
    return [[float(s) * m for m in mask] for s, mask in zip(scores, masks)]


def gae_reference(rewards: Sequence[Sequence[float]], masks: Sequence[Sequence[int]],
                  values: Sequence[Sequence[float]], gamma: float, lam: float,
                  live: Sequence[bool] | None = None,
                  bootstrap: Sequence[float] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """GAE over policy tokens only. Returns (advantages, returns), both 0 off policy tokens.

    For the policy positions p_0 < ... < p_{n-1} of a sequence: delta_k = r(p_k) + gamma * V(p_{k+1}) - V(p_k)
    with V(p_n) = ``bootstrap[b]`` (0 when the episode terminated after the last action, the critic's value of
    the truncated state otherwise; all 0 when ``bootstrap`` is None), A_k = delta_k + gamma * lam * A_{k+1}.
    Rewards on non-policy tokens are an error (they would be silently lost).
    """
    advs, rets = [], []
    for b, (r, m, v) in enumerate(zip(rewards, masks, values)):
        a_row, g_row = [0.0] * len(m), [0.0] * len(m)
        if live is None or live[b]:
            for t, x in enumerate(r):
                if x and not m[t]:
                    raise ValueError(f"sequence {b}: reward {x} on non-policy token {t} would be lost")
            pos = _policy_positions(m)
            next_v, next_a = (float(bootstrap[b]) if bootstrap is not None else 0.0), 0.0
            for t in reversed(pos):
                delta = r[t] + gamma * next_v - v[t]
                a = delta + gamma * lam * next_a
                a_row[t], g_row[t] = a, a + v[t]
                next_v, next_a = v[t], a
        advs.append(a_row)
        rets.append(g_row)
    return advs, rets


def discounted_returns_reference(rewards: Sequence[Sequence[float]], masks: Sequence[Sequence[int]],
                                 gamma: float, live: Sequence[bool] | None = None) -> list[list[float]]:
    """G(p_k) = r(p_k) + gamma * G(p_{k+1}) over policy positions only (0 elsewhere)."""
    out = []
    for b, (r, m) in enumerate(zip(rewards, masks)):
        row = [0.0] * len(m)
        if live is None or live[b]:
            g = 0.0
            for t in reversed(_policy_positions(m)):
                g = r[t] + gamma * g
                row[t] = g
        out.append(row)
    return out


def whiten_reference(x: Sequence[Sequence[float]], masks: Sequence[Sequence[int]],
                     live: Sequence[bool] | None = None, eps: float = EPS) -> list[list[float]]:
    """(x - mean) / (std + eps) over all policy tokens of live sequences (population std)."""
    vals = [x[b][t] for b, m in enumerate(masks) if live is None or live[b] for t, mm in enumerate(m) if mm]
    if not vals:
        return [[0.0] * len(m) for m in masks]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return [[((x[b][t] - mean) / (std + eps)) * mm if (live is None or live[b]) else 0.0
             for t, mm in enumerate(m)] for b, m in enumerate(masks)]


def reinforce_pp_reference(rewards, masks, kl, kl_coef: float, gamma: float,
                           live: Sequence[bool] | None = None) -> list[list[float]]:
    """REINFORCE++: token returns of (reward - kl_coef * kl) over policy tokens, whitened over the batch."""
    shaped = [[(r[t] - kl_coef * k[t]) * m[t] for t in range(len(m))] for r, m, k in zip(rewards, masks, kl)]
    return whiten_reference(discounted_returns_reference(shaped, masks, gamma, live), masks, live)


# --- vectorised versions --------------------------------------------------------------------------------
def _check_rewards_on_policy(batch: AdvantageBatch) -> None:
    lost = (batch.rewards != 0) & (batch.mask == 0) & batch.live[:, None]
    if bool(lost.any()):
        b, t = (int(x) for x in lost.nonzero()[0])
        raise ValueError(f"sequence {b}: reward on non-policy token {t} would be lost by the loss mask")


def sequence_rewards(batch: AdvantageBatch) -> torch.Tensor:
    return batch.rewards.sum(dim=1)


def _group_stats(scores: torch.Tensor, groups: torch.Tensor, live: torch.Tensor):
    """Per-sample (sum over live group members, count of live group members, sum of squares)."""
    _, inv = torch.unique(groups, return_inverse=True)
    G = int(inv.max()) + 1 if len(inv) else 0
    w = live.to(scores.dtype)
    s = torch.zeros(G, dtype=scores.dtype).index_add_(0, inv, scores * w)
    n = torch.zeros(G, dtype=scores.dtype).index_add_(0, inv, w)
    ss = torch.zeros(G, dtype=scores.dtype).index_add_(0, inv, scores * scores * w)
    return s[inv], n[inv], ss[inv]


def _masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    n = mask.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * mask


def _reverse_scan(mask: torch.Tensor, step) -> None:
    """Walk positions right to left; ``step(t, on)`` is called with the [B] bool of policy tokens at t."""
    for t in range(mask.shape[1] - 1, -1, -1):
        step(t, mask[:, t] > 0)


@register("grpo", needs_groups=True, description="group-normalised outcome reward broadcast over policy tokens")
def grpo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    r = sequence_rewards(batch).double()
    s, n, ss = _group_stats(r, batch.groups, batch.live)
    n_ = n.clamp(min=1)
    mean = s / n_
    std = (ss / n_ - mean * mean).clamp(min=0).sqrt()
    score = r - mean
    if p.normalize_std:
        score = score / (std + EPS)
    score = torch.where(batch.live & (n > 0), score, torch.zeros_like(score))
    return AdvantageResult(score.float()[:, None] * batch.mask)


@register("rloo", needs_groups=True, description="leave-one-out baseline over the n samples of a task")
def rloo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    r = sequence_rewards(batch).double()
    s, n, _ = _group_stats(r, batch.groups, batch.live)
    score = r - (s - r) / (n - 1).clamp(min=1)
    score = torch.where(batch.live & (n >= 2), score, torch.zeros_like(score))
    return AdvantageResult(score.float()[:, None] * batch.mask)


@register("reinforce++", kl_in_reward=True,
          description="token returns with the KL penalty in the reward, whitened over the global batch")
def reinforce_pp(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    _check_rewards_on_policy(batch)
    mask = batch.mask * batch.live[:, None].to(batch.mask.dtype)
    r = batch.rewards.double()
    if batch.kl is not None and p.kl_coef:
        r = r - p.kl_coef * batch.kl.double()
    r = r * mask
    ret = torch.zeros_like(r)
    g = torch.zeros(r.shape[0], dtype=r.dtype)

    def step(t, on):
        nonlocal g
        g = torch.where(on, r[:, t] + p.gamma * g, g)
        ret[:, t] = torch.where(on, g, torch.zeros_like(g))

    _reverse_scan(mask, step)
    return AdvantageResult(_masked_whiten(ret, mask.double()).float())


@register("ppo", needs_critic=True, description="GAE(gamma, lambda) over policy tokens with a learned critic")
def ppo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    if batch.values is None:
        raise ValueError("the ppo estimator needs critic values (batch.values)")
    _check_rewards_on_policy(batch)
    mask = batch.mask * batch.live[:, None].to(batch.mask.dtype)
    r, v = batch.rewards.double(), batch.values.double()
    adv = torch.zeros_like(r)
    next_v = (batch.bootstrap.double().clone() if batch.bootstrap is not None
              else torch.zeros(r.shape[0], dtype=r.dtype))
    next_a = torch.zeros_like(next_v)

    def step(t, on):
        nonlocal next_v, next_a
        delta = r[:, t] + p.gamma * next_v - v[:, t]
        a = delta + p.gamma * p.lam * next_a
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
        next_v = torch.where(on, v[:, t], next_v)
        next_a = torch.where(on, a, next_a)

    _reverse_scan(mask, step)
    returns = (adv + v) * mask
    out = _masked_whiten(adv, mask.double()) if p.whiten else adv * mask
    return AdvantageResult(out.float(), returns.float())


# --- building a batch from trajectories -----------------------------------------------------------------
def pad_rows(rows: Sequence[Sequence[float]], width: int | None = None, dtype=torch.float32) -> torch.Tensor:
    width = width if width is not None else max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out


def make_batch(token_rewards: Sequence[Sequence[float]], loss_masks: Sequence[Sequence[int]],
               groups: Sequence[int], masked: Sequence[bool] | None = None,
               values: Sequence[Sequence[float]] | None = None,
               kl: Sequence[Sequence[float]] | None = None,
               bootstrap: Sequence[float] | None = None) -> AdvantageBatch:
    masked = list(masked) if masked is not None else [False] * len(loss_masks)
    width = max((len(m) for m in loss_masks), default=0)
    return AdvantageBatch(
        rewards=pad_rows(token_rewards, width), mask=pad_rows(loss_masks, width),
        groups=torch.tensor(list(groups), dtype=torch.long), live=~torch.tensor(masked, dtype=torch.bool),
        values=pad_rows(values, width) if values is not None else None,
        kl=pad_rows(kl, width) if kl is not None else None,
        bootstrap=torch.tensor([float(x) for x in bootstrap], dtype=torch.float32) if bootstrap is not None else None)


def unpad(x: torch.Tensor, lengths: Sequence[int]) -> list[list[float]]:
    return [x[i, :n].tolist() for i, n in enumerate(lengths)]


def bootstrap_values(trajs, final_values: Sequence[float] | None) -> list[float]:
    """V(s_T) after each trajectory's last action, for GAE: 0 for an episode that terminated (or was masked),
    ``final_values[i]`` (the critic's value of the state after trajectory i's last token) for one a turn limit
    or token budget truncated. ``final_values`` None: 0 for all (no critic value of the final state given)."""
    from core.trajectory import is_truncated

    if final_values is None:
        return [0.0] * len(trajs)
    if len(final_values) != len(trajs):
        raise ValueError(f"{len(final_values)} final values for {len(trajs)} trajectories: pass one per trajectory")
    return [float(v) if is_truncated(t) and not t.masked else 0.0 for t, v in zip(trajs, final_values)]


def trajectory_advantages(name: str, params: EstimatorParams, trajs, values=None, kl=None, final_values=None):
    """Run estimator ``name`` over ``core.trajectory.Trajectory`` objects. ``values`` / ``kl`` are per-token
    lists aligned with ``trajs`` (the learner's ``per_token``); ``final_values`` (PPO) the critic's value of the
    state after each trajectory's last token (the learner's ``final_values``), bootstrapped from where a turn
    limit or token budget truncated the episode. Returns (advantages, returns or None, stats)."""
    from core.trajectory import token_rewards

    spec = get_estimator(name)
    if spec.needs_critic and values is None:
        raise ValueError(f"estimator {name!r} needs critic values")
    batch = make_batch([token_rewards(t) for t in trajs], [t.loss_mask for t in trajs], [t.group_id for t in trajs],
                       [t.masked for t in trajs], values if spec.needs_critic else None,
                       kl if spec.kl_in_reward else None,
                       bootstrap_values(trajs, final_values) if spec.needs_critic else None)
    res = spec.fn(batch, params)
    lengths = [len(t.token_ids) for t in trajs]
    adv = unpad(res.advantages, lengths)
    stats = {"episodes_with_signal": float(sum(1 for a in adv if any(x != 0 for x in a)))}
    pol = batch.mask.bool() & batch.live[:, None]
    if bool(pol.any()):
        stats["adv_mean"] = float(res.advantages[pol].mean())
        stats["adv_abs_mean"] = float(res.advantages[pol].abs().mean())
        if batch.values is not None:
            stats["value_mean"] = float(batch.values[pol].mean())
    return adv, (unpad(res.returns, lengths) if res.returns is not None else None), stats
