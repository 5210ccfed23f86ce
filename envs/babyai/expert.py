"""The BabyAI expert: minigrid's ``BabyAIBot`` followed step by step, its plan phrased in this env's actions.

``BabyAIBot`` (``minigrid.utils.baby_ai_bot``) solves the BabyAI levels with primitive minigrid actions. It keeps a
stack of subgoals (go next to something, pick up, drop, open, explore) and is meant to be told, after every
minigrid step, which action was really taken (``replan(action_taken)``), so it can follow an agent that does not
do exactly what it suggested. :class:`ExpertDriver` uses that: the env calls :meth:`ExpertDriver.observe` after
every primitive step it runs (including each step inside a macro), and :meth:`ExpertDriver.next_action` names the
env action for the bot's current subgoal:

* going next to an object the env has named ("red ball 1") -> that object's macro: "pick up red ball 1" when the
  bot's next subgoal is to pick it up, "open blue door 1" when it is to open it (and the env lists those), else
  "go to red ball 1". The macro takes a shortest path, not necessarily the bot's, and the bot replans from
  wherever it ends;
* anything else (exploring towards unseen cells, going next to an empty cell to drop something, putting an
  object next to another, a pick-up / drop / toggle in place) -> the bot's next primitive as the env's primitive
  phrase ("move forward", "turn left", "pick up", ...).

A door-closing subgoal (the bot undoing a door the agent opened on its own; this env offers no "close") is
skipped. If the bot raises (its plan asserts things this env's macros can break, or a box was opened: it then
refuses to go on), or its primitive is not an action the env offers now, the expert gives up: ``next_action``
returns None.

:func:`solve` drives a freshly reset env with the expert through its text actions and counts the turns; the env
uses it at reset to label each task with ``required_turns``.
"""

from __future__ import annotations

from typing import Any, Optional

from minigrid.core.world_object import WorldObj
from minigrid.envs.babyai.core.verifier import ObjDesc
from minigrid.utils.baby_ai_bot import BabyAIBot, CloseSubgoal, GoNextToSubgoal, OpenSubgoal, PickupSubgoal

from envs.babyai import planner

# the bot's primitive (a minigrid action id) -> this env's primitive phrase
PRIMITIVE_PHRASE = {
    planner.LEFT: "turn left",
    planner.RIGHT: "turn right",
    planner.FORWARD: "move forward",
    planner.PICKUP: "pick up",
    planner.DROP: "drop",
    planner.TOGGLE: "toggle",
}
_NAMEABLE = ("ball", "key", "box", "door")
DEFAULT_TURN_CAP = 200  # solve() gives up after this many turns (BabyAI's own step limits end episodes sooner)


class ExpertDriver:
    """Follows one episode of a ``BabyAIEnv`` (created right after its reset) with a ``BabyAIBot``."""

    def __init__(self, env: Any):
        self.env = env  # the BabyAIEnv: its minigrid env (``_env``), known objects and listed actions are read
        self.error: Optional[str] = None
        self.suggestion: Optional[int] = None
        try:
            self.bot = BabyAIBot(env._env)
        except Exception as e:  # noqa: BLE001 - a mission the bot cannot parse: no expert for this task
            self.bot = None
            self.error = f"{type(e).__name__}: {e}"
            return
        self._replan(None)

    @property
    def alive(self) -> bool:
        return self.error is None

    def _replan(self, action_taken: Optional[int]) -> None:
        try:
            self.suggestion = int(self.bot.replan(action_taken))
            self._skip_closing()
        except Exception as e:  # noqa: BLE001 - the bot's plan broke (assertion, opened box): give up
            self.error = f"{type(e).__name__}: {e}"
            self.suggestion = None

    def _skip_closing(self) -> None:
        """The bot plans to close a door only to undo one that the agent opened on its own (or when told to open a
        door that is open already); BabyAI never needs a closed door and this env offers no "close". Drop such
        subgoals (and an open-subgoal whose door is open) and ask the subgoals below for their move."""
        bot = self.bot
        for _ in range(8):
            if not (bot.stack and isinstance(bot.stack[-1], CloseSubgoal)):
                return
            bot.stack.pop()
            suggestion = None
            while bot.stack and suggestion is None:
                goal = bot.stack[-1]
                goal.update_agent_attributes()
                if isinstance(goal, OpenSubgoal) and goal.fwd_cell is not None and goal.fwd_cell.type == "door" \
                        and goal.fwd_cell.is_open:
                    bot.stack.pop()
                    continue
                suggestion = goal.replan_before_action()
            self.suggestion = int(suggestion) if suggestion is not None else None
        raise RuntimeError("the bot keeps planning to close a door")

    def observe(self, action: int) -> None:
        """The env took primitive ``action`` and the episode goes on: let the bot see the new state."""
        if self.alive:
            self._replan(int(action))

    def _target(self, goal: GoNextToSubgoal) -> Optional[WorldObj]:
        """The object a go-next-to subgoal walks up to (None: a position with nothing nameable on it)."""
        datum = goal.datum
        if isinstance(datum, WorldObj):
            obj = datum
        elif isinstance(datum, ObjDesc):
            # the bot resolves a description to the nearest matching object it has seen, at every step
            obj, _ = self.bot._find_obj_pos(datum, False)
        else:
            x, y = int(datum[0]), int(datum[1])
            grid = self.env._env.grid
            obj = grid.get(x, y) if 0 <= x < grid.width and 0 <= y < grid.height else None
        return obj if obj is not None and obj.type in _NAMEABLE else None

    def _name_of(self, obj: WorldObj) -> Optional[str]:
        for k in self.env._known:
            if k.obj is obj:
                return k.name
        return None

    def next_action(self) -> Optional[str]:
        """The env action (one of its currently listed phrases) for the bot's next move; None: give up."""
        if not self.alive or self.suggestion is None:
            return None
        options = self.env._options
        stack = self.bot.stack
        top = stack[-1] if stack else None
        if isinstance(top, GoNextToSubgoal) and top.reason not in ("PutNext", "Explore"):
            obj = self._target(top)
            name = None if obj is None else self._name_of(obj)
            if name is not None:
                below = stack[-2] if len(stack) > 1 else None
                if isinstance(below, PickupSubgoal) and f"pick up {name}" in options:
                    return f"pick up {name}"
                if isinstance(below, OpenSubgoal) and f"open {name}" in options:
                    return f"open {name}"
                if f"go to {name}" in options:
                    return f"go to {name}"
        phrase = PRIMITIVE_PHRASE.get(self.suggestion)
        if phrase is None or phrase not in options:
            self.error = f"the bot's next action {self.suggestion} is not available here"
            return None
        return phrase


def solve(env: Any, cap: int = DEFAULT_TURN_CAP) -> tuple[Optional[int], list[str]]:
    """Drive a just-reset ``BabyAIEnv`` (with expert hints on) by its expert through text actions.

    Returns (turns used if the mission was accomplished within ``cap`` turns else None, the actions taken)."""
    actions: list[str] = []
    for _ in range(cap):
        action = env.expert_next_action()
        if action is None:
            return None, actions
        res = env.step(action)
        actions.append(action)
        if not res.info.get("valid_action"):
            return None, actions
        if res.done:
            return (len(actions) if res.info.get("success") else None), actions
    return None, actions
