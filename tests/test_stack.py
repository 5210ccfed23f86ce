"""`scalinginter stack`: state handling and errors (fast), and a real up/status/down of Prefect server +
worker, MLflow server and the moto S3 endpoint on 127.0.0.1 (slow)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import stack as S

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout=300):
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    return subprocess.run(cmd + list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_pid_and_port_helpers():
    assert S.pid_alive(os.getpid()) and not S.pid_alive(None) and not S.pid_alive(0)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not S.pid_alive(p.pid)
    with socket.socket() as s:
        s.bind((S.HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        assert S.port_in_use(port)
    assert not S.port_in_use(S.free_port())
    assert not S.http_ok("http://127.0.0.1:1/nothing", timeout=0.5)


def test_busy_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind((S.HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(S.StackError, match=f"prefect port {port} already in use"):
            S.up(tmp_path / "st", prefect_port=port, mlflow_port=S.free_port())
    assert S.read_state(tmp_path / "st") is None and S.status(tmp_path / "st") == []


def test_stop_pid_kills_the_process_group():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time;"
                          "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);time.sleep(60)"],
                         start_new_session=True)
    time.sleep(1.0)
    kids = [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert kids
    S.stop_pid(p.pid, timeout=5)
    p.wait(timeout=5)
    time.sleep(0.3)
    assert not any(S.pid_alive(k) for k in kids)


def test_down_and_status_without_a_stack(tmp_path):
    assert S.down(tmp_path) == [] and S.status(tmp_path) == []
    p = cli("stack", "status", "--dir", str(tmp_path))
    assert p.returncode == 1 and "no stack" in p.stdout
    p = cli("stack", "down", "--dir", str(tmp_path))
    assert p.returncode == 0 and "nothing was running" in p.stdout


def test_client_env():
    st = {"urls": {"prefect_api": "http://127.0.0.1:1/api", "mlflow": "http://127.0.0.1:2", "s3": "http://127.0.0.1:3"}}
    env = S.client_env(st)
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:1/api" and env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:2"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:3"
    del st["urls"]["s3"]
    assert "AWS_ENDPOINT_URL" not in S.client_env(st)


@pytest.mark.slow
def test_stack_up_status_down(tmp_path):
    d = tmp_path / "stack"
    ports = [S.free_port() for _ in range(3)]
    p = cli("stack", "up", "--dir", str(d), "--s3", "--prefect-port", str(ports[0]), "--mlflow-port", str(ports[1]),
            "--s3-port", str(ports[2]))
    try:
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert f"Prefect UI:   http://127.0.0.1:{ports[0]}" in p.stdout
        assert f"MLflow UI:    http://127.0.0.1:{ports[1]}" in p.stdout
        assert f"S3 endpoint:  http://127.0.0.1:{ports[2]}" in p.stdout
        state = json.loads((d / "state.json").read_text())
        assert set(state["services"]) == {"prefect-server", "mlflow", "s3", "worker"}
        env_sh = (d / "env.sh").read_text()
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[0]}/api" in env_sh
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports[1]}" in env_sh
        st = cli("stack", "status", "--dir", str(d))
        assert st.returncode == 0 and st.stdout.count(" up ") == 4, st.stdout
        # the pool exists and the worker polls it; the S3 endpoint has the bucket
        assert S._worker_online(S.client_env(state), "local")
        import boto3

        s3 = boto3.client("s3", endpoint_url=state["urls"]["s3"], region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")
        assert "scalinginter" in [b["Name"] for b in s3.list_buckets()["Buckets"]]
        # up again is a no-op on a running stack
        again = cli("stack", "up", "--dir", str(d), "--s3", "--prefect-port", str(ports[0]))
        assert again.returncode == 0 and json.loads((d / "state.json").read_text())["services"] == state["services"]
    finally:
        down = cli("stack", "down", "--dir", str(d))
    assert down.returncode == 0 and "worker" in down.stdout and "prefect-server" in down.stdout
    assert not any(S.pid_alive(s["pid"]) for s in state["services"].values())
    assert not any(S.port_in_use(port) for port in ports)
    assert cli("stack", "status", "--dir", str(d)).returncode == 1
    assert (d / "logs" / "prefect-server.log").exists() and (d / "mlflow.db").exists()


def test_gpu_work_pool_templates_are_wired():
    """infra/workpools/*.json are Prefect base job templates whose GPU settings come from declared variables."""
    import re

    for name, needle in (("kubernetes-gpu.json", "nvidia.com/gpu"), ("docker-gpu.json", "device_requests")):
        t = json.loads((ROOT / "infra" / "workpools" / name).read_text())
        assert set(t) == {"job_configuration", "variables"}
        text = json.dumps(t["job_configuration"])
        assert needle in text and "{{ gpu_count }}" in text and "{{ shm_size }}" in text
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text))
        declared = set(t["variables"]["properties"])
        assert used <= declared, used - declared
        assert not re.search(r"AWS_SECRET|aws_secret", text)  # credentials never in a template
