"""WebArena config evaluators: ``string_match`` (exact / must_include / fuzzy), ``url_match``, ``program_html``.

A task's score is the product of the evaluators listed in ``eval.eval_types`` (each 0 or 1), as in WebArena.
The logic here is pure: the browser part of ``program_html`` (reading a page) is a callable the env passes in,
and ``fuzzy_match`` asks a ``Judge`` (an OpenAI-compatible chat endpoint). Without a judge, a task that needs
one is *not scored*: ``needs_judge(config)`` lets the env skip such tasks up front with a clear message.

Config fields used (WebArena's format)::

    "eval": {"eval_types": ["string_match", "url_match", "program_html"],
             "reference_answers": {"exact_match": "...", "must_include": [...], "fuzzy_match": [...] | "N/A"},
             "reference_url": "__SHOP__/cart |OR| __SHOP__/checkout", "url_note": "GOLD in PRED",
             "program_html": [{"url": "last" | "__SHOP__/cart", "locator": "" | "document.querySelector(...)...",
                               "required_contents": {"exact_match": "..."} | {"must_include": ["a |OR| b", ...]}}]}
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, unquote, urlparse

EVAL_TYPES = ("string_match", "url_match", "program_html")
OR = " |OR| "

FetchFn = Callable[[str, str], str]  # (url or "last", JS locator or "") -> text


class EvalConfigError(ValueError):
    """A task config the evaluators cannot use."""


class JudgeUnavailable(RuntimeError):
    """A fuzzy_match needs an LLM judge and none is configured."""


NO_JUDGE_MESSAGE = (
    "this task's string_match uses fuzzy_match, which needs an LLM judge; none is configured, so the task is "
    "not scored. Set SI_JUDGE_URL (an OpenAI-compatible base URL such as http://127.0.0.1:8000/v1), "
    "SI_JUDGE_MODEL and, if needed, SI_JUDGE_API_KEY, or pass judge_url=... to the env"
)


def clean(s: Any) -> str:
    """WebArena-style answer normalisation: trim, lower case, drop surrounding quotes and final period."""
    t = str(s).strip().lower()
    t = t.strip("\"'`").strip()
    t = t.rstrip(".").strip()
    return " ".join(t.split())


def exact_match(ref: str, pred: str) -> float:
    return float(clean(ref) == clean(pred))


_TOKEN = re.compile(r"\w+(?:[.,'\-]\w+)*")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def must_include(ref: str, pred: str) -> float:
    """``ref`` (or one of its ``|OR|`` alternatives) occurs in ``pred`` after normalisation. A one-word reference
    must be a whole word of the answer (as WebArena does), so "3" is not found in "13" or "3.5"."""
    p = clean(pred)

    def found(alt: str) -> bool:
        a = clean(alt)
        words = _tokens(a)
        if len(words) == 1 and words[0] == a:
            return a in _tokens(p)
        return a in p

    return float(any(found(alt) for alt in str(ref).split(OR)))


@dataclass
class EvalResult:
    score: float
    details: list[str] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return self.score >= 1.0


# --- LLM judge ------------------------------------------------------------------------------------------------
class Judge:
    """fuzzy_match through an OpenAI-compatible ``/chat/completions`` endpoint (a "correct"/"incorrect" verdict)."""

    def __init__(self, url: str, model: str = "gpt-4o-mini", api_key: str | None = None, timeout_s: float = 60.0):
        if not url:
            raise ValueError("judge url is empty")
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls, url: str | None = None, model: str | None = None) -> Optional["Judge"]:
        url = url or os.environ.get("SI_JUDGE_URL")
        if not url:
            return None
        return cls(url, model or os.environ.get("SI_JUDGE_MODEL", "gpt-4o-mini"), os.environ.get("SI_JUDGE_API_KEY"))

    def _ask(self, prompt: str) -> str:
        import httpx

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = {"model": self.model, "temperature": 0, "max_tokens": 256,
                "messages": [{"role": "system", "content": "You are a careful grader."},
                             {"role": "user", "content": prompt}]}
        r = httpx.post(self.url + "/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])

    def fuzzy(self, intent: str, reference: str, answer: str) -> float:
        prompt = (
            "Decide whether a student's answer to a question matches the reference answer in meaning. "
            "Extra detail is fine if it does not contradict the reference.\n"
            f"question: {intent}\nreference answer: {reference}\nstudent answer: {answer}\n"
            "Reply with one word: correct, incorrect or partially correct."
        )
        return verdict_score(self._ask(prompt))

    def unachievable(self, intent: str, answer: str) -> float:
        prompt = (
            "A task was judged unachievable. Decide whether the agent's final answer also says the task cannot be "
            "done (for any reason).\n"
            f"task: {intent}\nagent answer: {answer}\nReply with one word: same or different."
        )
        v = self._ask(prompt).strip().lower()
        return float(v.startswith("same") or ("same" in v and "different" not in v))


def verdict_score(text: str) -> float:
    """1.0 for a plain "correct" verdict; "incorrect" and "partially correct" score 0."""
    v = text.strip().lower()
    if "incorrect" in v or "partially" in v:
        return 0.0
    return float("correct" in v)


# --- config checks -----------------------------------------------------------------------------------------------
def needs_judge(config: dict[str, Any]) -> bool:
    ev = config.get("eval") or {}
    if "string_match" not in (ev.get("eval_types") or []):
        return False
    return "fuzzy_match" in (ev.get("reference_answers") or {})


def validate_config(config: dict[str, Any]) -> None:
    """Raise ``EvalConfigError`` for configs the evaluators cannot score."""
    tid = config.get("task_id", "?")
    ev = config.get("eval")
    if not isinstance(ev, dict):
        raise EvalConfigError(f"task {tid}: missing 'eval' object")
    types = ev.get("eval_types")
    if not isinstance(types, list) or not types:
        raise EvalConfigError(f"task {tid}: eval.eval_types must be a non-empty list")
    for t in types:
        if t not in EVAL_TYPES:
            raise EvalConfigError(f"task {tid}: unknown eval type {t!r} (supported: {', '.join(EVAL_TYPES)})")
    if "string_match" in types:
        ra = ev.get("reference_answers")
        if not isinstance(ra, dict) or not set(ra) & {"exact_match", "must_include", "fuzzy_match"}:
            raise EvalConfigError(f"task {tid}: string_match needs reference_answers with exact_match, "
                                  "must_include or fuzzy_match")
    if "url_match" in types and not ev.get("reference_url"):
        raise EvalConfigError(f"task {tid}: url_match needs eval.reference_url")
    if "program_html" in types:
        targets = ev.get("program_html")
        if not isinstance(targets, list) or not targets:
            raise EvalConfigError(f"task {tid}: program_html needs a non-empty eval.program_html list")
        for t in targets:
            if str(t.get("url", "")).startswith("func:") or str(t.get("locator", "")).startswith("func:"):
                raise EvalConfigError(f"task {tid}: program_html 'func:' helpers (WebArena's site-specific Python "
                                      "helpers) are not supported")
            rc = t.get("required_contents")
            if not isinstance(rc, dict) or not set(rc) & {"exact_match", "must_include"}:
                raise EvalConfigError(f"task {tid}: program_html targets need required_contents with exact_match "
                                      "or must_include")


# --- evaluators ----------------------------------------------------------------------------------------------------
def string_match(config: dict[str, Any], answer: str, judge: Optional[Judge]) -> EvalResult:
    ra = (config.get("eval") or {}).get("reference_answers") or {}
    score, details = 1.0, []
    if "exact_match" in ra:
        s = exact_match(ra["exact_match"], answer)
        details.append(f"exact_match {ra['exact_match']!r}: {s:g}")
        score *= s
    if "must_include" in ra:
        for ref in ra["must_include"]:
            s = must_include(ref, answer)
            details.append(f"must_include {ref!r}: {s:g}")
            score *= s
    if "fuzzy_match" in ra:
        if judge is None:
            raise JudgeUnavailable(NO_JUDGE_MESSAGE)
        fm = ra["fuzzy_match"]
        intent = str(config.get("intent", ""))
        if fm == "N/A":
            s = judge.unachievable(intent, answer)
            details.append(f"fuzzy_match N/A (unachievable): {s:g}")
            score *= s
        else:
            for ref in fm if isinstance(fm, list) else [fm]:
                s = judge.fuzzy(intent, str(ref), answer)
                details.append(f"fuzzy_match {ref!r}: {s:g}")
                score *= s
    return EvalResult(score, details)


def _split_url(u: str) -> tuple[str, dict[str, list[str]]]:
    p = urlparse(unquote(u.strip()))
    path = (p.netloc + p.path).rstrip("/")
    return path, parse_qs(p.query)


def url_match_score(reference_url: str, pred_url: str) -> float:
    """1.0 if some ``|OR|`` alternative's host+path equals the page's and its query values are all present."""
    pred_path, pred_q = _split_url(pred_url)
    for ref in str(reference_url).split(OR):
        ref_path, ref_q = _split_url(ref)
        if ref_path != pred_path:
            continue
        if all(set(v) <= set(pred_q.get(k, [])) for k, v in ref_q.items()):
            return 1.0
    return 0.0


def content_score(required: dict[str, Any], text: str) -> tuple[float, list[str]]:
    details: list[str] = []
    score = 1.0
    if "exact_match" in required:
        s = exact_match(required["exact_match"], text)
        details.append(f"exact_match {required['exact_match']!r}: {s:g}")
        score *= s
    if "must_include" in required:
        for ref in required["must_include"]:
            s = must_include(ref, text)
            details.append(f"must_include {ref!r}: {s:g}")
            score *= s
    return score, details


def program_html(config: dict[str, Any], fetch: FetchFn) -> EvalResult:
    score, details = 1.0, []
    for t in (config.get("eval") or {}).get("program_html") or []:
        url, locator = str(t.get("url", "last")), str(t.get("locator", ""))
        try:
            text = fetch(url, locator)
        except Exception as exc:  # noqa: BLE001  (a page that cannot be read scores 0)
            details.append(f"program_html {url}: could not read the page ({type(exc).__name__}: {exc})")
            return EvalResult(0.0, details)
        s, d = content_score(t.get("required_contents") or {}, "" if text is None else str(text))
        details += [f"program_html {url}: {x}" for x in d]
        score *= s
    return EvalResult(score, details)


def evaluate(config: dict[str, Any], answer: str, final_url: str, fetch: FetchFn,
             judge: Optional[Judge] = None, substitute: Callable[[str], str] = lambda s: s) -> EvalResult:
    """Score a finished episode. ``substitute`` replaces site placeholders (``__SHOP__``) in reference URLs.

    Raises ``JudgeUnavailable`` when a fuzzy_match needs a judge and none was given.
    """
    ev = config.get("eval") or {}
    score, details = 1.0, []
    for t in ev.get("eval_types") or []:
        if t == "string_match":
            r = string_match(config, answer, judge)
        elif t == "url_match":
            ref = OR.join(substitute(u) for u in str(ev.get("reference_url", "")).split(OR))
            s = url_match_score(ref, final_url)
            r = EvalResult(s, [f"url_match {ev.get('reference_url')!r} vs {final_url!r}: {s:g}"])
        elif t == "program_html":
            r = program_html(config, lambda url, loc: fetch(url if url == "last" else substitute(url), loc))
        else:
            raise EvalConfigError(f"unknown eval type {t!r}")
        score *= r.score
        details += r.details
    return EvalResult(score, details)


def load_configs(path: str) -> list[dict[str, Any]]:
    """Task configs from a JSON file (a list or one object) or a directory of ``*.json`` files (WebArena's layout)."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.json"), key=lambda f: (len(f.stem), f.stem))
        out = []
        for f in files:
            d = json.loads(f.read_text())
            out += d if isinstance(d, list) else [d]
        return out
    if not p.is_file():
        raise FileNotFoundError(f"task config {path} does not exist")
    d = json.loads(p.read_text())
    return d if isinstance(d, list) else [d]
