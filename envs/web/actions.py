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

KINDS = ("click", "type", "hover", "press", "scroll", "goto", "go_back", "go_forward", "new_tab", "tab_focus",
         "close_tab", "stop")
_ALIASES = {"goback": "go_back", "go back": "go_back", "goforward": "go_forward", "go forward": "go_forward",
            "newtab": "new_tab", "new tab": "new_tab", "tabfocus": "tab_focus", "closetab": "close_tab",
            "close tab": "close_tab", "tab focus": "tab_focus"}

_ACTION_LINE = re.compile(r"^[ \t>*_#-]*action[*_]*\s*:[*_]*\s*(.*?)\s*$", re.IGNORECASE | re.MULTILINE)
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


@dataclass(frozen=True)
class ParseResult:
    action: Optional[Action]
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.action is not None


def _clip(s: str, n: int = 80) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _bracket_args(rest: str) -> tuple[list[str], str]:
    """Split ``[a] [b c] [d]`` into ["a", "b c", "d"]; returns (args, unparsed tail).

    The last argument may itself contain ``]`` (an answer or a typed text): it runs to the last ``]``.
    """
    args: list[str] = []
    s = rest.strip()
    while s.startswith("["):
        last = s.rfind("]")
        nxt = s.find("]")
        if nxt < 0:
            return args, s
        # an argument ends at the first "]" that is followed by whitespace + "[" or by the end of text
        end = nxt
        while True:
            tail = s[end + 1 :].lstrip()
            if tail == "" or tail.startswith("["):
                break
            more = s.find("]", end + 1)
            if more < 0:
                end = last
                break
            end = more
        args.append(s[1:end])
        s = s[end + 1 :].strip()
    return args, s


def parse_one(text: str) -> ParseResult:
    """Parse a single action string such as ``click [12]``."""
    raw = text.strip().strip("`").strip()
    raw = re.sub(r"^[*_]+|[*_]+$", "", raw).strip()
    if raw.endswith(".") and not raw.endswith("].") and "[" not in raw:
        raw = raw[:-1]
    if raw.endswith("]."):
        raw = raw[:-1]
    if not raw:
        return ParseResult(None, "the action is empty; use one of: " + USAGE)
    m = _HEAD.match(raw)
    if not m:
        return ParseResult(None, f"'{_clip(raw)}' is not an action; use one of: {USAGE}")
    head = m.group(1).lower()
    rest = raw[m.end() :]
    two = re.match(r"^\s+([a-zA-Z]+)", rest)
    if two and f"{head} {two.group(1).lower()}" in _ALIASES:
        head = f"{head} {two.group(1).lower()}"
        rest = rest[two.end() :]
    kind = _ALIASES.get(head, head)
    if kind not in KINDS:
        return ParseResult(None, f"unknown action '{_clip(head, 30)}'; use one of: {USAGE}")
    if rest.strip() and not rest.strip().startswith("["):
        return ParseResult(None, f"could not read the arguments of '{_clip(raw)}': put each one in [brackets], "
                                 f"e.g. {_example(kind)}")
    args, tail = _bracket_args(rest)
    if tail:
        return ParseResult(None, f"could not read the arguments of '{_clip(raw)}': put each one in [brackets]")

    def need(n_min: int, n_max: int) -> Optional[str]:
        if not n_min <= len(args) <= n_max:
            want = f"{n_min}" if n_min == n_max else f"{n_min} to {n_max}"
            return f"'{kind}' takes {want} bracketed argument(s), got {len(args)}: e.g. {_example(kind)}"
        return None

    def element() -> Optional[int]:
        s = args[0].strip().lstrip("#")
        return int(s) if s.isdigit() else None

    if kind in ("click", "hover"):
        if err := need(1, 1):
            return ParseResult(None, err)
        eid = element()
        if eid is None:
            return ParseResult(None, f"'{kind}' needs a numeric element id like [12], got [{_clip(args[0], 30)}]")
        return ParseResult(Action(kind, element_id=eid), None)
    if kind == "type":
        if err := need(2, 3):
            return ParseResult(None, err)
        eid = element()
        if eid is None:
            return ParseResult(None, f"'type' needs a numeric element id like [12], got [{_clip(args[0], 30)}]")
        enter = True
        if len(args) == 3:
            flag = args[2].strip().lower()
            if flag in ("1", "true", "yes", "enter", "press_enter", ""):
                enter = True
            elif flag in ("0", "false", "no"):
                enter = False
            else:
                return ParseResult(None, f"the third argument of 'type' must be 1 or 0, got [{_clip(args[2], 20)}]")
        return ParseResult(Action("type", element_id=eid, text=args[1], press_enter=enter), None)
    if kind == "press":
        if err := need(1, 1):
            return ParseResult(None, err)
        if not args[0].strip():
            return ParseResult(None, "'press' needs a key combination, e.g. press [Enter] or press [Control+a]")
        return ParseResult(Action("press", text=args[0].strip()), None)
    if kind == "scroll":
        if err := need(1, 1):
            return ParseResult(None, err)
        d = args[0].strip().lower()
        if d not in ("up", "down"):
            return ParseResult(None, f"scroll takes [up] or [down], got [{_clip(args[0], 20)}]")
        return ParseResult(Action("scroll", text=d), None)
    if kind == "goto":
        if err := need(1, 1):
            return ParseResult(None, err)
        url = args[0].strip()
        if not url:
            return ParseResult(None, "'goto' needs a URL, e.g. goto [http://...]")
        return ParseResult(Action("goto", text=url), None)
    if kind == "tab_focus":
        if err := need(1, 1):
            return ParseResult(None, err)
        s = args[0].strip()
        if not s.isdigit():
            return ParseResult(None, f"'tab_focus' needs a tab number like [0], got [{_clip(s, 20)}]")
        return ParseResult(Action("tab_focus", number=int(s)), None)
    if kind == "stop":
        if err := need(0, 1):
            return ParseResult(None, err)
        return ParseResult(Action("stop", text=args[0].strip() if args else ""), None)
    if err := need(0, 0):  # go_back, go_forward, new_tab, close_tab
        return ParseResult(None, err)
    return ParseResult(Action(kind), None)


def _example(kind: str) -> str:
    return {"click": "click [12]", "hover": "hover [12]", "type": "type [12] [blue mug] [1]", "press": "press [Enter]",
            "scroll": "scroll [down]", "goto": "goto [http://...]", "tab_focus": "tab_focus [0]",
            "stop": "stop [answer]"}.get(kind, kind)


def parse_action(reply: str) -> ParseResult:
    """The one action a model reply asks for, or why there is none."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, "the reply is empty; end it with one line 'Action: <action>'")
    lines = [m.group(1) for m in _ACTION_LINE.finditer(reply)]
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
