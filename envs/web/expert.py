"""Resolve hand-written expert steps against an observation (pure).

Expert steps are WebArena actions whose element ids are locators ``[role 'name']``:
``click [link 'Cart (0)']`` -> ``click [3]`` when the observation has the line ``[3] link 'Cart (0)'``.
"""

from __future__ import annotations

import re
from typing import Optional

_LINE = re.compile(r"^\s*\[(\d+)\] (.*)$")
_LOCATOR = re.compile(r"^(\w+) \[(\w+) '(.*?)'\](.*)$", re.DOTALL)


def find_element(observation: str, role: str, name: str) -> Optional[int]:
    """Id of the first element line ``[id] role 'name'`` (with or without properties after it)."""
    want = f"{role} '{name}'"
    for line in observation.splitlines():
        m = _LINE.match(line)
        if m and (m.group(2) == want or m.group(2).startswith(want + " ")):
            return int(m.group(1))
    return None


def resolve(step: str, observation: str) -> Optional[str]:
    """The concrete action of an expert step, or None when its element is not in the observation."""
    m = _LOCATOR.match(step)
    if not m:
        return step
    kind, role, name, rest = m.groups()
    eid = find_element(observation, role, name)
    if eid is None:
        return None
    return f"{kind} [{eid}]{rest}"
