"""The ScalingInter-vs-fixed-horizon study, as pure functions (no Prefect, no disk).

Three arms train for the same number of steps with the same episodes per step and differ only in the turn
limit of each phase:

- ``scalinginter``: the curriculum as given (growing limits, e.g. 2 -> 3 -> 4);
- ``fixed-short``: every phase at the first phase's limit;
- ``fixed-long``: every phase at the last phase's limit.

The phase boundaries stay the same in every arm, so each arm has a checkpoint at the same global steps
and the held-out curve of every arm is measured at the same points.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

ARMS = ("scalinginter", "fixed-short", "fixed-long")


def arm_phases(phases: list[dict], arm: str) -> list[dict]:
    """The curriculum of one arm, from the ScalingInter one (a list of ``{"turn_limit", "steps"}``)."""
    if not phases:
        raise ValueError("the study needs a curriculum with at least one phase")
    if arm == "scalinginter":
        limit = None
    elif arm == "fixed-short":
        limit = phases[0]["turn_limit"]
    elif arm == "fixed-long":
        limit = phases[-1]["turn_limit"]
    else:
        raise ValueError(f"unknown study arm {arm!r}; choose from {', '.join(ARMS)}")
    return [{"turn_limit": p["turn_limit"] if limit is None else limit, "steps": p["steps"]} for p in phases]


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms:
        raise ValueError("--arms is empty: give e.g. scalinginter,fixed-short,fixed-long")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    if len(set(arms)) != len(arms):
        raise ValueError(f"--arms names an arm twice: {text}")
    return arms


@dataclass(frozen=True)
class Band:
    """Mean and spread (min, max) over seeds of one quantity at one point."""

    mean: float
    lo: float
    hi: float
    n: int


def band(values: list[float]) -> Band:
    if not values:
        raise ValueError("band of no values")
    return Band(statistics.fmean(values), min(values), max(values), len(values))


def curve_over_seeds(curves: list[dict[int, float]]) -> dict[int, Band]:
    """Per-seed curves ``{step: value}`` -> ``{step: Band}`` over the seeds that have the step."""
    steps = sorted({s for c in curves for s in c})
    return {s: band([c[s] for c in curves if s in c]) for s in steps}


def pooled_successes(per_seed: list[list[float]]) -> list[float]:
    """Per-task success averaged over seeds (each seed's list is over the same tasks, in the same order)."""
    if not per_seed:
        raise ValueError("no seeds")
    n = len(per_seed[0])
    if any(len(p) != n for p in per_seed):
        raise ValueError("the seeds were scored on different numbers of tasks; a paired test needs the same tasks")
    return [statistics.fmean(p[i] for p in per_seed) for i in range(n)]
