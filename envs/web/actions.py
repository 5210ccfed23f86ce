"""Parse WebArena actions out of a model reply (pure; no browser).

Grammar (WebArena's action space; brackets are literal)::

    click [id]            hover [id]            type [id] [text] [press_enter]   (press_enter: 1 default, or 0)
    press [keys]          scroll [up|down]      goto [url]
    go_back               go_forward            new_tab          tab_focus [n]   close_tab
    stop [answer]         (stop [] / stop without answer = no answer)

Where the action is taken from, in order:

1. ``Action: <action>`` lines (ReAct style, any case, markdown emphasis tolerated). Several lines naming the
   same action count once; different ones are an error ("one action per turn").
2. Otherwise a fenced block (````` ```click [12]``` `````, WebArena's own prompt format), the last one.
3. Otherwise a reply that is exactly one action line.

Errors never raise: ``parse_action`` returns ``ParseResult(action=None, error=why)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from envs.react import ParseResult

KINDS = ("click", "type", "hover", "press", "scroll", "goto", "go_back", "go_forward", "new_tab", "tab_focus",
         "close_tab", "stop")
_ALIASES = {"goback": "go_back", "go back": "go_back", "goforward": "go_forward", "go forward": "go_forward",
            "newtab": "new_tab", "new tab": "new_tab", "tabfocus": "tab_focus", "closetab": "close_tab",
            "close tab": "close_tab", "tab focus": "tab_focus"}

# Linear time on any input (see envs/react.py): no newline in the prefix class, one character class per run,
# trailing whitespace stripped in Python.
_ACTION_LINE = re.compile(r"^[ \t>*_#-]*action[*_]*[ \t\r\f\v]*:[\s*_]*([^\n]*)", re.IGNORECASE | re.MULTILINE)
_FENCE = re.compile(r"```(?:[a-zA-Z]*[ \t]*\n)?(.*?)```", re.DOTALL)
_HEAD = re.compile(r"^([a-zA-Z_]+)")

USAGE = (
    "click [id] | type [id] [text] [1 or 0 = press Enter after] | hover [id] | press [keys] | scroll [up|down] | "
    "goto [url] | go_back | go_forward | new_tab | tab_focus [n] | close_tab | stop [answer]"
)


@dataclass(frozen=True)
class Action:
    kind: str
    element_id: Optional[int] = None
    text: Optional[str] = None  # type: text; press: keys; goto: url; stop: answer; scroll: up|down
    press_enter: bool = True
    number: Optional[int] = None  # tab_focus

    def render(self) -> str:
        """Canonical text of the action (used as "previous action" in observations)."""
        k = self.kind
        if k in ("click", "hover"):
            return f"{k} [{self.element_id}]"
        if k == "type":
            return f"type [{self.element_id}] [{self.text}] [{1 if self.press_enter else 0}]"
        if k in ("press", "scroll", "goto", "stop"):
            return f"{k} [{self.text or ''}]"
        if k == "tab_focus":
            return f"tab_focus [{self.number}]"
        return k


def _clip(s: str, n: int = 80) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _bracket_args(rest: str) -> tuple[list[str], str]:
    """Split ``[a] [b c] [d]`` into ["a", "b c", "d"]; returns (args, unparsed tail).

    An argument ends at the first ``]`` followed by optional whitespace and then ``[`` or the end of the text,
    so the last argument may itself contain ``]`` (an answer or a typed text). Index arithmetic only (no
    slicing per bracket), so the cost is linear in the text.
    """
    args: list[str] = []
    s = rest.strip()
    n, i = len(s), 0
    while i < n and s[i] == "[":
        end = s.find("]", i + 1)
        if end < 0:
            return args, s[i:]
        while True:
            after = _skip_space(s, end + 1)
            if after == n or s[after] == "[":
                break
            more = s.find("]", end + 1)
            if more < 0:
                end = s.rfind("]")
                break
            end = more
        args.append(s[i + 1 : end])
        i = _skip_space(s, end + 1)
    return args, s[i:]


_SPACE = re.compile(r"\s*")


def _skip_space(s: str, i: int) -> int:
    return _SPACE.match(s, i).end()  # type: ignore[union-attr]


def _clean_raw(text: str) -> str:
    """Strip code marks, emphasis and a sentence's full stop around an action."""
    raw = text.strip().strip("`").strip().strip("*_").strip()
    if raw.endswith(".") and not raw.endswith("].") and "[" not in raw:
        raw = raw[:-1]
    if raw.endswith("]."):
        raw = raw[:-1]
    return raw


def _split_head(raw: str) -> tuple[Optional[str], str, Optional[str]]:
    """(action kind, argument text, error): the action's name (aliases resolved) and what follows it."""
    m = _HEAD.match(raw)
    if not m:
        return None, "", f"'{_clip(raw)}' is not an action; use one of: {USAGE}"
    head = m.group(1).lower()
    rest = raw[m.end() :]
    two = _SECOND_WORD.match(rest)
    if two and f"{head} {two.group(1).lower()}" in _ALIASES:
        head = f"{head} {two.group(1).lower()}"
        rest = rest[two.end() :]
    kind = _ALIASES.get(head, head)
    if kind not in KINDS:
        return None, "", f"unknown action '{_clip(head, 30)}'; use one of: {USAGE}"
    return kind, rest, None


_SECOND_WORD = re.compile(r"\s+([a-zA-Z]+)")


def _arity_error(kind: str, args: list[str], n_min: int, n_max: int) -> Optional[str]:
    if n_min <= len(args) <= n_max:
        return None
    want = f"{n_min}" if n_min == n_max else f"{n_min} to {n_max}"
    return f"'{kind}' takes {want} bracketed argument(s), got {len(args)}: e.g. {_example(kind)}"


def _element_id(kind: str, arg: str) -> tuple[Optional[int], Optional[str]]:
    s = arg.strip().lstrip("#")
    if s.isdigit():
        return int(s), None
    return None, f"'{kind}' needs a numeric element id like [12], got [{_clip(arg, 30)}]"


def _enter_flag(arg: str) -> tuple[bool, Optional[str]]:
    flag = arg.strip().lower()
    if flag in ("1", "true", "yes", "enter", "press_enter", ""):
        return True, None
    if flag in ("0", "false", "no"):
        return False, None
    return True, f"the third argument of 'type' must be 1 or 0, got [{_clip(arg, 20)}]"


def _build(kind: str, args: list[str]) -> ParseResult:
    """The action of ``kind`` with its bracketed ``args``, or why they do not fit."""
    arity = {"click": (1, 1), "hover": (1, 1), "type": (2, 3), "press": (1, 1), "scroll": (1, 1), "goto": (1, 1),
             "tab_focus": (1, 1), "stop": (0, 1)}.get(kind, (0, 0))
    if err := _arity_error(kind, args, *arity):
        return ParseResult(None, err)
    if kind in ("click", "hover", "type"):
        eid, err = _element_id(kind, args[0])
        if err:
            return ParseResult(None, err)
        if kind != "type":
            return ParseResult(Action(kind, element_id=eid), None)
        enter, err = _enter_flag(args[2]) if len(args) == 3 else (True, None)
        return ParseResult(None, err) if err else ParseResult(
            Action("type", element_id=eid, text=args[1], press_enter=enter), None)
    arg = args[0].strip() if args else ""
    if kind == "press" and not arg:
        return ParseResult(None, "'press' needs a key combination, e.g. press [Enter] or press [Control+a]")
    if kind == "scroll" and arg.lower() not in ("up", "down"):
        return ParseResult(None, f"scroll takes [up] or [down], got [{_clip(args[0], 20)}]")
    if kind == "goto" and not arg:
        return ParseResult(None, "'goto' needs a URL, e.g. goto [http://...]")
    if kind == "tab_focus":
        if not arg.isdigit():
            return ParseResult(None, f"'tab_focus' needs a tab number like [0], got [{_clip(arg, 20)}]")
        return ParseResult(Action("tab_focus", number=int(arg)), None)
    if kind in ("press", "goto", "stop"):
        return ParseResult(Action(kind, text=arg), None)
    if kind == "scroll":
        return ParseResult(Action("scroll", text=arg.lower()), None)
    return ParseResult(Action(kind), None)  # go_back, go_forward, new_tab, close_tab


def parse_one(text: str) -> ParseResult:
    """Parse a single action string such as ``click [12]``."""
    raw = _clean_raw(text)
    if not raw:
        return ParseResult(None, "the action is empty; use one of: " + USAGE)
    kind, rest, err = _split_head(raw)
    if err or kind is None:
        return ParseResult(None, err)
    if rest.strip() and not rest.strip().startswith("["):
        return ParseResult(None, f"could not read the arguments of '{_clip(raw)}': put each one in [brackets], "
                                 f"e.g. {_example(kind)}")
    args, tail = _bracket_args(rest)
    if tail:
        return ParseResult(None, f"could not read the arguments of '{_clip(raw)}': put each one in [brackets]")
    return _build(kind, args)


def _example(kind: str) -> str:
    return {"click": "click [12]", "hover": "hover [12]", "type": "type [12] [blue mug] [1]", "press": "press [Enter]",
            "scroll": "scroll [down]", "goto": "goto [http://...]", "tab_focus": "tab_focus [0]",
            "stop": "stop [answer]"}.get(kind, kind)


def parse_action(reply: str) -> ParseResult:
    """The one action a model reply asks for, or why there is none."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, "the reply is empty; end it with one line 'Action: <action>'")
    lines = [m.group(1).strip() for m in _ACTION_LINE.finditer(reply)]
    lines = [ln for ln in lines if ln.strip()] or lines
    if lines:
        results = [parse_one(ln) for ln in lines]
        distinct = {r.action if r.ok else ("?", " ".join(ln.split())) for r, ln in zip(results, lines)}
        if len(distinct) > 1:
            return ParseResult(None, "one action per turn, but the reply has several different Action lines")
        return results[-1]
    fences = [f.strip() for f in _FENCE.findall(reply) if f.strip()]
    if fences:
        return parse_one(fences[-1].splitlines()[0] if len(fences[-1].splitlines()) == 1 else fences[-1])
    stripped = reply.strip()
    if "\n" not in stripped:
        r = parse_one(stripped)
        if r.ok:
            return r
    return ParseResult(None, "no action found; end your reply with one line 'Action: <action>', e.g. Action: click [12]")
