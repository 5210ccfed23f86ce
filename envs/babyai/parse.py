"""Turn a model reply into one of the currently available action phrases (pure).

Rules, in order:

1. If the reply has ``Action: <phrase>`` (ReAct style; any case, markdown emphasis tolerated), the phrase
   after it is the action. Several ``Action:`` lines naming the same action count once; different ones
   are an error ("one action per turn").
2. Without an ``Action:`` line, the reply is accepted if exactly one distinct available phrase occurs in it
   (longest match first, so "pick up red ball 1" is not also counted as "pick up").

Phrases are compared after normalisation: lower case, single spaces, no surrounding quotes/brackets or
trailing punctuation, articles ("the", "a", "an") dropped. A phrase that names an object without its
index ("go to red ball") is accepted when exactly one available action fits.
"""

from __future__ import annotations

import re

from envs.react import ParseResult

# One character class between "action" and ":" (never two adjacent quantifiers that can trade characters), so a
# long run of spaces or emphasis costs linear time, not quadratic.
_ACTION_RE = re.compile(r"(?<![a-z])action[\s*_]*:\s*(.*)", re.IGNORECASE)
_NEXT_WORD = re.compile(r" *(\S+)")
_ARTICLES = {"the", "a", "an"}
_OBJECT_WORDS = {"red", "green", "blue", "purple", "yellow", "grey", "gray", "ball", "key", "box", "door", "object"}
_STRIP_CHARS = " \t\"'`*_<>[](){}.,;:!?"


def normalize(text: str) -> str:
    """Canonical form used for comparisons."""
    text = text.lower().replace("_", " ")
    words = re.findall(r"[a-z0-9]+", text)
    return " ".join(w for w in words if w not in _ARTICLES)


def _strip_index(phrase: str) -> str:
    """'go to red ball 1' -> 'go to red ball' (``phrase`` is normalized: single spaces)."""
    head, _, last = phrase.rpartition(" ")
    return head if head and last.isdigit() else phrase


def _find_mentions(text: str, canon: dict[str, str]) -> list[str]:
    """Distinct available actions mentioned in normalized ``text``, longest match first, no overlaps."""
    found: list[str] = []
    taken = [False] * len(text)
    for phrase in sorted(canon, key=len, reverse=True):
        if not phrase:
            continue
        for m in re.finditer(r"(?<![a-z0-9])" + re.escape(phrase) + r"(?![a-z0-9])", text):
            if any(taken[m.start() : m.end()]):
                continue
            nxt = _NEXT_WORD.match(text, m.end())  # the next word, without copying the rest of the text
            if nxt and (nxt.group(1) in _OBJECT_WORDS or nxt.group(1).isdigit()):
                continue  # "pick up red ball 2" is not the bare "pick up" when red ball 2 is unavailable
            for i in range(m.start(), m.end()):
                taken[i] = True
            if canon[phrase] not in found:
                found.append(canon[phrase])
    return found


def _match_phrase(phrase: str, canon: dict[str, str]) -> ParseResult:
    norm = normalize(phrase)
    if not norm:
        return ParseResult(None, "the Action line is empty")
    if norm in canon:
        return ParseResult(canon[norm], None)
    # "go to red ball" for "go to red ball 1" when it is the only red ball
    if not norm[-1].isdigit():
        fits = [a for n, a in canon.items() if _strip_index(n) == norm and n != norm]
        if len(fits) == 1:
            return ParseResult(fits[0], None)
        if len(fits) > 1:
            return ParseResult(None, f"'{phrase.strip()}' is ambiguous: say which one ({', '.join(fits)})")
    # an action phrase wrapped in extra words ("I will turn left now")
    mentions = _find_mentions(norm, canon)
    if len(mentions) == 1:
        return ParseResult(mentions[0], None)
    if len(mentions) > 1:
        return ParseResult(None, f"one action per turn, but the Action line names {len(mentions)}: "
                                 + ", ".join(mentions))
    return ParseResult(None, f"'{_clip(phrase)}' is not an available action")


def _clip(s: str, n: int = 60) -> str:
    s = " ".join(s.split()).strip(_STRIP_CHARS)
    return s if len(s) <= n else s[: n - 3] + "..."


def parse_action(reply: str, available: list[str]) -> ParseResult:
    """Pick the action a reply asks for, or explain why none can be taken."""
    if not isinstance(reply, str) or not reply.strip():
        return ParseResult(None, "the reply is empty")
    canon: dict[str, str] = {}
    for a in available:
        canon.setdefault(normalize(a), a)

    phrases = [m.group(1) for m in _ACTION_RE.finditer(reply)]
    if phrases:
        results = [_match_phrase(p, canon) for p in phrases]
        distinct = {r.action if r.ok else ("?", normalize(p)) for r, p in zip(results, phrases)}
        if len(distinct) > 1:
            return ParseResult(None, "one action per turn, but the reply has several different Action lines")
        return results[-1]

    mentions = _find_mentions(normalize(reply), canon)
    if len(mentions) == 1:
        return ParseResult(mentions[0], None)
    if len(mentions) > 1:
        return ParseResult(None, "one action per turn, but the reply mentions several: " + ", ".join(mentions[:4])
                           + ("..." if len(mentions) > 4 else "") + "; end with one line 'Action: <action>'")
    return ParseResult(None, "no action found; end your reply with one line 'Action: <action>'")
