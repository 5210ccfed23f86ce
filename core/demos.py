"""Expert demonstrations, the pure part: the reply a demonstration puts in the model's mouth."""

from __future__ import annotations

import re

_ACTION_LINE = re.compile(r"^\s*action\s*:\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)


def action_reply(expert_text: str) -> str:
    """The reply a behaviour-cloned policy learns for an expert's text: ``Action: <action>``, with the action of
    the text's last ``Action:`` line (the line envs act on); a text without one names its action on its own
    (``"turn left"`` -> ``"Action: turn left"``). Raises ValueError for an empty action or a multi-line text
    without an ``Action:`` line (no single action to imitate)."""
    if not isinstance(expert_text, str):
        raise ValueError(f"the expert's reply must be text, got {type(expert_text).__name__}")
    found = _ACTION_LINE.findall(expert_text)
    if found:
        action = found[-1]
    else:
        action = expert_text.strip()
        if "\n" in action:
            raise ValueError(f"the expert's reply {expert_text!r} has several lines and no 'Action:' line")
    if not action:
        raise ValueError(f"the expert's reply {expert_text!r} names no action")
    return f"Action: {action}"
