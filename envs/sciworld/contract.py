"""Contract-suite hints for SciWorld (tests/test_env_contract.py). Few JVMs: the pool is shared per process."""

from __future__ import annotations

from envs.base import task_index

OPTIONS: dict = {"expose_gold": True, "max_jvms": 4, "env_step_limit": 1000}
# Test indices 0..29 are one variation of each task (round-robin, tasks sorted by name); a short sample
# whose gold paths are short: find-animal, find-plant, identify-life-stages-2, power-component
EXPERT_TASKS = [task_index("test", i) for i in (5, 13, 17, 25)]
EXPERT_MAX_STEPS = 150


def valid_action(observation: str, info: dict) -> str:
    return "First I look around.\nAction: look around"


def two_actions(observation: str, info: dict) -> str:
    return "Action: look around\nAction: inventory"


def expert_action(observation: str, info: dict) -> str | None:
    """ScienceWorld's gold action path (the env exposes the next gold action with expose_gold=True)."""
    action = info.get("gold_action")
    return None if action is None else f"Action: {action}"
