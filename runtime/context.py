"""What is live while a run runs, owned in one place: ``Runtime``.

A run (the parent flow), an evaluation (``flows.evaluate``) and a warm start each open one
(``with Runtime.scope() as rt:``). It owns, for as long as it is open:

- ``engines``: the generation engine kept across the run's sessions (phases and evaluations load their weights into
  it instead of starting another; ``runtime.backends.vllm_backend.EnginePool``), shut down when the Runtime closes;
- ``sessions``: the live handles of each open phase or evaluation (``Session``: learner, generation backend, chat
  format, env servers), by key; a phase closes its own, and the Runtime closes any left open;
- ``ledger``: the wall-time ledger (``core.walltime``) that ``runtime.timing.timed`` charges.

Prefect tasks take a session key (a string), not a ``Session``: task parameters are hashed and shown in the UI.
They find the session through ``Runtime.current()``, which reads ``_OPEN`` below: **the one place in the process
that holds a handle across tasks**. Prefect runs a flow's tasks in worker threads of the flow's process, so the
stack is process-wide (a lock guards it), not a context variable. An inner ``Runtime.scope()`` (an evaluation
inside a run, a phase flow inside its parent) joins the open Runtime: one engine, one ledger, one close.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from core.chat import ChatFormat
from core.config import RunConfig
from core.walltime import WallLedger
from runtime.memory import trim_heap

if TYPE_CHECKING:  # the learner module imports torch: not at this module's import
    from runtime.backends.learner import Learner

_LOCK = threading.RLock()
_OPEN: list["Runtime"] = []  # the open Runtimes, innermost last (see the module docstring)


@dataclass
class Session:
    """One phase's or evaluation's live handles; no step's data is kept here."""

    cfg: RunConfig
    learner: "Learner | None" = None  # training; None in an evaluation
    model: Any = None
    tokenizer: Any = None
    backend: Any = None
    chat: ChatFormat | None = None
    servers: list[Any] = field(default_factory=list)


class Runtime:
    """See the module docstring. ``with Runtime() as rt:`` opens a new one; ``with Runtime.scope() as rt:`` joins
    the open one or opens a new one."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.ledger = WallLedger()
        self._engines = None
        self._closed = False

    # -- the process's open Runtimes -------------------------------------------------------------------
    @staticmethod
    def current() -> "Runtime":
        rt = Runtime.current_or_none()
        if rt is None:
            raise RuntimeError("no Runtime is open in this process: open one around the work "
                               "(`with Runtime.scope():`, as the run, evaluate and warmstart flows do)")
        return rt

    @staticmethod
    def current_or_none() -> "Runtime | None":
        with _LOCK:
            return _OPEN[-1] if _OPEN else None

    @staticmethod
    @contextlib.contextmanager
    def scope() -> Iterator["Runtime"]:
        """The open Runtime (joined: it stays open after this scope), else a new one, closed when the scope ends."""
        rt = Runtime.current_or_none()
        if rt is not None:
            yield rt
            return
        with Runtime() as rt:
            yield rt

    def __enter__(self) -> "Runtime":
        with _LOCK:
            _OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            with _LOCK:
                if self in _OPEN:
                    _OPEN.remove(self)

    # -- what it owns ------------------------------------------------------------------------------------
    @property
    def engines(self):
        """The kept generation engine's pool (created on first use: a run with the transformers backend has none)."""
        if self._engines is None:
            from runtime.backends.vllm_backend import EnginePool

            self._engines = EnginePool()
        return self._engines

    def new_ledger(self) -> WallLedger:
        """A fresh wall-time ledger for what follows (a run's breakdown starts at the run's start)."""
        self.ledger = WallLedger()
        return self.ledger

    def add_session(self, s: Session) -> str:
        key = uuid.uuid4().hex
        with _LOCK:
            self.sessions[key] = s
        return key

    def session(self, key: str) -> Session:
        with _LOCK:
            if key not in self.sessions:
                raise KeyError(f"no live session {key!r} in this Runtime")
            return self.sessions[key]

    def close_session(self, key: str) -> list[str]:
        """Stop the session's env servers, hand its engine back to the pool (kept for the next session) and close
        its learner. Every part is closed even when one fails; the failures are printed and returned."""
        with _LOCK:
            s = self.sessions.pop(key, None)
        if s is None:
            return []
        failures = self._close_parts(s)
        del s  # the last reference: the learner's weights and optimizer state are freed here (gc: any cycle too)
        gc.collect()
        trim_heap()  # and go back to the OS (runtime.memory)
        for f in failures:
            print(f"warning: closing a session: {f}", flush=True)
        return failures

    def _close_parts(self, s: Session) -> list[str]:
        failures: list[str] = []

        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every part gets its close; each failure is reported
                failures.append(f"{what}: {type(exc).__name__}: {exc}")

        for srv in s.servers:
            attempt(f"env server {srv!r}", srv.stop)
        vllm = s.backend is not None and s.cfg.rollout.backend == "vllm"
        if vllm:
            attempt("vLLM engine release", lambda: self.engines.release(s.backend))
        for obj in (s.learner,) if vllm else (s.backend, s.learner):  # DeepSpeed ranks, the transformers backend
            close = getattr(obj, "close", None)
            if close is not None:
                attempt(f"{type(obj).__name__}.close", close)
        return failures

    def close(self) -> None:
        """Close every session still open, then shut the kept engine down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for key in list(self.sessions):
                self.close_session(key)
        finally:
            if self._engines is not None:
                self._engines.shutdown()
