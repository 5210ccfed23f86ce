"""Episode metrics. Masked episodes (infrastructure failures) are counted apart and never scored."""

from __future__ import annotations

from collections import Counter

from core.trajectory import FINISH_REASONS, Trajectory


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    live = [t for t in trajs if not t.masked]
    n = len(live)
    out: dict[str, float] = {
        "episodes": float(n),
        "masked_episodes": float(len(trajs) - n),
        "mean_reward": sum(t.reward for t in live) / n if n else 0.0,
        "success_rate": sum(t.success for t in live) / n if n else 0.0,
        "mean_turns": sum(t.turns for t in live) / n if n else 0.0,
        "mean_policy_tokens": sum(t.num_policy_tokens for t in live) / n if n else 0.0,
        "mean_length": sum(len(t.token_ids) for t in live) / n if n else 0.0,
    }
    # numbers an env reports about the episode besides its reward (``episode_metrics``, from its last step,
    # e.g. SciWorld's 0-100 score next to success = score 100, deep search's F1 next to exact match)
    extra: dict[str, list[float]] = {}
    for t in live:
        for k, v in (t.episode_metrics or {}).items():
            extra.setdefault(k, []).append(float(v))
    for k, vals in sorted(extra.items()):
        out[f"mean_{k}"] = sum(vals) / len(vals)
    reasons = Counter(t.finish_reason for t in trajs)
    for r in FINISH_REASONS:
        out[f"finish_{r}"] = float(reasons.get(r, 0))
    return out


DIAGNOSTICS = (  # (key, what the viewer's chart calls it): how a long-horizon run's collapse shows before success does
    ("diag/invalid_action_rate", "invalid actions (share of turns)"),
    ("diag/repeated_action_rate", "repeated action in the same state (share of turns)"),
    ("diag/reply_tokens", "reply length (tokens per turn)"),
    ("diag/turns_used_frac", "turns used / turn limit"),
    ("diag/turn_limit_frac", "episodes ending at the turn limit"),
    ("diag/zero_adv_group_frac", "groups with all-zero advantage"),
)


def _turn_lengths(t: Trajectory) -> list[int]:
    """Policy tokens of each turn (turn k: the policy tokens after turn k-1's last action token up to turn k's)."""
    out, prev = [], -1
    for end in t.action_ends:
        out.append(sum(t.loss_mask[prev + 1:end + 1]))
        prev = end
    return out


def step_diagnostics(trajs: list[Trajectory], advantages: list[list[float]] | None,
                     turn_limit: int | None) -> dict[str, float]:
    """A training step's stability diagnostics over its live episodes (see ``DIAGNOSTICS``):

    - invalid-action rate: turns the env flagged invalid (``invalid_actions``) / turns;
    - repeated-action rate: turns whose parsed action equals the turn before's and that acted on the same
      observation as the turn before (a stuck loop) / turns that have a turn before;
    - reply tokens: mean policy tokens per turn;
    - turns used / turn limit (mean over episodes) and the share of episodes that ended at the turn limit;
    - the share of groups (``group_id``) whose advantages are 0 on every policy token: no learning signal.
    Entropy comes from the update (``train/entropy``)."""
    live = [i for i, t in enumerate(trajs) if not t.masked]
    out: dict[str, float] = {}
    if not live:
        return out
    turns = invalid = repeats = with_prev = 0
    lengths: list[int] = []
    for i in live:
        t = trajs[i]
        flags = t.invalid_actions or []
        invalid += sum(bool(x) for x in flags)
        turns += t.turns
        lengths += _turn_lengths(t)
        acts = t.actions or []
        obs = [t.first_observation] + list(t.observations or [])
        for k in range(1, min(len(acts), t.turns)):
            with_prev += 1
            if acts[k] is not None and acts[k] == acts[k - 1] and k < len(obs) and obs[k] == obs[k - 1]:
                repeats += 1
    out["diag/invalid_action_rate"] = invalid / turns if turns else 0.0
    out["diag/repeated_action_rate"] = repeats / with_prev if with_prev else 0.0
    out["diag/reply_tokens"] = sum(lengths) / len(lengths) if lengths else 0.0
    if turn_limit:
        out["diag/turns_used_frac"] = sum(trajs[i].turns for i in live) / len(live) / turn_limit
    out["diag/turn_limit_frac"] = sum(trajs[i].finish_reason == "turn_limit" for i in live) / len(live)
    if advantages is not None:
        groups: dict[int, bool] = {}
        for i in live:
            t = trajs[i]
            signal = any(a != 0 for a, m in zip(advantages[i], t.loss_mask) if m)
            groups[t.group_id] = groups.get(t.group_id, False) or signal
        out["diag/zero_adv_group_frac"] = sum(not s for s in groups.values()) / len(groups)
    return out
