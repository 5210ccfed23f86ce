"""Refusals: a run, an evaluation or a check that cannot go on says so in one line (what is wrong and the fix) on
stderr and exits 2, from the plain CLI and from inside the Prefect flows alike; the traceback goes to the run's log
file, and to the console only with ``SCALINGINTER_VERBOSE=1``.

A refusal is an exception of a kind whose message already names the fix: ``Refusal`` (raised here and in the flows:
an env server nobody answers, an evaluation or a step in which every episode was masked), a bad config
(``ConfigError``), an env that refused the run (``EnvConfigError``: a split it cannot hold out, an AgentGym server
whose goals differ), bad evaluation input, a model or checkpoint that is missing or damaged, a warm start that
cannot run. Anything else is a fault of ours and keeps its traceback.

``cli_refusals`` wraps a CLI command: it keeps Prefect's report of a refusal (the task's and every flow's
"Encountered exception" traceback, their "Finished in state Failed") off the console, and turns the refusal into the
one line. ``log_refusal`` is what a flow calls where it knows its run's log file.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
import sys
import traceback
from pathlib import Path
from typing import Iterator

from runtime.console import verbose

LOGGED = "_scalinginter_log"  # attribute of an exception whose traceback is in a run's log file (its path)


class Refusal(Exception):
    """The run cannot go on, for a reason the message states with its fix (one line)."""


def one_line(text: object) -> str:
    """``text`` on one line: its lines joined with "; " (with a space after one that ends in ":", ";" or ","),
    spaces folded."""
    out = ""
    for part in (" ".join(line.split()) for line in str(text).splitlines()):
        if part:
            out = part if not out else f"{out}{' ' if out.endswith((':', ';', ',')) else '; '}{part}"
    return out


def _refusal_types() -> tuple[type[BaseException], ...]:
    from core.config import ConfigError
    from envs.errors import EnvConfigError

    kinds: list[type[BaseException]] = [Refusal, ConfigError, EnvConfigError]
    for module, name in (("runtime.backends.model", "ModelNotFound"), ("flows.evaluate", "EvalInputError"),
                         ("storage.checkpoint_store", "CheckpointStoreError"), ("tasks.demos", "DemoError")):
        try:
            kinds.append(getattr(__import__(module, fromlist=[name]), name))
        except Exception:  # noqa: BLE001 - a module that cannot load raises nothing of its kinds
            pass
    return tuple(kinds)


def refusal_line(exc: BaseException | None) -> str | None:
    """The one line of a refusal (``exc`` or an exception it was raised from), None when ``exc`` is no refusal."""
    kinds = _refusal_types()
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, kinds):
            if type(exc).__name__ == "CheckpointCorrupted":
                return one_line(f"checkpoint {exc.uri} is damaged: {exc.reason}; evaluate another checkpoint (e.g. "
                                "the phase's previous step checkpoint or final) or copy this one again")
            if type(exc).__name__ in ("CheckpointStoreError", "CheckpointNotFound"):
                return one_line(f"cannot load checkpoint {exc.uri}: {exc.reason}")
            return one_line(exc)
        exc, seen = exc.__cause__, seen + 1
    return None


def masked_reason(errors: list[str]) -> str:
    """The env's reason for masked episodes, from their errors: the most common one (shortened), and how many."""
    errors = [e for e in errors if e]
    if not errors:
        return "no error recorded"
    top, n = Counter(errors).most_common(1)[0]
    text = one_line(top)
    text = text if len(text) <= 300 else text[:297] + "..."
    return text if n == len(errors) else f"{text}; {n} of {len(errors)} episodes failed so"


def check_not_all_masked(trajs: list, what: str) -> None:
    """A step or an evaluation in which every episode was masked (an env failure each time, after the rollout's
    retries) has nothing to learn or score: stop with the reason the env gave."""
    if trajs and all(t.masked for t in trajs):
        raise Refusal(f"every one of {what} {len(trajs)} episodes was masked by an env failure ("
                      f"{masked_reason([t.error for t in trajs])}); fix the env server (env.url, or the spawned "
                      "server's log) and start again")


def log_refusal(exc: BaseException, path: str | Path | None) -> None:
    """Append ``exc``'s traceback to the log file ``path`` (once per exception; a refusal or any other failure) and
    mark it as logged there."""
    if path is None or getattr(exc, LOGGED, None):
        return
    try:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a", encoding="utf-8") as f:
            line = refusal_line(exc)
            f.write(f"refused: {line}\n" if line else f"failed: {type(exc).__name__}: {one_line(exc)}\n")
            f.write("".join(traceback.format_exception(exc)))
        setattr(exc, LOGGED, str(p))
    except Exception:  # noqa: BLE001 - the log is a record; the refusal itself still reaches the console
        pass


class _PrefectRefusalRecords(logging.Filter):
    """On Prefect's console handler: a record that reports a refusal (its traceback, and the "Finished in state
    Failed" lines that follow it) goes to the log file instead of the console."""

    def __init__(self, log_path: Path | None):
        super().__init__()
        self.log_path = log_path
        self.refused = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and refusal_line(exc) is not None:
            self.refused = True
            self._to_file(record)
            return False
        if self.refused and record.name.startswith("prefect.") and "Finished in state Failed" in record.getMessage():
            self._to_file(record)
            return False
        return True

    def _to_file(self, record: logging.LogRecord) -> None:
        if self.log_path is None:
            return
        try:
            with Path(self.log_path).open("a", encoding="utf-8") as f:
                f.write(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record) + "\n")
        except OSError:
            pass


def _prefect_console_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers if type(h).__name__ == "PrefectConsoleHandler"]


@contextlib.contextmanager
def cli_refusals(log_path: str | Path | None = None) -> Iterator[None]:
    """Around a CLI command's work: a refusal raised inside (from a flow, a task or the command itself) ends the
    command with one line on stderr and exit code 2; its traceback goes to the log file it was logged to (the run's),
    else ``log_path``, and with ``SCALINGINTER_VERBOSE=1`` also to stderr. Other exceptions pass unchanged."""
    import typer

    quiet = not verbose()
    records = _PrefectRefusalRecords(Path(log_path) if log_path else None)
    handlers = _prefect_console_handlers() if quiet else []
    for h in handlers:
        h.addFilter(records)
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - only refusals are turned into the line; the rest is re-raised
        line = refusal_line(e)
        if line is None:
            raise
        log_refusal(e, log_path)
        if not quiet:
            traceback.print_exception(e, file=sys.stderr)
        typer.secho(f"error: {line}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    finally:
        for h in handlers:
            h.removeFilter(records)


__all__ = ["Refusal", "check_not_all_masked", "cli_refusals", "log_refusal", "masked_reason", "one_line",
           "refusal_line"]
