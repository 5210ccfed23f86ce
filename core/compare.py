"""Run comparison and nightly regression logic (pure: no MLflow, no disk).

``summarize`` turns one curriculum run's metric histories into a ``RunSummary``; ``side_by_side`` renders
several summaries as a text table with one column per run; ``check_regression`` compares tonight's
evaluation with the previous night's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Series = list[tuple[int, float]]  # (global step, value), any order


@dataclass(frozen=True)
class RunSummary:
    name: str
    run_id: str
    curriculum: str  # e.g. "2>3>4" (ScalingInter) or "4" (fixed horizon)
    steps: int  # training steps logged (distinct global steps)
    wall_time_s: float | None
    success: float | None  # final held-out success (eval_after) if logged, else last train success
    success_source: str  # "held-out" | "train" | "-"
    reward: float | None  # last train mean reward
    turns: float | None  # last train mean turns
    train_success: float | None  # last train success rate
    curves: dict[str, Series] = field(default_factory=dict, compare=False)


def last_value(series: Series | None) -> float | None:
    """Value at the largest step (the last logged one wins ties)."""
    if not series:
        return None
    best = max(range(len(series)), key=lambda i: (series[i][0], i))
    return float(series[best][1])


def curriculum_label(turn_limits: list[int]) -> str:
    """``[2, 3, 4]`` -> ``"2>3>4"`` (ScalingInter); a fixed horizon is one number whatever its phases
    (``[4, 4, 4]`` -> ``"4"``, as the learning study's fixed arms keep the phase boundaries)."""
    if not turn_limits:
        return "-"
    if len(set(turn_limits)) == 1:
        return str(turn_limits[0])
    return ">".join(str(t) for t in turn_limits)


def summarize(name: str, run_id: str, histories: dict[str, Series], turn_limits: list[int],
              start_ms: int | None, end_ms: int | None) -> RunSummary:
    """``histories`` maps metric names (success_rate, mean_reward, mean_turns, eval_after/success_rate, ...)
    to their (step, value) series."""
    train = {k: histories.get(k) or [] for k in ("success_rate", "mean_reward", "mean_turns")}
    steps = len({s for ser in train.values() for s, _ in ser})  # distinct training steps logged
    held = last_value(histories.get("eval_after/success_rate") or histories.get("heldout/success_rate"))
    train_success = last_value(train["success_rate"])
    if held is not None:
        success, source = held, "held-out"
    elif train_success is not None:
        success, source = train_success, "train"
    else:
        success, source = None, "-"
    wall = (end_ms - start_ms) / 1000.0 if start_ms is not None and end_ms is not None and end_ms >= start_ms else None
    return RunSummary(name=name, run_id=run_id, curriculum=curriculum_label(turn_limits), steps=int(steps),
                      wall_time_s=wall, success=success, success_source=source,
                      reward=last_value(train["mean_reward"]), turns=last_value(train["mean_turns"]),
                      train_success=train_success,
                      curves={k: sorted(v) for k, v in {**train, "heldout/success_rate":
                                                        histories.get("heldout/success_rate") or []}.items() if v})


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


ROWS = [
    ("curriculum (turn limits)", lambda r: r.curriculum),
    ("final success", lambda r: _fmt(r.success, ".3f") + (f" ({r.success_source})" if r.success is not None else "")),
    ("final train success", lambda r: _fmt(r.train_success, ".3f")),
    ("final reward", lambda r: _fmt(r.reward, ".3f")),
    ("final turns", lambda r: _fmt(r.turns, ".2f")),
    ("wall time (s)", lambda r: _fmt(r.wall_time_s, ".0f")),
    ("steps", lambda r: str(r.steps)),
]


def side_by_side(runs: list[RunSummary]) -> str:
    """A text table: one row per quantity, one column per run."""
    if not runs:
        raise ValueError("side_by_side needs at least one run")
    header = [""] + [r.name for r in runs]
    body = [[label] + [get(r) for r in runs] for label, get in ROWS]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in body)])


# --- nightly regression -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    regressed: bool
    message: str
    delta: float | None  # current - previous on the watched metric


def check_regression(current: dict[str, float], previous: dict[str, float] | None,
                     metric: str = "success_rate", tolerance: float = 0.05) -> Verdict:
    """Regression = ``current[metric] < previous[metric] - tolerance`` (absolute). No previous night: no
    regression. Raises on a missing metric or a negative tolerance."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if metric not in current:
        raise KeyError(f"metric {metric!r} missing from tonight's results (have: {', '.join(sorted(current))})")
    cur = float(current[metric])
    if previous is None or metric not in previous:
        return Verdict(False, f"{metric} {cur:.3f}; no previous night to compare with", None)
    prev = float(previous[metric])
    delta = cur - prev
    if cur < prev - tolerance:
        return Verdict(True, f"REGRESSION: {metric} {cur:.3f} vs {prev:.3f} the previous night "
                             f"({delta:+.3f}, tolerance {tolerance:.3f})", delta)
    return Verdict(False, f"OK: {metric} {cur:.3f} vs {prev:.3f} the previous night ({delta:+.3f}, "
                          f"tolerance {tolerance:.3f})", delta)


def markdown_table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> str:
    """Two-column markdown table (used by the Prefect artifacts)."""
    out = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(out)
