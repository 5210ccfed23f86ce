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
)
from envs.client import AsyncEnvClient
from envs.errors import EnvServerError
from tasks.env_sessions import HttpEpisode
from tasks.rollout import EnvInfraError


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
        return {"observation": f"Task {b['data_idx']}: count to three.", "reward": 0, "done": False}

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
        assert "count to three" in r.observation and r.instruction and r.info["success"] is False
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
        assert fresh != env_id and "count to three" in c.reset(fresh, 1).observation


def test_rollout_sessions_mask_agentgym_errors():
    """Through tasks.env_sessions.HttpEpisode (what the rollout uses): errors become EnvInfraError (masked)."""
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
