"""The text-environment contract every ScalingInter environment implements.

Environments speak Gymnasium in text: ``reset`` returns an observation and an info dict, ``step`` takes
the model's reply (or a bare action) and returns observation, reward, terminated, truncated and info.
Bad model output never raises: it becomes an explanatory observation for the agent.

Environments never know the curriculum: the turn limit is enforced by the rollout. The rollout drives an env
through ``EpisodeEnv`` (below: the same contract, one episode, async; adapters in ``envs.sessions``), and every
reply, sync or async, in-process or over HTTP, is an ``EnvReply``.
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

# data_idx space: one integer space per env, split by range so train and test never overlap.
TEST_OFFSET = 1_000_000
SPLITS = ("train", "test")


def split_of(data_idx: int) -> str:
    """Which split a task index belongs to (train: [0, 1e6), test: [1e6, ...))."""
    if data_idx < 0:
        raise ValueError(f"data_idx must be >= 0, got {data_idx}")
    return "test" if data_idx >= TEST_OFFSET else "train"


def task_index(split: str, i: int) -> int:
    """The i-th task index of a split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if not 0 <= i < TEST_OFFSET:
        raise ValueError(f"task number must be in [0, {TEST_OFFSET}), got {i}")
    return i + (TEST_OFFSET if split == "test" else 0)


_STDOUT_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_stdout():
    """Swallow what a game engine prints. ``redirect_stdout`` swaps the process-wide ``sys.stdout``, so the env
    server's worker threads take turns here; unguarded, one thread could restore another's StringIO for good."""
    with _STDOUT_LOCK, contextlib.redirect_stdout(io.StringIO()):
        yield


@dataclass
class EnvReply:
    """An env's reply, to a reset or a step (the one reply type: in-process envs, the HTTP client, the rollout)."""

    observation: str
    reward: float = 0.0
    terminated: bool = False  # the episode reached a terminal state (success or failure)
    truncated: bool = False  # cut by a step limit of the env's own, not a terminal state
    info: dict[str, Any] = field(default_factory=dict)  # a step's must hold "success": bool
    instruction: str = ""  # a reset's: the env's system-prompt text (sessions fill it in)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


StepResult = EnvReply  # the name env implementations construct their step replies with: the same type


@runtime_checkable
class TextEnv(Protocol):
    """One episode at a time; an instance is reused across episodes via ``reset``."""

    name: str

    def instruction(self) -> str:
        """System-prompt text: the task family, action format and rules."""
        ...

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        """Start the task ``data_idx`` (deterministic). Returns (observation, info)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply the model's reply or a bare action. Malformed actions give an explanatory observation."""
        ...

    def observation(self) -> str:
        """The current observation (same text as the last reset/step returned)."""
        ...

    def num_tasks(self, split: str) -> int:
        """How many distinct tasks ``split`` ("train" or "test") has; its indices are
        ``task_index(split, i)`` for i in [0, num_tasks(split)) (ValueError for another split)."""
        ...

    def close(self) -> None: ...


class EpisodeEnv(Protocol):
    """The same contract as the rollout sees it: one episode of a ``TextEnv``, asynchronously, over HTTP or
    in-process (``envs.sessions``: ``HttpEpisode``, ``PooledEpisode``, ``LocalEpisode``); every reply an
    ``EnvReply`` (a reset's with the env's ``instruction``)."""

    async def reset(self, data_idx: int) -> EnvReply: ...

    async def step(self, reply_text: str) -> EnvReply: ...

    async def close(self) -> None: ...


# --- registry (one of the two plug-in points) -------------------------------------------------------
EnvFactory = Callable[..., TextEnv]
_REGISTRY: dict[str, str] = {
    # name -> "module:factory" (imported lazily so the server only imports the env it hosts)
    "babyai": "envs.babyai.env:BabyAIEnv",
}


# name -> "module:attr" of a dict {preset name: partial RunConfig dict}; each env package owns its presets.
_PRESETS: dict[str, str] = {
    "babyai": "envs.babyai.presets:PRESETS",
}


def register_env(name: str, target: str, presets: str | None = None) -> None:
    """Register an env under ``name`` (``target``: "module:factory", imported when the env is first made). A name
    already taken by another target (or other presets) is refused; registering the same again is a no-op."""
    for table, value, what in ((_REGISTRY, target, "factory"), (_PRESETS, presets, "presets")):
        if value is not None and table.get(name, value) != value:
            raise ValueError(f"environment {name!r} is already registered with {what} {table[name]!r}; "
                             f"{value!r} needs another name")
    _REGISTRY[name] = target
    if presets is not None:
        _PRESETS[name] = presets


def env_presets(name: str) -> dict[str, dict[str, Any]]:
    """The run presets of an env (smoke, paper, ...); {} for an env without presets."""
    import envs  # noqa: F401  (registers the built-in envs)

    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(env_names())}")
    if name not in _PRESETS:
        return {}
    import importlib

    module, attr = _PRESETS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def make_env(name: str, **options: Any) -> TextEnv:
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(env_names())}")
    import importlib

    module, attr = _REGISTRY[name].split(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**options)
