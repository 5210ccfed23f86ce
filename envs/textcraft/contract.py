"""Hints for the generic env contract suite (tests/test_env_contract.py)."""

from __future__ import annotations

from envs.textcraft.expert import next_action

OPTIONS: dict = {}


def valid_action(observation: str, info: dict) -> str:
    return "I will check what I carry.\nAction: inventory"


def expert_action(observation: str, info: dict) -> str | None:
    action = next_action(info["goal"], info.get("inventory", {}))
    return None if action is None else f"Following the recipe tree.\nAction: {action}"


def two_actions(observation: str, info: dict) -> str:
    return "Action: inventory\nAction: get 1 oak log"
