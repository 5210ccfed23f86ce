"""BabyAI (minigrid) levels as a ScalingInter text environment.

Task index -> task: ``level = levels[data_idx % L]``; the seed is ``data_idx`` for train indices and
``TEST_SEED_BASE + (data_idx - TEST_OFFSET)`` for test indices, so train seeds are in [0, 1e6) and test
seeds in [1e9, 1e9 + 1e6): train and test worlds never share a seed. Valid indices are
``[0, 2 * TEST_OFFSET)``; anything else is a ValueError.

Each turn the model sends one action phrase. Primitive actions map to one minigrid step; macro actions
("go to red ball 1", "pick up red ball 1", "open blue door 1", "go through blue door 1") are planned with
BFS and run as a sequence of primitive minigrid steps, each counting against minigrid's ``max_steps``.
Only currently possible actions are listed; "pick up <object>" macros are listed only when the mission
is about picking up or putting objects (the bare "pick up" primitive stays available when facing an
object), which keeps observations short in the go-to levels.
Reward, termination and truncation are minigrid's own.

The expert (``envs.babyai.expert``: minigrid's ``BabyAIBot``, its subgoals phrased as this env's macros where
one fits, else its primitive) labels every task at reset with ``info["required_turns"]``, the turns it takes
to solve the task with these actions (option ``label_turns``; cached per (level, seed)), and names its next
action for the current state in ``info["expert_action"]`` after every reset and step (option
``expert_hints``; None once it gave up or the episode is over). With option ``label_remaining`` it also reports
``info["expert_remaining_turns"]`` after every reset and step: the turns the expert, replanned from the current
state, needs from there (0 once the mission is accomplished, None when it cannot finish or the episode ended
otherwise): the potential of progress-reward shaping. None of these change observations or rewards.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI-* gymnasium ids)

from envs.base import TEST_OFFSET, StepResult, quiet_stdout, split_of
from envs.babyai import planner
from envs.babyai.expert import ExpertDriver, solve
from envs.babyai.parse import normalize, parse_action
from envs.babyai.render import ObjView, describe_ahead, render_invalid, render_observation

DEFAULT_LEVELS = (
    "GoToRedBallGrey",
    "GoToRedBall",
    "GoToObj",
    "GoToLocal",
    "GoToDoor",
    "PickupLoc",
    "PickupDist",
    "OpenDoor",
)
TEST_SEED_BASE = 1_000_000_000  # test seeds live in [1e9, 1e9 + 1e6); train seeds in [0, 1e6)
MAX_DATA_IDX = 2 * TEST_OFFSET  # exclusive
LABEL_CACHE_SIZE = 65_536  # (level, seed) -> required turns, per env instance

PICKABLE = ("ball", "key", "box")
_NOT_OBJECTS = ("wall", "empty", "unseen", "floor", "agent")

# Short and concrete: SmolLM2-135M copies long instructions or worked examples back instead of answering
# (measured with bench/babyai_base_success.py). The example action is a primitive so it hints at no object.
INSTRUCTION = (
    "You play a grid world game. 'go to <object>' walks you to that object. "
    "Answer with one action only, for example: Action: turn left"
)


# --- level names ------------------------------------------------------------------------------------
def _babyai_ids() -> dict[str, str]:
    """lower-case short name -> full gymnasium id (highest version wins)."""
    out: dict[str, tuple[int, str]] = {}
    for env_id in gym.registry:
        m = re.fullmatch(r"BabyAI-(.+)-v(\d+)", env_id)
        if m:
            key, ver = m.group(1).lower(), int(m.group(2))
            if key not in out or ver > out[key][0]:
                out[key] = (ver, env_id)
    return {k: v for k, (_, v) in out.items()}


def resolve_level(name: str) -> str:
    """'GoToObj', 'BabyAI-GoToObj-v0', 'gotoobj' -> 'BabyAI-GoToObj-v0'."""
    raw = name.strip()
    if raw in gym.registry and raw.startswith("BabyAI-"):
        return raw
    key = re.sub(r"^babyai-", "", raw, flags=re.IGNORECASE)
    key = re.sub(r"-v\d+$", "", key).lower()
    ids = _babyai_ids()
    if key not in ids:
        raise ValueError(f"unknown BabyAI level {name!r}; e.g. {', '.join(DEFAULT_LEVELS)}")
    return ids[key]


def short_name(level_id: str) -> str:
    return re.sub(r"^BabyAI-|-v\d+$", "", level_id)


def parse_levels(levels: list[str] | tuple[str, ...] | str | None) -> list[str]:
    if levels is None:
        names: list[str] = list(DEFAULT_LEVELS)
    elif isinstance(levels, str):
        names = [p for p in (s.strip() for s in levels.split(",")) if p]
    else:
        names = [str(p).strip() for p in levels if str(p).strip()]
    if not names:
        raise ValueError("levels must name at least one BabyAI level")
    return [resolve_level(n) for n in names]


def task_of(data_idx: int, num_levels: int) -> tuple[int, int]:
    """data_idx -> (level position, seed). Train and test seeds come from disjoint ranges."""
    if isinstance(data_idx, bool) or not isinstance(data_idx, int):
        try:
            as_int = int(data_idx)  # numpy integers
        except (TypeError, ValueError):
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}") from None
        if as_int != data_idx or isinstance(data_idx, (bool, float)):
            raise ValueError(f"data_idx must be an integer, got {data_idx!r}")
        data_idx = as_int
    if not 0 <= data_idx < MAX_DATA_IDX:
        raise ValueError(
            f"data_idx {data_idx} out of range: train is [0, {TEST_OFFSET}), test is [{TEST_OFFSET}, {MAX_DATA_IDX})"
        )
    level_pos = data_idx % num_levels
    # One seed per index (not per index // L): levels built on the same generator (GoToRedBall, GoToLocal,
    # ...) would otherwise lay out identical worlds for neighbouring indices.
    if split_of(data_idx) == "train":
        seed = data_idx
    else:
        seed = TEST_SEED_BASE + (data_idx - TEST_OFFSET)
    return level_pos, seed


# --- the environment --------------------------------------------------------------------------------
@dataclass
class _Known:
    obj: Any  # the minigrid WorldObj (identity is what keeps names stable)
    name: str  # "red ball 1"
    pos: tuple[int, int]  # last known position
    visible: bool = False


@dataclass
class _Option:
    kind: str  # "prim" or "macro"
    plan: list[int]  # primitive minigrid actions
    target: Optional[_Known] = None


def _flag(value: Any, name: str) -> bool:
    """A boolean option (also 'true'/'false'/'1'/'0' from a command line or query string)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


class BabyAIEnv:
    name = "babyai"

    def __init__(self, levels: list[str] | str | None = None, max_steps: int | None = None,
                 label_turns: bool = True, expert_hints: bool = True, label_remaining: bool = False):
        self.levels = parse_levels(levels)
        if max_steps is not None and (isinstance(max_steps, bool) or int(max_steps) < 1):
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        self.max_steps = int(max_steps) if max_steps is not None else None
        self.label_turns = _flag(label_turns, "label_turns")  # info["required_turns"] at reset
        self.expert_hints = _flag(expert_hints, "expert_hints")  # info["expert_action"] after reset and step
        self.label_remaining = _flag(label_remaining, "label_remaining")  # info["expert_remaining_turns"]
        self._driver: Optional[ExpertDriver] = None
        self._expert_next: Optional[str] = None
        self._labels: OrderedDict[tuple[str, int], Optional[int]] = OrderedDict()
        self._sim: Optional["BabyAIEnv"] = None  # the labeller's own env (same levels and step limit)
        self.label_failures = 0  # resets whose task the expert did not solve (no required_turns)
        self._envs: dict[str, Any] = {}
        self._env: Any = None
        self._obs = ""
        self._known: list[_Known] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._options: dict[str, _Option] = {}
        self._unreachable: dict[str, str] = {}
        self._over = False
        self._terminated = False
        self._truncated = False
        self._success = False
        self._meta: dict[str, Any] = {}
        self._pickup_macros = True

    # -- contract ------------------------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        """Every index of a split is a distinct (level, seed) task: 1e6 per split."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return TEST_OFFSET

    def task(self, data_idx: int) -> tuple[str, int]:
        """(gymnasium level id, seed) of a task index."""
        pos, seed = task_of(data_idx, len(self.levels))
        return self.levels[pos], seed

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        level, seed = self.task(data_idx)
        self._begin(level, seed, int(data_idx))
        if self.label_turns:
            turns = self.required_turns(level, seed)
            if turns is not None:
                self._meta["required_turns"] = turns
        info = self._info(valid=True, action=None, turn_steps=0)
        if self.label_remaining:
            info["expert_remaining_turns"] = (self._meta["required_turns"] if "required_turns" in self._meta
                                              else self.remaining_turns())
        return self._obs, info

    def remaining_turns(self) -> Optional[int]:
        """Turns the expert needs from the current state (0: the mission is accomplished; None: it cannot finish,
        or the episode ended without success), by replanning on a copy of this env."""
        if self._over:
            return 0 if self._success else None
        import copy

        held = self._sim, self._labels, self._envs  # the copy needs only the current level's env
        self._sim, self._labels, self._envs = None, OrderedDict(), {}
        try:
            twin = copy.deepcopy(self)
        finally:
            self._sim, self._labels, self._envs = held
        twin.label_turns = twin.label_remaining = False
        if twin._driver is None:
            twin._driver = ExpertDriver(twin)
            twin._expert_next = twin._driver.next_action()
        twin.expert_hints = True
        turns, _ = solve(twin)
        return turns

    def required_turns(self, level: str, seed: int) -> Optional[int]:
        """Turns the expert takes to solve (level, seed) with this env's actions (None: it did not), by playing
        the task on a second env instance; cached."""
        key = (level, int(seed))
        if key in self._labels:
            self._labels.move_to_end(key)
            return self._labels[key]
        if self._sim is None:
            self._sim = BabyAIEnv(self.levels, self.max_steps, label_turns=False, expert_hints=True)
        self._sim._begin(level, int(seed), -1)
        turns, _ = solve(self._sim)
        if turns is None:
            self.label_failures += 1
        self._labels[key] = turns
        if len(self._labels) > LABEL_CACHE_SIZE:
            self._labels.popitem(last=False)
        return turns

    def expert_next_action(self) -> Optional[str]:
        """The expert's next action phrase for the current state (None: no hints, gave up, or episode over)."""
        return self._expert_next

    def _begin(self, level: str, seed: int, data_idx: int) -> None:
        """Reset the minigrid env of ``level`` with ``seed`` and this env's episode state."""
        env = self._envs.get(level)
        if env is None:
            env = gym.make(level, disable_env_checker=True).unwrapped
            self._envs[level] = env
        # level generation prints rejection-sampling notes on stdout; keep the server's stdout clean
        with quiet_stdout():
            env.reset(seed=seed)
        if self.max_steps is not None:
            env.max_steps = self.max_steps
        self._env = env
        self._pickup_macros = "pick up" in env.mission or "put " in env.mission
        self._known, self._counts = [], {}
        self._over = self._terminated = self._truncated = self._success = False
        self._meta = {"level": level, "seed": seed, "data_idx": int(data_idx),
                      "split": split_of(int(data_idx)) if data_idx >= 0 else None,
                      "mission": env.mission, "max_steps": env.max_steps,
                      "category": short_name(level)}  # per-category eval scores: the level
        self._refresh()
        self._driver = ExpertDriver(self) if self.expert_hints else None
        self._expert_next = self._driver.next_action() if self._driver is not None else None
        self._obs = self._render(None)

    def step(self, action: str) -> StepResult:
        if self._env is None:
            raise RuntimeError("BabyAIEnv.step() called before reset()")
        if self._over:
            self._obs = "The episode is over."
            return StepResult(self._obs, 0.0, self._terminated, self._truncated,
                              self._info(valid=False, action=None, turn_steps=0))

        parsed = parse_action(action if isinstance(action, str) else str(action), list(self._options))
        if not parsed.ok:
            error = self._explain_unreachable(action) or parsed.error or "invalid action"
            self._obs = render_invalid(error, list(self._options))
            info = {**self._info(valid=False, action=None, turn_steps=0), "invalid_action": True}
            return StepResult(self._obs, 0.0, False, False, info)

        phrase = parsed.action
        option = self._options[phrase]
        plan = option.plan if option.plan else [planner.DONE]  # "go to" while already facing: one no-op step
        env = self._env
        reward, terminated, truncated, taken = 0.0, False, False, 0
        for a in plan:
            _, r, terminated, truncated, _ = env.step(a)
            taken += 1
            reward += float(r)
            if terminated or truncated:
                break
            self._observe()
            if self._driver is not None:
                self._driver.observe(a)
        if terminated:
            truncated = False  # a terminal state, even if it was also the last allowed step
        self._terminated, self._truncated = bool(terminated), bool(truncated)
        self._success = bool(terminated and reward > 0)
        self._over = self._terminated or self._truncated

        feedback = self._feedback(phrase, option, taken)
        if not self._over:
            self._refresh()
        self._expert_next = (self._driver.next_action()
                             if self._driver is not None and not self._over else None)
        self._obs = self._render(feedback)
        info = self._info(valid=True, action=phrase, turn_steps=taken)
        if self.label_remaining:
            info["expert_remaining_turns"] = self.remaining_turns()
        return StepResult(self._obs, reward, self._terminated, self._truncated, info)

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self._env = None
        self._driver = None
        if self._sim is not None:
            self._sim.close()
            self._sim = None

    # -- helpers for callers -------------------------------------------------------------------------
    def available_actions(self) -> list[str]:
        return [] if self._over else list(self._options)

    # -- internals -----------------------------------------------------------------------------------
    def _info(self, valid: bool, action: Optional[str], turn_steps: int) -> dict[str, Any]:
        info = {
            **self._meta,
            "success": self._success,
            "valid_action": valid,
            "action": action,
            "env_steps": int(self._env.step_count),
            "turn_steps": turn_steps,
            "available_actions": self.available_actions(),
        }
        if self.expert_hints:
            info["expert_action"] = self._expert_next
        return info

    def _name_for(self, obj) -> _Known:
        for k in self._known:
            if k.obj is obj:
                return k
        key = (obj.color, obj.type)
        self._counts[key] = self._counts.get(key, 0) + 1
        k = _Known(obj, f"{obj.color} {obj.type} {self._counts[key]}", (-1, -1))
        self._known.append(k)
        return k

    def _observe(self) -> None:
        """Remember every object in the agent's current (occlusion-aware) view."""
        env = self._env
        grid, vis = env.gen_obs_grid()
        size = env.agent_view_size
        ax, ay = env.agent_pos
        dx, dy = planner.DIR_VEC[env.agent_dir]
        rx, ry = -dy, dx
        for k in self._known:
            k.visible = False
        found = []
        for i in range(size):
            for j in range(size):
                if not vis[i, j] or (i == size // 2 and j == size - 1):
                    continue
                cell = grid.get(i, j)
                if cell is None or cell.type in _NOT_OBJECTS:
                    continue
                fwd, right = size - 1 - j, i - size // 2
                found.append((fwd + abs(right), fwd, right, cell))
        under = env.grid.get(ax, ay)  # e.g. the open door the agent stands in (not part of the view image)
        if under is not None and under.type not in _NOT_OBJECTS:
            found.append((0, 0, 0, under))
        found.sort(key=lambda t: (t[0], t[1], t[2]))  # nearest first: stable, deterministic numbering
        for _, fwd, right, cell in found:
            k = self._name_for(cell)
            k.pos = (ax + dx * fwd + rx * right, ay + dy * fwd + ry * right)
            k.visible = True

    def _locate(self, k: _Known) -> Optional[tuple[int, int]]:
        """Where an object is now (None if carried or gone)."""
        env = self._env
        if env.carrying is k.obj:
            return None
        x, y = k.pos
        if 0 <= x < env.width and 0 <= y < env.height and env.grid.get(x, y) is k.obj:
            return k.pos
        for gx in range(env.width):
            for gy in range(env.height):
                if env.grid.get(gx, gy) is k.obj:
                    k.pos = (gx, gy)
                    return k.pos
        return None

    def _rel(self, pos: tuple[int, int]) -> tuple[int, int]:
        env = self._env
        vx, vy = pos[0] - env.agent_pos[0], pos[1] - env.agent_pos[1]
        dx, dy = planner.DIR_VEC[env.agent_dir]
        return vx * dx + vy * dy, vx * (-dy) + vy * dx

    def _listed(self) -> list[tuple[_Known, tuple[int, int]]]:
        """Known objects still in the grid: visible ones nearest first, then remembered ones."""
        out = []
        for k in self._known:
            pos = self._locate(k)
            if pos is not None:
                out.append((k, pos))
        def key(item):
            k, pos = item
            a, r = self._rel(pos)
            return (not k.visible, abs(a) + abs(r))
        return sorted(out, key=key)

    def _refresh(self) -> None:
        """Observe, then work out which actions are available now (with their plans)."""
        self._observe()
        env = self._env
        grid = env.grid
        carrying = env.carrying
        walk = planner.walkable_mask(grid)
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        reach = planner.search(walk, start)
        fx, fy = planner.front_of(start)
        front = grid.get(fx, fy) if 0 <= fx < env.width and 0 <= fy < env.height else None
        front_walkable = 0 <= fx < env.width and 0 <= fy < env.height and walk[fx][fy]

        opts: dict[str, _Option] = {}
        opts["turn left"] = _Option("prim", [planner.LEFT])
        opts["turn right"] = _Option("prim", [planner.RIGHT])
        if front_walkable:
            opts["move forward"] = _Option("prim", [planner.FORWARD])
        if front is not None and front.can_pickup() and carrying is None:
            opts["pick up"] = _Option("prim", [planner.PICKUP])
        if carrying is not None and front is None and 0 <= fx < env.width and 0 <= fy < env.height:
            opts["drop"] = _Option("prim", [planner.DROP])
        if front is not None and self._toggle_useful(front, carrying):
            opts["toggle"] = _Option("prim", [planner.TOGGLE])

        def is_wall(x, y):
            if not (0 <= x < env.width and 0 <= y < env.height):
                return True
            c = grid.get(x, y)
            return c is not None and c.type == "wall"

        self._unreachable = {}
        for k, pos in self._listed():
            obj = k.obj
            to_face = planner.plan_to_face(reach, pos)
            if to_face is None:
                self._unreachable[k.name] = (
                    f"no path to {k.name} (the way is blocked; closed doors must be opened first)"
                )
                continue
            opts[f"go to {k.name}"] = _Option("macro", to_face, k)
            if obj.type in PICKABLE and carrying is None and self._pickup_macros:
                opts[f"pick up {k.name}"] = _Option("macro", to_face + [planner.PICKUP], k)
            if obj.type == "door":
                if not obj.is_open and self._toggle_useful(obj, carrying):
                    opts[f"open {k.name}"] = _Option("macro", to_face + [planner.TOGGLE], k)
                elif obj.is_open:
                    axis = planner.door_axis(is_wall, pos)
                    if axis is not None:
                        through = planner.plan_through_door(reach, walk, pos, axis, start)
                        if through:
                            opts[f"go through {k.name}"] = _Option("macro", through, k)
        self._options = opts

    @staticmethod
    def _toggle_useful(obj, carrying) -> bool:
        """Toggling opens a closed door, unlocks a locked one with its key, or opens a box (closing doors
        is never needed in BabyAI, so it is not offered)."""
        if obj.type == "door":
            if obj.is_locked:
                return carrying is not None and carrying.type == "key" and carrying.color == obj.color
            return not obj.is_open
        return obj.type == "box"

    def _explain_unreachable(self, reply: Any) -> Optional[str]:
        """A specific message when the reply names a macro for a known object that cannot be reached."""
        if not self._unreachable or not isinstance(reply, str):
            return None
        text = normalize(reply)
        for name, why in self._unreachable.items():
            if re.search(r"(?<![a-z0-9])" + re.escape(normalize(name)) + r"(?![a-z0-9])", text):
                return why
        return None

    def _feedback(self, phrase: str, option: _Option, taken: int) -> str:
        env = self._env
        if option.kind == "prim":
            if phrase == "pick up":
                return f"You picked up {self._carry_name()}." if env.carrying is not None else "Nothing picked up."
            if phrase == "drop":
                return "You dropped it."
            if phrase == "toggle":
                return "You toggled it."
            return {"turn left": "You turned left.", "turn right": "You turned right.",
                    "move forward": "You moved forward."}[phrase]
        name = option.target.name if option.target else "it"
        done_early = taken < len(option.plan)
        steps = f" ({taken} step{'s' if taken != 1 else ''})"
        if done_early:
            return f"You stopped after {taken} steps on the way to {name}."
        if phrase.startswith("go to "):
            return f"You went to {name}{steps}."
        if phrase.startswith("pick up "):
            return f"You picked up {name}{steps}."
        if phrase.startswith("open "):
            return f"You opened {name}{steps}."
        if phrase.startswith("go through "):
            return f"You went through {name}{steps}."
        return f"Done{steps}."

    def _carry_name(self) -> Optional[str]:
        carrying = self._env.carrying
        return None if carrying is None else self._name_for(carrying).name

    def _render(self, feedback: Optional[str]) -> str:
        env = self._env
        if self._over:
            if self._success:
                end = "Mission complete!"
            elif self._terminated:
                end = "Mission failed."
            else:
                end = "Out of steps: the episode is over."
            return "\n".join(p for p in (feedback, f"Goal: {env.mission}", end) if p)
        objects = []
        for k, pos in self._listed():
            a, r = self._rel(pos)
            state = None
            if k.obj.type == "door":
                state = "locked" if k.obj.is_locked else ("open" if k.obj.is_open else "closed")
            objects.append(ObjView(k.name, a, r, state, k.visible))
        return render_observation(env.mission, objects, self._ahead(), self._carry_name(),
                                  list(self._options), feedback)

    def _ahead(self) -> str:
        env = self._env
        dx, dy = planner.DIR_VEC[env.agent_dir]
        x, y = env.agent_pos
        limit = env.agent_view_size - 1
        free = 0
        for _ in range(limit):
            x, y = x + dx, y + dy
            if not (0 <= x < env.width and 0 <= y < env.height):
                return describe_ahead(free, "wall", limit)
            cell = env.grid.get(x, y)
            if cell is None or (cell.can_overlap() and cell.type != "lava"):
                free += 1
                continue
            if cell.type == "wall":
                blocker = "wall"
            elif cell.type == "door":
                blocker = ("locked " if cell.is_locked else "closed ") + self._name_for(cell).name
            else:
                blocker = self._name_for(cell).name
            return describe_ahead(free, blocker, limit)
        return describe_ahead(free, None, limit)
