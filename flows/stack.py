"""The local stack on 127.0.0.1: Prefect server + a process worker, an MLflow server and, when asked, an S3
endpoint (moto's standalone server). ``scalinginter stack up|down|status|env``.

Everything lives under a stack dir (default ``./.stack``): ``state.json`` (pids, ports, URLs), ``env.sh``
(the variables a shell needs to use the stack), ``logs/<service>.log``, the Prefect home with its sqlite
database, the MLflow store and artifacts. ``down`` stops exactly the processes ``up`` started (by pid,
each in its own process group) and keeps the data, so the next ``up`` sees the same runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
DEFAULT_DIR = ".stack"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "s3": 9000}
S3_BUCKET = "scalinginter"
# moto accepts any credentials; these are placeholders for the local fake S3, not secrets.
S3_FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "local-stack", "AWS_SECRET_ACCESS_KEY": "local-stack"}


class StackError(RuntimeError):
    pass


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def stack_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("SCALINGINTER_STACK_DIR") or DEFAULT_DIR).resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass
class Service:
    name: str
    pid: int
    port: int | None
    url: str | None  # what a user opens (UI / endpoint)
    health: str | None  # URL that answers 2xx when up
    log: str


def _state_path(d: Path) -> Path:
    return d / "state.json"


def read_state(d: Path) -> dict[str, Any] | None:
    p = _state_path(d)
    return json.loads(p.read_text()) if p.exists() else None


def _write_state(d: Path, state: dict[str, Any]) -> None:
    tmp = _state_path(d).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, _state_path(d))


def _spawn(d: Path, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> int:
    log = d / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        fh.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        fh.flush()
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             cwd=str(cwd), start_new_session=True)
    return p.pid


def _wait(name: str, pid: int, check, timeout: float, log: Path) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if check():
            return
        if not pid_alive(pid):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StackError(f"{name} exited during startup; last log lines ({log}):\n{tail}")
        time.sleep(0.5)
    raise StackError(f"{name} did not become ready within {timeout:.0f}s; see {log}")


def stop_pid(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM the process group ``pid`` leads (we started it with a new session), then SIGKILL."""
    if not pid_alive(pid):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        t0 = time.time()
        while time.time() - t0 < timeout:
            if not pid_alive(pid):
                return
            time.sleep(0.2)
    try:  # reap if it is our child
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def base_env(d: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PREFECT_HOME": str(d / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_UI_ENABLED": env.get("PREFECT_UI_ENABLED", "true"),
                "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"})
    env.pop("PREFECT_API_URL", None)
    return env


def client_env(state: dict[str, Any]) -> dict[str, str]:
    """The variables a client (shell, worker, test) sets to use the stack."""
    out = {"PREFECT_API_URL": state["urls"]["prefect_api"], "MLFLOW_TRACKING_URI": state["urls"]["mlflow"]}
    if state["urls"].get("s3"):
        out.update({"AWS_ENDPOINT_URL": state["urls"]["s3"], "AWS_DEFAULT_REGION": "us-east-1",
                    **S3_FAKE_CREDENTIALS})
    return out


def up(directory: str | Path | None = None, *, prefect_port: int | None = None, mlflow_port: int | None = None,
       s3: bool = False, s3_port: int | None = None, pool: str = "local", worker: bool = True,
       deploy: bool = False, workdir: str | Path | None = None, timeout: float = 120.0,
       extra_worker_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start the stack (idempotent: a running stack is left as is). Returns the state dict."""
    d = stack_dir(directory)
    d.mkdir(parents=True, exist_ok=True)
    cwd = Path(workdir or os.getcwd()).resolve()
    old = read_state(d)
    if old and all(pid_alive(s["pid"]) for s in old["services"].values()):
        return old
    if old:
        down(d)
    ports = {"prefect": prefect_port or DEFAULT_PORTS["prefect"], "mlflow": mlflow_port or DEFAULT_PORTS["mlflow"]}
    if s3:
        ports["s3"] = s3_port or DEFAULT_PORTS["s3"]
    busy = [f"{k} port {p}" for k, p in ports.items() if port_in_use(p)]
    if busy:
        raise StackError(f"{', '.join(busy)} already in use on {HOST}: stop what uses it or pass other ports "
                         "(--prefect-port/--mlflow-port/--s3-port)")
    env = base_env(d)
    urls = {"prefect_ui": f"http://{HOST}:{ports['prefect']}", "prefect_api": f"http://{HOST}:{ports['prefect']}/api",
            "mlflow": f"http://{HOST}:{ports['mlflow']}"}
    state: dict[str, Any] = {"dir": str(d), "workdir": str(cwd), "pool": pool, "ports": ports, "urls": urls,
                             "services": {}, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        # Prefect server (its sqlite database lives in the stack's Prefect home)
        pid = _spawn(d, "prefect-server", [_bin("prefect"), "server", "start", "--host", HOST, "--port",
                                           str(ports["prefect"])], env, d)
        state["services"]["prefect-server"] = vars(Service("prefect-server", pid, ports["prefect"], urls["prefect_ui"],
                                                           urls["prefect_api"] + "/health",
                                                           str(d / "logs" / "prefect-server.log")))
        _write_state(d, state)
        # MLflow server (sqlite store + proxied artifacts in the stack dir)
        (d / "mlartifacts").mkdir(exist_ok=True)
        pid = _spawn(d, "mlflow", [_bin("mlflow"), "server", "--host", HOST, "--port", str(ports["mlflow"]),
                                   "--workers", "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
                                   "--artifacts-destination", str(d / "mlartifacts")], env, d)
        state["services"]["mlflow"] = vars(Service("mlflow", pid, ports["mlflow"], urls["mlflow"],
                                                   urls["mlflow"] + "/health", str(d / "logs" / "mlflow.log")))
        _write_state(d, state)
        if s3:
            urls["s3"] = f"http://{HOST}:{ports['s3']}"
            pid = _spawn(d, "s3", [_bin("moto_server"), "-H", HOST, "-p", str(ports["s3"])], env, d)
            state["services"]["s3"] = vars(Service("s3", pid, ports["s3"], urls["s3"], urls["s3"] + "/moto-api/",
                                                   str(d / "logs" / "s3.log")))
            _write_state(d, state)
        for name, svc in state["services"].items():
            _wait(name, svc["pid"], lambda u=svc["health"]: http_ok(u), timeout, Path(svc["log"]))
        cenv = {**env, **client_env(state)}
        if s3:
            _create_bucket(cenv, urls["s3"])
        _run([_bin("prefect"), "--no-prompt", "work-pool", "create", pool, "--type", "process", "--overwrite"],
             cenv, cwd)
        if deploy:
            _run([_bin("prefect"), "--no-prompt", "deploy", "--all"], cenv, cwd, timeout=600)
        if worker:
            wenv = {**cenv, **(extra_worker_env or {})}
            pid = _spawn(d, "worker", [_bin("prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                       "--name", f"local-{os.getpid()}"], wenv, cwd)
            state["services"]["worker"] = vars(Service("worker", pid, None, None, None, str(d / "logs" / "worker.log")))
            _write_state(d, state)
            _wait("worker", pid, lambda: _worker_online(cenv, pool), timeout, d / "logs" / "worker.log")
    except BaseException:
        down(d)
        raise
    _write_state(d, state)
    (d / "env.sh").write_text("".join(f"export {k}={v}\n" for k, v in client_env(state).items()))
    return state


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    env = {**env, "PWD": str(cwd)}  # prefect.yaml's pull step records {{ $PWD }} as the flows' working dir
    p = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise StackError(f"{' '.join(cmd[1:])} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout


def _create_bucket(env: dict[str, str], endpoint: str) -> None:
    import boto3

    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    existing = {b["Name"] for b in c.list_buckets().get("Buckets", [])}
    if S3_BUCKET not in existing:
        c.create_bucket(Bucket=S3_BUCKET)


def _worker_online(env: dict[str, str], pool: str) -> bool:
    req = urllib.request.Request(f"{env['PREFECT_API_URL']}/work_pools/{pool}/workers/filter", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return any(w.get("status") == "ONLINE" for w in json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def down(directory: str | Path | None = None) -> list[str]:
    """Stop the processes recorded in state.json (worker first). Returns the names stopped."""
    d = stack_dir(directory)
    state = read_state(d)
    if not state:
        return []
    order = ["worker", "s3", "mlflow", "prefect-server"]
    names = sorted(state["services"], key=lambda n: order.index(n) if n in order else -1)
    stopped = []
    for name in names:
        pid = state["services"][name]["pid"]
        if pid_alive(pid):
            stop_pid(pid)
            stopped.append(name)
    _state_path(d).unlink(missing_ok=True)
    return stopped


def status(directory: str | Path | None = None) -> list[dict[str, Any]]:
    d = stack_dir(directory)
    state = read_state(d)
    if not state:
        return []
    out = []
    for name, svc in state["services"].items():
        alive = pid_alive(svc["pid"])
        healthy = alive and (http_ok(svc["health"]) if svc.get("health") else True)
        out.append({"service": name, "pid": svc["pid"], "alive": alive, "healthy": healthy, "url": svc.get("url"),
                    "log": svc["log"]})
    return out
