"""Pure logic of the web envs: action parser, evaluators, tree formatting, expert locators, task files."""

from __future__ import annotations

import json

import pytest

from envs.web import evaluators as ev
from envs.web.a11y import Snapshot, format_node, format_tree
from envs.web.actions import Action, parse_action, parse_one
from envs.web.env import normalize_keys
from envs.web.expert import find_element, resolve
from envs.web.tasks.build_tasks import HERE, build


# --- actions ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,expected", [
    ("I should open the cart.\nAction: click [12]", Action("click", element_id=12)),
    ("Action: type [4] [blue mug] [1]", Action("type", element_id=4, text="blue mug", press_enter=True)),
    ("Action: type [4] [blue mug] [0]", Action("type", element_id=4, text="blue mug", press_enter=False)),
    ("Action: type [4] [blue mug]", Action("type", element_id=4, text="blue mug", press_enter=True)),
    ("Action: type [4] [a [b] c] [0]", Action("type", element_id=4, text="a [b] c", press_enter=False)),
    ("Action: hover [7]", Action("hover", element_id=7)),
    ("Action: press [Control+a]", Action("press", text="Control+a")),
    ("Action: scroll [down]", Action("scroll", text="down")),
    ("Action: scroll [UP]", Action("scroll", text="up")),
    ("Action: goto [http://x.org/a?b=1]", Action("goto", text="http://x.org/a?b=1")),
    ("Action: go_back", Action("go_back")),
    ("action: go back", Action("go_back")),
    ("Action: go_forward", Action("go_forward")),
    ("Action: new_tab", Action("new_tab")),
    ("Action: tab_focus [1]", Action("tab_focus", number=1)),
    ("Action: close_tab", Action("close_tab")),
    ("Action: stop [$12.50]", Action("stop", text="$12.50")),
    ("Action: stop []", Action("stop", text="")),
    ("Action: stop", Action("stop", text="")),
    ("Action: stop [the answer is [x] here]", Action("stop", text="the answer is [x] here")),
    ("**Action:** `click [3]`", Action("click", element_id=3)),
    ("Let's think.\n```click [5]```", Action("click", element_id=5)),
    ("In summary, the next action I will perform is ```\nstop [42]\n```", Action("stop", text="42")),
    ("click [9]", Action("click", element_id=9)),
    ("Action: click [3]\nAction: click [3]", Action("click", element_id=3)),
])
def test_parse_good(reply, expected):
    r = parse_action(reply)
    assert r.ok, r.error
    assert r.action == expected


@pytest.mark.parametrize("reply,fragment", [
    ("", "empty"),
    ("I do not know what to do.", "no action found"),
    ("Action: click [3]\nAction: click [4]", "one action per turn"),
    ("Action: click [abc]", "numeric element id"),
    ("Action: click 12", "bracket"),
    ("Action: jump [3]", "unknown action"),
    ("Action: scroll [left]", "scroll takes"),
    ("Action: type [3]", "takes 2 to 3"),
    ("Action: type [3] [x] [maybe]", "1 or 0"),
    ("Action: tab_focus [x]", "tab number"),
    ("Action: goto []", "needs a URL"),
    ("Action: go_back [1]", "takes 0"),
    ("Action:", "empty"),
])
def test_parse_bad(reply, fragment):
    r = parse_action(reply)
    assert not r.ok and r.action is None
    assert fragment in r.error


def test_render_roundtrip():
    for text in ("click [3]", "type [4] [hello world] [0]", "press [Enter]", "scroll [down]", "goto [http://a/b]",
                 "go_back", "tab_focus [2]", "stop [yes]", "stop []"):
        a = parse_one(text).action
        assert a is not None and parse_one(a.render()).action == a


def test_normalize_keys():
    assert normalize_keys("ctrl+a") == "Control+a"
    assert normalize_keys("Enter") == "Enter"
    assert normalize_keys("shift+tab") == "Shift+Tab"


# --- evaluators ------------------------------------------------------------------------------------------------------
def test_string_match():
    assert ev.exact_match("Shipped", " shipped. ") == 1.0
    assert ev.exact_match("Shipped", "it is shipped") == 0.0
    assert ev.must_include("12.50", "The price is $12.50") == 1.0
    assert ev.must_include("12.50", "The price is $12.05") == 0.0
    assert ev.must_include("cat |OR| dog", "a DOG") == 1.0
    cfg = {"eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": ["a", "b"]}}}
    assert ev.evaluate(cfg, "a and b", "", None).score == 1.0
    assert ev.evaluate(cfg, "a only", "", None).score == 0.0


def test_url_match():
    assert ev.url_match_score("http://h/shop/category/x?sort=price", "http://h/shop/category/x?sort=price&p=1") == 1
    assert ev.url_match_score("http://h/shop/category/x?sort=price", "http://h/shop/category/x") == 0
    assert ev.url_match_score("http://h/shop/cart", "http://h/shop/cart/") == 1
    assert ev.url_match_score("http://h/a |OR| http://h/b", "http://h/b") == 1
    assert ev.url_match_score("http://h/a", "http://h/ab") == 0
    cfg = {"eval": {"eval_types": ["url_match"], "reference_url": "__SHOP__/search?q=pens"}}
    r = ev.evaluate(cfg, "", "http://h/e/k/shop/search?q=pens", None, substitute=lambda s: s.replace("__SHOP__", "http://h/e/k/shop"))
    assert r.score == 1.0


def test_program_html_uses_fetch():
    cfg = {"eval": {"eval_types": ["program_html"], "program_html": [
        {"url": "__X__/cart", "locator": "q", "required_contents": {"must_include": ["Mug", "$25.00"]}},
        {"url": "last", "locator": "", "required_contents": {"exact_match": "13 points"}}]}}
    pages = {("http://h/cart", "q"): "Blue Mug 2 $25.00", ("last", ""): "13 points"}
    sub = lambda s: s.replace("__X__", "http://h")  # noqa: E731
    assert ev.evaluate(cfg, "", "", lambda u, loc: pages[(u, loc)], substitute=sub).score == 1.0
    pages[("last", "")] = "12 points"
    assert ev.evaluate(cfg, "", "", lambda u, loc: pages[(u, loc)], substitute=sub).score == 0.0

    def boom(u, loc):
        raise RuntimeError("page gone")

    r = ev.evaluate(cfg, "", "", boom, substitute=sub)
    assert r.score == 0.0 and "could not read" in r.details[0]


def test_fuzzy_needs_judge():
    cfg = {"intent": "q", "eval": {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": ["x"]}}}
    assert ev.needs_judge(cfg)
    with pytest.raises(ev.JudgeUnavailable, match="SI_JUDGE_URL"):
        ev.evaluate(cfg, "x", "", None)

    class FakeJudge:  # the judge's HTTP side is exercised in test_web_judge_endpoint
        def fuzzy(self, intent, ref, ans):
            return 1.0 if ans == ref else 0.0

    assert ev.evaluate(cfg, "x", "", None, judge=FakeJudge()).score == 1.0
    assert ev.verdict_score("Correct") == 1.0
    assert ev.verdict_score("partially correct") == 0.0
    assert ev.verdict_score("incorrect") == 0.0


def test_judge_endpoint(monkeypatch):
    """Judge talks OpenAI chat-completions to a real HTTP server (a tiny local one)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = {}

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["path"], seen["body"] = self.path, body
            verdict = "correct" if "student answer: 42" in body["messages"][-1]["content"] else "incorrect"
            out = json.dumps({"choices": [{"message": {"content": verdict}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SI_JUDGE_URL", f"http://127.0.0.1:{srv.server_port}/v1")
        judge = ev.Judge.from_env()
        assert judge is not None
        assert judge.fuzzy("what?", "forty-two", "42") == 1.0
        assert judge.fuzzy("what?", "forty-two", "41") == 0.0
        assert seen["path"] == "/v1/chat/completions" and seen["body"]["temperature"] == 0
    finally:
        srv.shutdown()


def test_validate_config():
    good = {"task_id": 1, "eval": {"eval_types": ["url_match"], "reference_url": "x"}}
    ev.validate_config(good)
    with pytest.raises(ev.EvalConfigError, match="unknown eval type"):
        ev.validate_config({"eval": {"eval_types": ["magic"]}})
    with pytest.raises(ev.EvalConfigError, match="func:"):
        ev.validate_config({"eval": {"eval_types": ["program_html"], "program_html": [
            {"url": "func:reddit_get_post_url('__last_url__')", "locator": "", "required_contents": {"must_include": []}}]}})


# --- tree formatting and expert locators ----------------------------------------------------------------------------
def _snap(n, height=20, scroll=0.0):
    nodes = [{"d": 0, "id": i + 1, "role": "link", "name": f"item {i}", "props": {}, "top": i * height,
              "bottom": (i + 1) * height} for i in range(n)]
    return Snapshot(nodes, scroll, 100.0, "t")


def test_format_tree_cut_and_scroll():
    full = format_tree(_snap(5), 10_000)
    assert full.splitlines()[0] == "[1] link 'item 0'" and "more lines" not in full
    cut = format_tree(_snap(200), 300)
    assert len(cut) <= 300 + 60 and cut.endswith("scroll [down] to see them)")
    scrolled = format_tree(_snap(200), 300, " ")
    assert "[1] link" in scrolled
    s = _snap(200, scroll=400.0)
    text = format_tree(s, 300)
    assert text.startswith("(20 lines above") and "[21] link 'item 20'" in text


def test_format_node_props():
    n = {"d": 1, "id": 4, "role": "textbox", "name": "Name", "props": {"focused": True, "value": "bob"}}
    assert format_node(n) == " [4] textbox 'Name' focused value: 'bob'"
    assert format_node({"d": 0, "id": 2, "role": "checkbox", "name": "a", "props": {"checked": False}}) == \
        "[2] checkbox 'a' checked: false"


def test_expert_resolve():
    obs = "URL: x\nOBSERVATION:\n[1] link 'Home'\n[4] spinbutton 'Quantity' value: '1'\n[5] button 'Add to cart'"
    assert find_element(obs, "button", "Add to cart") == 5
    assert resolve("type [spinbutton 'Quantity'] [2] [0]", obs) == "type [4] [2] [0]"
    assert resolve("click [link 'Cart']", obs) is None
    assert resolve("stop [42]", obs) == "stop [42]"


# --- task files ---------------------------------------------------------------------------------------------------------
def test_task_files_match_builder_and_sizes():
    built = build()
    for site, tasks in built.items():
        on_disk = json.loads((HERE / f"{site}.json").read_text())
        assert on_disk == json.loads(json.dumps(tasks)), f"{site}.json is stale: python -m envs.web.tasks.build_tasks"
        assert len(tasks) >= 30
        splits = {t["split"] for t in tasks}
        assert splits == {"train", "test"}
        for t in tasks:
            ev.validate_config(t)
            assert t["expert"] and t["expert"][-1].startswith("stop")
            assert t["start_url"].startswith(("__SHOP__", "__FORUM__"))
        intents = [t["intent"] for t in tasks]
        assert len(set(intents)) == len(intents)


def test_one_word_must_include_matches_whole_words_only():
    # a count or rating answer: "3" must not be found inside "13" or "3.5" (an answer listing many numbers
    # would otherwise collect the reward)
    assert ev.must_include("3", "13") == 0.0
    assert ev.must_include("3", "3.5 stars") == 0.0
    assert ev.must_include("3", "There are 3 comments.") == 1.0
    assert ev.must_include("Shipped", "it was SHIPPED") == 1.0
    assert ev.must_include("blue mug", "a Blue Mug here") == 1.0  # several words: a phrase inside the answer
