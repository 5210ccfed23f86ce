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

from envs.react import ParseResult

KINDS = ("search", "answer")
# Tags are found with plain patterns and paired up by hand: a lazy ``<tag>.*?</tag>`` pattern rescans the rest
# of the text from every unclosed opening tag (quadratic time on "<search>" x 50k).
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
_OPEN = re.compile(r"<(search|answer)>", re.IGNORECASE)
_CLOSE = {k: re.compile(rf"</{k}>", re.IGNORECASE) for k in KINDS}
HOW = "Reply with <search>query</search> to search, or <answer>text</answer> to give your final answer."


@dataclass(frozen=True)
class Action:
    kind: str  # "search" | "answer"
    text: str  # the query or the answer, whitespace collapsed


def _clean(text: str) -> str:
    return " ".join(text.split())


def _last_start(pattern: re.Pattern, text: str) -> int:
    """Where the last match of ``pattern`` starts (-1 when none); one linear pass."""
    last = -1
    for m in pattern.finditer(text):
        last = m.start()
    return last


def _drop_think(reply: str) -> str:
    """The reply with every ``<think>...</think>`` block (first closing tag ends it) replaced by a space."""
    out, pos = [], 0
    while True:
        m = _THINK_OPEN.search(reply, pos)
        if m is None:
            break
        c = _THINK_CLOSE.search(reply, m.end())
        if c is None:  # no closing tag after this one: none after any later one either
            break
        out += [reply[pos : m.start()], " "]
        pos = c.end()
    out.append(reply[pos:])
    return "".join(out)


def _tags(body: str) -> list[tuple[str, str]]:
    """(kind, raw content) of every ``<kind>...</kind>`` pair, left to right, as a lazy regex would pair them."""
    last_close = {k: _last_start(p, body) for k, p in _CLOSE.items()}
    found, pos = [], 0
    while True:
        m = _OPEN.search(body, pos)
        if m is None:
            return found
        kind = m.group(1).lower()
        if last_close[kind] < m.end():  # never closed: try the next opening tag
            pos = m.start() + 1
            continue
        c = _CLOSE[kind].search(body, m.end())
        assert c is not None
        found.append((kind, body[m.end() : c.start()]))
        pos = c.end()


def parse_reply(reply: str) -> ParseResult:
    """The one action in a reply, or why there is none."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, f"The reply is empty. {HOW}")
    body = _drop_think(reply)
    found = [(kind, _clean(text)) for kind, text in _tags(body)]
    if not found:
        m = _OPEN.search(body)
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
