"""ScalingInter curriculum: data (a list of phases) plus pure functions of the global step.

Steps are counted globally from 0. Phase k covers steps [start_k, start_k + steps_k). Resume is exact
because the turn limit is a function of the step, not scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    turn_limit: int
    steps: int

    def __post_init__(self):
        if self.turn_limit < 1:
            raise ValueError(f"phase turn_limit must be >= 1, got {self.turn_limit}")
        if self.steps < 1:
            raise ValueError(f"phase steps must be >= 1, got {self.steps}")


def validate(phases: list[Phase]) -> None:
    if not phases:
        raise ValueError("a curriculum needs at least one phase")


def total_steps(phases: list[Phase]) -> int:
    return sum(p.steps for p in phases)


def phase_start(phases: list[Phase], k: int) -> int:
    """Global step at which phase k (0-based) begins."""
    if not 0 <= k < len(phases):
        raise IndexError(f"phase {k} out of range (curriculum has {len(phases)} phases)")
    return sum(p.steps for p in phases[:k])


def phase_at(phases: list[Phase], step: int) -> int:
    """0-based index of the phase that global step ``step`` belongs to."""
    validate(phases)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    end = 0
    for k, p in enumerate(phases):
        end += p.steps
        if step < end:
            return k
    raise ValueError(f"step {step} is past the end of the curriculum ({end} steps)")


def turn_limit_at(phases: list[Phase], step: int) -> int:
    return phases[phase_at(phases, step)].turn_limit
