"""Contract-suite hints for the toy env (``envs/toy.py`` is a module, so its hints live next to it here;
packaged envs put them in ``envs/<name>/contract.py``)."""

from __future__ import annotations

import re

OPTIONS: dict = {"n_train": 50, "n_test": 10}


def valid_action(observation: str, info: dict) -> str:
    return "Let me try.\nAction: open door 1"


def expert_action(observation: str, info: dict) -> str | None:
    """Read the note, map its colour to the door number."""
    color = re.search(r"prize is behind the (\w+) door", observation)
    door = color and re.search(rf"door (\d+) is {color.group(1)}", observation)
    return f"Action: open door {door.group(1)}" if door else None


def two_actions(observation: str, info: dict) -> str:
    return "Action: open door 1\nAction: open door 2"
