"""The env HTTP protocol: toy env, server (in-process and as a real subprocess), sync/async clients, spawner."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

import envs  # noqa: F401  (registers "toy")
from envs.base import TEST_OFFSET, make_env
from envs.client import AsyncEnvClient, EnvClient, RemoteEnv
from envs.errors import (
    EnvBadRequest,
    EnvServerError,
    EnvServerStartError,
    EnvUnavailable,
    TooManyEnvs,
    UnknownEnvId,
)
from envs.server import create_app
from envs.spawn import EnvServerProcess, free_port
from envs.toy import ToyEnv, extract_action


def solve(observation: str) -> str:
    """The winning reply for a toy hint task (reads the note, maps colour -> door)."""
    color = re.search(r"prize is behind the (\w+) door", observation).group(1)
    door = re.search(rf"door (\d+) is {color}", observation).group(1)
    return f"The note says {color}.\nAction: open door {door}"


def wrong(observation: str) -> str:
    door = int(re.search(r"open door (\d+)$", solve(observation)).group(1))
    return f"Action: open door {door % 3 + 1}"


# --- toy env -----------------------------------------------------------------------------------------------
def test_toy_env_contract():
    env = make_env("toy")
    assert isinstance(env, ToyEnv) and env.name == "toy"
    obs, info = env.reset(7)
    assert obs == env.observation() and info["split"] == "train" and "open door N" in env.instruction()
    assert env.reset(7)[0] == obs and make_env("toy").reset(7)[0] == obs  # deterministic
    assert len({make_env("toy").reset(i)[0] for i in range(20)}) > 3  # tasks differ

    bad = env.step("I will dance")  # malformed: explained, no attempt spent
    assert not bad.done and bad.reward == 0 and "Invalid action" in bad.observation and bad.info["invalid_action"]
    assert "no door 9" in env.step("Action: open door 9").observation.lower()

    miss = env.step(wrong(obs))  # first wrong door: one more attempt
    assert not miss.done and miss.info["success"] is False and "Attempts left: 1" in miss.observation
    win = env.step(solve(obs))
    assert win.terminated and not win.truncated and win.reward == 1.0 and win.info["success"] is True
    with pytest.raises(RuntimeError):
        env.step("Action: open door 1")

    obs8, _ = env.reset(8)
    env.step(wrong(obs8))
    lose = env.step(wrong(obs8))
    assert lose.terminated and lose.reward == 0.0 and lose.info["success"] is False

    with pytest.raises(ValueError):
        env.reset(1000)  # n_train = 1000
    with pytest.raises(ValueError):
        env.reset(TEST_OFFSET + 100)
    assert env.reset(TEST_OFFSET + 99)[1]["split"] == "test"

    blind = make_env("toy", hint=False, attempts=1)  # the prize is always behind the red door
    for i in range(10):
        obs, _ = blind.reset(i)
        assert "note" not in obs
        red = re.search(r"door (\d+) is red", obs).group(1)
        assert blind.step(f"Action: open door {red}").info["success"]

    assert extract_action("Let me think.\nAction: foo\nmore\nACTION:  Open Door 2. ") == "open door 2"
    assert extract_action(" `open door 3` ") == "open door 3"


# --- in-process server: error shapes ---------------------------------------------------------------------
@pytest.fixture()
def app_client():
    app = create_app("toy", {"fail_action": "explode"}, max_envs=3, idle_ttl_s=600)
    with TestClient(app) as c:
        yield c


def _err(resp, status, code):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) >= {"error", "code"} and body["code"] == code and body["error"], body
    return body


def test_error_shapes_in_process(app_client):
    c = app_client
    assert c.get("/health").json()["status"] == "ok"
    env_id = c.post("/create", json={}).json()["id"]
    _err(c.post("/step", json={"id": env_id, "action": "open door 1"}), 409, "not_reset")
    _err(c.get("/observation", params={"id": env_id}), 409, "not_reset")
    _err(c.post("/reset", json={"id": env_id, "data_idx": 5_000}), 400, "bad_data_idx")
    _err(c.post("/reset", json={"id": env_id, "data_idx": -1}), 400, "bad_data_idx")
    raw = {"headers": {"content-type": "application/json"}}
    _err(c.post("/step", content=b'{"id": 0, "action": ', **raw), 400, "malformed_json")
    _err(c.post("/step", json={"id": env_id}), 422, "invalid_request")
    _err(c.post("/reset", json={"data_idx": 1}), 422, "invalid_request")
    _err(c.post("/step", json=["not", "an", "object"]), 422, "invalid_request")
    _err(c.get("/observation"), 422, "invalid_request")
    _err(c.post("/step", json={"id": 99, "action": "x"}), 404, "unknown_id")
    _err(c.get("/no/such/route"), 404, "not_found")
    _err(c.get("/step"), 405, "method_not_allowed")

    r = c.post("/reset", json={"id": env_id, "data_idx": 3}).json()
    assert set(r) == {"observation", "reward", "done", "terminated", "truncated", "info", "instruction"}
    assert r["done"] is False and r["instruction"].startswith("You are in a hall")

    # an env exception is a 500 JSON error; the env must be reset before stepping again; the server lives on
    _err(c.post("/step", json={"id": env_id, "action": "Action: explode"}), 500, "env_error")
    _err(c.post("/step", json={"id": env_id, "action": "open door 1"}), 409, "env_broken")
    obs = c.post("/reset", json={"id": env_id, "data_idx": 3}).json()["observation"]
    s = c.post("/step", json={"id": env_id, "action": solve(obs)}).json()
    assert s["done"] and s["terminated"] and not s["truncated"] and s["reward"] == 1.0 and s["info"]["success"]
    _err(c.post("/step", json={"id": env_id, "action": "open door 1"}), 409, "episode_done")
    assert c.get("/observation", params={"id": env_id}).json()["observation"] == s["observation"]

    # capacity: max_envs=3
    more = [c.post("/create", json={}).json()["id"] for _ in range(2)]
    assert len({env_id, *more}) == 3
    _err(c.post("/create", json={}), 429, "too_many_envs")
    assert c.post("/close", json={"id": more[0]}).json() == {"closed": True}
    assert c.post("/close", json={"id": more[0]}).json()["closed"] is True  # idempotent
    _err(c.post("/step", json={"id": more[0], "action": "x"}), 404, "env_closed")
    new_id = c.post("/create", json={}).json()["id"]
    assert new_id not in (env_id, *more)  # ids are never reused
    _err(c.post("/close", json={"id": 1234}), 404, "unknown_id")


def test_client_error_types_in_process(app_client):
    client = EnvClient(http_client=app_client)
    env_id = client.create()
    with pytest.raises(EnvBadRequest) as e:
        client.step(env_id, "open door 1")
    assert e.value.status == 409 and e.value.code == "not_reset"
    with pytest.raises(EnvBadRequest) as e:
        client.reset(env_id, 10**9)
    assert e.value.status == 400 and "out of range" in str(e.value)
    with pytest.raises(UnknownEnvId):
        client.observation(42)
    r = client.reset(env_id, 11)
    with pytest.raises(EnvServerError) as e:
        client.step(env_id, "explode")
    # the exception text stays in the server log, never in the reply (issue 18)
    assert e.value.status == 500 and "server log" in str(e.value) and "simulated failure" not in str(e.value)
    client.create(), client.create()
    with pytest.raises(TooManyEnvs):
        client.create()

    remote = RemoteEnv(client, "toy")  # TextEnv over HTTP
    for eid in (0, 1, 2):
        client.close(eid)
    obs, info = remote.reset(21)
    assert remote.instruction() == r.instruction and info["data_idx"] == 21
    res = remote.step(solve(obs))
    assert res.done and res.info["success"] and remote.observation() == res.observation
    remote.close()


def test_idle_envs_are_reaped_in_process():
    # a TTL well above the touch interval: on a loaded machine a request can take a second or more
    app = create_app("toy", idle_ttl_s=2.0, reap_interval_s=0.05)
    with TestClient(app) as c:
        idle = c.post("/create", json={}).json()["id"]
        busy = c.post("/create", json={}).json()["id"]
        obs = c.post("/reset", json={"id": busy, "data_idx": 0}).json()["observation"]
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:  # keep touching `busy` for 3 s (longer than the TTL)
            time.sleep(0.1)
            c.get("/observation", params={"id": busy})
        h = c.get("/health").json()
        assert (h["live_envs"], h["reaped_total"]) == (1, 1), h
        body = _err(c.post("/reset", json={"id": idle, "data_idx": 0}), 404, "env_closed")
        assert "idle" in body["error"]
        assert c.post("/step", json={"id": busy, "action": solve(obs)}).json()["reward"] == 1.0


def test_retry_policy_never_resends_a_step():
    """Connect failures are retried for every call; a dropped response only for idempotent calls."""
    calls: list[str] = []
    mode = {"fail": "read"}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            exc = httpx.ReadError if mode["fail"] == "read" else httpx.ConnectError
            raise exc("simulated", request=request)
        if request.url.path == "/step":
            return httpx.Response(200, json={"observation": "o", "reward": 0.0, "done": False,
                                             "terminated": False, "truncated": False, "info": {}})
        return httpx.Response(200, json={"observation": "o"})

    client = EnvClient("http://envs", http_client=httpx.Client(transport=httpx.MockTransport(handler)), backoff_s=0.001)
    with pytest.raises(EnvUnavailable) as e:  # maybe applied: not re-sent
        client.step(0, "open door 1")
    assert e.value.maybe_applied and calls == ["/step"]
    calls.clear()
    assert client.observation(0) == "o" and calls == ["/observation", "/observation"]  # idempotent: retried
    calls.clear()
    mode["fail"] = "connect"
    assert client.step(0, "open door 1").observation == "o" and calls == ["/step", "/step"]  # never sent: retried


def test_unreachable_server_is_typed_and_fast():
    client = EnvClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    t = time.monotonic()
    with pytest.raises(EnvUnavailable) as e:
        client.create()
    assert time.monotonic() - t < 3 and not e.value.maybe_applied


# --- the real server in a subprocess ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with EnvServerProcess("toy", max_envs=64) as srv:
        yield srv


def test_episode_over_http(server):
    assert server.alive()
    with EnvClient(server.url) as c:
        h = c.health()
        assert h["status"] == "ok" and h["env"] == "toy"
        env_id = c.create()
        r = c.reset(env_id, 42)
        assert "open door N" in r.instruction and r.info["data_idx"] == 42
        assert c.observation(env_id) == r.observation
        bad = c.step(env_id, "hmm, I am not sure")
        assert not bad.done and "Invalid action" in bad.observation
        miss = c.step(env_id, wrong(r.observation))
        assert not miss.done and miss.reward == 0.0
        win = c.step(env_id, solve(r.observation))
        assert win.done and win.terminated and win.reward == 1.0 and win.info["success"] is True
        assert c.observation(env_id) == win.observation
        with pytest.raises(EnvBadRequest) as e:  # step after done -> 409
            c.step(env_id, "Action: open door 1")
        assert e.value.status == 409 and e.value.code == "episode_done"
        assert c.reset(env_id, 43).observation  # the same env id plays another episode
        assert c.close(env_id) is True
        with pytest.raises(UnknownEnvId):
            c.step(env_id, "Action: open door 1")
        with pytest.raises(UnknownEnvId):
            c.reset(10**6, 0)


def test_raw_http_errors_and_agentgym_dialect(server):
    with httpx.Client(base_url=server.url, timeout=5) as h:
        r = h.post("/step", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "malformed_json"
        r = h.post("/reset", json={"id": 0})
        assert r.status_code == 422 and r.json()["code"] == "invalid_request" and "data_idx" in r.json()["error"]
        r = h.post("/step", json={"id": 987654, "action": "x"})
        assert r.status_code == 404 and r.json()["code"] == "unknown_id"

        # AgentGym WebArena/SearchQA style: `env_idx` instead of `id`
        env_idx = h.post("/create", json={}).json()["id"]
        obs = h.post("/reset", json={"env_idx": env_idx, "data_idx": 9}).json()["observation"]
        assert h.get("/observation", params={"env_idx": env_idx}).json()["observation"] == obs
        s = h.post("/step", json={"env_idx": env_idx, "action": solve(obs)}).json()
        assert s["done"] is True and s["reward"] == 1.0
        assert h.post("/close", json={"env_idx": env_idx}).json()["closed"] is True


def test_async_concurrent_episodes(server):
    async def episode(c: AsyncEnvClient, data_idx: int) -> float:
        env_id = await c.create()
        try:
            r = await c.reset(env_id, data_idx)
            res = await c.step(env_id, wrong(r.observation))
            if not res.done:
                res = await c.step(env_id, solve(r.observation))
            return res.reward
        finally:
            await c.close(env_id)

    async def main():
        async with AsyncEnvClient(server.url) as c:
            rewards = await asyncio.gather(*(episode(c, TEST_OFFSET + i) for i in range(24)))
            return rewards, (await c.health())["live_envs"]

    rewards, live = asyncio.run(main())
    assert rewards == [1.0] * 24 and live == 0


def test_reaping_over_http():
    with EnvServerProcess("toy", idle_ttl_s=0.3, reap_interval_s=0.05) as srv, EnvClient(srv.url) as c:
        env_id = c.create()
        c.reset(env_id, 1)
        time.sleep(0.6)
        assert c.health()["live_envs"] == 0
        with pytest.raises(UnknownEnvId) as e:
            c.step(env_id, "Action: open door 1")
        assert e.value.code == "env_closed"
        assert c.create() == env_id + 1  # ids are not reused


def test_slow_envs_run_in_parallel_and_a_killed_server_is_typed():
    with EnvServerProcess("toy", env_options={"step_delay_s": 0.4}) as srv:

        async def one(c: AsyncEnvClient, i: int):
            env_id = await c.create()
            r = await c.reset(env_id, i)
            return (await c.step(env_id, solve(r.observation))).reward

        async def main():
            async with AsyncEnvClient(srv.url) as c:
                t = time.monotonic()
                rewards = await asyncio.gather(*(one(c, i) for i in range(8)))
                return rewards, time.monotonic() - t

        rewards, elapsed = asyncio.run(main())
        assert rewards == [1.0] * 8 and elapsed < 1.6, elapsed  # 8 x 0.4 s sequential would be 3.2 s

        c = EnvClient(srv.url, retries=2, backoff_s=0.05)
        env_id = c.create()
        obs = c.reset(env_id, 5).observation
        outcome: dict = {}

        def step_in_flight():
            t = time.monotonic()
            try:
                c.step(env_id, wrong(obs))
            except Exception as exc:  # noqa: BLE001
                outcome["exc"] = exc
            outcome["elapsed"] = time.monotonic() - t

        th = threading.Thread(target=step_in_flight)
        th.start()
        time.sleep(0.15)
        srv.kill()  # dies mid-step
        th.join(10)
        assert not th.is_alive()
        assert isinstance(outcome.get("exc"), EnvUnavailable) and outcome["exc"].maybe_applied
        assert outcome["elapsed"] < 3

        t = time.monotonic()  # and every later call fails fast with the same type
        for call in (lambda: c.step(env_id, "Action: open door 1"), lambda: c.observation(env_id), c.health):
            with pytest.raises(EnvUnavailable):
                call()
        assert time.monotonic() - t < 5
        assert not srv.alive()

        srv.restart()  # same port, fresh ids
        assert srv.alive() and c.health()["live_envs"] == 0
        with pytest.raises(UnknownEnvId):
            c.step(env_id, "Action: open door 1")
        c.shutdown()


def test_spawn_failure_reports_the_log_tail():
    with pytest.raises(EnvServerStartError) as e:
        EnvServerProcess("toy", env_options={"n_doors": 99}, startup_timeout_s=20).start()
    assert "n_doors must be in" in str(e.value)
