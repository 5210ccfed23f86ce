"""ScienceWorld (PyPI ``scienceworld`` 1.2.3, a Scala simulator in a JVM) as a ScalingInter text environment.

Tasks: all 30 ScienceWorld tasks, each with the train / dev / test variations ScienceWorld defines. Our
train split is every (task, train variation) pair (3592), our test split every (task, test variation) pair
(1819; ``test_split="dev"`` uses the dev variations instead). Pairs are ordered round-robin over the tasks
(the first 30 test indices are one variation of each task), so a prefix of a split covers all tasks. Train
indices wrap modulo the split size; test indices past the end are rejected. The catalog (variation lists
per task) is read from a JVM once and stored under the ScalingInter cache dir (``sciworld/catalog-*.json``).

Episode: reset shows the task description and the ``look around`` text; each step sends one action from
the reply's ``Action:`` line to the simulator and returns its text. A reply without a well-formed action,
with two different actions, or an action the simulator does not know ("No known action matches that
input.") changes nothing and is answered with the valid action templates. Ambiguous actions get the
simulator's numbered question; answering ``Action: 0`` picks the first reading (as gold paths do).

Score and reward: ScienceWorld scores 0-100 (partial credit; negative when the task is failed). Each
step's reward is the change of the score clipped to [0, 100], times ``reward_scale`` (default 0.01), so an
episode's return is its final score / 100. ``info["score"]`` is the current score (0-100);
``info["success"]`` is True only at score 100 (task completed). A failed task (score < 0) ends the episode
with success False; more than ``env_step_limit`` simulator moves truncates it.

JVMs come from the process-wide pool in ``envs.sciworld.jvm`` (capped by ``max_jvms``, reused across
episodes and envs, returned on ``close``). ``expose_gold=True`` loads tasks with their gold action path
and puts the next gold action in ``info["gold_action"]`` (for the expert in tests).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from envs.base import TEST_OFFSET, StepResult, split_of
from envs.react import default_normalize, extract_action
from envs.sciworld.jvm import get_pool

UNKNOWN = "No known action matches that input."
INSTRUCTION = (
    "You are an agent in ScienceWorld, a text simulation of science experiments. Complete the task by "
    "acting in the world. Actions include: look around, look at OBJ, open OBJ, go to LOC, pick up OBJ, "
    "move OBJ to OBJ, use OBJ on OBJ, activate OBJ, focus on OBJ, wait. Answer with one action only, "
    "for example: Action: look around"
)
CATALOG_VERSION = 1


# --- task catalog ------------------------------------------------------------------------------------------
def catalog_path() -> Path:
    from scienceworld.version import __version__

    from envs.cache import cache_root

    return cache_root() / "sciworld" / f"catalog-v{CATALOG_VERSION}-scienceworld-{__version__}.json"


def read_catalog(world) -> dict[str, dict[str, list[int]]]:
    """{task name: {"train": [...], "dev": [...], "test": [...]}} read from a JVM."""
    out = {}
    for name in sorted(world.get_task_names()):
        world.load(name, 0, "")
        out[name] = {"train": sorted(world.get_variations_train()), "dev": sorted(world.get_variations_dev()),
                     "test": sorted(world.get_variations_test())}
    return out


def round_robin(catalog: dict[str, dict[str, list[int]]], split: str, tasks: list[str]) -> list[tuple[str, int]]:
    """(task, variation) pairs of one ScienceWorld split, one variation of each task in turn."""
    lists = [(t, catalog[t][split]) for t in tasks]
    longest = max((len(v) for _, v in lists), default=0)
    return [(t, v[r]) for r in range(longest) for t, v in lists if r < len(v)]


_CATALOG: dict[str, Any] = {}
_CATALOG_LOCK = threading.Lock()


def load_catalog(pool, acquire_timeout_s: float) -> dict[str, dict[str, list[int]]]:
    with _CATALOG_LOCK:
        if "data" in _CATALOG:
            return _CATALOG["data"]
        path = catalog_path()
        data = None
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = None
        if not data:
            world = pool.acquire(acquire_timeout_s)
            try:
                data = read_catalog(world)
            except Exception:
                pool.release(world, broken=True)
                raise
            pool.release(world)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".catalog-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        _CATALOG["data"] = data
        return data


# --- the environment ---------------------------------------------------------------------------------------
class SciWorldEnv:
    name = "sciworld"

    def __init__(
        self,
        tasks: str | list[str] | None = None,
        test_split: str = "test",
        simplifications: str = "",
        env_step_limit: int = 100,
        reward_scale: float = 0.01,
        max_jvms: int = 16,
        jvm_heap_mb: int = 384,
        jvm_idle_ttl_s: float = 120.0,
        acquire_timeout_s: float = 30.0,
        expose_gold: bool = False,
    ):
        if test_split not in ("test", "dev"):
            raise ValueError(f"test_split must be 'test' or 'dev', got {test_split!r}")
        if env_step_limit < 1 or reward_scale <= 0 or jvm_heap_mb < 128:
            raise ValueError("env_step_limit must be >= 1, reward_scale > 0 and jvm_heap_mb >= 128")
        self.test_split = test_split
        self.simplifications = simplifications
        self.env_step_limit = int(env_step_limit)
        self.reward_scale = float(reward_scale)
        self.acquire_timeout_s = float(acquire_timeout_s)
        self.expose_gold = bool(expose_gold)
        self.pool = get_pool(max_jvms, [f"-Xmx{int(jvm_heap_mb)}m", "-XX:+UseSerialGC"], jvm_idle_ttl_s)
        catalog = load_catalog(self.pool, self.acquire_timeout_s)
        names = sorted(catalog)
        if tasks:
            wanted = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
            unknown = [t for t in wanted if t not in catalog]
            if unknown:
                raise ValueError(f"unknown ScienceWorld task(s) {unknown}; known: {', '.join(names)}")
            names = wanted
        self.task_names = names
        self.train = round_robin(catalog, "train", names)
        self.test = round_robin(catalog, test_split, names)
        self._world = None
        self._task: tuple[str, int] | None = None
        self._obs = ""
        self._score = 0
        self._done = False
        self._success = False
        self._gold: list[str] = []
        self._gold_pos = 0
        self._templates: list[str] = []
        self._meta: dict[str, Any] = {}

    # --- contract -----------------------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        if split == "train":
            return len(self.train)
        if split == "test":
            return len(self.test)
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")

    def task(self, data_idx: int) -> tuple[str, int]:
        """(task name, variation) of a task index; ValueError outside the task space."""
        if isinstance(data_idx, bool) or int(data_idx) != data_idx:
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}")
        data_idx = int(data_idx)
        if split_of(data_idx) == "train":
            return self.train[data_idx % len(self.train)]
        local = data_idx - TEST_OFFSET
        if local >= len(self.test):
            raise ValueError(f"data_idx {data_idx} out of range: the SciWorld test split is "
                             f"[{TEST_OFFSET}, {TEST_OFFSET + len(self.test)})")
        return self.test[local]

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        task, variation = self.task(data_idx)
        world = self._acquire()
        try:
            world.load(task, variation, self.simplifications, generateGoldPath=self.expose_gold)
            self._gold = list(world.get_gold_action_sequence()) if self.expose_gold else []
            look = str(world.server.step("look around"))
            desc = str(world.get_task_description())
            self._templates = sorted(world.get_possible_actions())
        except Exception:
            self._drop_world()
            raise
        self._task = (task, variation)
        self._gold_pos = 0
        self._score = 0
        self._done = self._success = False
        self._obs = f"{desc}\n\n{look}".strip()
        self._meta = {"data_idx": int(data_idx), "split": split_of(int(data_idx)), "task": task,
                      "variation": int(variation), "category": task}  # per-category eval scores: the task family
        return self._obs, self._info(None)

    def step(self, action: str) -> StepResult:
        if self._task is None or self._world is None:
            raise RuntimeError("SciWorldEnv.step() called before reset()")
        if self._done:
            self._obs = "The episode is over."
            return StepResult(self._obs, 0.0, True, False, {**self._info(None), "invalid_action": True})
        ex = extract_action(action if isinstance(action, str) else str(action), default_normalize)
        if not ex.ok:
            return self._invalid(f"Invalid action: {ex.error}.")
        world = self._world
        try:
            obs = str(world.server.step(ex.action)).strip()
            if obs == UNKNOWN:
                return self._invalid(f"Invalid action: no known action matches '{ex.action}'.")
            raw = int(round(100 * float(world.server.getScore())))
            completed = bool(world.server.getCompleted())
            moves = int(world.get_num_moves())
        except Exception:
            self._drop_world()
            raise
        score = max(0, min(100, raw))
        reward = (score - self._score) * self.reward_scale
        self._score = score
        if self._gold_pos < len(self._gold) and ex.action == default_normalize(self._gold[self._gold_pos]):
            self._gold_pos += 1
        failed = raw < 0
        self._success = bool(completed and score >= 100 and not failed)
        terminated = bool(completed or failed)
        truncated = bool(not terminated and moves > self.env_step_limit)
        self._done = terminated or truncated
        if self._success:
            obs += "\nTask completed (score 100)."
        elif failed:
            obs += "\nThe task failed."
        self._obs = obs
        info = self._info(ex.action)
        info["moves"] = moves
        return StepResult(obs, float(reward), terminated, truncated, info)

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        """Return the JVM to the pool (another env reuses it)."""
        world, self._world = self._world, None
        self._task = None
        if world is not None:
            self.pool.release(world)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # --- helpers ------------------------------------------------------------------------------------
    def _acquire(self):
        if self._world is not None and not self._world.alive():
            self._drop_world()
        if self._world is None:
            self._world = self.pool.acquire(self.acquire_timeout_s)
        return self._world

    def _drop_world(self) -> None:
        world, self._world = self._world, None
        if world is not None:
            self.pool.release(world, broken=True)

    def _invalid(self, why: str) -> StepResult:
        self._obs = (f"{why} Valid action templates (OBJ/LOC are things you see): {', '.join(self._templates)}. "
                     "End your reply with one line 'Action: <action>'.")
        return StepResult(self._obs, 0.0, False, False, {**self._info(None), "invalid_action": True})

    def _info(self, action: str | None) -> dict[str, Any]:
        info = {**self._meta, "success": self._success, "score": self._score, "action": action,
                "episode_metrics": {"score": float(self._score)}}
        if self.expose_gold:
            info["gold_action"] = self._gold[self._gold_pos] if self._gold_pos < len(self._gold) else None
        return info
