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
    # numbers an env reports about the episode besides its reward (``info["episode_metrics"]`` of its last step,
    # e.g. SciWorld's 0-100 score next to success = score 100, deep search's F1 next to exact match)
    extra: dict[str, list[float]] = {}
    for t in live:
        for k, v in (t.info.get("episode_metrics") or {}).items():
            extra.setdefault(k, []).append(float(v))
    for k, vals in sorted(extra.items()):
        out[f"mean_{k}"] = sum(vals) / len(vals)
    reasons = Counter(t.finish_reason for t in trajs)
    for r in FINISH_REASONS:
        out[f"finish_{r}"] = float(reasons.get(r, 0))
    return out
