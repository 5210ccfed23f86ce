"""Every env's action parser runs in linear time on hostile replies (issue 18: 100k spaces took 14 s in BabyAI,
50k newlines 30 s in TextCraft, and held the GIL so /health stalled).

For each parser and each input shape we time the parse at n and at 10 n characters (best of three, CPU time)
and require the big input to cost at most 30x the small one: linear code gives ~10x, the old quadratic
patterns gave ~100x (and took seconds). A generous absolute bound (2 s for ~100k characters) guards against a
parser that is linear but absurdly slow.
"""

from __future__ import annotations

import time

import pytest

from envs import react
from envs.babyai import parse as babyai
from envs.searchqa import parse as searchqa
from envs.textcraft import parse as textcraft
from envs.web import actions as web

AVAILABLE = ["turn left", "turn right", "move forward", "pick up", "drop", "toggle", "go to red ball 1",
             "pick up red ball 1", "open blue door 1", "go through blue door 1"]

PARSERS = {
    "babyai": lambda s: babyai.parse_action(s, AVAILABLE),
    "textcraft": textcraft.parse_action,
    "react": react.extract_action,
    "web": web.parse_action,
    "searchqa": searchqa.parse_reply,
}

# input shapes, each a function of a repeat count n (the reply has ~n to ~10n characters)
SHAPES = {
    "spaces": lambda n: "x" + " " * n + "y",
    "newlines": lambda n: "\n" * n + "x",
    "action_spaces": lambda n: "Action" + " " * n + "y",
    "action_trailing_spaces": lambda n: "Action: turn left" + " " * n + "x",
    "action_line_spaces": lambda n: "Action:" + " \t" * n,
    "many_action_lines": lambda n: "Action: turn left\n" * (n // 18),
    "emphasis": lambda n: "*" * n + "x",
    "dots": lambda n: "." * n + "x",
    "mentions": lambda n: "turn left " * (n // 10),
    "brackets": lambda n: "click " + "[a] x" * (n // 5),
    "bracket_args": lambda n: "stop " + "[a] " * (n // 4),
    "fences": lambda n: "```" * (n // 3),
    "open_tags": lambda n: "<search>" * (n // 8),
    "think_tags": lambda n: "<think>" * (n // 7),
    "mixed_tags": lambda n: "<search>a</answer>" * (n // 18),
}

SMALL = 10_000
RATIO = 30.0
ABS_LIMIT_S = 2.0


def _cpu_time(fn, text: str) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn(text)
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_parsers_scale_linearly(parser):
    fn = PARSERS[parser]
    report = []
    for shape, make in SHAPES.items():
        small, big = make(SMALL), make(10 * SMALL)
        fn(small)  # warm up (regex compilation, caches)
        t_small, t_big = _cpu_time(fn, small), _cpu_time(fn, big)
        # a floor of 1 ms on the small input: below it the clock's resolution dominates the ratio
        ratio = t_big / max(t_small, 1e-3)
        report.append(f"{shape}: {len(big)} chars {t_big * 1e3:.1f} ms (x{ratio:.1f} of {len(small)})")
        assert t_big < ABS_LIMIT_S, f"{parser} on {shape}: {t_big:.2f} s for {len(big)} characters"
        assert ratio < RATIO, f"{parser} on {shape}: 10x the input cost {ratio:.0f}x the time (quadratic?)"
    print(f"\n{parser}: " + "; ".join(report))


def test_issue_inputs_parse_quickly_and_explain():
    """The two inputs of the report: a BabyAI reply of 100k spaces, a TextCraft reply of 50k newlines."""
    t0 = time.process_time()
    r1 = babyai.parse_action("Action:" + " " * 100_000 + "turn left", AVAILABLE)
    r2 = textcraft.parse_action("\n" * 50_000 + "Action: inventory")
    r3 = babyai.parse_action(" " * 100_000, AVAILABLE)
    took = time.process_time() - t0
    assert r1.action == "turn left" and r2.action == "inventory"
    assert not r3.ok and "empty" in r3.error
    assert took < 1.0, f"{took:.2f} s"


def test_rewritten_parsers_keep_their_rules():
    """The linear rewrites pair tags and split brackets exactly like the old patterns did."""
    p = searchqa.parse_reply
    assert p("<think>x <search>no</search></think><search> capital  of France </search>").action == \
        searchqa.Action("search", "capital of France")
    assert p("<search>a <answer>b</search>").action == searchqa.Action("search", "a <answer>b")
    assert p("<think>open <SEARCH>q</Search>").action == searchqa.Action("search", "q")  # unclosed think stays
    assert "not closed" in p("<answer>Paris").error
    assert "a search and an answer" in p("<search>a</search><answer>b</answer>").error
    assert web.parse_one("stop [the answer is [3] ok]").action.text == "the answer is [3] ok"
    assert web.parse_one("type [4] [a] b] [0]").action == web.Action("type", element_id=4, text="a] b",
                                                                       press_enter=False)
    assert web.parse_action("**Action:** click [12]  \n").action == web.Action("click", element_id=12)
    assert "takes 1 bracketed" in web.parse_one("click [1] [2]").error
    assert react.extract_action("> **Action:**  inventory.  ").action == "inventory"
    assert react.extract_action("Action:\n\n  get 1 oak log").action == "get 1 oak log"
    assert babyai.parse_action("I will go to the red ball 1 now", AVAILABLE).action == "go to red ball 1"
    assert babyai.parse_action("Action **: pick up red ball", AVAILABLE).action == "pick up red ball 1"
