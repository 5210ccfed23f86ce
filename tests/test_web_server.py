"""The webarena env behind the real env server (spawned process, one browser): the scripted expert succeeds."""

from __future__ import annotations

import pytest

import envs  # noqa: F401
from envs.base import task_index
from envs.client import EnvClient
from envs.spawn import EnvServerProcess
from envs.webarena.contract import expert_action
from envs.webarena.env import local_tasks


@pytest.fixture(scope="module")
def client():
    with EnvServerProcess("webarena", env_options={"max_contexts": 4}, startup_timeout_s=90) as srv:
        with EnvClient(srv.url) as c:
            yield c


def _sample():
    """Indices of one train and one test task per (site, template) pair of eval types, capped for speed."""
    tasks = local_tasks()
    train = [t for t in tasks if t["split"] == "train"]
    test = [t for t in tasks if t["split"] == "test"]
    picks, seen = [], set()
    for split, lst in (("train", train), ("test", test)):
        for i, t in enumerate(lst):
            key = (t["_site_key"], tuple(t["eval"]["eval_types"]))
            if (split, key) not in seen:
                seen.add((split, key))
                picks.append(task_index(split, i))
    return picks


def test_expert_succeeds_through_server(client):
    env_id = client.create()
    ok = []
    for idx in _sample():
        r = client.reset(env_id, idx)
        obs, info = r.observation, r.info
        assert "OBSERVATION:" in obs and r.instruction and "Action:" in r.instruction
        for _ in range(12):
            a = expert_action(obs, info)
            assert a is not None, obs
            s = client.step(env_id, a)
            obs, info = s.observation, s.info
            if s.done:
                break
        ok.append((idx, s.terminated and s.reward == 1.0 and s.info["success"]))
    assert all(v for _, v in ok), ok
    assert len(ok) >= 8
    client.close(env_id)


def test_bad_actions_give_observations_not_errors(client):
    env_id = client.create()
    r = client.reset(env_id, 0)
    s = client.step(env_id, "Action: click [4242]")
    assert not s.done and "no element with id [4242]" in s.observation
    s = client.step(env_id, "Action: goto [https://www.google.com/]")
    assert not s.done and "outside the allowed sites" in s.observation
    s = client.step(env_id, "Action: fly [1]")
    assert s.info.get("invalid_action") and not s.done
    s = client.step(env_id, "Action: stop [definitely wrong]")
    assert s.terminated and s.reward == 0.0 and not s.info["success"]
    client.close(env_id)
