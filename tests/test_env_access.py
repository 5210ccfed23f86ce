"""Env server access and request rules (issue 18): the shared token, refusing to serve off loopback without one,
strict ids, JSON-only bodies, size bounds, no API docs, lone surrogates, and task-index errors kept apart from
env failures."""

from __future__ import annotations

import hmac
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from starlette.testclient import TestClient

import envs  # noqa: F401
from envs.client import EnvClient
from envs.errors import EnvBadRequest, EnvServerError, TaskIndexError
from envs.server import MAX_ACTION_CHARS, create_app, is_loopback
from envs.spawn import REPO_ROOT, free_port

JSON = {"Content-Type": "application/json"}


def _code(resp, status, code):
    assert resp.status_code == status, resp.text
    assert resp.json()["code"] == code, resp.text


def test_token_is_required_everywhere_but_health(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    with TestClient(create_app("toy", token="s3cret-token")) as c:
        assert c.get("/health").status_code == 200
        _code(c.post("/create", json={}), 401, "unauthorized")
        _code(c.post("/create", json={}, headers={"Authorization": "Bearer s3cret-tokeN"}), 401, "unauthorized")
        _code(c.post("/create", json={}, headers={"Authorization": "Basic s3cret-token"}), 401, "unauthorized")
        assert "s3cret" not in c.post("/create", json={}).text
        assert c.post("/create", json={}, headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
        assert compared, "the token is compared with hmac.compare_digest (constant time)"
        # the pipeline's client sends it: explicitly, or from SCALINGINTER_ENV_TOKEN
        assert EnvClient(http_client=c, token="s3cret-token").create() >= 0
        monkeypatch.setenv("SCALINGINTER_ENV_TOKEN", "s3cret-token")
        assert EnvClient(http_client=c).create() >= 0
        monkeypatch.delenv("SCALINGINTER_ENV_TOKEN")
        with pytest.raises(EnvBadRequest) as e:
            EnvClient(http_client=c).create()
        assert e.value.status == 401


def test_loopback_detection():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com", ""))


def _server(args, env):
    return subprocess.Popen([sys.executable, "-m", "envs.server", "--env", "toy", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_non_loopback_bind_needs_a_token(monkeypatch, capsys):
    from envs.server import main

    monkeypatch.delenv("SCALINGINTER_ENV_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:  # refused before anything binds
        main(["--env", "toy", "--host", "0.0.0.0", "--port", str(free_port())])
    msg = str(e.value.code)
    assert "\n" not in msg and "token" in msg and "0.0.0.0" in msg and "SCALINGINTER_ENV_TOKEN" in msg

    env = {k: v for k, v in os.environ.items() if k != "SCALINGINTER_ENV_TOKEN"}
    port = free_port()
    p = _server(["--host", "0.0.0.0", "--port", str(port)], {**env, "SCALINGINTER_ENV_TOKEN": "tok-123"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() else "timeout"
            time.sleep(0.2)
        assert httpx.post(url + "/create", json={}).status_code == 401
        assert EnvClient(url, token="tok-123").create() == 0
    finally:
        p.terminate()
        p.wait(10)


@pytest.fixture()
def toy():
    with TestClient(create_app("toy", max_envs=8)) as c:
        yield c


def test_request_rules(toy):
    c = toy
    assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404
    _code(c.post("/create"), 415, "unsupported_media_type")
    _code(c.post("/create", content=b"{}", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type")
    _code(c.post("/create", content=b"", headers=JSON), 400, "malformed_json")
    env_id = c.post("/create", json={}).json()["id"]
    second = c.post("/create", json={}).json()["id"]
    assert second == 1
    # strict ints: true is not env 1, "1_0" is not 10
    _code(c.post("/reset", json={"id": True, "data_idx": 0}), 422, "invalid_request")
    _code(c.post("/reset", json={"id": env_id, "data_idx": "1_0"}), 422, "invalid_request")
    _code(c.get("/observation?id=1_0"), 422, "invalid_request")
    assert c.post("/reset", json={"id": env_id, "data_idx": 0}).status_code == 200
    _code(c.post("/step", json={"id": env_id, "action": "x" * (MAX_ACTION_CHARS + 1)}), 422, "action_too_long")
    big = json.dumps({"id": env_id, "action": "x" * (2 << 20)}).encode()
    _code(c.post("/step", content=big, headers=JSON), 413, "body_too_large")
    # a lone surrogate is an unknown action, explained, not a 500
    r = c.post("/step", content=b'{"id": 0, "action": "Action: open door \\ud800"}', headers=JSON)
    assert r.status_code == 200 and r.json()["info"].get("invalid_action"), r.text


def test_task_index_errors_are_not_env_failures(toy, monkeypatch):
    client = EnvClient(http_client=toy)
    env_id = client.create()
    for bad in (-1, 5_000, 1_000_000 + 10**5, 3_000_000):
        with pytest.raises(TaskIndexError) as e:
            client.reset(env_id, bad)
        assert e.value.status == 400 and e.value.code == "bad_data_idx" and "out of range" in str(e.value)
    # a ValueError from a reset with a valid index is the env's bug: 500, the episode is masked, no text leaks
    from envs.toy import ToyEnv

    def broken(self, data_idx):
        raise ValueError("internal detail /secret/path")

    monkeypatch.setattr(ToyEnv, "reset", broken)
    with pytest.raises(EnvServerError) as e:
        client.reset(env_id, 3)
    assert e.value.status == 500 and e.value.code == "env_error" and "/secret/path" not in str(e.value)
    assert not isinstance(e.value, TaskIndexError)
