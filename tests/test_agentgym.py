"""The AgentGym adapter (envs/agentgym.py) against a stand-in server that speaks the AgentGym dialect as
../shared/design/prior-art.md documents it: ``id`` (BabyAI/TextCraft/SciWorld) or ``env_idx``
(WebArena/SearchQA) in requests, ``/create`` -> ``{"id": n}`` (TextCraft adds the first observation, SearchQA
answers a bare int), ``/step`` -> ``{"observation", "reward", "done"}`` (+ ``score`` 0-100 for SciWorld),
``/observation?id=`` -> the observation string, ``/close`` -> a bare bool, and every error as HTTP 200
``{"error": ...}``. The game behind it is a counter: "Action: inc" adds one; reaching 3 succeeds."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from core.config import ConfigError, build_config
from envs.agentgym import (
    AgentGymClient,
    AsyncAgentGymClient,
    EpisodeState,
    decode_create,
    decode_step,
    dialect_for,
    extract_reply_action,
    make_async_client,
    textcraft_goals,
)
from envs.client import AsyncEnvClient
from envs.errors import EnvServerError
from envs.sessions import HttpEpisode
from envs.errors import EnvInfraError


def stand_in(flavour: str) -> FastAPI:
    """A minimal AgentGym-style server. flavour: textcraft | sciworld | searchqa."""
    key = "env_idx" if flavour == "searchqa" else "id"
    app = FastAPI()
    envs: dict[int, dict] = {}
    app.state.steps = 0
    app.state.closed = []
    app.state.next_id = 0

    async def body_of(request: Request) -> dict:
        return await request.json()

    @app.get("/")
    def hello():
        return f"This is environment {flavour}."

    @app.post("/create")
    async def create():
        n = app.state.next_id
        app.state.next_id += 1
        envs[n] = {"count": 0, "done": False}
        if flavour == "searchqa":
            return n  # bare int
        if flavour == "textcraft":
            return {"id": n, "observation": "Crafting commands: ...", "done": False}
        return {"id": n}

    @app.post("/reset")
    async def reset(request: Request):
        b = await body_of(request)
        if key not in b:
            return {"error": f"missing {key}"}
        e = envs.get(b[key])
        if e is None:
            return {"error": f"env {b[key]} not found"}
        if b.get("data_idx", 0) < 0:
            return {"error": "bad data_idx"}
        e.update(count=0, done=False)
        if flavour == "searchqa":
            return f"Question {b['data_idx']}: count to three."  # bare string observation
        goal = f"\n\nGoal: craft {textcraft_goals()[b['data_idx'] % 544]}." if flavour == "textcraft" else ""
        out = {"observation": f"Task {b['data_idx']}: count to three.{goal}", "reward": 0, "done": False}
        if flavour == "sciworld":  # SciWorld's server sends the task apart from the room's description
            out.update(observation="This room is called the counter room.", task_description="Count to three.")
        return out

    @app.post("/step")
    async def step(request: Request):
        b = await body_of(request)
        e = envs.get(b.get(key))
        if e is None:
            return {"error": f"env {b.get(key)} not found"}
        app.state.steps += 1
        action = b["action"]
        if action == "explode":
            return {"error": "Traceback (most recent call last): ... RuntimeError: simulator crashed"}
        if action in ("inc", "<answer>inc</answer>"):
            e["count"] += 1
        done = e["count"] >= 3
        out = {"observation": f"count is {e['count']}", "done": done}
        if flavour == "sciworld":
            score = {0: 0, 1: 25, 2: 60, 3: 100}[min(e["count"], 3)]
            out.update(reward=score - e.get("score", 0), score=score)
            e["score"] = score
        else:
            out["reward"] = 1.0 if done else 0.0
        return out

    @app.get("/observation")
    async def observation(request: Request):
        idx = request.query_params.get(key)
        e = envs.get(int(idx)) if idx is not None else None
        if e is None:
            return {"error": "env not found"}
        return f"count is {e['count']}"

    @app.post("/close")
    async def close(request: Request):
        b = await body_of(request)
        app.state.closed.append(b.get(key))
        return envs.pop(b.get(key), None) is not None  # bare bool

    return app


# --- pure pieces ----------------------------------------------------------------------------------------------
def test_decode_create_variants_and_errors():
    assert decode_create({"id": 3}) == (3, None)
    assert decode_create({"env_idx": 4}) == (4, None)
    assert decode_create({"id": 0, "observation": "hi"}) == (0, "hi")
    assert decode_create(7) == (7, None)
    for bad in ({"error": "boom"}, True, {"foo": 1}, "text"):
        with pytest.raises(EnvServerError):
            decode_create(bad)


def test_decode_step_reward_rules():
    tc = dialect_for("textcraft")
    r = decode_step({"observation": "Crafted 1 x", "reward": 1, "done": True}, tc, EpisodeState())
    assert (r.reward, r.terminated, r.info["success"]) == (1.0, True, True)
    r = decode_step({"observation": "Got 1 y", "reward": 0, "done": False}, tc, EpisodeState())
    assert (r.reward, r.done, r.info["success"]) == (0.0, False, False)
    # SciWorld: the score (0-100) becomes the reward (per-step change / 100); success only at 100
    sw, st = dialect_for("sciworld"), EpisodeState()
    rewards = [decode_step({"observation": "o", "reward": 99, "score": s, "done": d}, sw, st)
               for s, d in ((25, False), (60, False), (60, True))]
    assert [x.reward for x in rewards] == [0.25, 0.35, 0.0]
    assert rewards[-1].terminated and rewards[-1].info == {"score": 60.0, "success": False,
                                                         "episode_metrics": {"score": 60.0}}
    full = decode_step({"observation": "o", "reward": 40, "score": 100, "done": True}, sw, EpisodeState())
    assert full.reward == 1.0 and full.info["success"]
    # WebShop: partial rewards are not success
    ws = dialect_for("webshop")
    assert not decode_step({"observation": "o", "reward": 0.5, "done": True}, ws, EpisodeState()).info["success"]
    with pytest.raises(EnvServerError) as e:
        decode_step({"error": "java.lang.NullPointerException"}, sw, EpisodeState())
    assert e.value.code == "agentgym_error" and "NullPointer" in str(e.value)


def test_reply_action_extraction():
    assert extract_reply_action("Think.\nAction: get 1 oak log", dialect_for("textcraft")) == ("get 1 oak log", None)
    act, err = extract_reply_action("Action: a\nAction: b", dialect_for("babyai"))
    assert act is None and "one action per turn" in err
    assert extract_reply_action("I click.\n```click [12]```\n```stop```", dialect_for("webarena"))[0] == "click [12]"
    assert extract_reply_action("no block", dialect_for("webarena"))[0] is None
    assert extract_reply_action("<search>q</search>", dialect_for("searchqa")) == ("<search>q</search>", None)


def test_config_selects_the_dialect():
    cfg = build_config("textcraft", None, ["env.dialect=agentgym", "env.url=http://127.0.0.1:36001"])
    assert cfg.env.dialect == "agentgym"
    assert isinstance(make_async_client(cfg.env.dialect, cfg.env.url, cfg.env.name), AsyncAgentGymClient)
    assert isinstance(make_async_client("scalinginter", "http://x", "babyai"), AsyncEnvClient)
    with pytest.raises(ConfigError, match="env.url"):
        build_config("textcraft", None, ["env.dialect=agentgym"])
    with pytest.raises(ConfigError):
        build_config("textcraft", None, ["env.dialect=gym"])


# --- against the stand-in server -----------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["textcraft", "sciworld", "searchqa"])
def test_sync_client_full_episode(flavour):
    app = stand_in(flavour)
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", flavour, http_client=tc)
        assert c.health()["status"] == "ok"
        env_id = c.create()
        r = c.reset(env_id, 5)
        assert "ount to three" in r.observation and r.instruction and r.info["success"] is False
        if flavour == "sciworld":  # the task opens the first observation, as AgentGym's client shows it
            assert r.observation == "Count to three.\nThis room is called the counter room."
        reply = "<answer>inc</answer>" if flavour == "searchqa" else "I add one.\nAction: inc"
        results = [c.step(env_id, reply) for _ in range(3)]
        assert [x.done for x in results] == [False, False, True]
        assert results[-1].info["success"] is True and results[-1].terminated
        assert sum(x.reward for x in results) == pytest.approx(1.0)
        if flavour == "sciworld":
            assert [x.reward for x in results] == pytest.approx([0.25, 0.35, 0.4])
        assert c.observation(env_id) == "count is 3"
        assert c.close(env_id) is True
        assert c.close(env_id) is False  # bare bool passed through


def test_malformed_reply_never_reaches_the_server():
    app = stand_in("textcraft")
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        c.reset(env_id, 0)
        for reply in ("", "hmm\nlet me think", "Action: inc\nAction: dec"):
            r = c.step(env_id, reply)
            assert r.info["invalid_action"] and r.reward == 0 and not r.done and "Invalid action" in r.observation
        assert app.state.steps == 0


def test_error_payloads_are_infrastructure_failures_and_the_env_is_dropped():
    app = stand_in("sciworld")
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "sciworld", http_client=tc)
        env_id = c.create()
        c.reset(env_id, 0)
        with pytest.raises(EnvServerError) as e:
            c.step(env_id, "Action: explode")  # HTTP 200 {"error": ...}
        assert e.value.code == "agentgym_error" and e.value.status == 200 and "crashed" in str(e.value)
        assert env_id in app.state.closed  # the broken env was closed
        with pytest.raises(EnvServerError):
            c.reset(10_000, 0)  # unknown id: also an error payload
        fresh = c.create()  # a new env works
        assert fresh != env_id and "counter room" in c.reset(fresh, 1).observation


def test_rollout_sessions_mask_agentgym_errors():
    """Through envs.sessions.HttpEpisode (what the rollout uses): errors become EnvInfraError (masked)."""
    app = stand_in("textcraft")

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        client = AsyncAgentGymClient("http://testserver", "textcraft", http_client=http)
        ep = HttpEpisode(client)
        first = await ep.reset(2)
        ok = await ep.step("Action: inc")
        with pytest.raises(EnvInfraError, match="simulator crashed"):
            await ep.step("Action: explode")
        ep2 = HttpEpisode(client)  # the next episode creates a fresh env
        await ep2.reset(3)
        done = [await ep2.step("Action: inc") for _ in range(3)][-1]
        await ep2.close()
        await http.aclose()
        return first, ok, done, ep.env_id, ep2.env_id

    first, ok, done, id1, id2 = asyncio.run(go())
    assert re.search("count to three", first.observation) and first.instruction
    assert ok.reward == 0 and not ok.terminated
    assert done.terminated and done.info["success"] and done.reward == 1.0
    assert id1 != id2


# --- against the replay servers (tests/agentgym_replay.py: recordings of the real servers + their shapes) ----
from envs.agentgym import SPLITS, split_map_for  # noqa: E402
from envs.base import task_index  # noqa: E402
from envs.errors import EnvBadRequest  # noqa: E402
from envs.errors import EnvConfigError  # noqa: E402
from tests.agentgym_replay import (  # noqa: E402
    babyai_app,
    load_exchanges,
    textcraft_app,
    textcraft_goal,
    transcript_app,
)


def test_replay_babyai_serves_the_recorded_exchanges_to_the_adapter():
    """Test indices 1e6..1e6+3 reach the server as recorded; its observations come back unchanged."""
    rec = {e["req"]["data_idx"]: e["resp"]["observation"] for e in load_exchanges() if e["path"] == "/reset"}
    app = babyai_app()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        assert c.health()["reply"] == "This is environment BabyAI."
        for i in range(4):
            env_id = c.create()
            r = c.reset(env_id, task_index("test", i))
            assert r.observation == rec[1_000_000 + i] and r.info["server_data_idx"] == 1_000_000 + i
            assert c.close(env_id) is True and c.close(env_id) is False
        assert [k for _, k in app.state.resets] == [1_000_000, 1_000_001, 1_000_002, 1_000_003]


def test_reply_without_an_action_line_gets_an_observation_and_no_server_call():
    """The recorded model replies (one line, no 'Action:') reached the server before; now they do not."""
    recorded = [e["req"]["action"] for e in load_exchanges() if e["path"] == "/step"]
    app = babyai_app()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        c.reset(env_id, task_index("test", 2))
        for reply in recorded[:3] + ["go to red ball 1", "Action:", "Action: turn left\nAction: turn right"]:
            r = c.step(env_id, reply)
            assert r.info["invalid_action"] and not r.done and r.reward == 0
            assert r.observation.startswith("Invalid action:") and "Action:" in r.observation
        assert app.state.steps == []


def test_actions_are_normalised_as_agentgyms_clients_do_case_kept():
    wins = {(1_000_002, "go to red ball 1"): 0.8875}
    app = babyai_app(wins)
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        c.reset(env_id, task_index("test", 2))
        r = c.step(env_id, 'I see it.\nAction: **"go to red ball 1."**')
        assert app.state.steps[-1] == (env_id, "go to red ball 1")  # the full stop used to reach the server
        assert r.terminated and r.info["success"] and r.reward == pytest.approx(0.8875)
    tapp = textcraft_app()
    with TestClient(tapp) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        first = c.reset(env_id, 0)
        assert c.step(env_id, "Action: get 1 sunflower.").observation == "Got 1 sunflower"
        assert c.step(env_id, "Action: Get 1 Sunflower").observation.startswith("Could not execute")
        assert c.step(env_id, "Action:\nlook").observation.startswith("Inventory: sunflower")
        assert [a for _, a in tapp.state.steps] == ["get 1 sunflower", "Get 1 Sunflower", "inventory"]
        goal = first.observation.rsplit("Goal: craft ", 1)[1].rstrip(".")
        done = c.step(env_id, f"Thought: craft it.\nAction: craft 1 {goal} using 1 sunflower.")
        assert done.terminated and done.info["success"] and done.reward == 1.0


def _agentgym_return(responses: list[dict]) -> float:
    """What AgentGym's BabyAI client scores an episode: the ``score`` of its last step."""
    return float(responses[-1]["score"])


@pytest.mark.parametrize("moves,worth,success", [
    (["turn left", "go to red ball 1"], 0.8875, True),  # a win: done
    (["turn left", "go to red ball 1"], 0.4, False),  # late win <= 0.5: the server leaves done unset; over here
    (["jump", "jump", "turn left"], 0.0, False),
])
def test_babyai_rewards_follow_the_servers_success_rule(moves, worth, success):
    """``reward`` is the episode's current value: the step reward is its rise, so a win counts once and the
    episode ends at it (a late win too, which the server leaves running); success is the server's ``done``."""
    app = babyai_app({(1_000_002, "go to red ball 1"): worth} if worth else None)
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        c.reset(env_id, task_index("test", 2))
        results = [c.step(env_id, f"Action: {m}") for m in moves]
    assert sum(r.reward for r in results) == pytest.approx(worth)
    assert [r.terminated for r in results] == [False] * (len(moves) - 1) + [bool(worth)]
    assert results[-1].info["success"] is success and results[-1].info["score"] == pytest.approx(worth)
    assert results[-1].info.get("late_win", False) is (0 < worth <= 0.5)


def test_replay_babyai_farming_after_a_late_win_is_not_credited():
    """The farming sequence (tests/data/agentgym/babyai_farming.jsonl, synthetic in the recorded format): after a
    late win worth 0.4375 the server's ``score`` grows by 0.4375 on each unrecognised / check action, to 1.75, what
    AgentGym's client reports. The adapter credits the win once, ends the episode there, and adds nothing after."""
    ex = load_exchanges("babyai_farming.jsonl")
    steps = [e for e in ex if e["path"] == "/step"]
    assert steps[-1]["resp"]["score"] == pytest.approx(1.75)  # the hazard, as the server reports it
    app = transcript_app("babyai_farming.jsonl")
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        c.reset(env_id, task_index("test", 2))
        results = [c.step(env_id, f"Thought: next.\nAction: {e['req']['action']}") for e in steps]
        assert c.close(env_id) is True
    assert app.state.served == len(ex)  # every exchange replayed, in order
    win = next(i for i, e in enumerate(steps) if e["resp"]["reward"] > 0)
    assert not any(r.terminated for r in results[:win]) and all(r.reward == 0 for r in results[:win])
    w = results[win]
    assert w.terminated and w.reward == pytest.approx(0.4375) and not w.info["success"] and w.info["late_win"]
    assert all(r.reward == 0 and r.terminated and not r.info["success"] for r in results[win + 1:])
    assert sum(r.reward for r in results) == pytest.approx(0.4375)  # not the 1.75 the server's score reached


def test_a_clean_win_still_scores_its_worth_and_success():
    app = babyai_app({(1_000_003, "go to purple key 1"): 0.9})
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        c.reset(env_id, task_index("test", 3))
        r = c.step(env_id, "Thought: it is right there. Action: go to purple key 1")  # one line, as AgentGym allows
    assert r.terminated and r.info["success"] and r.reward == pytest.approx(0.9) and r.info["server_score"] == 0.9


def test_errors_of_the_real_server_mask_the_episode():
    app = babyai_app({(1_000_003, "go to purple key 1"): 0.9})
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        with pytest.raises(EnvServerError, match="The id 99 is not valid"):
            c.step(99, "Action: turn left")
        env_id = c.create()
        with pytest.raises(EnvServerError, match=rf"error on /step: {env_id} \["):  # a step before reset
            c.step(env_id, "Action: turn left")
        env_id = c.create()
        c.reset(env_id, task_index("test", 3))
        assert c.step(env_id, "Action: go to purple key 1").terminated
        with pytest.raises(EnvServerError, match="has finished") as e:
            c.step(env_id, "Action: turn left")
        assert e.value.code == "agentgym_error" and env_id in app.state.closed
        with pytest.raises(EnvBadRequest, match="data_idx must be >= 0"):
            c.reset(c.create(), -1)


def test_babyai_split_partitions_level_and_seed():
    app = babyai_app()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "babyai", http_client=tc)
        env_id = c.create()
        got = {}
        for split in ("train", "test"):
            for i in list(range(80)) + [999_999 - 80 + j for j in range(80)]:
                c.reset(env_id, task_index(split, i))
                k = app.state.resets[-1][1]
                got.setdefault(split, set()).add((k % 40 + 1, k // 40))  # (level, seed) the server builds
    assert {lvl for lvl, _ in got["train"]} == {lvl for lvl, _ in got["test"]} == set(range(1, 41))
    assert not got["train"] & got["test"]
    assert max(s for _, s in got["train"]) < 25_000 <= min(s for _, s in got["test"])


def test_textcraft_split_holds_out_the_embedded_envs_goals_by_name_on_a_shuffled_server():
    """A server whose file system lists the recipe files in another order serves the goals in another order: the
    client learns which index serves which goal, and task i of each split is the embedded TextCraft env's goal i,
    sent as this server's index for it. Held-out goals are the embedded env's, whatever the server's order."""
    forget_goal_map()  # learned here
    import random

    from envs.textcraft.env import TextCraftEnv

    order = list(textcraft_goals())
    random.Random(7).shuffle(order)
    app = textcraft_app(order)
    embedded = TextCraftEnv()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        app.state.goals.clear()
        first = c.reset(env_id, task_index("test", 0))
        # learned once: indices 0-544 (544 is goal 0 again), then the task's goal at this server's index
        assert app.state.goals == [*range(544), 0, order.index(first.info["goal_name"])]
        names = {}
        for split, n in (("train", 2 * 319), ("test", 100)):
            for i in range(n):
                r = c.reset(env_id, task_index(split, i))
                want = item_name(embedded.task(task_index(split, i))["goal"])
                assert r.info["goal_name"] == want and order[r.info["server_data_idx"]] == want
                assert r.observation.endswith(f"Goal: craft {want}.")
                names.setdefault(split, []).append(want)
        assert len(app.state.goals) == 546 + 2 * 319 + 100  # no further learning
        with pytest.raises(EnvBadRequest, match="held-out split has 100 goals") as e:
            c.reset(env_id, task_index("test", 100))  # past the held-out split: refused, never wrapped
        assert e.value.code == "split_refused"
    assert names["test"] == list(textcraft_split()[1]) and len(set(names["test"])) == 100
    assert not set(names["train"]) & set(names["test"]) and len(set(names["train"])) == 319


@pytest.mark.parametrize("env", ["sciworld", "webshop", "alfworld"])
def test_a_split_without_an_honest_partition_is_refused_with_the_reason(env):
    app = stand_in("sciworld")
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", env, http_client=tc)
        env_id = c.create()
        assert "counter room" in c.reset(env_id, task_index("train", 7)).observation  # train passes
        with pytest.raises(EnvBadRequest, match="--split test refused.*--split train") as e:
            c.reset(env_id, task_index("test", 0))
        assert e.value.code == "split_refused"
    assert "refuse_test" not in SPLITS["babyai"].doc and split_map_for(env).refuse_test


def test_refused_split_fails_the_rollout_at_once_not_masked():
    app = stand_in("sciworld")

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        ep = HttpEpisode(AsyncAgentGymClient("http://testserver", "sciworld", http_client=http))
        try:
            await ep.reset(task_index("test", 0))
        finally:
            await http.aclose()

    with pytest.raises(EnvConfigError, match="sciworld server lists every variation"):
        asyncio.run(go())


# --- TextCraft: the server's goals are learned by name, and a server with other goals is refused ----------------
from envs.agentgym import forget_goal_map, goal_set_error, textcraft_goal_set, textcraft_split  # noqa: E402
from envs.textcraft.tasks import item_name  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_goal_maps():
    """The clients keep a learned goal map per server URL for the process, and every test's stand-in is a new server
    at the same URL: each test starts with the map of a server in the sorted order (what the stand-ins serve unless
    given other goals), and a test of learning forgets it first."""
    from envs import agentgym

    forget_goal_map()
    gm = agentgym.GoalMap("http://testserver", agentgym.textcraft_recipes(), textcraft_goals())
    agentgym._GOAL_MAPS[(gm.url, gm.recipes)] = gm
    yield
    forget_goal_map()


def test_textcraft_goal_list_and_the_goals_that_depend_on_file_order():
    goals = textcraft_goals()
    assert len(goals) == 544 and len(set(goals)) == 544
    assert goals[:3] == ("acacia planks", "acacia wood", "beacon")  # depth 1 first, then the sorted listing's order
    required, optional = textcraft_goal_set()
    assert len(required) == 541 and optional == {"gold ingot", "gold nugget", "iron ingot", "iron nugget",
                                                 "honey block", "honey bottle"}
    assert set(goals) <= required | optional and len(set(goals) & optional) == 3
    train, test = textcraft_split()
    assert len(train) == 319 and len(test) == 100 and set(train) | set(test) <= required
    assert goal_set_error(goals) is None
    assert goal_set_error(list(reversed(goals))) is None  # another order of the same goals
    pairs = {"gold ingot": "gold nugget", "iron ingot": "iron nugget", "honey block": "honey bottle"}
    other = {**pairs, **{b: a for a, b in pairs.items()}}
    assert goal_set_error([other.get(g, g) for g in goals]) is None  # the other recipe of every cycle kept


@pytest.mark.parametrize("change,needle", [
    ("missing", "missing 2: 'beacon', 'dark oak sign'"),
    ("extra", "extra 1: 'golden teapot'"),
    ("twice", "repeated 1: 'beacon' at 2 and 9"),
])
def test_a_server_whose_goal_set_differs_is_refused_with_the_differences(change, needle):
    forget_goal_map()  # learned here
    goals = list(textcraft_goals())
    if change == "missing":
        goals = [g for g in goals if g not in ("beacon", "dark oak sign")]
    elif change == "extra":
        goals.insert(17, "golden teapot")
    else:
        goals[9] = "beacon"  # beacon at 2 and 9, goal 9's own name missing
    app = textcraft_app(goals)
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        with pytest.raises(EnvBadRequest) as e:
            c.reset(env_id, task_index("test", 0))
    msg = str(e.value)
    assert e.value.code == "split_refused" and "\n" not in msg
    assert "goal set differs" in msg and needle in msg and "agentenv-textcraft" in msg, msg
    assert env_id in app.state.closed  # the env is dropped


def test_a_server_whose_goals_never_repeat_is_refused():
    forget_goal_map()  # learned here
    goals = list(textcraft_goals()) + [f"made-up item {i}" for i in range(80)]
    with TestClient(textcraft_app(goals)) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        with pytest.raises(EnvBadRequest, match=r"did not repeat within 612 indices.*extra 68: 'made-up item 0'"):
            c.reset(c.create(), 0)


def test_a_server_restarted_in_another_order_is_learned_again_once():
    forget_goal_map()  # learned here
    import random

    order = list(textcraft_goals())
    app = textcraft_app(order)
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        first = c.reset(env_id, task_index("train", 3))
        random.Random(3).shuffle(app.state.names)  # the server comes back reading its files in another order
        app.state.goals.clear()
        again = c.reset(env_id, task_index("train", 3))
        assert again.info["goal_name"] == first.info["goal_name"] == textcraft_split()[0][3]
        assert app.state.names[again.info["server_data_idx"]] == first.info["goal_name"]
        assert len(app.state.goals) == 1 + 545 + 1  # the stale index, the learning, the task


def test_a_server_whose_goals_keep_changing_is_refused(monkeypatch):
    forget_goal_map()  # learned here
    app = textcraft_app()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        learn = c.goal_map

        def learn_then_change(env_id=None):
            gm = learn(env_id)
            app.state.names.reverse()  # the server's order changes right after every learning
            return gm

        monkeypatch.setattr(c, "goal_map", learn_then_change)
        with pytest.raises(EnvBadRequest, match="changed its goals while in use") as e:
            c.reset(c.create(), task_index("train", 3))
    assert e.value.code == "split_refused"


def test_replay_textcraft_server_is_learned_once_per_server_and_kept_for_the_process():
    forget_goal_map()  # learned here
    app = textcraft_app()
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        env_id = c.create()
        app.state.goals.clear()
        r = c.reset(env_id, task_index("test", 0))
        test0 = textcraft_split()[1][0]
        assert r.observation.endswith(f"Goal: craft {test0}.") and r.info["server_data_idx"] == textcraft_goals().index(test0)
        c2 = AgentGymClient("http://testserver", "textcraft", http_client=tc)  # a new client of the same server
        c2.reset(env_id, task_index("train", 1))
        gm = c2.goal_map()
    assert [k for _, k in app.state.resets] == [*range(545), r.info["server_data_idx"], gm.server_index(textcraft_split()[0][1])]
    rec = gm.record()
    assert rec["server_goals"] == list(textcraft_goals()) and rec["test"][0] == {
        "task": task_index("test", 0), "goal": test0, "data_idx": r.info["server_data_idx"]}


def test_textcraft_server_that_names_no_goal_is_refused():
    forget_goal_map()  # learned here
    app = stand_in("sciworld")  # observations without a "Goal: craft" line
    with TestClient(app) as tc:
        c = AgentGymClient("http://testserver", "textcraft", http_client=tc)
        with pytest.raises(EnvBadRequest, match="names no goal"):
            c.reset(c.create(), 0)


def test_goal_set_refusal_fails_the_rollout_at_once_and_concurrent_resets_share_one_learning():
    """Through HttpEpisode: a configuration error (EnvConfigError), not a masked episode; concurrent first resets
    wait for one learning."""
    forget_goal_map()  # learned here
    import random

    goals = list(textcraft_goals())[:-1]  # one goal missing

    async def go(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        client = AsyncAgentGymClient("http://testserver", "textcraft", http_client=http)
        try:
            eps = [HttpEpisode(client) for _ in range(3)]
            return await asyncio.gather(*(ep.reset(task_index("train", i)) for i, ep in enumerate(eps)))
        finally:
            await http.aclose()

    with pytest.raises(EnvConfigError, match="goal set differs.*missing 1"):
        asyncio.run(go(textcraft_app(goals)))
    forget_goal_map()
    shuffled = list(textcraft_goals())
    random.Random(5).shuffle(shuffled)
    ok = textcraft_app(shuffled)
    replies = asyncio.run(go(ok))
    assert [r.info["goal_name"] for r in replies] == list(textcraft_split()[0][:3])
    resets = [k for _, k in ok.state.resets]
    assert resets[:545] == list(range(545)) and len(resets) == 545 + 3  # one learning for three episodes


def test_a_held_out_evaluation_runs_against_a_shuffled_server(tmp_path):
    """Over HTTP, as a run drives it: the run's check learns the server's goals (and writes the map to the run's
    files), then the rollout plays the held-out tasks; each episode opens on the embedded env's held-out goal."""
    import json
    import random

    from transformers import AutoTokenizer

    from core.chat import ChatFormat
    from flows.config import build_config
    from flows.envcheck import GOAL_MAP_FILE, check_env_servers
    from runtime.backends.model import resolve_model
    from runtime.context import Session
    from tasks.steps import _rollout
    from tests.agentgym_replay import serve_app
    from tests.test_async_rollout import FakeEngine

    forget_goal_map()
    order = list(textcraft_goals())
    random.Random(11).shuffle(order)
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    lines = []
    with serve_app(textcraft_app(order)) as url:
        cfg = build_config("textcraft", None, ["rollout.backend=transformers", "env.dialect=agentgym", f"env.url={url}",
                                               "env.prompt=agentgym"])
        check_env_servers(cfg, record_dir=tmp_path, echo=lines.append)
        s = Session(cfg=cfg, backend=FakeEngine(tok, replies=("Thought: first the flower.\nAction: get 1 sunflower",)),
                    chat=ChatFormat.from_tokenizer(tok, cfg.env.prompt))
        trajs, m = _rollout(s, [url], [task_index("test", i) for i in range(6)], 1, 2, 0.0, 32, "eval")
    test = textcraft_split()[1]
    assert m["masked_episodes"] == 0 and len(trajs) == 6
    assert [t.first_observation.rsplit("Goal: craft ", 1)[1] for t in trajs] == [f"{g}." for g in test[:6]]
    assert len(lines) == 1 and "its 544 goals learned" in lines[0] and GOAL_MAP_FILE in lines[0]
    rec = json.loads((tmp_path / GOAL_MAP_FILE).read_text())[url]
    assert rec["server_goals"] == order and [e["goal"] for e in rec["test"]] == list(test)
    assert all(order[e["data_idx"]] == e["goal"] for e in rec["test"] + rec["train"])


# --- the Action parser accepts what AgentGym's clients accept ------------------------------------------------
@pytest.mark.parametrize("reply,env,want", [
    ("Thought: the ball is ahead. Action: go to red ball 1", "babyai", "go to red ball 1"),  # one line
    ("Thought:\nI need logs.\n\nAction:\nget 1 oak log", "textcraft", "get 1 oak log"),  # AgentGym's own format
    ("I know the recipe.Action: craft 4 oak planks using 1 oak log", "textcraft",
     "craft 4 oak planks using 1 oak log"),
    ("1. Action: turn left", "babyai", "turn left"),
    ("Next Action: **look**", "textcraft", "inventory"),
])
def test_adapter_accepts_action_wherever_agentgyms_clients_find_it(reply, env, want):
    assert extract_reply_action(reply, dialect_for(env)) == (want, None)


def test_our_envs_parsers_accept_the_one_line_form_too():
    from envs.babyai.parse import parse_action as babyai_parse
    from envs.react import extract_action
    from envs.textcraft.parse import parse_action as textcraft_parse

    line = "Thought: I have the log. Action: craft 4 oak planks using 1 oak log."
    assert textcraft_parse(line).action == "craft 4 oak planks using 1 oak log"
    assert textcraft_parse('Thought: x Action: get 1 "oak log"!').action == "get 1 oak log"  # kept chars only
    assert textcraft_parse("Action: look").action == "inventory"
    assert babyai_parse("Thought: there. Action: go to red ball 1.", ["turn left", "go to red ball 1"]).action \
        == "go to red ball 1"
    assert extract_action("Thought: open it. Action: open door to kitchen").action == "open door to kitchen"  # sciworld
    # stricter on purpose, or where AgentGym's clients match nothing either:
    assert extract_action("my reaction: calm\nAction: wait").action == "wait"  # 'reaction:' is no Action
    assert extract_action("the best action: wait\nlook around").action is None  # prose, lower case, mid-line
    assert extract_action("Action: wait\nAction: look").action is None  # two different actions: refused
    assert extract_action("Action: wait\nAction: wait.").action == "wait"  # the same one twice: taken
