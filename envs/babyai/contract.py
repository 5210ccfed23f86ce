"""Contract-suite hints for BabyAI (tests/test_env_contract.py)."""

from __future__ import annotations

import re

OPTIONS: dict = {"levels": "GoToObj"}  # one room, one object (the expert below serves every level)


def valid_action(observation: str, info: dict) -> str:
    return "I will look around.\nAction: turn left"


def expert_action(observation: str, info: dict) -> str | None:
    """The env's expert (``envs.babyai.expert``: minigrid's BabyAIBot phrased as this env's actions), which the env
    names in ``info["expert_action"]`` (None: it gave up). Every level is served. With the env option
    ``expert_hints=False`` there is no such key: then a go-to heuristic (the mission's object's "go to" macro,
    else explore), which only solves the go-to levels."""
    if "expert_action" in info:
        action = info["expert_action"]
        return None if action is None else f"Action: {action}"
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
