"""Prefect's ephemeral API started early (flows/early_api.py): the flow then runs on that one server, never on a
server not yet up, and nothing starts where an API URL is set or the early start is off."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
from flows.early_api import start_early
thread = start_early()
assert thread is not None and thread.is_alive(), thread  # the server boots while this process goes on
from prefect.server.api.server import SubprocessASGIServer
from prefect import flow

@flow
def one():
    return 1

assert one() == 1  # the client waited for the thread, then used its server
servers = [s for s in SubprocessASGIServer._instances.values() if s.server_process is not None]
assert len(servers) == 1 and servers[0].running and servers[0].server_process.poll() is None, servers
assert not thread.is_alive()
assert start_early() is None  # already up: nothing more
print("OK", servers[0].port)
"""


def _py(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "SCALINGINTER_EARLY_API")}
    e.update(PYTHONPATH=str(ROOT), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=600)


def test_a_flow_runs_on_the_server_started_early():
    p = _py(SCRIPT)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_nothing_starts_with_an_api_url_or_when_turned_off():
    code = "from flows.early_api import start_early; assert start_early() is None; print('OK')"
    for env in ({"PREFECT_API_URL": "http://127.0.0.1:1/api"}, {"SCALINGINTER_EARLY_API": "0"}):
        p = _py(code, **env)
        assert p.returncode == 0 and "OK" in p.stdout, (env, p.stderr[-2000:])
