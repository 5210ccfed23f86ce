"""Token-exact multi-turn trajectories.

A trajectory is one flat token sequence: the prompt (system + first observation, rendered by the chat
template), then for every turn the ids the policy sampled (loss mask 1) followed by the environment's
reply wrapped in the chat template's own delimiters (loss mask 0). Ids are never decoded and re-encoded.
Rewards are attached to the last *action* token of the turn that earned them.

With a history window (``rollout.history_turns``) each turn is generated from a prompt of its own (the
instruction, the last k turns and the current observation), so the trajectory is the concatenation of its
turns' *samples*: ``segment_starts[k]`` is where turn k's sample (its prompt, then its reply) begins. Every
sample is one sequence for the learner (``turn_samples``); the flat layout keeps the estimators unchanged:
policy tokens, ``action_ends`` and rewards mean what they mean without a window.
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
    segment_starts: list[int] = field(default_factory=list)  # history window: where each turn's sample begins
    # what the episode saw and said, turn by turn (diagnostics, GiGPO's anchor states, the Parquet file, the viewer);
    # None where the rollout never recorded it (an episode that failed at reset has no observations)
    first_observation: str | None = None  # the reset observation: turn 0 acts on it
    observations: list[str] | None = None  # the env's reply to each turn
    replies: list[str] | None = None  # the policy's text of each turn (set when the rollout pass ends)
    actions: list[str | None] | None = None  # the env's parsed action of each turn (None: it named none)
    invalid_actions: list[bool] | None = None  # the env flagged the turn's reply as no valid action
    # the env expert's reply at the state each turn acted on (entry k: before turn k; one more entry may follow the
    # last turn); None where the rollout asked no expert (algo.expert_coef = 0), an entry None where it had none
    expert_replies: list[str | None] | None = None
    # the turns the env's expert needs from each state (entry 0: after reset, entry k: after turn k), where the env
    # reports it (BabyAI's label_remaining); progress-reward shaping's potential
    expert_remaining: list[int | None] | None = None
    expert_demo: bool = False  # the env expert's episode put into a group (algo.expert_groups), not sampled
    category: str | None = None  # the env's task category (per-category eval scores)
    required_turns: int | None = None  # the fewest turns the env's expert needs (results by horizon)
    episode_metrics: dict[str, float] | None = None  # numbers the env reports besides the reward (SciWorld's score)
    env_truncated: bool = False  # the env's own step budget ended the episode
    turn_limit: int | None = None  # the training step's turn limit (None outside training steps)
    attempt: int = 1  # which pass ran it: > 1 after env failures masked the earlier ones
    earlier_errors: list[str] = field(default_factory=list)  # those failures, oldest first

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

    def record_env_reply(self, observation: str, action: str | None, invalid: bool) -> None:
        """The env's reply to the last action: its observation, the action it parsed, whether it was invalid."""
        if self.observations is None:  # the first reply: the per-turn lists start here (None before: no turn)
            self.observations, self.actions, self.invalid_actions = [], [], []
        self.observations.append(observation)
        self.actions.append(action)
        self.invalid_actions.append(bool(invalid))

    def start_segment(self, prompt_ids: list[int]) -> None:
        """History window: the next turn's sample starts here with its own prompt (loss mask 0). The first
        sample is the trajectory's start (``start``), so the first call also marks segment 0."""
        if not self.token_ids:
            raise ValueError("start the trajectory before its next turn's sample")
        if not self.segment_starts:
            self.segment_starts.append(0)
        self.segment_starts.append(len(self.token_ids))
        self.add_env(prompt_ids)

    @property
    def segment_start(self) -> int:
        """Where the sample of the turn being generated begins (0 without a history window)."""
        return self.segment_starts[-1] if self.segment_starts else 0

    @property
    def context_ids(self) -> list[int]:
        """The ids the policy's next turn is generated from: the current sample (the whole trajectory without
        a history window)."""
        return self.token_ids[self.segment_start:] if self.segment_starts else self.token_ids

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


def segment_bounds(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each per-turn sample of ``traj``; one span, the whole sequence, without a history window."""
    starts = traj.segment_starts or [0]
    ends = starts[1:] + [len(traj.token_ids)]
    return list(zip(starts, ends))


def turn_samples(trajs: list[Trajectory]) -> tuple[list[Trajectory], list[tuple[int, int, int]]]:
    """The learner's sequences: every trajectory without a history window as it is (the same object), one per
    turn sample otherwise (a new ``Trajectory`` over its slice: same task, group, mask flag and finish reason;
    the turn's own action end and reward). Also where each sample lies: ``(trajectory index, start, end)``.
    Per-token rows of the samples map back onto the trajectories with ``join_rows``, and the other way with
    ``split_rows``."""
    samples: list[Trajectory] = []
    where: list[tuple[int, int, int]] = []
    for i, t in enumerate(trajs):
        if not t.segment_starts:
            samples.append(t)
            where.append((i, 0, len(t.token_ids)))
            continue
        for a, b in segment_bounds(t):
            k = [j for j, e in enumerate(t.action_ends) if a <= e < b]
            s = Trajectory(task_id=t.task_id, group_id=t.group_id, token_ids=t.token_ids[a:b],
                           loss_mask=t.loss_mask[a:b], logprobs=t.logprobs[a:b],
                           prompt_len=next((p - a for p in range(a, b) if t.loss_mask[p]), b - a),
                           action_ends=[t.action_ends[j] - a for j in k],
                           turn_rewards=[t.turn_rewards[j] for j in k], success=t.success,
                           finish_reason=t.finish_reason, masked=t.masked, error=t.error,
                           expert_demo=t.expert_demo)
            samples.append(s)
            where.append((i, a, b))
    return samples, where


def join_rows(rows: list[list[float]], where: list[tuple[int, int, int]], lengths: list[int]) -> list[list[float]]:
    """Per-token rows of the samples (``turn_samples``) as rows of the trajectories (``lengths``: their token
    counts); a position no sample covers is 0."""
    out = [[0.0] * n for n in lengths]
    for row, (i, a, b) in zip(rows, where):
        if len(row) != b - a:
            raise ValueError(f"a sample row of {len(row)} values for a sample of {b - a} tokens")
        out[i][a:b] = list(row)
    return out


def split_rows(rows: list[list[float]], where: list[tuple[int, int, int]]) -> list[list[float]]:
    """Per-token rows of the trajectories cut into rows of their samples (``turn_samples``)."""
    return [list(rows[i][a:b]) for i, a, b in where]


def reply_starts(traj: Trajectory) -> list[int]:
    """The index of each turn's first policy token (turn k's reply runs from here to ``action_ends[k]``)."""
    out, prev = [], -1
    for end in traj.action_ends:
        p = prev + 1
        while p <= end and not traj.loss_mask[p]:
            p += 1
        out.append(p)
        prev = end
    return out


def relabel_sample(traj: Trajectory, turn: int, reply_ids: list[int]) -> tuple[list[int], list[int]]:
    """The sequence that teaches ``reply_ids`` at the state turn ``turn`` of ``traj`` acted on: the context the
    policy saw then (the trajectory up to that turn's reply; with a history window, that turn's own sample up to
    its reply), then ``reply_ids``; and its loss mask (1 on ``reply_ids`` only)."""
    if not 0 <= turn < traj.turns:
        raise ValueError(f"turn {turn} is not a turn of this {traj.turns}-turn trajectory")
    if not reply_ids:
        raise ValueError("an empty reply teaches nothing")
    start = traj.segment_starts[turn] if traj.segment_starts else 0
    ctx = traj.token_ids[start:reply_starts(traj)[turn]]
    return ctx + list(reply_ids), [0] * len(ctx) + [1] * len(reply_ids)


def is_truncated(traj: Trajectory) -> bool:
    """True when a turn limit or the token budget cut the episode short (PPO bootstraps from V(s_T) there)."""
    return traj.finish_reason in TRUNCATION_REASONS


def turn_observations(traj: Trajectory) -> list[str]:
    """The observation each turn acted on (GiGPO's anchor state): turn 0 the reset's observation
    (``first_observation``), turn k > 0 the env's reply to turn k - 1 (``observations[k - 1]``),
    as the rollout records them."""
    if traj.turns == 0:
        return []
    first, obs = traj.first_observation, traj.observations or []
    if first is None or len(obs) < traj.turns - 1:
        raise ValueError(f"trajectory of task {traj.task_id} has {traj.turns} turns but "
                         f"{'no' if first is None else 'a'} first observation and {len(obs)} observations: "
                         "the observation each turn acted on is needed (runtime.rollout records first_observation "
                         "and observations)")
    return [str(first)] + [str(o) for o in obs[: traj.turns - 1]]


def token_rewards(traj: Trajectory) -> list[float]:
    """Per-token reward: each turn's reward on that turn's last action token (never on an env token)."""
    out = [0.0] * len(traj.token_ids)
    for pos, r in zip(traj.action_ends, traj.turn_rewards):
        if traj.loss_mask[pos] != 1:
            raise ValueError(f"reward position {pos} is not a policy token")
        out[pos] += r
    return out
