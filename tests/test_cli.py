"""The `scalinginter` console script: bad input gets a clear error; `env serve` serves BabyAI over HTTP."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def cmd():
    exe = Path(sys.executable).with_name("scalinginter")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]


def run(*args, timeout=120):
    return subprocess.run(cmd() + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


@pytest.mark.parametrize("args, needle", [
    (["run", "nosuchenv"], "unknown environment 'nosuchenv'"),
    (["run", "babyai", "--preset", "huge"], "unknown preset 'huge'"),
    (["run", "babyai", "--set", "rollout.temperature=-1"], "rollout.temperature"),
    (["run", "babyai", "--set", "rollout.nope=1"], "rollout.nope"),
    (["run", "babyai", "--set", "justakey"], "key=value"),
    (["eval", "/no/such/ckpt", "babyai"], "not found"),
    (["eval", "smollm2-135m", "babyai", "--split", "dev"], "--split"),
])
def test_bad_input_clear_error(args, needle):
    p = run(*args)
    assert p.returncode != 0
    assert needle in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_print_config_shows_preset():
    p = run("run", "babyai", "--preset", "smoke", "--set", "algo.lr=3e-6", "--print-config")
    assert p.returncode == 0, p.stderr
    cfg = json.loads(p.stdout)
    assert cfg["algo"]["lr"] == 3e-6 and cfg["preset"] == "smoke"


def test_env_serve_babyai():
    from envs.spawn import free_port

    port = free_port()
    proc = subprocess.Popen(cmd() + ["env", "serve", "babyai", "--host", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("server did not come up")
        eid = httpx.post(f"{base}/create", json={}, timeout=10).json()["id"]
        r = httpx.post(f"{base}/reset", json={"id": eid, "data_idx": 0}, timeout=10).json()
        assert "Which action?" in r["observation"] and r["done"] is False and r["instruction"]
        action = r["info"]["available_actions"][0]
        s = httpx.post(f"{base}/step", json={"id": eid, "action": f"I will turn.\nAction: {action}"}, timeout=10)
        body = s.json()
        assert s.status_code == 200 and {"observation", "reward", "done", "terminated", "truncated"} <= body.keys()
        assert body["info"]["valid_action"] is True
        bad = httpx.post(f"{base}/step", json={"id": eid, "action": "Action: fly to the moon"}, timeout=10).json()
        assert bad["info"]["valid_action"] is False and "Which action?" in bad["observation"]
        assert httpx.post(f"{base}/step", json={"id": 999, "action": "x"}, timeout=10).status_code == 404
        assert httpx.post(f"{base}/reset", json={"id": eid, "data_idx": -1}, timeout=10).status_code == 400
        assert httpx.post(f"{base}/close", json={"id": eid}, timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
