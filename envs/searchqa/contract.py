"""Hints for the generic env contract suite (tests/test_env_contract.py)."""

from __future__ import annotations

from typing import Any, Optional

from envs.searchqa.oracle import oracle_reply

OPTIONS: dict[str, Any] = {"progress": False}  # the embedded default set with BM25 (index cached on disk)


def valid_action(observation: str, info: dict[str, Any]) -> str:
    """A well-formed search (not necessarily a useful one); after two searches, a (probably wrong) answer,
    so that an episode driven by this policy ends (the env itself has no turn limit)."""
    if int(info.get("n_searches", 0)) >= 2:
        return "<answer>I do not know</answer>"
    return "<think>Let me look it up.</think>\n<search>capital city</search>"


def expert_action(observation: str, info: dict[str, Any]) -> Optional[str]:
    """The oracle: searches the entity named by the question's plan and answers from the passages."""
    return oracle_reply(observation, info)


def two_actions(observation: str, info: dict[str, Any]) -> str:
    return "<search>capital city</search>\n<answer>Paris</answer>"
