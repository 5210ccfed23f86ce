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
    ledger = LEDGER
    ledger.enter(name, time.perf_counter())
    try:
        yield
    finally:
        try:
            ledger.exit(time.perf_counter())
        except RuntimeError:  # the ledger was reset meanwhile: accounting never fails the run
            pass


def add(name: str, seconds: float) -> None:
    LEDGER.add(name, seconds)
