"""A quiet console: library chatter (vLLM and its engine processes, transformers, DeepSpeed, MLflow/alembic,
Prefect's own run bookkeeping) goes to ``<run dir>/engine.log``; the console keeps our lines (the run header, a
line per step, evaluation progress, the final table) and warnings.

``SCALINGINTER_VERBOSE=1`` leaves the console as the libraries set it up.

vLLM's engine core and worker are separate processes: they read ``VLLM_LOGGING_CONFIG_PATH`` (a logging config
written here that sends the ``vllm`` logger to the same file) and, while the engine starts, ``VLLMBackend``
points their stdout/stderr file descriptors at the file too (``engine_log_path``), so their prints, progress bars
and C++ warnings land there as well.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

ENV_LOG = "SCALINGINTER_ENGINE_LOG"
LIBRARY_LOGGERS = ("vllm", "transformers", "DeepSpeed", "deepspeed", "mlflow", "alembic", "torch.distributed",
                   "httpx", "urllib3", "accelerate", "datasets", "huggingface_hub")
_FILE_HANDLER: logging.Handler | None = None
_SAVED_ENV: dict[str, str | None] = {}
_SAVED_LOGGERS: list[tuple[logging.Logger, list[logging.Handler], bool]] = []


def verbose() -> bool:
    return os.environ.get("SCALINGINTER_VERBOSE", "").lower() in ("1", "true", "yes")


def engine_log_path() -> str | None:
    """Where engine processes should write their output (None: the console)."""
    return os.environ.get(ENV_LOG) or None


class _LibraryRecordsToFile(logging.Filter):
    """On a console handler: a record logged by library code below WARNING goes to the file instead. Our prints
    (Prefect's ``log_prints`` logs them with the caller's path, i.e. our code) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or "site-packages" not in (record.pathname or ""):
            return True
        if _FILE_HANDLER is not None:
            _FILE_HANDLER.handle(record)
        return False


def quiet_console(run_dir: Path) -> Path | None:
    """Send library logging to ``run_dir/engine.log`` from now on (this process and engine processes started
    later). Returns the log's path, or None when ``SCALINGINTER_VERBOSE`` is set."""
    global _FILE_HANDLER
    if verbose():
        return None
    restore_console()  # a second run in this process starts from the libraries' own setup
    try:  # first, so the handler transformers installs on import is one of those moved to the file
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
    except Exception:  # noqa: BLE001 - transformers is optional here
        pass
    path = Path(run_dir).resolve() / "engine.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _FILE_HANDLER = handler
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        removed = [h for h in lg.handlers
                   if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        _SAVED_LOGGERS.append((lg, removed, lg.propagate))
        for h in removed:
            lg.removeHandler(h)
        lg.addHandler(handler)
        lg.propagate = False
    # Prefect's console handlers: its own INFO bookkeeping ("Beginning flow run", "Finished in state") to the file
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if type(h).__name__ == "PrefectConsoleHandler" and not any(
                    isinstance(f, _LibraryRecordsToFile) for f in h.filters):
                h.addFilter(_LibraryRecordsToFile())
    # engine processes: vLLM's logging config and the file for their stdout/stderr
    cfg_path = path.with_name("vllm-logging.json")
    cfg_path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "mode": "a",
                              "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }))
    for k, v in (("VLLM_LOGGING_CONFIG_PATH", str(cfg_path)), ("VLLM_CONFIGURE_LOGGING", "1"), (ENV_LOG, str(path))):
        _SAVED_ENV[k] = os.environ.get(k)
        os.environ[k] = v
    return path


def restore_env(saved: dict[str, str | None]) -> None:
    """Put the environment variables in ``saved`` back as they were (None: it was unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def restore_console() -> None:
    """Undo ``quiet_console`` (the env vars point at the run directory, which may be deleted after the run)."""
    global _FILE_HANDLER
    if _FILE_HANDLER is not None:
        try:
            from transformers.utils import logging as tlog

            tlog.enable_progress_bar()
        except Exception:  # noqa: BLE001
            pass
    restore_env(_SAVED_ENV)
    _SAVED_ENV.clear()
    for lg, removed, propagate in _SAVED_LOGGERS:
        if _FILE_HANDLER is not None:
            lg.removeHandler(_FILE_HANDLER)
        for h in removed:
            lg.addHandler(h)
        lg.propagate = propagate
    _SAVED_LOGGERS.clear()
    if _FILE_HANDLER is not None:
        _FILE_HANDLER.close()
        _FILE_HANDLER = None


class redirect_fds:
    """Point this process's stdout/stderr file descriptors at ``path`` while a child process is started (it inherits
    them), then restore them. A no-op for ``path`` None."""

    def __init__(self, path: str | None):
        self.path = path
        self.saved: list[tuple[int, int]] = []

    def __enter__(self):
        if not self.path:
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for target in (1, 2):
                self.saved.append((target, os.dup(target)))
                os.dup2(fd, target)
        finally:
            os.close(fd)
        return self

    def __exit__(self, *exc):
        if self.saved:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
        for target, dup in self.saved:
            os.dup2(dup, target)
            os.close(dup)
        self.saved.clear()
        return False
