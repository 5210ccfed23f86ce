"""An evaluation's inputs checked before anything heavy loads (pure, no imports beyond the standard library):
``scalinginter eval`` refuses a bad sweep in well under a second, and ``flows.evaluate.evaluate`` checks the same
for its Python callers."""

from __future__ import annotations

MAX_EVAL_SAMPLES = 4096  # an episode's seed key is task_id * MAX_EVAL_SAMPLES + sample


class EvalInputError(ValueError):
    """Bad evaluation input; the message says how to fix it (one line)."""


def check_sweep(samples: int, turn_limits: list[int]) -> None:
    """Refuse a bad sample count or budget list, saying how to fix it (EvalInputError, a ValueError)."""
    if samples < 1:
        raise EvalInputError(f"--samples must be >= 1 (1 = one greedy episode per task), got {samples}")
    if not turn_limits:
        raise EvalInputError("the turn budget list is empty: pass e.g. --turn-limits 2,4,8")
    if any(t < 1 for t in turn_limits):
        raise EvalInputError(f"turn budgets must be >= 1, got {turn_limits}")
    if list(turn_limits) != sorted(set(turn_limits)):
        raise EvalInputError(f"turn budgets must be strictly increasing without repeats, got "
                         f"{','.join(map(str, turn_limits))}: pass e.g. {','.join(map(str, sorted(set(turn_limits))))}")


def check_inputs(samples: int, turn_limits: list[int] | None, temperature: float | None, split: str, n: int,
                 confidence: float = 0.95) -> float:
    """Check the inputs that need no model folder: the sweep (the turn budgets when given), the split, the task
    count, the confidence and the sampling; returns the temperature (None: greedy for one sample, else 1.0).
    Raises EvalInputError."""
    check_sweep(samples, turn_limits if turn_limits is not None else [1])
    if samples > MAX_EVAL_SAMPLES:
        raise EvalInputError(f"--samples {samples} is more than {MAX_EVAL_SAMPLES}: lower it")
    if split not in ("test", "train"):
        raise EvalInputError(f"split must be 'test' or 'train', got {split!r}")
    if n < 1:
        raise EvalInputError(f"n must be >= 1 task, got {n}")
    if not 0 < confidence < 1:
        raise EvalInputError(f"confidence must be in (0, 1), got {confidence}")
    if temperature is None:
        temperature = 0.0 if samples == 1 else 1.0
    if temperature < 0:
        raise EvalInputError(f"temperature must be >= 0, got {temperature}")
    if samples > 1 and temperature == 0:
        raise EvalInputError(f"--samples {samples} with temperature 0 scores {samples} identical greedy episodes: "
                             "pass --temperature > 0 (e.g. 1.0) or --samples 1")
    return temperature
