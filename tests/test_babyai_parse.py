from envs.babyai.parse import ParseResult, normalize, parse_action

AVAILABLE = [
    "turn left",
    "turn right",
    "move forward",
    "pick up",
    "go to red ball 1",
    "pick up red ball 1",
    "go to grey key 1",
    "go to grey key 2",
]


def ok(reply, expected, available=AVAILABLE):
    res = parse_action(reply, available)
    assert res == ParseResult(expected, None), (reply, res)


def bad(reply, fragment="", available=AVAILABLE):
    res = parse_action(reply, available)
    assert res.action is None and res.error, (reply, res)
    assert fragment in res.error, (reply, res.error)
    return res.error


def test_action_line():
    ok("Thought: the ball is ahead.\nAction: go to red ball 1", "go to red ball 1")
    ok("action:   Go To  Red Ball 1.", "go to red ball 1")
    ok("**Action:** turn right!", "turn right")
    ok("Action: `move forward`", "move forward")
    ok("Action:\nturn left", "turn left")
    ok("I look around. Action: turn left", "turn left")
    ok("Action: go to the red ball 1", "go to red ball 1")  # articles are ignored


def test_action_line_tolerates_extra_words():
    ok("Action: I will go to red ball 1 now", "go to red ball 1")


def test_bare_phrase():
    ok("turn left", "turn left")
    ok("  Move forward.  ", "move forward")
    ok("The red ball is close, so pick up red ball 1", "pick up red ball 1")


def test_longest_match():
    # "pick up red ball 1" contains "pick up" and ends with ... "red ball 1": only one action counts
    ok("pick up red ball 1", "pick up red ball 1")
    ok("Action: pick up red ball 1", "pick up red ball 1")
    ok("Action: pick up", "pick up")
    # "grey key 1" must not match inside "grey key 12"
    bad("Action: go to grey key 12", "not an available action")
    # a prefix action followed by an object is not that prefix action
    bad("Action: pick up red ball 2", "not an available action")
    bad("pick up the blue key 1", "no action found")
    ok("pick up", "pick up")


def test_missing_index_resolved_only_if_unique():
    ok("Action: go to red ball", "go to red ball 1")
    bad("Action: go to grey key", "ambiguous")


def test_malformed():
    bad("", "empty")
    bad("   \n ", "empty")
    bad("I am not sure what to do.", "no action found")
    bad("Action:", "empty")
    bad("Action: dance", "not an available action")


def test_two_different_actions():
    bad("Action: turn left\nAction: turn right", "one action per turn")
    bad("Action: turn left\nAction: fly", "one action per turn")
    bad("turn left and then move forward", "one action per turn")
    # repeating the same action is fine
    ok("Action: turn left\nAction: Turn left.", "turn left")
    # echoing the available-actions list does not count as an Action line
    bad("Available actions: turn left, turn right", "one action per turn")
    ok("Available actions: turn left, turn right\nAction: turn right", "turn right")


def test_not_available():
    err = bad("Action: go to blue box 1", "not an available action")
    assert "go to blue box 1" in err
    bad("Action: pick up grey key 1", available=["turn left", "go to grey key 1"])


def test_normalize():
    assert normalize("  Go_To THE Red-Ball 1. ") == "go to red ball 1"
