"""Run comparison and nightly regression logic (pure: no MLflow, no disk).

``summarize`` turns one curriculum run's metric histories into a ``RunSummary`` (``eval_summary`` does the same
for a ``scalinginter eval`` run); ``side_by_side`` renders several summaries as a text table with one column per
run; ``study_rows`` / ``study_table`` / ``arm_bands`` lay out a learning study (arms x seeds, each training run
with the evaluation of its final checkpoint); ``check_regression`` compares tonight's evaluation with the
previous night's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from core.stats import wilson_interval
from core.study import ARMS, Band, curve_over_seeds

Series = list[tuple[int, float]]  # (global step, value), any order


@dataclass(frozen=True)
class Rate:
    """A success rate with its 95 % interval (``lo``/``hi`` None when unknown)."""

    value: float
    lo: float | None = None
    hi: float | None = None

    def text(self, spec: str = ".3f") -> str:
        if self.lo is None or self.hi is None:
            return format(self.value, spec)
        return f"{self.value:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


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
    kind: str = "train"  # "train" (a curriculum's parent run) | "eval" (a ``scalinginter eval`` run)
    heldout: dict[int, Rate] = field(default_factory=dict, compare=False)  # eval runs: turn budget -> success


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


def eval_budgets(histories: dict[str, Series], model: str = "model") -> dict[int, Rate]:
    """An eval run's success per turn budget: ``<model>/avg`` and ``<model>/avg_ci_low|high`` are logged at
    step = budget (``flows.evaluate.log_eval``)."""
    val = _by_step(histories.get(f"{model}/avg"))
    lo = _by_step(histories.get(f"{model}/avg_ci_low"))
    hi = _by_step(histories.get(f"{model}/avg_ci_high"))
    return {int(b): Rate(float(v), lo.get(b), hi.get(b)) for b, v in sorted(val.items())}


def _by_step(series: Series | None) -> dict[int, float]:
    """``{step: value}`` in step order; a step logged twice keeps its later value."""
    return dict(sorted(series or [], key=lambda p: p[0]))


_CKPT = re.compile(r"(?:^|/)([^/]+)/phase-(\d+)/(?:final|step-\d+)/?$")


def eval_label(checkpoint: str | None, fallback: str) -> str:
    """A column name for an eval run: ``eval:<run>/phase-<k>`` when the checkpoint is a training run's
    (``.../checkpoints/<run>/phase-<k>/final``), ``eval:<model>`` for a model name, else ``fallback``."""
    if not checkpoint or checkpoint in ("null", "None"):
        return fallback
    m = _CKPT.search(checkpoint.rstrip("/"))
    if m:
        return f"eval:{m.group(1)}/phase-{m.group(2)}"
    return f"eval:{checkpoint.rstrip('/').rsplit('/', 1)[-1]}"


def eval_summary(name: str, run_id: str, histories: dict[str, Series], start_ms: int | None,
                 end_ms: int | None) -> RunSummary:
    """A ``scalinginter eval`` run as a column of ``side_by_side``: success (with interval) at each turn budget;
    its headline success is the one at the largest budget."""
    budgets = eval_budgets(histories)
    top = budgets[max(budgets)] if budgets else None
    wall = (end_ms - start_ms) / 1000.0 if start_ms is not None and end_ms is not None and end_ms >= start_ms else None
    return RunSummary(name=name, run_id=run_id, curriculum="eval", steps=0, wall_time_s=wall,
                      success=top.value if top else None, success_source="held-out" if top else "-",
                      reward=last_value(histories.get("mean_reward")), turns=last_value(histories.get("mean_turns")),
                      train_success=None, kind="eval", heldout=budgets)


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
    for b in sorted({b for r in runs for b in r.heldout}):  # eval runs: success at every turn budget
        body.append([f"held-out @{b} turns [95% CI]"] + [r.heldout[b].text() if b in r.heldout else "-" for r in runs])
    return _render(header, body, left_cols=1)


def _render(header: list[str], body: list[list[str]], left_cols: int = 1) -> str:
    """Aligned text columns: the first ``left_cols`` left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i < left_cols else c.rjust(widths[i])
                         for i, c in enumerate(cells)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in body)])


# --- learning study ---------------------------------------------------------------------------------------
_STUDY_NAME = re.compile(r"-(" + "|".join(re.escape(a) for a in ARMS) + r")-s(\d+)$")


def study_arm_seed(run_name: str, curriculum: str, seed: int | None) -> tuple[str, int | None]:
    """The arm and seed of a study run: from its name (``study-<env>-<arm>-s<seed>``, as
    ``bench/learning_study.py`` names them), else the curriculum label as the arm and the ``seed`` param."""
    m = _STUDY_NAME.search(run_name)
    if m:
        return m.group(1), int(m.group(2))
    return curriculum, seed


@dataclass(frozen=True)
class StudyRow:
    """One training run of a study with the evaluation of its final checkpoint (``final``: None if not scored)."""

    arm: str
    seed: int | None
    run: RunSummary
    tokens: float | None  # tokens generated in training
    final: RunSummary | None = None  # the ``scalinginter eval`` run of the final checkpoint
    heldout_curve: list[tuple[int, Rate]] = field(default_factory=list)  # eval.each_phase: (global step, success)


def heldout_curve(series: Series | None, n_tasks: int | None) -> list[tuple[int, Rate]]:
    """``heldout/success_rate`` points (greedy, ``n_tasks`` held-out tasks) with their Wilson intervals; without
    ``n_tasks`` the points have no interval. A step logged twice keeps its last value."""
    out = []
    for step, v in _by_step(series).items():
        if n_tasks:
            k = round(v * n_tasks)
            lo, hi = wilson_interval(k, n_tasks) if 0 <= k <= n_tasks else (None, None)
            out.append((int(step), Rate(float(v), lo, hi)))
        else:
            out.append((int(step), Rate(float(v))))
    return out


def study_rows(rows: list[StudyRow]) -> list[StudyRow]:
    """Rows in table order: arms in the study's order (scalinginter, fixed-short, fixed-long, then others by
    name), seeds ascending."""
    order = {a: i for i, a in enumerate(ARMS)}
    return sorted(rows, key=lambda r: (order.get(r.arm, len(ARMS)), r.arm, -1 if r.seed is None else r.seed,
                                       r.run.name))


def study_table(rows: list[StudyRow], others: list[RunSummary] = (), title: str = "") -> str:
    """The study side by side: one line per run (arm, seed, run, steps, tokens generated, wall time, held-out
    success with its 95 % interval at every evaluated turn budget), other eval runs of the experiment (the base
    model) as lines of their own, then the held-out curve per phase (``eval.each_phase``) when logged."""
    if not rows and not others:
        raise ValueError("the study has no training runs and no evaluations")
    rows = study_rows(rows)
    budgets = sorted({b for r in rows if r.final for b in r.final.heldout} | {b for o in others for b in o.heldout})
    header = ["arm", "seed", "run", "turn limits", "steps", "tokens", "wall s"] + [f"held-out @{b} [95% CI]"
                                                                                    for b in budgets]

    def cells(r: RunSummary | None) -> list[str]:
        return [r.heldout[b].text() if r is not None and b in r.heldout else "-" for b in budgets]

    body = [[r.arm, "-" if r.seed is None else str(r.seed), r.run.name, r.run.curriculum, str(r.run.steps),
             _fmt(r.tokens, ".0f"), _fmt(r.run.wall_time_s, ".0f")] + cells(r.final) for r in rows]
    body += [["(eval)", "-", o.name, "-", "-", "-", _fmt(o.wall_time_s, ".0f")] + cells(o) for o in others]
    parts = ([title] if title else []) + [_render(header, body, left_cols=4)]
    curved = [r for r in rows if r.heldout_curve]
    if curved:
        steps = sorted({s for r in curved for s, _ in r.heldout_curve})
        head = ["arm", "seed", "run"] + [f"step {s}" for s in steps]
        lines = []
        for r in curved:
            pts = dict(r.heldout_curve)
            lines.append([r.arm, "-" if r.seed is None else str(r.seed), r.run.name]
                         + [pts[s].text() if s in pts else "-" for s in steps])
        parts += ["", "held-out success per phase (eval.each_phase; greedy, 95% Wilson interval):",
                  _render(head, lines, left_cols=3)]
    return "\n".join(parts)


def arm_bands(rows: list[StudyRow], base: float | None = None) -> dict[str, dict[str, dict[int, Band]]]:
    """Per arm, mean and min-max over seeds of the held-out curve (``heldout``: the phase evaluations, plus the
    base model's success at step 0 when given, plus the final evaluation at the last step when no phase point is
    there) and of the train success per step (``train``)."""
    out: dict[str, dict[str, dict[int, Band]]] = {}
    for arm in dict.fromkeys(r.arm for r in study_rows(rows)):
        rs = [r for r in rows if r.arm == arm]
        held = []
        for r in rs:
            c = {s: p.value for s, p in r.heldout_curve}
            if base is not None:
                c.setdefault(0, base)
            if r.final is not None and r.final.success is not None and r.run.steps and r.run.steps not in c:
                c[r.run.steps] = r.final.success
            if c:
                held.append(c)
        train = [_by_step(r.run.curves.get("success_rate")) for r in rs]
        out[arm] = {"heldout": curve_over_seeds(held), "train": curve_over_seeds([t for t in train if t])}
    return out


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
