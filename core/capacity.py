"""How many episodes a rollout keeps live at once, from what its env servers can hold (pure)."""

from __future__ import annotations

from typing import Sequence


def live_episode_cap(configured: int | None, capacities: Sequence[int | None]) -> int | None:
    """The rollout's cap on live episodes: the smaller of ``configured`` (``rollout.max_live_episodes``, None if
    unset) and the sum of the servers' capacities. A server with capacity None is unbounded, and so is a sum
    over it; None means no cap at all."""
    if configured is not None and configured < 1:
        raise ValueError(f"rollout.max_live_episodes must be >= 1, got {configured}")
    if any(c is not None and c < 1 for c in capacities):
        raise ValueError(f"a server capacity must be >= 1 or None (unbounded), got {list(capacities)}")
    total = None if not capacities or any(c is None for c in capacities) else sum(capacities)  # type: ignore[arg-type]
    if total is None:
        return configured
    return total if configured is None else min(configured, total)


def pick_server(capacities: Sequence[int | None], live: Sequence[int]) -> int:
    """The server a new episode goes to: the one with the most free slots (None = unbounded counts as most),
    ties to the fewest live episodes, then the lowest index. ``ValueError`` when every server is full."""
    best, key = -1, None
    for i, (c, n) in enumerate(zip(capacities, live)):
        free = float("inf") if c is None else c - n
        if free <= 0:
            continue
        k = (-free, n, i)
        if key is None or k < key:
            best, key = i, k
    if best < 0:
        raise ValueError(f"every env server is full ({list(live)} live of {list(capacities)})")
    return best
