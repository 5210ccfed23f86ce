"""Several env servers per env (``env.urls``): the phase uses the listed running servers instead of spawning, and
the rollout's capacity-aware admission (``ServerSlots``: each new episode to the server with the most free slots)
spreads the episodes over them. Two real local BabyAI servers (``python -m envs.server``, capacities 2 and 3 from
their ``--max-envs``) and a fake generation engine (the point is where episodes go, not what is generated)."""

from __future__ import annotations

import pytest

from tests.test_async_rollout import FakeEngine


def test_env_urls_config():
    from flows.config import ConfigError, build_config

    c = build_config("babyai", "tiny", ["env.urls=[http://h1:8000,http://h2:8000]"])
    assert c.env.urls == ["http://h1:8000", "http://h2:8000"] and c.env.server_urls == c.env.urls
    assert build_config("babyai", "tiny", ['env.urls=["http://h1:8000"]']).env.server_urls == ["http://h1:8000"]
    assert build_config("babyai", "tiny", ["env.url=http://h1:8000"]).env.server_urls == ["http://h1:8000"]
    assert build_config("babyai", "tiny").env.server_urls is None  # spawn
    with pytest.raises(ConfigError, match="both set"):
        build_config("babyai", "tiny", ["env.url=http://h1:8000", "env.urls=[http://h2:8000]"])
    with pytest.raises(ConfigError, match="empty"):
        build_config("babyai", "tiny", ["env.urls=[]"])
    a = build_config("babyai", "tiny", ["env.dialect=agentgym", "env.urls=[http://h1:36001,http://h2:36001]"])
    assert a.env.server_urls == ["http://h1:36001", "http://h2:36001"]


def test_episodes_spread_over_two_real_servers():
    from transformers import AutoTokenizer

    from core.chat import ChatFormat
    from envs.base import task_index
    from envs.client import EnvClient
    from envs.spawn import EnvServerProcess
    from flows.config import build_config
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime, Session
    from tasks.steps import _rollout, spawn_env_servers

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    with EnvServerProcess("babyai", max_envs=2) as a, EnvServerProcess("babyai", max_envs=3) as b:
        cfg = build_config("babyai", "tiny", ["rollout.backend=transformers", f"env.urls=[{a.url},{b.url}]"])
        s = Session(cfg=cfg, backend=FakeEngine(tok), chat=ChatFormat.from_tokenizer(tok))
        with Runtime() as rt:
            key = rt.add_session(s)
            urls = spawn_env_servers.fn(key)
            assert urls == [a.url, b.url] and s.servers == []  # running servers used, none spawned
            trajs, m = _rollout(s, urls, [task_index("train", i) for i in range(5)], 1, 2, 1.0, 8, "test")
        assert len(trajs) == 5 and not [t.error for t in trajs if t.masked]
        created = []
        for srv in (a, b):  # ids are never reused: the next id counts the envs this server created
            with EnvClient(srv.url) as c:
                assert c.health()["live_envs"] == 0  # every episode closed its env
                created.append(c.create())
    # 5 episodes at once (the live cap is 2 + 3), each to the freest server: 2 on the first, 3 on the second
    assert created == [2, 3], created  # (ids count from 0)
