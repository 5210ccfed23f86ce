"""Clients of the env HTTP server (``envs/server.py``): ``EnvClient`` (sync) and ``AsyncEnvClient``.

Errors are typed (``envs.errors``): ``UnknownEnvId`` (404), ``TooManyEnvs`` (429), ``EnvBadRequest`` (other
4xx), ``EnvServerError`` (5xx), ``EnvUnavailable`` (unreachable / timed out / died, after retries).

Retry policy: a request that never reached the server (connection refused, connect timeout, pool timeout)
is retried with exponential backoff for every call. A request that may have reached the server (read
timeout, connection dropped mid-response, 502/503/504 from a proxy) is retried only for idempotent calls
(``health``, ``reset``, ``observation``, ``close``); ``create`` and ``step`` raise ``EnvUnavailable`` with
``maybe_applied=True`` instead, so a step is never applied twice behind the caller's back. Every call has
a timeout, so a dead server gives ``EnvUnavailable`` quickly instead of a hang.

``RemoteEnv`` wraps a sync client as a ``TextEnv`` so a rollout can use local and remote envs alike.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import httpx

from envs.base import EnvReply, StepResult
from envs.errors import (
    EnvBadRequest,
    EnvError,
    EnvServerError,
    EnvUnavailable,
    TaskIndexError,
    TooManyEnvs,
    UnknownEnvId,
)

TOKEN_ENV = "SCALINGINTER_ENV_TOKEN"  # the env servers' shared token (the one definition: envs.server imports it)
_TOKENS: dict[str, str] = {}  # base URL -> token of the servers this process spawned (envs.spawn registers them)


def register_token(base_url: str, token: str) -> None:
    """Clients of ``base_url`` made from now on in this process send ``token`` (unless given another)."""
    _TOKENS[base_url.rstrip("/")] = token

_RETRY_STATUSES = (502, 503, 504)
# never reached the server: always safe to retry
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def capacity_from_health(health: Any) -> int | None:
    """How many episodes a server runs at once, from its ``/health``: the smaller of its ``capacity`` (the env's
    pool size; null for envs without a pool) and its ``max_envs``; None when it states neither (unbounded)."""
    if not isinstance(health, dict):
        return None
    caps = [health.get(k) for k in ("capacity", "max_envs")]
    caps = [int(c) for c in caps if isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 1]
    return min(caps) if caps else None


class _Base:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        health_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        token: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        token = token if token is not None else _TOKENS.get(self.base_url) or os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.health_timeout = httpx.Timeout(health_timeout_s, connect=min(connect_timeout_s, health_timeout_s))
        self.retries = max(0, int(retries))
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def _kw(self, timeout) -> dict[str, Any]:
        # a caller-supplied http_client keeps its own timeouts (FastAPI's TestClient rejects per-request ones)
        kw: dict[str, Any] = {"headers": self._headers} if self._headers else {}
        return {**kw, "timeout": timeout or self.timeout} if self._owns else kw

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2**attempt)) * (0.75 + 0.5 * random.random())

    def _plan(self, exc_or_status: BaseException | int, idempotent: bool, attempt: int) -> bool:
        """Whether to retry after this failure."""
        if attempt >= self.retries:
            return False
        if isinstance(exc_or_status, int):
            return idempotent and exc_or_status in _RETRY_STATUSES
        if isinstance(exc_or_status, _NOT_SENT):
            return True
        return idempotent and isinstance(exc_or_status, httpx.TransportError)

    def _unavailable(self, method: str, path: str, exc: BaseException, idempotent: bool, attempts: int):
        sent = not isinstance(exc, _NOT_SENT)
        kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
        return EnvUnavailable(
            f"{method} {path} {kind} after {attempts} attempt(s): {type(exc).__name__}: {exc}",
            maybe_applied=sent and not idempotent,
            url=self.base_url + path,
        )

    def _decode_reply(self, method: str, path: str, resp: httpx.Response, idempotent: bool) -> Any:
        """What ``_request`` returns for a response it will not retry (a dialect adapter overrides this)."""
        return self._decode(method, path, resp, idempotent)

    def _decode(self, method: str, path: str, resp: httpx.Response, idempotent: bool) -> Any:
        url = self.base_url + path
        if resp.is_success:
            try:
                return resp.json()
            except ValueError as exc:
                raise EnvServerError(
                    f"{method} {path}: response is not JSON: {resp.text[:200]!r}", status=resp.status_code, url=url
                ) from exc
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "error" in body:
            message, code = str(body.get("error")), body.get("code")
        else:
            message, code = (resp.text[:500] or resp.reason_phrase), None
        status = resp.status_code
        kw = {"status": status, "code": code, "url": url}
        msg = f"{method} {path}: {message}"
        if status == 404 and code in ("unknown_id", "env_closed"):
            raise UnknownEnvId(msg, **kw)
        if status == 429:
            raise TooManyEnvs(msg, **kw)
        if status == 400 and code == "bad_data_idx":
            raise TaskIndexError(msg, **kw)
        if status in _RETRY_STATUSES:
            raise EnvUnavailable(msg, maybe_applied=not idempotent, **kw)
        if 400 <= status < 500:
            raise EnvBadRequest(msg, **kw)
        raise EnvServerError(msg, **kw)

    @staticmethod
    def _step_result(d: dict[str, Any]) -> StepResult:
        return StepResult(
            observation=d["observation"],
            reward=float(d["reward"]),
            terminated=bool(d.get("terminated", d.get("done", False))),
            truncated=bool(d.get("truncated", False)),
            info=d.get("info") or {},
        )

    @staticmethod
    def _reset_result(d: dict[str, Any]) -> EnvReply:
        return EnvReply(observation=d["observation"], info=d.get("info") or {}, instruction=d.get("instruction", ""))


class EnvClient(_Base):
    """Synchronous client. ``http_client`` may be any ``httpx.Client`` (e.g. FastAPI's ``TestClient``); a
    supplied client keeps its own timeouts, otherwise ``timeout_s``/``connect_timeout_s`` apply to every call."""

    def __init__(self, base_url: str = "http://testserver", *, http_client: httpx.Client | None = None, **kw):
        super().__init__(base_url, **kw)
        self._owns = http_client is None
        self._http = http_client if http_client is not None else httpx.Client(timeout=self.timeout)

    def _request(self, method: str, path: str, *, idempotent: bool, json=None, params=None, timeout=None) -> Any:
        attempt = 0
        while True:
            try:
                resp = self._http.request(method, self.base_url + path, json=json, params=params, **self._kw(timeout))
            except httpx.TransportError as exc:
                if self._plan(exc, idempotent, attempt):
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._unavailable(method, path, exc, idempotent, attempt + 1) from exc
            if self._plan(resp.status_code, idempotent, attempt):
                time.sleep(self._delay(attempt))
                attempt += 1
                continue
            return self._decode_reply(method, path, resp, idempotent)

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", idempotent=True, timeout=self.health_timeout)

    def capacity(self) -> int | None:
        """Episodes the server runs at once (``capacity_from_health``); None: unbounded."""
        return capacity_from_health(self.health())

    def create(self) -> int:
        return int(self._request("POST", "/create", idempotent=False, json={})["id"])

    def reset(self, env_id: int, data_idx: int) -> EnvReply:
        d = self._request("POST", "/reset", idempotent=True, json={"id": env_id, "data_idx": data_idx})
        return self._reset_result(d)

    def step(self, env_id: int, action: str) -> StepResult:
        d = self._request("POST", "/step", idempotent=False, json={"id": env_id, "action": action})
        return self._step_result(d)

    def observation(self, env_id: int) -> str:
        return self._request("GET", "/observation", idempotent=True, params={"id": env_id})["observation"]

    def close(self, env_id: int) -> bool:
        return bool(self._request("POST", "/close", idempotent=True, json={"id": env_id}).get("closed", False))

    def shutdown(self) -> None:
        """Close the underlying HTTP connections (not the server's envs)."""
        if self._owns:
            self._http.close()

    def __enter__(self) -> "EnvClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class AsyncEnvClient(_Base):
    """Asyncio client; safe to share between many concurrent episodes."""

    def __init__(
        self,
        base_url: str = "http://testserver",
        *,
        http_client: httpx.AsyncClient | None = None,
        max_connections: int = 256,
        **kw,
    ):
        super().__init__(base_url, **kw)
        self._owns = http_client is None
        self._http = (
            http_client
            if http_client is not None
            else httpx.AsyncClient(
                timeout=self.timeout,
                limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            )
        )

    async def _request(self, method: str, path: str, *, idempotent: bool, json=None, params=None, timeout=None) -> Any:
        attempt = 0
        while True:
            try:
                resp = await self._http.request(
                    method, self.base_url + path, json=json, params=params, **self._kw(timeout)
                )
            except httpx.TransportError as exc:
                if self._plan(exc, idempotent, attempt):
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._unavailable(method, path, exc, idempotent, attempt + 1) from exc
            if self._plan(resp.status_code, idempotent, attempt):
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            return self._decode_reply(method, path, resp, idempotent)

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health", idempotent=True, timeout=self.health_timeout)

    async def capacity(self) -> int | None:
        """Episodes the server runs at once (``capacity_from_health``); None: unbounded."""
        return capacity_from_health(await self.health())

    async def create(self) -> int:
        return int((await self._request("POST", "/create", idempotent=False, json={}))["id"])

    async def reset(self, env_id: int, data_idx: int) -> EnvReply:
        d = await self._request("POST", "/reset", idempotent=True, json={"id": env_id, "data_idx": data_idx})
        return self._reset_result(d)

    async def step(self, env_id: int, action: str) -> StepResult:
        d = await self._request("POST", "/step", idempotent=False, json={"id": env_id, "action": action})
        return self._step_result(d)

    async def observation(self, env_id: int) -> str:
        return (await self._request("GET", "/observation", idempotent=True, params={"id": env_id}))["observation"]

    async def close(self, env_id: int) -> bool:
        d = await self._request("POST", "/close", idempotent=True, json={"id": env_id})
        return bool(d.get("closed", False))

    async def aclose(self) -> None:
        """Close the underlying HTTP connections (not the server's envs)."""
        if self._owns:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncEnvClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RemoteEnv:
    """A ``TextEnv`` backed by one env on a server. The env id is created on the first ``reset``.

    ``instruction()`` is the text the server returned with the last reset (empty before the first one).
    """

    def __init__(self, client: EnvClient, name: str = "remote"):
        self.client = client
        self.name = name
        self.env_id: int | None = None
        self._instruction = ""
        self._obs = ""

    def instruction(self) -> str:
        return self._instruction

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        if self.env_id is None:
            self.env_id = self.client.create()
        r = self.client.reset(self.env_id, data_idx)
        self._instruction, self._obs = r.instruction, r.observation
        return r.observation, r.info

    def step(self, action: str) -> StepResult:
        if self.env_id is None:
            raise RuntimeError("RemoteEnv.step() before reset()")
        res = self.client.step(self.env_id, action)
        self._obs = res.observation
        return res

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        if self.env_id is not None:
            env_id, self.env_id = self.env_id, None
            try:
                self.client.close(env_id)
            except EnvError:
                pass  # the server reaps what it cannot be told to close


__all__ = ["AsyncEnvClient", "EnvClient", "RemoteEnv", "capacity_from_health"]
