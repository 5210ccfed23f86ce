"""Breadth-first path planning on a minigrid grid, for the BabyAI macro actions.

The search state is ``(x, y, dir)`` and the moves are minigrid's three navigation primitives (turn left,
turn right, move forward), each costing one step, so BFS gives the plan with the fewest primitive steps.
Only free cells and cells the agent can overlap (open doors, floor) are walkable: the planner never opens
doors, picks things up or walks into lava on its own.

Everything here is pure apart from :func:`walkable_mask`, which only reads a minigrid ``Grid``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

# minigrid action ids (minigrid.core.actions.Actions) and direction vectors (DIR_TO_VEC)
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # 0: +x (east), 1: +y (south), 2: -x, 3: -y

State = tuple[int, int, int]
Cell = tuple[int, int]


def walkable_mask(grid) -> list[list[bool]]:
    """``mask[x][y]`` is True where the agent may stand: empty cells and overlappable non-lava objects."""
    mask = []
    for x in range(grid.width):
        col = []
        for y in range(grid.height):
            cell = grid.get(x, y)
            col.append(cell is None or (cell.can_overlap() and cell.type != "lava"))
        mask.append(col)
    return mask


def front_of(state: State) -> Cell:
    x, y, d = state
    dx, dy = DIR_VEC[d]
    return x + dx, y + dy


@dataclass
class Reach:
    """All states reachable from ``start`` with their BFS parents (one search serves every target)."""

    start: State
    parent: dict[State, Optional[tuple[State, int]]]

    def reachable(self, state: State) -> bool:
        return state in self.parent

    def path_to(self, state: State) -> list[int]:
        """Primitive actions leading from ``start`` to ``state`` (which must be reachable)."""
        actions: list[int] = []
        while True:
            link = self.parent[state]
            if link is None:
                break
            state, action = link
            actions.append(action)
        actions.reverse()
        return actions

    def best(self, goals: Iterable[State]) -> Optional[list[int]]:
        """Shortest action list reaching any of ``goals``; None if none is reachable."""
        best_path: Optional[list[int]] = None
        for g in goals:
            if g in self.parent:
                p = self.path_to(g)
                if best_path is None or len(p) < len(best_path):
                    best_path = p
        return best_path


def search(walkable: Sequence[Sequence[bool]], start: State) -> Reach:
    """Single-source BFS over (x, y, dir) from ``start``."""
    width = len(walkable)
    height = len(walkable[0]) if width else 0
    parent: dict[State, Optional[tuple[State, int]]] = {start: None}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        x, y, d = s
        nexts = [((x, y, (d - 1) % 4), LEFT), ((x, y, (d + 1) % 4), RIGHT)]
        fx, fy = x + DIR_VEC[d][0], y + DIR_VEC[d][1]
        if 0 <= fx < width and 0 <= fy < height and walkable[fx][fy]:
            nexts.append(((fx, fy, d), FORWARD))
        for n, a in nexts:
            if n not in parent:
                parent[n] = (s, a)
                queue.append(n)
    return Reach(start, parent)


def facing_states(target: Cell) -> list[State]:
    """The four states that stand next to ``target`` and face it."""
    tx, ty = target
    out = []
    for d, (dx, dy) in enumerate(DIR_VEC):
        out.append((tx - dx, ty - dy, d))
    return out


def plan_to_face(reach: Reach, target: Cell) -> Optional[list[int]]:
    """Shortest plan ending adjacent to ``target`` and facing it (BabyAI's "go to")."""
    return reach.best(facing_states(target))


def plan_to_cell(reach: Reach, cell: Cell, dirs: Iterable[int] = range(4)) -> Optional[list[int]]:
    """Shortest plan ending on ``cell`` with one of ``dirs``."""
    x, y = cell
    return reach.best((x, y, d) for d in dirs)


def door_axis(is_wall: Callable[[int, int], bool], door: Cell) -> Optional[int]:
    """Axis along which a door is crossed: 0 = x axis, 1 = y axis, None if it cannot be told.

    A door sits in a wall, so it is crossed along the axis whose two neighbours are not walls.
    """
    x, y = door
    horiz = not is_wall(x - 1, y) and not is_wall(x + 1, y)
    vert = not is_wall(x, y - 1) and not is_wall(x, y + 1)
    if horiz and not vert:
        return 0
    if vert and not horiz:
        return 1
    return None


def plan_through_door(
    reach: Reach, walkable: Sequence[Sequence[bool]], door: Cell, axis: int, agent: State
) -> Optional[list[int]]:
    """Plan to cross an (open) door to the side opposite the agent, ending one cell past the door.

    If the cell past the door is occupied, the plan ends standing in the doorway facing out.
    """
    dx, dy = (1, 0) if axis == 0 else (0, 1)
    x, y = door
    ax, ay, ad = agent
    side = (ax - x) * dx + (ay - y) * dy  # > 0: agent on the + side
    if side == 0:  # standing in the doorway: go the way it faces, else the + side
        adx, ady = DIR_VEC[ad]
        side = -((adx * dx + ady * dy) or 1)
    sign = -1 if side > 0 else 1
    far = (x + sign * dx, y + sign * dy)
    out_dir = DIR_VEC.index((sign * dx, sign * dy))
    w, h = len(walkable), len(walkable[0])
    if 0 <= far[0] < w and 0 <= far[1] < h and walkable[far[0]][far[1]]:
        # prefer arriving through this door: stand in the doorway facing out, then step forward
        via = reach.best([(x, y, out_dir)])
        if via is not None:
            return via + [FORWARD]
        return plan_to_cell(reach, far)
    return plan_to_cell(reach, door, [out_dir])
