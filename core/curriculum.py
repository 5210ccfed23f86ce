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


# --- gated mode: a phase ends when its train success rate stops improving ---------------------------------
@dataclass(frozen=True)
class Gate:
    patience: int = 3  # steps without improvement of the smoothed success rate before the phase ends
    min_delta: float = 0.02  # smallest rise that counts as improvement
    threshold: float | None = None  # the phase ends once the smoothed success rate reaches this
    window: int = 3  # moving-average window over the per-step train success rates
    min_steps: int = 2  # a phase runs at least this many steps


@dataclass(frozen=True)
class GateState:
    """Where a gated phase stands; a plain value stored in every checkpoint so resume is exact."""

    history: tuple[float, ...] = ()  # per-step train success rates of this phase
    best: float | None = None  # best smoothed success rate so far
    since_best: int = 0  # steps since ``best`` last rose by >= min_delta

    def to_dict(self) -> dict:
        return {"history": list(self.history), "best": self.best, "since_best": self.since_best}

    @classmethod
    def from_dict(cls, d: dict | None) -> "GateState":
        if not d:
            return cls()
        return cls(tuple(float(x) for x in d.get("history", ())), d.get("best"), int(d.get("since_best", 0)))


def gate_update(gate: Gate, state: GateState, success_rate: float, max_steps: int) -> tuple[GateState, str | None]:
    """Record one step's train success rate. Returns the new state and why the phase ends now
    (``"threshold"``, ``"plateau"``, ``"max_steps"``) or None to go on."""
    history = state.history + (float(success_rate),)
    recent = history[-gate.window:]
    smooth = sum(recent) / len(recent)
    if state.best is None or smooth >= state.best + gate.min_delta:
        best, since = smooth, 0
    else:
        best, since = state.best, state.since_best + 1
    new = GateState(history, best, since)
    steps = len(history)
    if steps >= max_steps:
        return new, "max_steps"
    if steps < gate.min_steps:
        return new, None
    if gate.threshold is not None and smooth >= gate.threshold:
        return new, "threshold"
    if since >= gate.patience:
        return new, "plateau"
    return new, None
