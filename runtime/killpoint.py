"""Test hook (not a config key): SIGKILL this process at a named point of a run, for tests/test_kill_resume.py.

``SCALINGINTER_KILL_AT=<point>[:<n>]`` makes the process send itself SIGKILL the n-th time (default 1) it
reaches ``kill_point(<point>)``: a real kill, so no ``finally``, ``atexit`` or buffered write runs. Unset, every
call is a no-op. One line naming the point goes to file descriptor 2 first, so a test can tell where it died.

Points (in a fresh run with ``checkpoint.every_n_steps=1``, the n-th arrival is global step n, or phase n for
``register``):

- ``rollout``: a training step's rollout, at its first progress report (a turn of an episode generated and
  stepped), before the step's batch exists;
- ``update``: the policy update, after the optimizer step, before the generation engine gets the new weights;
- ``checkpoint``: a local checkpoint save, its files in the temporary directory, no manifest written yet;
- ``register``: a phase's final checkpoint and the run's ``latest`` pointer written, the model version not yet
  registered in MLflow.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "SCALINGINTER_KILL_AT"
POINTS = ("rollout", "update", "checkpoint", "register")

_arrivals: dict[str, int] = {}


def parse_kill_at(raw: str) -> tuple[str, int] | None:
    """``"update:2"`` -> ("update", 2); ``"update"`` -> ("update", 1); empty -> None. Bad values raise ValueError
    saying what is accepted."""
    raw = raw.strip()
    if not raw:
        return None
    point, sep, count = raw.partition(":")
    if point not in POINTS:
        raise ValueError(f"{KILL_ENV}={raw!r}: unknown point {point!r}; use one of {', '.join(POINTS)}, "
                         "optionally with :N (the N-th arrival), e.g. update:2")
    if not sep:
        return point, 1
    try:
        n = int(count)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{KILL_ENV}={raw!r}: {count!r} is not a positive arrival count (e.g. {point}:2)")
    return point, n


def kill_point(point: str) -> None:
    """SIGKILL this process if ``$SCALINGINTER_KILL_AT`` names this arrival at ``point``; otherwise nothing."""
    target = parse_kill_at(os.environ.get(KILL_ENV, ""))
    if target is None:
        return
    _arrivals[point] = _arrivals.get(point, 0) + 1
    if target == (point, _arrivals[point]):
        os.write(2, f"\n{KILL_ENV}: SIGKILL at {point}:{_arrivals[point]}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
