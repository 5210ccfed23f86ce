"""Turn a model reply into a well-formed TextCraft action (pure).

The action comes from the reply's ``Action:`` line (``envs.react`` rules: one distinct action per reply).
Well-formed actions, in canonical spelling:

* ``inventory`` (``look`` and ``check inventory`` mean it too)
* ``get N item``                               e.g. ``get 2 oak log``
* ``craft N item using N item, N item, ...``   e.g. ``craft 4 oak planks using 1 oak log``

Item names are lower case with single spaces (``minecraft:`` prefixes and underscores are accepted and
rewritten). Whether the game accepts a well-formed action (the item exists, the recipe matches, the
inventory has the inputs) is the game's business, not the parser's.
"""

from __future__ import annotations

import re
from typing import Optional

from envs.react import ParseResult, action_lines, default_normalize, extract_action

FORMATS = ("get N item", "craft N item using N item, N item, ...", "inventory")
_ITEM = r"[a-z][a-z0-9' -]*?"
_GET = re.compile(rf"^get\s+(\d+)\s+({_ITEM})$")
_CRAFT = re.compile(rf"^craft\s+(\d+)\s+({_ITEM})\s+using\s+(.+)$")
_COUNTED = re.compile(rf"^(\d+)\s+({_ITEM})$")


def normalize(text: str) -> str:
    """Lower case; ``minecraft:`` prefixes dropped, underscores as spaces; then, as AgentGym's TextCraft client
    does, only letters, digits, commas and spaces kept (``get 1 "oak log"!`` -> ``get 1 oak log``)."""
    text = default_normalize(text).replace("minecraft:", "").replace("_", " ")
    return " ".join(re.sub(r"[^a-z0-9, ]+", "", text).split())


def _count(raw: str, what: str) -> tuple[Optional[int], Optional[str]]:
    n = int(raw)
    if n < 1:
        return None, f"the count of {what} must be at least 1"
    return n, None


def canonical(action: str) -> ParseResult:
    """Check the syntax of one normalized action and return its canonical spelling."""
    a = normalize(action)
    if a in ("inventory", "check inventory", "look"):  # "look": AgentGym's client sends inventory for it
        return ParseResult("inventory", None)
    m = _GET.match(a)
    if m:
        n, err = _count(m.group(1), m.group(2))
        return ParseResult(f"get {n} {m.group(2).strip()}", None) if err is None else ParseResult(None, err)
    m = _CRAFT.match(a)
    if m:
        n, err = _count(m.group(1), m.group(2))
        if err:
            return ParseResult(None, err)
        parts = [p.strip() for p in m.group(3).split(",") if p.strip()]
        if not parts:
            return ParseResult(None, "craft needs ingredients after 'using'")
        ins = []
        for p in parts:
            pm = _COUNTED.match(p)
            if not pm:
                return ParseResult(None, f"ingredient '{p}' must be 'N item' (a count, then the item)")
            k, err = _count(pm.group(1), pm.group(2))
            if err:
                return ParseResult(None, err)
            ins.append(f"{k} {pm.group(2).strip()}")
        return ParseResult(f"craft {n} {m.group(2).strip()} using {', '.join(ins)}", None)
    if a.startswith("get "):
        return ParseResult(None, "'get' needs a count and an item, e.g. 'get 1 oak log'")
    if a.startswith("craft "):
        return ParseResult(None, "'craft' must look like 'craft N item using N item, N item'")
    return ParseResult(None, f"'{_clip(a)}' is not a TextCraft action")


def parse_action(reply: str, menu: list[str] | None = None) -> ParseResult:
    """The well-formed action a reply asks for, or why there is none. With an action ``menu`` (the
    ``show_actions`` option) a reply without an ``Action:`` line is also accepted when exactly one distinct menu
    action occurs in it, BabyAI's rule for its list of available actions."""
    ex = extract_action(reply, normalize)
    parsed = canonical(ex.action) if ex.ok else ParseResult(None, ex.error)
    if parsed.ok or not menu or not isinstance(reply, str) or action_lines(reply):
        return parsed
    found = menu_matches(reply, menu)
    if len(found) == 1:
        return canonical(found[0])
    if len(found) > 1:
        return ParseResult(None, f"one action per turn, but the reply names {len(found)} actions "
                               f"({', '.join(repr(a) for a in found[:3])})")
    return parsed


def menu_matches(reply: str, menu: list[str]) -> list[str]:
    """The distinct menu actions that occur in ``reply`` as whole phrases (normalised; longest first, and a
    match's text is consumed, so 'get 1 oak log' inside a longer match does not count twice)."""
    text = f" {' '.join(normalize(reply).replace(chr(10), ' ').split())} "
    found = []
    for action in sorted({normalize(a) for a in menu}, key=len, reverse=True):
        needle = f" {action}"
        pos, hit = text.find(needle), False
        while pos != -1:
            end = pos + len(needle)
            if end == len(text) or not text[end].isalnum():
                text = text[:pos] + " \x00" + text[end:]
                hit = True
                pos = text.find(needle, pos + 2)
            else:
                pos = text.find(needle, end)
        if hit:
            found.append(action)
    return found


def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
