"""Clients for unmodified AgentGym env servers (``agentenv-*``), with the interface of ``envs.client``.

``AgentGymClient`` / ``AsyncAgentGymClient`` have the methods of ``EnvClient`` / ``AsyncEnvClient``
(``health``, ``create``, ``reset``, ``step``, ``observation``, ``close``) and return the same
``ResetResult`` / ``StepResult``, so the rollout drives an AgentGym server like one of ours. Select them
with ``env.dialect=agentgym`` and ``env.url=http://host:port`` (``env.name`` names the AgentGym env:
babyai, textcraft, sciworld, webarena, searchqa, webshop, alfworld, ...).

What the adapter maps (see ../shared/design/prior-art.md):

* ids: every request carries both ``id`` and ``env_idx`` (servers ignore the key they do not use);
  ``/create`` may answer ``{"id": n}``, ``{"env_idx": n}``, ``{"id": n, "observation": ...}`` or a bare int.
* replies may be a dict, a bare string (an observation) or a bare bool (``/close``).
* ``/step`` answers ``observation, reward, done`` (+ ``score``): SciWorld's ``score`` (0-100) becomes the
  reward (score change / 100 per step, so the return is score / 100) and success is score 100; for the
  other envs success is a positive reward at the end (WebShop: reward 1).
* errors: AgentGym servers answer failures with HTTP 200 ``{"error": ...}`` (or a 5xx). Those are
  infrastructure failures, never an outcome: they raise ``EnvServerError`` (code ``agentgym_error``),
  which the rollout turns into a masked episode; the failed env id is closed (best effort) and the
  episode's next ``create`` gets a fresh env.
* actions: AgentGym servers take the bare action, their clients extract it from the model's reply; so do
  we (``Action:`` line; WebArena: the first fenced block; SearchQA: the reply as is). A reply without a
  well-formed action never reaches the server: it gets an explanatory observation, reward 0, not done,
  ``info["invalid_action"]``.
* AgentGym servers send no instruction; the adapter uses the env's instruction text (ours for babyai /
  textcraft / sciworld, or ``instruction=``).

The pure pieces (``decode_*``, ``extract_reply_action``, ``Dialect``) are unit-tested without a server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from envs.base import StepResult
from envs.client import AsyncEnvClient, EnvClient, ResetResult, _Base
from envs.errors import EnvServerError
from envs.react import extract_action

_FENCE = re.compile(r"```(?:[\w+-]*\n)?(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class Dialect:
    env: str
    action_format: str = "react"  # react | fenced | raw
    score_scale: float | None = None  # reward from the score change / scale (SciWorld: 100)
    success_reward: float = 0.0  # success iff done and reward > this (or >= 1 when full_reward)
    full_reward: bool = False


DIALECTS: dict[str, Dialect] = {
    "babyai": Dialect("babyai"),
    "textcraft": Dialect("textcraft"),
    "sciworld": Dialect("sciworld", score_scale=100.0),
    "webarena": Dialect("webarena", action_format="fenced"),
    "searchqa": Dialect("searchqa", action_format="raw"),
    "webshop": Dialect("webshop", full_reward=True),
    "alfworld": Dialect("alfworld"),
}


def dialect_for(env: str) -> Dialect:
    return DIALECTS.get(env, Dialect(env))


def default_instruction(env: str) -> str:
    try:
        if env == "babyai":
            from envs.babyai.env import INSTRUCTION
        elif env == "textcraft":
            from envs.textcraft.env import INSTRUCTION
        elif env == "sciworld":
            from envs.sciworld.env import INSTRUCTION
        else:
            raise ImportError
        return INSTRUCTION
    except ImportError:
        return ("You are an agent acting in a text environment. Think briefly, then end your reply with one "
                "line of the form: Action: <action>")


# --- pure decoding -------------------------------------------------------------------------------------------
def agentgym_error(path: str, body: Any, status: int | None = None, url: str | None = None) -> EnvServerError:
    msg = body.get("error") if isinstance(body, dict) else body
    return EnvServerError(f"AgentGym server error on {path}: {msg}", status=status, code="agentgym_error", url=url)


def _check(path: str, body: Any) -> Any:
    if isinstance(body, dict) and body.get("error") not in (None, "", False):
        raise agentgym_error(path, body, 200)
    return body


def decode_create(body: Any) -> tuple[int, str | None]:
    """(env id, first observation if the server sent one)."""
    body = _check("/create", body)
    if isinstance(body, bool):
        raise agentgym_error("/create", f"unexpected reply {body!r}")
    if isinstance(body, int):
        return body, None
    if isinstance(body, dict):
        for key in ("id", "env_idx", "env_id"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                obs = body.get("observation")
                return body[key], obs if isinstance(obs, str) else None
    raise agentgym_error("/create", f"no env id in reply {str(body)[:200]!r}")


def decode_observation(path: str, body: Any) -> str:
    body = _check(path, body)
    if isinstance(body, str):
        return body
    if isinstance(body, dict):
        for key in ("observation", "obs", "state"):
            if isinstance(body.get(key), str):
                return body[key]
    raise agentgym_error(path, f"no observation in reply {str(body)[:200]!r}")


def _num(x: Any, default: float = 0.0) -> float:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


@dataclass
class EpisodeState:
    """What the adapter remembers per env id (the score so far, for score-based rewards)."""

    score: float = 0.0


def decode_step(body: Any, dialect: Dialect, state: EpisodeState) -> StepResult:
    body = _check("/step", body)
    if isinstance(body, str):  # bare observation
        return StepResult(body, 0.0, False, False, {"success": False})
    if not isinstance(body, dict):
        raise agentgym_error("/step", f"unexpected reply {str(body)[:200]!r}")
    obs = decode_observation("/step", body)
    done = bool(body.get("done", False) or body.get("terminated", False))
    raw_reward = _num(body.get("reward"))
    info: dict[str, Any] = {k: v for k, v in body.items() if k not in ("observation", "reward", "done")}
    if dialect.score_scale is not None and "score" in body:
        score = max(0.0, min(dialect.score_scale, _num(body["score"])))
        reward = (score - state.score) / dialect.score_scale
        state.score = score
        success = done and score >= dialect.score_scale
        info["score"] = score
        info["episode_metrics"] = {"score": score}
    else:
        reward = raw_reward
        success = done and (raw_reward >= 1.0 if dialect.full_reward else raw_reward > dialect.success_reward)
    info["success"] = bool(success)
    return StepResult(obs, float(reward), done, bool(body.get("truncated", False)) and not done, info)


def extract_reply_action(reply: str, dialect: Dialect) -> tuple[str | None, str | None]:
    """(action to send, error) from a model reply, the way AgentGym's clients parse it."""
    if dialect.action_format == "raw":
        return (reply, None) if reply.strip() else (None, "the reply is empty")
    if dialect.action_format == "fenced":
        m = _FENCE.search(reply or "")
        if m and m.group(1).strip():
            return m.group(1).strip(), None
        return None, "no action found; put the action in a fenced code block"
    ex = extract_action(reply, lambda s: " ".join(s.strip().strip("`'\"*_").strip().split()))
    return (ex.action, None) if ex.ok else (None, ex.error)


def invalid_result(error: str, dialect: Dialect) -> StepResult:
    how = {"fenced": "put one action in a fenced code block", "raw": "answer with your action"}.get(
        dialect.action_format, "end your reply with one line 'Action: <action>'")
    return StepResult(f"Invalid action: {error}. Please {how}.", 0.0, False, False,
                      {"success": False, "invalid_action": True})


# --- clients ------------------------------------------------------------------------------------------------
class _AgentGymBase(_Base):
    def __init__(self, base_url: str, env: str, *, instruction: str | None = None, **kw):
        super().__init__(base_url, **kw)
        self.dialect = dialect_for(env)
        self.instruction = instruction if instruction is not None else default_instruction(env)
        self._state: dict[int, EpisodeState] = {}

    def _decode_reply(self, method: str, path: str, resp: httpx.Response, idempotent: bool) -> Any:
        # AgentGym servers answer bare values and plain text, and report errors as {"error"} bodies
        if resp.is_success:
            try:
                return resp.json()
            except ValueError:
                text = resp.text
                return text  # some servers answer plain text
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "error" in body and resp.status_code >= 500:
            raise agentgym_error(path, body, resp.status_code, self.base_url + path)
        return self._decode(method, path, resp, idempotent)  # typed errors for 4xx / 5xx / 502-504

    @staticmethod
    def _ids(env_id: int) -> dict[str, int]:
        return {"id": env_id, "env_idx": env_id}


class AgentGymClient(_AgentGymBase, EnvClient):
    """Sync client for an AgentGym env server (``EnvClient``'s transport and retries, the AgentGym dialect)."""

    def health(self) -> dict[str, Any]:
        body = self._request("GET", "/", idempotent=True, timeout=self.health_timeout)
        return {"status": "ok", "reply": body}

    def create(self) -> int:
        env_id, _ = decode_create(self._request("POST", "/create", idempotent=False, json={}))
        self._state[env_id] = EpisodeState()
        return env_id

    def reset(self, env_id: int, data_idx: int) -> ResetResult:
        try:
            body = self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": data_idx})
            obs = decode_observation("/reset", body)
        except EnvServerError:
            self._discard(env_id)
            raise
        self._state[env_id] = EpisodeState()
        info = {k: v for k, v in body.items() if k != "observation"} if isinstance(body, dict) else {}
        info.setdefault("success", False)
        info.setdefault("category", self.dialect.env)  # per-category eval scores: all an AgentGym reset tells
        return ResetResult(obs, info, self.instruction)

    def step(self, env_id: int, action: str) -> StepResult:
        act, err = extract_reply_action(action, self.dialect)
        if act is None:
            return invalid_result(err, self.dialect)
        try:
            body = self._request("POST", "/step", idempotent=False, json={**self._ids(env_id), "action": act})
            return decode_step(body, self.dialect, self._state.setdefault(env_id, EpisodeState()))
        except EnvServerError:
            self._discard(env_id)
            raise

    def observation(self, env_id: int) -> str:
        return decode_observation("/observation", self._request("GET", "/observation", idempotent=True,
                                                                 params=self._ids(env_id)))

    def close(self, env_id: int) -> bool:
        self._state.pop(env_id, None)
        body = _check("/close", self._request("POST", "/close", idempotent=True, json=self._ids(env_id)))
        return bool(body.get("closed", True)) if isinstance(body, dict) else bool(body)

    def _discard(self, env_id: int) -> None:
        """After an error payload the env's state is unknown: close it (best effort); the next episode creates
        a fresh env."""
        self._state.pop(env_id, None)
        try:
            self._request("POST", "/close", idempotent=True, json=self._ids(env_id))
        except Exception:  # noqa: BLE001
            pass

    def shutdown(self) -> None:
        if self._owns:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class AsyncAgentGymClient(_AgentGymBase, AsyncEnvClient):
    """Asyncio client for an AgentGym env server (what the rollout uses with ``env.dialect=agentgym``)."""

    async def health(self) -> dict[str, Any]:
        body = await self._request("GET", "/", idempotent=True, timeout=self.health_timeout)
        return {"status": "ok", "reply": body}

    async def create(self) -> int:
        env_id, _ = decode_create(await self._request("POST", "/create", idempotent=False, json={}))
        self._state[env_id] = EpisodeState()
        return env_id

    async def reset(self, env_id: int, data_idx: int) -> ResetResult:
        try:
            body = await self._request("POST", "/reset", idempotent=True,
                                       json={**self._ids(env_id), "data_idx": data_idx})
            obs = decode_observation("/reset", body)
        except EnvServerError:
            await self._discard(env_id)
            raise
        self._state[env_id] = EpisodeState()
        info = {k: v for k, v in body.items() if k != "observation"} if isinstance(body, dict) else {}
        info.setdefault("success", False)
        info.setdefault("category", self.dialect.env)  # per-category eval scores: all an AgentGym reset tells
        return ResetResult(obs, info, self.instruction)

    async def step(self, env_id: int, action: str) -> StepResult:
        act, err = extract_reply_action(action, self.dialect)
        if act is None:
            return invalid_result(err, self.dialect)
        try:
            body = await self._request("POST", "/step", idempotent=False, json={**self._ids(env_id), "action": act})
            return decode_step(body, self.dialect, self._state.setdefault(env_id, EpisodeState()))
        except EnvServerError:
            await self._discard(env_id)
            raise

    async def observation(self, env_id: int) -> str:
        body = await self._request("GET", "/observation", idempotent=True, params=self._ids(env_id))
        return decode_observation("/observation", body)

    async def close(self, env_id: int) -> bool:
        self._state.pop(env_id, None)
        body = _check("/close", await self._request("POST", "/close", idempotent=True, json=self._ids(env_id)))
        return bool(body.get("closed", True)) if isinstance(body, dict) else bool(body)

    async def _discard(self, env_id: int) -> None:
        self._state.pop(env_id, None)
        try:
            await self._request("POST", "/close", idempotent=True, json=self._ids(env_id))
        except Exception:  # noqa: BLE001
            pass

    async def aclose(self) -> None:
        if self._owns:
            await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def make_async_client(dialect: str, url: str, env: str, timeout_s: float = 60.0):
    """The async client for ``dialect`` ("scalinginter" or "agentgym")."""
    if dialect == "agentgym":
        return AsyncAgentGymClient(url, env, timeout_s=timeout_s)
    if dialect == "scalinginter":
        from envs.client import AsyncEnvClient

        return AsyncEnvClient(url, timeout_s=timeout_s)
    raise ValueError(f"unknown env dialect {dialect!r}; expected 'scalinginter' or 'agentgym'")


__all__ = ["AgentGymClient", "AsyncAgentGymClient", "DIALECTS", "Dialect", "decode_create", "decode_step",
           "extract_reply_action", "make_async_client"]
