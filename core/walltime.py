"""Where a run's wall time went: a ledger of exclusive seconds per category (pure; the caller passes the clock).

Categories nest: time spent in an inner category (e.g. an engine start inside an evaluation) counts for the inner
one only, so the categories add up to at most the wall time and the rest is ``other``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES: dict[str, str] = {
    "setup": "setup and engine start",
    "rollout": "rollout",
    "advantages": "advantages",
    "update": "update",
    "weight_sync": "weight sync",
    "evaluation": "evaluation",
    "checkpoint": "checkpoint",
}


@dataclass
class WallLedger:
    totals: dict[str, float] = field(default_factory=dict)
    _stack: list[list] = field(default_factory=list)  # [name, start, seconds spent in children]

    def enter(self, name: str, now: float) -> None:
        if name not in CATEGORIES:
            raise ValueError(f"unknown wall-time category {name!r}: one of {', '.join(CATEGORIES)}")
        self._stack.append([name, now, 0.0])

    def exit(self, now: float) -> float:
        """Close the innermost open category; returns its exclusive seconds (also added to its total)."""
        if not self._stack:
            raise RuntimeError("WallLedger.exit without a matching enter")
        name, start, children = self._stack.pop()
        spent = max(0.0, now - start)
        own = max(0.0, spent - children)
        self.totals[name] = self.totals.get(name, 0.0) + own
        if self._stack:
            self._stack[-1][2] += spent
        return own

    def add(self, name: str, seconds: float) -> None:
        """Add seconds measured elsewhere (e.g. by a backend); they are taken out of the enclosing category."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown wall-time category {name!r}: one of {', '.join(CATEGORIES)}")
        seconds = max(0.0, float(seconds))
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        if self._stack:
            self._stack[-1][2] += seconds

    def breakdown(self, wall_s: float) -> dict[str, float]:
        """Seconds per category in ``CATEGORIES`` order, then ``other`` (wall time not in any category, >= 0)."""
        out = {k: round(self.totals.get(k, 0.0), 3) for k in CATEGORIES}
        out["other"] = round(max(0.0, wall_s - sum(self.totals.values())), 3)
        return out


def format_breakdown(parts: dict[str, float], wall_s: float) -> str:
    """One line: ``wall time 100 s: rollout 50 s (50%), ...`` (categories with time, largest first)."""
    label = {**CATEGORIES, "other": "other"}
    items = sorted(((k, v) for k, v in parts.items() if v >= 0.05), key=lambda kv: -kv[1])
    body = ", ".join(f"{label.get(k, k)} {v:.0f} s ({100 * v / wall_s:.0f}%)" if wall_s > 0 else f"{label.get(k, k)} {v:.0f} s"
                     for k, v in items)
    return f"wall time {wall_s:.0f} s: {body}"
