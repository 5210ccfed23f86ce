"""Turn a model reply into one search-QA action (pure).

Actions are tags: ``<search>query</search>`` or ``<answer>text</answer>``. Reasoning inside
``<think>...</think>`` is removed first (a search or answer tag inside a think block does not count).
Tags are case-insensitive and may span lines; the content is stripped and its whitespace collapsed.

* exactly one action (the same action repeated counts once) -> that action;
* no complete tag, an unclosed tag, an empty tag, or two different actions -> an error message that tells
  the model what to send instead (the env turns it into an explanatory observation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

KINDS = ("search", "answer")
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.IGNORECASE | re.DOTALL)
_OPEN = re.compile(r"<(search|answer)>", re.IGNORECASE)
HOW = "Reply with <search>query</search> to search, or <answer>text</answer> to give your final answer."


@dataclass(frozen=True)
class Action:
    kind: str  # "search" | "answer"
    text: str  # the query or the answer, whitespace collapsed


@dataclass(frozen=True)
class ParseResult:
    action: Optional[Action]
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.action is not None


def _clean(text: str) -> str:
    return " ".join(text.split())


def parse_reply(reply: str) -> ParseResult:
    """The one action in a reply, or why there is none."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, f"The reply is empty. {HOW}")
    body = _THINK.sub(" ", reply)
    found = [(m.group(1).lower(), _clean(m.group(2))) for m in _TAG.finditer(body)]
    if not found:
        rest = _TAG.sub(" ", body)
        m = _OPEN.search(rest)
        if m:
            kind = m.group(1).lower()
            return ParseResult(None, f"The <{kind}> tag is not closed: end it with </{kind}>. {HOW}")
        return ParseResult(None, f"No action found. {HOW}")
    distinct = list(dict.fromkeys(found))
    if len(distinct) > 1:
        kinds = sorted({k for k, _ in distinct})
        plural = {"search": "searches", "answer": "answers"}
        what = "a search and an answer" if len(kinds) == 2 else f"{len(distinct)} different {plural[kinds[0]]}"
        return ParseResult(None, f"One action per turn, but the reply has {what}. {HOW}")
    kind, text = distinct[0]
    if not text:
        return ParseResult(None, f"The <{kind}> tag is empty. {HOW}")
    return ParseResult(Action(kind, text), None)
