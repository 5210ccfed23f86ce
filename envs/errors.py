"""Typed errors of the env HTTP client and spawner.

An infrastructure failure must never look like an episode outcome: the rollout catches ``EnvUnavailable`` /
``EnvServerError`` and masks the episode instead of scoring it.
"""

from __future__ import annotations


class EnvError(Exception):
    """Base of all env-server errors. ``status``/``code`` come from the server's JSON error when there is one."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None, url: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.url = url

    def __str__(self) -> str:
        parts = [self.message]
        if self.status is not None:
            parts.append(f"[HTTP {self.status}{' ' + self.code if self.code else ''}]")
        if self.url:
            parts.append(f"({self.url})")
        return " ".join(parts)


class EnvUnavailable(EnvError):
    """The server could not be reached or answered (refused, timeout, died mid-request, 502/503/504), after retries.

    ``maybe_applied`` is True when the request may have reached the server and been applied (e.g. the server
    died during a ``step``); the episode's state is then unknown and it should be discarded.
    """

    def __init__(self, message: str, *, maybe_applied: bool = False, **kw):
        super().__init__(message, **kw)
        self.maybe_applied = maybe_applied


class UnknownEnvId(EnvError):
    """404: the env id was never issued, or was closed / reaped after being idle."""


class EnvBadRequest(EnvError):
    """A 4xx other than 404: malformed request, bad data_idx (400), step before reset / after done (409) ..."""


class TooManyEnvs(EnvBadRequest):
    """429: the server is at its ``max_envs`` limit; close envs (or wait for idle ones to be reaped)."""


class EnvServerError(EnvError):
    """5xx: the env raised or the server failed; the server keeps serving, the episode should be discarded."""


class EnvServerStartError(EnvError):
    """An env server subprocess failed to start or to become healthy in time (message holds its log tail)."""


class TaskIndexError(EnvBadRequest, ValueError):
    """A task index (``data_idx``) outside the env's task space: the run's configuration is wrong, not the env.

    Envs raise it from ``reset`` for an index past a split (it is a ``ValueError``, so in-process callers that
    catch ``ValueError`` keep working); the server answers 400 ``bad_data_idx``, and the client raises it again
    from that answer. Any other exception in ``reset`` is an env failure (500): the episode is masked.
    """

    def __init__(self, message: str, **kw):
        kw.setdefault("code", "bad_data_idx")
        super().__init__(message, **kw)


class EnvInfraError(RuntimeError):
    """The environment failed (server down, 5xx, timeout): the episode is masked, not scored."""


class EnvConfigError(ValueError):
    """The env refused what the run asked of it (e.g. a task index outside its split): a configuration error,
    raised at once rather than masked, since every episode would fail the same way."""
