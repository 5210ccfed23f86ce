"""Env servers advertise how many episodes they run at once, and the rollout never admits more.

The pool test runs the real miniwob server (Chromium through the browser pool, 2 contexts) and the real SmolLM2
with the transformers generator: an eval of 3x the pool size through ``tasks.steps._rollout`` (what run, eval,
the nightly eval and the AgentGym dialect all use) must finish with no masked episode and no pool timeout, its
first turn within seconds. Before the cap, all 6 resets were sent at once: 4 waited for a context that the first
2 episodes could not give back (their first turn waits for every reset), until the pool's acquire timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from fastapi.testclient import TestClient

from core.capacity import live_episode_cap, pick_server
from envs.client import EnvClient, capacity_from_health
from envs.server import create_app, env_capacity


# --- pure pieces ------------------------------------------------------------------------------------------------
def test_live_episode_cap_is_the_configured_cap_and_the_servers_sum():
    assert live_episode_cap(None, [16]) == 16
    assert live_episode_cap(None, [2, 3]) == 5
    assert live_episode_cap(4, [2, 3]) == 4
    assert live_episode_cap(8, [2, 3]) == 5
    assert live_episode_cap(None, [None]) is None  # pure-Python env: unbounded
    assert live_episode_cap(7, [None]) == 7  # AgentGym server (advertises nothing), capped by config
    assert live_episode_cap(None, [4, None]) is None  # a sum over an unbounded server is unbounded
    assert live_episode_cap(3, []) == 3
    with pytest.raises(ValueError, match="max_live_episodes"):
        live_episode_cap(0, [2])
    with pytest.raises(ValueError, match="capacity"):
        live_episode_cap(None, [0])


def test_pick_server_fills_the_freest_server_and_never_a_full_one():
    assert pick_server([2, 3], [0, 0]) == 1  # 3 free beats 2
    assert pick_server([2, 3], [0, 1]) == 0  # 2 free each: fewer live
    assert pick_server([2, 2], [1, 1]) == 0  # full tie: lowest index
    assert pick_server([2, None], [0, 40]) == 1  # unbounded is always freest
    assert pick_server([1, 4], [1, 3]) == 1
    with pytest.raises(ValueError, match="full"):
        pick_server([1, 2], [1, 2])
    # a rollout capped at the sum never overfills: 5 episodes on [2, 3], each taking the pick
    live = [0, 0]
    for _ in range(5):
        live[pick_server([2, 3], live)] += 1
    assert live == [2, 3]


def test_capacity_from_health_takes_the_pool_and_max_envs():
    assert capacity_from_health({"capacity": 16, "max_envs": 256}) == 16
    assert capacity_from_health({"capacity": None, "max_envs": 256}) == 256
    assert capacity_from_health({"capacity": 300, "max_envs": 256}) == 256
    assert capacity_from_health({"status": "ok"}) is None  # a server that states nothing: unbounded
    assert capacity_from_health("This is environment BabyAI.") is None


def test_env_capacity_reads_the_pool_size():
    class Pool:
        capacity = 4

    class WithPool:
        pool = Pool()

    class Declared:
        episode_capacity = 3

    assert env_capacity(WithPool()) == 4 and env_capacity(Declared()) == 3 and env_capacity(object()) is None


def test_a_pure_python_env_server_advertises_no_pool():
    with TestClient(create_app("toy", max_envs=40)) as tc:
        h = tc.get("/health").json()
        assert h["capacity"] is None and h["max_envs"] == 40
        assert EnvClient("http://testserver", http_client=tc).capacity() == 40


def test_agentgym_servers_advertise_nothing_and_run_unbounded_unless_configured():
    from envs.agentgym import AsyncAgentGymClient
    from tasks.steps import live_cap

    async def go(configured):
        c = AsyncAgentGymClient("http://127.0.0.1:9", "babyai")  # never contacted: AgentGym has no capacity
        try:
            return await live_cap([c, c], configured)
        finally:
            await c.aclose()

    assert asyncio.run(go(None)) == ([None, None], None)
    assert asyncio.run(go(6)) == ([None, None], 6)


# --- the real pool --------------------------------------------------------------------------------------------
POOL = 2


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium") and not os.environ.get("SI_CHROMIUM"),
                    reason="needs Chromium (infra/install.sh installs Debian's)")
def test_eval_of_three_times_the_pool_never_waits_for_a_context(capsys):
    from core.config import build_config
    from envs.base import task_index
    from envs.spawn import EnvServerProcess
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime
    from tasks.steps import _rollout, close_session, get_session, open_session

    # generous page timeouts: a loaded 2-core machine may be slow to render, which is not what this test is about
    opts = {"tasks": "click-button,click-test", "max_contexts": POOL, "acquire_timeout_s": 20, "action_timeout_s": 30}
    cfg = build_config("miniwob", None, ["rollout.backend=transformers", f"env.options={json.dumps(opts)}"])
    assert cfg.rollout.max_live_episodes is None  # no preset: the cap must come from the server
    with EnvServerProcess("miniwob", env_options=opts, startup_timeout_s=300) as srv, Runtime():
        with EnvClient(srv.url) as c:
            assert c.health()["capacity"] == POOL
            warm = c.create()  # launch Chromium before the clock starts
            c.reset(warm, task_index("test", 0))
            c.close(warm)
        key = open_session(cfg, resolve_model("smollm2-135m"), train=False)
        try:
            s = get_session(key)
            first: list[float] = []
            real = s.backend.generate

            def generate(prompts, params):
                first.append(time.time())
                return real(prompts, params)

            s.backend.generate = generate
            t0 = time.time()
            trajs, m = _rollout(s, [srv.url], [task_index("test", i) for i in range(3 * POOL)], 1, 2, 0.0, 8,
                                "eval")
        finally:
            close_session(key)
        server_log = srv.log_tail(400)
    out = capsys.readouterr().out
    assert len(trajs) == 3 * POOL
    assert "PoolExhausted" not in server_log and "contexts are in use" not in server_log, server_log[-3000:]
    assert [t.error for t in trajs if t.masked] == [], server_log[-3000:]  # no masked episode
    assert all(t.turns >= 1 for t in trajs)
    assert first[0] - t0 < 20, f"first turn after {first[0] - t0:.1f} s"  # before the pool timeout (20 s)
    assert f"{3 * POOL} episodes, at most {POOL} live at once" in out and "waiting for env capacity" in out
