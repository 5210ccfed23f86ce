"""Hints for the generic env contract suite, and reference solutions for a sample of MiniWoB tasks.

``expert_action`` reads the task's utterance (the OBJECTIVE line) and the accessibility tree, and returns
the next action of a hand-written solution; it is stateless (decides from what the page shows, e.g. whether
a field already holds the text). ``SOLVED_TASKS`` lists the tasks it solves.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from envs.web.expert import find_element

OPTIONS: dict[str, Any] = {"tasks": "click-button,enter-text,click-checkboxes", "max_contexts": 4}


def two_actions(observation: str, info: dict) -> str:
    return "Action: scroll [down]\nAction: scroll [up]"


def valid_action(observation: str, info: dict) -> str:
    return "Let me look at the rest of the page.\nAction: scroll [down]"


def _objective(obs: str) -> str:
    m = re.search(r"^OBJECTIVE: (.*)$", obs, re.MULTILINE)
    return m.group(1) if m else ""


_ELEMENT = re.compile(
    r"^\s*\[(\d+)\] (\w+)(?: '(.*?)'(?=(?: (?:focused|disabled|selected|checked: |expanded: |value: |level: ))|$))?(.*)$"
)


def _elements(obs: str) -> list[tuple[int, str, str, str]]:
    """(id, role, name, properties) of every element line of the tree."""
    out = []
    for line in obs.split("OBSERVATION:", 1)[-1].splitlines():
        m = _ELEMENT.match(line)
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3) or "", m.group(4) or ""))
    return out


def _first(obs: str, role: str) -> Optional[int]:
    for eid, r, _, _ in _elements(obs):
        if r == role:
            return eid
    return None


def _value(rest: str) -> str:
    m = re.search(r"value: '(.*?)'", rest)
    return m.group(1) if m else ""


def _act(a: Optional[str]) -> Optional[str]:
    return None if a is None else f"Next step of the reference solution.\nAction: {a}"


def _click_named(obs: str, name: str, roles=("button", "link", "StaticText", "tab")) -> Optional[str]:
    for role in roles:
        eid = find_element(obs, role, name)
        if eid is not None:
            return f"click [{eid}]"
    return None


def _submit(obs: str, label: str = "Submit") -> Optional[str]:
    for eid, role, name, _ in _elements(obs):
        if role == "button" and name.lower() == label.lower():
            return f"click [{eid}]"
    return None


def _fill_then_submit(obs: str, wanted: list[tuple[Optional[str], str]], submit: str = "Submit") -> Optional[str]:
    """Type each (field label or None = n-th textbox, text) that does not hold its text yet, then submit."""
    boxes = [(eid, name, rest) for eid, role, name, rest in _elements(obs) if role == "textbox"]
    for i, (label, text) in enumerate(wanted):
        box = next((b for b in boxes if label and b[1].lower() == label.lower()), None)
        if box is None and i < len(boxes):
            box = boxes[i]
        if box is None:
            return None
        if _value(box[2]) != text:
            return f"type [{box[0]}] [{text}] [0]"
    return _submit(obs, submit)


def _click_button(obs: str, goal: str) -> Optional[str]:
    m = re.match(r'Click on the "(.*)" button\.', goal)
    return _click_named(obs, m.group(1), ("button",)) if m else None


def _click_link(obs: str, goal: str) -> Optional[str]:
    m = re.match(r'Click on the link "(.*)"\.', goal)
    return _click_named(obs, m.group(1), ("link", "StaticText")) if m else None


def _click_test(obs: str, goal: str) -> Optional[str]:
    eid = _first(obs, "button")
    return None if eid is None else f"click [{eid}]"


def _click_test_2(obs: str, goal: str) -> Optional[str]:
    m = re.match(r"Click button (\w+)\.", goal)
    return _click_named(obs, m.group(1), ("button",)) if m else None


def _click_tab(obs: str, goal: str) -> Optional[str]:
    m = re.match(r"Click on (Tab #\d)\.", goal)
    return _click_named(obs, m.group(1), ("link", "tab")) if m else None


def _focus_text(obs: str, goal: str) -> Optional[str]:
    eid = _first(obs, "textbox")
    return None if eid is None else f"click [{eid}]"


def _enter_text(obs: str, goal: str) -> Optional[str]:
    m = re.match(r'Enter "(.*)" into the text field and press Submit\.', goal)
    return _fill_then_submit(obs, [(None, m.group(1))]) if m else None


def _enter_password(obs: str, goal: str) -> Optional[str]:
    m = re.match(r'Enter the password "(.*)" into both text fields and press submit\.', goal)
    return _fill_then_submit(obs, [(None, m.group(1)), (None, m.group(1))]) if m else None


def _login_user(obs: str, goal: str) -> Optional[str]:
    m = re.match(r'Enter the username "(.*)" and the password "(.*)" into the text fields and press login\.', goal)
    return _fill_then_submit(obs, [("Username", m.group(1)), ("Password", m.group(2))], "Login") if m else None


def _select_boxes(obs: str, goal: str, role: str) -> Optional[str]:
    m = re.match(r"Select (.*) and click Submit\.", goal)
    if not m:
        return None
    words = [] if m.group(1) == "nothing" else [w.strip() for w in re.split(r",\s*|\s+and\s+", m.group(1)) if w.strip()]
    for eid, r, name, rest in _elements(obs):
        if r != role:
            continue
        checked = "checked: true" in rest
        if (name in words) != checked:
            return f"click [{eid}]"
    return _submit(obs)


def _choose_list(obs: str, goal: str) -> Optional[str]:
    m = re.match(r"Select (.*) from the list and click Submit\.", goal)
    if not m:
        return None
    for eid, role, name, rest in _elements(obs):
        if role == "combobox":
            if _value(rest) != m.group(1):
                return f"type [{eid}] [{m.group(1)}] [0]"
            return _submit(obs)
    return None


EXPERTS: dict[str, Callable[[str, str], Optional[str]]] = {
    "click-button": _click_button,
    "click-link": _click_link,
    "click-test": _click_test,
    "click-test-2": _click_test_2,
    "click-tab": _click_tab,
    "focus-text": _focus_text,
    "enter-text": _enter_text,
    "enter-password": _enter_password,
    "login-user": _login_user,
    "click-checkboxes": lambda o, g: _select_boxes(o, g, "checkbox"),
    "click-option": lambda o, g: _select_boxes(o, g, "radio"),
    "choose-list": _choose_list,
}
SOLVED_TASKS = tuple(EXPERTS)


def expert_action(observation: str, info: dict) -> Optional[str]:
    fn = EXPERTS.get(str(info.get("task", "")))
    if fn is None:
        return None
    return _act(fn(observation, _objective(observation)))
