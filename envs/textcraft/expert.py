"""TextCraft expert: the next action from the recipe tree, the goal and the current inventory.

Stateless: every call plans the whole remaining crafting from the inventory and returns the first
action, so it can drive an episode from any point (and through any transport, it needs only the goal id
and the inventory that ``TextCraftEnv`` puts in ``info``). Planning, for ``need`` units of an item:
use what the inventory holds; a base item (no recipe) is fetched with ``get``; a tag ("planks") is
resolved to a concrete member (one already held, else the shallowest); a craftable item uses its
shallowest recipe, acquiring ``count * batches`` of every input first, then crafts ``batches`` times
(leftovers stay in the simulated inventory).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

from envs.textcraft.tasks import item_name, load_tree


@lru_cache(maxsize=4)
def _tree(minecraft_dir: str | None = None):
    return load_tree(minecraft_dir)


def _id(name: str) -> str:
    return name if name.startswith("minecraft:") else "minecraft:" + name.replace(" ", "_")


def gettable_name(tree, name: str) -> bool:
    """Whether the game hands out ``name`` (an item id, or its spelling in the crafting commands) with ``get``: a
    base item."""
    item = _id(name)
    return not tree.is_craftable(item) and not tree.is_tag(item) and tree.is_valid_item(item)


class _Planner:
    def __init__(self, tree, inventory: dict[str, int]):
        self.t = tree
        self.inv = {_id(k): int(v) for k, v in inventory.items()}

    def gettable(self, item: str) -> bool:
        return gettable_name(self.t, item)

    def resolve(self, name: str, n: int) -> str:
        """A concrete item id for an item-or-tag name."""
        if not self.t.is_tag(name):
            return name
        members = sorted(set(self.t.get_items_with_tags(name)))
        held = [m for m in members if self.inv.get(m, 0) >= n]
        if held:
            return held[0]
        usable = [m for m in members if m in self.t.itemid_recipes or self.gettable(m)]
        if not usable:
            raise ValueError(f"no concrete item for tag {name}")
        return min(usable, key=lambda m: (self.t.get_min_depth(m), m))

    def acquire(self, item: str, n: int, stack: frozenset = frozenset()) -> list[str]:
        have = self.inv.get(item, 0)
        take = min(have, n)
        self.inv[item] = have - take
        n -= take
        if n == 0:
            return []
        if self.gettable(item):
            return [f"get {n} {item_name(item)}"]
        if item in stack:
            raise ValueError(f"cycle at {item}")
        recipes = sorted(self.t.itemid_recipes.get(item, []),
                         key=lambda r: (self.t.get_min_depth_recipes([r]), r.recipe_str))
        last_error: Exception | None = None
        for r in recipes:
            saved = dict(self.inv)
            try:
                k = r.output_item.count
                batches = math.ceil(n / k)
                acts: list[str] = []
                parts = []
                for inp in r.input_items:
                    need = inp.count * batches
                    concrete = self.resolve(inp.item_tag.name, need)
                    acts += self.acquire(concrete, need, stack | {item})
                    parts.append(f"{inp.count} {item_name(concrete)}")
                acts += [f"craft {k} {item_name(item)} using {', '.join(parts)}"] * batches
                self.inv[item] = self.inv.get(item, 0) + batches * k - n
                return acts
            except ValueError as e:
                self.inv = saved
                last_error = e
        raise ValueError(f"cannot make {item}: {last_error or 'no recipe'}")


def plan(goal: str, inventory: dict[str, int], minecraft_dir: str | None = None) -> list[str]:
    """Every remaining action to craft one ``goal`` (item id) from ``inventory`` ({item name: count})."""
    p = _Planner(_tree(minecraft_dir), inventory)
    # the goal itself must be crafted (holding one already does not count as crafting it)
    p.inv[goal] = 0
    return p.acquire(goal, 1)


def next_action(goal: str, inventory: dict[str, int], minecraft_dir: str | None = None) -> Optional[str]:
    """The expert's next action, or None when no plan exists."""
    try:
        acts = plan(goal, inventory, minecraft_dir)
    except ValueError:
        return None
    return acts[0] if acts else None
