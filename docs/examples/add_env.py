"""A new environment: "guess the number", where the horizon matters (docs/extending/add-env.md).

The agent guesses a secret number in [1, high]; the env answers "higher" or "lower". Bisection needs about
log2(high) turns, so a short turn limit caps what any policy can reach: a task for a growing curriculum.
tests/test_docs_examples.py runs ``demo()``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from envs.base import TEST_OFFSET, StepResult, register_env, split_of

_ACTION = re.compile(r"^\s*action\s*:\s*guess\s+(-?\d+)\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)


class GuessEnv:
    name = "guess"

    def __init__(self, high: int = 100, n_train: int = 1000, n_test: int = 100):
        self.high, self.n_train, self.n_test = int(high), int(n_train), int(n_test)
        self._secret, self._done, self._obs = 0, True, ""

    def instruction(self) -> str:
        return (f"I picked a whole number from 1 to {self.high}. Guess it; after each guess I say 'higher' or "
                "'lower'. End your reply with one line: Action: guess N")

    def num_tasks(self, split: str) -> int:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return self.n_train if split == "train" else self.n_test

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        split = split_of(data_idx)
        local = data_idx - (TEST_OFFSET if split == "test" else 0)
        if not 0 <= local < self.num_tasks(split):
            raise ValueError(f"data_idx {data_idx} is outside the {split} split")
        self._secret = random.Random(f"guess-{data_idx}").randint(1, self.high)  # deterministic per task
        self._done = False
        self._obs = f"Guess a number from 1 to {self.high}."
        return self._obs, {"success": False, "category": "small" if self._secret <= self.high // 2 else "large"}

    def step(self, action: str) -> StepResult:
        found = {int(n) for n in _ACTION.findall(action)}
        if len(found) != 1:  # no action, or two different ones: explained, costs nothing, no state change
            self._obs = "Invalid action. End your reply with exactly one line: Action: guess N"
            return StepResult(self._obs, 0.0, False, False, {"success": False, "invalid_action": True})
        guess = found.pop()
        if guess == self._secret:
            self._done = True
            self._obs = f"{guess} is right!"
            return StepResult(self._obs, 1.0, True, False, {"success": True})
        self._obs = f"{guess} is wrong: {'higher' if self._secret > guess else 'lower'}."
        return StepResult(self._obs, 0.0, False, False, {"success": False})

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._done = True


# What a run needs besides the env: presets (partial RunConfig dicts; docs/extending/add-preset.md).
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "curriculum": {"phases": [{"turn_limit": 3, "steps": 4}, {"turn_limit": 5, "steps": 4},
                                  {"turn_limit": 8, "steps": 4}]},
        "rollout": {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 1024},
        "algo": {"lr": 3e-5, "kl_coef": 0.0},
        "eval": {"n": 32},
    },
}

# In the repository this line goes into envs/__init__.py, with the module at envs/guess.py:
#     register_env("guess", "envs.guess:GuessEnv", presets="envs.guess:PRESETS")
register_env("guess", f"{__name__}:GuessEnv", presets=f"{__name__}:PRESETS")


def bisect(observation: str, low: int, high: int) -> tuple[int, int]:
    """An expert's bookkeeping: narrow [low, high] by the env's last answer."""
    m = re.match(r"(\d+) is wrong: (higher|lower)", observation)
    if m:
        n = int(m.group(1))
        low, high = (n + 1, high) if m.group(2) == "higher" else (low, n - 1)
    return low, high


def demo() -> dict[str, Any]:
    """Make the env through the registry, solve a task by bisection, serve it over HTTP, build a run config."""
    from fastapi.testclient import TestClient

    from envs.base import make_env, task_index
    from envs.client import EnvClient
    from envs.server import create_app
    from flows.config import build_config

    env = make_env("guess", high=100)
    obs, info = env.reset(task_index("test", 0))
    low, high, turns = 1, 100, 0
    while True:  # bisection: at most 7 turns for 100 numbers
        guess = (low + high) // 2
        r = env.step(f"Let me halve the range.\nAction: guess {guess}")
        turns += 1
        if r.terminated:
            break
        low, high = bisect(r.observation, low, high)
    assert r.info["success"] and r.reward == 1.0 and turns <= 7

    bad = env.step("I think it is 5 or 6")  # bad output never raises: it is explained
    assert bad.info["invalid_action"] and not bad.terminated

    # The generic env server hosts it like any built-in env (here in-process; `scalinginter env serve guess` once
    # it is registered in envs/__init__.py).
    with TestClient(create_app("guess", {"high": 100})) as http:
        client = EnvClient(http_client=http)
        eid = client.create()
        reply = client.reset(eid, task_index("train", 3))
        step = client.step(eid, "Action: guess 50")
        assert reply.instruction.startswith("I picked") and step.observation.startswith("50 is")
        client.close(eid)

    cfg = build_config("guess", "smoke", ["rollout.temperature=0.7"])  # what `scalinginter run guess` builds
    assert cfg.env.name == "guess" and [p.turn_limit for p in cfg.curriculum.phases] == [3, 5, 8]
    return {"turns": turns, "phases": [p.turn_limit for p in cfg.curriculum.phases]}


if __name__ == "__main__":
    print(demo())
