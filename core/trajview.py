"""Pure logic of the trajectory viewer (``scalinginter view``): how an episode row becomes turns and token
segments, finish labels, filtering / sorting / paging of a step's episodes, phase ranges and an inline SVG
line chart. No I/O: the web layer (flows/viewer/app.py) reads Parquet and JSON and calls these."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any, Iterable, Sequence
from urllib.parse import quote

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765


def viewer_url(run_name: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    """The bookmarkable viewer URL of a run (what ``scalinginter view`` serves)."""
    return f"http://{host}:{port}/runs/{quote(run_name, safe='')}"


# --- episodes ---------------------------------------------------------------------------------------------
def finish_label(finish_reason: str | None, masked: bool = False, env_truncated: bool = False) -> str:
    """How an episode ended, as the viewer names it: masked (an env failure; excluded from the loss),
    turn limit, token budget, env limit (the env's own step budget), terminated (success or failure), '-'."""
    if masked or finish_reason == "env_error":
        return "masked"
    if finish_reason == "turn_limit":
        return "turn limit"
    if finish_reason == "token_budget":
        return "token budget"
    if env_truncated:
        return "env limit"
    if finish_reason in ("success", "failure"):
        return "terminated"
    return "-"


TRUNCATED = ("turn limit", "token budget", "env limit")


def policy_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs of policy tokens (mask 1) as [start, end) pairs: one per action turn."""
    runs, start = [], None
    for i, m in enumerate(loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(loss_mask)))
    return runs


@dataclass(frozen=True)
class Segment:
    kind: str  # "prompt" (system + first observation), "action" (policy tokens of turn `turn`), "env" (reply)
    turn: int  # 0-based turn the segment belongs to (prompt: 0)
    start: int
    end: int  # exclusive


def token_segments(loss_mask: Sequence[int], action_ends: Sequence[int] | None = None) -> list[Segment]:
    """Split a trajectory's tokens into prompt / action / env segments. ``action_ends`` (index of each turn's
    last action token, newer files) splits adjacent action turns that share no env tokens; without it the
    runs of the loss mask are the turns."""
    runs = policy_runs(loss_mask)
    if action_ends:
        split = []
        for a, b in runs:  # cut a run after every action end inside it
            cut = a
            for e in action_ends:
                if a <= e < b - 1 and e + 1 > cut:
                    split.append((cut, e + 1))
                    cut = e + 1
            split.append((cut, b))
        runs = split
    out: list[Segment] = []
    first = runs[0][0] if runs else len(loss_mask)
    if first > 0:
        out.append(Segment("prompt", 0, 0, first))
    for k, (a, b) in enumerate(runs):
        out.append(Segment("action", k, a, b))
        nxt = runs[k + 1][0] if k + 1 < len(runs) else len(loss_mask)
        if nxt > b:
            out.append(Segment("env", k, b, nxt))
    return out


def action_span(reply: str, action: str | None) -> tuple[int, int] | None:
    """Where the parsed action appears in the reply (case-insensitive, its last occurrence, since agents end
    their reply with the action); None when it does not appear verbatim."""
    if not action or not reply:
        return None
    i = reply.lower().rfind(action.strip().lower())
    if i < 0:
        return None
    return i, i + len(action.strip())


@dataclass
class Turn:
    index: int  # 1-based
    seen: str | None  # the observation the model saw before replying
    reply: str | None
    action: str | None
    invalid: bool
    reward: float | None
    observation_after: str | None


def conversation(first_observation: str | None, replies: Sequence[str] | None, observations: Sequence[str] | None,
                 turn_rewards: Sequence[float] | None, actions: Sequence[str | None] | None = None,
                 invalid: Sequence[bool] | None = None, turns: int | None = None) -> list[Turn]:
    """The episode turn by turn. Lists may be missing (older files) or one short (a masked episode's last turn
    got no env reply): what is missing is None."""
    def at(xs, i):
        return xs[i] if xs is not None and 0 <= i < len(xs) else None

    n = max(len(replies or ()), len(turn_rewards or ()), turns or 0)
    out = []
    for k in range(n):
        seen = first_observation if k == 0 else at(observations, k - 1)
        r = at(turn_rewards, k)
        out.append(Turn(k + 1, seen, at(replies, k), at(actions, k), bool(at(invalid, k) or False),
                        None if r is None else float(r), at(observations, k)))
    return out


# --- a step's episode table ---------------------------------------------------------------------------------
SORT_KEYS = ("index", "task_id", "category", "reward", "success", "turns", "finish")


def select_episodes(rows: Sequence[dict[str, Any]], failed: bool = False, truncated: bool = False,
                    task: int | None = None, category: str | None = None, sort: str = "index",
                    desc: bool = False) -> list[dict[str, Any]]:
    """Filter (failed only: not success and not masked; truncated only; one task; one category) and sort
    (stable, missing values last) the rows of a step. Each row needs ``index`` and the keys it is sorted by."""
    if sort not in SORT_KEYS:
        raise ValueError(f"unknown sort key {sort!r}; expected one of {', '.join(SORT_KEYS)}")
    out = [r for r in rows
           if (not failed or (not r.get("success") and r.get("finish") != "masked"))
           and (not truncated or r.get("finish") in TRUNCATED)
           and (task is None or r.get("task_id") == task)
           and (category is None or r.get("category") == category)]
    present = [r for r in out if r.get(sort) is not None]
    missing = [r for r in out if r.get(sort) is None]
    present.sort(key=lambda r: (r[sort], r["index"]), reverse=desc)
    return present + missing


def page_of(n_items: int, page: int, per_page: int) -> tuple[int, int, int]:
    """(first, last exclusive, number of pages) of 1-based ``page``, clamped into range."""
    if per_page < 1:
        raise ValueError("per_page must be >= 1")
    pages = max(1, math.ceil(n_items / per_page))
    page = min(max(1, page), pages)
    first = (page - 1) * per_page
    return first, min(n_items, first + per_page), pages


# --- a run's chart ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseRange:
    phase: int
    first_step: int  # global step numbers as in metrics.jsonl (1-based), inclusive
    last_step: int
    turn_limit: int | None


def phase_ranges(metrics: Iterable[dict[str, Any]]) -> list[PhaseRange]:
    """Phases as they ran (a gated phase may stop early): from metrics.jsonl rows (global_step, phase,
    turn_limit). A resumed run may log a step twice: the step counts once."""
    by: dict[int, list[tuple[int, int | None]]] = {}
    for m in metrics:
        if "phase" in m and "global_step" in m:
            tl = m.get("turn_limit")
            by.setdefault(int(m["phase"]), []).append((int(m["global_step"]), None if tl is None else int(tl)))
    return [PhaseRange(p, min(s for s, _ in v), max(s for s, _ in v), max(v)[1]) for p, v in sorted(by.items())]


def planned_phase_ranges(phases: Sequence[tuple[int, int]]) -> list[PhaseRange]:
    """Phases of a steps-mode curriculum from its config: (turn_limit, steps) each."""
    out, s = [], 1
    for k, (tl, n) in enumerate(phases):
        out.append(PhaseRange(k + 1, s, s + n - 1, tl))
        s += n
    return out


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    return [round(start + i * step, 10) for i in range(int((hi - start) / step + 1e-9) + 1)]


def svg_chart(title: str, points: Sequence[tuple[float, float]], phases: Sequence[PhaseRange] = (),
              width: int = 480, height: int = 180, y_range: tuple[float, float] | None = None,
              css_class: str = "chart") -> str:
    """A line chart as inline SVG: ``points`` (x = global step, y), vertical phase boundaries labelled with
    their turn limits. Each point is a ``circle`` with a ``<title>`` (hover shows the value)."""
    pad_l, pad_r, pad_t, pad_b = 44, 10, 22, 26
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    xs = [p[0] for p in points] + [x for r in phases for x in (r.first_step, r.last_step)]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y_range is not None:
        y0, y1 = y_range
    else:
        ys = [p[1] for p in points] or [0.0, 1.0]
        y0, y1 = min(ys), max(ys)
        if y1 == y0:
            y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        return round(pad_l + (x - x0) / (x1 - x0) * w, 2)

    def sy(y: float) -> float:
        return round(pad_t + (1 - (y - y0) / (y1 - y0)) * h, 2)

    parts = [f'<svg class="{css_class}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'role="img" aria-label="{escape(title)}">',
             f'<text x="{pad_l}" y="14" class="chart-title">{escape(title)}</text>',
             f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" class="chart-frame"/>']
    for t in _nice_ticks(y0, y1):
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{sy(t)}" y2="{sy(t)}" class="chart-grid"/>'
                     f'<text x="{pad_l - 4}" y="{sy(t) + 4}" class="chart-tick" text-anchor="end">{t:g}</text>')
    for k, r in enumerate(phases):
        band_a = sx(r.first_step - 0.5) if k else pad_l
        band_a = max(band_a, pad_l)
        if k:
            parts.append(f'<line x1="{band_a}" x2="{band_a}" y1="{pad_t}" y2="{pad_t + h}" class="chart-phase"/>')
        label = f"phase {r.phase}" + (f": \u2264{r.turn_limit} turns" if r.turn_limit is not None else "")
        parts.append(f'<text x="{band_a + 3}" y="{pad_t + 11}" class="chart-phase-label">{escape(label)}</text>')
    if points:
        path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x)},{sy(y)}" for i, (x, y) in enumerate(points))
        parts.append(f'<path d="{path}" class="chart-line"/>')
        for x, y in points:
            parts.append(f'<circle cx="{sx(x)}" cy="{sy(y)}" r="2.5" class="chart-dot">'
                         f'<title>step {x:g}: {y:.4g}</title></circle>')
    else:
        parts.append(f'<text x="{pad_l + w / 2}" y="{pad_t + h / 2}" text-anchor="middle" class="chart-tick">'
                     "no data</text>")
    parts.append(f'<text x="{pad_l + w / 2}" y="{height - 4}" text-anchor="middle" class="chart-tick">'
                 "global step</text>")
    parts.append("</svg>")
    return "".join(parts)


def advantage_color(adv: float | None, scale: float) -> str:
    """CSS background of a policy token by its advantage: green above 0, red below, opacity |adv| / scale
    (capped at 1); transparent when there is no advantage."""
    if adv is None or scale <= 0 or adv == 0:
        return "transparent"
    a = min(1.0, abs(adv) / scale)
    rgb = "22,163,74" if adv > 0 else "220,38,38"
    return f"rgba({rgb},{a:.2f})"
