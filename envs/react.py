"""ReAct-style action extraction shared by the text envs (pure functions, no env state).

A reply is free text ending with a line ``Action: <action>``. Rules:

* every ``Action:`` is collected: at the start of a line in any case (markdown emphasis like ``**Action:**``
  tolerated), or inside a line spelled ``Action:`` as AgentGym's clients look for it (``Thought: ... Action: x``
  on one line; not inside a word, so ``reaction:`` is not one); the action is the rest of that line, or the next
  line when nothing follows the colon. Actions naming the same action (after ``normalize``) count once,
  different ones are an error ("one action per turn"). AgentGym's clients refuse two ``Action:`` even when
  they agree and match ``Action:`` only in that spelling; both are places where this parser is more lenient;
* without an ``Action:`` line, a reply that is a single non-empty line is taken as the bare action
  (clients that send just ``inventory``); anything longer is "no action found".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

# Linear time on any input: the prefix class excludes newlines (so a run of blank lines is not rescanned from
# every line start), runs of spaces/emphasis are one character class each, and the trailing whitespace is
# stripped in Python instead of by a lazy group racing a ``\s*$`` (quadratic on long trailing runs).
# Mid-line, only the exact spelling ``Action:`` after a non-alphanumeric character (what AgentGym's clients match),
# so prose like "my next action: ..." is not taken for an action line.
_ACTION_LINE = re.compile(r"(?:^[ \t\r\f\v>*_#-]*(?i:action)|(?<![A-Za-z0-9])Action)[ \t\r\f\v*_]*:[\s*_]*([^\n]*)",
                          re.MULTILINE)
_STRIP = " \t\"'`*_"


A = TypeVar("A")


@dataclass(frozen=True)
class ParseResult(Generic[A]):
    """What a parser made of a reply, for every env: the accepted action (an env's own type: the action text,
    or a structured ``Action``), or None with ``error`` saying why nothing was accepted."""

    action: Optional[A]
    error: Optional[str]  # why no action was taken, or None

    @property
    def ok(self) -> bool:
        return self.action is not None


def default_normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding quotes/backticks, no trailing full stop."""
    text = text.strip().strip(_STRIP).strip()
    text = text.rstrip(".!").strip()
    return " ".join(text.lower().split())


def action_lines(reply: str) -> list[str]:
    """The raw texts after every ``Action:`` line, in order."""
    return [m.group(1).strip() for m in _ACTION_LINE.finditer(reply or "")]


def extract_action(reply: str, normalize: Callable[[str], str] = default_normalize) -> ParseResult:
    """The one action a reply asks for, or why there is none (see the module doc)."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, "the reply is empty; end it with one line 'Action: <action>'")
    found = [normalize(a) for a in action_lines(reply)]
    found = [a for a in found if a]
    if found:
        distinct = list(dict.fromkeys(found))
        if len(distinct) > 1:
            shown = ", ".join(repr(a) for a in distinct[:3])
            return ParseResult(None, f"one action per turn, but the reply has {len(distinct)} different Action lines "
                                     f"({shown})")
        return ParseResult(distinct[0], None)
    if action_lines(reply):
        return ParseResult(None, "the Action line is empty")
    lines = [ln for ln in reply.strip().splitlines() if ln.strip()]
    if len(lines) == 1:
        bare = normalize(lines[0])
        if bare:
            return ParseResult(bare, None)
    return ParseResult(None, "no action found; end your reply with one line 'Action: <action>'")
