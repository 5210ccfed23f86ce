"""The run's seeds, written once: a training step's base seed and each episode turn's sampling seed are pure
functions of the run's seed and the position, so a resumed step draws the same tasks and samples the same tokens."""

from __future__ import annotations


def step_seed(run_seed: int, global_step: int) -> int:
    """The base seed of a training step: which train tasks it draws and (through ``episode_seed``) how its
    episodes sample. A pure function of the run's seed and the global step, so a resumed step repeats exactly."""
    return run_seed * 1_000_003 + global_step


def episode_seed(base: int, episode: int, turn: int) -> int:
    """The sampling seed of one episode's turn: a pure function of the step's base seed, the episode's index in
    the batch and the turn, so it does not depend on which other episodes are still running."""
    return (base * 1_000_003 + episode * 10_007 + turn) % (2**31 - 1)


def round_seed(step_base: int, rollout_round: int) -> int:
    """The base seed of a step's extra rollout round (dynamic sampling refills groups without signal): round 0 is
    the step's own base seed; later rounds draw other tasks and samples, still a pure function of the position."""
    if rollout_round < 0:
        raise ValueError(f"rollout_round must be >= 0, got {rollout_round}")
    return step_base if rollout_round == 0 else step_base + rollout_round * 1_000_000_007
