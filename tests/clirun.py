"""The ``scalinginter`` command as the end-to-end tests run it: the installed entry point when there is one (else
``python -m flows.cli``), this checkout on PYTHONPATH, and a longer start for Prefect's ephemeral API, whose default
20 s is too short on a busy 2-core machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.sharedapi import own_api_env

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path, timeout: int = 900, popen: bool = False, own_api: bool = False,
        log: Path | None = None):
    """Run ``scalinginter ARGS`` in ``cwd``: the finished process (output captured as text), or with ``popen`` the
    running one, its stdout and stderr written to the file ``log`` (a pipe nobody reads while it runs could fill and
    stall it). The session's shared Prefect API serves it once up (tests/sharedapi.py); ``own_api``: Prefect's
    temporary server of its own, as a user's run starts."""
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]) + list(args)
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **os.environ, "PYTHONPATH": str(ROOT)}
    if own_api:
        env = own_api_env(env)
    if popen:
        if log is None:
            raise ValueError("cli(popen=True) writes the process's output to a file: pass log=")
        with open(log, "w") as f:
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def side_by_side(*commands: tuple[str, ...], cwd: Path, run=cli) -> list[subprocess.CompletedProcess]:
    """``run(*command, cwd=cwd)`` for each command at the same time (independent processes: their start-ups
    overlap); the finished processes in the commands' order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda c: run(*c, cwd=cwd), commands))


def background(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path, request) -> subprocess.Popen:
    """``cmd`` started beside the test, its output to ``log`` (a pipe nobody reads until the end could fill and
    stall it); stopped when the test ends (``request``: the test's pytest request) if it still runs."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    request.addfinalizer(proc.terminate)
    return proc


def finished(proc: subprocess.Popen, log: Path, timeout: int = 900) -> None:
    """Wait for a ``background`` process; it must exit 0 (else the end of its log is the failure message)."""
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-3000:]
