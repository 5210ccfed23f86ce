"""Wall-time accounting (``core.walltime``): ``with timed("rollout"):`` where the work happens charges the open
``Runtime``'s ledger (``runtime.context``); the parent flow starts a fresh ledger at the start of a run and
prints/saves its ``breakdown`` at the end. Outside any Runtime nothing is charged."""

from __future__ import annotations

import contextlib
import time

from core.walltime import WallLedger
from runtime.context import Runtime


def _ledger() -> WallLedger:
    rt = Runtime.current_or_none()
    return rt.ledger if rt is not None else WallLedger()  # outside a Runtime: charged to a ledger nobody reads


@contextlib.contextmanager
def timed(name: str):
    ledger = _ledger()
    ledger.enter(name, time.perf_counter())
    try:
        yield
    finally:
        try:
            ledger.exit(time.perf_counter())
        except RuntimeError:  # the ledger was replaced meanwhile: accounting never fails the run
            pass


def add(name: str, seconds: float) -> None:
    _ledger().add(name, seconds)
