"""Statistics of an evaluation (pure: numbers in, numbers out).

- ``wilson_interval``: the Wilson score interval of a proportion (scipy's ``binomtest``).
- ``pass_at_k``: the unbiased Pass@k estimator from n samples of which c succeeded,
  ``1 - C(n-c, k) / C(n, k)`` (the probability that k samples drawn without replacement from the n contain a
  success), computed with exact integer binomials.
- ``bootstrap_ci``: percentile bootstrap interval of a mean over tasks (tasks are resampled with replacement).
- ``mcnemar_exact``: exact McNemar test on paired binary outcomes; given the discordant counts b (only the first
  succeeds) and c (only the second), under H0 b ~ Binomial(b + c, 1/2), so it is a binomial test.
- ``paired_bootstrap``: difference of two per-task score vectors over the same tasks, with a percentile bootstrap
  interval (tasks resampled jointly) and a two-sided bootstrap p-value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.stats import binomtest


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``successes / n``. ``n == 0`` gives the uninformative (0, 1)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from ``n`` samples with ``c`` successes (needs 1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"Pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every draw of k samples contains a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k reported for K samples: every power of two up to K, and K itself."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    ks = {1 << i for i in range(samples.bit_length()) if 1 << i <= samples}
    return sorted(ks | {samples})


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def bootstrap_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(values)`` (one value per task; tasks resampled with replacement).
    Empty input gives (nan, nan)."""
    _check_confidence(confidence)
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1)
    a = (1 - confidence) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def mcnemar_exact(b: int, c: int, alternative: str = "two-sided") -> float:
    """Exact McNemar p-value from the discordant counts: ``b`` pairs where only the first succeeds, ``c`` where
    only the second does. ``alternative``: "two-sided", "greater" (the first is better: b large) or "less".
    No discordant pair: p = 1."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be two-sided, greater or less, got {alternative!r}")
    if b + c == 0:
        return 1.0
    return float(binomtest(int(b), int(b + c), 0.5, alternative=alternative).pvalue)


@dataclass(frozen=True)
class PairedResult:
    diff: float  # mean(a) - mean(b)
    ci: tuple[float, float]  # percentile bootstrap interval of the difference
    p_value: float  # two-sided bootstrap p-value for "no difference"


def paired_bootstrap(a: Sequence[float], b: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                     seed: int = 0) -> PairedResult:
    """``mean(a) - mean(b)`` over the same tasks (``a[i]`` and ``b[i]`` score task i), its percentile bootstrap
    interval and the two-sided p = 2 * (1 + min(#(d* <= 0), #(d* >= 0))) / (resamples + 1), capped at 1, over the
    resampled mean differences d*. With very few tasks the bootstrap is coarse; prefer McNemar for greedy runs."""
    _check_confidence(confidence)
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired scores need the same tasks: {x.size} vs {y.size} values")
    if x.size == 0:
        raise ValueError("paired_bootstrap needs at least one task")
    d = x - y
    diff = float(d.mean())
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    al = (1 - confidence) / 2
    # +1: the observed sample counts as one resample, so p is never 0 from a finite number of resamples
    tail = min(int(np.sum(means <= 0)), int(np.sum(means >= 0)))
    p = min(1.0, 2 * (tail + 1) / (resamples + 1))
    return PairedResult(diff, (float(np.quantile(means, al)), float(np.quantile(means, 1 - al))), p)


def seed_task_bootstrap(per_seed: Sequence[Sequence[float]], confidence: float = 0.95, resamples: int = 4000,
                        seed: int = 0) -> tuple[float, float, float]:
    """Mean of a seeds x tasks table (``per_seed[s][t]``: a per-task score or a paired difference of run ``s`` on
    task ``t``; every seed scored on the same tasks) with a two-way percentile bootstrap interval: each replicate
    draws the seeds with replacement and, independently, the tasks with replacement, and averages the crossed
    cells. Seed-to-seed variation is in the interval (a per-task bootstrap pooled over seeds leaves it out).
    Returns (mean, low, high); an empty table gives nans. (``seed_cluster_bootstrap`` with each task its own
    cluster: the same draws.)"""
    x = np.asarray(per_seed, dtype=float)
    return seed_cluster_bootstrap(x, list(range(x.shape[1])) if x.ndim == 2 else [], confidence, resamples, seed)


def seed_cluster_bootstrap(per_seed: Sequence[Sequence[float]], clusters: Sequence[Any], confidence: float = 0.95,
                           resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """``seed_task_bootstrap`` with the tasks drawn in clusters (``clusters[t]``: task ``t``'s cluster, e.g. its
    env level): each replicate draws the seeds with replacement and, independently, as many whole clusters as there
    are, with replacement, and averages the crossed cells of the drawn clusters' tasks. Where the tasks of a
    cluster succeed or fail together (a policy's one strategy for a level), they count as one draw, not as many:
    the interval then speaks for other tasks of other clusters like these, not only for more tasks of these.
    Returns (mean, low, high); an empty table gives nans."""
    _check_confidence(confidence)
    x = np.asarray(per_seed, dtype=float)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    if x.ndim != 2:
        raise ValueError("per_seed must be a table: one row of per-task values per seed, all of one length")
    S, T = x.shape
    if len(clusters) != T:
        raise ValueError(f"{len(clusters)} cluster labels for {T} tasks")
    groups = [np.array([t for t in range(T) if clusters[t] == c]) for c in dict.fromkeys(clusters)]
    single = np.array([g[0] for g in groups]) if all(len(g) == 1 for g in groups) else None  # one task each
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for b in range(resamples):
        rows = rng.integers(0, S, size=S)
        drawn = rng.integers(0, len(groups), size=len(groups))
        cols = single[drawn] if single is not None else np.concatenate([groups[k] for k in drawn])
        means[b] = x[np.ix_(rows, cols)].mean()
    a = (1 - confidence) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))
