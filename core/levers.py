"""The levers that keep RL from making a competent agent worse, the pure part (no torch, Prefect, HTTP or disk).

- ``has_signal``: a step whose batch holds no nonzero advantage and no expert term changes nothing (no weight, no
  optimizer state): AdamW would otherwise keep moving every weight through its momentum on a step with no signal.
- ``group_has_variance`` / ``keep_groups``: dynamic sampling (DAPO): groups whose live samples all got the same
  reward carry no group-relative signal; they are dropped and fresh groups take their place, round by round.
- ``all_succeeded`` / ``solved_groups`` / ``replay_advantages``: algo.replay_solved: groups whose live samples all
  succeeded keep a gradient (the replay coefficient on their own action tokens) instead of none.
- ``mask_truncated``: episodes a turn limit or token budget cut short are left out of the policy-gradient loss
  instead of being scored as failures (DAPO's overlong filtering); they still count in their group's baseline.
- ``expert_coef_at``: the weight of the auxiliary log-likelihood of the expert's action at the states the policy
  visited (DAgger relabelling; CHORD/LUFFY's decaying SFT term), decaying over the run.
- ``relabel_turns``: which turns of an episode get the expert's reply as a target: the first ``k`` turns whose
  reply differs from the expert's (where the policy left the expert's path), earliest first.
- ``potential_shaping``: a progress reward from the expert's remaining turns, F_t = Phi(s_{t+1}) - Phi(s_t) with
  Phi = -(turns the expert needs from s): potential-based (Ng et al. 1999), so the best policy is unchanged; an
  episode's shaping sums to Phi(s_T) - Phi(s_0) (it telescopes), i.e. the progress it made.
- ``fits_turns``: task selection by horizon: a task whose expert needs more turns than the phase allows can only
  fail, so its group is all-zero advantage.
"""

from __future__ import annotations

from typing import Sequence

from core.trajectory import TRUNCATION_REASONS


def has_signal(advantages: Sequence[Sequence[float]], expert_samples: int = 0) -> bool:
    """True when a training step has something to learn from: any nonzero per-token advantage, or at least one
    expert-relabelled sample for the auxiliary term."""
    if expert_samples < 0:
        raise ValueError(f"expert_samples must be >= 0, got {expert_samples}")
    return expert_samples > 0 or any(x != 0 for row in advantages for x in row)


def _live(values: Sequence, masked: Sequence[bool] | None, what: str) -> list:
    """The values of a group's samples that are not masked (``masked`` None: all of them)."""
    masked = list(masked) if masked is not None else [False] * len(values)
    if len(masked) != len(values):
        raise ValueError(f"{len(values)} {what} but {len(masked)} mask flags")
    return [v for v, m in zip(values, masked) if not m]


def _take(rounds: Sequence[Sequence[bool]], k: int, skip: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Up to ``k`` (round, group) pairs whose flag ``rounds[r][g]`` is set, in round order, leaving out ``skip``."""
    have = set(skip)
    out: list[tuple[int, int]] = []
    for r, flags in enumerate(rounds):
        for g, ok in enumerate(flags):
            if ok and (r, g) not in have and len(out) < k:
                out.append((r, g))
    return out


def group_has_variance(rewards: Sequence[float], masked: Sequence[bool] | None = None) -> bool:
    """True when the live samples of one group did not all get the same reward (fewer than two live: False)."""
    live = [float(r) for r in _live(rewards, masked, "rewards")]
    return len(live) >= 2 and any(r != live[0] for r in live[1:])


def keep_groups(rounds: Sequence[Sequence[bool]], wanted: int) -> list[tuple[int, int]]:
    """Dynamic sampling's batch: ``rounds[r][g]`` says whether group ``g`` of rollout round ``r`` has reward variance.
    Returns the (round, group) pairs the step trains on: groups with variance in round order, at most ``wanted``;
    when fewer than ``wanted`` have variance after the last round, the step keeps those it has (an empty batch is a
    step without signal, skipped)."""
    if wanted < 1:
        raise ValueError(f"wanted must be >= 1, got {wanted}")
    return _take(rounds, wanted)


def all_failed(successes: Sequence[bool], masked: Sequence[bool] | None = None) -> bool:
    """True when a group has live samples and none of them succeeded (expert_groups completes such a group)."""
    live = [bool(x) for x in _live(successes, masked, "successes")]
    return bool(live) and not any(live)


def all_succeeded(successes: Sequence[bool], masked: Sequence[bool] | None = None) -> bool:
    """True when a group has live samples and every one of them succeeded (a task the policy already solves)."""
    live = [bool(x) for x in _live(successes, masked, "successes")]
    return bool(live) and all(live)


def solved_groups(solved: Sequence[Sequence[bool]], taken: Sequence[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    """``algo.replay_solved``'s groups: ``solved[r][g]`` says whether every live sample of group ``g`` of rollout round
    ``r`` succeeded. Returns up to ``k`` (round, group) pairs of solved groups not already in ``taken`` (the step's
    batch), in round order."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return _take(solved, k, taken)


def replay_advantages(advantages: Sequence[Sequence[float]], loss_masks: Sequence[Sequence[int]],
                      replay: Sequence[bool], coef: float) -> list[list[float]]:
    """The rows flagged in ``replay`` (episodes of a solved group) get ``coef`` on every token of their loss mask (the
    policy's own actions) and 0 elsewhere: a behaviour-cloning gradient on successes the group-relative estimator gives
    none (all its samples scored the same). The other rows are returned unchanged."""
    if not len(advantages) == len(loss_masks) == len(replay):
        raise ValueError(f"{len(advantages)} advantage rows, {len(loss_masks)} loss masks, {len(replay)} replay flags")
    if coef <= 0:
        raise ValueError(f"coef must be > 0, got {coef}")
    out = []
    for row, mask, rep in zip(advantages, loss_masks, replay):
        if rep and len(mask) != len(row):
            raise ValueError(f"an advantage row of {len(row)} tokens against a loss mask of {len(mask)}")
        out.append([coef * float(m) for m in mask] if rep else list(row))
    return out


def mask_truncated(advantages: Sequence[Sequence[float]], finish_reasons: Sequence[str]) -> list[list[float]]:
    """The advantages with every row of a truncated episode (turn limit, token budget) set to 0: no policy-gradient
    term for it, whatever its group said."""
    if len(advantages) != len(finish_reasons):
        raise ValueError(f"{len(advantages)} advantage rows but {len(finish_reasons)} finish reasons")
    return [[0.0] * len(row) if reason in TRUNCATION_REASONS else [float(x) for x in row]
            for row, reason in zip(advantages, finish_reasons)]


DECAYS = ("none", "linear")


def expert_coef_at(coef: float, decay: str, step: int, total_steps: int) -> float:
    """The auxiliary term's weight at global step ``step`` (0-based) of ``total_steps``: ``coef`` throughout
    (``none``), or falling linearly from ``coef`` at the first step to ``coef / total_steps`` at the last
    (``linear``: coef * (1 - step / total_steps))."""
    if decay not in DECAYS:
        raise ValueError(f"unknown decay {decay!r}; expected one of {DECAYS}")
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    if total_steps < 1 or not 0 <= step < total_steps:
        raise ValueError(f"step {step} is not a step of a run of {total_steps}")
    return coef if decay == "none" else coef * (1.0 - step / total_steps)


def _norm(text: str | None) -> str:
    return " ".join((text or "").split()).lower()


def relabel_turns(policy_replies: Sequence[str], expert_replies: Sequence[str | None], k: int) -> list[int]:
    """The turns (0-based) whose state gets the expert's reply as an imitation target: the first ``k`` turns where
    the expert named a reply and the policy's reply differs from it (whitespace and case aside), earliest first.
    ``expert_replies[t]`` is the expert's reply at the state turn ``t`` acted on (None: it had none); it may hold
    one more entry than there are turns (the state after the last one), which is ignored."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    out: list[int] = []
    for t, mine in enumerate(policy_replies):
        if len(out) >= k:
            break
        want = expert_replies[t] if t < len(expert_replies) else None
        if want is not None and _norm(mine) != _norm(want):
            out.append(t)
    return out


def fits_turns(required_turns: int | None, turn_limit: int) -> bool:
    """Whether a task fits a phase: its expert needs at most ``turn_limit`` turns (an unlabelled task fits)."""
    return required_turns is None or required_turns <= turn_limit


def potential_shaping(remaining: Sequence[int | None], turns: int, coef: float) -> list[float]:
    """Per-turn shaping rewards of an episode of ``turns`` turns: ``coef * (Phi(s_{t+1}) - Phi(s_t))`` with
    ``Phi(s) = -remaining[s]`` (``remaining[0]``: after reset, ``remaining[t]``: after turn ``t``). A turn whose
    state before or after has no count (None, or missing) gets 0. Undiscounted (the estimators' outcome returns
    are), so over an episode whose counts are all known the sum is ``coef * (remaining[0] - remaining[turns])``."""
    if turns < 0:
        raise ValueError(f"turns must be >= 0, got {turns}")
    out = []
    for t in range(turns):
        a = remaining[t] if t < len(remaining) else None
        b = remaining[t + 1] if t + 1 < len(remaining) else None
        out.append(0.0 if a is None or b is None else float(coef) * (float(a) - float(b)))
    return out


def invalid_action_penalties(invalid: Sequence[bool] | None, turns: int, penalty: float) -> list[float]:
    """Per-turn rewards of an episode of ``turns`` turns: ``-penalty`` on each turn whose reply the env flagged as no
    valid action (``invalid[t]``), 0 elsewhere; an episode without flags (None) or a turn past them gets 0."""
    if turns < 0:
        raise ValueError(f"turns must be >= 0, got {turns}")
    flags = list(invalid or [])
    return [-float(penalty) if t < len(flags) and flags[t] else 0.0 for t in range(turns)]
