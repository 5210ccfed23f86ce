"""Advantage estimators (one of the two plug-in registries).

An estimator maps the batch's sequence-level data to per-token advantages over policy tokens.
Inputs are plain Python lists so the functions are testable by hand; the learner turns them into tensors.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Sequence

Estimator = Callable[..., list[list[float]]]
_ESTIMATORS: dict[str, Estimator] = {}


def register(name: str):
    def deco(fn: Estimator) -> Estimator:
        _ESTIMATORS[name] = fn
        return fn

    return deco


def get_estimator(name: str) -> Estimator:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; available: {', '.join(sorted(_ESTIMATORS))}")
    return _ESTIMATORS[name]


def estimator_names() -> list[str]:
    return sorted(_ESTIMATORS)


def grpo_scores(
    rewards: Sequence[float],
    groups: Sequence[int],
    masked: Sequence[bool] | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """Group-normalised outcome reward: (r - mean_g) / (std_g + eps), std the population std.

    Masked samples (infrastructure failures) get 0 and do not enter their group's statistics.
    A group with one live sample, or with identical rewards, gives 0 advantages (no signal).
    """
    n = len(rewards)
    if len(groups) != n:
        raise ValueError(f"{n} rewards but {len(groups)} group ids")
    masked = list(masked) if masked is not None else [False] * n
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        if not masked[i]:
            members[g].append(i)
    out = [0.0] * n
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i in idx:
            a = float(rewards[i]) - mean
            out[i] = a / (std + eps) if normalize_std else a
    return out


@register("grpo")
def grpo(
    rewards: Sequence[float],
    groups: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    masked: Sequence[bool] | None = None,
    normalize_std: bool = True,
    **_: object,
) -> list[list[float]]:
    """GRPO: the sequence's group-normalised score broadcast over its policy tokens (0 on env tokens)."""
    scores = grpo_scores(rewards, groups, masked, normalize_std)
    return [[s * m for m in mask] for s, mask in zip(scores, loss_masks)]
