"""Contract-suite hints for BabyAI (tests/test_env_contract.py)."""

from __future__ import annotations

import re

OPTIONS: dict = {"levels": "GoToObj"}  # one room, one object: the macro expert below always succeeds


def valid_action(observation: str, info: dict) -> str:
    return "I will look around.\nAction: turn left"


def expert_action(observation: str, info: dict) -> str | None:
    """Go to the mission's object with the env's planner macro; explore while it is not in view."""
    m = re.search(r"(?:(red|green|blue|purple|yellow|grey) )?(ball|key|box|door)", info.get("mission", ""))
    avail = info.get("available_actions", [])
    if m:
        color = m.group(1) or r"\w+"
        wanted = re.compile(rf"go to {color} {m.group(2)} \d+")
        hits = [a for a in avail if wanted.fullmatch(a)]
        if hits:
            return f"Action: {hits[0]}"
    return "Action: " + ("move forward" if "move forward" in avail else "turn left")


def two_actions(observation: str, info: dict) -> str:
    return "Action: turn left\nAction: turn right"
