"""One generic HTTP server hosting any registered ``TextEnv`` (AgentGym endpoint names, faults fixed).

Endpoints (``env_idx`` is accepted everywhere as an alias of ``id``, the AgentGym WebArena/SearchQA dialect):

=======================  ====================================  ==================================================
``GET  /health``         -                                     ``{"status": "ok", "env", "live_envs", "capacity",
                                                               "max_envs", ...}`` (capacity: the env's pool size)
``POST /create``         a JSON object, ignored                ``{"id": n}``  (ids are never reused)
``POST /reset``          ``{"id", "data_idx"}``                ``{"observation", "reward", "done", "terminated",
                                                               "truncated", "info", "instruction"}``
``POST /step``           ``{"id", "action"}``                  ``{"observation", "reward", "done", "terminated",
                                                               "truncated", "info"}``
``GET  /observation``    ``?id=``                              ``{"observation"}``
``POST /close``          ``{"id"}``                            ``{"closed": true}``  (idempotent)
=======================  ====================================  ==================================================

Errors are real HTTP statuses with a JSON body ``{"error": message, "code": code}``:
400 ``malformed_json`` / ``bad_data_idx`` (a task index outside the env's tasks; any other reset failure is a 500);
401 ``unauthorized`` (a token is set and the request lacks it); 413 ``body_too_large``; 415 (POST bodies must be
JSON); 422 ``invalid_request`` (missing or mistyped fields; ids are strict ints) / ``action_too_long``;
404 ``unknown_id`` (never issued) / ``env_closed`` (closed or reaped) / ``not_found`` (no such route);
409 ``not_reset`` / ``episode_done`` / ``env_broken`` (the env raised; reset it); 429 ``too_many_envs``;
500 ``env_error`` / ``env_create_failed`` / ``internal_error``. The server keeps serving after env errors.

Env code is synchronous: every env call runs in a worker thread (bounded by ``workers``) under a per-env
``asyncio.Lock``, so requests on different envs run in parallel and requests on one env are serialised.
Every request touches its env's last-used time; a background reaper closes envs idle for longer than
``idle_ttl_s``, so envs of vanished clients do not leak.

Run: ``python -m envs.server --env toy --host 127.0.0.1 --port 8000 [--option key=value ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from envs.base import TEST_OFFSET, TextEnv, env_names, make_env
from envs.client import TOKEN_ENV  # the shared token clients send as "Authorization: Bearer <token>"
from envs.errors import TaskIndexError

log = logging.getLogger("envs.server")

_CLOSED_HISTORY = 100_000  # how many closed ids remember *why* they are gone (all closed ids stay unusable)
MAX_ACTION_CHARS = 131_072  # a /step action longer than this is refused (422 action_too_long)
MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413 body_too_large)
KEEP_ALIVE_S = 75  # an idle client connection is kept this long (clients drop theirs sooner: see serve())


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


# --- request bodies ----------------------------------------------------------------------------------
_ID = Field(validation_alias=AliasChoices("id", "env_idx"))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# strict: ``true`` is not env 1 and ``"1_0"`` is not 10
class IdBody(_Body):
    id: StrictInt = _ID


class ResetBody(_Body):
    id: StrictInt = _ID
    data_idx: StrictInt


class StepBody(_Body):
    id: StrictInt = _ID
    action: str


# --- env hosting ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Slot:
    id: int
    env: TextEnv
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: str = "created"  # created | running | done | broken
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False

    def touch(self) -> None:
        self.last_used = time.monotonic()


def env_capacity(env: Any) -> int | None:
    """Episodes an env of this kind can run at once in one server process: its ``episode_capacity`` attribute,
    else its pool's ``capacity`` (the browser pool's contexts, SciWorld's JVMs); None for envs without a pool."""
    cap = getattr(env, "episode_capacity", None)
    if cap is None:
        cap = getattr(getattr(env, "pool", None), "capacity", None)
    return int(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap >= 1 else None


def _jsonable(x: Any) -> Any:
    """Make env info JSON-safe (numpy scalars/arrays, tuples, sets, odd objects)."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    for attr in ("tolist", "item"):  # numpy arrays / scalars, torch tensors
        fn = getattr(x, attr, None)
        if callable(fn):
            try:
                return _jsonable(fn())
            except Exception:  # noqa: BLE001
                pass
    return str(x)


def _split_range(data_idx: int) -> tuple[str, int]:
    return ("test", TEST_OFFSET) if data_idx >= TEST_OFFSET else ("train", 0)


def _num_tasks(env: Any, split: str) -> int | None:
    try:
        return int(env.num_tasks(split))
    except Exception:  # noqa: BLE001  (an env that cannot say: its reset decides)
        return None


def _past_split(env: Any, data_idx: int) -> str | None:
    """Why ``data_idx`` lies past its split's tasks, or None when it does not (or the env cannot say)."""
    split, base = _split_range(data_idx)
    n = _num_tasks(env, split)
    if n is not None and data_idx - base >= n:
        return f"data_idx {data_idx} out of range: the {split} split has {n} task(s), [{base}, {base + n})"
    return None


def check_task_index(env: Any, data_idx: int) -> None:
    """Raise ``TaskIndexError`` for an index outside every env's task space: negative, past the test split's
    offsets, past the test split's tasks (train indices past the split wrap around in some envs: their reset
    decides)."""
    if not 0 <= data_idx < 2 * TEST_OFFSET:
        raise TaskIndexError(f"data_idx {data_idx} out of range: train is [0, {TEST_OFFSET}), "
                             f"test is [{TEST_OFFSET}, {2 * TEST_OFFSET})")
    split, _ = _split_range(data_idx)
    if split == "test" or _num_tasks(env, split) == 0:
        past = _past_split(env, data_idx)
        if past:
            raise TaskIndexError(past)


class EnvHost:
    """The live envs of one server process and the rules for using them."""

    def __init__(
        self,
        env_name: str,
        env_options: dict[str, Any] | None = None,
        *,
        max_envs: int = 256,
        idle_ttl_s: float = 600.0,
        reap_interval_s: float | None = None,
        workers: int = 32,
        preload: bool = True,
    ):
        if env_name not in env_names():
            raise KeyError(f"unknown environment {env_name!r}; registered: {', '.join(env_names())}")
        if max_envs < 1 or idle_ttl_s <= 0 or workers < 1:
            raise ValueError("max_envs and workers must be >= 1 and idle_ttl_s > 0")
        self.env_name = env_name
        self.env_options = dict(env_options or {})
        self.max_envs = max_envs
        self.idle_ttl_s = float(idle_ttl_s)
        self.reap_interval_s = (
            float(reap_interval_s) if reap_interval_s else min(max(self.idle_ttl_s / 4, 0.05), 10.0)
        )
        self.workers = workers
        self.preload = preload
        self._slots: dict[int, _Slot] = {}
        self._next_id = 0
        self._creating = 0
        self._closed: OrderedDict[int, str] = OrderedDict()
        self._spare: TextEnv | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._reaper_task: asyncio.Task | None = None
        self.created_total = self.closed_total = self.reaped_total = 0
        self.capacity: int | None = None  # episodes the env's pool holds at once (None: unbounded / not yet known)

    # lifecycle
    async def start(self) -> None:
        self._limiter = anyio.CapacityLimiter(self.workers)
        if self.preload:  # fail fast on import/option errors, and keep the env for the first /create
            self._spare = await self._run(self._make)
            self.capacity = env_capacity(self._spare)
        self._reaper_task = asyncio.create_task(self._reaper(), name="env-reaper")

    async def shutdown(self) -> None:
        if self._reaper_task is not None:
            self._reaper_task.cancel()
            try:
                await self._reaper_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        envs = [s.env for s in self._slots.values()]
        self._slots.clear()
        if self._spare is not None:
            envs.append(self._spare)
            self._spare = None
        for env in envs:
            await self._close_env(env)

    # plumbing
    def _make(self) -> TextEnv:
        return make_env(self.env_name, **self.env_options)

    async def _run(self, fn, *args):
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _gone(self, env_id: int) -> ApiError:
        if 0 <= env_id < self._next_id:
            why = self._closed.get(env_id, "closed")
            detail = f" after being idle for more than {self.idle_ttl_s:g} s" if why == "reaped" else ""
            return ApiError(404, "env_closed", f"env id {env_id} was {why}{detail}; create a new env", reason=why)
        return ApiError(404, "unknown_id", f"env id {env_id} was never created on this server")

    @asynccontextmanager
    async def _use(self, env_id: int):
        slot = self._slots.get(env_id)
        if slot is None:
            raise self._gone(env_id)
        slot.touch()
        async with slot.lock:
            if slot.closed:
                raise self._gone(env_id)
            try:
                yield slot
            finally:
                slot.touch()

    def _env_failed(self, slot: _Slot, what: str, exc: BaseException) -> ApiError:
        slot.state = "broken"
        log.error("env %d (%s) raised in %s", slot.id, self.env_name, what, exc_info=exc)
        # the exception text stays in the server log: it may hold paths, hosts or data a client should not see
        return ApiError(500, "env_error", f"the {self.env_name} env raised an error in {what} (details in the server "
                        "log); the episode is lost, reset the env or close it", id=slot.id)

    async def _close_env(self, env: TextEnv) -> None:
        try:
            await self._run(env.close)
        except Exception:  # noqa: BLE001
            log.exception("closing a %s env failed", self.env_name)

    async def _close_slot(self, slot: _Slot, reason: str) -> None:
        slot.closed = True
        self._slots.pop(slot.id, None)
        self._closed[slot.id] = reason
        while len(self._closed) > _CLOSED_HISTORY:
            self._closed.popitem(last=False)
        self.closed_total += 1
        if reason == "reaped":
            self.reaped_total += 1
        await self._close_env(slot.env)

    # reaper
    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                n = await self.reap_once()
                if n:
                    log.info("reaped %d idle env(s); %d live", n, len(self._slots))
            except Exception:  # noqa: BLE001
                log.exception("reaper pass failed")

    async def reap_once(self) -> int:
        """Close every env idle for longer than ``idle_ttl_s`` and not in use. Returns how many."""
        n = 0
        for slot in list(self._slots.values()):
            if slot.closed or slot.lock.locked() or time.monotonic() - slot.last_used <= self.idle_ttl_s:
                continue
            async with slot.lock:  # free, so acquired without yielding: no request can slip in between
                if not slot.closed:
                    await self._close_slot(slot, "reaped")
                    n += 1
        return n

    # operations
    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "env": self.env_name,
            "pid": os.getpid(),
            # set by the spawner (process or container): tells this server from another one on a reused port
            "instance": os.environ.get("SCALINGINTER_INSTANCE"),
            "live_envs": len(self._slots),
            "max_envs": self.max_envs,
            # how many episodes this server runs at once: its env's pool size (browser contexts, JVMs), null for
            # envs without one (then only max_envs bounds it); the rollout caps its live episodes to the sum
            "capacity": self.capacity,
            "idle_ttl_s": self.idle_ttl_s,
            "created_total": self.created_total,
            "closed_total": self.closed_total,
            "reaped_total": self.reaped_total,
        }

    async def create(self) -> dict[str, Any]:
        if len(self._slots) + self._creating >= self.max_envs:
            await self.reap_once()
            if len(self._slots) + self._creating >= self.max_envs:
                raise ApiError(
                    429,
                    "too_many_envs",
                    f"{len(self._slots)} live envs, the limit is max_envs={self.max_envs}; close envs you no "
                    f"longer use (idle envs are reaped after {self.idle_ttl_s:g} s)",
                )
        self._creating += 1
        try:
            env, self._spare = self._spare, None
            if env is None:
                env = await self._run(self._make)
            if self.capacity is None:  # not preloaded: the first env tells
                self.capacity = env_capacity(env)
        except Exception as exc:  # noqa: BLE001
            log.exception("creating a %s env failed", self.env_name)
            raise ApiError(
                500, "env_create_failed", f"creating a {self.env_name} env failed (details in the server log)"
            ) from exc
        finally:
            self._creating -= 1
        env_id = self._next_id
        self._next_id += 1
        self._slots[env_id] = _Slot(env_id, env)
        self.created_total += 1
        return {"id": env_id}

    async def reset(self, env_id: int, data_idx: int) -> dict[str, Any]:
        async with self._use(env_id) as slot:

            def work():
                check_task_index(slot.env, data_idx)
                try:
                    obs, info = slot.env.reset(data_idx)
                except TaskIndexError:
                    raise
                except ValueError as exc:  # a non-wrapping env refusing a train index past its split
                    past = _past_split(slot.env, data_idx)
                    if past:
                        raise TaskIndexError(past) from exc
                    raise
                return obs, info, slot.env.instruction()

            try:
                obs, info, instruction = await self._run(work)
            except TaskIndexError as exc:
                slot.state = "created"
                raise ApiError(400, "bad_data_idx", f"reset({data_idx}) rejected: {exc.message}", id=env_id) from exc
            except Exception as exc:  # noqa: BLE001  (any other failure, ValueError included, is the env's)
                raise self._env_failed(slot, f"reset({data_idx})", exc) from exc
            slot.state = "running"
            return {
                "observation": str(obs),
                "reward": 0.0,
                "done": False,
                "terminated": False,
                "truncated": False,
                "info": _jsonable(info or {}),
                "instruction": str(instruction),
            }

    def _check_running(self, slot: _Slot, what: str) -> None:
        if slot.state == "created":
            raise ApiError(409, "not_reset", f"env {slot.id}: {what} before reset; call /reset first", id=slot.id)
        if slot.state == "broken":
            raise ApiError(
                409, "env_broken", f"env {slot.id} raised an error earlier; call /reset (or close it)", id=slot.id
            )

    async def step(self, env_id: int, action: str) -> dict[str, Any]:
        async with self._use(env_id) as slot:
            self._check_running(slot, "step")
            if slot.state == "done":
                raise ApiError(
                    409, "episode_done", f"env {env_id}: the episode is over; call /reset to start another", id=env_id
                )
            try:
                res = await self._run(slot.env.step, action)
                out = {
                    "observation": str(res.observation),
                    "reward": float(res.reward),
                    "done": bool(res.terminated or res.truncated),
                    "terminated": bool(res.terminated),
                    "truncated": bool(res.truncated),
                    "info": _jsonable(res.info or {}),
                }
            except Exception as exc:  # noqa: BLE001
                raise self._env_failed(slot, "step", exc) from exc
            if not math.isfinite(out["reward"]):
                raise self._env_failed(slot, "step", ValueError(f"non-finite reward {out['reward']}"))
            if out["done"]:
                slot.state = "done"
            return out

    async def observation(self, env_id: int) -> dict[str, Any]:
        async with self._use(env_id) as slot:
            self._check_running(slot, "observation")
            try:
                obs = await self._run(slot.env.observation)
            except Exception as exc:  # noqa: BLE001
                raise self._env_failed(slot, "observation", exc) from exc
            return {"observation": str(obs)}

    async def close(self, env_id: int) -> dict[str, Any]:
        slot = self._slots.get(env_id)
        if slot is None:
            if 0 <= env_id < self._next_id:  # already closed or reaped: closing is idempotent
                return {"closed": True, "already_closed": True}
            raise self._gone(env_id)
        async with slot.lock:  # waits for an in-flight call on this env
            if slot.closed:
                return {"closed": True, "already_closed": True}
            await self._close_slot(slot, "closed")
        return {"closed": True}


# --- the app ------------------------------------------------------------------------------------------
class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: a lone surrogate (from a client's ``"\\ud800"`` echoed in an observation) becomes
    U+FFFD instead of a UnicodeEncodeError that would turn the reply into a 500 and drop the connection."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").encode("utf-8")


def _error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    return SafeJSONResponse({"error": message, "code": code, **extra}, status_code=status)


def _no_surrogates(text: str) -> str:
    """Lone surrogates (valid JSON escapes, invalid Unicode) replaced by U+FFFD, so env code never sees them."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RequestGuard:
    """ASGI middleware in front of every route: the shared token (when set; ``GET /health`` is exempt so probes
    and the spawner's health check work), JSON-only POST bodies (a web page cannot send ``application/json``
    cross-origin without a preflight this server never grants), and a bound on the body size (413)."""

    def __init__(self, app: Any, *, token: str | None, max_body_bytes: int):
        self.app = app
        self.token = token.encode() if token else None
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"] == "POST":
            body, refusal = await self._read_body(headers, receive)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers) -> JSONResponse | None:
        if self.token is not None and not (scope["method"] == "GET" and scope["path"] == "/health"):
            given = headers.get("authorization", b"")
            scheme, _, value = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                return _error(401, "unauthorized", f"this env server needs its token: send 'Authorization: Bearer "
                              f"<token>' (the clients read {TOKEN_ENV})")
        if scope["method"] == "POST":
            ctype = headers.get("content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return _error(415, "unsupported_media_type", "POST bodies must be JSON: send "
                              "'Content-Type: application/json' and a JSON object (e.g. {} for /create)")
        return None

    async def _read_body(self, headers, receive) -> tuple[bytes, JSONResponse | None]:
        too_big = _error(413, "body_too_large", f"the request body is larger than {self.max_body_bytes} bytes "
                         f"(actions are limited to {MAX_ACTION_CHARS} characters by default)")
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return b"", _error(400, "bad_content_length", "Content-Length is not a number")
            if int(declared) > self.max_body_bytes:
                return b"", too_big
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", too_big
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(chunks), None


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body already read, then the connection's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(
    env_name: str,
    env_options: dict[str, Any] | None = None,
    max_envs: int = 256,
    idle_ttl_s: float = 600,
    *,
    reap_interval_s: float | None = None,
    workers: int = 32,
    preload: bool = True,
    token: str | None = None,
    max_action_chars: int = MAX_ACTION_CHARS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """A FastAPI app hosting envs of ``env_name`` (built with ``make_env(env_name, **env_options)``).

    ``token``: when set, every request but ``GET /health`` must carry ``Authorization: Bearer <token>``.
    """
    if max_action_chars < 1 or max_body_bytes < 1024:
        raise ValueError("max_action_chars must be >= 1 and max_body_bytes >= 1024")
    host = EnvHost(
        env_name,
        env_options,
        max_envs=max_envs,
        idle_ttl_s=idle_ttl_s,
        reap_interval_s=reap_interval_s,
        workers=workers,
        preload=preload,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await host.start()
        try:
            yield
        finally:
            await host.shutdown()

    # no /docs, /redoc or /openapi.json: the protocol is documented in this module, not served to strangers
    app = FastAPI(title=f"ScalingInter env server ({env_name})", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, default_response_class=SafeJSONResponse)
    app.state.host = host
    app.add_middleware(RequestGuard, token=token, max_body_bytes=max_body_bytes)

    _install_error_handlers(app)
    _install_routes(app, host, max_action_chars)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error reply is ``{"error", "code", ...}`` JSON: our ApiErrors, FastAPI's validation errors (400 for
    JSON that does not parse, else 422), Starlette's 404/405, and a 500 without exception text for the rest."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.code, exc.message, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        if any(e["type"] == "json_invalid" for e in errs):
            return _error(400, "malformed_json", "request body is not valid JSON", details=errs)
        summary = "; ".join(f"{'.'.join(e['loc'][1:]) or e['loc'][0] if e['loc'] else '?'}: {e['msg']}" for e in errs)
        return _error(422, "invalid_request", f"invalid request: {summary}", details=errs)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return _error(exc.status_code, code, f"{exc.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(500, "internal_error", "internal server error (details in the server log)")


def _install_routes(app: FastAPI, host: EnvHost, max_action_chars: int) -> None:
    """The protocol's endpoints: /health, /create, /reset, /step, /observation, /close over ``host``."""

    @app.get("/health")
    async def health():
        return host.health()

    @app.post("/create")
    async def create(request: Request):
        try:  # a JSON object is required (and ignored): see RequestGuard
            body = json.loads(await request.body())
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
            body = None
        if not isinstance(body, dict):
            raise ApiError(400, "malformed_json", "/create takes a JSON object body, e.g. {}")
        return await host.create()

    @app.post("/reset")
    async def reset(body: ResetBody):
        return await host.reset(body.id, body.data_idx)

    @app.post("/step")
    async def step(body: StepBody):
        if len(body.action) > max_action_chars:
            raise ApiError(422, "action_too_long", f"the action has {len(body.action)} characters; this server "
                           f"takes at most {max_action_chars} (--max-action-chars): send a shorter reply")
        return await host.step(body.id, _no_surrogates(body.action))

    @app.get("/observation")
    async def observation(id: str | None = Query(None), env_idx: str | None = Query(None)):  # noqa: A002
        raw = id if id is not None else env_idx
        if raw is None:
            raise ApiError(422, "invalid_request", "invalid request: query parameter 'id' (or 'env_idx') is required")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            raise ApiError(422, "invalid_request", "invalid request: id must be a non-negative integer in digits")
        return await host.observation(int(raw))

    @app.post("/close")
    async def close(body: IdBody):
        return await host.close(body.id)


# --- running it -----------------------------------------------------------------------------------------
def _watch_parent(server, parent_pid: int) -> None:
    """Stop the server when the process that spawned it goes away (so crashed trainers leave no orphans)."""

    def loop():
        while not server.should_exit:
            if os.getppid() != parent_pid:
                log.warning("parent process %d is gone; shutting down", parent_pid)
                server.should_exit = True
                return
            time.sleep(1.0)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def serve(
    env_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    env_options: dict[str, Any] | None = None,
    *,
    max_envs: int = 256,
    idle_ttl_s: float = 600,
    reap_interval_s: float | None = None,
    workers: int = 32,
    log_level: str = "warning",
    parent_pid: int | None = None,
    token: str | None = None,
    max_action_chars: int = MAX_ACTION_CHARS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> None:
    """Run the server for ``env_name`` with uvicorn (blocks until shut down).

    ``token`` (default: ``$SCALINGINTER_ENV_TOKEN``) is required to bind anything but a loopback address.
    """
    import uvicorn

    token = token or os.environ.get(TOKEN_ENV) or None
    if not token and not is_loopback(host):
        sys.exit(f"error: refusing to serve on {host} (not a loopback address) without a shared token; pass "
                 f"--token or set {TOKEN_ENV} (clients send it), or bind 127.0.0.1")
    app = create_app(
        env_name, env_options, max_envs, idle_ttl_s, reap_interval_s=reap_interval_s, workers=workers, token=token,
        max_action_chars=max_action_chars, max_body_bytes=max_body_bytes,
    )
    # idle keep-alive connections are held longer than clients keep them (httpx: 5 s), so a client never sends on a
    # connection the server is closing ("Server disconnected without sending a response"); at uvicorn's default, equal
    # to httpx's, that race lost 2 in 14 steps sent after ~5 s idle through Docker's port proxy
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = uvicorn.Server(config)
    if parent_pid:
        _watch_parent(server, parent_pid)
    server.run()
    if not server.started:  # e.g. port in use or lifespan startup failed
        sys.exit(3)


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    try:
        value = json.loads(raw)  # numbers, true/false, null, lists, quoted strings
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.server", description="Serve a registered TextEnv over HTTP.")
    p.add_argument("--env", required=True, help=f"registered env name ({', '.join(env_names())})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="env constructor option (value parsed as JSON when possible); repeatable")
    p.add_argument("--options-json", default=None, help="env constructor options as one JSON object")
    p.add_argument("--max-envs", type=int, default=256)
    p.add_argument("--idle-ttl", type=float, default=600.0, help="seconds before an idle env is reaped")
    p.add_argument("--reap-interval", type=float, default=None)
    p.add_argument("--workers", type=int, default=32, help="max env calls running at once (threads)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    p.add_argument("--token", default=None,
                   help=f"shared token clients must send (default: ${TOKEN_ENV}); required off loopback")
    p.add_argument("--max-action-chars", type=int, default=MAX_ACTION_CHARS, help="longest /step action (422 beyond)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body (413 beyond)")
    a = p.parse_args(argv)
    options: dict[str, Any] = json.loads(a.options_json) if a.options_json else {}
    options.update(dict(a.option))
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(
        a.env,
        a.host,
        a.port,
        options,
        max_envs=a.max_envs,
        idle_ttl_s=a.idle_ttl,
        reap_interval_s=a.reap_interval,
        workers=a.workers,
        log_level=a.log_level,
        parent_pid=a.parent_pid,
        token=a.token,
        max_action_chars=a.max_action_chars,
        max_body_bytes=a.max_body_bytes,
    )


if __name__ == "__main__":
    main()
