"""The miniwob env: task mapping (no browser) and reference solutions through the real env server."""

from __future__ import annotations

import pytest

import envs  # noqa: F401
from envs.base import TEST_OFFSET, task_index
from envs.client import EnvClient
from envs.miniwob.contract import SOLVED_TASKS, expert_action
from envs.miniwob.env import DEFAULT_TASKS, MiniWoBEnv, TEST_SEED_BASE, all_tasks, parse_tasks
from envs.spawn import EnvServerProcess


def test_task_lists():
    known = all_tasks()
    assert len(known) >= 100 and set(DEFAULT_TASKS) <= set(known) and set(SOLVED_TASKS) <= set(known)
    assert parse_tasks("click-button, miniwob.enter-text") == ["click-button", "enter-text"]
    with pytest.raises(ValueError, match="unknown MiniWoB task"):
        parse_tasks("click-nothing")


def test_index_mapping_splits_never_share_seeds():
    env = MiniWoBEnv(tasks="click-button,enter-text", n_train=10, n_test=4)  # no browser until reset
    assert env.task(0) == ("click-button", 0, "train")
    assert env.task(3) == ("enter-text", 1, "train")
    assert env.task(TEST_OFFSET + 1) == ("enter-text", TEST_SEED_BASE, "test")
    assert env.num_tasks("train") == 10 and env.num_tasks("test") == 4
    with pytest.raises(ValueError, match="out of range"):
        env.task(10)
    with pytest.raises(ValueError, match="out of range"):
        env.task(TEST_OFFSET + 4)
    with pytest.raises(ValueError, match="reward"):
        MiniWoBEnv(reward="fancy")


@pytest.fixture(scope="module")
def client():
    opts = {"tasks": ",".join(SOLVED_TASKS), "max_contexts": 2}
    with EnvServerProcess("miniwob", env_options=opts, startup_timeout_s=90) as srv:
        with EnvClient(srv.url) as c:
            yield c


def _episode(client, env_id, idx):
    r = client.reset(env_id, idx)
    obs, info = r.observation, r.info
    s = None
    for _ in range(10):
        a = expert_action(obs, info)
        assert a is not None, obs
        s = client.step(env_id, a)
        obs, info = s.observation, s.info
        if s.done:
            break
    return r.info["task"], s


def test_reference_solutions_through_server(client):
    env_id = client.create()
    results = {}
    for i in range(len(SOLVED_TASKS)):  # every expert task once on train, once on test
        for split in ("train", "test"):
            task, s = _episode(client, env_id, task_index(split, i))
            results[(task, split)] = (s.terminated, s.reward, s.info["success"])
    assert all(v == (True, 1.0, True) for v in results.values()), results
    client.close(env_id)


def test_wrong_click_fails_with_miniwob_reward(client):
    env_id = client.create()
    r = client.reset(env_id, SOLVED_TASKS.index("click-test-2"))
    obs = r.observation
    goal = [ln for ln in obs.splitlines() if ln.startswith("OBJECTIVE:")][0]
    wrong = "TWO" if "ONE" in goal else "ONE"
    eid = [ln for ln in obs.splitlines() if f"button '{wrong}'" in ln][0].strip()[1:].split("]")[0]
    s = client.step(env_id, f"Action: click [{eid}]")
    assert s.terminated and s.reward == -1.0 and not s.info["success"]
    assert "without success" in s.observation
    r = client.reset(env_id, 0)
    s = client.step(env_id, "Action: stop []")
    assert s.terminated and s.reward == 0.0 and not s.info["success"]
    client.close(env_id)


@pytest.mark.slow
def test_reference_solutions_many_seeds(client):
    env_id = client.create()
    bad = []
    for i in range(len(SOLVED_TASKS) * 5):
        task, s = _episode(client, env_id, task_index("train", i))
        if not s.info["success"]:
            bad.append((task, i, s.observation[:200]))
    assert not bad, bad
    client.close(env_id)
