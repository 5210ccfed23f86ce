"""The BabyAI expert (minigrid's BabyAIBot phrased as the env's actions), ``required_turns`` and the ``multistep``
preset."""

import random

import pytest

from envs.babyai import contract
from envs.babyai.env import BabyAIEnv
from envs.babyai.expert import PRIMITIVE_PHRASE, solve
from envs.babyai.presets import PRESETS
from envs.base import task_index

MULTISTEP = PRESETS["multistep"]["env"]["options"]["levels"]


def _drive(step, info, cap=60):
    """Follow ``contract.expert_action`` through ``step`` (a callable taking the reply text); (turns, last result)."""
    res, turns = None, 0
    for _ in range(cap):
        reply = contract.expert_action("", info)
        if reply is None:
            break
        res = step(reply)
        turns += 1
        assert res.info["valid_action"], (reply, res.observation)
        info = res.info
        if res.done:
            break
    return turns, res


def test_multistep_preset():
    p = PRESETS["multistep"]
    env = BabyAIEnv(MULTISTEP)
    assert len(env.levels) == 7
    assert [ph["turn_limit"] for ph in p["curriculum"]["phases"]] == [3, 6, 10]
    assert p["eval"]["n"] % len(env.levels) == 0  # the same number of held-out tasks per level
    assert "paper" in PRESETS and "multistep" not in str(PRESETS["paper"])


def test_multistep_rl_preset_is_the_measured_arm():
    """`--preset multistep-rl` resolves to the settings the rl-vs-warmstart `groups@10+expert0.6` arm ran with (the
    multistep preset plus the arm's overrides; the bench's own output, runtime and evaluation settings left aside)."""
    import sys
    from pathlib import Path

    from flows.config import build_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from rl_vs_warmstart import ARMS, BASE

    arm = [s for s in BASE + ARMS["groups@10+expert0.6"] if not s.startswith("env.runtime")]
    a = build_config("babyai", "multistep", arm + ["eval.turn_limit=10"]).model_dump()
    b = build_config("babyai", "multistep-rl").model_dump()
    assert b.pop("preset") == "multistep-rl" and a.pop("preset") == "multistep"
    assert a == b
    assert b["curriculum"]["phases"] == [{**b["curriculum"]["phases"][0], "turn_limit": 10, "steps": 12}]



def test_multistep_study_preset_is_the_recipe_on_the_curriculum():
    """`--preset multistep-study` is multistep-rl's recipe on 3 -> 6 -> 10 turns, 12 steps a phase, without the
    fits-turns filter (the study's scalinginter-fit arm adds it, so it must differ from scalinginter)."""
    from core.study import arm_overrides, arm_phases
    from flows.config import build_config

    rl = build_config("babyai", "multistep-rl").model_dump()
    st = build_config("babyai", "multistep-study").model_dump()
    assert st["rollout"]["task_filter"] == "none" and rl["rollout"]["task_filter"] == "fits_turns"
    assert [(p["turn_limit"], p["steps"]) for p in st["curriculum"]["phases"]] == [(3, 12), (6, 12), (10, 12)]
    for key in ("preset", "curriculum"):
        rl.pop(key), st.pop(key)
    rl["rollout"].pop("task_filter"), st["rollout"].pop("task_filter")
    assert rl == st  # the same recipe otherwise
    phases = build_config("babyai", "multistep-study").model_dump()["curriculum"]["phases"]
    assert [p["turn_limit"] for p in arm_phases(phases, "fixed-long")] == [10, 10, 10]
    assert sum(p["steps"] for p in arm_phases(phases, "fixed-short")) == 36
    fit = build_config("babyai", "multistep-study", arm_overrides("scalinginter-fit"))
    assert fit.rollout.task_filter == "fits_turns"

def test_multistep_sample_is_labelled_and_solved_within_its_label():
    """200 held-out tasks: every one gets a label, the expert solves >= 99 % of them through the env's text
    actions in exactly that many turns, and the labels spread over the turn-limit buckets."""
    env = BabyAIEnv(MULTISTEP)
    labels, solved = [], 0
    for i in range(200):
        _, info = env.reset(task_index("test", i))
        assert isinstance(info["required_turns"], int) and info["required_turns"] >= 1, info
        labels.append(info["required_turns"])
        turns, res = _drive(env.step, info, cap=info["required_turns"])
        solved += bool(res is not None and res.info["success"] and res.terminated and turns == info["required_turns"])
    assert env.label_failures == 0
    assert solved >= 198, solved
    buckets = [sum(lo <= t <= hi for t in labels) for lo, hi in ((1, 1), (2, 3), (4, 6), (7, 10))]
    assert all(b >= 20 for b in buckets), buckets
    assert sum(t > 10 for t in labels) <= 4


def test_expert_through_the_http_server():
    from envs.client import EnvClient
    from envs.spawn import EnvServerProcess

    with EnvServerProcess("babyai", env_options={"levels": MULTISTEP}, startup_timeout_s=120) as srv:
        c = EnvClient(srv.url, timeout_s=120)
        h = c.create()
        results = []
        for i in range(14):  # two tasks of each level
            r = c.reset(h, task_index("test", i))
            need = r.info["required_turns"]
            turns, res = _drive(lambda reply: c.step(h, reply), r.info)
            results.append((r.info["category"], need, turns, bool(res and res.info["success"] and res.terminated)))
        c.close(h)
        c.shutdown()
    assert all(ok and turns == need for _, need, turns, ok in results), results
    assert len({cat for cat, *_ in results}) == 7


@pytest.mark.parametrize("level", ["PickupLoc", "PutNextS4N1", "UnlockLocal", "UnlockPickup", "KeyCorridorS3R1",
                                   "OpenTwoDoors", "Open", "SynthLoc"])
def test_expert_action_on_non_go_to_levels(level):
    env = BabyAIEnv(level)
    for idx in range(3):
        obs, info = env.reset(idx)
        reply = contract.expert_action(obs, info)
        assert reply.startswith("Action: ") and reply[len("Action: "):] in info["available_actions"]
        turns, res = _drive(env.step, info, cap=200)
        assert res.info["success"] and res.terminated, (level, idx, res.observation)
        assert turns == info["required_turns"]


def test_required_turns_equals_the_turns_the_expert_used():
    env = BabyAIEnv("GoToLocal,UnlockPickup,PutNextS4N1")
    for idx in range(9):
        _, info = env.reset(idx)
        sim = BabyAIEnv("GoToLocal,UnlockPickup,PutNextS4N1", label_turns=False)
        sim.reset(idx)
        turns, actions = solve(sim)
        assert turns == info["required_turns"] == len(actions)


def test_hand_checked_cases():
    # GoToLocal train 0: "go to the green ball", the ball 3 ahead -> one macro
    env = BabyAIEnv("GoToLocal")
    _, info = env.reset(0)
    assert info["mission"] == "go to the green ball" and info["required_turns"] == 1
    assert info["expert_action"] == "go to green ball 1"
    # GoToLocal train 2: facing a wall, nothing in view -> turn (the bot explores), then the ball's macro
    obs, info = env.reset(2)
    assert "You see: no objects" in obs and info["required_turns"] == 2 and info["expert_action"] == "turn right"
    res = env.step(contract.expert_action(obs, info))
    assert res.info["expert_action"].startswith("go to grey ball ")
    assert env.step(contract.expert_action(res.observation, res.info)).info["success"]
    # UnlockPickup train 0: "pick up the purple box" behind a locked green door; the key is behind the agent:
    # turn, turn, fetch the key, unlock, turn to a free cell, drop the key, fetch the box = 7 turns
    env = BabyAIEnv("UnlockPickup", label_turns=False)
    _, info = env.reset(0)
    assert info["mission"] == "pick up the purple box"
    turns, actions = solve(env)
    assert actions == ["turn left", "turn left", "pick up green key 1", "open green door 1", "turn left", "drop",
                       "pick up purple box 1"]
    assert turns == 7
    # KeyCorridorS3R1 train 1: open the red door, fetch the grey key, unlock the grey door, drop the key, then
    # pick up the ball
    env = BabyAIEnv("KeyCorridorS3R1", label_turns=False)
    env.reset(1)
    turns, actions = solve(env)
    assert turns == 9 and actions[1:4] == ["open red door 1", "pick up grey key 1", "open grey door 1"]
    assert actions[-1] == "pick up purple ball 1"


def test_options_off_and_no_behaviour_change():
    on, off = BabyAIEnv("GoToLocal,UnlockPickup"), BabyAIEnv("GoToLocal,UnlockPickup", label_turns="false",
                                                              expert_hints=False)
    for idx in range(4):
        obs_on, info_on = on.reset(idx)
        obs_off, info_off = off.reset(idx)
        assert obs_on == obs_off
        assert "required_turns" not in info_off and "expert_action" not in info_off
        assert {k: v for k, v in info_on.items() if k not in ("required_turns", "expert_action")} == info_off
        for a in ("turn left", "move forward", "turn right"):
            if a in info_on["available_actions"]:
                r_on, r_off = on.step(a), off.step(a)
                assert (r_on.observation, r_on.reward, r_on.done) == (r_off.observation, r_off.reward, r_off.done)
    with pytest.raises(ValueError, match="label_turns"):
        BabyAIEnv("GoToLocal", label_turns="maybe")
    # without hints the contract expert falls back to the go-to heuristic
    assert contract.expert_action("", info_off).startswith("Action: ")


def test_labels_are_cached_and_failures_counted():
    env = BabyAIEnv("UnlockPickup")
    env.reset(3)
    assert len(env._labels) == 1
    env._sim = None  # a cached label needs no simulation
    _, info = env.reset(3)
    assert env._sim is None and info["required_turns"] >= 6
    # 3 minigrid steps are too few for UnlockPickup: no label, counted
    short = BabyAIEnv("UnlockPickup", max_steps=3)
    _, info = short.reset(0)
    assert "required_turns" not in info and short.label_failures == 1


def test_expert_after_random_actions_names_available_actions_or_gives_up():
    """The bot follows what the agent really did (each primitive, inside macros too): its next action is always
    one the env lists, or None (it gave up), and from a short random detour it mostly still solves the task."""
    env = BabyAIEnv(MULTISTEP, label_turns=False)
    rng = random.Random(0)
    recovered = 0
    for idx in range(35):
        _, info = env.reset(idx)
        for _ in range(3):
            res = env.step(rng.choice(info["available_actions"]))
            info = res.info
            if res.done:
                break
            a = info["expert_action"]
            assert a is None or a in info["available_actions"]
        if res.done:
            recovered += res.info["success"]
            continue
        _, res = _drive(env.step, info, cap=100)
        recovered += bool(res is not None and res.info["success"])
    assert recovered >= 30, recovered
    assert set(PRIMITIVE_PHRASE.values()) == {"turn left", "turn right", "move forward", "pick up", "drop", "toggle"}
