"""Hints for the generic env contract suite (tests/test_env_contract.py) and the scripted expert."""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

from envs.web.expert import resolve

OPTIONS: dict[str, Any] = {"max_contexts": 4, "action_timeout_s": 10.0}


def two_actions(observation: str, info: dict) -> str:
    return "Action: scroll [down]\nAction: scroll [up]"


def comparable(observation: str) -> str:
    """The observation without the per-episode site key in URLs (every episode gets a fresh one)."""
    return re.sub(r"/e/[0-9a-f]+/", "/e/KEY/", observation)


def valid_action(observation: str, info: dict) -> str:
    """A well-formed action (scrolling never breaks a task)."""
    return "I will look further down the page.\nAction: scroll [down]"


@functools.lru_cache(maxsize=1)
def _local_tasks() -> dict[tuple[str, int], dict[str, Any]]:
    from envs.webarena.env import local_tasks

    return {(t["_site_key"], int(t["task_id"])): t for t in local_tasks()}


def expert_action(observation: str, info: dict) -> Optional[str]:
    """The hand-written solution of a local task, one step per turn (None: no expert / element not found)."""
    task = _local_tasks().get((str(info.get("site", "")), int(info.get("task_id", -1) if info.get("task_id") is not None else -1)))
    if task is None:
        return None
    steps = task.get("expert") or []
    turn = int(info.get("turn", 0))
    if turn >= len(steps):
        return None
    action = resolve(steps[turn], observation)
    return None if action is None else f"Following the plan.\nAction: {action}"
