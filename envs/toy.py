"""A tiny deterministic text env for tests and learning smoke tests: "pick the right door".

Task ``data_idx`` fixes a hall of ``n_doors`` coloured doors (a seeded permutation of colours). The prize is
behind one colour:

* ``hint=True`` (default): a note in the first observation names the colour, which varies per task, so the
  agent must read the observation and map colour -> door number.
* ``hint=False``: no note; the prize is always behind the red door, so the agent has to learn that rule from
  reward alone (random play succeeds ~1/n_doors per attempt).

The agent replies ``Action: open door N``; it may also send its whole reply, the last ``Action:`` line is
used (several ``Action:`` lines naming different actions are an invalid action). A wrong door costs an attempt (``attempts``, default 2, so episodes last one or two valid turns);
a malformed action gives an explanatory observation and costs nothing (the rollout's turn limit bounds it).
Reward 1.0 on success, 0.0 otherwise; ``info["success"]`` is always set.

Task space: train ``[0, n_train)``, test ``[TEST_OFFSET, TEST_OFFSET + n_test)``; other indices raise
``ValueError``. Two knobs exist only to exercise infrastructure: ``step_delay_s`` (sleep in each step) and
``fail_action`` (this exact action raises ``RuntimeError`` as a simulated env crash).
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from envs.base import TEST_OFFSET, StepResult, split_of

COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
_ACTION_LINE = re.compile(r"^\s*action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_OPEN_DOOR = re.compile(r"^open\s+(?:the\s+)?door\s*(?:#|no\.?\s*)?(\d+)$")


def extract_action(reply: str) -> str:
    """The action in a model reply: the last ``Action: ...`` line, else the whole (single-line) reply."""
    found = _ACTION_LINE.findall(reply)
    text = found[-1] if found else reply.strip()
    text = text.strip().strip("`'\"").strip().rstrip(".!").strip()
    return " ".join(text.lower().split())


class ToyEnv:
    name = "toy"

    def __init__(
        self,
        n_doors: int = 3,
        attempts: int = 2,
        hint: bool = True,
        n_train: int = 1000,
        n_test: int = 100,
        step_delay_s: float = 0.0,
        fail_action: str | None = None,
    ):
        if not 2 <= n_doors <= len(COLORS):
            raise ValueError(f"n_doors must be in [2, {len(COLORS)}], got {n_doors}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.n_doors = int(n_doors)
        self.attempts = int(attempts)
        self.hint = bool(hint)
        self.n_train = int(n_train)
        self.n_test = int(n_test)
        self.step_delay_s = float(step_delay_s)
        self.fail_action = fail_action.lower() if fail_action else None
        self._data_idx: int | None = None
        self._doors: list[str] = []
        self._prize = 0  # 1-based door number
        self._attempts_left = 0
        self._done = False
        self._obs = ""

    # --- TextEnv -------------------------------------------------------------------------------------
    def instruction(self) -> str:
        rule = (
            "A note in the hall tells you which colour hides the prize."
            if self.hint
            else "There is no note; you have to find out which door hides the prize."
        )
        return (
            f"You are in a hall with {self.n_doors} numbered, coloured doors. Exactly one hides a prize. "
            f"{rule} You may open a door; a wrong door costs one of your {self.attempts} attempt(s).\n"
            "Think briefly if you like, then end your reply with exactly one line of the form\n"
            "Action: open door N\n"
            f"where N is a door number from 1 to {self.n_doors}."
        )

    def num_tasks(self, split: str) -> int:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return self.n_train if split == "train" else self.n_test

    def task(self, data_idx: int) -> tuple[list[str], int]:
        """(door colours, 1-based prize door) of a task; raises ValueError outside the task space."""
        split = split_of(data_idx)
        n = self.n_train if split == "train" else self.n_test
        local = data_idx - (TEST_OFFSET if split == "test" else 0)
        if not 0 <= local < n:
            raise ValueError(
                f"data_idx {data_idx} out of range for toy {split} split "
                f"(valid: [{TEST_OFFSET if split == 'test' else 0}, {(TEST_OFFSET if split == 'test' else 0) + n}))"
            )
        rng = random.Random(f"toy-{data_idx}")
        doors = list(COLORS[: self.n_doors])
        rng.shuffle(doors)
        prize_color = rng.choice(doors) if self.hint else "red"
        return doors, doors.index(prize_color) + 1

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        doors, prize = self.task(int(data_idx))
        self._data_idx = int(data_idx)
        self._doors, self._prize = doors, prize
        self._attempts_left = self.attempts
        self._done = False
        hall = ", ".join(f"door {i} is {c}" for i, c in enumerate(doors, 1))
        note = f" A note on the wall says: the prize is behind the {doors[prize - 1]} door." if self.hint else ""
        self._obs = f"You are in a hall with {self.n_doors} doors: {hall}.{note}\n{self._status()}"
        # category (per-category eval scores): where the prize is, the door to find
        return self._obs, {"data_idx": self._data_idx, "split": split_of(self._data_idx), "success": False,
                           "category": f"door-{prize}"}

    def step(self, action: str) -> StepResult:
        if self._data_idx is None:
            raise RuntimeError("toy env: step() before reset()")
        if self._done:
            raise RuntimeError("toy env: step() after the episode ended; call reset()")
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        act = extract_action(action)
        distinct = {extract_action(line) for line in _ACTION_LINE.findall(action)} - {""}
        if len(distinct) > 1:  # two different actions in one reply: explained, no attempt spent
            self._obs = (
                f"Invalid action: one action per turn, but the reply names {len(distinct)} different actions. "
                f"Reply with a final line 'Action: open door N'.\n{self._status()}"
            )
            return self._result(0.0, terminated=False, success=False, invalid=True)
        if self.fail_action is not None and act == self.fail_action:
            raise RuntimeError(f"toy env: simulated failure on action {act!r}")
        m = _OPEN_DOOR.match(act)
        if not m or not 1 <= int(m.group(1)) <= self.n_doors:
            why = f"There is no door {m.group(1)}." if m else f"Invalid action {act!r}."
            self._obs = (
                f"{why} Reply with a final line 'Action: open door N' where N is 1 to {self.n_doors}.\n"
                + self._status()
            )
            return self._result(0.0, terminated=False, success=False, invalid=True)
        door = int(m.group(1))
        if door == self._prize:
            self._done = True
            self._obs = f"You open door {door} ({self._doors[door - 1]}) and find the prize!"
            return self._result(1.0, terminated=True, success=True)
        self._attempts_left -= 1
        if self._attempts_left <= 0:
            self._done = True
            self._obs = f"Door {door} is empty and you have no attempts left. The prize was behind door {self._prize}."
            return self._result(0.0, terminated=True, success=False)
        self._obs = f"Door {door} ({self._doors[door - 1]}) is empty.\n{self._status()}"
        return self._result(0.0, terminated=False, success=False)

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._data_idx = None
        self._done = True

    # --- helpers ---------------------------------------------------------------------------------------
    def _status(self) -> str:
        return (
            f"Attempts left: {self._attempts_left}. "
            f"Available actions: {', '.join(f'open door {i}' for i in range(1, self.n_doors + 1))}"
        )

    def _result(self, reward: float, *, terminated: bool, success: bool, invalid: bool = False) -> StepResult:
        info: dict[str, Any] = {"success": success, "attempts_left": self._attempts_left}
        if invalid:
            info["invalid_action"] = True
        return StepResult(self._obs, reward, terminated, False, info)
