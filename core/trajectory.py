"""Token-exact multi-turn trajectories.

A trajectory is one flat token sequence: the prompt (system + first observation, rendered by the chat
template), then for every turn the ids the policy sampled (loss mask 1) followed by the environment's
reply wrapped in the chat template's own delimiters (loss mask 0). Ids are never decoded and re-encoded.
Rewards are attached to the last *action* token of the turn that earned them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FINISH_REASONS = ("success", "failure", "turn_limit", "token_budget", "env_error")
# endings that cut an episode short rather than end it: the state after the last action still has a value
TRUNCATION_REASONS = ("turn_limit", "token_budget")


@dataclass
class Trajectory:
    task_id: int
    group_id: int  # samples of the same task in the same step share a group id
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob on policy tokens, 0.0 elsewhere
    prompt_len: int = 0
    action_ends: list[int] = field(default_factory=list)  # index of each turn's last action token
    turn_rewards: list[float] = field(default_factory=list)  # reward the env gave for each turn
    success: bool = False
    finish_reason: str = ""
    masked: bool = False  # infrastructure failure: excluded from loss and metrics, never scored 0
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    # -- building -------------------------------------------------------------------------------------
    def start(self, prompt_ids: list[int]) -> None:
        if self.token_ids:
            raise ValueError("trajectory already started")
        self.token_ids = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.prompt_len = len(prompt_ids)

    def add_action(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} action ids but {len(logprobs)} log-probs")
        if not ids:
            raise ValueError("an action turn needs at least one token")
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.action_ends.append(len(self.token_ids) - 1)
        self.turn_rewards.append(0.0)

    def set_turn_reward(self, reward: float) -> None:
        if not self.turn_rewards:
            raise ValueError("no action turn to reward")
        self.turn_rewards[-1] = float(reward)

    def add_env(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def finish(self, reason: str, success: bool = False) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {FINISH_REASONS}")
        self.finish_reason = reason
        self.success = bool(success)
        if reason == "env_error":
            self.masked = True

    # -- views ----------------------------------------------------------------------------------------
    @property
    def turns(self) -> int:
        return len(self.action_ends)

    @property
    def reward(self) -> float:
        """Episode return: the sum of the turn rewards."""
        return float(sum(self.turn_rewards))

    @property
    def num_policy_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["turns"] = self.turns
        d["reward"] = self.reward
        return d


def is_truncated(traj: Trajectory) -> bool:
    """True when a turn limit or the token budget cut the episode short (PPO bootstraps from V(s_T) there)."""
    return traj.finish_reason in TRUNCATION_REASONS


def token_rewards(traj: Trajectory) -> list[float]:
    """Per-token reward: each turn's reward on that turn's last action token (never on an env token)."""
    out = [0.0] * len(traj.token_ids)
    for pos, r in zip(traj.action_ends, traj.turn_rewards):
        if traj.loss_mask[pos] != 1:
            raise ValueError(f"reward position {pos} is not a policy token")
        out[pos] += r
    return out
