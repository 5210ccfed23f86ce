"""Compact text for what the BabyAI agent sees (pure: data in, string out).

Positions are egocentric: "3 ahead, 1 left" is three steps forward and one to the left of the agent.
A small model reads every token of this on CPU, so the wording is terse and fixed. Every observation ends
with the same multiple-choice question listing the available actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class ObjView:
    name: str  # "red ball 1": colour, type and a per-episode index
    ahead: int  # steps forward (negative: behind)
    right: int  # steps to the right (negative: left)
    state: Optional[str] = None  # doors: "open" / "closed" / "locked"
    visible: bool = True  # False: remembered from earlier, out of view now


def relative_position(ahead: int, right: int) -> str:
    parts = []
    if ahead > 0:
        parts.append(f"{ahead} ahead")
    elif ahead < 0:
        parts.append(f"{-ahead} behind")
    if right > 0:
        parts.append(f"{right} right")
    elif right < 0:
        parts.append(f"{-right} left")
    return ", ".join(parts) if parts else "here"


def describe_object(o: ObjView) -> str:
    """Visible objects get their position; remembered ones only their name (and door state): their
    "go to" macro still works, and positions of things out of view would cost tokens for little use."""
    parts = [relative_position(o.ahead, o.right)] if o.visible else []
    if o.state:
        parts.append(o.state)
    return f"{o.name} ({', '.join(parts)})" if parts else o.name


def describe_ahead(free: int, blocker: Optional[str], max_view: int) -> str:
    """The straight line in front of the agent: free cells, then what stops it."""
    if blocker is None:
        return f"{free}+ free" if free >= max_view else f"{free} free"
    if free == 0:
        return f"blocked by {blocker}"
    return f"{free} free, then {blocker}"


PRIMITIVES = ("turn left", "turn right", "move forward", "pick up", "drop", "toggle")
QUESTION = "Which action? Choose one of: "


def render_observation(
    mission: str,
    objects: Sequence[ObjView],
    ahead: str,
    carrying: Optional[str],
    actions: Sequence[str],
    feedback: Optional[str] = None,
) -> str:
    lines = []
    if feedback:
        lines.append(feedback)
    lines.append(f"Goal: {mission}")
    seen = [describe_object(o) for o in objects if o.visible]
    lines.append("You see: " + (", ".join(seen) if seen else "no objects"))
    remembered = [describe_object(o) for o in objects if not o.visible]
    if remembered:
        lines.append("Out of view: " + ", ".join(remembered))
    lines.append(f"Ahead: {ahead}")
    lines.append(f"Carrying: {carrying or 'nothing'}")
    lines.append(render_actions(actions))
    return "\n".join(lines)


def render_actions(actions: Sequence[str]) -> str:
    """The closing question. A 135M chat model answers a direct multiple-choice question far more often
    with exactly one of the options than it follows a "reply with ..." instruction; quoting the options
    and listing object actions before the primitive moves also raised the share of parseable replies
    (bench/babyai_base_success.py)."""
    ordered = [a for a in actions if a not in PRIMITIVES] + [a for a in actions if a in PRIMITIVES]
    return QUESTION + ", ".join(f'"{a}"' for a in ordered)


def render_invalid(error: str, actions: Sequence[str]) -> str:
    return f"Invalid action: {error}. Nothing happened.\n" + render_actions(actions)
