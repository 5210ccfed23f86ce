"""SciWorld: task ordering (pure), the capped JVM pool (reuse, cap, broken JVMs, idle shutdown), the env's
score/reward/invalid-action rules, and JVMs returned to the pool on /close and by the server's reaper.
Starts three JVMs in total (the env tests share the contract suite's pool settings)."""

from __future__ import annotations

import shutil
import time

import pytest

pytest.importorskip("scienceworld", reason="optional dependency scienceworld is not installed")
if shutil.which("java") is None:
    pytest.skip("no Java runtime (infra/install.sh installs openjdk-17-jre-headless)", allow_module_level=True)

from fastapi.testclient import TestClient  # noqa: E402

from envs.base import TEST_OFFSET, task_index  # noqa: E402
from envs.client import EnvClient  # noqa: E402
from envs.sciworld.env import SciWorldEnv, round_robin  # noqa: E402
from envs.sciworld.jvm import JvmPool, PoolExhausted  # noqa: E402
from envs.server import create_app  # noqa: E402

OPTS = {"expose_gold": True, "max_jvms": 4, "env_step_limit": 1000}  # = envs/sciworld/contract.py OPTIONS


def test_round_robin_covers_every_task_first():
    cat = {"a": {"train": [0, 1, 2], "test": [9]}, "b": {"train": [5], "test": [7, 8]}}
    assert round_robin(cat, "train", ["a", "b"]) == [("a", 0), ("b", 5), ("a", 1), ("a", 2)]
    assert round_robin(cat, "test", ["b", "a"]) == [("b", 7), ("a", 9), ("b", 8)]


def test_pool_caps_reuses_and_drops_broken_jvms():
    pool = JvmPool(max_jvms=1, java_opts=["-Xmx256m", "-XX:+UseSerialGC"], idle_ttl_s=60)
    try:
        w = pool.acquire()
        assert w.alive() and pool.stats()["live"] == 1
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match="max_jvms=1"):
            pool.acquire(timeout_s=0.3)
        assert time.monotonic() - t0 < 2
        pool.release(w)
        again = pool.acquire()
        assert again is w and pool.stats()["started_total"] == 1  # reused, not restarted
        pool.release(again, broken=True)  # a failed JVM is shut down, not reused
        st = pool.stats()
        assert not w.alive() and (st["live"], st["idle"], st["closed_total"]) == (0, 0, 1)
        w2 = pool.acquire()
        pool.release(w2)
        assert pool.reap_idle(now=time.monotonic() + 3600) == 1 and not w2.alive()
        assert pool.stats()["live"] == 0
    finally:
        pool.shutdown()


@pytest.fixture(scope="module")
def env():
    e = SciWorldEnv(**OPTS)
    yield e
    e.close()


def test_tasks_and_splits(env):
    assert len(env.task_names) == 30
    assert env.num_tasks("train") == 3592 and env.num_tasks("test") == 1819
    assert {env.task(task_index("test", i))[0] for i in range(30)} == set(env.task_names)
    train_pairs = set(env.train)
    assert not train_pairs & set(env.test)  # ScienceWorld's variation splits never overlap
    assert env.task(3592) == env.task(0)  # train wraps
    with pytest.raises(ValueError):
        env.task(TEST_OFFSET + 1819)
    with pytest.raises(ValueError, match="unknown ScienceWorld task"):
        SciWorldEnv(tasks="boil,fly", **OPTS)


def test_gold_path_scores_100_and_rewards_sum_to_one(env):
    obs, info = env.reset(task_index("test", 25))  # power-component
    assert info["task"] == "power-component" and "Your task is to" in obs and "This room is called" in obs
    assert info["score"] == 0 and info["success"] is False
    rewards, scores = [], []
    while True:
        r = env.step(f"Thought.\nAction: {info['gold_action']}")
        info = r.info
        rewards.append(r.reward)
        scores.append(info["score"])
        if r.done:
            break
    assert r.terminated and info["success"] and info["score"] == 100 and "score 100" in r.observation
    assert sum(rewards) == pytest.approx(1.0) and scores == sorted(scores)  # partial credit on the way
    assert any(0 < s < 100 for s in scores)


def test_invalid_actions_list_templates_and_change_nothing(env):
    obs, info = env.reset(task_index("train", 0))
    look = env.step("Action: look around")
    for reply in ("Action: dance wildly", "hmm\nwhat now", "Action: look around\nAction: inventory"):
        r = env.step(reply)
        assert r.info["invalid_action"] and r.reward == 0 and not r.done
        assert "Valid action templates" in r.observation and "pick up OBJ" in r.observation
    assert env.step("Action: look around").observation == look.observation


def test_jvms_return_to_the_pool_on_close_and_reap(env):
    pool = env.pool  # same settings -> the same process-wide pool
    with TestClient(create_app("sciworld", OPTS, max_envs=8, idle_ttl_s=600)) as tc:
        c = EnvClient(http_client=tc)
        a = c.create()
        c.reset(a, task_index("test", 17))
        before = pool.stats()
        c.close(a)
        assert pool.stats()["idle"] == before["idle"] + 1  # /close returned a's JVM
        d = c.create()
        c.reset(d, task_index("test", 19))  # reuses an idle JVM
        assert pool.stats()["started_total"] == before["started_total"]
        c.close(d)
    # a client that disappears: its env is reaped and the JVM comes back to the pool
    with TestClient(create_app("sciworld", OPTS, max_envs=8, idle_ttl_s=0.5, reap_interval_s=0.1)) as tc:
        c = EnvClient(http_client=tc)
        b = c.create()
        c.reset(b, task_index("test", 18))
        busy = pool.stats()
        time.sleep(1.5)
        assert tc.get("/health").json()["reaped_total"] == 1
        assert pool.stats()["idle"] == busy["idle"] + 1 and pool.stats()["live"] == busy["live"]
