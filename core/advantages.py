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
- ``kl``: per-token KL estimate log pi_old - log pi_ref (REINFORCE++ puts ``-kl_coef * kl`` in the reward);
- ``turn_ends``: per sequence, the index of each turn's last action token (``Trajectory.action_ends``); the tokens
  of turn k are the policy tokens after turn k-1's end up to turn k's end (env tokens need not be contiguous:
  a history window puts a whole prompt between two turns). Filled for estimators that work per turn
  (``needs_turns``: GiGPO) and for per-turn discounting (``EstimatorParams.discount == "turn"``);
- ``anchors``: per sequence, per turn, the anchor-state key, the observation the turn acted on
  (``core.trajectory.turn_observations``; GiGPO groups the turns of a task's group that share one).

Token-level recursions (GAE, discounted returns) run over *policy tokens only*: the successor of a turn's
last action token is the next turn's first action token; env tokens are skipped, never bootstrapped from.
With ``discount="turn"`` gamma is applied once per turn boundary instead of once per token (reinforce++), or the
return from turn k is normalised among the group's turns k (grpo). GiGPO always discounts per turn.

Each estimator has a plain-Python reference version (``*_reference``, lists in, lists out, written to be
read) and the vectorised tensor version the learner uses; tests check they agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
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
    turn_ends: list[list[int]] | None = None  # per sequence: each turn's last action token (per-turn estimators)
    anchors: list[list[str]] | None = None  # per sequence, per turn: the anchor-state key (GiGPO)


@dataclass
class EstimatorParams:
    gamma: float = 1.0
    lam: float = 1.0
    normalize_std: bool = True  # GRPO: divide by the group std
    whiten: bool = True  # PPO: normalise advantages over the batch's policy tokens
    kl_coef: float = 0.0  # REINFORCE++: KL penalty in the reward
    step_weight: float = 1.0  # GiGPO: omega, the weight of the step-level (anchor-state) advantage
    discount: str = "token"  # reinforce++ / grpo: gamma per policy token ("token") or per turn ("turn")

    @classmethod
    def from_algo(cls, a) -> "EstimatorParams":
        """The estimator parameters of an ``AlgoConfig`` (duck-typed: core.config is not imported here)."""
        return cls(gamma=a.gamma, lam=a.lam, normalize_std=a.normalize_std, whiten=a.whiten_advantages,
                   kl_coef=a.kl_coef, step_weight=a.gigpo_step_weight, discount=a.discount)


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] critic targets (PPO)
    stats: dict[str, float] = field(default_factory=dict)  # estimator-specific metrics (GiGPO's step groups)


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[[AdvantageBatch, EstimatorParams], AdvantageResult]
    needs_critic: bool = False  # PPO: values in, returns out
    kl_in_reward: bool = False  # REINFORCE++: the KL penalty is in the reward, not in the loss
    needs_groups: bool = False  # group baselines need >= 2 samples per task
    description: str = ""
    needs_turns: bool = False  # per-turn structure in: batch.turn_ends and batch.anchors (GiGPO)


_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register(name: str, *, needs_critic: bool = False, kl_in_reward: bool = False, needs_groups: bool = False,
             needs_turns: bool = False, description: str = ""):
    def deco(fn):
        old = _ESTIMATORS.get(name)
        if old is not None and _origin(old.fn) != _origin(fn):  # the same function again (a reload) is fine
            raise ValueError(f"advantage estimator {name!r} is already registered by {_origin(old.fn)}; "
                             f"{_origin(fn)} needs another name")
        _ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, kl_in_reward, needs_groups, description,
                                          needs_turns)
        return fn

    return deco


def _origin(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


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
                                 gamma: float, live: Sequence[bool] | None = None,
                                 turn_ends: Sequence[Sequence[int]] | None = None) -> list[list[float]]:
    """G(p_k) = r(p_k) + gamma * G(p_{k+1}) over policy positions only (0 elsewhere). With ``turn_ends`` (per-turn
    discounting) the factor is gamma only where p_k is a turn's last action token and 1 inside a turn: every token
    of turn k then sees sum_j gamma^(j-k) r_j (plus the undiscounted rest of its own turn's rewards)."""
    out = []
    for b, (r, m) in enumerate(zip(rewards, masks)):
        row = [0.0] * len(m)
        if live is None or live[b]:
            ends = None if turn_ends is None else set(turn_ends[b])
            g = 0.0
            for t in reversed(_policy_positions(m)):
                g = r[t] + (gamma if ends is None or t in ends else 1.0) * g
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
                           live: Sequence[bool] | None = None, turn_ends=None) -> list[list[float]]:
    """REINFORCE++: token returns of (reward - kl_coef * kl) over policy tokens, whitened over the batch
    (``turn_ends``: gamma per turn, see ``discounted_returns_reference``)."""
    shaped = [[(r[t] - kl_coef * k[t]) * m[t] for t in range(len(m))] for r, m, k in zip(rewards, masks, kl)]
    return whiten_reference(discounted_returns_reference(shaped, masks, gamma, live, turn_ends), masks, live)


# --- per-turn references (GiGPO, per-turn GRPO) -----------------------------------------------------------
def turn_positions_reference(mask: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """The policy positions of each turn: those after turn k-1's end up to and including turn k's end."""
    out, prev = [], -1
    for e in ends:
        out.append([t for t in range(prev + 1, e + 1) if mask[t]])
        prev = e
    return out


def turn_rewards_reference(rewards: Sequence[float], mask: Sequence[int], ends: Sequence[int]) -> list[float]:
    """Each turn's reward: the sum of the rewards on its policy tokens (its last action token's, from a trajectory)."""
    return [float(sum(rewards[t] for t in span)) for span in turn_positions_reference(mask, ends)]


def turn_returns_reference(turn_rewards: Sequence[float], gamma: float) -> list[float]:
    """R_k = sum_j>=k gamma^(j-k) r_j over the turns of one episode."""
    out, g = [0.0] * len(turn_rewards), 0.0
    for k in reversed(range(len(turn_rewards))):
        g = float(turn_rewards[k]) + gamma * g
        out[k] = g
    return out


def _normalised(vals: Sequence[float], normalize_std: bool, eps: float = EPS) -> list[float]:
    """(v - mean) / (std + eps) within one group (population std), or v - mean; a group of one gives 0."""
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return [(v - mean) / (std + eps) if normalize_std else v - mean for v in vals]


def _keyed_reference(values: dict[tuple[int, int], float], key_of, normalize_std: bool) -> dict[tuple[int, int], float]:
    """Normalise ``values`` ((sequence, turn) -> value) within the groups ``key_of((b, k))`` names."""
    members: dict = defaultdict(list)
    for bk in values:
        members[key_of(bk)].append(bk)
    out = {}
    for idx in members.values():
        out.update(zip(idx, _normalised([values[bk] for bk in idx], normalize_std)))
    return out


def gigpo_reference(turn_rewards: Sequence[Sequence[float]], anchors: Sequence[Sequence[str]], groups: Sequence[int],
                    masked: Sequence[bool] | None = None, gamma: float = 1.0, normalize_std: bool = True,
                    step_weight: float = 1.0) -> list[list[float]]:
    """GiGPO per-turn advantages A[b][k] = A_episode[b] + step_weight * A_step[b][k] (Feng et al. 2025):

    - A_episode: GRPO's group-normalised episode return (``grpo_scores`` of sum_k r_k);
    - A_step: turn k's discounted return R_k = sum_j>=k gamma^(j-k) r_j, normalised among all turns of the same
      task group (live samples) that acted on the same anchor state (``anchors[b][k]``, the observation), a
      state visited twice by one episode counting twice; a step group of one gives 0.

    Masked samples get 0 and enter no statistics."""
    n = len(turn_rewards)
    masked = list(masked) if masked is not None else [False] * n
    episode = grpo_scores([sum(r) for r in turn_rewards], groups, masked, normalize_std)
    returns = {(b, k): R for b in range(n) if not masked[b]
               for k, R in enumerate(turn_returns_reference(turn_rewards[b], gamma))}
    for b in range(n):
        if not masked[b] and len(anchors[b]) != len(turn_rewards[b]):
            raise ValueError(f"sequence {b}: {len(anchors[b])} anchors for {len(turn_rewards[b])} turns")
    step = _keyed_reference(returns, lambda bk: (groups[bk[0]], anchors[bk[0]][bk[1]]), normalize_std)
    return [[0.0] * len(turn_rewards[b]) if masked[b] else
            [episode[b] + step_weight * step[(b, k)] for k in range(len(turn_rewards[b]))] for b in range(n)]


def grpo_turn_reference(turn_rewards: Sequence[Sequence[float]], groups: Sequence[int],
                        masked: Sequence[bool] | None = None, gamma: float = 1.0,
                        normalize_std: bool = True) -> list[list[float]]:
    """GRPO with per-turn discounting: turn k scored by its return R_k = sum_j>=k gamma^(j-k) r_j, normalised
    among the turns k (same index) of the task group's live samples that reached turn k."""
    n = len(turn_rewards)
    masked = list(masked) if masked is not None else [False] * n
    returns = {(b, k): R for b in range(n) if not masked[b]
               for k, R in enumerate(turn_returns_reference(turn_rewards[b], gamma))}
    adv = _keyed_reference(returns, lambda bk: (groups[bk[0]], bk[1]), normalize_std)
    return [[adv.get((b, k), 0.0) for k in range(len(turn_rewards[b]))] for b in range(n)]


def turn_broadcast_reference(turn_scores: Sequence[Sequence[float]], turn_ends: Sequence[Sequence[int]],
                             masks: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per-token rows: each turn's score on that turn's policy tokens, 0 elsewhere."""
    out = []
    for scores, ends, m in zip(turn_scores, turn_ends, masks):
        row = [0.0] * len(m)
        for s, span in zip(scores, turn_positions_reference(m, ends)):
            for t in span:
                row[t] = float(s)
        out.append(row)
    return out


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


DISCOUNTS = ("token", "turn")


def _per_turn(p: EstimatorParams, name: str, allowed: bool) -> bool:
    """True for ``discount="turn"``; an error for an unknown discount or one ``name`` does not define."""
    if p.discount not in DISCOUNTS:
        raise ValueError(f"unknown discount {p.discount!r}: use one of {DISCOUNTS}")
    if p.discount == "turn" and not allowed:
        raise ValueError(f"discount='turn' is not defined for {name}: use discount='token'")
    return p.discount == "turn"


@dataclass
class _Turns:
    """Per-turn layout of a batch: ``of[b, t]`` the turn of position t (the number of turn ends before it; ``n[b]``
    or more after the last end), ``n[b]`` the turns of sequence b (0 for masked ones), ``ends[b, k]`` turn k's last
    action token (T past the last turn), ``K`` the most turns of any sequence."""
    of: torch.Tensor  # [B, T] long
    n: torch.Tensor  # [B] long
    ends: torch.Tensor  # [B, max(K, 1)] long
    K: int

    def valid(self) -> torch.Tensor:  # [B, K] bool: turn k exists in sequence b
        return torch.arange(self.K)[None, :] < self.n[:, None]

    def broadcast(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, K] per-turn scores -> [B, T]: each turn's score on its policy tokens (``mask``), 0 elsewhere."""
        if self.K == 0:
            return torch.zeros(mask.shape, dtype=scores.dtype)
        on = (self.of < self.n[:, None]) & (mask > 0)
        return torch.where(on, scores.gather(1, self.of.clamp(max=self.K - 1)), torch.zeros((), dtype=scores.dtype))

    def returns(self, r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
        """[B, K] discounted turn returns R_k = r_k + gamma * R_{k+1} of the token rewards ``r`` [B, T] summed per
        turn over its policy tokens."""
        B = r.shape[0]
        rt = torch.zeros(B, self.K + 1, dtype=r.dtype).scatter_add_(1, self.of.clamp(max=self.K), r * mask)
        R = torch.zeros(B, self.K + 1, dtype=r.dtype)
        for k in range(self.K - 1, -1, -1):  # slots past a sequence's last turn hold 0 reward: R stays exact
            R[:, k] = rt[:, k] + gamma * R[:, k + 1]
        return R[:, : self.K]


def _turn_layout(batch: AdvantageBatch) -> _Turns:
    """Checks ``batch.turn_ends`` against the mask (increasing, on policy tokens, every policy token in a turn) for
    the live sequences and lays the turns out as tensors."""
    B, T = batch.mask.shape
    if batch.turn_ends is None:
        raise ValueError("this estimator works per turn and needs batch.turn_ends (each sequence's "
                         "Trajectory.action_ends; trajectory_advantages fills them)")
    if len(batch.turn_ends) != B:
        raise ValueError(f"{len(batch.turn_ends)} rows of turn ends for {B} sequences")
    live = batch.live.tolist()
    rows = []
    for b, ends in enumerate(batch.turn_ends):
        ends = [int(e) for e in ends] if live[b] else []
        if any(not 0 <= e < T for e in ends) or any(x >= y for x, y in zip(ends, ends[1:])):
            raise ValueError(f"sequence {b}: turn ends {ends} must increase and lie in [0, {T})")
        rows.append(ends)
    n = torch.tensor([len(e) for e in rows], dtype=torch.long).reshape(B)
    K = int(n.max()) if B else 0
    ends = torch.full((B, max(K, 1)), T, dtype=torch.long)
    for b, e in enumerate(rows):
        if e:
            ends[b, : len(e)] = torch.tensor(e, dtype=torch.long)
    of = torch.searchsorted(ends, torch.arange(T).expand(B, T).contiguous())
    t = _Turns(of, n, ends, K)
    if T and K:
        off = t.valid() & (batch.mask.gather(1, ends.clamp(max=T - 1))[:, :K] == 0)
        if bool(off.any()):
            b, k = (int(x) for x in off.nonzero()[0])
            raise ValueError(f"sequence {b}: turn {k} ends on token {rows[b][k]}, which is not a policy token")
    stray = (batch.mask > 0) & batch.live[:, None] & (of >= n[:, None])
    if bool(stray.any()):
        b, p = (int(x) for x in stray.nonzero()[0])
        raise ValueError(f"sequence {b}: policy token {p} lies after the last turn end: every action turn needs its "
                         "end in turn_ends")
    return t


def _normalise_by_key(x: torch.Tensor, keys: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """[N] values normalised within the groups ``keys`` [N] names: (x - mean) / (std + eps) (population std), or
    x - mean; a group of one gives 0."""
    s, n, ss = _group_stats(x, keys, torch.ones(x.shape, dtype=torch.bool))
    n_ = n.clamp(min=1)
    mean = s / n_
    out = x - mean
    if normalize_std:
        out = out / ((ss / n_ - mean * mean).clamp(min=0).sqrt() + EPS)
    return out


@register("grpo", needs_groups=True, description="group-normalised outcome reward broadcast over policy tokens")
def grpo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    if _per_turn(p, "grpo", allowed=True):
        return _grpo_per_turn(batch, p)
    return AdvantageResult(_grpo_scores(batch, p.normalize_std).float()[:, None] * batch.mask)


def _grpo_scores(batch: AdvantageBatch, normalize_std: bool) -> torch.Tensor:
    """[B] group-normalised episode returns (``grpo_scores``), 0 for masked sequences."""
    r = sequence_rewards(batch).double()
    s, n, ss = _group_stats(r, batch.groups, batch.live)
    n_ = n.clamp(min=1)
    mean = s / n_
    std = (ss / n_ - mean * mean).clamp(min=0).sqrt()
    score = r - mean
    if normalize_std:
        score = score / (std + EPS)
    return torch.where(batch.live & (n > 0), score, torch.zeros_like(score))


def _grpo_per_turn(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    """Turn k of sequence b scored by R_k (discounted per turn), normalised among the turns k of b's task group
    (``grpo_turn_reference``)."""
    _check_rewards_on_policy(batch)
    turns = _turn_layout(batch)
    mask = batch.mask.double() * batch.live[:, None].double()
    R = turns.returns(batch.rewards.double(), mask, p.gamma)  # [B, K]
    valid = turns.valid()
    adv = torch.zeros_like(R)
    if bool(valid.any()):
        _, g = torch.unique(batch.groups, return_inverse=True)
        keys = g[:, None] * turns.K + torch.arange(turns.K)[None, :]  # (task group, turn index)
        adv[valid] = _normalise_by_key(R[valid], keys[valid], p.normalize_std)
    return AdvantageResult(turns.broadcast(adv, mask).float())


@register("rloo", needs_groups=True, description="leave-one-out baseline over the n samples of a task")
def rloo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    _per_turn(p, "rloo", allowed=False)
    r = sequence_rewards(batch).double()
    s, n, _ = _group_stats(r, batch.groups, batch.live)
    score = r - (s - r) / (n - 1).clamp(min=1)
    score = torch.where(batch.live & (n >= 2), score, torch.zeros_like(score))
    return AdvantageResult(score.float()[:, None] * batch.mask)


def filtered_bc_reference(rewards: Sequence[float], masked: Sequence[bool] | None = None) -> list[float]:
    """Filtered behaviour cloning's sequence scores: 1 for a live episode with a positive return (a success), else
    0 (failures and masked episodes: no gradient, never a negative one)."""
    masked = list(masked) if masked is not None else [False] * len(rewards)
    return [1.0 if float(r) > 0 and not m else 0.0 for r, m in zip(rewards, masked)]


@register("filtered-bc", description="behaviour cloning on the batch's successful episodes (advantage 1 on their "
                                     "policy tokens, 0 elsewhere)")
def filtered_bc(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    _per_turn(p, "filtered-bc", allowed=False)
    score = (sequence_rewards(batch) > 0) & batch.live
    return AdvantageResult(score.float()[:, None] * batch.mask)


@register("reinforce++", kl_in_reward=True,
          description="token returns with the KL penalty in the reward, whitened over the global batch")
def reinforce_pp(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    per_turn = _per_turn(p, "reinforce++", allowed=True)
    _check_rewards_on_policy(batch)
    mask = batch.mask * batch.live[:, None].to(batch.mask.dtype)
    r = batch.rewards.double()
    if batch.kl is not None and p.kl_coef:
        r = r - p.kl_coef * batch.kl.double()
    r = r * mask
    ret = torch.zeros_like(r)
    g = torch.zeros(r.shape[0], dtype=r.dtype)
    disc = None
    if per_turn:  # gamma on a turn's last action token (stepping back into the turn before), 1 inside a turn
        ends = _turn_layout(batch).ends
        at_end = torch.zeros(r.shape[0], r.shape[1] + 1, dtype=torch.bool).scatter_(1, ends, True)[:, : r.shape[1]]
        disc = torch.ones_like(r)
        disc[at_end] = p.gamma

    def step(t, on):
        nonlocal g
        g = torch.where(on, r[:, t] + (p.gamma if disc is None else disc[:, t]) * g, g)
        ret[:, t] = torch.where(on, g, torch.zeros_like(g))

    _reverse_scan(mask, step)
    return AdvantageResult(_masked_whiten(ret, mask.double()).float())


@register("ppo", needs_critic=True, description="GAE(gamma, lambda) over policy tokens with a learned critic")
def ppo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    _per_turn(p, "ppo", allowed=False)
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


@register("gigpo", needs_groups=True, needs_turns=True,
          description="GiGPO: group-normalised episode return plus the turn's discounted return normalised among "
                      "the group's turns from the same anchor state (observation)")
def gigpo(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    """A[b, k] = A_episode[b] + step_weight * A_step[b, k] on turn k's policy tokens (``gigpo_reference``);
    gamma is per turn whatever ``p.discount`` says."""
    _per_turn(p, "gigpo", allowed=True)  # (an unknown discount is still an error)
    _check_rewards_on_policy(batch)
    turns = _turn_layout(batch)
    if batch.anchors is None or len(batch.anchors) != len(batch.turn_ends):
        raise ValueError("gigpo needs batch.anchors, one row of anchor-state keys per sequence "
                         "(trajectory_advantages fills them with core.trajectory.turn_observations)")
    B = batch.mask.shape[0]
    mask = batch.mask.double() * batch.live[:, None].double()
    episode = _grpo_scores(batch, p.normalize_std)  # [B] episode level: GRPO's score of the episode return
    # step level: turn returns normalised within (task group, anchor state)
    R = turns.returns(batch.rewards.double(), mask, p.gamma)  # [B, K]
    keys: dict[tuple[int, str], int] = {}
    bs, ks, ids = [], [], []
    groups = batch.groups.tolist()
    for b in range(B):
        nb = int(turns.n[b])
        if nb and len(batch.anchors[b]) != nb:
            raise ValueError(f"sequence {b}: {len(batch.anchors[b])} anchors for {nb} turns")
        for k in range(nb):
            bs.append(b)
            ks.append(k)
            ids.append(keys.setdefault((groups[b], str(batch.anchors[b][k])), len(keys)))
    step = torch.zeros_like(R)
    stats = {}
    if ids:
        key_t = torch.tensor(ids, dtype=torch.long)
        step[bs, ks] = _normalise_by_key(R[bs, ks], key_t, p.normalize_std)
        size = torch.bincount(key_t).double()
        stats = {"step_group_size_mean": float(size.mean()),
                 "turns_in_shared_step_groups": float((size[key_t] >= 2).double().mean())}
    adv = turns.broadcast(episode[:, None] + p.step_weight * step, mask)
    return AdvantageResult(adv.float(), stats=stats)


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
               bootstrap: Sequence[float] | None = None,
               turn_ends: Sequence[Sequence[int]] | None = None,
               anchors: Sequence[Sequence[str]] | None = None) -> AdvantageBatch:
    masked = list(masked) if masked is not None else [False] * len(loss_masks)
    width = max((len(m) for m in loss_masks), default=0)
    return AdvantageBatch(
        rewards=pad_rows(token_rewards, width), mask=pad_rows(loss_masks, width),
        groups=torch.tensor(list(groups), dtype=torch.long), live=~torch.tensor(masked, dtype=torch.bool),
        values=pad_rows(values, width) if values is not None else None,
        kl=pad_rows(kl, width) if kl is not None else None,
        bootstrap=torch.tensor([float(x) for x in bootstrap], dtype=torch.float32) if bootstrap is not None else None,
        turn_ends=[[int(e) for e in row] for row in turn_ends] if turn_ends is not None else None,
        anchors=[[str(a) for a in row] for row in anchors] if anchors is not None else None)


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
    limit or token budget truncated the episode. Per-turn estimators (GiGPO) and per-turn discounting get each
    trajectory's turn ends (``action_ends``) and, for GiGPO, the observation each turn acted on as its anchor
    state (``turn_observations``; masked trajectories, which enter no statistics, get empty keys).
    Returns (advantages, returns or None, stats)."""
    from core.trajectory import token_rewards, turn_observations

    spec = get_estimator(name)
    if spec.needs_critic and values is None:
        raise ValueError(f"estimator {name!r} needs critic values")
    per_turn = spec.needs_turns or params.discount == "turn"
    batch = make_batch([token_rewards(t) for t in trajs], [t.loss_mask for t in trajs], [t.group_id for t in trajs],
                       [t.masked for t in trajs], values if spec.needs_critic else None,
                       kl if spec.kl_in_reward else None,
                       bootstrap_values(trajs, final_values) if spec.needs_critic else None,
                       turn_ends=[t.action_ends for t in trajs] if per_turn else None,
                       anchors=[[""] * t.turns if t.masked else turn_observations(t) for t in trajs]
                       if spec.needs_turns else None)
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
    stats.update(res.stats)
    return adv, (unpad(res.returns, lengths) if res.returns is not None else None), stats
