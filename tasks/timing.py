"""The process's wall-time ledger (``core.walltime``): ``with timed("rollout"):`` where the work happens; the parent
flow resets it at the start of a run and prints/saves ``breakdown`` at the end."""

from __future__ import annotations

import contextlib
import time

from core.walltime import WallLedger

LEDGER = WallLedger()


def reset() -> WallLedger:
    global LEDGER
    LEDGER = WallLedger()
    return LEDGER


@contextlib.contextmanager
def timed(name: str):
    LEDGER.enter(name, time.perf_counter())
    try:
        yield
    finally:
        LEDGER.exit(time.perf_counter())


def add(name: str, seconds: float) -> None:
    LEDGER.add(name, seconds)
